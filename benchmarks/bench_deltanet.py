"""Benchmark: Gated DeltaNet's two sequence operators on CUDA, packfwd's fla path against its torch path and fla's
own autograd, at a Qwen3.5 layer's shapes on an RL-like packed batch.

Shapes (transformers' ``Qwen3_5Config`` / ``Qwen3NextConfig`` defaults): 16 query/key heads and 32 value heads of
128, the short convolution over ``2 * 16 * 128 + 32 * 128 = 8192`` channels with 4 taps; ``--tokens`` (16384)
packed tokens in sequences of uniform random lengths in [64, ``--max-len``] (4096), bf16, the decay in float32 as
the layer computes it.  Rows, per operator (``rule``: ``chunk_gated_delta_rule_packed`` with the L2 norm of q and
k in the kernel; ``conv``: ``causal_conv1d_packed`` with SiLU):

* ``fla``: packfwd's CUDA path (fla's varlen forward on the chunk-aligned layout; the rule's backward fla's kernels
  with packfwd's chunk-local step in place of the one fla refuses on Hopper, the convolution's fla's);
* ``fla_recompute`` (the rule): the same forward, the backward the torch path recomputed (``PACKFWD_DELTANET=recompute``);
* ``torch``: packfwd's torch path (``PACKFWD_DELTANET=torch``), exact, the CPU path;
* ``fla_own``: fla's own ``chunk_gated_delta_rule`` / ``causal_conv1d`` on the packed buffer with its own backward
  (host ``cu_seqlens`` given); its rule backward refuses on Hopper with Triton < 3.7.1, recorded as ``refused``.

Each: forward and forward + backward in milliseconds (CUDA events, median of ``--iters`` after warm-up), the peak
memory above the inputs, and the largest difference from the torch path relative to its largest value (the run
fails past 2e-2).  Prints the ratios torch / fla and the rule's backward cost against fla's forward.

    PYTHONPATH=.:/tmp/site python3 benchmarks/bench_deltanet.py --out benchmarks/out/deltanet.json
    python benchmarks/bench_deltanet.py --smoke --out /tmp/deltanet_smoke.json    # CPU: the torch rows only (CI)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))
from common import environment, pick_device, table, time_device, write_json  # noqa: E402

from packfwd.models.mixers import deltanet_cuda  # noqa: E402
from packfwd.models.mixers.deltanet_ops import causal_conv1d_packed, chunk_gated_delta_rule_packed  # noqa: E402

FULL = {"hk": 16, "hv": 32, "d": 128, "taps": 4, "tokens": 16384, "max_len": 4096, "min_len": 64}
SMOKE = {"hk": 1, "hv": 2, "d": 8, "taps": 4, "tokens": 96, "max_len": 40, "min_len": 1}
TOLERANCE = 2e-2


def lengths_for(tokens: int, min_len: int, max_len: int, seed: int = 0) -> list[int]:
    """Uniform random lengths in [min_len, max_len] until ``tokens`` (the last one cut to fit)."""
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while sum(out) < tokens:
        out.append(int(torch.randint(min_len, max_len + 1, (1,), generator=g)))
    out[-1] -= sum(out) - tokens
    return out


def inputs(shape: dict, t: int, device: torch.device, dtype: torch.dtype) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*s):
        return torch.randn(*s, generator=g).to(device)

    hk, hv, d = shape["hk"], shape["hv"], shape["d"]
    c = 2 * hk * d + hv * d
    return {
        "rule": [rand(t, hk, d).to(dtype), rand(t, hk, d).to(dtype), rand(t, hv, d).to(dtype),
                 -F.softplus(rand(t, hv)) * 0.5, rand(t, hv).sigmoid().to(dtype)],
        "conv": [rand(t, c).to(dtype), (rand(c, shape["taps"]) * 0.5).to(dtype), (rand(c) * 0.1).to(dtype)],
    }


def packfwd_fns(cu: torch.Tensor, max_seqlen: int) -> dict:
    return {
        "rule": lambda q, k, v, g, b: chunk_gated_delta_rule_packed(q, k, v, g, b, cu, 64, max_seqlen=max_seqlen,
                                                                    use_qk_l2norm_in_kernel=True),
        "conv": lambda x, w, b: causal_conv1d_packed(x, w, b, cu, activation="silu"),
    }


def fla_own_fns(cu: torch.Tensor) -> dict:
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    cu64, cu_cpu = cu.long(), cu.long().cpu()

    def rule(q, k, v, g, b):
        o, _ = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], b[None], use_qk_l2norm_in_kernel=True,
                                      cu_seqlens=cu64, cu_seqlens_cpu=cu_cpu)
        return o[0]

    def conv(x, w, b):
        return causal_conv1d(x[None], w, b, activation="silu", cu_seqlens=cu64, cu_seqlens_cpu=cu_cpu)[0][0]

    return {"rule": rule, "conv": conv}


def measure(fn, args, upstream, device, iters, warmup) -> dict:
    """Forward and forward + backward milliseconds and peak memory above what is allocated before."""
    leaves = [a.detach().requires_grad_(a.is_floating_point()) for a in args]

    def fwd():
        with torch.no_grad():
            fn(*args)

    def fwd_bwd():
        torch.autograd.grad(fn(*leaves), leaves, upstream)

    row = {"forward_ms": time_device(fwd, device, warmup=warmup, iters=iters)}
    try:
        fwd_bwd()
    except Exception as e:  # fla's own backward refuses on Hopper with Triton < 3.7.1
        row["refused"] = f"{type(e).__name__}: {e}"[:300]
        return row
    row["forward_backward_ms"] = time_device(fwd_bwd, device, warmup=warmup, iters=iters)
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd()
        row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return row


def run(shape: dict, device: torch.device, iters: int, warmup: int) -> dict:
    lengths = lengths_for(shape["tokens"], shape["min_len"], shape["max_len"])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device, dtype=torch.int32)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    data = inputs(shape, shape["tokens"], device, dtype)
    fns = packfwd_fns(cu, max(lengths))
    impls = {"torch": (fns, "torch")}  # name: (the operators, PACKFWD_DELTANET)
    fla_ok = device.type == "cuda" and deltanet_cuda.fla_takes(*data["rule"][:3], *data["rule"][3:])
    if fla_ok:
        impls = {"fla": (fns, "auto"), "fla_recompute": (fns, "recompute"), "torch": (fns, "torch"),
                 "fla_own": (fla_own_fns(cu), "auto")}
    rows = []
    for op, args in data.items():
        with torch.no_grad():
            os.environ[deltanet_cuda.SWITCH] = "torch"
            ref = fns[op](*args).float()
        g = torch.Generator(device="cpu").manual_seed(1)
        upstream = torch.randn(ref.shape, generator=g).to(device=device, dtype=args[0].dtype)
        for impl, (table_, switch) in impls.items():
            if impl == "fla_recompute" and op != "rule":
                continue
            os.environ[deltanet_cuda.SWITCH] = switch
            with torch.no_grad():
                out = table_[op](*args).float()
            rel = float((out - ref).abs().max() / ref.abs().max())
            row = {"op": op, "impl": impl, "rel_diff": rel, **measure(table_[op], args, upstream, device, iters, warmup)}
            rows.append(row)
            print(table([row], list(row)), flush=True)
    os.environ.pop(deltanet_cuda.SWITCH, None)
    return {"lengths": lengths, "rows": rows}


def ratios(rows: list[dict]) -> dict:
    by = {(r["op"], r["impl"]): r for r in rows}
    out = {}
    for op in ("rule", "conv"):
        fla, torch_ = by.get((op, "fla")), by.get((op, "torch"))
        if not fla:
            continue
        for key in ("forward_ms", "forward_backward_ms"):
            out[f"{op} {key[:-3]}: torch / fla"] = torch_[key] / fla[key]
        out[f"{op} backward / forward (fla path)"] = (fla["forward_backward_ms"] - fla["forward_ms"]) / fla["forward_ms"]
        recompute = by.get((op, "fla_recompute"))
        if recompute:
            out[f"{op} forward_backward: recompute / fla"] = recompute["forward_backward_ms"] / fla["forward_backward_ms"]
        own = by.get((op, "fla_own"), {})
        if "forward_backward_ms" in own:
            out[f"{op} forward_backward: fla path / fla_own"] = fla["forward_backward_ms"] / own["forward_backward_ms"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (CI): the torch rows only")
    ap.add_argument("--out", type=Path, default=HERE / "out" / "deltanet.json", help="JSON file to write")
    ap.add_argument("--tokens", type=int, default=None, help="packed tokens (default 16384)")
    ap.add_argument("--max-len", type=int, default=None, help="longest sequence (default 4096)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per row (default 10; smoke 2)")
    args = ap.parse_args(argv)
    shape = dict(SMOKE if args.smoke else FULL)
    shape.update({k: v for k, v in (("tokens", args.tokens), ("max_len", args.max_len)) if v is not None})
    device = pick_device(args.smoke)
    iters = args.iters or (2 if args.smoke else 10)
    result = run(shape, device, iters, warmup=1 if args.smoke else 3)
    result.update({"shape": shape, "env": environment(), "ratios": ratios(result["rows"])})
    write_json(args.out, result)
    for name, value in result["ratios"].items():
        print(f"{name}: {value:.2f}")
    bad = [r for r in result["rows"] if r["rel_diff"] > TOLERANCE]
    if bad:
        print(f"FAILED: {[(r['op'], r['impl'], r['rel_diff']) for r in bad]} differ from the torch path")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
