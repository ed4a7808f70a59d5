"""Benchmark: packfwd's fused layer kernels (``packfwd/ops``) against the torch code they replace, one op at a time.

The ops of a transformer layer outside its matrix products, at the shapes of the packed training step of the
1B Llama (``t`` = 13312 packed tokens, h 2048, ffn 7168, 16 query / 8 key-value heads of 128):

* ``rmsnorm``: ``[t, h]``; torch: ``torch.nn.functional.rms_norm`` (what ``torch.nn.RMSNorm`` runs);
* ``rmsnorm+residual``: the add before the norm fused in; torch: ``x + r`` then ``rms_norm``;
* ``qk_norm``: Qwen3's QK-norm, ``[t * 16, 128]`` rows of head_dim; torch: ``rms_norm``;
* ``swiglu``: ``[t, 2f] -> [t, f]``; torch: Megatron-Core's unfused gated MLP, ``silu(gate) * up``;
* ``rope``: query and key ``[t, heads, 128]`` views of the fused QKV output, rotated by per-token angles (the
  fused kernel takes one angle per channel pair); torch: :func:`packfwd.models.mixers.rope.apply_rope` on the full
  ``[t, 1, 128]`` table (Megatron-Core's arithmetic, what ``fused=False`` models run).

Each op: forward, and forward + backward (the backward from a fixed random gradient), milliseconds (CUDA events,
median of ``--iters`` after warm-up, back to back), the bytes the op must move at least (each input read and each
output written once), GB/s and % of a device copy measured in the same run.  ``torch.compile`` of the torch code
is a third row (``compiled``).  Every fused result is checked against the torch result (``max_abs`` in the JSON; the
run fails past bf16 rounding).

    PYTHONPATH=. python3 benchmarks/bench_kernels.py --out benchmarks/out/kernels.json
    PYTHONPATH=. python3 benchmarks/bench_kernels.py --sweep-swiglu --out benchmarks/out/swiglu_sweep.json

``--sweep-swiglu`` (CUDA) times the four SwiGLU kernels (plain and scaled by a per-row probability, forward and
backward) over their launch configurations (``packfwd.ops.swiglu.CONFIG``: rows and columns per program, warps) at
two shapes: the dense 1B's ``[13312, 2 x 7168]`` and the MoE step's expert rows ``[8 x 13440, 2 x 768]``
(``bench_moe.py``'s model, top-8), each in GB/s and % of copy (the bytes each must move at least).
    python benchmarks/bench_kernels.py --smoke --out /tmp/kernels_smoke.json    # CPU: the torch rows only (CI)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))
from common import copy_bandwidth, environment, table, time_device, write_json  # noqa: E402

from packfwd.models.mixers.rope import apply_rope  # noqa: E402
from packfwd.ops import rmsnorm, rope, swiglu  # noqa: E402

FULL = {"t": 13312, "h": 2048, "f": 7168, "hq": 16, "hk": 8, "d": 128}
SMOKE = {"t": 64, "h": 32, "f": 48, "hq": 4, "hk": 2, "d": 16}
EPS = 1e-5


def cases(shape: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """name -> (inputs, {impl: fn(*inputs) -> tensor or tuple}, bytes moved by one forward)."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(device=device, dtype=dtype).requires_grad_(True)

    t, h, f = shape["t"], shape["h"], shape["f"]
    e = torch.tensor([], dtype=dtype).element_size()
    x, r, w = rand(t, h), rand(t, h), rand(h, scale=0.1)
    y = rand(t, 2 * f)
    d = shape["d"]
    q_rows, wq = rand(t * shape["hq"], d), rand(d, scale=0.1)
    out = {
        "rmsnorm": ((x, w), {"torch": lambda x, w: F.rms_norm(x, (h,), w, EPS),
                             "fused": lambda x, w: rmsnorm.rms_norm(x, w, EPS, kernel=True)}, (2 * t * h + h) * e),
        "rmsnorm+residual": ((x, r, w), {
            "torch": lambda x, r, w: _add_norm(x, r, w, h),
            "fused": lambda x, r, w: rmsnorm.rms_norm(x, w, EPS, residual=r, kernel=True)}, (4 * t * h + h) * e),
        # QK-norm (Qwen3): rows of head_dim over every query head, [t * hq, d]
        "qk_norm": ((q_rows,), {"torch": lambda q: F.rms_norm(q, (d,), wq, EPS),
                                "fused": lambda q: rmsnorm.rms_norm(q, wq, EPS, kernel=True)},
                    (2 * t * shape["hq"] * d + d) * e),
        "swiglu": ((y,), {"torch": lambda y: _glu(y), "fused": lambda y: swiglu.SwiGLUKernel.apply(y)},
                   3 * t * f * e),
    }
    # RoPE: q and k as the strided views Megatron-Core's QKV split hands the core attention ([t, groups, (hq/hk + 2)
    # * d] -> q [t, hq, d], k [t, hk, d]); per-token angles [t, d/2] (positions of 8 packed sequences)
    hq, hk, d = shape["hq"], shape["hk"], shape["d"]
    qkv = rand(t, hk, (hq // hk + 2) * d)
    positions = torch.arange(t) % (t // 8)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    half = (positions[:, None].float() * inv_freq[None]).to(device)
    cos_h, sin_h = half.cos().to(dtype), half.sin().to(dtype)
    cos_f, sin_f = rope.full_table(half).cos().to(dtype)[:, None], rope.full_table(half).sin().to(dtype)[:, None]

    def split(qkv):
        q = qkv[..., : hq // hk * d].reshape(t, hq, d)  # a copy under GQA, as Megatron-Core's reshape of the query
        return q, qkv[..., hq // hk * d: (hq // hk + 1) * d]

    out["rope"] = ((qkv,), {
        "torch": lambda qkv: tuple(apply_rope(x, cos_f, sin_f) for x in split(qkv)),
        "fused": lambda qkv: rope.rope(*split(qkv), cos_h, sin_h, paired=True, kernel=True)},
        2 * t * (hq + hk) * d * e)
    return out


def _add_norm(x, r, w, h):
    v = x + r
    return F.rms_norm(v, (h,), w, EPS), v


def _glu(y):
    gate, up = torch.chunk(y, 2, dim=-1)
    return F.silu(gate) * up


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


def measure(name, inputs, impls, nbytes, device, iters, copy_gbs, compile_):
    rows = []
    fns = dict(impls)
    if compile_ and "torch" in fns:
        fns["compiled"] = torch.compile(fns["torch"], dynamic=False)
    if device.type != "cuda":  # the kernels need CUDA (or Triton's interpreter): the CPU runs the torch rows only
        fns = {k: v for k, v in fns.items() if k == "torch"}
    ref = [o.detach().float() for o in _outputs(fns["torch"](*inputs))]
    grads = [torch.randn_like(o) for o in _outputs(fns["torch"](*inputs))]
    for impl, fn in fns.items():
        got = [o.detach().float() for o in _outputs(fn(*inputs))]
        max_abs = max(float((a - b).abs().max()) for a, b in zip(got, ref))
        rel = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(got, ref))

        def fwd(fn=fn):
            with torch.no_grad():
                fn(*inputs)

        def fwd_bwd(fn=fn):
            outs = _outputs(fn(*inputs))
            torch.autograd.backward(outs, grads[: len(outs)])
            for a in inputs:
                a.grad = None

        ms_f = time_device(fwd, device, iters=iters, back_to_back=5)
        ms_fb = time_device(fwd_bwd, device, iters=iters, back_to_back=5)
        rows.append({"op": name, "impl": impl, "fwd_ms": ms_f, "fwd+bwd_ms": ms_fb, "fwd_GB": nbytes / 1e9,
                     "fwd_GB/s": nbytes / (ms_f * 1e-3) / 1e9,
                     "fwd_%copy": None if copy_gbs is None else 100 * nbytes / (ms_f * 1e-3) / 1e9 / copy_gbs,
                     "max_abs_vs_torch": max_abs, "max_rel_vs_torch": rel})
    return rows


SWEEP_SHAPES = {"dense": (13312, 7168), "moe": (8 * 13440, 768)}  # (rows, f)
SWEEP = {"rows": (1, 2, 4, 8, 16), "block_f": (256, 512, 1024, 2048), "num_warps": (2, 4, 8)}


def sweep_swiglu(device, iters: int, copy_gbs: float) -> list[dict]:
    """Every launch configuration of the four SwiGLU kernels at :data:`SWEEP_SHAPES` (module docstring)."""
    import itertools

    rows = []
    saved = dict(swiglu.CONFIG)
    try:
        for shape, (n, f) in SWEEP_SHAPES.items():
            g = torch.Generator(device=device).manual_seed(0)
            y = torch.randn(n, 2 * f, generator=g, device=device).bfloat16()
            go = torch.randn(n, f, generator=g, device=device).bfloat16()
            p = torch.rand(n, generator=g, device=device)  # the routing probability, in the router's float32
            e = 2  # bf16 bytes
            kernels = {  # name: (fn, bytes moved at least)
                "fwd": (lambda: swiglu.forward(y), n * 3 * f * e),
                "bwd": (lambda: swiglu.backward(go, y), n * 5 * f * e),
                "scaled_fwd": (lambda: swiglu.scaled_forward(y, p), n * (3 * f * e + 4)),
                "scaled_bwd": (lambda: swiglu.scaled_backward(go, y, p), n * (5 * f * e + 8)),
            }
            for r, bf, w in itertools.product(*SWEEP.values()):
                if bf > 2 * triton_next_pow2(f) or r * bf > 16384:
                    continue
                swiglu.CONFIG.update(rows=r, block_f=bf, num_warps=w)
                for name, (fn, nbytes) in kernels.items():
                    ms = time_device(fn, device, iters=iters, back_to_back=5)
                    gbs = nbytes / (ms * 1e-3) / 1e9
                    rows.append({"shape": shape, "kernel": name, "rows": r, "block_f": bf, "num_warps": w, "ms": ms,
                                 "GB/s": gbs, "%copy": 100 * gbs / copy_gbs})
    finally:
        swiglu.CONFIG.clear()
        swiglu.CONFIG.update(saved)
    return rows


def triton_next_pow2(x: int) -> int:
    return 1 << (int(x) - 1).bit_length()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (torch rows only): seconds")
    ap.add_argument("--out", type=Path, default=HERE / "out" / "kernels.json")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    ap.add_argument("--sweep-swiglu", action="store_true", help="CUDA: the SwiGLU kernels' launch configurations")
    cfg = ap.parse_args(argv)
    if cfg.sweep_swiglu:
        if not torch.cuda.is_available():
            ap.error("--sweep-swiglu needs CUDA")
        device = torch.device("cuda")
        copy_gbs = copy_bandwidth(1 << 31, device)
        rows = sweep_swiglu(device, cfg.iters or 10, copy_gbs)
        best = {}
        for r in rows:
            key = (r["shape"], r["kernel"])
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
        default = [r for r in rows if (r["rows"], r["block_f"], r["num_warps"]) == (4, 1024, 4)]
        print(table(default + list(best.values()), list(rows[0])), flush=True)
        write_json(cfg.out, {"benchmark": "swiglu_sweep", "command": " ".join(sys.argv), "env": environment(),
                             "shapes": SWEEP_SHAPES, "copy_GB/s": copy_gbs, "results": rows,
                             "best": list(best.values())})
        print(f"wrote {cfg.out}")
        return 0
    cuda = torch.cuda.is_available() and not cfg.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = FULL if cuda else SMOKE
    iters = cfg.iters or (20 if cuda else 2)
    copy_gbs = copy_bandwidth(1 << 31, device) if cuda else None
    rows = []
    for name, (inputs, impls, nbytes) in cases(shape, device, dtype).items():
        rows += measure(name, inputs, impls, nbytes, device, iters, copy_gbs, compile_=cuda and not cfg.no_compile)
        print(table([r for r in rows if r["op"] == name], list(rows[-1])), flush=True)
    payload = {"benchmark": "kernels", "smoke": cfg.smoke, "command": " ".join(sys.argv), "env": environment(),
               "shape": shape, "dtype": str(dtype), "copy_GB/s": copy_gbs, "iters": iters, "results": rows}
    write_json(cfg.out, payload)
    print(f"wrote {cfg.out}")
    # relative to the largest output: fp32 within float rounding; bf16 a few units of its 2^-8 rounding (torch
    # rounds intermediate results to bf16 where the kernels keep float32)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    bad = [r for r in rows if r["max_rel_vs_torch"] > tol]
    if bad:
        print(f"fused results differ from torch's beyond rounding: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
