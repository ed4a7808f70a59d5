"""Benchmark: time and peak memory of token log-probs (+ entropy), naive vs chunked vs fused.

Methods, each for mode ``logp`` (log-probs only) and ``logp+ent`` (log-probs and entropy), forward only
(``fwd``, under no_grad, as for reference/old-policy log-probs) and forward + backward (``fwd+bwd``):

* ``naive``: ``log_softmax(logits.float() / T)`` gathered at the labels, entropy ``-(p * log p).sum()``,
  autograd for the backward: several ``[t, v]`` float32 buffers.
* ``chunked``: ``packfwd.logits.log_probs`` / ``log_probs_and_entropy`` on the same logits (on CUDA: the fused
  Triton kernels of ``packfwd.ops.logprob``).
* ``chunked_torch``: the same, forced onto the torch blocks (what ``chunked`` is off CUDA).
* ``naive_linear`` / ``fused``: from the final hidden states and output weight: ``hidden @ weight.T`` then
  ``naive``, against ``packfwd.logits.fused_log_probs_and_entropy`` (never materialises the logits).

Timing: on CUDA with device events, after warm-up, median of ``--runs`` runs, fresh random data each run
(generated outside the timed region).  Memory: on CUDA ``torch.cuda.max_memory_allocated`` above what was
allocated before the call (inputs excluded; the gradient w.r.t. the logits is counted).  On the CPU: peak RSS
growth in one extra run after all timings (``VmHWM`` after resetting it through ``/proc/self/clear_refs``, with
glibc's malloc told to return big blocks to the system); approximate, Linux only, ``null`` elsewhere.  CPU times
are only indicative (and meaningless on a loaded machine); the targets are meant for the CUDA run.

Targets checked and written to the JSON (``targets``): chunked fwd+bwd peak <= 1/4 of naive's and time <= 1.2x
naive's, per mode.  Also written: the largest differences between methods' outputs and gradients on one batch.

    python benchmarks/bench_logprobs.py [--smoke] [--device cuda] [--out benchmarks/out/logprobs.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import skip_reason  # noqa: E402
from packfwd.logits import _chunked, fused_log_probs_and_entropy, log_probs, log_probs_and_entropy  # noqa: E402

MODES = ("logp", "logp+ent")
PASSES = ("fwd", "fwd+bwd")


# ------------------------------------------------------------------------------------------------ methods


def naive(logits, labels, temperature, mode, blocks=None):
    lsm = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)
    out = {"log_probs": torch.where(labels >= 0, lsm.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)}
    if mode == "logp+ent":
        out["entropy"] = -(lsm.exp() * lsm).sum(-1)
    return out


def chunked(logits, labels, temperature, mode, blocks=None):
    chunk = None if blocks is None else max(1, logits.shape[0] // blocks)  # tokens per block
    if mode == "logp":
        return {"log_probs": log_probs(logits, labels, temperature=temperature, chunk_size=chunk)}
    return log_probs_and_entropy(logits, labels, temperature=temperature, chunk_size=chunk)


def chunked_torch(logits, labels, temperature, mode, blocks=None):
    """``chunked`` forced onto the torch blocks (on CUDA ``chunked`` takes the fused Triton kernels)."""
    chunk = None if blocks is None else max(1, logits.shape[0] // blocks)
    return _chunked(logits, labels, temperature, None, chunk, mode == "logp+ent", kernel=False)


def naive_linear(hidden, weight, labels, temperature, mode, blocks=None):
    return naive(hidden @ weight.T, labels, temperature, mode)


def fused(hidden, weight, labels, temperature, mode, blocks=None):
    chunk = None if blocks is None else max(1, weight.shape[0] // blocks)  # vocab rows per block
    out = fused_log_probs_and_entropy(hidden, weight, labels, temperature=temperature, chunk_size=chunk)
    return out if mode == "logp+ent" else {"log_probs": out["log_probs"]}


METHODS = {"naive": (naive, "logits"), "chunked": (chunked, "logits"), "chunked_torch": (chunked_torch, "logits"),
           "naive_linear": (naive_linear, "linear"), "fused": (fused, "linear")}


# ------------------------------------------------------------------------------------------------- inputs


def make_inputs(cfg, kind, seed, requires_grad):
    """Fresh random inputs: logits ~ 3 * N(0, 1) (or hidden/weight giving logits of that scale)."""
    dev, dt = cfg["device"], getattr(torch, cfg["dtype"])
    g = torch.Generator(device=dev).manual_seed(seed)
    t, v, h = cfg["t"], cfg["v"], cfg["hidden"]
    labels = torch.randint(0, v, (t,), generator=g, device=dev)
    labels[::7] = -100
    temperature = torch.rand(t, generator=g, device=dev) * 0.5 + 0.75
    if kind == "logits":
        tensors = [torch.randn(t, v, generator=g, device=dev, dtype=dt).mul_(3.0)]
    else:
        tensors = [torch.randn(t, h, generator=g, device=dev, dtype=dt),
                   torch.randn(v, h, generator=g, device=dev, dtype=dt).mul_(3.0 / h**0.5)]
    for x in tensors:
        x.requires_grad_(requires_grad)
    return tensors, labels, temperature


def upstream(t, device, seed):
    g = torch.Generator(device=device).manual_seed(seed + 1)
    return torch.randn(t, generator=g, device=device), torch.randn(t, generator=g, device=device)


def step(fn, tensors, labels, temperature, mode, g_lp, g_ent, backward, blocks):
    if not backward:
        with torch.no_grad():
            return fn(*tensors, labels, temperature, mode, blocks)
    out = fn(*tensors, labels, temperature, mode, blocks)
    loss = (out["log_probs"] * g_lp).sum()
    if "entropy" in out:
        loss = loss + (out["entropy"] * g_ent).sum()
    loss.backward()
    return out


# ------------------------------------------------------------------------------------------ measurement


class CpuPeak:
    """Peak resident-set growth of this process on Linux; ``None`` elsewhere.

    Enabling it makes glibc's malloc serve big blocks straight from the OS and return them on free (so that RSS
    follows tensor lifetimes), which slows allocation: measure CPU times before enabling it.
    """

    def __init__(self):
        self.ok = sys.platform.startswith("linux") and os.path.exists("/proc/self/clear_refs")
        self.libc = None
        if self.ok:
            try:
                self.libc = ctypes.CDLL("libc.so.6")
                self.libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: fixed at 64 KiB, no dynamic growth
                self.libc.mallopt(-1, 1 << 16)  # M_TRIM_THRESHOLD
            except (OSError, AttributeError):
                self.libc = None

    @staticmethod
    def _status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"{key} not in /proc/self/status")

    def start(self):
        if not self.ok:
            return
        if self.libc is not None:
            self.libc.malloc_trim(0)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
        except OSError:
            self.ok = False
            return
        self.base = self._status("VmRSS:")

    def peak(self):
        return self._status("VmHWM:") - self.base if self.ok else None


def run_once(cfg, name, mode, backward, seed):
    """One run on fresh data: (elapsed ms, peak bytes above the inputs or None)."""
    fn, kind = METHODS[name]
    tensors, labels, temperature = make_inputs(cfg, kind, seed, backward)
    g_lp, g_ent = upstream(cfg["t"], cfg["device"], seed)
    args = (fn, tensors, labels, temperature, mode, g_lp, g_ent, backward, cfg["blocks"])
    if cfg["device"] == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = step(*args)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end), torch.cuda.max_memory_allocated() - base
    t0 = time.perf_counter()
    out = step(*args)
    del out
    return (time.perf_counter() - t0) * 1e3, None


def cpu_peak_once(cfg, name, mode, backward, cpu_peak):
    fn, kind = METHODS[name]
    tensors, labels, temperature = make_inputs(cfg, kind, 3, backward)
    g_lp, g_ent = upstream(cfg["t"], cfg["device"], 3)
    cpu_peak.start()
    out = step(fn, tensors, labels, temperature, mode, g_lp, g_ent, backward, cfg["blocks"])
    del out
    return cpu_peak.peak()


def measure(cfg, name, mode, backward):
    """One row; a row that runs out of memory is recorded as skipped (its times None) and the run goes on."""
    times, peaks = [], []
    try:
        for i in range(cfg["warmup"] + cfg["runs"]):
            elapsed, peak = run_once(cfg, name, mode, backward, seed=1000 * i + 17)
            if i >= cfg["warmup"]:
                times.append(elapsed)
                peaks.append(peak)
    except torch.cuda.OutOfMemoryError as e:
        return {"method": name, "mode": mode, "pass": "fwd+bwd" if backward else "fwd", "time_ms_median": None,
                "time_ms_runs": times, "peak_bytes": None, "skipped": skip_reason(e)}
    return {"method": name, "mode": mode, "pass": "fwd+bwd" if backward else "fwd",
            "time_ms_median": statistics.median(times), "time_ms_runs": times,
            "peak_bytes": None if None in peaks else max(peaks)}


def agreement(cfg):
    """Largest |difference| of outputs and gradients: chunked vs naive, fused vs naive_linear (one batch)."""
    result = {}
    for ours, ref in (("chunked", "naive"), ("chunked_torch", "naive"), ("fused", "naive_linear")):
        grads = {}
        outs = {}
        for name in (ours, ref):
            fn, kind = METHODS[name]
            tensors, labels, temperature = make_inputs(cfg, kind, 5, True)
            g_lp, g_ent = upstream(cfg["t"], cfg["device"], 5)
            out = step(fn, tensors, labels, temperature, "logp+ent", g_lp, g_ent, True, cfg["blocks"])
            outs[name] = {k: v.detach() for k, v in out.items()}
            grads[name] = [x.grad for x in tensors]
        diff = {k: (outs[ours][k].float() - outs[ref][k].float()).abs().max().item() for k in outs[ref]}
        for i, (a, b) in enumerate(zip(grads[ours], grads[ref])):
            scale = b.float().abs().max().item() or 1.0
            diff[f"grad{i}_rel_to_max"] = (a.float() - b.float()).abs().max().item() / scale
        result[f"{ours}_vs_{ref}"] = diff
        del grads, outs
    return result


# ----------------------------------------------------------------------------------------------- driver


def config(args):
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for, but CUDA is not available")
    if args.smoke:
        sizes = dict(t=64, v=512, hidden=32, runs=2, warmup=1, blocks=4)
    elif device == "cuda":  # the design point, with packfwd's default block sizes
        sizes = dict(t=16384, v=131072, hidden=4096, runs=5, warmup=2, blocks=None)
    else:  # bf16 matmuls are very slow on most CPUs, hence float32 by default there
        sizes = dict(t=1024, v=16384, hidden=128, runs=3, warmup=1, blocks=32, dtype="float32")
    sizes.setdefault("dtype", "bfloat16")
    for key in ("t", "v", "hidden", "runs", "warmup", "blocks", "dtype"):
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    return dict(device=device, **sizes)


def targets(results):
    """Chunked fwd+bwd against naive: peak <= 1/4, time <= 1.2x (the design targets), per mode."""
    out = {}
    by = {(r["method"], r["mode"], r["pass"]): r for r in results}
    for mode in MODES:
        c, n = by[("chunked", mode, "fwd+bwd")], by[("naive", mode, "fwd+bwd")]
        if c["time_ms_median"] is None or n["time_ms_median"] is None:
            out[mode] = {"peak_ratio": None, "peak_ok": None, "time_ratio": None, "time_ok": None,
                         "skipped": c.get("skipped") or n.get("skipped")}
            continue
        mem = None if c["peak_bytes"] is None or not n["peak_bytes"] else c["peak_bytes"] / n["peak_bytes"]
        tim = c["time_ms_median"] / n["time_ms_median"]
        out[mode] = {"peak_ratio": mem, "peak_ok": None if mem is None else mem <= 0.25,
                     "time_ratio": tim, "time_ok": tim <= 1.2}
    return out


def table(results):
    gib = lambda b: "n/a" if b is None else f"{b / 2**30:8.3f}"  # noqa: E731
    base = {(r["mode"], r["pass"], METHODS[r["method"]][1]): r for r in results if r["method"].startswith("naive")}
    lines = [f"{'method':<15}{'mode':<10}{'pass':<9}{'time ms':>10}{'x naive':>9}{'peak GiB':>10}{'x naive':>9}"]
    for r in results:
        ref = base[(r["mode"], r["pass"], METHODS[r["method"]][1])]
        if r["time_ms_median"] is None or ref["time_ms_median"] is None:
            lines.append(f"{r['method']:<15}{r['mode']:<10}{r['pass']:<9}  {r.get('skipped') or 'skipped: its baseline'}")
            continue
        tr = r["time_ms_median"] / ref["time_ms_median"]
        mr = (r["peak_bytes"] / ref["peak_bytes"]) if r["peak_bytes"] is not None and ref["peak_bytes"] else None
        lines.append(f"{r['method']:<15}{r['mode']:<10}{r['pass']:<9}{r['time_ms_median']:10.2f}{tr:9.2f}"
                     f"{gib(r['peak_bytes']):>10}{'n/a' if mr is None else f'{mr:9.3f}':>9}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "logprobs.json"),
                        help="JSON report path (default: benchmarks/out/logprobs.json)")
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                        help="default: bfloat16 (float32 for the CPU's default sizes)")
    parser.add_argument("--t", type=int, default=None, help="tokens")
    parser.add_argument("--v", type=int, default=None, help="vocab")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (fused / linear methods)")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--blocks", type=int, default=None,
                        help="split the work into this many blocks (default: packfwd's block size on CUDA; 32 on "
                             "the CPU, the number of blocks of the CUDA design point, so that ratios are alike)")
    args = parser.parse_args(argv)
    cfg = config(args)
    print(f"log-prob benchmark on {cfg['device']}: t={cfg['t']} v={cfg['v']} hidden={cfg['hidden']} "
          f"{cfg['dtype']}, median of {cfg['runs']} runs after {cfg['warmup']} warm-up", flush=True)
    results = [measure(cfg, name, mode, p == "fwd+bwd") for mode in MODES for p in PASSES for name in METHODS]
    if cfg["device"] == "cpu":  # memory in separate runs, after every timing (see CpuPeak)
        cpu_peak = CpuPeak()
        for r in results:
            r["peak_bytes"] = cpu_peak_once(cfg, r["method"], r["mode"], r["pass"] == "fwd+bwd", cpu_peak)
    report = {
        "benchmark": "logprobs",
        "config": cfg,
        "env": {"torch": torch.__version__, "python": platform.python_version(),
                "gpu": torch.cuda.get_device_name() if cfg["device"] == "cuda" else None},
        "results": results,
        "targets": targets(results),
        # the targets are stated for this configuration only; elsewhere the ratios are indicative
        "design_point": cfg["device"] == "cuda" and (cfg["t"], cfg["v"], cfg["dtype"]) == (16384, 131072, "bfloat16"),
        "agreement": agreement(cfg),
    }
    print(table(results))
    if not report["design_point"]:
        print("(not the design point t=16384, v=131072, bf16 on CUDA: the target ratios are only indicative)")
    for mode, tgt in report["targets"].items():
        if tgt["time_ratio"] is None:
            print(f"targets [{mode}]: not measured ({tgt['skipped']})")
            continue
        print(f"targets [{mode}] chunked/naive fwd+bwd: peak {tgt['peak_ratio']} (<= 0.25: {tgt['peak_ok']}), "
              f"time {tgt['time_ratio']:.3f} (<= 1.2: {tgt['time_ok']})")
    print("agreement:", json.dumps(report["agreement"]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
