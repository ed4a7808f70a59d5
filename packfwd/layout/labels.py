"""``next_token_labels``: labels in the caller's padded layout that stay right after any packing."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .._validate import check_mask, check_tensor
from .source import check_compact, to_device


def next_token_labels(input_ids: Tensor, attention_mask: Tensor | None, ignore_index: int = -100) -> Tensor:
    """``[b, s]`` labels: at each real token, the next real token of the same row; ``ignore_index`` at a row's
    last real token and at padding.  Once packed (with any CP split) every token's label is the next token of its
    own sequence, never the first token of the next one.  No host sync (holes and left padding included).  A
    jagged nested ``input_ids`` (``attention_mask=None``) gets labels jagged like it, on the same offsets.

    >>> import torch
    >>> ids = torch.tensor([[0, 5, 6, 7], [8, 0, 9, 0]])
    >>> next_token_labels(ids, ids != 0).tolist()
    [[-100, 6, 7, -100], [9, -100, -100, -100]]
    >>> jagged = torch.nested.nested_tensor_from_jagged(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([0, 3, 5]))
    >>> next_token_labels(jagged, None).values().tolist()
    [6, 7, -100, 9, -100]
    """
    if isinstance(input_ids, Tensor) and input_ids.is_nested:
        if attention_mask is not None:
            raise ValueError("a nested input_ids holds its own lengths: pass attention_mask=None")
        return shift_in_sequence(input_ids, None, 1, ignore_index)
    check_tensor("input_ids", input_ids)
    mask = check_mask(attention_mask, input_ids).bool()
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [b, s], got shape {tuple(input_ids.shape)}")
    b, s = mask.shape
    col = torch.arange(s, device=mask.device).expand(b, s)
    # next[j] = smallest real column k > j, or s when none: a suffix minimum, computed on the flipped row.
    real_col = torch.where(mask, col, s)
    suffix_min = real_col.flip(1).cummin(1).values.flip(1)  # min over k >= j
    nxt = torch.cat([suffix_min[:, 1:], torch.full_like(suffix_min[:, :1], s)], dim=1)
    has_next = mask & (nxt < s)
    gathered = input_ids.gather(1, nxt.clamp(max=max(s - 1, 0)))
    return torch.where(has_next, gathered, torch.full_like(input_ids, ignore_index))


def shift_in_sequence(x: Tensor, attention_mask: Tensor | None, shift, fill_value=0) -> Tensor:
    """At each real token, ``x`` at the real token ``shift`` places later *in the same sequence*; ``fill_value``
    where the sequence has no such token and at padding.  ``x``: ``[b, s, *]`` with ``attention_mask [b, s]``
    (any padding pattern, holes included: "later" counts real tokens), or a jagged nested ``[b, j, *]`` with
    ``attention_mask=None``.  ``shift``: an int >= 0 (same shape as ``x``), or a list of them (one trailing dim
    more, one entry per shift).  Gathers only, no host sync.

    ``shift_in_sequence(ids, mask, 1, ignore)`` is :func:`next_token_labels`; multi-token prediction's depth ``k``
    embeds the ids at ``shift=k`` and predicts those at ``shift=k+1`` (:func:`mtp_labels`).

    >>> import torch
    >>> ids = torch.tensor([[0, 5, 6, 7], [8, 0, 9, 0]])
    >>> shift_in_sequence(ids, ids != 0, 2, fill_value=-1).tolist()
    [[-1, 7, -1, -1], [-1, -1, -1, -1]]
    >>> shift_in_sequence(ids, ids != 0, [0, 1])[1].tolist()     # row 1, shifts 0 and 1 per token
    [[8, 9], [0, 0], [9, 0], [0, 0]]
    """
    if isinstance(shift, int) and not isinstance(shift, bool):
        return _shifted(x, attention_mask, [_check_shift(shift)], fill_value)[..., 0]
    if isinstance(shift, (list, tuple)) and shift:
        return _shifted(x, attention_mask, [_check_shift(k) for k in shift], fill_value)
    raise ValueError(f"shift must be an int >= 0 or a non-empty list of them, got {shift!r}")


def mtp_labels(input_ids: Tensor, attention_mask: Tensor | None, num_depths: int, ignore_index: int = -100) -> Tensor:
    """Multi-token prediction labels ``[b, s, D]``: ``[..., k - 1]`` holds depth ``k``'s label of each token, the
    token ``k + 1`` places later in the same sequence (depth 0, the main head, is :func:`next_token_labels`);
    ``ignore_index`` where the sequence ends first and at padding.  Never a token of another sequence or a pad,
    whatever packing or CP split follows (pack it like the ids).  A jagged ``input_ids`` gives jagged ``[b, j, D]``.

    >>> import torch
    >>> ids = torch.tensor([[0, 5, 6, 7, 8], [9, 3, 0, 0, 0]])
    >>> mtp_labels(ids, ids != 0, 2)[0].T.tolist()     # row 0, depth 1 then depth 2
    [[-100, 7, 8, -100, -100], [-100, 8, -100, -100, -100]]
    """
    depths = range(1, _check_depths(num_depths) + 1)
    return _shifted(input_ids, attention_mask, [k + 1 for k in depths], ignore_index)


def mtp_loss_mask(loss_mask: Tensor | None, attention_mask: Tensor | None, num_depths: int) -> Tensor:
    """The loss mask of every multi-token prediction depth, ``[b, s, D]`` bool, matching :func:`mtp_labels`.

    ``loss_mask``: the main head's mask ``[b, s]``, aligned with :func:`next_token_labels` (True at a token whose
    *next* token is learned), or None for every token that has a next token.  Depth ``k``'s prediction at a token
    targets the token ``k + 1`` places later, which the main head targets from the token ``k`` places later, so
    ``[..., k - 1]`` is ``loss_mask`` read ``k`` tokens later in the same sequence (what Megatron-Core's MTP gets
    by rolling the mask ``k`` times), and False where depth ``k`` has no label.

    >>> import torch
    >>> mask = torch.ones(1, 5, dtype=torch.bool)
    >>> loss = torch.tensor([[False, False, True, True, False]])   # a response: tokens 3 and 4 are learned
    >>> mtp_loss_mask(loss, mask, 2)[0].T.int().tolist()
    [[0, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    """
    depths = _check_depths(num_depths)
    if loss_mask is None:
        if attention_mask is None:
            raise ValueError("pass loss_mask (jagged like the ids) or the batch's attention_mask")
        loss_mask = attention_mask
    check_tensor("loss_mask", loss_mask)
    loss_mask = _as_bool(loss_mask)
    shifts = list(range(1, depths + 1))
    shifted = _shifted(loss_mask, attention_mask, shifts, False)
    exists = _shifted(_as_bool(loss_mask, ones=True), attention_mask, [k + 1 for k in shifts], False)
    return shifted & exists


def mtp_targets(input_ids: Tensor, attention_mask: Tensor | None, num_depths: int, labels: Tensor | None = None,
                loss_mask: Tensor | None = None) -> dict[str, Tensor]:
    """Everything the multi-token-prediction depths of a batch need, in the caller's layout, to be packed like the
    ids: ``"ids"`` ``[b, s, D]`` (depth ``k`` embeds the token ``k`` places later in the same sequence, 0 where
    none), ``"labels"`` ``[b, s, D]`` (it predicts the main head's label ``k`` places later: with ``labels=None``
    :func:`mtp_labels`), ``"mask"`` ``[b, s, D]`` (:func:`mtp_loss_mask` of ``loss_mask``) and ``"main_mask"``
    ``[b, s]`` (the main head's mask: ``loss_mask``, or every token with a next one).  ``labels`` and
    ``loss_mask``: the main head's, aligned with :func:`next_token_labels` (a caller whose labels are the tokens
    themselves shifts them first: ``shift_in_sequence(x, attention_mask, 1)``).  Jagged in, jagged out.

    >>> import torch
    >>> ids = torch.tensor([[0, 5, 6, 7], [8, 9, 0, 0]])
    >>> got = mtp_targets(ids, ids != 0, 1)
    >>> got["ids"][..., 0].tolist(), got["labels"][..., 0].tolist(), got["mask"][..., 0].int().tolist()
    ([[0, 6, 7, 0], [9, 0, 0, 0]], [[-100, 7, -100, -100], [-100, -100, -100, -100]], [[0, 1, 0, 0], [0, 0, 0, 0]])
    """
    depths = list(range(1, _check_depths(num_depths) + 1))
    if loss_mask is None:
        main = shift_in_sequence(_as_bool(input_ids, ones=True), attention_mask, 1, False)  # has a next token
    else:
        main = _as_bool(check_tensor("loss_mask", loss_mask))
    return {"ids": shift_in_sequence(input_ids, attention_mask, depths, 0),
            "labels": (mtp_labels(input_ids, attention_mask, len(depths)) if labels is None
                       else shift_in_sequence(labels, attention_mask, depths, -100)),
            "mask": mtp_loss_mask(main, attention_mask, len(depths)),
            "main_mask": main}


def _check_shift(shift) -> int:
    if isinstance(shift, bool) or not isinstance(shift, int) or shift < 0:
        raise ValueError(f"shift must be a non-negative Python int, got {shift!r}")
    return shift


def _check_depths(num_depths) -> int:
    if isinstance(num_depths, bool) or not isinstance(num_depths, int) or num_depths < 1:
        raise ValueError(f"num_depths must be a positive Python int (the model's mtp_num_layers), got {num_depths!r}")
    return num_depths


def _as_bool(x: Tensor, ones: bool = False) -> Tensor:
    """``x`` as bool (all True with ``ones``), jagged or not."""
    if x.is_nested:
        values = x.values()
        values = torch.ones_like(values, dtype=torch.bool) if ones else values.bool()
        return torch.nested.nested_tensor_from_jagged(values, x.offsets())
    return torch.ones_like(x, dtype=torch.bool) if ones else x.bool()


def _shifted(x: Tensor, attention_mask: Tensor | None, shifts: list[int], fill_value) -> Tensor:
    """``[b, s, *] -> [b, s, *, K]`` (jagged ``[b, j, *] -> [b, j, *, K]``): ``x`` at the real token ``shifts[k]``
    places later in the same sequence, ``fill_value`` where there is none and at padding."""
    check_tensor("x", x)
    shift = to_device(np.asarray(shifts, dtype=np.int64), x.device)  # [K], uploaded without a sync
    if x.is_nested:
        if attention_mask is not None:
            raise ValueError("x is a nested (jagged) tensor: it carries its lengths; pass attention_mask=None")
        check_compact(x)
        values, offsets = x.values(), x.offsets().to(x.device)
        token = torch.arange(values.shape[0], device=x.device)
        end = offsets[1:][torch.searchsorted(offsets[1:], token, right=True)]  # each token's sequence end
        target = token[:, None] + shift  # [t, K]
        valid = target < end[:, None]
        gathered = values[target.clamp(max=max(values.shape[0] - 1, 0))]  # [t, K, *]
        out = _fill(gathered.movedim(1, -1), valid, fill_value)
        return torch.nested.nested_tensor_from_jagged(out, x.offsets())
    mask = check_mask(attention_mask, x).bool()
    b, s = mask.shape
    rank = mask.long().cumsum(1) - 1  # each real token's index among its row's real tokens
    count = mask.sum(1, keepdim=True)  # [b, 1]
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # real columns first, in order
    target = rank[..., None] + shift  # [b, s, K]
    valid = mask[..., None] & (target < count[..., None])
    k, trailing = len(shifts), x.shape[2:]
    col = order.gather(1, target.clamp(0, max(s - 1, 0)).reshape(b, s * k)).reshape(b, s, k)
    flat = x.reshape(b, s, trailing.numel())  # [b, s, f]
    gathered = flat.gather(1, col.reshape(b, s * k, 1).expand(-1, -1, flat.shape[2]))  # [b, s*K, f]
    gathered = gathered.reshape(b, s, k, *trailing).movedim(2, -1)  # [b, s, *, K]
    return _fill(gathered, valid.reshape(b, s, *[1] * len(trailing), len(shifts)), fill_value)


def _fill(values: Tensor, valid: Tensor, fill_value) -> Tensor:
    if valid.dim() < values.dim():
        valid = valid.reshape(valid.shape[0], *[1] * (values.dim() - 2), valid.shape[-1])
    return torch.where(valid, values, torch.full_like(values, fill_value))
