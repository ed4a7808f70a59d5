"""Log-probabilities and entropy of packed logits in bounded memory, vocab-parallel aware.

These are the logits processors of packfwd's forward: ``processor(logits: [t, v_local], **packed_args) ->
dict[str, Tensor [t]]``.  ``log_probs_and_entropy`` is one as is; bind the group of a vocab-parallel output
layer with ``functools.partial(log_probs_and_entropy, tp_group=group)``.

Math, per token, with ``x = logits / temperature``: ``lse = logsumexp(x)``, ``log_prob = x[label] - lse``,
``entropy = lse - sum(softmax(x) * x)``.  Gradients: ``dlog_prob/dx = onehot(label) - p`` and
``dentropy/dx = -p * (log p + entropy)``; both are local to each vocab entry once ``lse`` and ``entropy`` are
known, which is what lets the backward recompute one block at a time and lets vocab shards skip communication.

Memory.  The plain way (``log_softmax(logits.float() / T)``) holds several ``[t, v]`` float32 buffers in the
forward and more in the backward.  Here the forward keeps only ``[t]`` statistics; the backward recomputes
``log p`` one block of rows (or, for the fused linear, of vocab entries) at a time and writes the gradient
straight into its ``[t, v]`` result in the logits' dtype.  Work buffers are two float32 blocks of about
``_BLOCK_ELEMENTS`` entries.

Vocab parallel (``tp_group`` given).  Each rank holds the contiguous slice ``[rank * v_local, (rank + 1) *
v_local)`` of the (padded) vocab, as Megatron's vocab-parallel output layer does; the padded entries take part
in the softmax, as in Megatron's own cross entropy.  Two all-reduces per call (max, then one stacked sum) make
every rank's outputs equal to the full-vocab ones; the gradient of each rank's logits is the matching slice of
the full-vocab gradient and needs no communication.

Masked vocab entries (logits of ``-inf``, e.g. from top-k filtering) are allowed, with at least one finite
logit per token and per vocab shard; only the gradient w.r.t. a tensor temperature then is NaN.

Labels: a negative label (such as ``-100``) is ignored: its log-prob is 0 and it sends no gradient.  A label at or
above the (global) vocab size raises: a ValueError for CPU tensors, an asynchronous device assert on CUDA (no
host sync; the error surfaces at the next synchronisation).
A temperature must be positive and finite: a float is checked at once, a tensor at every token it scales (a
ValueError on the CPU, an asynchronous device assert on CUDA); never is a bad entry silently read as another
temperature.  Tokens left out by ``token_mask`` or not marked by ``real_tokens`` (``[t]`` bool: the packed layout's
padding slots are False; ``make_forward`` passes it with a tensor temperature) may hold anything, such as the 0
the layouts fill in: they are computed at temperature 1 (1 / 0 would make their gradients NaN, and NaN * 0
upstream is still NaN) and their numbers are discarded.
Results are float32 (float64 for float64 inputs).

On one GPU (CUDA bf16/fp16/fp32 logits, no ``tp_group``, no gradient w.r.t. the temperature) the logits
functions run fused Triton kernels instead (``packfwd.ops.logprob``: one read of the logits forward, one
read and one write backward, same math); ``chunk_size`` is then unused.  Everywhere else, the torch blocks above.
The fused linear (``fused_log_probs_and_entropy``) runs its vocab blocks through the Triton kernels of
``packfwd.ops.linear_logprob`` on any CUDA bf16/fp16/fp32 input, vocab-parallel or not, temperature gradient
included; the matmuls are cuBLAS's either way.

``token_mask`` (``[t]`` bool): only those tokens' numbers are wanted (e.g. the response); the others are 0 and send
no gradient.  The logits processors compute every row and mask (no host sync); the fused linear computes the
selected rows only (one host sync to learn their count), which is where the head's work goes.

One module: the row-block and vocab-block autograd functions share their block math
(``_block_stats``, ``_block_grad``, the group reductions) and their argument checks; split, the math would be
read in two places.  The fused linear's sequence-parallel gather and row selection sit beside it, as its inputs.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from ._validate import check_bool
from .ops.logprob import save_row_stats

__all__ = ["RowSelection", "entropy", "fused_log_probs_and_entropy", "log_probs", "log_probs_and_entropy",
           "select_rows", "selected_logits", "vocab_parallel"]

# Entries of one float32 work block: 2**26 * 4 B = 256 MiB.  At most two such buffers live at once, far below
# the [t, v] float32 buffers they replace, while each kernel stays big enough to hide its launch (at v = 128k a
# block is 512 tokens; for the fused linear at t = 16k, 4096 vocab rows).
_BLOCK_ELEMENTS = 1 << 26


# ----------------------------------------------------------------------------------------------- public API


def vocab_parallel(fn):
    """Mark a logits processor as handling a vocabulary slice: it takes ``tp_group=`` (the process group the
    output layer's vocabulary is split over, or None) and returns full-vocabulary numbers.

    ``make_forward`` calls a marked processor with the model's tensor-parallel group; it refuses an unmarked
    processor on a tensor-parallel model, whose logits hold only this rank's slice of the vocabulary.  The
    processors of this module are marked.

    >>> @vocab_parallel
    ... def greedy_logit(logits, *, tp_group=None):
    ...     return {"max": logits.max(-1).values}     # (a real one would all-reduce the max over tp_group)
    >>> greedy_logit.takes_tp_group
    True
    """
    fn.takes_tp_group = True
    return fn


@vocab_parallel

def log_probs(logits: Tensor, labels: Tensor, *, temperature=1.0, tp_group=None, chunk_size=None,
              token_mask=None, real_tokens=None) -> Tensor:
    """Log-probability of each token's label: ``log_softmax(logits / temperature)[i, labels[i]]``.

    logits: ``[t, v]`` (``[t, v_local]``, this rank's vocab slice, when ``tp_group`` is given), any float dtype;
    labels: ``[t]`` integer, negative = ignored (result 0, no gradient); temperature: a positive finite float or
    a ``[t]`` tensor (per token; checked at every token computed, see the module docstring); chunk_size: tokens
    per work block (default: about 2**26 entries per block); token_mask: ``[t]`` bool or None, the tokens wanted
    (the others give 0, no gradient); real_tokens: ``[t]`` bool or None, False at a packed layout's padding slots
    (their temperature is not checked; ``make_forward`` passes it).
    Returns ``[t]`` float32, differentiable w.r.t. ``logits`` and a tensor ``temperature``.

    >>> import torch
    >>> logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    >>> log_probs(logits, torch.tensor([1, -100]))
    tensor([-1.3863,  0.0000])
    """
    return _chunked(logits, labels, temperature, tp_group, chunk_size, False, token_mask=token_mask,
                    real_tokens=real_tokens)["log_probs"]


@vocab_parallel
def entropy(logits: Tensor, *, temperature=1.0, tp_group=None, chunk_size=None, token_mask=None,
            real_tokens=None) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` per token: ``[t, v] -> [t]`` float32.

    Arguments as in :func:`log_probs`.

    >>> import torch
    >>> entropy(torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -float("inf"), -float("inf")]]))
    tensor([1.3863, 0.6931])
    """
    return _chunked(logits, None, temperature, tp_group, chunk_size, True, token_mask=token_mask,
                    real_tokens=real_tokens)["entropy"]


@vocab_parallel
def log_probs_and_entropy(
    logits: Tensor, labels: Tensor, *, temperature=1.0, tp_group=None, chunk_size=None, token_mask=None,
    real_tokens=None, sum_pi_squared: bool = False,
) -> dict[str, Tensor]:
    """Both :func:`log_probs` and :func:`entropy` in one pass: ``{"log_probs": [t], "entropy": [t]}``.

    A logits processor as is.  Entropy is computed for every token, ignored labels included (mask it yourself, or
    pass ``token_mask``; ``make_forward`` scores only the tokens with a label by default).  Its fused form, from
    the hidden states and the output weight, is :func:`fused_log_probs_and_entropy` (``make_forward(...,
    head="fused")`` takes it).  ``sum_pi_squared=True`` adds ``"sum_pi_squared" [t]``: ``sum_i p_i^2`` of
    ``p = softmax(logits / temperature)`` per token (verl's optimal-token baseline reads it; 0 where
    ``token_mask`` is False).  It carries no gradient: a backward through it raises (detach it in a loss).

    >>> import torch
    >>> out = log_probs_and_entropy(torch.zeros(3, 8), torch.tensor([0, 5, -100]),
    ...                             temperature=torch.tensor([1.0, 0.5, 2.0]))
    >>> out["log_probs"], out["entropy"]
    (tensor([-2.0794, -2.0794,  0.0000]), tensor([2.0794, 2.0794, 2.0794]))
    """
    return _chunked(logits, labels, temperature, tp_group, chunk_size, True, token_mask=token_mask,
                    real_tokens=real_tokens, sum_pi_squared=sum_pi_squared)


def fused_log_probs_and_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, *, temperature=1.0, tp_group=None, chunk_size=None,
    token_mask=None, sequence_parallel: bool = False, real_tokens=None, token_count: int | None = None,
    sum_pi_squared: bool = False,
) -> dict[str, Tensor]:
    """:func:`log_probs_and_entropy` of ``logits = hidden @ weight.T`` without materialising ``[t, v]`` logits.

    hidden: ``[t, hdim]``, the final hidden states, identical on every rank of ``tp_group`` (gathered first if
    sequence parallel); weight: ``[v_local, hdim]``, this rank's rows of the output layer, same dtype as hidden.
    Each block of ``chunk_size`` vocab rows (default: about 2**26 / t) is multiplied, reduced and dropped; the
    backward recomputes it.  Blocks run over the vocab, not the tokens, so the weight gradient of a block is one
    full-``t`` matmul written once (no low-precision accumulation across blocks).  Logits are rounded to
    ``hidden.dtype`` like a plain ``hidden @ weight.T`` before the float32 math.

    Gradients: ``weight`` gets its own rows' gradient; ``hidden`` gets the full gradient (the sum over vocab
    shards, all-reduced over ``tp_group``), so do not all-reduce it again.

    ``sequence_parallel=True``: ``hidden`` is this rank's slice of the tokens, ``[t / tp, hdim]``, as Megatron's
    sequence parallelism splits them (rank ``r`` holds rows ``r * t / tp ...``); it is all-gathered over
    ``tp_group`` here and its gradient reduce-scattered back (each rank's part of the sum over vocab shards).
    ``labels``, ``temperature``, ``token_mask`` and the results then describe all ``t`` tokens, on every rank.
    ``token_mask``: ``[t]`` bool or None; only the selected rows are computed, the others give 0 and no gradient.
    ``token_count`` (a host int, with ``token_mask``): the rows go into that many slots, with no host sync
    (:func:`select_rows`; more selected tokens than slots raise); without it, one host sync reads their count.
    ``temperature`` and ``real_tokens``: as in :func:`log_probs`.  ``sum_pi_squared=True`` adds
    ``"sum_pi_squared"``, as in :func:`log_probs_and_entropy`.
    With the Triton kernels and the default ``chunk_size``, blocks are whole multiples of the kernels' step (a
    short remainder joins the last block), so a token's numbers do not depend on how many tokens come with it.

    >>> import torch
    >>> _ = torch.manual_seed(0)
    >>> hidden, weight, labels = torch.randn(5, 3), torch.randn(11, 3), torch.tensor([0, 3, -100, 10, 7])
    >>> out = fused_log_probs_and_entropy(hidden, weight, labels, chunk_size=4)
    >>> torch.allclose(out["log_probs"], log_probs(hidden @ weight.T, labels), atol=1e-6)
    True
    """
    hidden = _check_float("hidden", hidden, 2, "[t, hdim]")
    weight = _check_float("weight", weight, 2, "[v_local, hdim]")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise TypeError(
            f"weight ({weight.dtype}, {weight.device}) and hidden ({hidden.dtype}, {hidden.device}) must share "
            "dtype and device; cast one, e.g. hidden.to(weight.dtype)"
        )
    if weight.shape[1] != hidden.shape[1] or weight.shape[0] == 0:
        raise ValueError(
            f"weight has shape {tuple(weight.shape)} but hidden has {tuple(hidden.shape)}; weight must be "
            "[v_local, hdim] with v_local >= 1 and the hidden size of hidden"
        )
    group, unit = _check_group(tp_group), _is_one(temperature)
    check_bool("sequence_parallel", sequence_parallel)
    if sequence_parallel and group is not None:
        hidden = _GatherRows.apply(hidden, group)  # [t, hdim] on every rank
    t, v_local = hidden.shape[0], weight.shape[0]
    labels = _check_labels(labels, t, hidden.device)
    _check_label_range(labels, v_local * _group_size(group))
    checked = _checked_tokens(token_mask, real_tokens, t, hidden.device)
    inv_t = _inverse_temperature(temperature, t, _compute_dtype(hidden.dtype), hidden.device, checked)
    want_sq = check_bool("sum_pi_squared", sum_pi_squared)
    rows = None
    if token_mask is not None:  # only the wanted tokens go through the head; free slots compute a harmless row
        rows = select_rows(_check_token_mask(token_mask, t, hidden.device), token_count)
        hidden = rows.take(hidden)
        labels = torch.where(rows.valid, rows.take(labels), -100)
        inv_t = torch.where(rows.valid, rows.take(inv_t), 1.0)
    elif token_count is not None:
        raise TypeError("token_count is the number of slots for the tokens token_mask selects; pass token_mask too")
    chunk = _check_chunk(chunk_size, max(1, _BLOCK_ELEMENTS // max(hidden.shape[0], 1)), align=128)
    kernel = _use_head_kernel(hidden)
    blocks = _vocab_blocks(v_local, min(chunk, v_local), aligned=kernel and chunk_size is None)
    out = _FusedLinear.apply(hidden, weight, inv_t, labels, group, blocks, unit, not sequence_parallel, kernel,
                             want_sq)
    names = ("log_probs", "entropy", "sum_pi_squared")[: 2 + want_sq]
    return {k: (v if rows is None else rows.put(v)) for k, v in zip(names, out)}


# the fused form of the processor: the same numbers from (hidden, weight); make_forward(..., head="fused") calls it
log_probs_and_entropy.fused = fused_log_probs_and_entropy


def selected_logits(hidden: Tensor, weight: Tensor, rows: RowSelection, *, tp_group=None,
                    sequence_parallel: bool = False) -> Tensor:
    """The output layer on the selected rows only: ``hidden[rows] @ weight.T`` -> ``[slots, v_local]`` in the
    weight's dtype, with the gradients a vocab-parallel output layer gives (``make_forward``'s scored logits head).

    hidden: ``[t, hdim]`` (``[t / tp, hdim]`` with ``sequence_parallel``: all-gathered over ``tp_group`` first,
    its gradient reduce-scattered back); weight: ``[v_local, hdim]``, this rank's vocab rows; rows: a
    :func:`select_rows` selection of the ``t`` tokens.  Under ``tp_group`` without sequence parallelism the hidden
    gradient is all-reduced over the group (each rank's vocab slice adds its part), as Megatron's
    ``ColumnParallelLinear`` does.

    >>> import torch
    >>> h, w = torch.randn(4, 3), torch.randn(5, 3)
    >>> sel = select_rows(torch.tensor([True, False, False, True]))
    >>> torch.equal(selected_logits(h, w, sel), (h @ w.T)[[0, 3]])
    True
    """
    group = _check_group(tp_group)
    if sequence_parallel and group is not None:
        hidden = _GatherRows.apply(hidden, group)
    picked = rows.take(hidden.to(weight.dtype))
    if group is not None and not sequence_parallel:
        picked = _ReduceGradient.apply(picked, group)
    return picked @ weight.T


@dataclasses.dataclass(frozen=True)
class RowSelection:
    """The tokens a ``[t]`` bool mask selects, gathered into ``slots`` rows of a fixed count (:func:`select_rows`).

    ``rows [slots]``: the token each slot holds (a free slot, past the selected count, repeats the first selected
    token, so it computes a real row whose numbers are dropped); ``valid [slots]``: the slot holds a selected
    token; ``mask [t]``: the selection; ``slot [t]``: each selected token's slot.  ``take(x [t, ...])`` gives
    ``[slots, ...]``; ``put(y [slots, ...])`` gives ``[t, ...]`` with 0 at the tokens not selected (its gradient
    reaches the selected slots only)."""

    rows: Tensor
    valid: Tensor
    mask: Tensor
    slot: Tensor

    def take(self, x: Tensor) -> Tensor:
        """``x [t, ...]`` -> ``[slots, ...]``: the selected tokens' rows."""
        return x.index_select(0, self.rows)

    def put(self, y: Tensor) -> Tensor:
        """``y [slots, ...]`` -> ``[t, ...]``: each selected token's row, exactly 0 elsewhere."""
        keep = self.mask.reshape(-1, *([1] * (y.dim() - 1)))
        return torch.where(keep, y.index_select(0, self.slot), 0)


def select_rows(mask: Tensor, slots: int | None = None) -> RowSelection:
    """The rows ``mask [t]`` (bool) selects, in ``slots`` fixed slots: gathers and scatters only, no host sync.

    ``slots``: a host int at least the selected count (e.g. the scored tokens a planner counted); None reads the
    count back (one host sync on CUDA).  More selected tokens than slots raise a ValueError on the CPU and an
    asynchronous device assert on CUDA (never a silently dropped token).

    >>> import torch
    >>> sel = select_rows(torch.tensor([False, True, False, True]), slots=3)
    >>> sel.rows.tolist(), sel.valid.tolist()
    ([1, 3, 1], [True, True, False])
    >>> sel.put(sel.take(torch.tensor([10.0, 11.0, 12.0, 13.0]))).tolist()
    [0.0, 11.0, 0.0, 13.0]
    """
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 1:
        raise TypeError(f"select_rows takes a [t] bool mask, got {getattr(mask, 'dtype', type(mask).__name__)}")
    t = mask.shape[0]
    count = mask.sum()
    if slots is None:
        slots = int(count)  # the one host sync
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
        raise TypeError(f"slots (token_count / scored_tokens) must be a host int >= 0, got {slots!r}")
    message = ("more tokens are scored than the slots given (token_count= / scored_tokens=): pass at least the "
               "number of tokens with a label >= 0 inside the loss mask")
    if mask.device.type == "cpu":
        if int(count) > slots:
            raise ValueError(f"{int(count)} tokens selected, {slots} slots: {message}")
    else:
        torch._assert_async(count <= slots, message[:250])
    slots = max(min(slots, t), 1) if t else 0  # no more slots than tokens; one at least: put() gathers from it
    pos = torch.cumsum(mask, 0) - 1  # each selected token's slot
    keep = mask & (pos < slots)
    ar = torch.arange(t, device=mask.device)
    # unique targets (the unselected tokens write past the slots): a deterministic scatter, no duplicates
    rows = torch.zeros(slots + t, dtype=torch.long, device=mask.device).scatter_(0, torch.where(keep, pos, slots + ar), ar)
    valid = torch.arange(slots, device=mask.device) < count
    rows = torch.where(valid, rows[:slots], rows[:1])
    return RowSelection(rows, valid, mask, pos.clamp(0, max(slots - 1, 0)))


def _check_token_mask(token_mask, t: int, device, name: str = "token_mask", true: str = "compute this token") -> Tensor:
    if not isinstance(token_mask, Tensor) or token_mask.dtype != torch.bool:
        got = token_mask.dtype if isinstance(token_mask, Tensor) else type(token_mask).__name__
        raise TypeError(f"{name} must be a bool tensor [t] (True: {true}), got {got}")
    if tuple(token_mask.shape) != (t,):
        raise ValueError(f"{name} must have shape [t] = ({t},) like the tokens, got {tuple(token_mask.shape)}")
    if token_mask.device != device:
        raise ValueError(f"{name} is on {token_mask.device} but the tokens on {device}; move it with .to()")
    return token_mask


def _checked_tokens(token_mask, real_tokens, t: int, device) -> Tensor | None:
    """``[t]`` bool: the tokens whose temperature must be valid (computed and real), or None for all."""
    masks = [_check_token_mask(token_mask, t, device)] if token_mask is not None else []
    if real_tokens is not None:
        masks.append(_check_token_mask(real_tokens, t, device, "real_tokens", "a real token, not layout padding"))
    return masks[0] & masks[1] if len(masks) == 2 else (masks[0] if masks else None)


def _use_head_kernel(hidden: Tensor) -> bool:
    """The fused linear's Triton block kernels: CUDA bf16/fp16/fp32 (any tensor parallelism, any temperature)."""
    if not hidden.is_cuda:
        return False
    from packfwd.ops.linear_logprob import supported

    return supported(hidden)


def _chunked(logits, labels, temperature, tp_group, chunk_size, want_entropy, kernel=None,
             token_mask=None, real_tokens=None, sum_pi_squared=False) -> dict[str, Tensor]:
    """``kernel``: None picks the Triton kernels where they apply (:func:`_use_kernel`); False forces torch."""
    logits = _check_float("logits", logits, 2, "[t, v]")
    t, v = logits.shape
    if v == 0:
        raise ValueError("logits has an empty vocab dimension; pass [t, v] logits with v >= 1")
    if labels is None:  # entropy only: every label ignored, so the log-prob side costs nothing
        labels = torch.full((t,), -1, dtype=torch.long, device=logits.device)
    labels = _check_labels(labels, t, logits.device)
    group = _check_group(tp_group)
    _check_label_range(labels, v * _group_size(group))
    checked = _checked_tokens(token_mask, real_tokens, t, logits.device)
    inv_t = _inverse_temperature(temperature, t, _compute_dtype(logits.dtype), logits.device, checked)
    chunk = _check_chunk(chunk_size, max(1, _BLOCK_ELEMENTS // v), align=1)
    unit = _is_one(temperature)
    mask = token_mask  # checked above
    if _use_kernel(logits, group, inv_t) if kernel is None else kernel:
        from packfwd.ops.logprob import RowKernel

        logp, ent = RowKernel.apply(logits, inv_t, labels, want_entropy)
    else:
        logp, ent = _RowBlocks.apply(logits, inv_t, labels, group, chunk, want_entropy, unit)
    out = {"log_probs": logp, "entropy": ent} if want_entropy else {"log_probs": logp}
    if check_bool("sum_pi_squared", sum_pi_squared):
        out["sum_pi_squared"] = _RowSquares.apply(logits, inv_t, group, chunk)
    if mask is not None:  # every row computed, the others masked: no host sync
        out = {k: torch.where(mask, v, 0.0) for k, v in out.items()}
    return out


def _use_kernel(logits: Tensor, group, inv_t: Tensor) -> bool:
    """The fused Triton kernels: CUDA bf16/fp16/fp32 logits, one vocab shard, no temperature gradient."""
    if not logits.is_cuda or group is not None or inv_t.requires_grad:
        return False
    from packfwd.ops.logprob import supported

    return supported(logits)


# ------------------------------------------------------------------------------------------ autograd functions


class _RowBlocks(torch.autograd.Function):
    """(log_probs, entropy) of ``logits [t, v_local]``, blocks of ``chunk`` rows; saves only ``[t]`` vectors."""

    @staticmethod
    def forward(ctx, logits, inv_t, labels, group, chunk, want_entropy, unit):
        t, v = logits.shape
        idx, hit = _label_columns(labels, _vocab_start(group, v), v)
        blocks = [
            _block_stats(logits[r : r + chunk], inv_t[r : r + chunk], idx[r : r + chunk], hit[r : r + chunk],
                         want_entropy, unit)
            for r in range(0, max(t, 1), chunk)  # t = 0: one empty block, for the shapes
        ]
        stats = [None if k == 2 and not want_entropy else torch.cat([b[k] for b in blocks]) for k in range(5)]
        m, s, mean_z, logp, ent = _finish(*_reduce_over_group(*stats, inv_t, group), labels >= 0)
        ctx.group, ctx.chunk, ctx.unit = group, chunk, unit
        return save_row_stats(ctx, logits, inv_t, labels, m, s, mean_z, logp, ent, want_entropy)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, inv_t, labels, m, s, mean_z = ctx.saved_tensors
        g_logp, g_ent = _upstream(g_logp, g_ent if ctx.want_entropy else None, labels)
        if g_logp is None and g_ent is None:
            return None, None, None, None, None, None, None
        t, v = logits.shape
        idx, hit = _label_columns(labels, _vocab_start(ctx.group, v), v)
        grad = torch.empty_like(logits) if ctx.needs_input_grad[0] else None
        need_dinv = ctx.needs_input_grad[1]
        dinv = []
        for r in range(0, max(t, 1), ctx.chunk):
            rows = slice(r, r + ctx.chunk)
            d = _block_grad(
                logits[rows], inv_t[rows], m[rows], s[rows], mean_z[rows], _rows(g_logp, rows), _rows(g_ent, rows),
                idx[rows], hit[rows], None if grad is None else grad[rows], need_dinv, ctx.unit,
            )
            dinv.append(d)
        dinv = _all_reduce_sum(torch.cat(dinv), ctx.group) if need_dinv else None
        return grad, dinv, None, None, None, None, None


class _RowSquares(torch.autograd.Function):
    """``sum_i p_i^2`` per row of ``logits [t, v_local]`` (vocab-wide over ``group``), blocks of ``chunk`` rows:
    one more read of the logits; no gradient (a backward through it raises)."""

    @staticmethod
    def forward(ctx, logits, inv_t, group, chunk):
        parts = []
        for r in range(0, logits.shape[0], chunk):
            raw, inv = logits[r : r + chunk], inv_t[r : r + chunk]
            mb, q = _merge_squares(None, raw, inv)
            parts.append((mb, q, torch.exp(_shifted(raw, mb, inv, False)).sum(dim=-1)))
        if not parts:
            return inv_t.new_zeros(0)
        mb, q, s = (torch.cat(x) for x in zip(*parts))
        if group is not None:
            import torch.distributed as dist

            top = mb.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            s = s * torch.exp((mb - top) * inv_t)
            return _sum_pi_squared(mb, q, top, _all_reduce_sum(s, group), inv_t, group)
        return q / (s * s)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(_NO_SQ_GRAD)


class _FusedLinear(torch.autograd.Function):
    """(log_probs, entropy) of ``hidden @ weight.T`` over vocab ``blocks`` ([(start, stop)], :func:`_vocab_blocks`);
    saves only ``[t]`` vectors.

    ``reduce_hidden``: all-reduce the hidden gradient over ``group`` (False when a sequence-parallel gather's
    backward reduce-scatters it instead).  ``kernel``: the blocks' math in ``packfwd.ops.linear_logprob``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, inv_t, labels, group, blocks, unit, reduce_hidden, kernel, want_sq):
        v_local = weight.shape[0]
        start = _vocab_start(group, v_local)
        squares = None  # (max, sum exp(2 z)) for sum_pi_squared, folded block by block
        if kernel:
            from .ops import linear_logprob as K

            m, s, e, label_raw = K.new_stats(hidden.shape[0], hidden.device, True)
            inv32 = inv_t.detach().float().contiguous()
            for col, stop in blocks:
                raw = hidden @ weight[col:stop].T
                K.accumulate_stats(raw, inv32, labels, start + col, m, s, e, label_raw)
                squares = _merge_squares(squares, raw, inv_t) if want_sq else None
                del raw
            hit = (labels >= start) & (labels < start + v_local)
            stats = m, s, e, torch.where(hit, (label_raw - m) * inv_t, 0.0), hit
        else:
            stats = None
            for col, stop in blocks:
                raw = hidden @ weight[col:stop].T  # [t, chunk] logits of this block, in hidden's dtype
                idx, hit = _label_columns(labels, start + col, raw.shape[1])
                block = _block_stats(raw, inv_t, idx, hit, True, unit)
                stats = block if stats is None else _merge(stats, block, inv_t)
                squares = _merge_squares(squares, raw, inv_t) if want_sq else None
                del raw
        m, s, mean_z, logp, ent = _finish(*_reduce_over_group(*stats, inv_t, group), labels >= 0)
        ctx.save_for_backward(hidden, weight, inv_t, labels, m, s, mean_z)
        ctx.group, ctx.blocks, ctx.unit, ctx.reduce_hidden, ctx.kernel = group, blocks, unit, reduce_hidden, kernel
        ctx.set_materialize_grads(False)
        if not want_sq:
            return logp, ent
        return logp, ent, _sum_pi_squared(*squares, m, s, inv_t, group).detach()

    @staticmethod
    def backward(ctx, g_logp, g_ent, g_sq=None):
        if g_sq is not None:
            raise RuntimeError(_NO_SQ_GRAD)
        hidden, weight, inv_t, labels, m, s, mean_z = ctx.saved_tensors
        g_logp, g_ent = _upstream(g_logp, g_ent, labels)
        if g_logp is None and g_ent is None:
            return (None,) * 10
        need_h, need_w, need_dinv = ctx.needs_input_grad[:3]
        v_local = weight.shape[0]
        start = _vocab_start(ctx.group, v_local)
        # float32 accumulator: the hidden gradient sums one matmul per vocab block
        grad_h = torch.zeros(hidden.shape, dtype=inv_t.dtype, device=hidden.device) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        dinv = torch.zeros(inv_t.shape, dtype=inv_t.dtype, device=inv_t.device) if need_dinv else None
        if ctx.kernel:
            from .ops import linear_logprob as K

            f32 = [None if x is None else x.detach().float().contiguous() for x in (inv_t, g_logp, g_ent)]
        for col, stop in ctx.blocks:
            w_block = weight[col:stop]
            raw = hidden @ w_block.T  # recomputed [t, chunk] logits: the same matmul as in the forward
            g_raw = torch.empty_like(raw)
            if ctx.kernel:
                K.block_grad(raw, f32[0], labels, start + col, m, s, mean_z, f32[1], f32[2], g_raw, dinv)
            else:
                idx, hit = _label_columns(labels, start + col, raw.shape[1])
                d = _block_grad(raw, inv_t, m, s, mean_z, g_logp, g_ent, idx, hit, g_raw, need_dinv, ctx.unit)
                if need_dinv:
                    dinv += d
            del raw
            if need_w:
                torch.mm(g_raw.T, hidden, out=grad_w[col:stop])
            if need_h:
                _add_mm_(grad_h, g_raw, w_block)
            del g_raw
        if need_h:  # each shard holds part of the sum over the vocab
            grad_h = (_all_reduce_sum(grad_h, ctx.group) if ctx.reduce_hidden else grad_h).to(hidden.dtype)
        if need_dinv:
            dinv = _all_reduce_sum(dinv, ctx.group)
        return grad_h, grad_w, dinv, None, None, None, None, None, None, None


_NO_SQ_GRAD = ("sum_pi_squared carries no gradient (a statistic, as verl's optimal-token baseline reads it); use "
               "sum_pi_squared.detach() in a loss")


def _merge_squares(acc, raw: Tensor, inv_t: Tensor):
    """Fold a block ``raw [r, k]`` into ``(max raw, sum exp(2 (raw - max) inv_t))`` per row (``acc`` None: the
    first block)."""
    mb = raw.amax(dim=-1).to(inv_t.dtype)
    mb = torch.where(torch.isfinite(mb), mb, 0.0)  # a block of -inf logits only adds 0
    q = torch.exp(2 * _shifted(raw, mb, inv_t, False)).sum(dim=-1)
    if acc is None:
        return mb, q
    m0, q0 = acc
    top = torch.maximum(m0, mb)
    return top, q0 * torch.exp(2 * (m0 - top) * inv_t) + q * torch.exp(2 * (mb - top) * inv_t)


def _sum_pi_squared(mq: Tensor, q: Tensor, m: Tensor, s: Tensor, inv_t: Tensor, group) -> Tensor:
    """``sum_i p_i^2 = sum exp(2 z) / s^2`` from the folded squares ``(mq, q)`` and the statistics' final max ``m``
    and sum ``s`` (vocab-wide: the group's shares of ``q`` are rescaled to ``m`` and summed)."""
    q = q * torch.exp(2 * (mq - m) * inv_t)
    return _all_reduce_sum(q, group) / (s * s)


def _vocab_blocks(v_local: int, chunk: int, aligned: bool) -> list[tuple[int, int]]:
    """The fused linear's vocab blocks ``[(start, stop)]``: ``chunk`` rows each, the last one shorter.

    ``aligned`` (the Triton kernels with the default chunk, which shrinks as the packed token count grows): every
    block is a multiple of the kernel's step (``linear_logprob.CONFIG["block"]``) and a shorter remainder joins the
    block before it, so a row's statistics are folded over the same steps whatever the chunk: the log-probs of a
    sequence do not depend on how many tokens are packed with it (batch invariance; a chunk_size the caller gives
    is the same at every call, and kept as given).

    >>> _vocab_blocks(10, 4, False), _vocab_blocks(5000, 1000, True), _vocab_blocks(9000, 5000, True)
    ([(0, 4), (4, 8), (8, 10)], [(0, 2048), (2048, 5000)], [(0, 4096), (4096, 9000)])
    """
    if aligned:
        from .ops.linear_logprob import CONFIG

        step = CONFIG["block"]
        chunk = max(step, chunk - chunk % step)
    starts = list(range(0, v_local, chunk))
    if aligned and len(starts) > 1 and v_local - starts[-1] < step:
        starts.pop()
    return list(zip(starts, starts[1:] + [v_local]))


class _GatherRows(torch.autograd.Function):
    """All-gather ``x [t_local, *]`` over ``group`` along the rows, in rank order (Megatron's sequence-parallel
    split); the backward reduce-scatters: sums every rank's partial gradient and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


class _ReduceGradient(torch.autograd.Function):
    """Identity forward; the backward all-reduces the gradient over ``group`` (the input of a vocab-parallel matmul,
    whose every rank adds its vocab slice's part)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_sum(grad.clone(), ctx.group), None


_ADDMM_OUT_DTYPE = [True]  # cleared if this torch / device has no addmm(out_dtype=)


def _add_mm_(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with ``acc`` float32: on CUDA with half-precision ``a``, ``b`` cuBLAS accumulates into
    ``acc`` itself (no ``[t, hdim]`` temporary, no rounding of the block's product to half precision)."""
    half = a.dtype in (torch.bfloat16, torch.float16)
    if acc.is_cuda and half and acc.dtype == torch.float32 and _ADDMM_OUT_DTYPE[0]:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (RuntimeError, TypeError):
            _ADDMM_OUT_DTYPE[0] = False
    acc += (a @ b).to(acc.dtype)


# ------------------------------------------------------------------------------------------------ block math
#
# Statistics of a block of vocab columns, per row, with x = raw * inv_t and z = (raw - m) * inv_t:
#   m = max raw (raw units: inv_t > 0, so it is also where x is largest),  s = sum exp(z),
#   e = sum exp(z) z,  zl = z[label] (0 when the label is elsewhere),  hit = whether the label is in the block.
# Then log_prob = zl - log s and entropy = log s - e / s.  lse = m * inv_t + log s is never formed, and z is
# computed as (raw - m) * inv_t, so the top entry's z is exactly 0: rounding either (|x| ~ 50 at low
# temperature) would cost ~1e-6 absolute on log-probs near 0 and on tiny entropies.  The backward recomputes z
# with the same formula and the same m.


def _shifted(raw: Tensor, m: Tensor, inv_t: Tensor, unit: bool) -> Tensor:
    """``z = (raw - m) * inv_t`` as a new ``[r, k]`` tensor of ``inv_t.dtype`` (the multiply skipped if ``unit``)."""
    z = torch.sub(raw, m[:, None])  # raw's dtype and m's float32 promote to float32
    return z if unit else z.mul_(inv_t[:, None])


def _block_stats(raw: Tensor, inv_t: Tensor, idx: Tensor, hit: Tensor, want_entropy: bool, unit: bool):
    """``(m, s, e, zl, hit)`` of one block ``raw [r, k]`` (see above), each ``[r]``; ``e`` is None unless wanted."""
    m = raw.amax(dim=-1).to(inv_t.dtype)
    z = _shifted(raw, m, inv_t, unit)
    zl = torch.where(hit, z.gather(1, idx[:, None])[:, 0], 0.0)
    p = z.exp_()
    e = torch.special.xlogy(p, p).sum(dim=-1) if want_entropy else None  # p log p is 0 where p = 0 (x = -inf)
    return m, p.sum(dim=-1), e, zl, hit


def _merge(a, b, inv_t):
    """Statistics of the union of two column blocks (rescaled to the larger max)."""
    (m1, s1, e1, zl1, hit1), (m2, s2, e2, zl2, hit2) = a, b
    m = torch.maximum(m1, m2)
    d1, d2 = (m1 - m) * inv_t, (m2 - m) * inv_t  # <= 0, and exactly 0 for the block holding the max
    w1, w2 = torch.exp(d1), torch.exp(d2)
    e = None if e1 is None else w1 * (e1 + d1 * s1) + w2 * (e2 + d2 * s2)
    zl = torch.where(hit1, zl1 + d1, 0.0) + torch.where(hit2, zl2 + d2, 0.0)
    return m, s1 * w1 + s2 * w2, e, zl, hit1 | hit2


def _reduce_over_group(m, s, e, zl, hit, inv_t, group):
    """``(m, s, e, zl)`` over the whole vocab: merge every rank's statistics with two all-reduces."""
    if group is None:
        return m, s, e, zl
    import torch.distributed as dist

    top = m.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    d = (m - top) * inv_t
    w = torch.exp(d)
    parts = [s * w, torch.where(hit, zl + d, 0.0)] + ([w * (e + d * s)] if e is not None else [])
    packed = torch.stack(parts)
    dist.all_reduce(packed, group=group)
    return top, packed[0], (packed[2] if e is not None else None), packed[1]


def _finish(m, s, e, zl, valid):
    """``(m, s, mean_z = e / s, log_prob, entropy)``: log_prob 0 where ``valid`` is false; the last None w/o e."""
    log_s = torch.log(s)
    logp = torch.where(valid, zl - log_s, 0.0)
    mean_z = e / s if e is not None else None  # E_p[z]
    return m, s, mean_z, logp, (log_s - mean_z) if e is not None else None


def _block_grad(raw, inv_t, m, s, mean_z, g_logp, g_ent, idx, hit, out, need_dinv, unit):
    """Write ``dL/draw`` of one block ``raw [r, k]`` into ``out`` (if given); return ``dL/dinv_t [r]`` or None.

    With ``E = exp(z)``, ``p = E / s`` and ``H = log s - mean_z``, off the label
    ``dL/dx = -g_logp p - g_ent p (log p + H) = -E (g_logp - g_ent mean_z) / s - (g_ent / s) E log E``
    (``E log E`` is 0 at ``E = 0``: a ``-inf`` logit gets 0, not NaN).  At the label, ``dL/dx = g_logp (1 - p)
    - g_ent p (log p + H)`` is computed per row from ``log p`` (with ``expm1``: no cancellation as p -> 1) and
    written over the block's value.  ``dL/draw = dL/dx * inv_t``.
    """
    z = _shifted(raw, m, inv_t, unit)
    log_s = torch.log(s)
    log_pl = z.gather(1, idx[:, None])[:, 0] - log_s  # log p at the label (where hit)
    a = (g_logp if g_ent is None else -g_ent * mean_z if g_logp is None else g_logp - g_ent * mean_z) / s
    b = None if g_ent is None else g_ent / s
    dx_label = torch.zeros_like(log_pl)
    if g_logp is not None:
        dx_label = dx_label - g_logp * torch.expm1(log_pl)
    if g_ent is not None:
        dx_label = dx_label - g_ent * torch.exp(log_pl) * (log_pl + log_s - mean_z)
    big_e = torch.exp(z) if need_dinv else z.exp_()
    e_log_e = torch.special.xlogy(big_e, big_e) if b is not None else None
    if need_dinv or out is None:
        dx = big_e.mul_(-a[:, None]) if b is None else big_e.mul_(-a[:, None]).addcmul_(e_log_e, -b[:, None])
        dx.scatter_(1, idx[:, None], torch.where(hit, dx_label, dx.gather(1, idx[:, None])[:, 0])[:, None])
        # sum dL/dx * raw = sum dL/dx * z / inv_t + 0, as dL/dx sums to 0 over the vocab; z keeps it well conditioned
        dinv = (dx * z).sum(dim=-1) / inv_t if need_dinv else None
        if out is not None:
            torch.mul(dx, inv_t[:, None], out=out)
        return dinv
    # no temperature gradient: write dL/draw straight into out, in out's dtype (one pass fewer)
    scale = -inv_t[:, None]
    if b is None:
        torch.mul(big_e, a[:, None] * scale, out=out)
    else:
        torch.addcmul(big_e.mul_(a[:, None] * scale), e_log_e, b[:, None] * scale, out=out)
    label_value = torch.where(hit, dx_label * inv_t, out.gather(1, idx[:, None])[:, 0].to(dx_label.dtype))
    out.scatter_(1, idx[:, None], label_value.to(out.dtype)[:, None])
    return None


def _label_columns(labels: Tensor, col_start: int, cols: int):
    """Column of each label inside the block ``[col_start, col_start + cols)`` (0 if outside) and whether inside."""
    idx = labels - col_start
    hit = (idx >= 0) & (idx < cols)  # ignored (negative) labels are never inside: col_start >= 0
    return torch.where(hit, idx, 0), hit


def _upstream(g_logp, g_ent, labels):
    """Upstream gradients, with the log-prob one zeroed at ignored labels."""
    if g_logp is not None:
        g_logp = torch.where(labels >= 0, g_logp, 0.0)
    return g_logp, g_ent


def _rows(x, rows):
    return None if x is None else x[rows]


def _all_reduce_sum(x: Tensor, group) -> Tensor:
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(x, group=group)
    return x


def _vocab_start(group, v_local: int) -> int:
    if group is None:
        return 0
    import torch.distributed as dist

    return dist.get_rank(group=group) * v_local


# ---------------------------------------------------------------------------------------------------- checks


def _is_one(temperature) -> bool:
    """A Python temperature of exactly 1: the scaling by 1 / temperature can be skipped."""
    return not isinstance(temperature, (Tensor, bool)) and temperature == 1


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_float(name: str, x, ndim: int, shape: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape}, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} has dtype {x.dtype}; pass a floating tensor (bf16, fp16, fp32 or fp64)")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {shape}, got shape {tuple(x.shape)}; flatten it first")
    return x


def _check_labels(labels, t: int, device) -> Tensor:
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a torch.Tensor [t] of token ids, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels has dtype {labels.dtype}; pass integer token ids (e.g. labels.long())")
    if tuple(labels.shape) != (t,):
        raise ValueError(f"labels must have shape [t] = ({t},) like the logits' rows, got {tuple(labels.shape)}")
    if labels.device != device:
        raise ValueError(f"labels are on {labels.device} but the logits on {device}; move them with .to()")
    return labels.long()


def _check_label_range(labels: Tensor, vocab: int) -> None:
    """Labels must lie below the vocabulary size (negative: ignored).  No host sync on CUDA."""
    message = f"labels hold a token id >= the vocabulary size {vocab}; pass labels in [0, {vocab}) (negative = ignored)"
    if labels.device.type == "cpu":
        if labels.numel() and int(labels.max()) >= vocab:
            raise ValueError(message)
    else:
        torch._assert_async((labels < vocab).all(), message)


def _group_size(group) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


def _inverse_temperature(temperature, t: int, dtype: torch.dtype, device, checked: Tensor | None = None) -> Tensor:
    """``1 / temperature`` as a ``[t]`` tensor of the compute dtype (differentiable for a tensor temperature).

    A tensor temperature must be positive and finite at the ``checked`` tokens (``[t]`` bool, None: all); elsewhere
    it may hold anything and reads as 1."""
    if isinstance(temperature, Tensor):
        if not temperature.dtype.is_floating_point:
            raise TypeError(f"temperature has dtype {temperature.dtype}; pass a float tensor (e.g. .float())")
        if temperature.dim() > 1 or (temperature.dim() == 1 and temperature.shape[0] != t):
            raise ValueError(
                f"temperature must be a float, a 0-d tensor or a [t] = ({t},) tensor, got shape "
                f"{tuple(temperature.shape)}; pack per-sequence temperatures like the logits"
            )
        if temperature.device != device:
            raise ValueError(f"temperature is on {temperature.device} but the logits on {device}; use .to()")
        temperature = temperature.to(dtype)
        ok = (temperature > 0) & torch.isfinite(temperature)
        _check_temperature_values(temperature, ok, checked)
        # unchecked tokens (padding slots, tokens token_mask leaves out) at temperature 1: packed layouts fill
        # padding slots with 0, and 1 / 0 there would make those rows' gradients NaN (NaN * 0 upstream is still
        # NaN) and poison the model's gradients.  A checked token is never read as 1 (it raised above, or on CUDA
        # the assert fails at the next sync).
        return (1.0 / torch.where(ok, temperature, 1.0)).expand(t)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a float or a tensor, got {type(temperature).__name__}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be positive and finite, got {temperature}; use 1.0 for none")
    return torch.full((t,), 1.0 / temperature, dtype=dtype, device=device)


def _check_temperature_values(temperature: Tensor, ok: Tensor, checked: Tensor | None) -> None:
    """Raise if a checked token's temperature is not positive and finite: eagerly on the CPU, asynchronously on
    CUDA (``torch._assert_async``: no host sync; the error surfaces at the next synchronisation)."""
    bad = ~ok if checked is None else ~ok & checked  # [t] (or 0-d: a scalar tensor, with every token checked)
    message = (
        "temperature must be positive and finite at every token it scales (got a value <= 0, NaN or inf); use "
        "1.0 for no scaling.  Only tokens token_mask leaves out, or a packed layout's padding slots (real_tokens "
        "False: make_forward passes real_tokens to packfwd.logits' processors; a processor of your own that calls "
        "them should take real_tokens and pass it on), may hold anything"
    )
    if bad.device.type != "cpu":  # CUDA takes a message of under 255 characters
        torch._assert_async(~bad.any(), "temperature must be positive and finite at every real token it scales (a "
                            "value <= 0, NaN or inf was found); only token_mask=False or real_tokens=False tokens "
                            "may hold anything")
    elif bad.any():
        where = int(bad.reshape(-1).nonzero()[0])
        value = temperature.reshape(-1)[where].item() if temperature.dim() else temperature.item()
        place = (f"token {where} of the logits' rows (as packed, or the scored rows only; not the batch's [b, s])"
                 if temperature.dim()
                 else "the scalar tensor")
        raise ValueError(f"temperature is {value} at {place}: {message}")


def _check_chunk(chunk_size, default: int, align: int) -> int:
    if chunk_size is None:
        return default - default % align if default >= align else default
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be a Python int or None, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}; or pass None for the default")
    return chunk_size


def _check_group(tp_group):
    if tp_group is None:
        return None
    import torch.distributed as dist

    if not isinstance(tp_group, dist.ProcessGroup):
        raise TypeError(
            f"tp_group must be a torch.distributed ProcessGroup or None, got {type(tp_group).__name__}; "
            "pass the tensor-parallel group over which the vocab is split"
        )
    return tp_group
