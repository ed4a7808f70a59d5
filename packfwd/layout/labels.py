"""``next_token_labels``: labels in the caller's padded layout that stay right after any packing."""

from __future__ import annotations

import torch
from torch import Tensor

from .._validate import check_mask, check_tensor


def next_token_labels(input_ids: Tensor, attention_mask: Tensor, ignore_index: int = -100) -> Tensor:
    """``[b, s]`` labels: at each real token, the next real token of the same row; ``ignore_index`` at a row's
    last real token and at padding.  Once packed (with any CP split) every token's label is the next token of its
    own sequence, never the first token of the next one.  No host sync (holes and left padding included).

    >>> import torch
    >>> ids = torch.tensor([[0, 5, 6, 7], [8, 0, 9, 0]])
    >>> next_token_labels(ids, ids != 0).tolist()
    [[-100, 6, 7, -100], [9, -100, -100, -100]]
    """
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
