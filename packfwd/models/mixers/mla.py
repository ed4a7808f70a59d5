"""packfwd's multi-head latent attention (MLA, DeepSeek-V3) module: Megatron-Core's MLA parameters, packfwd's RoPE.

:class:`PackedMLASelfAttention` stands where a layer spec puts Megatron-Core's ``MLASelfAttention`` and holds
the same submodules under the same names, so the state dict is Megatron-Core's (its local spec: norms not fused
into the up projections)::

    linear_q_proj        ColumnParallelLinear [H * (dn + dr), hidden]        (q_lora_rank None)
    linear_q_down_proj   ColumnParallelLinear [q_lora_rank, hidden]           (else; output gathered over TP)
    q_layernorm          RMSNorm [q_lora_rank]
    linear_q_up_proj     ColumnParallelLinear [H * (dn + dr), q_lora_rank]
    linear_kv_down_proj  ColumnParallelLinear [kv_lora_rank + dr, hidden]     (output gathered over TP)
    kv_layernorm         RMSNorm [kv_lora_rank]
    linear_kv_up_proj    ColumnParallelLinear [H * (dn + dv), kv_lora_rank]
    core_attention       packfwd CoreAttention (q/k head dim dn + dr, v head dim dv), no RoPE of its own
    linear_proj          RowParallelLinear [hidden, H * dv]

Why not Megatron-Core's module itself: it builds its own rotary module on ``torch.cuda.current_device()`` (no CPU
model), and it rotates THD batches with Megatron's per-sequence RoPE (host syncs, no caller positions) and BSHD
ones from ``0..s-1``.  Here the rotated channels are turned by :class:`MlaRope` from each token's own position:
THD from the params' ``position_ids`` or each token's place in its padded sequence (zigzag-aware under context
parallelism), BSHD from the model's per-token angles (``rotary_pos_emb [s, b, 1, dr]``, from ``position_ids``) or
``0..s-1``; with ``rope_interleave`` the channels are de-interleaved first (:mod:`packfwd.models.mixers.latent`).  Under
TP the heads are split, the down projections' outputs gathered (and, under sequence parallelism, cut back to
each rank's tokens before the up projections, which gather them again), as Megatron-Core's MLA does.

The description ``Mla`` is :mod:`packfwd.models.mixers.latent`'s (not imported here: that module imports this one
when a model is built).  This module imports Megatron-Core; ``packfwd.models`` imports it only when a model is built.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from torch import Tensor

from packfwd.layout.rules import local_positions

from .rope import PackedRope, PackedRotaryEmbedding, rotary_angles

__all__ = ["MlaRope", "PackedMLASelfAttention", "mla_attention_spec", "mla_rotary_modules"]


class MlaRope:
    """The RoPE of an MLA model's rotated channels: ``rope.angles(positions) -> [*, dr]`` float32 and
    ``rope(q_rot [N, H, dr], k_rot [N, 1, dr], angles [N, dr]) -> (q_rot, k_rot)``: cos and sin of the angles
    times ``mla.cos_sin_factor()`` (in float32, then the tensors' dtype), de-interleaved first with
    ``mla.rope_interleave``, rotated by Megatron's half-split arithmetic (:class:`~packfwd.models.mixers.rope.PackedRope`,
    fused on CUDA where built fused).  A plain object: the modules holding it add nothing to the state dict.

    >>> from packfwd.models.mixers import Mla
    >>> mla = Mla(kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=4, v_head_dim=2)
    >>> rope = MlaRope(mla_rotary_modules(mla, 1e4, packed=True)[0], mla)
    >>> q = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    >>> rope(q, q, rope.angles(torch.tensor([0])))[0].tolist()   # position 0: de-interleaved, not turned
    [[[1.0, 3.0, 2.0, 4.0]]]
    """

    def __init__(self, rotary: PackedRotaryEmbedding, mla, fused: bool = False):
        self.rotary, self.interleave, self.factor = rotary, mla.rope_interleave, mla.cos_sin_factor()
        self.rope = PackedRope(rotary, fused=fused)

    def angles(self, positions: Tensor) -> Tensor:
        return rotary_angles(self.rotary, positions)

    def __call__(self, q: Tensor, k: Tensor, angles: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = (angles.cos() * self.factor).to(q.dtype), (angles.sin() * self.factor).to(q.dtype)
        if self.interleave:  # pairs (2j, 2j+1) -> halves (j, j + dr/2)
            q, k = (torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) for x in (q, k))
        return self.rope.rotate(q.contiguous(), k.contiguous(), cos, sin)


def mla_rotary_modules(mla, theta: float, *, packed: bool, fused: bool = False):
    """The rotary module (``dr`` channels, plain or YaRN inverse frequencies, on the CPU; no parameters or
    buffers) and the :class:`MlaRope` of an MLA model.  ``packed=False`` (Megatron-Core's own THD RoPE) is
    refused: Megatron-Core's MLA RoPE cannot be built on the CPU nor take per-token positions."""
    if not packed:
        raise ValueError("packed_rope=False with multi-head latent attention: packfwd's MLA applies its own RoPE "
                         "from per-token positions (Megatron-Core's MLA RoPE is not built); use packed_rope=True")
    rotary = PackedRotaryEmbedding(kv_channels=mla.qk_rope_head_dim, rotary_percent=1.0, rotary_base=theta,
                                   use_cpu_initialization=True, packed=True)
    rotary.inv_freq = mla.inv_freq(theta)
    return rotary, MlaRope(rotary, mla, fused=fused)


class PackedMLASelfAttention(MegatronModule):
    """Multi-head latent self-attention with Megatron-Core's MLA parameters and packfwd's RoPE (module docstring).

    Built by ``TransformerLayer`` with Megatron's keywords and the spec's params ``mla`` (the description) and
    ``rope`` (:class:`MlaRope`); called as Megatron calls its self-attention: ``(hidden_states [s, b, h],
    attention_mask=None, *, rotary_pos_emb=None, packed_seq_params=None, ...) -> (output, bias)``.  Inference
    arguments (``inference_context``, ``key_value_states``, flash-decoding cos/sin) raise.
    """

    def __init__(self, config, submodules, layer_number: int, attn_mask_type=AttnMaskType.causal,
                 cp_comm_type: str | None = None, pg_collection=None, name: str | None = None, *, mla,
                 rope: MlaRope | None = None):
        super().__init__(config)
        self.name = name  # Megatron-Core >= 0.19 passes the module's instance name down (its labels only)
        from megatron.core.process_groups_config import ProcessGroupCollection

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.pg_collection, self.layer_number, self.attn_mask_type = pg_collection, layer_number, attn_mask_type
        # None (a spec built without the model's): plain or YaRN RoPE of the config's theta, unfused
        self.mla = mla
        self.rope = rope if rope is not None else mla_rotary_modules(mla, config.rotary_base, packed=True)[1]
        tp = pg_collection.tp.size() if pg_collection.tp is not None else 1
        heads = config.num_attention_heads
        if heads % tp:
            raise ValueError(f"num_attention_heads={heads} is not divisible by the TP size {tp}; pick one that is")
        self.local_heads, self.tp_size = heads // tp, tp

        def column(spec, size_in, size_out, name):
            return build_module(spec, size_in, size_out, config=config, init_method=config.init_method,
                                gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
                                tp_comm_buffer_name=name, tp_group=pg_collection.tp)

        # Megatron-Core's MLA order of construction (the same random initialisation)
        self.core_attention = build_module(submodules.core_attention, config=config, layer_number=layer_number,
                                           attn_mask_type=attn_mask_type, attention_type="self",
                                           softmax_scale=mla.softmax_scale(), cp_comm_type=cp_comm_type,
                                           pg_collection=pg_collection)
        self.linear_proj = build_module(submodules.linear_proj, heads * mla.v_head_dim, config.hidden_size,
                                        config=config, init_method=config.output_layer_init_method,
                                        bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
                                        is_expert=False, tp_comm_buffer_name="proj", tp_group=pg_collection.tp)
        if mla.q_lora_rank is None:
            self.linear_q_proj = column(submodules.linear_q_proj, config.hidden_size, heads * mla.qk_head_dim,
                                        "q_proj")
        else:
            self.linear_q_down_proj = column(submodules.linear_q_down_proj, config.hidden_size, mla.q_lora_rank,
                                             "q_down_proj")
            self.linear_q_up_proj = column(submodules.linear_q_up_proj, mla.q_lora_rank, heads * mla.qk_head_dim,
                                           "q_up_proj")
        self.linear_kv_down_proj = column(submodules.linear_kv_down_proj, config.hidden_size,
                                          mla.kv_lora_rank + mla.qk_rope_head_dim, "kv_down_proj")
        self.linear_kv_up_proj = column(submodules.linear_kv_up_proj, mla.kv_lora_rank,
                                        heads * (mla.qk_nope_head_dim + mla.v_head_dim), "kv_up_proj")
        if mla.q_lora_rank is not None:
            self.q_layernorm = build_module(submodules.q_layernorm, config=config, hidden_size=mla.q_lora_rank,
                                            eps=mla.latent_norm_eps)
        self.kv_layernorm = build_module(submodules.kv_layernorm, config=config, hidden_size=mla.kv_lora_rank,
                                         eps=mla.latent_norm_eps)

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, position_ids=None, sequence_len_offset=None, *,
                inference_params=None):
        unused = dict(key_value_states=key_value_states, inference_context=inference_context,
                      inference_params=inference_params, rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                      rotary_pos_cos_sin=rotary_pos_cos_sin, sequence_len_offset=sequence_len_offset)
        given = sorted(name for name, value in unused.items() if value is not None)
        if given:
            raise ValueError(f"packfwd's MLA self-attention is causal self-attention for training and scoring: "
                             f"{given} are not supported; pass None")
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        q, k, v = self._qkv(hidden_states, rotary_pos_emb, packed_seq_params if thd else None)
        out = self.core_attention(q, k, v, attention_mask, attn_mask_type=self.attn_mask_type,
                                  attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        if thd:  # [t, H * dv] -> [t, 1, H * dv]
            out = out.reshape(out.shape[0], 1, -1)
        return self.linear_proj(out)

    def _whole(self, latent: Tensor) -> Tensor:
        """A down projection's output ``[s, b, width / tp]`` (ColumnParallelLinear's, every token) as ``[s, b,
        width]``: all-gathered over TP (backward: split)."""
        if self.tp_size == 1:
            return latent
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        return gather_from_tensor_model_parallel_region(latent, group=self.pg_collection.tp)

    def _own_tokens(self, latent: Tensor) -> Tensor:
        """Under sequence parallelism, this TP rank's tokens of a whole-sequence latent (what the up projection,
        which gathers its input's tokens, takes)."""
        if self.tp_size == 1 or not self.config.sequence_parallel:
            return latent
        from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region

        return scatter_to_sequence_parallel_region(latent, group=self.pg_collection.tp)

    def _qkv(self, x: Tensor, angles: Tensor | None, params) -> tuple[Tensor, Tensor, Tensor]:
        """``query [N, H, dn + dr]``, ``key`` likewise, ``value [N, H, dv]``: THD ``[t, ...]`` (``params``), else
        BSHD ``[s, b, ...]``."""
        mla, heads = self.mla, self.local_heads
        if mla.q_lora_rank is None:
            q, _ = self.linear_q_proj(x)
        else:
            q_latent, _ = self.linear_q_down_proj(x)
            q, _ = self.linear_q_up_proj(self.q_layernorm(self._own_tokens(self._whole(q_latent))))
        kv_latent, _ = self.linear_kv_down_proj(x)
        latent, k_rot = self._whole(kv_latent).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        kv, _ = self.linear_kv_up_proj(self.kv_layernorm(self._own_tokens(latent)))
        lead = q.shape[:-1]  # [s, b] (THD: [t, 1]), every token of the sequence
        tokens = lead.numel()
        q = q.reshape(tokens, heads, mla.qk_head_dim)
        kv = kv.reshape(tokens, heads, mla.qk_nope_head_dim + mla.v_head_dim)
        q_nope, q_rot = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        k_rot = k_rot.reshape(tokens, 1, mla.qk_rope_head_dim)
        if mla.rope:  # else no position encoding (Kimi-Linear): the channels as projected
            q_rot, k_rot = self.rope(q_rot, k_rot, self._angles(angles, params, lead, q.device))
        query = torch.cat((q_nope, q_rot), dim=-1)
        key = torch.cat((k_nope, k_rot.expand(-1, heads, -1)), dim=-1)
        shape = (tokens,) if params is not None else tuple(lead)
        return (t.reshape(*shape, heads, t.shape[-1]) for t in (query, key, v.contiguous()))

    def _angles(self, angles: Tensor | None, params, lead, device) -> Tensor:
        """``[N, dr]`` float32 RoPE angles of the ``N`` tokens (module docstring)."""
        if params is not None:
            positions = getattr(params, "position_ids", None)
            if positions is None:
                cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
                cp_size, cp_rank, _ = self.core_attention.cp_place(params)
                positions = local_positions(cu, lead.numel(), cp_size, cp_rank)
            return self.rope.angles(positions.reshape(-1))
        s, b = lead
        if angles is None:  # no caller positions: 0..s-1 on every row
            return self.rope.angles(torch.arange(s, device=device))[:, None].expand(s, b, -1).reshape(s * b, -1)
        return angles.reshape(s * b, -1)  # [s, b, 1, dr] from the model's position_ids


def mla_attention_spec(args, *, attention_backend: str | None = None, rope=None):
    """The ``ModuleSpec`` of an MLA layer's self-attention for ``args`` (``args.mla`` set): Megatron-Core's local
    MLA submodules (column-parallel down projections, RMSNorm latent norms), packfwd's core attention without RoPE;
    ``rope`` the model's :class:`~packfwd.models.mixers.mla.MlaRope` (None: the module builds one from the config).

    >>> from packfwd.models.args import ModelArgs
    >>> from packfwd.models.mixers import Mla
    >>> args = ModelArgs(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=1, num_attention_heads=2,
    ...                  family="deepseek_v3", mla=Mla(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
    ...                  v_head_dim=6))
    >>> spec = mla_attention_spec(args)
    >>> spec.module.__name__, spec.submodules.core_attention.params
    ('PackedMLASelfAttention', {'backend': None, 'rope': None})
    """
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from ..norm import RMSNorm
    from .attention import CoreAttention

    return ModuleSpec(
        module=PackedMLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal, "mla": args.mla, "rope": rope},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear, linear_q_down_proj=ColumnParallelLinear,
            linear_q_up_proj=ColumnParallelLinear, linear_kv_down_proj=ColumnParallelLinear,
            linear_kv_up_proj=ColumnParallelLinear,
            core_attention=ModuleSpec(module=CoreAttention, params={"backend": attention_backend, "rope": None}),
            linear_proj=RowParallelLinear, q_layernorm=RMSNorm, kv_layernorm=RMSNorm,
        ),
    )
