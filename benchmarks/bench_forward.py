"""Benchmark: the packed (THD) forward of a ~1B Llama-style model against the padded forward users run today.

* ``padded``: the model on the whole padded batch ``[b, s]`` (every row full width, causal attention over it:
  real tokens first, so their results are exact).  It computes all ``b * s`` tokens whatever the fill.
* ``thd``: ``make_forward("thd")(model, ids, mask, seqlens=...)``: plan (host lengths: no sync), pack, the model
  on the real tokens only (varlen attention per sequence), unpack the logits to ``[b, s, v]``.
* ``bshd`` (for reference): ``make_forward("bshd")``: real tokens moved left, rows cut to the longest one.

At fills 25, 50 and 75 percent (each run draws fresh row lengths uniform in ``fill * s +- w/2`` with
``w = min(2 fill, 2 - 2 fill) * s``, and fresh token ids), forward only (``fwd``, under no_grad, as for
log-probs) and forward + backward (``fwd+bwd``, the backward from a random ``[b, s, v]`` gradient).

Reported per fill and pass: tokens/s (padded: all ``b * s`` tokens; THD: real tokens), the achieved speedup
``t_padded / t_thd``, the ideal speedup ``b * s / real tokens``, their ratio (target >= 0.9), the FLOP-ideal
speedup, and achieved TFLOP/s next to a bf16 matmul ceiling measured in the same run.  FLOPs: linear layers
``2 * P * tokens`` (``P``: every weight matrix but the embedding), causal attention ``4 * h_q * sum(l_i^2) / 2``
per layer (padded: ``l_i = s``); ``fwd+bwd`` = 3 x forward.

Timing: CUDA events around each call (planning and host work included), warm-up first, median of ``--runs``.
A correctness check per fill compares THD and padded logits on the real tokens.

    PYTHONPATH=. python3 benchmarks/bench_forward.py --out benchmarks/out/forward.json
    python benchmarks/bench_forward.py --smoke --out /tmp/forward_smoke.json     # tiny model on the CPU (CI)

``--megatron-rope`` runs the THD rows with Megatron-Core's own THD RoPE (per sequence, 4 host syncs per layer)
instead of packfwd's :class:`~packfwd.models.mixers.rope.PackedRope`, to measure what that costs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))
from common import environment, skip_reason, table, write_json  # noqa: E402

from packfwd.forward import make_forward  # noqa: E402
from packfwd.models import ModelArgs, build_model  # noqa: E402

FULL = ModelArgs(vocab_size=32000, hidden_size=2048, ffn_hidden_size=7168, num_layers=16, num_attention_heads=16,
                 num_query_groups=8, max_position_embeddings=8192)
SMOKE = ModelArgs(vocab_size=128, hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4,
                  num_query_groups=2)
PASSES = ("fwd", "fwd+bwd")
TARGET = 0.9


# ------------------------------------------------------------------------------------------------ counting


def linear_params(args: ModelArgs) -> int:
    """Weights of every matrix product per token: attention (qkv, proj), MLP (fc1 gate+up, fc2), output layer."""
    h, d = args.hidden_size, args.kv_channels
    q, kv = args.num_attention_heads * d, args.query_groups * d
    per_layer = h * (q + 2 * kv) + q * h + h * 2 * args.ffn_hidden_size + args.ffn_hidden_size * h
    return args.num_layers * per_layer + args.hidden_size * args.vocab_size


def total_params(args: ModelArgs) -> int:
    embed = args.vocab_size * args.hidden_size
    norms = args.num_layers * 2 * args.hidden_size + args.hidden_size
    return linear_params(args) + embed + norms


def forward_flops(args: ModelArgs, lengths) -> float:
    """Forward FLOPs of sequences of the given lengths (linear layers + causal attention)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    q = args.num_attention_heads * args.kv_channels
    linear = 2.0 * linear_params(args) * lengths.sum()
    attention = args.num_layers * 4.0 * q * (lengths**2).sum() / 2
    return linear + attention


# ------------------------------------------------------------------------------------------------ inputs


def draw_lengths(rng: np.random.Generator, b: int, s: int, fill: float) -> list[int]:
    w = min(2 * fill, 2 - 2 * fill) * s
    lo, hi = max(1, round(fill * s - w / 2)), min(s, round(fill * s + w / 2))
    return rng.integers(lo, hi + 1, size=b).tolist()


def batch(rng, b, s, fill, vocab, device):
    lengths = draw_lengths(rng, b, s, fill)
    ids = torch.randint(1, vocab, (b, s), device=device)
    mask = torch.arange(s, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    return lengths, ids, mask


# ------------------------------------------------------------------------------------------------ timing


class Timer:
    """Elapsed milliseconds of one call: CUDA events on the GPU (from an idle device), host clock on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def matmul_tflops(device, dtype, timer, n=8192, runs=10) -> float | None:
    if device.type != "cuda":
        return None
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    ms = statistics.median(timer(lambda: a @ b) for _ in range(runs))
    return 2 * n**3 / (ms * 1e-3) / 1e12


def make_step(variant, model, pass_, grad):
    """A closure running one variant on one batch: returns the [b, s, v] logits (forward) or None."""
    thd, bshd = make_forward("thd"), make_forward("bshd")

    def logits(lengths, ids, mask):
        if variant == "padded":
            b, s = ids.shape
            positions = torch.arange(s, device=ids.device).expand(b, s)
            return model(input_ids=ids, position_ids=positions, attention_mask=None)
        fwd = thd if variant == "thd" else bshd
        return fwd(model, ids, mask, seqlens=lengths)

    def step(lengths, ids, mask):
        if pass_ == "fwd":
            with torch.no_grad():
                return logits(lengths, ids, mask)
        out = logits(lengths, ids, mask)
        out.backward(grad)
        return None

    return step


def run_variant(variant, model, pass_, grad, cfg, rng, timer):
    """Times (ms) and row lengths of the timed runs, each on a fresh batch."""
    step = make_step(variant, model, pass_, grad)
    times, runs = [], []
    for i in range(cfg.warmup + cfg.runs):
        lengths, ids, mask = batch(rng, cfg.batch, cfg.seq, cfg.fill_now, cfg.vocab, cfg.device)
        ms = timer(lambda: step(lengths, ids, mask))
        model.zero_grad(set_to_none=True)
        if i >= cfg.warmup:
            times.append(ms)
            runs.append(lengths)
    return times, runs


def check(model, cfg, rng) -> float:
    """Relative L2 difference of the THD and padded logits over the real tokens (one fresh batch)."""
    lengths, ids, mask = batch(rng, cfg.batch, cfg.seq, cfg.fill_now, cfg.vocab, cfg.device)
    with torch.no_grad():
        padded = make_step("padded", model, "fwd", None)(lengths, ids, mask)
        packed = make_step("thd", model, "fwd", None)(lengths, ids, mask)
        if packed[~mask].any():
            raise AssertionError("the THD forward left non-zero logits at padding")
        a, b = packed[mask].float(), padded[mask].float()
        return float((a - b).norm() / b.norm())


# ------------------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (CI): seconds")
    ap.add_argument("--out", type=Path, default=HERE / "out" / "forward.json", help="JSON file to write")
    ap.add_argument("--batch", type=int, default=None, help="rows b (default 8; smoke 4)")
    ap.add_argument("--seq", type=int, default=None, help="padded width s (default 4096; smoke 32)")
    ap.add_argument("--fills", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    ap.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    ap.add_argument("--runs", type=int, default=None, help="timed runs per point (default 7; smoke 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 2; smoke 1)")
    ap.add_argument("--no-bshd", action="store_true", help="skip the compacted-BSHD reference rows")
    ap.add_argument("--megatron-rope", action="store_true",
                    help="THD with Megatron-Core's own THD RoPE (host syncs, per-sequence) instead of packfwd's")
    cfg = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not cfg.smoke
    cfg.device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    args = SMOKE if cfg.smoke else FULL
    cfg.batch = cfg.batch or (4 if cfg.smoke else 8)
    cfg.seq = cfg.seq or (32 if cfg.smoke else 4096)
    cfg.runs = cfg.runs or (2 if cfg.smoke else 7)
    cfg.warmup = cfg.warmup if cfg.warmup is not None else (1 if cfg.smoke else 2)
    cfg.vocab = args.vocab_size
    rng = np.random.default_rng(0)
    timer = Timer(cfg.device)

    torch.manual_seed(0)
    t0 = time.perf_counter()
    # --megatron-rope: Megatron-Core applies RoPE to THD batches itself (a construction choice, for comparison)
    model = build_model(args, device=cfg.device, params_dtype=dtype, packed_rope=not cfg.megatron_rope)
    build_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    b, s = cfg.batch, cfg.seq
    ceiling = matmul_tflops(cfg.device, dtype, timer)
    print(f"model: {n_params / 1e9:.3f} B parameters ({dtype}, built in {build_s:.1f} s); b={b}, s={s}; "
          f"bf16 matmul ceiling: {ceiling and round(ceiling)} TFLOP/s", flush=True)

    padded_fwd = forward_flops(args, [s] * b)
    rows, padded = [], {}
    for pass_ in cfg.passes:
        try:
            grad = None
            if pass_ == "fwd+bwd":
                grad = torch.randn(b, s, args.vocab_size, device=cfg.device, dtype=dtype)
            mult = 3.0 if pass_ == "fwd+bwd" else 1.0
            cfg.fill_now = 1.0
            times, _ = run_variant("padded", model, pass_, grad, cfg, rng, timer)
            t_pad = statistics.median(times)
            padded[pass_] = {"ms": t_pad, "ms_runs": times, "tokens_per_s": b * s / t_pad * 1e3,
                             "TFLOP/s": mult * padded_fwd / (t_pad * 1e-3) / 1e12}
            for fill in cfg.fills:
                cfg.fill_now = fill
                err = check(model, cfg, rng) if pass_ == "fwd" else None
                t_thd, lens = run_variant("thd", model, pass_, grad, cfg, rng, timer)
                tok = [sum(x) for x in lens]
                flops = [forward_flops(args, x) for x in lens]
                ratios = [(r / t) / (b * s / t_pad) for r, t in zip(tok, t_thd)]
                ms = statistics.median(t_thd)
                real = statistics.median(tok)
                row = {
                    "pass": pass_, "fill": fill, "real_fill": real / (b * s),
                    "padded_ms": t_pad, "thd_ms": ms, "thd_ms_runs": t_thd, "real_tokens_runs": tok,
                    "padded_tok/s": b * s / t_pad * 1e3,
                    "thd_tok/s": statistics.median(r / t * 1e3 for r, t in zip(tok, t_thd)),
                    "speedup": t_pad / ms, "ideal": b * s / real,
                    "flop_ideal": padded_fwd / statistics.median(flops),
                    "ratio": statistics.median(ratios), "target": TARGET,
                    "thd_TFLOP/s": statistics.median(mult * f / (t * 1e-3) / 1e12 for f, t in zip(flops, t_thd)),
                    "padded_TFLOP/s": padded[pass_]["TFLOP/s"], "rel_err": err,
                }
                row["meets_target"] = row["ratio"] >= TARGET
                if not cfg.no_bshd:
                    t_bshd, _ = run_variant("bshd", model, pass_, grad, cfg, rng, timer)
                    row["bshd_ms"] = statistics.median(t_bshd)
                    row["bshd_speedup"] = t_pad / row["bshd_ms"]
                rows.append(row)
                print(f"  {pass_} fill {fill}: padded {t_pad:.1f} ms, thd {ms:.1f} ms, speedup {row['speedup']:.2f} "
                      f"of ideal {row['ideal']:.2f} -> ratio {row['ratio']:.3f}", flush=True)
            del grad
        except torch.cuda.OutOfMemoryError as e:  # this pass is recorded as skipped; the next one runs
            padded[pass_] = {"skipped": skip_reason(e)}
            print(f"  {pass_}: {padded[pass_]['skipped']}", flush=True)

    payload = {
        "benchmark": "forward", "smoke": cfg.smoke, "command": " ".join(sys.argv), "env": environment(),
        "thd_rope": "megatron" if cfg.megatron_rope else "packfwd",
        "model": {**{k: getattr(args, k) for k in ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers",
                                                  "num_attention_heads", "num_query_groups")},
                  "parameters": n_params, "linear_parameters": linear_params(args), "dtype": str(dtype)},
        "batch": b, "seq": s, "runs": cfg.runs, "warmup": cfg.warmup,
        "matmul_ceiling_TFLOP/s": ceiling, "padded": padded, "results": rows, "target_ratio": TARGET,
    }
    write_json(cfg.out, payload)
    cols = ["pass", "fill", "real_fill", "padded_ms", "thd_ms", "speedup", "ideal", "ratio", "flop_ideal",
            "padded_TFLOP/s", "thd_TFLOP/s", "bshd_speedup", "rel_err"]
    print(table(rows, cols))
    print(f"wrote {cfg.out}")
    if cfg.smoke and any(r["rel_err"] is not None and r["rel_err"] > 1e-4 for r in rows):
        print("THD and padded logits disagree", file=sys.stderr)
        return 1
    if not cfg.smoke and any(r["rel_err"] is not None and r["rel_err"] > 5e-2 for r in rows):
        print("THD and padded logits disagree beyond bf16 rounding", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
