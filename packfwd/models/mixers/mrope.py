"""Multimodal RoPE ("mrope", Qwen2-VL / Qwen2.5-VL / Qwen3.5) for packfwd's models: three position coordinates per
token.

A model built with ``ModelArgs(mrope_section=(t, h, w))`` is Megatron-Core's ``GPTModel`` with
``position_embedding_type="mrope"`` and ``config.mrope_section``: each token has positions ``(temporal, height,
width)`` (``[3, b, s]``, or ``[3, 1, t]`` packed), and frequency ``j`` of the ``d/2`` RoPE frequencies turns by the
coordinate its section picks: the first ``t`` frequencies by the temporal position, the next ``h`` by the height,
the last ``w`` by the width (``t + h + w = d/2``; with partial RoPE ``d`` is the rotated channels, the rest pass
through); interleaved (``ModelArgs.mrope_interleaved``, Qwen3-VL / Qwen3.5: transformers' ``mrope_interleaved``)
frequency ``j`` turns by the height when ``j % 3 == 1`` and ``j < 3 h``, by the width when ``j % 3 == 2`` and ``j <
3 w``, else by the temporal position; the angle table is laid out in halves (``[freqs, freqs]``) and
rotated with ``rotate_half``, as transformers' Qwen2-VL and Megatron-Core's ``MultimodalRotaryEmbedding`` do.
A text token has three equal coordinates, so ``[b, s]`` positions (or none) give plain RoPE.

Two parts, chosen at construction by :class:`packfwd.models.runtime.model.PackedGPTModel` (the softmax attention
component's ``rotary_modules``, :mod:`packfwd.models.mixers.softmax`):

* :class:`MropeRotaryEmbedding` stands where Megatron-Core's constructor puts its ``MultimodalRotaryEmbedding``
  and is called as ``GPTModel`` calls that one: ``rotary(position_ids [3, b, s], mrope_section, cp_group)`` ->
  ``[s, b, 1, d]`` angles for a BSHD batch (Megatron-Core's attention applies them), None when the positions ride
  in the THD ``PackedSeqParams``.  Megatron-Core's own module cannot serve: it allocates its ``inv_freq`` on
  ``torch.cuda.current_device()`` (no CPU model), and under context parallelism it cuts the angle table as if
  the batch were one sequence (``get_pos_emb_on_this_cp_rank``), which is wrong for packed sequences;
* :class:`MropeRope`, given to every core attention through the layer spec, rotates the query and key of a THD
  batch from each local token's own three coordinates (``PackedSeqParams.position_ids [3, t]``, packed per CP rank
  with the same plan as the tokens), with no host sync.

This module imports Megatron-Core; ``packfwd.models`` imports it only when a model is built.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from packfwd._validate import check_positions
from packfwd.layout.rules import local_positions

from .rotary import check_mrope_section
from .rope import PackedRope, PackedRotaryEmbedding

__all__ = ["MropeRope", "MropeRotaryEmbedding", "mrope_angles", "mrope_coordinates", "mrope_positions"]


class MropeRotaryEmbedding(PackedRotaryEmbedding):
    """The rotary module of an mrope model (see the module docstring): Megatron-Core's ``RotaryEmbedding`` table
    (``inv_freq``, on the CPU with ``use_cpu_initialization``) and ``mrope_section``, called as Megatron-Core's
    ``GPTModel`` calls its ``MultimodalRotaryEmbedding``.

    >>> rotary = MropeRotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True,
    ...                               mrope_section=(1, 2, 1))
    >>> rotary(torch.zeros(3, 2, 5, dtype=torch.long), [1, 2, 1]).shape, rotary(None, [1, 2, 1])
    (torch.Size([5, 2, 1, 8]), None)
    """

    def __init__(self, *args, mrope_section: Sequence[int], mrope_interleaved: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.mrope_section = check_mrope_section(mrope_section, 2 * self.inv_freq.numel(), mrope_interleaved)
        self.mrope_interleaved = bool(mrope_interleaved)

    def forward(self, position_ids: Tensor | None, mrope_section=None, cp_group=None):
        if position_ids is None:
            return None  # THD: MropeRope applies the positions carried by PackedSeqParams in the core attention
        if mrope_section is not None and tuple(mrope_section) != self.mrope_section:
            raise ValueError(f"mrope_section={list(mrope_section)} but this model was built with {self.mrope_section}")
        if cp_group is not None and cp_group.size() > 1:
            raise ValueError("context parallelism needs the THD layout (positions packed per CP rank); use THD")
        return mrope_angles(self, position_ids).transpose(0, 1)[:, :, None, :]  # [3, b, s] -> [s, b, 1, d]


def mrope_angles(rotary: MropeRotaryEmbedding, positions: Tensor) -> Tensor:
    """``[*, d]`` float32 angles of ``positions [3, *]``: frequency ``j`` times the coordinate its section picks,
    laid out in halves (``[freqs, freqs]``); the products transformers' Qwen2-VL and Megatron-Core's
    ``MultimodalRotaryEmbedding`` form (``position (float32) * inv_freq``).

    >>> rotary = MropeRotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True,
    ...                               mrope_section=(1, 2, 1))
    >>> pos = torch.tensor([[5], [7], [9]])                       # one token at (t, h, w) = (5, 7, 9)
    >>> (mrope_angles(rotary, pos)[0, :4] / rotary.inv_freq).round().tolist()   # t, h, h, w
    [5.0, 7.0, 7.0, 9.0]
    """
    if positions.dim() < 1 or positions.shape[0] != 3:
        raise ValueError(f"positions has shape {tuple(positions.shape)}; multimodal RoPE takes [3, ...]")
    if rotary.rotary_interleaved:
        raise ValueError("multimodal RoPE is laid out in halves (rotary_interleaved=False), as Qwen2-VL's")
    inv_freq = rotary.inv_freq
    seq = positions.to(device=inv_freq.device, dtype=inv_freq.dtype)
    if getattr(rotary, "seq_len_interpolation_factor", None) is not None:
        seq = seq * (1 / rotary.seq_len_interpolation_factor)
    coord = mrope_coordinates(rotary.mrope_section, getattr(rotary, "mrope_interleaved", False), inv_freq.device)
    freqs = seq[..., None] * inv_freq  # [3, *, d/2]
    picked = freqs.gather(0, coord.expand(1, *freqs.shape[1:]))[0]  # [*, d/2]: each frequency's coordinate
    return torch.cat((picked, picked), dim=-1)


def mrope_coordinates(section: Sequence[int], interleaved: bool, device=None) -> Tensor:
    """``[d/2]``: the coordinate (0 temporal, 1 height, 2 width) each frequency turns by (module docstring).

    >>> mrope_coordinates((2, 1, 1), False).tolist(), mrope_coordinates((3, 3, 2), True).tolist()
    ([0, 0, 1, 2], [0, 1, 2, 0, 1, 2, 0, 1])
    """
    t, h, w = section
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3, device=device), torch.tensor(section, device=device))
    j = torch.arange(t + h + w, device=device)
    height = (j % 3 == 1) & (j < 3 * h)
    width = (j % 3 == 2) & (j < 3 * w)
    return height.long() + 2 * width.long()


class MropeRope(PackedRope):
    """RoPE of a THD batch for :class:`~packfwd.models.mixers.attention.CoreAttention` in an mrope model: ``rope(q, k,
    cu_seqlens_padded, cp_size, cp_rank, positions=None) -> (q, k)``.  ``positions``: ``[3, t]`` (each local
    token's coordinates), or ``[t]`` / None (text: three equal coordinates; None: each token's position in its
    own padded sequence, zigzag-aware under CP).  Megatron's rotation arithmetic
    (:func:`packfwd.models.mixers.rope.apply_rope`).

    >>> rotary = MropeRotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True,
    ...                               mrope_section=(1, 2, 1))
    >>> q = torch.randn(3, 2, 8)
    >>> text = MropeRope(rotary)(q, q, torch.tensor([0, 3]))[0]                     # positions 0, 1, 2
    >>> torch.equal(text, PackedRope(rotary)(q, q, torch.tensor([0, 3]))[0])        # = plain RoPE for text
    True
    """

    def __call__(self, q: Tensor, k: Tensor, cu_seqlens_padded: Tensor | None, cp_size: int = 1, cp_rank: int = 0,
                 positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if positions is None:
            positions = local_positions(cu_seqlens_padded, q.shape[0], cp_size, cp_rank)
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        angles = mrope_angles(self.rotary, positions)  # [t, d]
        return self.rotate(q, k, angles.cos().to(q.dtype), angles.sin().to(q.dtype))  # apply_rope, or fused


def mrope_positions(position_ids: Tensor | None, input_ids: Tensor | None, *, fill: bool) -> Tensor | None:
    """The positions an mrope model runs on: ``[3, b, s]`` (THD ``[3, 1, t]``) as given; ``[b, s]`` (``[1, t]``)
    as three equal coordinates (text); None stays None (THD: each token's position in its sequence) unless
    ``fill`` (a BSHD batch): then ``0..s-1`` on every row, from ``input_ids [b, s]``.

    >>> mrope_positions(torch.tensor([[0, 1, 2]]), None, fill=False)[:, 0].tolist()
    [[0, 1, 2], [0, 1, 2], [0, 1, 2]]
    """
    if position_ids is None:
        if not fill:
            return None
        if input_ids is None:
            raise ValueError("a BSHD batch without input_ids (decoder_input, or a later pipeline stage) needs "
                             "position_ids [3, b, s] on a multimodal-RoPE model; pass them")
        b, s = input_ids.shape
        return torch.arange(s, device=input_ids.device).expand(3, b, s)
    check_positions(position_ids, input_ids, coords=3)
    return position_ids.expand(3, *position_ids.shape) if position_ids.dim() == 2 else position_ids

