"""packfwd's model class: Megatron-Core's ``GPTModel`` whose constructor builds packfwd's parts itself.

``PackedGPTModel(config, args, layers=..., device=...)`` is what :func:`packfwd.models.build_model` returns.
Beyond what Megatron-Core's ``GPTModel`` constructor builds, it chooses, once, at construction:

* the decoder: :func:`packfwd.models.runtime.spec.block_spec` of ``args`` (each layer's token mixer and MLP
  components), whose core attention (:class:`~packfwd.models.mixers.attention.CoreAttention`) gets the attention
  backend and the model's THD RoPE as spec params;
* the rotary module and that THD RoPE, the token mixer's (``rotary_modules`` of :func:`packfwd.models.mixers.mixer`'s
  component): for softmax attention :class:`~packfwd.models.mixers.rope.PackedRotaryEmbedding`, the one
  :class:`~packfwd.models.mixers.rope.PackedRope` reads its angles from (it stands where Megatron-Core's constructor
  puts a plain ``RotaryEmbedding``), or with ``args.mrope_section`` multimodal RoPE (``position_embedding_type=
  "mrope"``, positions ``[3, b, s]`` / ``[3, 1, t]``, :mod:`packfwd.models.mixers.mrope`); for multi-head latent
  attention one over the rotated channels, plain or YaRN, that each layer's
  :class:`~packfwd.models.mixers.mla.MlaRope` reads (BSHD angles of caller positions reach it as
  ``rotary_pos_emb``: a mixer that ``rotates_itself`` gets them though Megatron-Core computes none);
* a value model's output layer: :class:`~packfwd.models.runtime.gpt.ValueHead` (width 1), where Megatron-Core's
  constructor puts the vocab-wide ``ColumnParallelLinear``.  That one is built first and dropped, so random
  initialisation draws the same numbers as Megatron-Core's model would;
* a model built for the CPU with sequence parallelism runs its forward inside
  :func:`packfwd.models.runtime.cpu.host_collectives` (:mod:`packfwd.models.runtime.cpu`, point 5);
* with ``args.mtp_num_layers``, on the last stage: Megatron-Core's MTP block from packfwd's MTP spec, whose
  layers take each depth's ids from the caller (``forward(..., mtp_input_ids=)``; :mod:`packfwd.models.runtime.mtp`).

The state dict is Megatron-Core's ``GPTModel``'s: neither the rotary module nor ``PackedRope`` holds parameters or
buffers.  This module imports Megatron-Core; ``packfwd.models`` imports it only when a model is built.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from megatron.core.models.gpt.gpt_model import GPTModel

from packfwd._validate import check_positions
from packfwd.layout.params import CpPlace, cp_place, with_cp, with_positions

from .cpu import host_collectives, is_host
from . import mtp
from ..args import ModelArgs
from .value import ValueHead
from .masked import forward_masked_rows
from ..mixers import mixer
from ..mixers.mrope import mrope_positions
from .positions import assert_per_sequence, thd_positions
from ..mixers.rope import rotary_angles
from .spec import block_spec

__all__ = ["PackedGPTModel"]


class PackedGPTModel(GPTModel):
    """Megatron-Core's ``GPTModel`` for ``args``, holding the layers ``layers`` (0-based, global; one pipeline
    stage or the whole model), on ``device`` (see the module docstring).

    ``config``: :func:`packfwd.models.runtime.gpt.transformer_config` of ``args`` for ``device``.  ``attention_backend``:
    see :mod:`packfwd.models.mixers.varlen`.  ``packed_rope=False`` keeps Megatron-Core's own THD RoPE (host syncs; it
    takes only each token's own position in its sequence, other THD ``position_ids`` raise; for
    comparison).  ``pre_process``, ``post_process``, ``pg_collection``, ``vp_stage``: Megatron-Core's.

    >>> from packfwd.models.runtime.config import transformer_config
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
            rotary_percent=args.rotary_percent,  # partial RoPE: the first int(d * percent) channels rotate
            rope_scaling=args.rope_scaling_factor is not None,
            rope_scaling_factor=args.rope_scaling_factor or 8.0,
        )
        attention = mixer(args)  # its rotary module and THD RoPE: plain, multimodal, or MLA's (plain or YaRN)
        rotary, rope = attention.rotary_modules(config, args, packed=packed_rope,
                                                cp_group=getattr(pg_collection, "cp", None))
        spec = block_spec(layers, args=args, attention_backend=attention_backend, rope=rope)
        mtp_spec = None
        if args.mtp_num_layers and post_process:  # Megatron-Core's rule: the MTP block on the last stage
            mtp_spec = mtp.mtp_block_spec(args.mtp_num_layers, args=args, attention_backend=attention_backend,
                                          rope=rope)
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            super().__init__(
                config, spec, vocab_size=args.vocab_size, max_sequence_length=args.max_position_embeddings,
                pre_process=pre_process, post_process=post_process,
                share_embeddings_and_output_weights=args.tie_embeddings and not args.value_head,
                position_embedding_type="rope", pg_collection=pg_collection, vp_stage=vp_stage,
                mtp_block_spec=mtp_spec, **rotary_kwargs,
            )
        self.rotary_pos_emb = rotary
        # the THD RoPE every layer shares: one forward makes its angle tables once (PackedRope.one_forward)
        self._rope_scope = getattr(rope, "one_forward", None)
        self.family, self.moe, self.mla, self.fused = args.family, args.moe, args.mla, args.fused  # for model_args
        self.linear_attention = args.linear_attention  # for model_args
        self.mixer_rotates = attention.rotates_itself  # BSHD angles computed here even where Megatron-Core's are None
        if args.mrope_section is not None:  # what the constructor's "mrope" branch sets (mrope.py says why not it)
            self.position_embedding_type, self.mrope_section = "mrope", list(args.mrope_section)
        numbers = [layer.layer_number - 1 for layer in self.decoder.layers]
        if numbers != list(layers):
            raise RuntimeError(f"Megatron-Core numbered this stage's layers {numbers}, but packfwd assigns it "
                               f"{list(layers)}; please report this configuration")
        if mtp_spec is not None:
            mtp.check_mtp_layers(self, args.num_layers)
        if args.value_head and post_process:
            self.output_layer = ValueHead(args.hidden_size, bias=args.value_head_bias, dtype=config.params_dtype,
                                          sequence_parallel=config.sequence_parallel, tp_group=self.pg_collection.tp)
        # Megatron's sequence-parallel buffers on the host (cpu.py, point 5)
        self.forward_on_host = is_host(device) and config.sequence_parallel
        self.to(device)

    def forward(self, input_ids, position_ids, attention_mask, *args, packed_seq_params=None, mtp_input_ids=None,
                mtp_detach_head=False, return_hidden=False, **kwargs):
        """Megatron-Core's ``GPTModel.forward``, honouring the caller's ``position_ids`` (RoPE from them) and a
        ``[b, s]`` padding mask.

        * THD (``packed_seq_params`` with ``qkv_format="thd"``): ``position_ids [1, t]`` reach the core attention's
          RoPE (None: each token's position in its own sequence); ``attention_mask`` must be None.  A ``[b, s]``
          tensor of another shape is accepted only as verl's default positions (``model_forward_gen`` passes
          them; Megatron-Core's GPTModel never reads them under THD), checked without a host sync, and then not
          read (the numbers of each token's position in its own sequence); anything else raises
          (:mod:`packfwd.models.runtime.positions` has the rule and what it cannot catch).
        * BSHD: ``position_ids [b, s]`` give every token's RoPE angle (None: ``0..s-1`` on every row);
          ``attention_mask [b, s]`` (True or 1 at real tokens, any padding pattern: left, right, holes) makes
          each row's real tokens attend causally to the real tokens before them, computed packed (see
          :func:`packfwd.models.runtime.masked.forward_masked_rows`); padded positions give zeros.
        * ``mtp_input_ids [D, *input_ids.shape]`` (a model with ``mtp_num_layers=D``): the ids each MTP depth
          embeds, ``[k - 1]`` holding the token ``k`` places later in the same sequence (0 where none;
          ``packfwd.layout.labels.shift_in_sequence``, packed like the ids).  The last stage then returns
          ``(logits, mtp_logits [D, *logits.shape])``; other stages ignore them.  Without them an MTP model
          returns the main logits alone (its MTP layers skipped).  ``mtp_detach_head=True`` (or the config's
          ``mtp_detach_heads``): the MTP logits see the output layer's weight detached (no MTP gradient to it).
        * MoE (THD): ``padding_mask [1, t]`` (True at slots kept from the routers) is used as given; without one,
          the plan's pads that packfwd's params carry (``ThdInfo.packed_seq_params().layout_pads``), so none is
          routed.  Params made elsewhere (verl's) carry none: their caller passes ``padding_mask``.
        * ``return_hidden=True``: the last stage returns its final-normed hidden states ``[s, b, h]`` (this rank's
          tokens under sequence parallelism) for a fused head (``packfwd.forward.head``), output and MTP layers skipped.
        """
        if args:
            raise TypeError("pass PackedGPTModel's arguments after attention_mask by keyword")
        if return_hidden:
            return self._hidden_states(input_ids, position_ids, attention_mask, packed_seq_params=packed_seq_params,
                                       mtp_input_ids=mtp_input_ids, **kwargs)
        if mtp_input_ids is not None:
            mtp_input_ids = self._check_mtp_ids(mtp_input_ids, input_ids)
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd and attention_mask is not None:
            raise ValueError("a THD batch takes attention_mask=None: its sequences are given by packed_seq_params")
        if thd:  # one CP place from here to the attention; [1, t] positions read, verl's default [b, s] not read
            cp = self._cp_place(packed_seq_params)
            packed_seq_params = with_cp(packed_seq_params, cp)
            tokens = self._packed_tokens(input_ids, kwargs)
            position_ids = thd_positions(position_ids, packed_seq_params, tokens, cp.size, cp.rank)
            pads = getattr(packed_seq_params, "layout_pads", None)  # the plan's (ThdInfo.packed_seq_params())
            if self.config.num_moe_experts and kwargs.get("padding_mask") is None and pads is not None:
                kwargs["padding_mask"] = pads
        if self.position_embedding_type == "mrope":  # [3, b, s]; [b, s] or none: three equal coordinates
            position_ids = mrope_positions(position_ids, input_ids if self.pre_process else None,
                                           fill=not thd and attention_mask is None)
        elif position_ids is not None:  # a later pipeline stage does not read input_ids: compare with them only here
            position_ids = check_positions(position_ids, input_ids if self.pre_process else None, coords=None)
        if attention_mask is not None:
            return forward_masked_rows(self, input_ids, position_ids, attention_mask, mtp_input_ids=mtp_input_ids,
                                       mtp_detach_head=mtp_detach_head, **kwargs)
        if thd and position_ids is not None:
            if self.rotary_pos_emb.packed:  # [1, t] -> [t]; multimodal [3, 1, t] -> [3, t]
                packed_seq_params = with_positions(packed_seq_params, position_ids.flatten(-2))
                position_ids = None if self.position_embedding_type == "mrope" else position_ids  # read there
            else:  # Megatron-Core's own THD RoPE reads no positions: they must be the ones it computes
                assert_per_sequence(position_ids.reshape(-1), packed_seq_params, cp.size, cp.rank)
        kwargs = dict(kwargs, packed_seq_params=packed_seq_params)
        if mtp_input_ids is not None:  # stacked under the main ids: how they reach the MTP block (mtp.py)
            main = input_ids if input_ids is not None else torch.zeros_like(mtp_input_ids[0])
            input_ids = torch.cat([main[None], mtp_input_ids])
        with (host_collectives() if self.forward_on_host else contextlib.nullcontext(),
              self._rope_scope() if self._rope_scope is not None else contextlib.nullcontext()):
            out = super().forward(input_ids, position_ids, None, **kwargs)
            return out if mtp_input_ids is None else mtp.with_logits(self, out, detach_head=mtp_detach_head)

    def _cp_place(self, params) -> CpPlace:
        """The context-parallel place of a THD batch: the one its params carry (``ThdInfo.packed_seq_params()``),
        checked once against the CP group the attention communicates over (``params.cp_group``, else the model's);
        params without one (verl's) take the group's."""
        group = getattr(params, "cp_group", None) or self.pg_collection.cp
        size = group.size() if group is not None and torch.distributed.is_initialized() else 1
        place, carried = CpPlace(size, group.rank() if size > 1 else 0), cp_place(params)
        if carried is not None and carried != place:
            raise ValueError(
                f"the batch was packed for context-parallel rank {carried.rank} of {carried.size}, but this model's "
                f"attention runs as rank {place.rank} of {place.size} of its CP group; pack it with cp_size="
                f"{place.size}, cp_rank={place.rank} (plan_thd / make_forward), or run the model in that CP group"
            )
        return place

    def _packed_tokens(self, input_ids, kwargs) -> int | None:
        """``t``, this rank's packed tokens of a THD batch: from the ids ``[1, t]`` (or ``decoder_input``) on the
        first stage, from the hidden states a later stage was given (under sequence parallelism each TP rank holds
        ``t / tp`` of them); None where neither is known."""
        hidden = kwargs.get("decoder_input") if self.pre_process else self.decoder.input_tensor
        if hidden is None:
            return input_ids.shape[-1] if self.pre_process and input_ids is not None else None
        return hidden.shape[0] * (self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1)

    def _hidden_states(self, input_ids, position_ids, attention_mask, **kwargs):
        """``forward(return_hidden=True)``: the output layer skipped (``_postprocess``), packed batches only."""
        if attention_mask is not None or kwargs.get("mtp_input_ids") is not None:
            raise ValueError("return_hidden=True takes a packed batch, without attention_mask or mtp_input_ids")
        self._skip_output_layer = True
        try:
            return self.forward(input_ids, position_ids, None, **kwargs)
        finally:
            self._skip_output_layer = False

    def _check_mtp_ids(self, mtp_input_ids, input_ids):
        """``mtp_input_ids`` for this stage: None where ignored (stages without the output layer)."""
        if not self.post_process:
            return None
        depth = self.config.mtp_num_layers or 0
        if not getattr(self, "mtp_process", False):
            raise ValueError("mtp_input_ids given to a model without MTP layers; build it with "
                             "ModelArgs(mtp_num_layers=...), or leave mtp_input_ids out")
        want = (depth, *input_ids.shape) if input_ids is not None else (depth, *mtp_input_ids.shape[1:])
        if tuple(mtp_input_ids.shape) != want or mtp_input_ids.dtype.is_floating_point:
            raise ValueError(f"mtp_input_ids has shape {tuple(mtp_input_ids.shape)} and dtype {mtp_input_ids.dtype}; "
                             f"pass integer ids [mtp_num_layers, *input_ids.shape] = {list(want)}")
        return mtp_input_ids

    def _preprocess(self, *args, **kwargs):
        """Megatron-Core's preprocessing, with a BSHD batch's RoPE angles taken from ``position_ids`` per token
        (Megatron-Core's own are ``0..s-1`` whatever the positions); stacked MTP ids embed their main row."""
        ids = kwargs.get("input_ids")
        if ids is not None and ids.dim() == 3:
            kwargs["input_ids"] = ids[0]
        out = super()._preprocess(*args, **kwargs)
        positions, params = kwargs.get("position_ids"), kwargs.get("packed_seq_params")
        if positions is None or params is not None or (out[1] is None and not self.mixer_rotates) \
                or self.position_embedding_type == "mrope":
            return out  # (multimodal RoPE: Megatron-Core's "mrope" branch computed them per token already)
        angles = rotary_angles(self.rotary_pos_emb, positions.transpose(0, 1))  # [s, b, d]
        return (out[0], angles[:, :, None, :], *out[2:])

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        """Megatron-Core's postprocessing; on a stage with MTP layers, unless Megatron-Core's own MTP loss is
        asked for (``labels=`` with 2-D ids), :func:`packfwd.models.runtime.mtp.postprocess`: the main logits alone,
        or with stacked MTP ids ``(logits, each depth's hidden states)``.  Under ``forward(return_hidden=True)``:
        the hidden states."""
        if getattr(self, "_skip_output_layer", False):
            return hidden_states
        if getattr(self, "mtp_process", False) and (labels is None or input_ids.dim() == 3):
            return mtp.postprocess(self, hidden_states, input_ids, position_ids=position_ids, **kwargs)
        return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
