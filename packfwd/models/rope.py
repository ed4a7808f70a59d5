"""RoPE for packed (THD) batches, applied inside packfwd's core attention with no host sync.

Megatron-Core applies RoPE to a THD tensor one sequence at a time: it reads the sequence lengths back to the host
(``cu_seqlens.tolist()``, and ``cu_seqlens[-1].item()`` in 0.19), splits the tensor and loops over the pieces in
Python.  That is two host syncs per call, four per layer (query and key), and a handful of kernels per sequence.

packfwd's models apply the same rotation from one gather instead:

* :func:`install_packed_rope` (called by ``build_model``) makes the model's rotary module return None for packed
  batches (``packed_seq=True``), so Megatron-Core skips its own THD RoPE, and hands every
  :class:`~packfwd.attention.CoreAttention` a :class:`PackedRope`;
* :class:`PackedRope` rotates the query and key of a THD batch: each token's position inside its own sequence
  comes from ``cu_seqlens_padded`` on the device (:func:`packed_positions`, zigzag-aware under context
  parallelism), its angles from Megatron's own rotary table, and the arithmetic is Megatron's, op for op
  (``t * cos + rotate_half(t) * sin`` in the input's dtype), so the results are bitwise the same.

BSHD batches keep Megatron-Core's RoPE unchanged (it has no host sync).  Megatron-Core is imported lazily.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["PackedRope", "apply_rope", "install_packed_rope", "packed_positions"]


def packed_positions(cu_seqlens_padded: Tensor, tokens: int, cp_size: int = 1, cp_rank: int = 0) -> Tensor:
    """``[tokens]`` int64: the position of each token of this CP rank's THD tensor inside its own sequence.

    ``cu_seqlens_padded``: ``[n+1]`` offsets of the whole padded sequences (before the CP split); with
    ``cp_size > 1`` each sequence is cut into ``2 * cp_size`` equal chunks and this rank holds chunks ``cp_rank``
    and ``2 * cp_size - 1 - cp_rank`` (packfwd's and Megatron-Core's zigzag).  Computed on the device: no sync.

    >>> import torch
    >>> cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    >>> packed_positions(cu, 12).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    >>> packed_positions(cu, 6, cp_size=2, cp_rank=1).tolist()     # chunks 1 and 2 of each sequence
    [2, 3, 4, 5, 1, 2]
    """
    device = cu_seqlens_padded.device
    if tokens == 0 or cu_seqlens_padded.numel() < 2:
        return torch.zeros(tokens, dtype=torch.long, device=device)
    starts = cu_seqlens_padded.to(torch.long) // cp_size  # where each sequence starts in this rank's tensor
    token = torch.arange(tokens, device=device)
    seq = torch.searchsorted(starts[1:], token, right=True).clamp_(max=starts.numel() - 2)
    first = starts[seq]
    offset = token - first  # row inside this rank's share of the sequence
    if cp_size == 1:
        return offset
    chunk = (starts[seq + 1] - first) // 2
    # the first chunk sits at cp_rank * chunk, the second at (2cp - 1 - cp_rank) * chunk (minus the chunk before it)
    return offset + torch.where(offset >= chunk, (2 * cp_size - 2 - cp_rank) * chunk, cp_rank * chunk)


def apply_rope(t: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """Rotate ``t: [tokens, heads, d]`` by per-token ``cos``/``sin: [tokens, 1, d_rot]`` (in ``t``'s dtype);
    channels past ``d_rot`` pass through.  Megatron-Core's arithmetic, op for op.

    >>> import torch
    >>> t = torch.tensor([[[1.0, 0.0]]])                 # one token, one head, d = 2
    >>> angle = torch.tensor([[[torch.pi / 2] * 2]])
    >>> apply_rope(t, angle.cos(), angle.sin()).round(decimals=6).abs().tolist()   # (1, 0) turned by 90 degrees
    [[[0.0, 1.0]]]
    """
    rot = cos.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    x = (x * cos) + (_rotate_half(x, interleaved) * sin)
    return torch.cat((x, rest), dim=-1)


def _rotate_half(x: Tensor, interleaved: bool) -> Tensor:
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class PackedRope:
    """RoPE of a THD batch for :class:`~packfwd.attention.CoreAttention`: ``rope(q, k, cu_seqlens_padded,
    max_seqlen, cp_size, cp_rank) -> (q, k)`` with ``q: [t, h, d]``, ``k: [t, h_kv, d]``.

    Holds the model's rotary module (Megatron-Core's ``RotaryEmbedding``; its cached ``[max_seqlen, 1, 1, d]``
    angle table is used); a plain object, not a module, so the model's state dict does not change.
    """

    def __init__(self, rotary, interleaved: bool = False):
        self.rotary = rotary
        self.interleaved = interleaved

    def __call__(self, q: Tensor, k: Tensor, cu_seqlens_padded: Tensor, max_seqlen: int, cp_size: int = 1,
                 cp_rank: int = 0) -> tuple[Tensor, Tensor]:
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        # Megatron's own (lru-cached) table: forward(max_seq_len, offset, packed_seq=True) is get_emb unsliced
        table = RotaryEmbedding.forward(self.rotary, max_seqlen, 0, True, None)  # [M, 1, 1, d_rot] float32
        angles = table.reshape(table.shape[0], 1, table.shape[-1])[
            packed_positions(cu_seqlens_padded, q.shape[0], cp_size, cp_rank)
        ]  # [t, 1, d_rot]
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        return apply_rope(q, cos, sin, self.interleaved), apply_rope(k, cos, sin, self.interleaved)


def install_packed_rope(model: torch.nn.Module) -> torch.nn.Module:
    """Route the THD RoPE of a packfwd-built ``GPTModel`` (or stage) through :class:`PackedRope`; in place,
    returns ``model``.  Models without a plain rotary embedding, or with Megatron's fused RoPE, are left as they
    are.

    >>> from packfwd.models import ModelArgs, build_model   # build_model calls this itself
    >>> model = build_model(ModelArgs(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=1,
    ...                               num_attention_heads=2), init=False)
    >>> model.rotary_pos_emb(16, packed_seq=True) is None, model.rotary_pos_emb(16).shape
    (True, torch.Size([16, 1, 1, 16]))
    >>> model.decoder.layers[0].self_attention.core_attention.rope is not None
    True
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from packfwd.attention import CoreAttention

    rotary = getattr(model, "rotary_pos_emb", None)
    config = getattr(model, "config", None)
    if not isinstance(rotary, RotaryEmbedding) or getattr(config, "apply_rope_fusion", False):
        return model
    if getattr(config, "multi_latent_attention", False):
        return model
    rotary.__class__ = _packed_class(type(rotary))
    rope = PackedRope(rotary, interleaved=bool(getattr(config, "rotary_interleaved", False)))
    for module in model.modules():
        if isinstance(module, CoreAttention):
            module.rope = rope
    return model


@functools.lru_cache(maxsize=None)
def _packed_class(base: type) -> type:
    if getattr(base, "_packfwd_packed", False):
        return base

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if packed_seq:
            return None  # packfwd's CoreAttention applies RoPE to packed batches itself (PackedRope)
        return base.forward(self, max_seq_len, offset, packed_seq, cp_group)

    doc = f"{base.__name__} that leaves packed (THD) batches to packfwd's PackedRope (returns None for them)."
    return type(f"Packed{base.__name__}", (base,), {"forward": forward, "_packfwd_packed": True, "__doc__": doc})
