"""``make demo``: packfwd's layouts, then a tiny Llama run on a ragged batch padded, packed (THD) and
compacted (BSHD), with the agreement of the logits, the tokens each form computes, and the times.

Everything is local: the Llama is built from a config with random weights (no downloads).
"""

from __future__ import annotations

import time
import warnings

import torch

LENGTHS = (300, 41, 17, 120, 5, 260, 64, 9)  # a ragged batch; padded to the longest
SEQ_LEN = 320


def ragged_batch(lengths=LENGTHS, seq_len=SEQ_LEN, vocab=128, seed=0):
    """ids [b, seq_len] and a mask: even rows right-padded, odd rows left-padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(lengths), seq_len), generator=g)
    mask = torch.zeros(len(lengths), seq_len, dtype=torch.bool)
    for i, n in enumerate(lengths):
        if i % 2:
            mask[i, seq_len - n :] = True
        else:
            mask[i, :n] = True
    return ids.masked_fill(~mask, 0), mask


def _timed(fn, repeats=5):
    """``fn()`` and its best wall time over ``repeats`` runs after a warm-up (best-of: the least noisy)."""
    out = fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return out, best


def model_demo() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from .bshd import plan_bshd
    from .forward import make_forward
    from .models import from_hf
    from .thd import plan_thd

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=SEQ_LEN)
    hf = LlamaForCausalLM(config).eval()
    model = from_hf(hf)
    ids, mask = ragged_batch()
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    b, s = ids.shape
    print(f"\n== a tiny Llama (hidden 64, 2 layers, 4 query / 2 kv heads) on {b} sequences, lengths {list(LENGTHS)} ==")
    print("padded: HF transformers with the attention mask; THD / BSHD: packfwd's Megatron-Core model")
    with torch.no_grad():
        padded, t_pad = _timed(lambda: hf(ids, attention_mask=mask.long(), position_ids=positions).logits)
        thd, t_thd = _timed(lambda: make_forward("thd")(model, ids, mask))
        bshd, t_bshd = _timed(lambda: make_forward("bshd")(model, ids, mask))
    rows = [
        ("padded", b * s, None, t_pad),
        ("THD", plan_thd(mask).local_tokens, (thd - padded)[mask].abs().max().item(), t_thd),
        ("BSHD", b * plan_bshd(mask).width, (bshd - padded)[mask].abs().max().item(), t_bshd),
    ]
    print(f"{'form':<8}{'tokens computed':>16}{'max |diff| vs padded':>22}{'best of 5':>11}")
    for name, tokens, diff, seconds in rows:
        shown = "-" if diff is None else f"{diff:.2e}"
        print(f"{name:<8}{tokens:>16}{shown:>22}{seconds * 1e3:>9.1f}ms")
    print(f"real tokens: {int(mask.sum())}")
    worst = max(r[2] for r in rows[1:])
    if worst > 1e-4:
        raise SystemExit(f"packed logits disagree with the padded model (max |diff| {worst:.2e})")


def main() -> None:
    warnings.filterwarnings("ignore")  # Megatron-Core warns about optional extensions at import
    from .demo_layouts import print_layout_demo

    print_layout_demo()
    model_demo()


if __name__ == "__main__":
    main()
