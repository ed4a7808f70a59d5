"""Where a batch's real tokens live before packing: a padded ``[b, s, *]`` tensor with a mask, or a jagged
``torch.nested`` tensor.  Every layout plan starts here.

Planning is host-bound (many tiny tensors), so it is built to launch few kernels:

1. the real lengths reach the host in ONE transfer (none when the mask is on the CPU, or when the caller
   passes ``seqlens``: then the device lengths are checked against them asynchronously, without a sync);
2. on CUDA with Triton, one kernel then writes every per-token map of the layout (``packfwd.ops.plan``);
3. elsewhere (the torch path, also the reference), every per-sequence quantity is computed on the host and
   uploaded in ONE asynchronous copy, and the per-token maps are a handful of elementwise kernels over the
   canvas (``TokenSource.rank_in_row``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from .._validate import MASK_VALUES_MESSAGE, check_host_seqlens, check_mask, check_tensor
from ..ops import plan as plan_kernel

# Given the real lengths [b] on the host (an int64 numpy array), a layout returns the Python ints that fix its
# shapes and the host int64 arrays it needs on the device.
LayoutFn = Callable[[np.ndarray], tuple[Sequence[int], Sequence[np.ndarray]]]


@dataclass(frozen=True)
class TokenSource:
    """The real tokens of a batch, as flat rows of a "canvas" (``x`` viewed as ``[b*s, *]``, or nested values)."""

    lengths: Tensor  # [b] int64, real tokens per row
    cu_seqlens: Tensor  # [b+1] int32
    mask: Tensor | None  # [b, s] bool; a bool mask is the caller's own, read by planning only (None if nested)
    row_ids: Tensor | None  # [t] int64, the row of each canvas row (nested input only)
    batch_size: int
    seq_len: int  # s (for nested input: the longest row)
    canvas_rows: int
    total: int  # t
    nested_offsets: Tensor | None  # [b+1] for nested input, else None

    def rank_in_row(self, row_offset: Tensor | None = None) -> Tensor:
        """For each canvas row: how many real tokens of its row come up to and including it (1-based position of
        a real token in its sequence), plus ``row_offset[row]`` if given.  Shape [b, s] (or [t] nested)."""
        if self.mask is not None:
            counts = self.mask.cumsum(1)
            return counts if row_offset is None else counts + row_offset[:, None]
        base = self.nested_offsets[:-1] if row_offset is None else self.nested_offsets[:-1] - row_offset
        return torch.arange(1, self.canvas_rows + 1, device=base.device) - base[self.row_ids]

    def per_row(self, table: Tensor) -> Tensor:
        """``table [b]`` broadcast to the canvas shape ([b, 1] for padded input, [t] for nested)."""
        return table[:, None] if self.mask is not None else table[self.row_ids]

    def where_real(self, value: Tensor, other: int) -> Tensor:
        """``value`` at real tokens, ``other`` at padding, flattened to the canvas rows."""
        if self.mask is None:
            return value.reshape(-1)
        return torch.where(self.mask, value, other).reshape(-1)


class PlanOfSource:
    """The batch facts every layout plan exposes, read from its ``source`` field."""

    source: TokenSource

    @property
    def batch_size(self) -> int:
        """``b``: rows of the caller's batch."""
        return self.source.batch_size

    @property
    def seq_len(self) -> int:
        """``s``: the caller's padded length (for nested input, the longest row)."""
        return self.source.seq_len


def is_nested(x: object) -> bool:
    return isinstance(x, Tensor) and x.is_nested


@dataclass(frozen=True)
class Lengths:
    """A padded batch's validated mask with its real lengths, on the device and on the host."""

    mask: Tensor  # [b, s] as given (bool or integer 0/1)
    lengths: Tensor  # [b] int64 on the mask's device, mask.sum(-1)
    host: np.ndarray  # [b] int64: the same lengths (synced once), or the caller's seqlens
    from_caller: bool  # host came from ``seqlens`` (to be checked on the device, asynchronously)

    @property
    def is_int(self) -> bool:
        return self.mask.dtype != torch.bool


def read_lengths(x: Tensor | None, attention_mask: Tensor | None, seqlens: object) -> Lengths:
    """Validate a padded batch's mask and learn its lengths on the host: the planning step's one sync (none for a
    CPU mask or with ``seqlens``)."""
    if attention_mask is None:
        raise TypeError("attention_mask is required for a padded x; pass the [b, s] mask (or a jagged nested x)")
    if x is not None:
        check_tensor("x", x)
    mask = check_mask(attention_mask, x)
    batch, seq_len = mask.shape
    lengths = mask.sum(1, dtype=torch.long)
    is_int = mask.dtype != torch.bool
    if seqlens is not None:
        host = _host_seqlens(seqlens, batch)
        if host.size and host.max() > seq_len:
            raise ValueError(f"seqlens has an entry larger than the mask width s={seq_len}")
        return Lengths(mask, lengths, host, True)
    extra = [torch.stack(torch.aminmax(mask)).to(torch.long)] if is_int and mask.numel() else []
    host = to_host(torch.cat([lengths, *extra]) if extra else lengths)  # the one sync
    if extra:
        host, (lo, hi) = host[:batch], host[batch:].tolist()
        if lo < 0 or hi > 1:
            raise ValueError(MASK_VALUES_MESSAGE)
    return Lengths(mask, lengths, host, False)


def _host_seqlens(seqlens: object, batch: int) -> np.ndarray:
    if isinstance(seqlens, (list, tuple)):  # fast path: validated with numpy
        arr = np.asarray(seqlens)
        if arr.ndim == 1 and arr.dtype.kind in "iu" and arr.shape[0] == batch and (not arr.size or arr.min() >= 0):
            return arr.astype(np.int64, copy=False)
    return np.asarray(check_host_seqlens(seqlens, batch), dtype=np.int64).reshape(-1)


def checked_lengths(src: Lengths) -> Tensor:
    """The lengths to plan with on the device: the mask's own, or the caller's ``seqlens`` uploaded and checked
    against the mask asynchronously (a wrong ``seqlens`` raises at a later sync, not silently)."""
    if not src.from_caller:
        return src.lengths
    host = to_device(src.host, src.mask.device)
    if src.is_int:
        torch._assert_async(((src.mask == 0) | (src.mask == 1)).all(), MASK_VALUES_MESSAGE)
    torch._assert_async((src.lengths == host).all(), SEQLENS_MESSAGE)
    return host


def padded_source(src: Lengths, cu_seqlens: Tensor) -> TokenSource:
    batch, seq_len = src.mask.shape
    return TokenSource(
        lengths=src.lengths,
        cu_seqlens=cu_seqlens,
        mask=src.mask if not src.is_int else src.mask.ne(0),
        row_ids=None,
        batch_size=batch,
        seq_len=seq_len,
        canvas_rows=batch * seq_len,
        total=int(src.host.sum()),
        nested_offsets=None,
    )


SEQLENS_MESSAGE = ("seqlens does not match attention_mask.sum(-1); pass the real length of every row (run_micro_batches "
                   "passes plan.seqlens: plan the micro-batches from this attention_mask's row lengths)")

COMPILE_MESSAGE = ("packfwd plans a layout on the host, which torch.compile cannot trace: plan outside the compiled "
                   "function (info = plan_thd(mask), or plan_bshd / plan_unpad) and pass the plan in (to_thd(x, info))")
_BREAK_MESSAGE = {"msg": COMPILE_MESSAGE} if torch.__version__ >= (2, 11) else {}  # seen in 2.11


def plan(
    x: Tensor | None,
    attention_mask: Tensor | None,
    seqlens: object,
    *,
    host_layout: LayoutFn,
    build: Callable[[TokenSource, list[int], list[Tensor]], Any],
    device_plan: Callable[[Lengths], Any] | None = None,
):
    """The planning driver every layout uses: validate the input and learn its lengths once, then plan.

    ``host_layout(lengths)`` is the layout's index function on the host (see ``LayoutFn``); its arrays are uploaded
    in one copy and ``build(source, ints, arrays)`` turns them into the layout's plan.  ``device_plan(lengths)``,
    when the layout has one, plans a padded CUDA batch in one Triton kernel instead (``packfwd.ops.plan``).
    Under ``torch.compile`` it is a graph break and runs eagerly; ``fullgraph=True`` raises ``COMPILE_MESSAGE``.
    """
    if torch.compiler.is_compiling():  # False in eager code: no cost, and torch._dynamo is not imported
        import torch._dynamo as dynamo
        dynamo.graph_break(**_BREAK_MESSAGE)  # numpy and the host read of the lengths cannot be traced
        return torch.compiler.disable(plan)(
            x, attention_mask, seqlens, host_layout=host_layout, build=build, device_plan=device_plan)
    if x is not None and is_nested(x):
        if attention_mask is not None:
            raise ValueError("x is a nested (jagged) tensor, which carries its own lengths; pass attention_mask=None")
        return build(*_plan_nested(x, seqlens, host_layout))
    src = read_lengths(x, attention_mask, seqlens)
    if device_plan is not None and plan_kernel.available(src.mask):
        return device_plan(src)
    return build(*plan_padded(src, host_layout))


def plan_padded(src: Lengths, layout: LayoutFn) -> tuple[TokenSource, list[int], list[Tensor]]:
    """The torch planning path for a padded batch whose lengths are known."""
    ints, arrays = layout(src.host)
    on_device = src.mask.device.type != "cpu"
    if src.from_caller and not on_device:  # CPU: the check is free, and raises here
        if src.is_int and not ((src.mask == 0) | (src.mask == 1)).all():
            raise ValueError(MASK_VALUES_MESSAGE)
        if not np.array_equal(src.lengths.numpy(), src.host):
            raise ValueError(SEQLENS_MESSAGE)
    check = src.from_caller and on_device
    cu_seqlens, *device_arrays = _upload(src.mask.device, [cumsum0(src.host), *arrays, *([src.host] if check else [])])
    if check:  # verified on the device, raising later (asynchronously) if the caller's lengths were wrong
        if src.is_int:
            torch._assert_async(((src.mask == 0) | (src.mask == 1)).all(), MASK_VALUES_MESSAGE)
        torch._assert_async((src.lengths == device_arrays.pop()).all(), SEQLENS_MESSAGE)
    return padded_source(src, cu_seqlens.to(torch.int32)), list(ints), device_arrays


def _plan_nested(x: Tensor, seqlens: object, layout: LayoutFn) -> tuple[TokenSource, list[int], list[Tensor]]:
    if x.layout != torch.jagged:
        raise TypeError("nested x must use layout=torch.jagged (torch.nested.nested_tensor(..., layout=torch.jagged))")
    if x._ragged_idx != 1:
        raise ValueError("nested x must be ragged in dim 1 ([b, j, *]); transpose it so dim 1 is the ragged one")
    check_compact(x)
    offsets = x.offsets().to(torch.long)
    lengths = offsets.diff()
    total = x.values().shape[0]
    if seqlens is not None:
        host_lengths = np.asarray(check_host_seqlens(seqlens, x.size(0)), dtype=np.int64).reshape(-1)
        torch._assert_async(
            (lengths == to_device(host_lengths, lengths.device)).all(), "seqlens does not match x.offsets()"
        )
    else:
        host_lengths = to_host(lengths)
    ints, arrays = layout(host_lengths)
    device_arrays = _upload(offsets.device, list(arrays))
    b = x.size(0)
    source = TokenSource(
        lengths=lengths,
        cu_seqlens=offsets.to(torch.int32),
        mask=None,
        row_ids=torch.repeat_interleave(torch.arange(b, device=offsets.device), lengths, output_size=total),
        batch_size=b,
        seq_len=int(host_lengths.max()) if b else 0,
        canvas_rows=total,
        total=total,
        nested_offsets=offsets,
    )
    return source, list(ints), device_arrays


def _upload(device: torch.device, arrays: list[np.ndarray]) -> list[Tensor]:
    """Host int64 arrays to ``device`` in one asynchronous copy; returns views of the uploaded block."""
    if not arrays:
        return []
    sizes = [a.size for a in arrays]
    block = to_device(np.concatenate([a.reshape(-1) for a in arrays]).astype(np.int64, copy=False), device)
    return [part.view(a.shape) for part, a in zip(block.split(sizes), arrays)]


def canvas_rows_of(x: Tensor, source: TokenSource) -> Tensor:
    """``x`` as the flat canvas ``[canvas_rows, *]`` the source indexes into."""
    if source.nested_offsets is not None:
        if not is_nested(x):
            raise TypeError("this plan was made from a nested tensor; pass a nested x with the same offsets")
        _check_same_rows(x, source)
        return x.values()
    if is_nested(x):
        raise TypeError("x is a nested tensor but this plan was made from a padded attention_mask; pass x padded "
                        f"[{source.batch_size}, {source.seq_len}, ...], or plan from the nested tensor")
    if x.dim() < 2 or (x.shape[0], x.shape[1]) != (source.batch_size, source.seq_len):
        raise ValueError(f"x has shape {tuple(x.shape)} but the plan was made for [b={source.batch_size}, "
                         f"s={source.seq_len}, ...]; pass x shaped like the attention_mask the plan was made from")
    return x.reshape(source.canvas_rows, *x.shape[2:])


def check_compact(x: Tensor) -> None:
    """A nested ``x`` whose ``values()`` are its tokens: not a ``torch.nested.narrow`` view with gaps."""
    if getattr(x, "_lengths", None) is not None:  # torch.nested.narrow's view: values() holds the gaps too
        raise ValueError("nested x is a narrowed view with gaps between its rows (x.lengths() is set), whose "
                         "values() are not its tokens; pass x.contiguous()")


_ROWS_MESSAGE = ("a nested x's rows are not the plan's: its offsets differ from those of the nested tensor the plan "
                 "was made from; pass x jagged like it (the same lengths, row by row)")


def _check_same_rows(x: Tensor, source: TokenSource) -> None:
    """A nested ``x`` has the plan's rows: its token count and row count on the host, its offsets (unless they are
    the plan's own tensor) compared at once on the CPU, by an asynchronous device assert elsewhere."""
    check_compact(x)
    if x.size(0) != source.batch_size or x.values().shape[0] != source.total:
        raise ValueError(f"nested x has {x.size(0)} rows and {x.values().shape[0]} tokens but the plan was made for "
                         f"{source.batch_size} rows and {source.total} tokens; pass x jagged like the tensor the plan "
                         "was made from")
    offsets, planned = x.offsets(), source.nested_offsets
    compiling = torch.compiler.is_compiling()  # no pointer read in a trace: the device assert alone
    if offsets is planned or (not compiling and offsets.data_ptr() == planned.data_ptr()):
        return
    same = offsets.to(device=planned.device, dtype=torch.long) == planned
    if planned.device.type == "cpu" and not compiling:
        if not bool(same.all()):
            raise ValueError(_ROWS_MESSAGE)
    else:
        torch._assert_async(same.all(), _ROWS_MESSAGE)


def from_canvas(canvas: Tensor, source: TokenSource) -> Tensor:
    """The inverse of ``canvas_rows_of``: ``[b, s, *]``, or a jagged nested tensor for nested sources."""
    if source.nested_offsets is not None:
        return torch.nested.nested_tensor_from_jagged(canvas, source.nested_offsets)
    return canvas.reshape(source.batch_size, source.seq_len, *canvas.shape[1:])


def scatter_inverse(inverse: Tensor, rows: int, canvas_rows: int) -> Tensor:
    """The forward map of a layout from its inverse: ``out[inverse[c]] = c`` for every canvas row ``c`` with
    ``inverse[c] >= 0``; -1 at the ``rows`` positions nothing maps to.  (One spare slot takes the -1 entries.)"""
    out = torch.full((rows + 1,), -1, dtype=torch.long, device=inverse.device)
    out.scatter_(0, inverse.remainder(rows + 1), torch.arange(canvas_rows, device=inverse.device))
    return out[:rows]


# ------------------------------------------------------------------------------------------ host <-> device


PLAN_UNDER_VMAP_MESSAGE = ("packfwd plans a layout from one batch's lengths, which torch.func.vmap would batch: make "
                           "the plan outside vmap (plan = packfwd.plan_thd(attention_mask), ...) and apply it inside")


def to_host(values: Tensor) -> np.ndarray:
    """A 1-D device tensor as a host int64 array: the planning step's single sync (free for CPU tensors).  Inside
    ``torch.func.grad`` / ``vjp`` / ``jvp`` the lengths (integers: nothing to differentiate) are read through the
    transforms' wrappers; under ``vmap`` planning is refused (:data:`PLAN_UNDER_VMAP_MESSAGE`)."""
    functorch = torch._C._functorch
    if not functorch.is_functorch_wrapped_tensor(values):
        return values.cpu().numpy().astype(np.int64, copy=False)
    while functorch.is_functorch_wrapped_tensor(values):
        if functorch.is_batchedtensor(values):
            raise ValueError(PLAN_UNDER_VMAP_MESSAGE)
        values = functorch.get_unwrapped(values)
    with torch._C._DisableFuncTorch():  # the read itself outside the transforms (they would wrap its result)
        return values.cpu().numpy().astype(np.int64, copy=False)


def to_device(host: np.ndarray, device: torch.device) -> Tensor:
    """Upload a small host array (int64, or float64 weights) without a sync: through pinned memory,
    asynchronously."""
    t = torch.from_numpy(host)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def cumsum0(lengths: np.ndarray) -> np.ndarray:
    """``[0, l0, l0+l1, ...]`` (host int64)."""
    out = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out
