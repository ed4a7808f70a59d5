"""RoPE for packed (THD) batches, applied inside packfwd's core attention with no host sync.

Megatron-Core applies RoPE to a THD tensor one sequence at a time: it reads the sequence lengths back to the host
(``cu_seqlens.tolist()``, and ``cu_seqlens[-1].item()`` in 0.19), splits the tensor and loops over the pieces in
Python.  That is two host syncs per call, four per layer (query and key), and a handful of kernels per sequence.

packfwd's models apply the same rotation from one gather instead.  Both parts are chosen when the model is built
(:class:`packfwd.models.runtime.model.PackedGPTModel`):

* :class:`PackedRotaryEmbedding` is the model's rotary module: Megatron-Core's ``RotaryEmbedding`` whose forward
  returns None for packed batches (``packed_seq=True``), so Megatron-Core skips its own THD RoPE;
* :class:`PackedRope`, handed to every :class:`~packfwd.models.mixers.attention.CoreAttention` through the layer spec,
  rotates the query and key of a THD batch: each token's position inside its own sequence comes from
  ``cu_seqlens_padded`` on the device (``packfwd.layout.rules.local_positions``, zigzag-aware under context
  parallelism), its angles from the rotary module's own table, and the arithmetic is Megatron's, op for op
  (``t * cos + rotate_half(t) * sin`` in the input's dtype), so the results are bitwise the same.  Built fused
  (``ModelArgs.fused``, the default), it rotates CUDA tensors with the Triton kernels of :mod:`packfwd.ops.rope`:
  the same arithmetic and bits, in one launch per tensor instead of the ops and ``cat`` s of halves.

BSHD batches keep Megatron-Core's RoPE unchanged (it has no host sync).  This module imports Megatron-Core;
``packfwd.models`` imports it only when a model is built.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from torch import Tensor

from packfwd.layout.rules import local_positions
from packfwd.ops import rope as rope_ops

__all__ = ["PackedRope", "PackedRotaryEmbedding", "apply_rope"]


class PackedRotaryEmbedding(RotaryEmbedding):
    """Megatron-Core's ``RotaryEmbedding`` as packfwd's models use it; built with Megatron's keywords, plus
    ``packed``.

    * ``packed=True``: ``forward(..., packed_seq=True)`` returns None, so Megatron-Core leaves the RoPE of THD
      batches to :class:`PackedRope`.  ``packed=False`` keeps Megatron-Core's own THD RoPE (for comparison).
    * The ``[s, 1, 1, d]`` angle table is computed on ``inv_freq``'s own device.  Megatron's ``get_emb`` moves
      ``inv_freq`` to ``torch.cuda.current_device()`` first, which fails for a model on the CPU
      (:mod:`packfwd.models.runtime.cpu`, point 2); on CUDA both compute the same table.

    Holds no parameters or buffers: the model's state dict is Megatron-Core's.

    >>> rotary = PackedRotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    >>> rotary(4).shape, rotary(4, packed_seq=True)
    (torch.Size([4, 1, 1, 8]), None)
    """

    def __init__(self, *args, packed: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.packed = packed

    def get_emb(self, max_seq_len: int, offset: int = 0) -> Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [s, d/2]
        if self.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).reshape(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]  # [s, 1, 1, d]

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if packed_seq and self.packed:
            return None  # packfwd's CoreAttention applies RoPE to packed batches itself (PackedRope)
        return super().forward(max_seq_len, offset, packed_seq, cp_group)


def apply_rope(t: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """Rotate ``t: [tokens, heads, d]`` by per-token ``cos``/``sin: [tokens, 1, d_rot]`` (in ``t``'s dtype);
    channels past ``d_rot`` pass through.  Megatron-Core's arithmetic, op for op (:func:`packfwd.ops.rope.reference`).

    >>> t = torch.tensor([[[1.0, 0.0]]])                 # one token, one head, d = 2
    >>> angle = torch.tensor([[[torch.pi / 2] * 2]])
    >>> apply_rope(t, angle.cos(), angle.sin()).round(decimals=6).abs().tolist()   # (1, 0) turned by 90 degrees
    [[[0.0, 1.0]]]
    """
    return rope_ops.reference(t, cos, sin, interleaved)


class PackedRope:
    """RoPE of a THD batch for :class:`~packfwd.models.mixers.attention.CoreAttention`: ``rope(q, k, cu_seqlens_padded,
    cp_size, cp_rank, positions=None) -> (q, k)`` with ``q: [t, h, d]``, ``k: [t, h_kv, d]``.

    ``positions``: ``[t]`` int64, the caller's position of every token; None: each token's position inside its own
    padded sequence (``packfwd.layout.rules.local_positions``, zigzag-aware under CP).  The angles are
    ``position * inv_freq`` of the model's rotary module, the same float32 products Megatron-Core's angle table
    holds (so no table and no bound on the positions), and the rotation is Megatron's arithmetic, op for op.
    A plain object, not a module: the core attention that holds it adds nothing to the state dict.

    ``fused=True`` (what packfwd's models build by default, ``ModelArgs.fused``): CUDA tensors are rotated by the
    Triton kernels of :mod:`packfwd.ops.rope` (one launch per tensor, no ``cat`` of halves; bit for bit the same
    numbers, gradients included); elsewhere, and with ``fused=False``, by :func:`apply_rope`.

    >>> rope = PackedRope(PackedRotaryEmbedding(kv_channels=4, rotary_percent=1.0, use_cpu_initialization=True))
    >>> q = torch.ones(3, 2, 4)                       # two sequences of padded lengths 2 and 1
    >>> q_rot, _ = rope(q, q[:, :1], torch.tensor([0, 2, 3]))
    >>> torch.equal(q_rot[0], q[0]), torch.equal(q_rot[2], q[2])   # position 0 of each sequence: no rotation
    (True, True)
    >>> torch.equal(rope(q, q, None, positions=torch.tensor([1, 0, 1]))[0][0], q_rot[1])   # caller positions
    True
    """

    def __init__(self, rotary: RotaryEmbedding, fused: bool = False):
        self.rotary = rotary
        self.interleaved = bool(rotary.rotary_interleaved)
        self.fused = bool(fused)
        self._depth = 0  # inside one_forward(): the tables of its batch are made once (see _tables)
        self._last = None

    def __call__(self, q: Tensor, k: Tensor, cu_seqlens_padded: Tensor | None, cp_size: int = 1, cp_rank: int = 0,
                 positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        cos, sin = self._tables(q, cu_seqlens_padded, cp_size, cp_rank, positions)
        if self.fused:  # one angle per pair of channels: no table laid out (no cat) where the kernels take it
            if rope_ops.supported(q, k, cos, sin):
                return rope_ops.rope(q, k, cos, sin, self.interleaved, paired=True, kernel=True)
            cos, sin = rope_ops.full_table(cos, self.interleaved), rope_ops.full_table(sin, self.interleaved)
        return self.rotate(q, k, cos, sin)

    def __getstate__(self) -> dict:  # a saved or copied model keeps no tables
        return {**self.__dict__, "_depth": 0, "_last": None}

    @contextlib.contextmanager
    def one_forward(self):
        """The layers of one model forward (:class:`~packfwd.models.runtime.model.PackedGPTModel` enters it): inside,
        a batch's angle tables are made by the first layer and taken by the others; they are dropped when the
        outermost forward ends, so no table outlives the forward that made it."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth <= 0:
                self._depth, self._last = 0, None

    def _tables(self, q: Tensor, cu_seqlens_padded: Tensor | None, cp_size: int, cp_rank: int,
                positions: Tensor | None) -> tuple[Tensor, Tensor]:
        """``cos, sin`` in ``q``'s dtype, ``[t, d_rot / 2]`` (fused: one angle per pair) or ``[t, d_rot]``.

        Inside :meth:`one_forward` every layer rotates the same tokens, so the tables the first layer makes are
        taken again while the source is the same tensor (``positions``, else ``cu_seqlens_padded``) for the same
        tokens, dtype, device, CUDA stream and CP place: one computation per forward instead of one per layer (about
        20 small ops each).  Outside it (a layer called on its own, activation recompute in the backward), under
        ``torch.compile`` and under a ``torch.func`` transform they are made afresh at every call."""
        source = positions if positions is not None else cu_seqlens_padded
        keep = (self._depth > 0 and isinstance(source, Tensor) and not torch.compiler.is_compiling()
                and not torch._C._are_functorch_transforms_active())
        if keep:
            stream = torch.cuda.current_stream(q.device).cuda_stream if q.is_cuda else None
            key = (q.shape[0], q.dtype, q.device, stream, cp_size, cp_rank, positions is None)
            last = self._last
            if last is not None and last[0] == key and last[1] is source:
                return last[2], last[3]
        if positions is None:
            positions = local_positions(cu_seqlens_padded, q.shape[0], cp_size, cp_rank)
        if self.fused:
            angles = rotary_freqs(self.rotary, positions)  # [t, d_rot / 2]
        else:
            angles = rotary_angles(self.rotary, positions)  # [t, d_rot]
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        if keep:
            self._last = (key, source, cos, sin)
        return cos, sin

    def rotate(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """``q [t, h, d]`` and ``k [t, h_kv, d]`` rotated by ``cos``/``sin [t, d_rot]`` (in q's dtype): the kernels
        of :mod:`packfwd.ops.rope` where ``fused`` and they take the tensors (CUDA), else :func:`apply_rope`."""
        if self.fused and rope_ops.supported(q, k, cos, sin):
            return rope_ops.rope(q, k, cos, sin, self.interleaved, kernel=True)
        cos, sin = cos[:, None], sin[:, None]  # [t, 1, d_rot]
        return apply_rope(q, cos, sin, self.interleaved), apply_rope(k, cos, sin, self.interleaved)


def rotary_angles(rotary: RotaryEmbedding, positions: Tensor) -> Tensor:
    """``[*positions.shape, d_rot]`` float32: the RoPE angles of each position, laid out as Megatron-Core's
    ``RotaryEmbedding.get_emb`` lays out its table rows (halves, or interleaved pairs), computed as it computes
    them: ``position (float32, times 1/interpolation factor) * inv_freq``.

    >>> rotary = PackedRotaryEmbedding(kv_channels=4, rotary_percent=1.0, use_cpu_initialization=True)
    >>> torch.equal(rotary_angles(rotary, torch.arange(5)), rotary.get_emb(5)[:, 0, 0])
    True
    """
    return rope_ops.full_table(rotary_freqs(rotary, positions), rotary.rotary_interleaved)


def rotary_freqs(rotary: RotaryEmbedding, positions: Tensor) -> Tensor:
    """``[*positions.shape, d_rot / 2]`` float32: one angle per pair of channels, ``position (float32, times
    1/interpolation factor) * inv_freq``, the products ``torch.outer`` forms in Megatron-Core's table.

    >>> rotary = PackedRotaryEmbedding(kv_channels=4, rotary_percent=1.0, use_cpu_initialization=True)
    >>> rotary_freqs(rotary, torch.tensor([0, 2])).tolist()
    [[0.0, 0.0], [2.0, 0.019999999552965164]]
    """
    # on the positions' device (the tokens'): a rotary module built on the CPU and moved keeps a CPU inv_freq (an
    # attribute, not a buffer); one float32 product per entry, the same bits on either device
    inv_freq = rotary.inv_freq.to(positions.device)
    seq = positions.to(dtype=inv_freq.dtype)
    if getattr(rotary, "seq_len_interpolation_factor", None) is not None:
        seq = seq * (1 / rotary.seq_len_interpolation_factor)
    return seq[..., None] * inv_freq  # [..., d/2]
