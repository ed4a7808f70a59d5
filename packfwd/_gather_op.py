"""``packfwd::gather_rows``: the row gather of ``_rows`` as one Triton kernel on CUDA, as a torch custom op.

    out[i] = cat(srcs)[index[i] - index_offset]   where 0 <= index[i] - index_offset < len(srcs) * rows,
             fill                                 elsewhere.

The backward pass is the same gather run through ``inverse`` (the gathers packfwd plans are partial bijections,
so the transpose of a gather is a gather); the vmap rule moves the vmapped dimension of the sources behind the
row dimension, where the kernel sees it as part of the row.  Both are registered on the custom op (what
torch.compile uses) and on an autograd.Function around it (what eager torch.func.grad / vjp / jvp / vmap use:
they do not go through a custom op's registered autograd).  The CPU implementation is the plain-torch reference;
CUDA uses Triton when it is installed.

Why a kernel: torch's ``index_put_`` (the scatter back to ``[b, s]``) moves one element per thread with
per-element index arithmetic and reached 21 % of the copy bandwidth on an H200; here each program copies whole
rows as 8-byte words with 16-byte vector accesses, reads the index once per row, writes fill rows without reading
anything, and reads several CP ranks' outputs in place (89-91 % of the copy; benchmarks/RESULTS.md).

Outside autograd, functorch transforms and torch.compile, ``gather_rows`` launches the kernel directly: the
dispatcher and the autograd.Function only cost host time when nothing needs them.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

_MAX_SOURCES = 8
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@functools.cache
def kernel_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _reference(srcs: list[Tensor], index: Tensor, index_offset: int, fill: float) -> Tensor:
    src = srcs[0] if len(srcs) == 1 else torch.cat(srcs)
    k = index - index_offset if index_offset else index
    keep = (k >= 0) & (k < src.shape[0])
    out = src.index_select(0, torch.where(keep, k, 0))
    return torch.where(keep.view(-1, *[1] * (src.dim() - 1)), out, torch.full((), fill, dtype=src.dtype, device=src.device))


@torch.library.custom_op("packfwd::gather_rows", mutates_args=())
def gather_rows_op(
    srcs: list[Tensor], index: Tensor, index_offset: int, inverse: Tensor, inverse_offset: int, fill: float
) -> Tensor:
    """The gather above; ``inverse`` / ``inverse_offset`` describe the inverse map, used by the backward pass."""
    return _reference(srcs, index, index_offset, fill)


@gather_rows_op.register_kernel("cuda")
def _gather_rows_cuda(srcs, index, index_offset, inverse, inverse_offset, fill):
    if not kernel_available() or len(srcs) > _MAX_SOURCES or srcs[0].dtype.is_complex:
        return _reference(srcs, index, index_offset, fill)
    return _launch(srcs, index, index_offset, fill)


@gather_rows_op.register_fake
def _(srcs, index, index_offset, inverse, inverse_offset, fill):
    return srcs[0].new_empty((index.shape[0], *srcs[0].shape[1:]))


def _setup_context(ctx, inputs, output):
    srcs, index, index_offset, inverse, inverse_offset, _ = inputs
    ctx.save_for_backward(index, inverse)
    ctx.offsets = (index_offset, inverse_offset)
    ctx.rows = [s.shape[0] for s in srcs]


def _backward(ctx, grad):
    index, inverse = ctx.saved_tensors
    index_offset, inverse_offset = ctx.offsets
    g = gather_rows_op([grad], inverse, inverse_offset, index, index_offset, 0.0)
    return list(g.split(ctx.rows)), None, None, None, None, None


gather_rows_op.register_autograd(_backward, setup_context=_setup_context)


@gather_rows_op.register_vmap
def _vmap(info, in_dims, srcs, index, index_offset, inverse, inverse_offset, fill):
    src_dims = in_dims[0]
    if in_dims[1] is not None or in_dims[3] is not None:  # a batch of plans: one gather per plan
        outs = []
        for b in range(info.batch_size):
            pick = lambda t, d: t if d is None else t.select(d, b)  # noqa: E731
            outs.append(
                gather_rows_op(
                    [pick(s, d) for s, d in zip(srcs, src_dims)], pick(index, in_dims[1]), index_offset,
                    pick(inverse, in_dims[3]), inverse_offset, fill,
                )
            )
        return torch.stack(outs), 0
    # Batched sources: the vmapped dimension goes right behind the row dimension and is gathered with the row.
    moved = []
    for s, d in zip(srcs, src_dims):
        if d is None:
            s = s.unsqueeze(1).expand(s.shape[0], info.batch_size, *s.shape[1:])
        else:
            s = s.movedim(d, 1)
        moved.append(s.contiguous())
    return gather_rows_op(moved, index, index_offset, inverse, inverse_offset, fill), 1


def gather_rows(srcs, index: Tensor, inverse: Tensor, fill: float, *, index_offset: int = 0, inverse_offset: int = 0):
    """The op with autograd, as the transforms call it.  Eagerly through an autograd.Function, which composes with
    torch.func (grad, vjp, jvp, vmap); under torch.compile as the bare custom op, whose registered autograd and
    vmap rules the compiler uses."""
    if torch.compiler.is_compiling():
        return gather_rows_op(list(srcs), index, index_offset, inverse, inverse_offset, float(fill))
    plain = not torch._C._are_functorch_transforms_active() and not (
        torch.is_grad_enabled() and any(s.requires_grad for s in srcs)
    )
    if plain and srcs[0].is_cuda and kernel_available() and len(srcs) <= _MAX_SOURCES and not srcs[0].dtype.is_complex:
        return _launch(list(srcs), index, index_offset, fill)  # nothing to record: skip the dispatcher
    return _GatherRows.apply(index, index_offset, inverse, inverse_offset, float(fill), *srcs)


class _GatherRows(torch.autograd.Function):
    """``apply(index, index_offset, inverse, inverse_offset, fill, *srcs)``: the backward pass is the inverse gather,
    the forward-mode rule the same gather of the tangents."""

    generate_vmap_rule = True

    @staticmethod
    def forward(index, index_offset, inverse, inverse_offset, fill, *srcs):
        return gather_rows_op(list(srcs), index, index_offset, inverse, inverse_offset, fill)

    @staticmethod
    def setup_context(ctx, inputs, output):
        index, index_offset, inverse, inverse_offset, fill, *srcs = inputs
        ctx.save_for_backward(index, inverse)
        ctx.save_for_forward(index, inverse)
        ctx.offsets = (index_offset, inverse_offset)
        ctx.rows = [s.shape[0] for s in srcs]

    @staticmethod
    def backward(ctx, grad):
        index, inverse = ctx.saved_tensors
        index_offset, inverse_offset = ctx.offsets
        g = gather_rows([grad], inverse, index, 0.0, index_offset=inverse_offset, inverse_offset=index_offset)
        return (None, None, None, None, None, *g.split(ctx.rows))


    @staticmethod
    def jvp(ctx, *tangents):
        """Linear in the sources: the tangent is gathered like them, with 0 where the fill goes."""
        index, inverse = ctx.saved_tensors
        index_offset, inverse_offset = ctx.offsets
        ts = tangents[5:]
        ref = next(t for t in ts if t is not None)
        ts = [t if t is not None else ref.new_zeros((r, *ref.shape[1:])) for t, r in zip(ts, ctx.rows)]
        return gather_rows(ts, index, inverse, 0.0, index_offset=index_offset, inverse_offset=inverse_offset)


# ---------------------------------------------------------------------------------------------------- the kernel


def _kernel():
    from ._triton_kernels import gather_rows_kernel

    return gather_rows_kernel


def _word_size(srcs: list[Tensor]) -> int:
    """The widest word (<= 8 bytes) that every row and every source pointer is a multiple of."""
    row_bytes = srcs[0][0].numel() * srcs[0].element_size() if srcs[0].shape[0] else srcs[0].element_size()
    for w in (8, 4, 2, 1):
        if row_bytes % w == 0 and all(s.data_ptr() % w == 0 for s in srcs):
            return w
    return 1


# Tuning: bytes of one row that one program copies, and bytes per program (several rows when rows are short).
CONFIG = {"row_bytes": 8192, "tile_bytes": 32768, "num_warps": 8}


@functools.lru_cache(maxsize=256)
def _fill_bits(fill: float, dtype: torch.dtype, w: int) -> int:
    """The fill value repeated over one w-byte word, as that word's integer bits (what the kernel stores)."""
    return int(torch.full((w // dtype.itemsize,), fill, dtype=dtype).view(_WORDS[w]).item())


def _launch(srcs: list[Tensor], index: Tensor, index_offset: int, fill: float) -> Tensor:
    import triton

    src0 = srcs[0]
    rows = src0.shape[0]
    n_out = index.shape[0]
    out = src0.new_empty((n_out, *src0.shape[1:]))
    if out.numel() == 0:
        return out
    if rows == 0:  # nothing to read: every row is a fill row
        return out.fill_(fill)
    w = _word_size(srcs)
    word = _WORDS[w]
    flat = [s.contiguous().view(rows, -1).view(word) for s in srcs]  # rows as words of w bytes
    width = flat[0].shape[1]
    offsets = [(f.data_ptr() - flat[0].data_ptr()) // w for f in flat[1:]]
    offsets += [0] * (_MAX_SOURCES - 1 - len(offsets))
    block_w = min(triton.next_power_of_2(width), max(1, CONFIG["row_bytes"] // w))
    block_r = max(1, CONFIG["tile_bytes"] // w // block_w)
    grid = (triton.cdiv(n_out, block_r), triton.cdiv(width, block_w))
    _kernel()[grid](
        flat[0], *offsets, index, out.view(n_out, -1).view(word),
        n_out, rows, rows * len(srcs), index_offset, _fill_bits(float(fill), src0.dtype, w),
        WIDTH=width, NSRC=len(srcs), BLOCK_R=block_r, BLOCK_W=block_w, num_warps=CONFIG["num_warps"],
    )
    return out
