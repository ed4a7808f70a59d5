"""The row gather every layout applies: plain torch everywhere, one Triton kernel on CUDA.

Every packfwd layout moves whole rows (tokens) of a flattened ``[rows, *]`` tensor, and every move is one gather::

    out[i] = cat(srcs)[index[i] - index_offset]   where 0 <= index[i] - index_offset < len(srcs) * rows,
             fill                                 elsewhere (the plans mark a padding row with -1)

with ``index`` fixed by the plan.  The inverse move is the same gather with the inverse index, so applying a plan
reads each real row once and writes each output row once, and the backward pass of a gather is again a gather
(the plans are partial bijections, so the transpose of a gather is the gather through ``inverse``).

Two implementations compute it bit for bit alike, and ``gather_rows`` picks one:

* everywhere, and on CUDA below ``KERNEL_MIN_BYTES``: plain torch in one to three small ops
  (``gather_rows_torch``), cheaper than a kernel launch for small tensors, and the reference;
* on CUDA from ``KERNEL_MIN_BYTES`` on: the custom op ``packfwd::gather_rows`` around one Triton kernel, a
  single pass at memory bandwidth.

The custom op.  Its backward pass gathers through ``inverse``; its vmap rule moves the vmapped dimension of the
sources behind the row dimension, where the kernel sees it as part of the row.  Both are registered on the op
(what torch.compile uses) and on an autograd.Function around it (what eager torch.func.grad / vjp / jvp / vmap
use: they do not go through a custom op's registered autograd).  Outside autograd, functorch transforms and
torch.compile, the kernel is launched directly: the dispatcher and the autograd.Function only cost host time
when something needs them.  The op's CPU implementation is the torch reference (``_reference``).

The kernel.  torch's ``index_put_`` (the scatter back to ``[b, s]``) moves one element per thread with
per-element index arithmetic and reached 21 % of the copy bandwidth on an H200; here each program copies whole
rows as words of up to 8 bytes with 16-byte vector accesses, reads the index once per row, writes fill rows
without reading anything, and reads several CP ranks' outputs in place, each source addressed by its offset
from the first (89-91 % of the copy; benchmarks/RESULTS.md).  It is tested on the GPU and, in Triton's
interpreter, on the CPU (``tests/gpu/test_gather_kernel.py``).

One file holds the whole gather (dispatch, torch path, custom op with its autograd and vmap rules, the kernel
and its launcher): splitting it would scatter one mechanism.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never launch these (importing this module must still work)
    triton = None

# Sources smaller than this take the torch path on CUDA too: for them launch overhead, not bytes, is the cost
# (measured on an H200: the kernel wins from about 64 MiB; benchmarks/RESULTS.md).
KERNEL_MIN_BYTES = 64 << 20


def gather_rows(
    srcs: Sequence[Tensor], index: Tensor, inverse: Tensor, fill_value: float = 0, *, inverse_offset: int = 0,
    dense: bool = False, expand: bool = False,
) -> Tensor:
    """``out[i] = cat(srcs)[index[i]]`` (``fill_value`` where ``index[i] == -1``).  srcs: k x [n, *] -> [len(index), *].

    ``inverse`` is the inverse map (``index[inverse[j] - inverse_offset] == j`` wherever that is in range, -1
    elsewhere): the custom op's backward pass gathers through it, and the torch path scatters through it when
    that is cheaper.  ``dense``: ``index`` has no -1 (nothing to fill).  ``expand``: the move back to a larger
    layout (pad, from_thd, from_bshd), whose ``inverse`` sends every source row to a row of this output or -1.
    """
    if use_op(srcs[0]):
        return _op_gather_rows(srcs, index, inverse, fill_value, inverse_offset=inverse_offset)
    return gather_rows_torch(srcs, index, inverse, fill_value, dense=dense, expand=expand)


def take_rows(src: Tensor, index: Tensor) -> Tensor:
    """``src.index_select(0, index)`` for an ``index`` with every entry in range (rows may repeat), by the kernel on
    CUDA when the output is large (from ``KERNEL_MIN_BYTES``), bit for bit the same.  No autograd of its own: for
    the forward or backward of a caller's ``autograd.Function`` (the MoE permutation, whose rows repeat a token
    ``top_k`` times, so its backward is a sum, not a gather)."""
    nbytes = index.numel() * (src[0].numel() if src.shape[0] else 0) * src.element_size()
    if src.is_cuda and _kernel_takes([src]) and nbytes >= KERNEL_MIN_BYTES:
        return _launch([src], index.long(), 0, 0.0)
    return src.index_select(0, index)


def use_op(src: Tensor) -> bool:
    """Whether a gather from ``src`` goes through the custom op (CUDA, Triton installed, large enough)."""
    return src.is_cuda and kernel_available() and src.numel() * src.element_size() >= KERNEL_MIN_BYTES


def gather_rows_torch(
    srcs: Sequence[Tensor], index: Tensor, inverse: Tensor, fill_value: float = 0, *, dense: bool = False,
    expand: bool = False,
) -> Tensor:
    """The same gather in one to three plain torch ops (autograd, vmap and compile native).

    Dense: one index.  Expand (pad, from_thd, from_bshd): the sources scattered into a filled canvas through
    ``inverse``, -1 landing in a spare row that is cut off.  Otherwise: the sources with one fill row appended,
    indexed (-1 picks the fill row).
    """
    src = srcs[0] if len(srcs) == 1 else torch.cat(list(srcs))
    if dense:
        return src[index]
    n = index.shape[0]
    if expand:
        canvas = src.new_full((n + 1, *src.shape[1:]), fill_value)
        canvas.index_put_((inverse,), src)  # index_put_ (unlike index_copy_) has a vmap batching rule
        return canvas[:n]
    fill = src.new_full((1, *src.shape[1:]), fill_value)
    return torch.cat([src, fill])[index]


# ------------------------------------------------------------------------------------------------ the custom op

_MAX_SOURCES = 8  # the kernel takes the first source's pointer and the others' offsets from it


def kernel_available() -> bool:
    """Whether Triton is installed (the kernel itself runs on CUDA, or on the CPU in Triton's interpreter)."""
    return triton is not None


def _kernel_takes(srcs: Sequence[Tensor]) -> bool:
    """Whether the kernel can gather from these sources (any dtype moves as words, except complex ones)."""
    return kernel_available() and len(srcs) <= _MAX_SOURCES and not srcs[0].dtype.is_complex


def _reference(srcs: list[Tensor], index: Tensor, index_offset: int, fill: float) -> Tensor:
    """The op in plain torch (its CPU implementation, and the kernel's reference in the tests)."""
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
    if _kernel_takes(srcs):
        return _launch(srcs, index, index_offset, fill)
    return _reference(srcs, index, index_offset, fill)


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


_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _op_gather_rows(srcs, index: Tensor, inverse: Tensor, fill: float, *, index_offset: int = 0, inverse_offset: int = 0):
    """The op with autograd, as the transforms call it.  Eagerly through an autograd.Function, which composes with
    torch.func (grad, vjp, jvp, vmap); under torch.compile as the bare custom op, whose registered autograd and
    vmap rules the compiler uses."""
    if torch.compiler.is_compiling():
        return gather_rows_op(list(srcs), index, index_offset, inverse, inverse_offset, float(fill))
    plain = not torch._C._are_functorch_transforms_active() and not (
        torch.is_grad_enabled() and any(s.requires_grad for s in srcs)
    )
    # A pullback of torch.func.vjp runs after its transform has ended, with the plan tensors it saved still
    # wrapped (no storage for the kernel): only the dispatcher unwraps those.
    plain = plain and not any(_is_functorch_wrapped(t) for t in (index, *srcs))
    if plain and srcs[0].is_cuda and _kernel_takes(srcs):
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
        g = _op_gather_rows([grad], inverse, index, 0.0, index_offset=inverse_offset, inverse_offset=index_offset)
        return (None, None, None, None, None, *g.split(ctx.rows))

    @staticmethod
    def jvp(ctx, *tangents):
        """Linear in the sources: the tangent is gathered like them, with 0 where the fill goes."""
        index, inverse = ctx.saved_tensors
        index_offset, inverse_offset = ctx.offsets
        ts = tangents[5:]
        ref = next(t for t in ts if t is not None)
        ts = [t if t is not None else ref.new_zeros((r, *ref.shape[1:])) for t, r in zip(ts, ctx.rows)]
        return _op_gather_rows(ts, index, inverse, 0.0, index_offset=index_offset, inverse_offset=inverse_offset)


# ---------------------------------------------------------------------------------------------------- the kernel

# Tuning: bytes of one row that one program copies, and bytes per program (several rows when rows are short).
CONFIG = {"row_bytes": 8192, "tile_bytes": 32768, "num_warps": 8}

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _word_size(srcs: list[Tensor]) -> int:
    """The widest word (<= 8 bytes) that every row and every source pointer is a multiple of."""
    row_bytes = srcs[0][0].numel() * srcs[0].element_size() if srcs[0].shape[0] else srcs[0].element_size()
    for w in (8, 4, 2, 1):
        if row_bytes % w == 0 and all(s.data_ptr() % w == 0 for s in srcs):
            return w
    return 1


def _fill_bits(fill: float, dtype: torch.dtype, w: int) -> int:
    """The fill value repeated over one w-byte word, as that word's integer bits (what the kernel stores)."""
    return _fill_bits_cached(float(fill).hex(), dtype, w)  # keyed by the exact float: -0.0 == 0.0 as a key


@functools.lru_cache(maxsize=256)
def _fill_bits_cached(fill_hex: str, dtype: torch.dtype, w: int) -> int:
    return int(torch.full((w // dtype.itemsize,), float.fromhex(fill_hex), dtype=dtype).view(_WORDS[w]).item())


def _launch(srcs: list[Tensor], index: Tensor, index_offset: int, fill: float) -> Tensor:
    """Run the kernel: ``srcs`` (1 to ``_MAX_SOURCES``, same shape and dtype), ``index`` [n_out] int64."""
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
    gather_rows_kernel[grid](
        flat[0], *offsets, index, out.view(n_out, -1).view(word),
        n_out, rows, rows * len(srcs), index_offset, _fill_bits(float(fill), src0.dtype, w),
        WIDTH=width, NSRC=len(srcs), BLOCK_R=block_r, BLOCK_W=block_w, num_warps=CONFIG["num_warps"],
    )
    return out


if triton is not None:
    @triton.jit(do_not_specialize=["fill"])
    def gather_rows_kernel(
        src, d1, d2, d3, d4, d5, d6, d7,  # the first source; element offsets of the others from it
        index, out, n_out, rows_per_src, n_src_rows, index_offset, fill,
        WIDTH: tl.constexpr, NSRC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
    ):
        """out[r, :] = cat(srcs)[index[r] - index_offset, :] where that row exists, else ``fill`` (a word's bits)."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        row_ok = rows < n_out
        k = tl.load(index + rows, mask=row_ok, other=-1).to(tl.int64) - index_offset
        keep = row_ok & (k >= 0) & (k < n_src_rows)
        k = tl.where(keep, k, 0)
        if NSRC == 1:
            base = k * WIDTH
        else:  # which source holds row k, and its element offset from the first source
            which = k // rows_per_src
            base = (k - which * rows_per_src) * WIDTH
            base += tl.where(which == 1, d1, 0)
            if NSRC > 2:
                base += tl.where(which == 2, d2, 0)
            if NSRC > 3:
                base += tl.where(which == 3, d3, 0)
            if NSRC > 4:
                base += tl.where(which == 4, d4, 0)
            if NSRC > 5:
                base += tl.where(which == 5, d5, 0)
            if NSRC > 6:
                base += tl.where(which == 6, d6, 0)
            if NSRC > 7:
                base += tl.where(which == 7, d7, 0)
        fill = (fill + tl.zeros([], dtype=tl.int64)).to(out.dtype.element_ty)  # the word's bits
        dst = out + rows.to(tl.int64)[:, None] * WIDTH + cols[None, :]
        if WIDTH % BLOCK_W == 0:  # whole blocks of columns: masks per row only
            vals = tl.load(src + base[:, None] + cols[None, :], mask=keep[:, None], other=fill)
            tl.store(dst, vals, mask=row_ok[:, None])
        else:
            col_ok = cols < WIDTH
            vals = tl.load(src + base[:, None] + cols[None, :], mask=keep[:, None] & col_ok[None, :], other=fill)
            tl.store(dst, vals, mask=row_ok[:, None] & col_ok[None, :])
