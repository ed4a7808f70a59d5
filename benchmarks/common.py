"""Timing helpers shared by the benchmarks.

* ``time_device``: device time of a bandwidth-bound call: CUDA events around each call, warm-up first, median.
* ``time_host``: wall-clock time of a call that is bound by the host (planning: many tiny kernels and a sync),
  with the device drained before and after each call, median.
* ``random_nonzero`` / ``random_lengths``: fresh random data, never zeros (zeros hide unwritten rows and can run
  faster than real data).
* ``copy_bandwidth``: the ceiling every data-moving result is compared with, measured in the same run
  (a device-to-device copy, bytes read plus bytes written).
* ``environment`` / ``write_json`` / ``table``: what every result is recorded with.
* ``graph_replay``: a step captured once as a CUDA graph, replayed with its plan copied in.
* ``skip_reason``: what a row that could not run records (out of memory above all), the device's cache emptied:
  every benchmark records such a row and goes on.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from importlib import metadata
from pathlib import Path
from typing import Callable, Sequence

import torch

GiB = 1 << 30


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_device(
    fn: Callable[[], object], device: torch.device, *, warmup: int = 3, iters: int = 20, back_to_back: int = 1,
    queued: bool = False,
) -> float:
    """Median milliseconds per call of ``fn()`` on the device: CUDA events around ``back_to_back`` consecutive
    calls (1: one call on an idle device, its launch overhead included; more: the device's own time per call,
    launches overlapping the previous call's work as in a training step).  Host clock on the CPU.
    ``queued``: see :func:`device_ms`."""
    for _ in range(warmup):
        fn()
    sync(device)
    return statistics.median(device_ms(fn, device, back_to_back=back_to_back, queued=queued) for _ in range(iters))


# A device-side wait long enough for the host to enqueue a few calls behind it (~1 ms at H200 clocks).
QUEUE_CYCLES = 2_000_000


def device_ms(fn: Callable[[], object], device: torch.device, *, back_to_back: int = 1, queued: bool = False) -> float:
    """Milliseconds per call of ``back_to_back`` consecutive calls, one sample (CUDA events; host clock on the CPU).

    ``queued=True`` (CUDA): the stream first waits on the device (``torch.cuda._sleep``) while the host enqueues the
    start event and the calls, so that the events time the device's work alone: without it the first call's host
    time (Python, launch) is inside the timed region, a bias against calls with more host work than a ``copy_``."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(back_to_back):
            fn()
        return (time.perf_counter() - t0) * 1e3 / back_to_back
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if queued and hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(QUEUE_CYCLES)
    start.record()
    for _ in range(back_to_back):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / back_to_back


def time_host(fn: Callable[[], object], device: torch.device, *, warmup: int = 3, iters: int = 20) -> float:
    """Median wall-clock milliseconds of ``fn()``, from an idle device to an idle device."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def random_nonzero(shape: Sequence[int], dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """Random values in +-[0.5, 1.5) (floats) or [1, 30000) (integers): no zeros."""
    g = torch.Generator(device=device).manual_seed(seed)
    if dtype.is_floating_point:
        x = torch.rand(shape, generator=g, device=device, dtype=torch.float32) + 0.5
        sign = torch.randint(0, 2, shape, generator=g, device=device) * 2 - 1
        return (x * sign).to(dtype)
    return torch.randint(1, 30000, shape, generator=g, device=device, dtype=torch.int64).to(dtype)


def random_lengths(b: int, s: int, seed: int) -> list[int]:
    """Lengths uniform in [1, s]: about half fill on average."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, s + 1, (b,), generator=g).tolist()


def right_padded_mask(lengths: Sequence[int], s: int, device: torch.device) -> torch.Tensor:
    return torch.arange(s, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]


def copy_bandwidth(nbytes: int, device: torch.device, *, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = random_nonzero((nbytes // 2,), torch.bfloat16, device, 0)
    dst = torch.empty_like(src)
    ms = time_device(lambda: dst.copy_(src), device, iters=iters)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def environment() -> dict:
    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron-core": version("megatron-core") or version("megatron_core"),
        "triton": version("triton"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "cuda": torch.version.cuda,
    }
    return env


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str))


def table(rows: list[dict], columns: Sequence[str]) -> str:
    """A plain-text table of ``rows`` (dicts) in the given column order; floats with 3 significant digits."""

    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return "" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def pick_device(smoke: bool) -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")


def graph_replay(body: Callable[[], object], model: torch.nn.Module, captured, plan: Callable[[], object],
                 warmup: int = 2) -> Callable[[], object]:
    """``body`` (a whole step that packs with the plan ``captured``) warmed up on a side stream, captured as one
    CUDA graph; the returned step copies a new ``plan()`` into ``captured`` and replays (its ``.graph`` the graph).
    ``torch._grouped_mm`` calls made while capturing are counted in ``.grouped_mm_calls`` (a replay calls no
    Python)."""
    from packfwd.layout.bucket import copy_plan_

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):  # kernels compiled, cuDNN graphs built, outside the capture
            body()
            model.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    graph, calls, original = torch.cuda.CUDAGraph(), [], getattr(torch, "_grouped_mm", None)
    if original is not None:
        torch._grouped_mm = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        with torch.cuda.graph(graph):
            out = body()  # the parameters' .grad are the graph's: each replay writes them anew
    finally:
        if original is not None:
            torch._grouped_mm = original

    def step():
        copy_plan_(captured, plan())
        graph.replay()
        return out

    step.graph, step.grouped_mm_calls = graph, len(calls)
    return step


def skip_reason(error: BaseException) -> str:
    """The reason a row records when its measurement raised: ``"skipped: out of memory (...)"`` for a CUDA
    out-of-memory error, else ``"failed: <type>: <message>"``; the CUDA cache is emptied so the next row starts
    clean."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    first = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return f"skipped: out of memory ({first})"
    return f"failed: {type(error).__name__}: {first}"
