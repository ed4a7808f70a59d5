"""Run every benchmark, each in its own process, and write their JSON under one folder.

    python benchmarks/run_all.py            # full sizes (on the GPU when there is one): `make bench`
    python benchmarks/run_all.py --smoke    # tiny sizes on the CPU, seconds: `make bench-smoke`, run by CI
    python benchmarks/run_all.py --only transforms vs_verl --out /tmp/bench

Exits non-zero if any benchmark fails (a benchmark also fails when its implementations disagree).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _dir_args(name: str):
    return lambda out, smoke: ["--out", str(out)]


def _file_args(stem: str, *extra: str):
    """``--out <folder>/<stem>[_smoke].json``, after ``extra`` (a benchmark's own options, e.g. another model)."""
    return lambda out, smoke: [*extra, "--out", str(out / f"{stem}{'_smoke' if smoke else ''}.json")]


# name: (script, arguments for the output location)
BENCHMARKS = {
    "transforms": ("bench_transforms.py", _dir_args("transforms")),
    "vs_verl": ("bench_vs_verl.py", _dir_args("vs_verl")),
    "logprobs": ("bench_logprobs.py", _file_args("logprobs")),
    "forward": ("bench_forward.py", _file_args("forward")),
    "micro_batches": ("bench_micro_batches.py", _file_args("micro_batches")),
    "composition": ("bench_composition.py", _file_args("composition")),
    "micro_throughput": ("bench_micro_throughput.py", _file_args("micro_throughput")),
    "fused_head": ("bench_fused_head.py", _file_args("fused_head")),
    "step": ("bench_step.py", _file_args("step")),
    "scored": ("bench_scored.py", _file_args("scored")),
    "rl_step": ("bench_rl_step.py", _file_args("rl_step")),
    "rl_step_moe": ("bench_rl_step.py", _file_args("rl_step_moe", "--model", "qwen3_moe")),
    "kernels": ("bench_kernels.py", _file_args("kernels")),
    "invariance": ("bench_invariance.py", _file_args("invariance")),
    "moe": ("bench_moe.py", _file_args("moe")),
    "deltanet": ("bench_deltanet.py", _file_args("deltanet")),
    "hybrid": ("bench_hybrid.py", _file_args("hybrid")),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    ap.add_argument("--out", type=Path, default=HERE / "out", help="folder for the JSON results")
    ap.add_argument("--only", nargs="*", choices=sorted(BENCHMARKS), help="run only these")
    args = ap.parse_args(argv)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    if args.smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""  # smoke runs are CPU runs, wherever they run
    failed = []
    for name in args.only or BENCHMARKS:
        script, out_args = BENCHMARKS[name]
        if not (HERE / script).exists():
            print(f"== {name}: {script} is missing, skipped")
            continue
        cmd = [sys.executable, str(HERE / script), *(["--smoke"] if args.smoke else []), *out_args(args.out, args.smoke)]
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, env=env, cwd=ROOT)
        print(f"== {name}: exit {rc} after {time.perf_counter() - t0:.1f} s", flush=True)
        if rc:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
