"""``make demo`` (``python -m packfwd.viz.demo``): packfwd's layouts as text, then a small Llama run on a ragged
batch padded, packed (THD) and compacted (BSHD), with the agreement of the logits, the tokens each form computes,
and the times.

Everything is local: the Llama is built from a config with random weights (no downloads).  It is sized so that
its matrix work, the part packing shrinks, outweighs the per-call overheads: with a hidden size of 64 the three
forms took about the same time although THD computes a third of the tokens.  On a CUDA GPU the forwards run
there and are timed with CUDA events; on the CPU with the wall clock.
"""

from __future__ import annotations

import time
import warnings
from typing import Callable, Sequence

import torch

from packfwd import from_thd, layer_partition, make_forward, plan_bshd, plan_thd, to_thd

from .text import describe_thd, lengths_mask, padding_overhead

LAYOUT_LENGTHS = (5, 17, 3, 9)  # small enough to print token by token
LENGTHS = (300, 41, 17, 120, 5, 260, 64, 9)  # the model's ragged batch; padded to SEQ_LEN
SEQ_LEN = 320
# 4 layers of hidden 384: about 0.35 s for the padded forward on two CPU cores, so the demo's model time
# (a warm-up and 3 timed runs of each form) stays near 3 s, and the matrix work dominates every form.
MODEL = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6,
             num_key_value_heads=2, vocab_size=128)
# On a GPU that model is bound by kernel launches (about 4 ms whatever the token count); 8 layers of hidden 2048
# (about 50 ms padded on an H200, in float32) make the matrix work count again.
MODEL_CUDA = dict(MODEL, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4)


def layout_demo(lengths: Sequence[int] = LAYOUT_LENGTHS, tp: int = 2, cp: int = 2) -> str:
    """The layout half of the demo: a ragged batch's THD layout per CP rank, padding overheads against verl's
    alignment, a pipeline layer partition, and a checked round trip through :func:`packfwd.to_thd`.

    >>> print(layout_demo())  # doctest: +ELLIPSIS
    == THD layout of a ragged batch, lengths [5, 17, 3, 9], tp=2, cp=2 ==
    cu_seqlens         [0, 5, 22, 25, 34]
    ...
    round trip from_thd(all ranks of to_thd(x)) == x * mask: True
    """
    lines = [f"== THD layout of a ragged batch, lengths {list(lengths)}, tp={tp}, cp={cp} =="]
    lines.append(describe_thd(lengths, tp_size=tp, cp_size=cp))
    lines.append("\n== padding overhead: packfwd's default alignment vs verl's (2*tp*cp, or tp without CP) ==")
    lines.append(f"{'tp':>3} {'cp':>3} {'real':>6} {'packfwd':>8} {'verl':>6}")
    for t, c in [(1, 1), (2, 1), (8, 1), (2, 2), (4, 2), (8, 4)]:
        o = padding_overhead(lengths, tp_size=t, cp_size=c)
        lines.append(f"{t:>3} {c:>3} {o['real']:>6} {o['packfwd']:>8} {o['verl']:>6}")
    lines.append("\n== layer partition of a 32-layer model, pp=4, vpp=2 (global layer indices) ==")
    for rank, stages in enumerate(layer_partition(32, 4, 2)):
        lines.append(f"pp rank {rank}: " + "  ".join(f"vpp {v}: {r.start}-{r.stop - 1}" for v, r in enumerate(stages)))
    mask = lengths_mask(lengths)
    x = torch.randn(*mask.shape, 8)
    outs, infos = zip(*(to_thd(x, mask, tp_size=tp, cp_size=cp, cp_rank=r) for r in range(cp)))
    exact = torch.equal(from_thd(list(outs), infos[0]), x * mask[..., None])
    lines.append(f"\nround trip from_thd(all ranks of to_thd(x)) == x * mask: {exact}")
    if not exact:
        raise SystemExit("round trip failed")
    return "\n".join(lines)


def ragged_batch(lengths: Sequence[int] = LENGTHS, seq_len: int = SEQ_LEN, vocab: int = 128, seed: int = 0):
    """``ids [b, seq_len]`` (0 at padding) and a bool mask: even rows right-padded, odd rows left-padded.

    >>> ids, mask = ragged_batch([2, 1], seq_len=3)
    >>> mask.int().tolist(), bool((ids[~mask] == 0).all())
    ([[1, 1, 0], [0, 0, 1]], True)
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(lengths), seq_len), generator=g)
    mask = torch.zeros(len(lengths), seq_len, dtype=torch.bool)
    for i, n in enumerate(lengths):
        if i % 2:
            mask[i, seq_len - n :] = True
        else:
            mask[i, :n] = True
    return ids.masked_fill(~mask, 0), mask


def _best_time(fn: Callable[[], torch.Tensor], repeats: int, device: torch.device):
    """``fn()`` and its best time in seconds over ``repeats`` runs after a warm-up (best-of: the least noisy).
    CUDA events on a GPU (no host sync inside the timed region but the one that reads the events)."""
    out = fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
    return out, best


def model_demo(
    lengths: Sequence[int] = LENGTHS, seq_len: int = SEQ_LEN, *, repeats: int | None = None, device=None, **config
) -> str:
    """Run a random Llama (``MODEL``, or ``MODEL_CUDA`` on a GPU, updated by ``config``) on :func:`ragged_batch`:
    HF transformers on the padded batch, packfwd's Megatron-Core model on THD and BSHD; returns the table of
    tokens computed, max |diff| of the logits against the padded ones, and best times over ``repeats`` runs
    (default 3 on the CPU, 10 on a GPU).  ``device``: default CUDA when present.

    >>> print(model_demo([5, 2], seq_len=6, repeats=1, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                  num_attention_heads=4, device="cpu"))  # doctest: +ELLIPSIS
    == a small Llama (hidden 32, 1 layers, 4 query / 2 kv heads) on 2 sequences, lengths [5, 2] ==
    padded: HF transformers with the attention mask; THD / BSHD: packfwd's Megatron-Core model
    form     tokens computed  max |diff| vs padded   best of 1  speed-up
    padded                12                     -  ...ms     1.00x
    THD                    7  ...
    BSHD                  10  ...
    real tokens: 7, timed on cpu (wall clock, ... threads)
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from packfwd.models import from_hf

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_cuda = device.type == "cuda"
    cfg = {**(MODEL_CUDA if on_cuda else MODEL), **config}
    repeats = repeats or (10 if on_cuda else 3)
    torch.manual_seed(0)
    with device:  # initialise the weights where they will run
        hf = LlamaForCausalLM(LlamaConfig(**cfg, max_position_embeddings=seq_len)).eval()
    model = from_hf(hf)
    ids, mask = (t.to(device) for t in ragged_batch(lengths, seq_len, vocab=cfg["vocab_size"]))
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    seqlens = list(lengths)  # known on the host: the packed forwards plan without a device sync
    thd_forward, bshd_forward = make_forward("thd"), make_forward("bshd")
    with torch.no_grad():
        padded, t_pad = _best_time(lambda: hf(ids, attention_mask=mask.long(), position_ids=positions).logits,
                                   repeats, device)
        thd, t_thd = _best_time(lambda: thd_forward(model, ids, mask, seqlens=seqlens), repeats, device)
        bshd, t_bshd = _best_time(lambda: bshd_forward(model, ids, mask, seqlens=seqlens), repeats, device)
    rows = [
        ("padded", ids.numel(), None, t_pad),
        ("THD", plan_thd(mask, seqlens=seqlens).local_tokens, (thd - padded)[mask].abs().max().item(), t_thd),
        ("BSHD", len(lengths) * plan_bshd(mask, seqlens=seqlens).width, (bshd - padded)[mask].abs().max().item(),
         t_bshd),
    ]
    clock = (f"CUDA events on {torch.cuda.get_device_name(device)}" if on_cuda
             else f"wall clock, {torch.get_num_threads()} threads")
    lines = [
        f"== a small Llama (hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
        f"{cfg['num_attention_heads']} query / {cfg['num_key_value_heads']} kv heads) on {len(lengths)} sequences, "
        f"lengths {list(lengths)} ==",
        "padded: HF transformers with the attention mask; THD / BSHD: packfwd's Megatron-Core model",
        *_table(rows, repeats),
        f"real tokens: {int(mask.sum())}, timed on {device.type} ({clock})",
    ]
    worst = max(r[2] for r in rows[1:])
    if worst > 1e-4:
        raise SystemExit(f"packed logits disagree with the padded model (max |diff| {worst:.2e})")
    return "\n".join(lines)


def _table(rows, repeats: int) -> list[str]:
    """Lines of the timing table; ``rows``: ``(form, tokens computed, max |diff| or None, seconds)``, padded first."""
    head = f"{'form':<8}{'tokens computed':>16}{'max |diff| vs padded':>22}{f'best of {repeats}':>12}{'speed-up':>10}"
    lines = [head]
    for name, tokens, diff, seconds in rows:
        shown = "-" if diff is None else f"{diff:.2e}"
        lines.append(f"{name:<8}{tokens:>16}{shown:>22}{seconds * 1e3:>10.1f}ms{rows[0][3] / seconds:>9.2f}x")
    return lines


if __name__ == "__main__":
    warnings.filterwarnings("ignore")  # Megatron-Core warns about optional extensions at import
    print(layout_demo())
    print()
    print(model_demo())
