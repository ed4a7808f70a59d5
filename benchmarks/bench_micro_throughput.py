"""Benchmark: one RL global batch through a ~1B Llama as fixed padded micro-batches, fixed packed micro-batches,
and packfwd's planned micro-batches: tokens/s (forward, forward + backward), padding waste, peak memory.

The global batch: ``--sequences`` RL-shaped sequences (``tests/micro_lengths.py`` "rl": a prompt plus a response,
one in five cut at the generation limit), lengths up to ``--seq`` = the padded width the rollout hands over.  Every
variant computes the per-token log-probs of the next token and, for ``fwd+bwd``, the token-mean loss over the
whole global batch with its backward (gradients accumulate over micro-batches).  The same memory budget for all:
``--rows`` rows of ``--seq`` tokens per micro-batch, i.e. ``max_tokens = rows * seq`` tokens.

* ``padded``:  micro-batches of ``rows`` sequences in the batch's order, each ``[rows, seq]`` through the model
  (what a trainer without packing runs; real tokens first in each row, so their results are exact).
* ``packed``:  the same micro-batches, packed (THD): ``run_micro_batches`` over a fixed-size plan.
* ``planned``: ``plan_micro_batches(seqlens, max_tokens=rows * seq, cost=("flops", 12 h, 1))`` (planning time
  included) then ``run_micro_batches``: as few micro-batches as the budget allows, each within it.

Reported per variant and pass: milliseconds per global batch (CUDA events around the whole step, median of
``--runs``), real tokens/s, computed tokens (model rows x width, or the packed totals) and the padding waste
``computed / real - 1``, micro-batches, peak memory, and the loss, which must agree across variants.

    PYTHONPATH=. python3 benchmarks/bench_micro_throughput.py --out benchmarks/out/micro_throughput.json
    python benchmarks/bench_micro_throughput.py --smoke --out /tmp/mt.json       # tiny model on the CPU (CI)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from common import environment, skip_reason, table, write_json  # noqa: E402

import packfwd as pf  # noqa: E402
from packfwd.logits import log_probs, vocab_parallel  # noqa: E402
from packfwd.micro import MicroBatchPlan, plan_micro_batches, run_micro_batches  # noqa: E402
from packfwd.models import ModelArgs, build_model  # noqa: E402
from tests.micro_lengths import lengths as draw  # noqa: E402

FULL = ModelArgs(vocab_size=32000, hidden_size=2048, ffn_hidden_size=7168, num_layers=16, num_attention_heads=16,
                 num_query_groups=8, max_position_embeddings=8192)
SMOKE = ModelArgs(vocab_size=128, hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4,
                  num_query_groups=2)
VARIANTS = ("padded", "packed", "planned")
PASSES = ("fwd", "fwd+bwd")


@vocab_parallel
def next_token_log_probs(logits, labels, tp_group=None):
    return {"log_probs": log_probs(logits, labels, tp_group=tp_group)}


def neg(out):
    return -out["log_probs"]


def fixed_plan(seqlens: list[int], rows: int, seq: int) -> MicroBatchPlan:
    """Micro-batches of ``rows`` consecutive sequences (the last may hold fewer), as a plan for the step."""
    mbs = [list(range(i, min(i + rows, len(seqlens)))) for i in range(0, len(seqlens), rows)]
    return MicroBatchPlan(micro_batches=[mbs], dp_rank_of=(0,) * len(seqlens),
                          tokens=[[sum(seqlens[i] for i in mb) for mb in mbs]], costs=[[0.0] * len(mbs)],
                          seqlens=tuple(seqlens), num_micro_batches=len(mbs), max_tokens=rows * seq, dp_size=1,
                          tp_size=1, cp_size=1, seq_align=1)


def padded_step(model, ids, mask, labels, rows, grad: bool, n_loss: int):
    """The padded baseline: each micro-batch ``[rows, s]`` through the model whole; log-probs of every slot."""
    b, s = ids.shape
    total = torch.zeros((), device=ids.device)
    outs = []
    for start in range(0, b, rows):
        sl = slice(start, min(start + rows, b))
        with torch.set_grad_enabled(grad):
            x = ids[sl]
            positions = torch.arange(s, device=ids.device).expand(x.shape[0], s)
            logits = model(input_ids=x, position_ids=positions, attention_mask=None)
            lp = log_probs(logits.reshape(-1, logits.shape[-1]), labels[sl].reshape(-1)).view(x.shape[0], s)
            lp = lp * mask[sl]
            if grad:
                loss = -(lp.float().sum()) / n_loss
                loss.backward()
                total = total + loss.detach()
        outs.append(lp.detach())
    return torch.cat(outs), total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (CI): seconds")
    ap.add_argument("--out", type=Path, default=HERE / "out" / "micro_throughput.json")
    ap.add_argument("--sequences", type=int, default=None, help="global batch size (default 128; smoke 12)")
    ap.add_argument("--seq", type=int, default=None, help="padded width = longest allowed (default 4096; smoke 48)")
    ap.add_argument("--rows", type=int, default=None, help="rows per fixed micro-batch (default 4; smoke 3)")
    ap.add_argument("--runs", type=int, default=None, help="timed runs (default 5; smoke 1)")
    ap.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    cfg = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not cfg.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    args = SMOKE if cfg.smoke else FULL
    n = cfg.sequences or (12 if cfg.smoke else 128)
    s = cfg.seq or (48 if cfg.smoke else 4096)
    rows = cfg.rows or (3 if cfg.smoke else 4)
    runs = cfg.runs or (1 if cfg.smoke else 5)

    torch.manual_seed(0)
    model = build_model(args, device=device, params_dtype=dtype)
    seqlens = draw("rl", n, s, seed=0)
    ids = torch.randint(1, args.vocab_size, (n, s), device=device)
    mask = torch.arange(s, device=device)[None, :] < torch.tensor(seqlens, device=device)[:, None]
    labels = torch.roll(ids, -1, dims=1)
    real = sum(seqlens)
    n_loss = real
    forward = pf.make_forward("thd", logits_processor=next_token_log_probs)
    cost = ("flops", 12 * args.hidden_size, 1)

    def run(variant, grad):
        if variant == "padded":
            return padded_step(model, ids, mask, labels, rows, grad, n_loss) + (None,)
        plan = (fixed_plan(seqlens, rows, s) if variant == "packed"
                else plan_micro_batches(seqlens, max_tokens=rows * s, cost=cost))
        res = run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, labels=labels,
                                loss_fn=neg if grad else None, loss_tokens=seqlens)
        return res.outputs["log_probs"], res.loss, plan

    def timed(fn):
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b), out
        t0 = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t0) * 1e3, out

    results, reference = [], {}
    for pass_ in cfg.passes:
        grad = pass_ == "fwd+bwd"
        for variant in VARIANTS:
            try:
                run(variant, grad)  # warm-up
            except torch.cuda.OutOfMemoryError as e:  # recorded as skipped; the other variants still run
                results.append({"pass": pass_, "variant": variant, "skipped": skip_reason(e)})
                print(f"  {pass_} {variant}: {results[-1]['skipped']}", flush=True)
                model.zero_grad(set_to_none=True)
                continue
            model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(runs):
                ms, (lp, loss, plan) = timed(lambda: run(variant, grad))
                times.append(ms)
                model.zero_grad(set_to_none=True)
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
            if variant == "padded":
                mbs, computed = -(-n // rows), -(-n // rows) * rows * s
            else:
                mbs = plan.num_micro_batches
                computed = sum(t for t in plan.tokens[0] if t)
            lp_real = lp.float()[mask]
            if variant == "padded":
                reference[pass_] = lp_real
            diff = float((lp_real - reference[pass_]).abs().max()) if pass_ in reference else None
            ms = statistics.median(times)
            row = {"pass": pass_, "variant": variant, "ms": ms, "ms_runs": times, "tokens/s": real / ms * 1e3,
                   "real_tokens": real, "computed_tokens": computed, "padding_waste": computed / real - 1,
                   "micro_batches": mbs, "peak_GiB": peak, "loss": float(loss) if grad else None,
                   "max_abs_diff_vs_padded": diff}
            results.append(row)
            print(f"  {pass_} {variant}: {ms:.1f} ms, {row['tokens/s']:.0f} tok/s, {mbs} micro-batches, "
                  f"waste {row['padding_waste']:.2f}, peak {peak and round(peak, 2)} GiB, diff {diff:.3g}",
                  flush=True)
    for pass_ in cfg.passes:
        base = next((r for r in results if r["pass"] == pass_ and r["variant"] == "padded" and "ms" in r), None)
        for r in results:
            if r["pass"] == pass_ and base is not None and "ms" in r:
                r["speedup_vs_padded"] = base["ms"] / r["ms"]
    payload = {"benchmark": "micro_throughput", "smoke": cfg.smoke, "command": " ".join(sys.argv),
               "env": environment(), "dtype": str(dtype),
               "model": {k: getattr(args, k) for k in ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers",
                                                       "num_attention_heads", "num_query_groups")},
               "sequences": n, "seq": s, "rows": rows, "max_tokens": rows * s, "runs": runs,
               "seqlens": seqlens, "results": results}
    write_json(cfg.out, payload)
    print(table(results, ["pass", "variant", "ms", "tokens/s", "speedup_vs_padded", "micro_batches",
                          "padding_waste", "peak_GiB", "loss", "max_abs_diff_vs_padded"]))
    tol = 1e-4 if dtype == torch.float32 else 1.0  # bf16: matmuls of other shapes round differently
    losses = {}
    for r in results:
        if r.get("loss") is not None:
            losses.setdefault(r["pass"], []).append(r["loss"])
    bad = [r for r in results if (r.get("max_abs_diff_vs_padded") or 0) > tol]
    bad_loss = [k for k, v in losses.items() if max(v) - min(v) > tol * max(1.0, abs(v[0]))]
    if bad or bad_loss:
        print(f"variants disagree: {[(r['pass'], r['variant']) for r in bad]} {bad_loss}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
