"""Multi-token prediction (MTP) in packfwd's models: Megatron-Core's ``MultiTokenPredictionBlock``, built from a
packfwd spec, whose layers take each depth's input ids from the caller instead of rolling the packed buffer.

Megatron-Core's MTP layer ``k`` combines the hidden state of token ``i`` with the embedding of token ``i + k``
(DeepSeek-V3's MTP), and the loss of depth ``k`` at token ``i`` targets token ``i + k + 1``.  It finds "``k``
places later" by rolling the ids, labels and loss mask one place left per depth (``roll_tensor``).  Over a
packed THD buffer that roll cuts sequences at ``cu_seqlens_q``, the *real* offsets, while the buffer is laid out
by the padded ones, so with any per-sequence padding (sequence parallelism, context parallelism) tokens move
across sequence boundaries, and under CP the chunk edges are misread (Megatron-LM #4494/#4495); it also loops
over the sequences in Python with host syncs.

packfwd does not rely on it.  The caller computes every depth's ids in its own layout
(``packfwd.layout.labels.shift_in_sequence``: the token ``k`` places later in the same sequence, 0 where there is
none) and packs them like the ids; :class:`PackedMtpLayer`, the layer of packfwd's MTP spec, embeds its depth's
ids as given.  The model receives them as ``mtp_input_ids [D, *input_ids.shape]`` and passes them down stacked
under the main ids (``input_ids [1 + D, ...]``), which is how they reach the block; each layer takes the first
row and hands the rest to the next.  Given ordinary 2-D ids (Megatron-Core's calling convention, e.g. a caller
that passes ``labels=`` and lets Megatron-Core compute the MTP loss), the layer rolls as Megatron-Core does.

Layer numbers.  MTP depth ``k`` (1-based) is the block's layer ``k`` (``layer_number``, 1-based, as in both
Megatron-Cores) and the model's global layer ``num_layers + k - 1`` (0-based; where DeepSeek-V3-style checkpoints
store it).  Its inner transformer layer is numbered ``num_layers + k`` by Megatron-Core 0.16 and ``k`` by 0.19
(``is_mtp_layer``); the model checks both against these.  The MTP block lives on the last pipeline stage (and the
last virtual stage), with a copy of the word embedding there (Megatron-Core's rule; tied output weights are
read from that copy on that stage).

This module imports Megatron-Core; ``packfwd.models`` imports it only when a model is built.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import make_viewless_tensor

from ..norm import norm_class
from .spec import layer_spec

__all__ = ["PackedMtpLayer", "check_mtp_layers", "inner_layer_name", "mtp_block_spec", "postprocess", "with_logits"]

_SUBMODULE_FIELDS = {f.name for f in dataclasses.fields(MultiTokenPredictionLayerSubmodules)}
# the inner layer's field: ``transformer_layer`` in Megatron-Core 0.16, ``mtp_model_layer`` from 0.19
_INNER = "mtp_model_layer" if "mtp_model_layer" in _SUBMODULE_FIELDS else "transformer_layer"
# Megatron-Core 0.19's ``_get_embeddings`` also rolls (and returns) the MoE routing padding mask
_WITH_PADDING_MASK = "padding_mask" in inspect.signature(MultiTokenPredictionLayer._get_embeddings).parameters


class PackedMtpLayer(MultiTokenPredictionLayer):
    """Megatron-Core's ``MultiTokenPredictionLayer`` (enorm, hnorm, ``eh_proj``, one transformer layer, final
    norm), whose input ids are given per depth instead of rolled.

    ``input_ids``: ``[D', *ids]`` stacked ids of this depth and the ones after it (3-D): this layer embeds row 0
    and returns rows ``1:`` for the next layer.  2-D ids: Megatron-Core's roll (its own calling convention)."""

    def _get_embeddings(self, input_ids, position_ids, embedding, hidden_states, packed_seq_params=None, **kwargs):
        if input_ids is None or input_ids.dim() != 3:
            return super()._get_embeddings(input_ids=input_ids, position_ids=position_ids, embedding=embedding,
                                           hidden_states=hidden_states, packed_seq_params=packed_seq_params,
                                           **kwargs)
        decoder_input = embedding(input_ids=input_ids[0], position_ids=position_ids)
        if getattr(self.config, "mtp_detach_heads", False):
            decoder_input = decoder_input.detach()
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        if _WITH_PADDING_MASK:
            return input_ids[1:], position_ids, kwargs.get("padding_mask"), decoder_input, hidden_states
        return input_ids[1:], position_ids, decoder_input, hidden_states


def mtp_block_spec(num_layers: int, *, args=None, attention_backend: str | None = None, rope=None) -> ModuleSpec:
    """The ``ModuleSpec`` of an MTP block of ``num_layers`` depths: :class:`PackedMtpLayer` s whose norms are
    the model's layer norm (:func:`packfwd.models.norm.norm_class`: RMSNorm, zero-centred for Qwen3.5), ``eh_proj``
    Megatron's ``ColumnParallelLinear``, and inner layer packfwd's decoder layer
    (:func:`packfwd.models.runtime.spec.layer_spec` of ``args``, the model's: its core attention and THD RoPE).

    >>> spec = mtp_block_spec(2, attention_backend="reference")
    >>> [s.module.__name__ for s in spec.submodules.layer_specs]
    ['PackedMtpLayer', 'PackedMtpLayer']
    """
    submodules = MultiTokenPredictionLayerSubmodules(
        enorm=norm_class(args), hnorm=norm_class(args), layer_norm=norm_class(args), eh_proj=ColumnParallelLinear,
        **{_INNER: layer_spec(args, args.num_layers if args is not None else 0, attention_backend=attention_backend,
                              rope=rope)},
    )
    layer = ModuleSpec(module=PackedMtpLayer, submodules=submodules)
    return ModuleSpec(module=MultiTokenPredictionBlock,
                      submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * num_layers))


def inner_layer_name() -> str:
    """The name of an MTP layer's inner transformer layer in this Megatron-Core (module docstring): where its
    weights sit in the state dict, ``mtp.layers.{k}.<name>.``.

    >>> inner_layer_name() in ("mtp_model_layer", "transformer_layer")
    True
    """
    return _INNER


def check_mtp_layers(model, num_layers: int) -> None:
    """The MTP layers Megatron-Core built are depths ``1..D``, their inner layers numbered as the module
    docstring says (``num_layers + k`` in Megatron-Core 0.16, ``k`` from 0.19)."""
    depths = [layer.layer_number for layer in model.mtp.layers]
    inner = [getattr(layer, _INNER).layer_number for layer in model.mtp.layers]
    want = list(range(1, model.config.mtp_num_layers + 1))
    if depths != want or inner not in ([num_layers + k for k in want], want):
        raise RuntimeError(f"Megatron-Core numbered the MTP layers {depths} (inner layers {inner}), but packfwd "
                           f"expects depths {want}; please report this configuration")


def postprocess(model, hidden_states, input_ids, **kwargs):
    """The last stage's output of a model with MTP layers (``model._postprocess`` for it):

    * ``input_ids [1 + D, ...]`` (main ids, then each depth's): the MTP layers run on them, and the result is
      ``(logits [b, s, v], hidden)``, ``hidden`` each depth's final-normed hidden states ``[s, b, h]`` (turned
      into logits by :func:`with_logits`, in the model's forward);
    * 2-D ids: the logits of the main head alone, MTP layers skipped (a forward that computes no MTP).
    """
    if input_ids is None or input_ids.dim() != 3:
        return _logits(model, hidden_states, kwargs.get("runtime_gather_output"))
    hidden_states = model.mtp(
        input_ids=input_ids[1:], position_ids=kwargs.get("position_ids"), hidden_states=hidden_states,
        attention_mask=kwargs.get("attention_mask"), rotary_pos_emb=kwargs.get("rotary_pos_emb"),
        rotary_pos_cos=kwargs.get("rotary_pos_cos"), rotary_pos_sin=kwargs.get("rotary_pos_sin"),
        packed_seq_params=kwargs.get("packed_seq_params"), sequence_len_offset=kwargs.get("sequence_len_offset"),
        embedding=model.embedding,
    )
    chunks = torch.chunk(hidden_states, 1 + model.config.mtp_num_layers, dim=0)
    return _logits(model, chunks[0], kwargs.get("runtime_gather_output")), chunks[1:]


def with_logits(model, out, *, detach_head: bool = False):
    """``(logits, hidden)`` from :func:`postprocess` -> ``(logits, mtp_logits [D, b, s, v])``: each depth through
    the shared output layer, whose weight is detached with ``detach_head`` or the config's ``mtp_detach_heads``
    (then the MTP loss does not train the output layer)."""
    logits, hidden = out
    detach = detach_head or getattr(model.config, "mtp_detach_heads", False)
    return logits, torch.stack([_logits(model, h, None, detach=detach) for h in hidden])


def _logits(model, hidden, gather, detach: bool = False):
    """``[s, b, h] -> [b, s, v]`` through the output layer (the tied embedding on its stage)."""
    if model.share_embeddings_and_output_weights:
        weight = model.shared_embedding_or_output_weight()
    else:
        weight = model.output_layer.weight if detach else None
    if detach:
        weight = weight.detach()
    out, _ = model.output_layer(hidden, weight=weight, runtime_gather_output=gather)
    out = getattr(model, "_scale_logits", lambda x: x)(out)  # MuP output scaling (Megatron-Core 0.19; off here)
    return out.transpose(0, 1).contiguous()
