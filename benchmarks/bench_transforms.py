"""Applying packfwd's plans at memory bandwidth: unpad, pad, to_thd, from_thd (cp=1 and cp=2) on a
[b=64, s=4096, h=4096] bf16 batch at about half fill, against the copy bandwidth measured in the same run.

Bytes counted are the fewest any implementation must move: each real row read once and each output row written
once (unpad: t rows read + t written; pad and from_thd: t read + b*s written; to_thd: the rank's real rows read +
its t_local rows written).  Index tensors are not counted.

Backends (each checked equal to the torch path before it is timed):
  kernel       the Triton row-gather kernel behind the custom op (what CUDA tensors of >= 4 MiB use)
  torch        the plain-torch path (fill row appended, then indexed; what CPU and small tensors use)
  torch-index  torch's index kernels as packfwd used them before: index_select + index_fill_ for gathers,
               index_fill_ + index_put_ for scatters

Against a plain copy of the same bytes (``vs_copy``, the issue's target: each transform >= 90 % of it):
``--repeats`` independent passes over the transforms (the backend a user gets: the kernel on CUDA); in each pass
every transform is timed in ``--pairs`` rounds interleaved with two plain copies, so that clock and thermal drift
hit all three: ``copy`` reads as many bytes as the transform (the real rows) into a buffer as large as its output
and zero-fills the rest (unpad and to_thd cp1: a clone of the real tokens' rows; pad and from_thd: their write-heavy
mix), ``clone`` moves the same total half read, half written.  ``ratio``: copy ms / transform ms per pass (medians
of the rounds), then its median, min and max over the passes (``ratio_clone`` likewise).  Timings are queued (``common.device_ms``):
the stream waits on the device while the host enqueues the calls, so neither side is charged its host time (the
plain ``ms`` column keeps the old timing: ``back_to_back`` calls from an idle device, the first call's Python and
launch inside).

Also: flash-attn-style unpad_input / pad_input (nonzero + .item() + gathers) at the same size, planning times,
and a size sweep that sets the custom op's size threshold.

    PYTHONPATH=. python benchmarks/bench_transforms.py [--smoke] [--out DIR | --out FILE.json] [--repeats K]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    copy_bandwidth,
    device_ms,
    environment,
    pick_device,
    random_lengths,
    random_nonzero,
    right_padded_mask,
    sync,
    table,
    time_device,
    time_host,
    write_json,
)

from packfwd.ops import gather as _gather_op, plan as _plan_kernel
from packfwd.ops import gather as _rows
from packfwd import from_thd, pad, plan_thd, plan_unpad, to_thd, unpad  # noqa: E402


class backend:
    """Route every packfwd gather through one implementation for the duration of a ``with`` block."""

    def __init__(self, use_op: bool):
        self.use_op = use_op

    def __enter__(self):
        self.saved = _rows.use_op
        _rows.use_op = lambda src: self.use_op

    def __exit__(self, *exc):
        _rows.use_op = self.saved


class torch_planning:
    """Plan with the torch path (a dozen small kernels) instead of the Triton planning kernel."""

    def __enter__(self):
        self.saved = _plan_kernel.available
        _plan_kernel.available = lambda mask: False

    def __exit__(self, *exc):
        _plan_kernel.available = self.saved


def index_kernels(plans, x, packed, y1, ys2):
    """The pre-kernel formulation with torch's index kernels, per case (index tensors prepared outside timing)."""
    pu, thd1, thd2 = plans

    def gather(src, idx):
        keep = idx >= 0
        clamped, zero = idx.clamp(min=0), (~keep).nonzero().view(-1)

        def run():
            out = src.index_select(0, clamped)
            if zero.numel():
                out.index_fill_(0, zero, 0)
            return out

        return run

    def scatter(ys, inverse, index, rows):
        fill = (inverse < 0).nonzero().view(-1)
        local = ys[0].shape[0]
        dsts = [torch.where(index[k * local : (k + 1) * local] >= 0, index[k * local : (k + 1) * local], rows)
                for k in range(len(ys))]

        def run():
            canvas = ys[0].new_empty((rows + 1, *ys[0].shape[1:]))
            canvas.index_fill_(0, fill, 0)
            for y, d in zip(ys, dsts):
                canvas.index_put_((d,), y)
            return canvas[:rows]

        return run

    flat = x.reshape(-1, *x.shape[2:])
    rows = flat.shape[0]
    return {
        "unpad": gather(flat, pu.index),
        "pad": scatter([packed], pu.inverse, pu.index, rows),
        "to_thd cp1": gather(flat, thd1.gather_index),
        "from_thd cp1": scatter([y1], thd1.inverse, thd1.index, rows),
        "to_thd cp2 r0": gather(flat, thd2[0].gather_index),
        "from_thd cp2": scatter(ys2, thd2[0].inverse, thd2[0].index, rows),
    }


def transform_cases(x, mask):
    b, s = mask.shape
    pu = plan_unpad(mask)
    thd1 = plan_thd(mask)
    thd2 = [plan_thd(mask, cp_size=2, cp_rank=r) for r in range(2)]
    with backend(False):
        packed = unpad(x, pu)[0]
        y1 = to_thd(x, thd1)[0]
        ys2 = [to_thd(x, i)[0] for i in thd2]
    row = x[0, 0].numel() * x.element_size()
    t = pu.total
    real_r0 = int((thd2[0].gather_index >= 0).sum())
    cases = {
        "unpad": (lambda: unpad(x, pu)[0], 2 * t * row),
        "pad": (lambda: pad(packed, pu), (b * s + t) * row),
        "to_thd cp1": (lambda: to_thd(x, thd1)[0], (thd1.local_tokens + t) * row),
        "from_thd cp1": (lambda: from_thd(y1, thd1), (b * s + t) * row),
        "to_thd cp2 r0": (lambda: to_thd(x, thd2[0])[0], (thd2[0].local_tokens + real_r0) * row),
        "from_thd cp2": (lambda: from_thd(ys2, thd2[0]), (b * s + t) * row),
    }
    reads = {name: (real_r0 if name == "to_thd cp2 r0" else t) * row for name in cases}  # the real rows read
    return cases, index_kernels((pu, thd1, thd2), x, packed, y1, ys2), reads


def flash_style(x, mask):
    """flash-attn's bert_padding pair, written here: a nonzero and an .item() (host syncs), then gathers."""

    def unpad_input(hidden, attention_mask):
        seqlens = attention_mask.sum(-1, dtype=torch.int32)
        indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
        max_seqlen = int(seqlens.max().item())
        cu = torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
        return hidden.reshape(-1, *hidden.shape[2:])[indices], indices, cu, max_seqlen

    def pad_input(packed, indices, batch, seqlen):
        out = packed.new_zeros((batch * seqlen, *packed.shape[1:]))
        out[indices] = packed
        return out.reshape(batch, seqlen, *packed.shape[1:])

    b, s = mask.shape
    packed, indices, _, _ = unpad_input(x, mask)
    info = plan_unpad(mask)
    return {
        "flash-style unpad_input (plan + gather)": lambda: unpad_input(x, mask),
        "packfwd plan_unpad + unpad": lambda: unpad(x, mask),
        "flash-style pad_input": lambda: pad_input(packed, indices, b, s),
        "packfwd pad": lambda: pad(packed, info),
    }


def same_bytes_copy(x, nbytes: int, read: int | None = None):
    """A plain copy moving ``nbytes``.  ``read`` None: a ``clone()`` of the first ``nbytes / 2`` bytes of ``x`` (half
    read, half written).  Else the transform's own mix: ``read`` bytes of ``x`` copied into a new buffer of
    ``nbytes - read`` bytes whose rest is zero-filled (unpad, to_thd cp1: the clone of the real tokens' rows again;
    pad, from_thd: the real rows copied and the padding written, as they must)."""
    flat = x.reshape(-1)
    if read is None:
        src = flat[: min(flat.numel(), nbytes // 2 // x.element_size())]
        return lambda: src.clone()
    n_read, n_write = read // x.element_size(), (nbytes - read) // x.element_size()
    src = flat[:n_read]
    if n_write == n_read:
        return lambda: src.clone()

    def copy_and_fill():
        out = flat.new_empty(n_write)
        out[:n_read].copy_(src)
        out[n_read:].zero_()
        return out

    return copy_and_fill


def vs_copy(x, cases, reads, device, *, kernel: bool, repeats: int, pairs: int, back_to_back: int) -> list[dict]:
    """Each transform against copies of the same bytes, interleaved, over ``repeats`` passes (module docstring):
    ``ratio``: against the copy with the transform's read/write mix; ``ratio_clone``: against a clone (half read,
    half written)."""
    copies = {name: (same_bytes_copy(x, nbytes, reads[name]), same_bytes_copy(x, nbytes))
              for name, (_, nbytes) in cases.items()}
    samples = {name: [] for name in cases}  # per pass: (mix copy ms, clone ms, transform ms), medians of the pairs
    with backend(kernel):
        for name, (fn, _) in cases.items():  # warm-up (kernel compilation, allocator)
            fn(), copies[name][0](), copies[name][1]()
        sync(device)
        for _ in range(repeats):
            for name, (fn, _) in cases.items():
                m, c, t = [], [], []
                for _ in range(pairs):
                    m.append(device_ms(copies[name][0], device, back_to_back=back_to_back, queued=True))
                    c.append(device_ms(copies[name][1], device, back_to_back=back_to_back, queued=True))
                    t.append(device_ms(fn, device, back_to_back=back_to_back, queued=True))
                samples[name].append(tuple(statistics.median(v) for v in (m, c, t)))
    rows = []
    for name, (_, nbytes) in cases.items():
        mix, clone, ms = zip(*samples[name])
        ratios, clone_ratios = [a / b for a, b in zip(mix, ms)], [a / b for a, b in zip(clone, ms)]
        gbps = lambda v: nbytes / (statistics.median(v) * 1e-3) / 1e9  # noqa: E731
        rows.append({
            "transform": name, "backend": "kernel" if kernel else "torch", "GB": nbytes / 1e9,
            "GB read": reads[name] / 1e9, "GB/s_median": gbps(ms), "copy_GB/s_median": gbps(mix),
            "clone_GB/s_median": gbps(clone), "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "ratio_clone_median": statistics.median(clone_ratios),
            "ratio_clone_min": min(clone_ratios), "ratio_clone_max": max(clone_ratios), "ratios": ratios,
            "ratios_clone": clone_ratios, "transform_ms": list(ms), "copy_ms": list(mix), "clone_ms": list(clone),
        })
        rows[-1]["meets_0.9"] = rows[-1]["ratio_median"] >= 0.9
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (CI keeps the script working)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out",
                    help="folder for transforms.json (transforms_smoke.json), or a .json file")
    ap.add_argument("--repeats", type=int, default=None, help="independent passes of vs_copy (default 5; smoke 2)")
    ap.add_argument("--pairs", type=int, default=None,
                    help="interleaved (copy, transform) timings per transform and pass (default 10; smoke 2)")
    ap.add_argument("--sweep", action="store_true", help="also time a few shapes of the Triton kernel")
    args = ap.parse_args(argv)
    device = pick_device(args.smoke)
    b, s, h = (4, 64, 32) if args.smoke else (64, 4096, 4096)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    iters = 3 if args.smoke else 30
    repeats = args.repeats or (2 if args.smoke else 5)
    pairs = args.pairs or (2 if args.smoke else 10)
    lengths = random_lengths(b, s, seed=1)
    mask = right_padded_mask(lengths, s, device)
    x = random_nonzero((b, s, h), dtype, device, seed=2)
    result = {"env": environment(), "shape": [b, s, h], "dtype": str(dtype), "fill": sum(lengths) / (b * s)}
    copy = copy_bandwidth(x.numel() * x.element_size(), device, iters=iters)
    result["copy_GBps"] = copy
    print(f"device {result['env']['device']}  shape {b}x{s}x{h} {dtype}  fill {result['fill']:.3f}  copy {copy:.0f} GB/s")

    cases, index_cases, reads = transform_cases(x, mask)
    kernel = device.type == "cuda" and _gather_op.kernel_available()
    rows = []
    for name, (fn, nbytes) in cases.items():
        with backend(False):
            reference = fn()
        runs = {"torch": lambda fn=fn: fn(), "torch-index": index_cases[name]}
        if kernel:
            runs = {"kernel": fn, **runs}
        for label, run in runs.items():
            ctx = backend(label == "kernel")
            with ctx:
                out = run()
                ok = torch.equal(out.reshape(reference.shape), reference)
                del out
                ms = time_device(run, device, iters=iters, back_to_back=5)
                ms1 = time_device(run, device, iters=iters)
            gbps = nbytes / (ms * 1e-3) / 1e9
            rows.append({"transform": name, "backend": label, "ms": ms, "GB": nbytes / 1e9, "GB/s": gbps,
                         "% copy": 100 * gbps / copy, "ms 1 call": ms1, "equal": ok})
        del reference
    result["transforms"] = rows

    if kernel and args.sweep:  # a few kernel shapes, to check the default is near the best
        sweep = []
        for cfg in ({"row_bytes": 8192, "tile_bytes": 32768, "num_warps": 8},
                    {"row_bytes": 4096, "tile_bytes": 16384, "num_warps": 4},
                    {"row_bytes": 2048, "tile_bytes": 8192, "num_warps": 4},
                    {"row_bytes": 8192, "tile_bytes": 16384, "num_warps": 4}):
            saved = dict(_gather_op.CONFIG)
            _gather_op.CONFIG.update(cfg)
            with backend(True):
                for name, (fn, nbytes) in cases.items():
                    ms = time_device(fn, device, iters=iters, back_to_back=5)
                    sweep.append({**cfg, "transform": name, "ms": ms, "% copy": 100 * nbytes / (ms * 1e-3) / 1e9 / copy})
            _gather_op.CONFIG.clear()
            _gather_op.CONFIG.update(saved)
        result["kernel_configs"] = sweep

    result["vs_copy"] = vs_copy(x, cases, reads, device, kernel=kernel, repeats=repeats, pairs=pairs,
                                back_to_back=1 if args.smoke else 5)
    result["vs_copy_method"] = (
        f"{repeats} passes x {pairs} interleaved (copy, clone, transform) timings, queued; copy = the same bytes "
        "read (the real rows) and written (the rest zero-filled), clone = the same bytes half read half written; "
        "ratio = copy ms / transform ms per pass (medians of the pairs)")

    flash = []
    with backend(kernel):
        for name, fn in flash_style(x, mask).items():
            flash.append({"call": name, "ms (host, synced)": time_host(fn, device, iters=iters)})
    result["flash_style"] = flash

    plans = []
    for name, fn in {
        "plan_unpad": lambda: plan_unpad(mask),
        "plan_unpad seqlens": lambda: plan_unpad(mask, seqlens=lengths),
        "plan_thd cp1": lambda: plan_thd(mask),
        "plan_thd cp2": lambda: plan_thd(mask, cp_size=2, cp_rank=0),
        "plan_thd cp2 seqlens": lambda: plan_thd(mask, cp_size=2, cp_rank=0, seqlens=lengths),
    }.items():
        row = {"plan": name, "ms (host, synced)": time_host(fn, device, iters=iters)}
        if device.type == "cuda":
            with torch_planning():
                row["torch path ms"] = time_host(fn, device, iters=iters)
        plans.append(row)
    result["planning"] = plans

    if kernel:  # where the custom op starts to pay: both paths timed with their launch overhead
        sweep = []
        small_mask = right_padded_mask(random_lengths(64, 2048, seed=3), 2048, device)
        info = plan_thd(small_mask, tp_size=2, cp_size=2, cp_rank=0)
        for width in (1, 4, 16, 64, 256, 1024):
            xs = random_nonzero((64, 2048, width), torch.float32, device, seed=width)
            ys = [to_thd(xs, plan_thd(small_mask, tp_size=2, cp_size=2, cp_rank=r))[0] for r in range(2)]
            for use in (True, False):
                with backend(use):
                    sweep.append({
                        "MiB": xs.numel() * 4 / 2**20, "backend": "kernel" if use else "torch",
                        "to_thd ms": time_host(lambda: to_thd(xs, info), device, iters=iters),
                        "from_thd ms": time_host(lambda: from_thd(ys, info), device, iters=iters),
                    })
        result["size_sweep"] = sweep

    print(table(rows, ["transform", "backend", "ms", "GB", "GB/s", "% copy", "ms 1 call", "equal"]))
    print(f"vs a copy of the same bytes ({result['vs_copy_method']}):")
    print(table(result["vs_copy"], ["transform", "backend", "GB", "GB read", "GB/s_median", "copy_GB/s_median",
                                    "ratio_median", "ratio_min", "ratio_max", "ratio_clone_median", "meets_0.9"]))
    if "kernel_configs" in result:
        print(table(result["kernel_configs"], ["transform", "row_bytes", "tile_bytes", "num_warps", "ms", "% copy"]))
    print(table(flash, ["call", "ms (host, synced)"]))
    print(table(plans, ["plan", "ms (host, synced)", "torch path ms"]))
    if "size_sweep" in result:
        print(table(result["size_sweep"], ["MiB", "backend", "to_thd ms", "from_thd ms"]))
    path = args.out if args.out.suffix == ".json" else args.out / ("transforms_smoke.json" if args.smoke else "transforms.json")
    write_json(path, result)
    print(f"wrote {path}")
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
