"""Multimodal RoPE positions (Qwen2-VL / Qwen2.5-VL / Qwen3.5 "mrope"): three coordinates (temporal, height, width)
per token.

Per row, over its real tokens in order, with a running start ``p`` (0 at the row's first real token):

* a text token gets ``(p, p, p)`` and advances ``p`` by 1;
* an image or video of grid ``(T, H, W)`` (patches) covers ``n = T * H * W / m**2`` consecutive tokens
  (``m = spatial_merge_size``), in ``t, h, w`` order over the merged grid ``(T, h = H/m, w = W/m)``; its token
  ``(i, j, k)`` gets ``(p + time(i), p + j, p + k)`` and the whole item advances ``p`` by ``max(h, w)``.
  ``time(i) = i`` for images and for Qwen2-VL videos; for Qwen2.5-VL videos (``tokens_per_second`` given)
  ``time(i) = int(i * tokens_per_second * second_per_grid_ts[v])`` (truncated toward zero, computed in the
  dtype of ``tokens_per_second * second_per_grid_ts`` as transformers does; 1 second per grid when absent).

These are transformers' ``get_rope_index`` values (5.x: ``Qwen2VLModel`` / ``Qwen2_5_VLModel``): padding gets
``0`` in all three coordinates, and ``delta[i] = max position of row i + 1 - real tokens of row i`` (0 for a row
without real tokens; transformers returns it as ``[b, 1]``, this function as ``[b]``).  transformers 5.17
truncates ``second_per_grid_ts`` to an int first (equal values for whole seconds).  transformers 4.x, and
verl's own copy of its rules (``verl.models.transformers.qwen2_vl.get_rope_index``), resume text after an item's
largest position, ``p + max(time(T-1) + 1, h, w)``, and put 1 at padding (4.x also counts deltas over the padded
row): their real tokens' positions equal these for single-frame images and videos whose ``time(T-1) < max(h, w)``.

Qwen3.5 (``split_video_frames=True``; Qwen3-VL's rule): each frame of a video is an item of its own, a grid
``(1, H, W)`` (its processor writes a timestamp and ``<vision_start>`` before every frame), so a video of ``T`` frames
is ``T`` items, each matched to the next of the video's ``T`` frames; images are as above.  These are transformers
5.x's ``Qwen3_5Model.get_rope_index`` values (it finds the items by ``mm_token_type_ids``, consecutive runs of
image or video tokens: the same items when each is preceded by ``<vision_start>``, as checked here).

Items are matched to grids in order: the k-th image of the batch (rows in order, tokens in order) is
``image_grid_thw[k]``; the same for videos.  Each item must be preceded by ``vision_start_token_id`` (as every
Qwen2-VL processor writes it) and be exactly ``n`` consecutive image (video) tokens; anything else raises.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from .._validate import check_mask, check_positive_int, check_tensor

_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def mrope_position_ids(
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    image_grid_thw: Tensor | None = None,
    video_grid_thw: Tensor | None = None,
    second_per_grid_ts: Tensor | None = None,
    spatial_merge_size: int = 2,
    image_token_id: int,
    video_token_id: int,
    vision_start_token_id: int,
    tokens_per_second: float | None = None,
    split_video_frames: bool = False,
) -> tuple[Tensor, Tensor]:
    """3-D RoPE positions ``[3, b, s]`` (long) and deltas ``[b]`` (long) of a padded text+vision batch.

    ``input_ids``: ``[b, s]`` token ids; ``attention_mask``: ``[b, s]`` bool or 0/1 (None: every token is real;
    any padding pattern works).  ``image_grid_thw`` / ``video_grid_thw``: ``[n, 3]`` integer ``(T, H, W)`` patch
    grids, in the order the items appear.  ``tokens_per_second`` (Qwen2.5-VL's ``vision_config``) with
    ``second_per_grid_ts`` (``[n_videos]``) spaces video frames in time; leave both out for Qwen2-VL and Qwen3.5.
    ``split_video_frames``: each video frame an item of its own (Qwen3.5; module docstring).  Rules in
    the module docstring.  Vectorised over tokens and items (no Python loop); it syncs with the host to find
    the real tokens and to check the grids (this is planning, done once per batch).

    >>> import torch
    >>> S, I = 8, 9                      # vision_start, image pad
    >>> ids = torch.tensor([[5, S, I, I, I, I, 6, 7], [0, 0, 0, 0, 5, 6, 7, 8]])
    >>> pos, delta = mrope_position_ids(ids, ids != 0, image_grid_thw=torch.tensor([[1, 4, 4]]),
    ...                                 image_token_id=I, video_token_id=10, vision_start_token_id=S)
    >>> pos[:, 0].tolist()               # t, h, w of row 0: the 2x2 image starts at 2, text resumes at 2 + 2
    [[0, 1, 2, 2, 2, 2, 4, 5], [0, 1, 2, 2, 3, 3, 4, 5], [0, 1, 2, 3, 2, 3, 4, 5]]
    >>> pos[0, 1].tolist(), delta.tolist()
    ([0, 0, 0, 0, 0, 1, 2, 3], [-2, 0])
    """
    ids = _check_ids(input_ids)
    b, s = ids.shape
    real = (ids.new_ones(b, s, dtype=torch.bool) if attention_mask is None
            else check_mask(attention_mask, ids).ne(0))
    m = check_positive_int("spatial_merge_size", spatial_merge_size)
    token = dict(image_token_id=image_token_id, video_token_id=video_token_id,
                 vision_start_token_id=vision_start_token_id)
    for name, value in token.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be a Python int (the tokenizer's id), got {type(value).__name__}")
    if len(set(token.values())) < 3:
        raise ValueError(f"image_token_id, video_token_id and vision_start_token_id must differ, got {token}")
    images = _check_grids("image_grid_thw", image_grid_thw, m, ids.device)
    videos = _check_grids("video_grid_thw", video_grid_thw, m, ids.device)
    if not isinstance(split_video_frames, bool):
        raise TypeError(f"split_video_frames must be True or False, got {split_video_frames!r}")
    if split_video_frames:  # Qwen3.5: a video of T frames is T one-frame items
        if tokens_per_second is not None:
            raise ValueError("split_video_frames=True with tokens_per_second: a one-frame item has no temporal "
                             "spacing (Qwen3.5 has none); pass tokens_per_second=None")
        videos = torch.cat([torch.ones_like(videos[:, :1]), videos[:, 1:]], 1).repeat_interleave(videos[:, 0], 0)
    interval = _video_interval(tokens_per_second, second_per_grid_ts, videos.shape[0], ids.device)

    where = real.reshape(-1).nonzero().reshape(-1)  # [t] flat index of each real token (one host sync)
    tokens = ids.reshape(-1)[where]
    row = where // s
    n_img = images.shape[0]
    item = torch.full_like(tokens, -1)  # [t] the item (images first, then videos) of each token, -1 for text
    offset = torch.zeros_like(tokens)  # [t] its index inside the item
    spans = []
    for kind, first, grid, token_id in (("image", 0, images, image_token_id), ("video", n_img, videos, video_token_id)):
        k, o, span = _assign(tokens, grid, token_id, kind)
        item = torch.where(k >= 0, k + first, item)
        offset = torch.where(k >= 0, o, offset)
        spans.append(span)
    grids = torch.cat([images, videos])  # [n, 3] merged (T, h, w) of every item
    _check_items(tokens, row, torch.cat(spans, 1), grids, n_img, vision_start_token_id, where, s)

    lengths = real.sum(1)
    coords = _coordinates(item, offset, grids, row, torch.cumsum(lengths, 0) - lengths, n_img, interval)  # [3, t]
    positions = ids.new_zeros(3, b * s, dtype=torch.long)
    positions[:, where] = coords
    top = torch.full((b,), -1, dtype=torch.long, device=ids.device)  # each row's largest position
    top = top.scatter_reduce(0, row, coords.amax(0) if coords.numel() else coords.new_zeros(0), "amax")
    return positions.reshape(3, b, s), top + 1 - lengths


def _coordinates(item, offset, grids, row, starts, n_img, interval) -> Tensor:
    """``[3, t]`` positions of the real tokens (rules in the module docstring); ``starts``: each row's first."""
    vision = item >= 0
    k = item.clamp(min=0)
    T, h, w = grids[k].unbind(-1) if grids.shape[0] else (torch.ones_like(offset),) * 3
    # the running start p: +1 after each text token, +max(h, w) after each item's last token
    last = vision & (offset == T * h * w - 1)
    step = torch.where(vision, torch.where(last, torch.maximum(h, w), 0), 1)
    ends = torch.cumsum(step, 0)
    p = ends - step - torch.cat([ends.new_zeros(1), ends])[starts][row]
    ti, hi, wi = offset // (h * w), offset // w % h, offset % w
    if interval is not None and grids.shape[0] > n_img:  # Qwen2.5-VL videos: frames spaced in time
        per = interval[(k - n_img).clamp(min=0)] if isinstance(interval, Tensor) else interval
        ti = torch.where(vision & (item >= n_img), (ti * per).long(), ti)
    return torch.stack([p + torch.where(vision, c, 0) for c in (ti, hi, wi)])


def _check_ids(input_ids: object) -> Tensor:
    ids = check_tensor("input_ids", input_ids)
    if ids.is_nested:
        raise TypeError("input_ids is nested; mrope_position_ids takes a padded [b, s] batch with its attention_mask")
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [b, s] token ids, got shape {tuple(ids.shape)}")
    if ids.dtype not in _INT_DTYPES:
        raise TypeError(f"input_ids has dtype {ids.dtype}; pass integer token ids (e.g. input_ids.long())")
    return ids


def _check_grids(name: str, grid: object, m: int, device) -> Tensor:
    """``[n, 3]`` patch grids -> merged ``(T, H/m, W/m)`` int64 on ``device`` (``[0, 3]`` for None)."""
    if grid is None:
        return torch.zeros(0, 3, dtype=torch.long, device=device)
    grid = check_tensor(name, grid)
    if grid.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} has dtype {grid.dtype}; pass integer (T, H, W) grids, e.g. {name}.long()")
    if grid.dim() != 2 or grid.shape[1] != 3:
        raise ValueError(f"{name} must be [n, 3] (T, H, W) rows, one per item, got shape {tuple(grid.shape)}")
    grid = grid.to(device=device, dtype=torch.long)
    bad = ((grid < 1).any(1) | (grid[:, 1:] % m != 0).any(1)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"{name}[{i}] = {grid[i].tolist()}: every T, H, W must be >= 1 and H, W multiples of "
            f"spatial_merge_size={m} (the grids the image processor returns, in patches before merging)"
        )
    return torch.cat([grid[:, :1], grid[:, 1:] // m], 1)


def _video_interval(tokens_per_second, second_per_grid_ts, n_videos: int, device):
    """None (Qwen2-VL), a Python number, or ``[n_videos]`` per-video temporal spacing (Qwen2.5-VL)."""
    if tokens_per_second is None:
        if second_per_grid_ts is not None:
            raise ValueError(
                "second_per_grid_ts is given but tokens_per_second is None; pass Qwen2.5-VL's "
                "vision_config.tokens_per_second (Qwen2-VL has no temporal spacing: drop second_per_grid_ts)"
            )
        return None
    if isinstance(tokens_per_second, bool) or not isinstance(tokens_per_second, numbers.Real) or tokens_per_second <= 0:
        raise ValueError(f"tokens_per_second must be a positive number, got {tokens_per_second!r}")
    if second_per_grid_ts is None:
        return tokens_per_second  # 1 second per grid
    sec = second_per_grid_ts
    if isinstance(sec, (list, tuple)):
        sec = torch.tensor(sec)
    sec = check_tensor("second_per_grid_ts", sec)
    if sec.dtype == torch.bool or sec.is_complex() or sec.dim() != 1 or sec.shape[0] != n_videos:
        raise ValueError(
            f"second_per_grid_ts must be a real [n_videos={n_videos}] tensor (one value per video_grid_thw row), "
            f"got shape {tuple(sec.shape)} and dtype {sec.dtype}"
        )
    return tokens_per_second * sec.to(device)


def _assign(tokens: Tensor, grid: Tensor, token_id: int, kind: str):
    """Item (-1 elsewhere) and offset in it of each packed token of one kind; ``[2, n]`` each item's first and
    last token (packed indices)."""
    mine = tokens == token_id
    sizes = grid.prod(1)  # [n] tokens per item
    ends = torch.cumsum(sizes, 0)
    count, total = int(mine.sum()), int(ends[-1]) if sizes.numel() else 0
    if count != total:
        name = f"{kind}_grid_thw"
        have = "is None" if not sizes.numel() else f"has {sizes.numel()} grids holding {total} tokens ({sizes.tolist()})"
        raise ValueError(
            f"input_ids holds {count} real {kind} tokens ({kind}_token_id={token_id}) but {name} {have}; each "
            f"{kind} takes T*H*W/spatial_merge_size**2 tokens: pass one grid per {kind}, in order "
            f"({'too many grids' if total > count else 'too few grids'} or wrong sizes)"
        )
    if not total:
        return torch.full_like(tokens, -1), torch.zeros_like(tokens), ends.new_zeros(2, 0)
    rank = torch.cumsum(mine, 0) - 1  # index of each token among this kind's tokens
    k = torch.searchsorted(ends, rank, right=True).clamp(max=sizes.numel() - 1)
    offset = torch.where(mine, rank - (ends - sizes)[k], 0)
    at = mine.nonzero().reshape(-1)
    return torch.where(mine, k, -1), offset, torch.stack([at[ends - sizes], at[ends - 1]])


def _check_items(tokens, row, span, grids, n_img, start_id, where, s) -> None:
    """Each item: exactly its ``n`` consecutive tokens of its kind, in one row, right after ``vision_start``."""
    if not grids.shape[0]:
        return
    n = grids.prod(1)
    first, last = span
    end_ok = (last - first + 1 == n) & (row[first] == row[last])
    prev = (first - 1).clamp(min=0)
    start_ok = (first > 0) & (row[prev] == row[first]) & (tokens[prev] == start_id)
    ok = (end_ok & start_ok).tolist()
    if all(ok):
        return
    i = ok.index(False)
    kind, j = ("image", i) if i < n_img else ("video", i - n_img)
    f = int(first[i])
    at = f"row {int(where[f]) // s} column {int(where[f]) % s}"
    if not bool(start_ok[i]):
        raise ValueError(
            f"{kind} {j} starts at {at} without vision_start_token_id={start_id} right before it; every {kind} "
            f"must be <vision_start> followed by its tokens, as the processor writes it (check the token ids)"
        )
    raise ValueError(
        f"{kind} {j} ({kind}_grid_thw[{j}] -> {int(n[i])} tokens) does not match the {kind} tokens at {at}: each "
        f"{kind} needs exactly T*H*W/spatial_merge_size**2 consecutive {kind} tokens in one row, grids in order"
    )
