"""packfwd's model class: Megatron-Core's ``GPTModel`` whose constructor builds packfwd's parts itself.

``PackedGPTModel(config, args, layers=..., device=...)`` is what :func:`packfwd.models.build_model` returns.
Beyond what Megatron-Core's ``GPTModel`` constructor builds, it chooses, once, at construction:

* the decoder: :func:`packfwd.models.spec.block_spec`, whose core attention
  (:class:`~packfwd.models.attention.CoreAttention`) gets the attention backend and the model's THD RoPE
  (:class:`~packfwd.models.rope.PackedRope`) as spec params;
* the rotary module: :class:`~packfwd.models.rope.PackedRotaryEmbedding`, the one ``PackedRope`` reads its
  angles from (it stands where Megatron-Core's constructor puts a plain ``RotaryEmbedding``);
* a value model's output layer: :class:`~packfwd.models.gpt.ValueHead` (width 1), where Megatron-Core's
  constructor puts the vocab-wide ``ColumnParallelLinear``.  That one is built first and dropped, so random
  initialisation draws the same numbers as Megatron-Core's model would;
* a model built for the CPU with sequence parallelism runs its forward inside
  :func:`packfwd.models.cpu.host_collectives` (:mod:`packfwd.models.cpu`, point 5).

The state dict is Megatron-Core's ``GPTModel``'s: neither the rotary module nor ``PackedRope`` holds parameters or
buffers.  This module imports Megatron-Core; ``packfwd.models`` imports it only when a model is built.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Sequence

import torch
from megatron.core.models.gpt.gpt_model import GPTModel

from .cpu import host_collectives, is_host
from .gpt import ModelArgs, ValueHead
from .rope import PackedRope, PackedRotaryEmbedding, rotary_angles
from .spec import block_spec

__all__ = ["PackedGPTModel"]


class PackedGPTModel(GPTModel):
    """Megatron-Core's ``GPTModel`` for ``args``, holding the layers ``layers`` (0-based, global; one pipeline
    stage or the whole model), on ``device`` (see the module docstring).

    ``config``: :func:`packfwd.models.gpt.transformer_config` of ``args`` for ``device``.  ``attention_backend``:
    see :mod:`packfwd.models.varlen`.  ``packed_rope=False`` keeps Megatron-Core's own THD RoPE (host syncs; it
    takes only each token's own position in its sequence, other THD ``position_ids`` raise; for
    comparison).  ``pre_process``, ``post_process``, ``pg_collection``, ``vp_stage``: Megatron-Core's.

    >>> from packfwd.models.gpt import transformer_config
    >>> from packfwd.models.runtime import ensure_model_parallel
    >>> ensure_model_parallel()
    >>> args = ModelArgs(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=1, num_attention_heads=2,
    ...                  value_head=True)
    >>> model = PackedGPTModel(transformer_config(args, init=False), args, layers=[0])
    >>> type(model.rotary_pos_emb).__name__, type(model.output_layer).__name__
    ('PackedRotaryEmbedding', 'ValueHead')
    >>> model.decoder.layers[0].self_attention.core_attention.rope.rotary is model.rotary_pos_emb
    True
    """

    def __init__(
        self,
        config,
        args: ModelArgs,
        *,
        layers: Sequence[int],
        device: torch.device | str = "cpu",
        attention_backend: str | None = None,
        packed_rope: bool = True,
        pre_process: bool = True,
        post_process: bool = True,
        pg_collection=None,
        vp_stage: int | None = None,
    ):
        device = torch.device(device)
        rotary_kwargs = dict(
            rotary_base=args.rope_theta,
            rope_scaling=args.rope_scaling_factor is not None,
            rope_scaling_factor=args.rope_scaling_factor or 8.0,
        )
        rotary = PackedRotaryEmbedding(
            kv_channels=config.kv_channels, rotary_percent=1.0, rotary_interleaved=config.rotary_interleaved,
            use_cpu_initialization=config.use_cpu_initialization, cp_group=getattr(pg_collection, "cp", None),
            packed=packed_rope, **rotary_kwargs,
        )
        spec = block_spec(len(layers), attention_backend=attention_backend,
                          rope=PackedRope(rotary) if packed_rope else None)
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            super().__init__(
                config, spec, vocab_size=args.vocab_size, max_sequence_length=args.max_position_embeddings,
                pre_process=pre_process, post_process=post_process,
                share_embeddings_and_output_weights=args.tie_embeddings and not args.value_head,
                position_embedding_type="rope", pg_collection=pg_collection, vp_stage=vp_stage, **rotary_kwargs,
            )
        self.rotary_pos_emb = rotary
        numbers = [layer.layer_number - 1 for layer in self.decoder.layers]
        if numbers != list(layers):
            raise RuntimeError(f"Megatron-Core numbered this stage's layers {numbers}, but packfwd assigns it "
                               f"{list(layers)}; please report this configuration")
        if args.value_head and post_process:
            self.output_layer = ValueHead(args.hidden_size, bias=args.value_head_bias, dtype=config.params_dtype,
                                          sequence_parallel=config.sequence_parallel, tp_group=self.pg_collection.tp)
        # Megatron's sequence-parallel buffers on the host (cpu.py, point 5)
        self.forward_on_host = is_host(device) and config.sequence_parallel
        self.to(device)

    def forward(self, input_ids, position_ids, attention_mask, *args, packed_seq_params=None, **kwargs):
        """Megatron-Core's ``GPTModel.forward``, honouring the caller's ``position_ids`` (RoPE from them) and a
        ``[b, s]`` padding mask.

        * THD (``packed_seq_params`` with ``qkv_format="thd"``): ``position_ids [1, t]`` reach the core attention's
          RoPE (None: each token's position in its own sequence); ``attention_mask`` must be None.
        * BSHD: ``position_ids [b, s]`` give every token's RoPE angle (None: ``0..s-1`` on every row);
          ``attention_mask [b, s]`` (True or 1 at real tokens, any padding pattern: left, right, holes) makes
          each row's real tokens attend causally to the real tokens before them, computed packed (see
          :func:`packfwd.models.model.forward_masked_rows`); padded positions give zeros.
        """
        if args:
            raise TypeError("pass PackedGPTModel's arguments after attention_mask by keyword")
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if position_ids is not None:  # a later pipeline stage does not read input_ids: compare with them only here
            position_ids = _check_positions(position_ids, input_ids if self.pre_process else None)
        if attention_mask is not None:
            if thd:
                raise ValueError(
                    "a THD batch takes attention_mask=None: its sequences are given by packed_seq_params"
                )
            return forward_masked_rows(self, input_ids, position_ids, attention_mask, **kwargs)
        if thd and position_ids is not None:
            if self.rotary_pos_emb.packed:
                packed_seq_params = with_positions(packed_seq_params, position_ids.reshape(-1))
            else:  # Megatron-Core's own THD RoPE reads no positions: they must be the ones it computes
                _assert_per_sequence(position_ids.reshape(-1), packed_seq_params, self.pg_collection.cp)
        kwargs = dict(kwargs, packed_seq_params=packed_seq_params)
        if not self.forward_on_host:
            return super().forward(input_ids, position_ids, None, **kwargs)
        with host_collectives():
            return super().forward(input_ids, position_ids, None, **kwargs)

    def _preprocess(self, *args, **kwargs):
        """Megatron-Core's preprocessing, with a BSHD batch's RoPE angles taken from ``position_ids`` per token
        (Megatron-Core's own are ``0..s-1`` whatever the positions)."""
        out = super()._preprocess(*args, **kwargs)
        positions, params = kwargs.get("position_ids"), kwargs.get("packed_seq_params")
        if positions is None or params is not None or out[1] is None:
            return out
        angles = rotary_angles(self.rotary_pos_emb, positions.transpose(0, 1))  # [s, b, d]
        return (out[0], angles[:, :, None, :], *out[2:])


def _assert_per_sequence(positions: torch.Tensor, params, model_cp_group) -> None:
    """For a model built with ``packed_rope=False``: caller positions other than each token's position in its
    own sequence would be silently ignored by Megatron-Core's THD RoPE, so they raise (asynchronously on CUDA)."""
    from packfwd.layout.rules import local_positions

    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    group = getattr(params, "cp_group", None) or model_cp_group
    cp = group.size() if group is not None else 1
    rank = group.rank() if cp > 1 else 0
    want = local_positions(cu, positions.shape[0], cp, rank).to(positions.device)
    message = ("this model was built with packed_rope=False: Megatron-Core's THD RoPE uses each token's position "
               "in its own sequence and cannot take other position_ids; build it with packed_rope=True")
    if positions.device.type == "cpu":
        if not torch.equal(positions, want):
            raise ValueError(message)
    else:
        torch._assert_async((positions == want).all(), message)


def with_positions(params, positions: torch.Tensor):
    """``params`` (Megatron-Core's ``PackedSeqParams``) carrying ``position_ids [t]`` for packfwd's core
    attention: a subclass instance with the same fields, plus that one."""
    import dataclasses

    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}
    return _positioned_class(type(params))(**fields, position_ids=positions)


@functools.lru_cache(maxsize=None)
def _positioned_class(base: type) -> type:
    import dataclasses

    return dataclasses.make_dataclass(
        f"Positioned{base.__name__}", [("position_ids", torch.Tensor, dataclasses.field(default=None))], bases=(base,)
    )


def _check_positions(position_ids, input_ids) -> torch.Tensor:
    if position_ids.dim() != 2:
        raise ValueError(
            f"position_ids has shape {tuple(position_ids.shape)}; this model uses 1-D RoPE and takes [b, s] (THD: "
            "[1, t]) positions. [k, b, s] multimodal positions need a multimodal-RoPE (vision-language) model"
        )
    if input_ids is not None and tuple(position_ids.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"position_ids has shape {tuple(position_ids.shape)} but input_ids {tuple(input_ids.shape)}; pass one "
            "position per token"
        )
    return position_ids


def forward_masked_rows(model, input_ids, position_ids, attention_mask, **kwargs):
    """``model`` on a BSHD batch with a ``[b, s]`` padding mask (True at real tokens), computed packed: the rows'
    real tokens go to the THD layout (``packfwd.to_thd``), run with causal attention per row, and come back to
    ``[b, s, ...]`` with zeros at padding.  Positions: the caller's, else each token's index in its row's real
    tokens.  One host sync (planning).  A pipeline stage without the output layer returns THD hidden states
    ``[t, 1, h]``; the next stage takes them through ``set_input_tensor`` and the same call."""
    from packfwd import from_thd, plan_thd, position_ids as thd_positions, to_thd

    if attention_mask.dim() != 2 or attention_mask.dtype.is_floating_point:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} and dtype {attention_mask.dtype}; a BSHD "
            "batch takes a [b, s] bool or 0/1 mask, True at real tokens"
        )
    config = model.config
    if getattr(config, "context_parallel_size", 1) > 1:
        raise ValueError(
            "a BSHD padding mask under context parallelism: the rows would be packed for one rank only; pack the "
            "batch per CP rank with packfwd.to_thd (or make_forward('thd', cp_size=, cp_rank=, cp_group=))"
        )
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    info = plan_thd(attention_mask, tp_size=tp)
    if info.source.total == 0:  # no real token: Megatron-Core's attention cannot run an empty batch
        from packfwd.forward.guards import empty_output, model_facts

        shape = tuple(attention_mask.shape) if model.post_process else (0, 1)
        return empty_output(model, model_facts(model, tp, 1), shape)
    ids = to_thd(input_ids, info)[0][None] if input_ids is not None and model.pre_process else None  # else unread
    positions = thd_positions(info) if position_ids is None else to_thd(position_ids, info)[0]
    out = model(ids, positions[None], None, packed_seq_params=info.packed_seq_params(), **kwargs)
    if not model.post_process:
        return out
    return from_thd(out[0], info)
