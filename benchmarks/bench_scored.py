"""Benchmark: scored tokens only (``make_forward``'s default) against scoring every token, one RL training step
(forward + backward of a log-prob and entropy loss over the response) of a Qwen3-1.7B-shaped model.

The model: Qwen3-1.7B's shape (hidden 2048, 16 heads, 8 KV heads of 128, MLP 6144, a tied 151,936-token vocabulary)
with ``--layers`` layers (default 28, the model's own; random bf16 weights, packfwd's ``build_model``).  The batch
(fixed seed): ``--batch`` rows of up to ``--seq`` tokens, each sequence half prompt (left-padded, before column
``seq // 2``) and half response (right-padded after it), so 50 % of the real tokens are prompt tokens whose
labels are ignored (-100); the loss mask is the response's.  The loss: ``-sum(log_prob * w) + 0.01 * sum(entropy
* w)`` over the loss tokens (``w`` = 1 / their count), the same in every row.

Rows, each ``make_forward("thd", logits_processor=log_probs_and_entropy, head=...)`` on the same model and batch:

* ``<head>_every``: ``scored_only=False``, the forward as it was before (every token through the vocab projection
  and the log-softmax), called ``forward(model, ids, mask, labels=labels)``;
* ``<head>_scored``: the default (``scored_only=True``), the same call: the forward reads the scored count back
  once while planning (the plan reads the lengths back anyway);
* ``<head>_scored_no_sync``: the default with ``seqlens=`` and ``scored_tokens=`` (host ints, as
  ``run_micro_batches`` passes them): no host sync at all.

Both heads: ``logits`` (the default: Megatron's output layer, here on the scored rows only) and ``fused``.  Timed:
CUDA events around the whole step from an idle device, median of ``--runs`` after ``--warmup``; peak memory per
row; the ratio of each scored row to its head's ``_every`` row, in the same run.  Checked: the scored rows' log-probs
equal the ``_every`` row's at the loss tokens (bf16 rounding) and are 0 elsewhere.

    PYTHONPATH=. python benchmarks/bench_scored.py --out benchmarks/out/scored.json
    python benchmarks/bench_scored.py --smoke --out /tmp/scored_smoke.json      # tiny model on the CPU (CI)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))
from common import device_ms, environment, table, write_json  # noqa: E402

from packfwd.forward import make_forward  # noqa: E402
from packfwd.logits import log_probs_and_entropy  # noqa: E402
from packfwd.models import ModelArgs, build_model  # noqa: E402

QWEN3_1P7B = dict(vocab_size=151936, hidden_size=2048, ffn_hidden_size=6144, num_layers=28, num_attention_heads=16,
                  num_query_groups=8, head_dim=128, qk_norm=True, tie_embeddings=True, rope_theta=1000000.0,
                  norm_eps=1e-6, max_position_embeddings=40960, family="qwen3")
SMOKE = dict(QWEN3_1P7B, vocab_size=512, hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4,
             num_query_groups=2, head_dim=16)
MODES = ("every", "scored", "scored_no_sync")


def model_args(fields: dict) -> ModelArgs:
    return ModelArgs(**fields)


def rl_batch(b: int, s: int, vocab: int, seed: int, device):
    """Half-prompt, half-response rows: prompts left-padded before column s // 2, responses right-padded after."""
    g = torch.Generator().manual_seed(seed)
    half = s // 2
    n = torch.randint(half // 4, half + 1, (b,), generator=g)  # each sequence: n prompt + n response tokens
    col = torch.arange(s)[None, :]
    mask = (col >= half - n[:, None]) & (col < half + n[:, None])
    ids = torch.randint(1, vocab, (b, s), generator=g) * mask
    loss_mask = torch.zeros_like(mask)
    loss_mask[:, half - 1 : -1] = mask[:, half:]  # token i is scored on predicting token i + 1, a response token
    labels = torch.where(loss_mask, torch.roll(ids, -1, dims=1), -100)
    return dict(ids=ids.to(device), mask=mask.to(device), labels=labels.to(device), loss_mask=loss_mask.to(device),
                lengths=(2 * n).tolist(), n_loss=int(loss_mask.sum()), tokens=int(mask.sum()))


def make_step(model, batch, head: str, mode: str):
    forward = make_forward("thd", logits_processor=log_probs_and_entropy, head=head, scored_only=mode != "every")
    extra = dict(seqlens=batch["lengths"], scored_tokens=batch["n_loss"]) if mode == "scored_no_sync" else {}
    w = batch["loss_mask"].float() / batch["n_loss"]

    def step():
        model.zero_grad(set_to_none=True)
        out = forward(model, batch["ids"], batch["mask"], labels=batch["labels"], **extra)
        loss = -(out["log_probs"] * w).sum() + 0.01 * (out["entropy"] * w).sum()
        loss.backward()
        return out["log_probs"].detach()

    return step


def run(args) -> dict:
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    fields = dict(SMOKE if args.smoke else QWEN3_1P7B)
    if args.layers is not None:
        fields["num_layers"] = args.layers
    torch.manual_seed(0)
    model = build_model(model_args(fields), device=device, params_dtype=dtype)
    batch = rl_batch(args.batch, args.seq, fields["vocab_size"], args.seed, device)
    rows, reference = [], {}
    for head in args.heads:
        for mode in MODES:
            step = make_step(model, batch, head, mode)
            for _ in range(args.warmup):
                lp = step()
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            ms = statistics.median(device_ms(step, device) for _ in range(args.runs))
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
            lp = step()
            keep = batch["loss_mask"]
            if mode == "every":
                reference[head] = lp
            else:
                diff = (lp[keep].float() - reference[head][keep].float()).abs().max().item()
                zero = not lp[~keep].any().item()
                if diff > (1e-4 if args.smoke else 0.1) or not zero:
                    raise SystemExit(f"{head}_{mode}: log-probs differ from every token's by {diff} at the loss "
                                     f"tokens (zero elsewhere: {zero})")
            every = next((r["ms"] for r in rows if r["row"] == f"{head}_every"), ms)
            rows.append({"row": f"{head}_{mode}", "ms": round(ms, 2), "vs_every": round(every / ms, 3),
                         "peak_GiB": None if peak is None else round(peak, 2)})
            print(table(rows[-1:], ["row", "ms", "vs_every", "peak_GiB"]), flush=True)
            del step
    return dict(benchmark="scored", environment=environment(), model=fields, batch=dict(
        rows=args.batch, seq=args.seq, real_tokens=batch["tokens"], loss_tokens=batch["n_loss"],
        prompt_share=round(1 - batch["n_loss"] / batch["tokens"], 3)), runs=args.runs, warmup=args.warmup,
        results=rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (CI): seconds")
    ap.add_argument("--out", type=Path, default=HERE / "out" / "scored.json", help="JSON file to write")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: 28, the model's; smoke 2)")
    ap.add_argument("--batch", type=int, default=None, help="rows (default 8; smoke 3)")
    ap.add_argument("--seq", type=int, default=None, help="padded width (default 4096; smoke 32)")
    ap.add_argument("--heads", nargs="+", choices=("logits", "fused"), default=["logits", "fused"])
    ap.add_argument("--runs", type=int, default=None, help="timed steps per row (default 5; smoke 1)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2; smoke 1)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.batch = args.batch or (3 if args.smoke else 8)
    args.seq = args.seq or (32 if args.smoke else 4096)
    args.runs = args.runs or (1 if args.smoke else 5)
    args.warmup = args.warmup or (1 if args.smoke else 2)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_scored needs a CUDA GPU (or --smoke)")
    result = run(args)
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
