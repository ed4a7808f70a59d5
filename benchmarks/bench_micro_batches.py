"""Micro-batch planning: packfwd's ``plan_micro_batches`` against verl 0.9.1's ``get_seqlen_balanced_partitions``
/ ``rearrange_micro_batches`` and NeMo-RL's sequence packing on the same global batches: balance, budget
violations and planning time.

Batches: the five length distributions of ``tests/micro_lengths.py`` (uniform, long-tailed, RL prompt+response,
many of length 1, some at the budget), 1,000 and 10,000 sequences, lengths up to ``max_len`` = 8192, DP over
``dp`` ranks.  Budget: ``max_tokens`` = 16384 padded tokens per GPU and micro-batch.  Two layouts: no model
parallelism (``tp = cp = 1``: padded = real lengths) and ``tp = 4, cp = 2`` with verl's alignment
(``seq_align = 2 * tp * cp = 16``, what verl's ``preprocess_packed_seqs`` pads to).

* verl, as its trainer runs it: Karmarkar-Karp over ``dp`` parts of equal size on ``calculate_workload``
  (``24576 L + L^2``), then ``rearrange_micro_batches`` per rank with ``max_token_len = max_tokens * cp`` (its
  Megatron engine's ``max_token_len_per_gpu * cp_size``, on raw lengths) and the count agreed across ranks
  (``tests/verl_balance_ref.py``).
* packfwd: ``plan_micro_batches(lengths, max_tokens=, dp_size=, tp_size=, cp_size=, seq_align=,
  cost=("flops", 24576, 1))``: the same workload, so both balance the same numbers.  ``packfwd@verl count``: the
  same with ``min_micro_batches=`` verl's count, to compare balance at an equal number of micro-batches (packfwd
  usually needs fewer, and fewer, fuller micro-batches are harder to balance).
* NeMo-RL, as its policy runs it with ``sequence_packing`` (``tests/nemo_rl_packing_ref.py``, re-implemented from
  its source, which says what it does and at which commit: the ``nemo-rl`` package on PyPI is an empty
  placeholder): every length rounded up to ``sequence_length_pad_multiple`` (here the layout's alignment, 1 or
  16, what ``make_sequence_length_divisible_by`` must be for it), modified first-fit decreasing into bins of
  ``max_tokens_per_microbatch = max_tokens * cp`` padded tokens (its budget counts the micro-batch before the CP
  split), the bin count raised to a multiple of ``dp``, bins dealt to ranks round robin; no cost model.
  ``packfwd@nemo-rl count``: packfwd at NeMo-RL's count.

Reported per planner: micro-batches per rank, ``mb max/mean`` (costliest micro-batch over the mean, all ranks),
``rank max/mean`` (costliest rank's total over the mean), ``violations`` (micro-batches whose real footprint,
``plan_thd(...).local_tokens`` computed with ``packfwd.layout.rules``, exceeds ``max_tokens``), the largest
footprint over the budget, and planning milliseconds (packfwd and NeMo-RL: median of 7 calls, NeMo-RL's being
the re-implementation's; verl: one call, it is slow).

    python benchmarks/bench_micro_batches.py [--smoke] [--no-verl] [--out benchmarks/results/micro_batches.json]

``--sweep``: instead, 180 smaller seeded batches (320 and 640 sequences, lengths up to 2048 / 4096, budgets 4096 /
8192, dp 1, 4, 8, both layouts, the five distributions, three seeds each) against verl at verl's count: how often
packfwd's costliest micro-batch is above verl's there, and how often packfwd needs more micro-batches
(``benchmarks/results/micro_batches_sweep.json``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, table, write_json  # noqa: E402

from packfwd.layout import rules  # noqa: E402
from packfwd.micro import plan_micro_batches  # noqa: E402
from tests.micro_lengths import KINDS, lengths  # noqa: E402
from tests.nemo_rl_packing_ref import nemo_rl_plan  # noqa: E402
from tests.verl_balance_ref import load_verl_balancing, verl_plan  # noqa: E402

A, B = 24576, 1  # verl's calculate_workload: 24576 L + L^2
MAX_TOKENS, MAX_LEN = 16384, 8192
LAYOUTS = {"tp1 cp1": (1, 1, None), "tp4 cp2 align16": (4, 2, 16)}


def metrics(plan: list, seqlens: list[int], tp: int, cp: int, align: int | None, max_tokens: int = MAX_TOKENS) -> dict:
    """Balance and budget of ``plan[dp_rank][mb] -> indices`` in one currency for every planner."""
    align = rules.check_seq_align(align, cp, tp)
    padded = rules.round_up(np.asarray(seqlens, dtype=np.int64), align)
    cost = A * padded.astype(float) + B * padded.astype(float) ** 2
    mb_cost, rank_cost, footprint = [], [], []
    for mbs in plan:
        rank_cost.append(sum(float(cost[mb].sum()) for mb in mbs))
        for mb in mbs:
            mb_cost.append(float(cost[mb].sum()))
            total = int(padded[mb].sum())
            footprint.append((total + rules.last_extra(total, seq_align=align, tp_size=tp, cp_size=cp)) // cp)
    return {
        "micro_batches_per_rank": max(len(mbs) for mbs in plan),
        "same_count_on_every_rank": len({len(mbs) for mbs in plan}) == 1,
        "mb_max_over_mean": max(mb_cost) / statistics.mean(mb_cost),
        "rank_max_over_mean": max(rank_cost) / statistics.mean(rank_cost),
        "violations": sum(f > max_tokens for f in footprint),
        "max_footprint_over_budget": max(footprint) / max_tokens,
    }


def timed(plan_fn, calls: int = 7):
    """``(result, median milliseconds)`` of ``calls`` calls of ``plan_fn()``."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        result = plan_fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return result, statistics.median(times)


def run_case(verl, n: int, dp: int, layout: str, kind: str, seed: int, *, with_verl: bool) -> list[dict]:
    tp, cp, align = LAYOUTS[layout]
    seqlens = lengths(kind, n, MAX_LEN, seed)
    kw = dict(max_tokens=MAX_TOKENS, dp_size=dp, tp_size=tp, cp_size=cp, seq_align=align, cost=("flops", A, B))
    plan, ms = timed(lambda: plan_micro_batches(seqlens, **kw))
    case = dict(n=n, dp=dp, layout=layout, kind=kind)
    rows = [dict(case, planner="packfwd", ms=ms, **metrics(plan.micro_batches, seqlens, tp, cp, align))]
    # NeMo-RL: the same alignment as its pad multiple, its budget on the micro-batch before the CP split.
    pad = rules.check_seq_align(align, cp, tp)
    nemo, ms = timed(lambda: nemo_rl_plan(seqlens, max_tokens=MAX_TOKENS * cp, dp_size=dp, pad_multiple=pad))
    rows.append(dict(case, planner="nemo-rl", ms=ms, **metrics(nemo, seqlens, tp, cp, align)))
    same = plan_micro_batches(seqlens, **kw, min_micro_batches=len(nemo[0]))  # balance at NeMo-RL's count
    rows.append(dict(case, planner="packfwd@nemo-rl count", ms=None,
                     **metrics(same.micro_batches, seqlens, tp, cp, align)))
    if with_verl and verl is not None:
        t0 = time.perf_counter()
        theirs = verl_plan(verl, seqlens, max_token_len=MAX_TOKENS * cp, dp_size=dp)
        ms = (time.perf_counter() - t0) * 1e3
        rows.append(dict(case, planner="verl", ms=ms, **metrics(theirs, seqlens, tp, cp, align)))
        same = plan_micro_batches(seqlens, **kw, min_micro_batches=len(theirs[0]))  # balance at verl's count
        rows.append(dict(case, planner="packfwd@verl count", ms=None,
                         **metrics(same.micro_batches, seqlens, tp, cp, align)))
    return rows


def sweep(verl, out: Path) -> int:
    """``--sweep`` (module docstring)."""
    rows = []
    for n, max_len, budget in [(320, 2048, 4096), (640, 4096, 8192)]:
        for dp in (1, 4, 8):
            for layout, (tp, cp, align) in {"tp1 cp1": (1, 1, None), "tp2 cp2 align8": (2, 2, 8)}.items():
                for kind in KINDS:
                    for seed in range(3):
                        seqlens = lengths(kind, n, max_len, seed)
                        theirs = verl_plan(verl, seqlens, max_token_len=budget * cp, dp_size=dp)
                        kw = dict(max_tokens=budget, dp_size=dp, tp_size=tp, cp_size=cp, seq_align=align, cost=(
                            "flops", A, B))
                        ours = plan_micro_batches(seqlens, **kw)
                        same = plan_micro_batches(seqlens, **kw, min_micro_batches=len(theirs[0]))
                        mine, their = (metrics(x, seqlens, tp, cp, align, budget) for x in (same.micro_batches, theirs))
                        rows.append(dict(n=n, dp=dp, layout=layout, kind=kind, seed=seed,
                                         packfwd_micro_batches=ours.num_micro_batches,
                                         verl_micro_batches=len(theirs[0]),
                                         packfwd_at_verl_count=mine["micro_batches_per_rank"],
                                         packfwd_mb_max_over_mean=mine["mb_max_over_mean"],
                                         verl_mb_max_over_mean=their["mb_max_over_mean"],
                                         packfwd_violations=mine["violations"], verl_violations=their["violations"]))
    equal = [r for r in rows if r["packfwd_at_verl_count"] == r["verl_micro_batches"]]
    summary = {
        "cases": len(rows),
        "packfwd_more_micro_batches_than_verl": sum(r["packfwd_micro_batches"] > r["verl_micro_batches"] for r in rows),
        "cases_at_equal_count": len(equal),
        "packfwd_costlier_at_equal_count": sum(
            r["packfwd_mb_max_over_mean"] > r["verl_mb_max_over_mean"] * (1 + 1e-12) for r in equal),
        "packfwd_violations": sum(r["packfwd_violations"] for r in rows),
        "verl_violations": sum(r["verl_violations"] for r in rows),
    }
    print(summary)
    write_json(out, {"env": environment(), "rows": rows, "summary": summary})
    return 1 if summary["packfwd_violations"] else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="small sizes, seconds")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "micro_batches.json")
    ap.add_argument("--no-verl-10k", action="store_true", help="skip verl at 10,000 sequences (minutes)")
    ap.add_argument("--no-verl", action="store_true", help="skip verl everywhere (quick runs)")
    ap.add_argument("--sweep", action="store_true", help="180 smaller batches against verl at verl's count")
    args = ap.parse_args(argv)
    if args.sweep:
        verl = load_verl_balancing()
        if verl is None:
            print("--sweep needs verl installed")
            return 1
        return sweep(verl, ROOT / "benchmarks" / "results" / "micro_batches_sweep.json")
    verl = None if args.no_verl else load_verl_balancing()
    if verl is None:
        print("verl skipped or not installed: packfwd and NeMo-RL only")
    sizes = [(200, 4)] if args.smoke else [(1000, 1), (1000, 8), (10000, 8)]
    rows = []
    for n, dp in sizes:
        for layout in LAYOUTS:
            for kind in KINDS:
                with_verl = not (n >= 10000 and args.no_verl_10k)
                case_rows = run_case(verl, n, dp, layout, kind, seed=0, with_verl=with_verl)
                rows += case_rows
                print(table(case_rows, COLUMNS), flush=True)
    ours = [r for r in rows if r["planner"].startswith("packfwd")]
    failed = [r for r in ours if r["violations"] or not r["same_count_on_every_rank"]]
    summary = {
        "packfwd_max_ms_10k": max((r["ms"] for r in ours if r["n"] >= 10000 and r["ms"]), default=None),
        "packfwd_violations": sum(r["violations"] for r in ours),
        "verl_violations": sum(r["violations"] for r in rows if r["planner"] == "verl"),
        "nemo_rl_violations": sum(r["violations"] for r in rows if r["planner"] == "nemo-rl"),
        "nemo_rl_max_ms_10k": max((r["ms"] for r in rows if r["planner"] == "nemo-rl" and r["n"] >= 10000),
                                  default=None),
    }
    print("\n" + table(rows, COLUMNS) + f"\n\n{summary}")
    write_json(args.out, {"env": environment(), "max_tokens": MAX_TOKENS, "max_len": MAX_LEN, "rows": rows,
                          "summary": summary})
    return 1 if failed else 0


COLUMNS = ["n", "dp", "layout", "kind", "planner", "micro_batches_per_rank", "mb_max_over_mean", "rank_max_over_mean",
           "violations", "max_footprint_over_budget", "ms"]

if __name__ == "__main__":
    sys.exit(main())
