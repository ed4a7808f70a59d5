"""The language model of a transformers Qwen2-VL / Qwen2.5-VL / Qwen3.5 (dense or MoE) as packfwd's Megatron-Core
model (multimodal RoPE).

The VL language model is a Qwen2 decoder (QKV bias, SwiGLU, RMSNorm, grouped-query attention) whose RoPE is
multimodal (``rope_parameters["mrope_section"]``, :mod:`packfwd.models.mixers.mrope`); its weights are the Qwen2
weights under another prefix.  So :func:`vl_args_from_hf_config` reads the text config into :class:`ModelArgs`
with ``mrope_section``, :func:`language_model_state_dict` renames the language model's tensors to the names
:func:`packfwd.models.convert.hf_weights.hf_to_megatron` reads (the vision tower's are left out), and
:func:`language_model_from_hf` builds the model (TP-sharded, any pipeline stage) with them.  The vision tower stays
transformers' (``hf.model.visual``): :mod:`packfwd.vision.model` merges its output into the embeddings.

Qwen3.5's (``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``) is the hybrid text model of
the ``qwen3_5`` / ``qwen3_5_moe`` family (Gated DeltaNet and gated full attention, partial RoPE) whose full-attention
layers take interleaved multimodal RoPE over the rotated channels (``mrope_section``, default ``[11, 11, 10]`` as
transformers'; ``mrope_interleaved=True``: transformers 5.x interleaves whatever the config's flag says).

Names in transformers 5.x: ``model.language_model.{embed_tokens,layers.i,norm}``, ``model.visual``, ``lm_head``;
in 4.x: ``model.{embed_tokens,layers.i,norm}``, ``visual``, ``lm_head``.  Both are read.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from ..args import ModelArgs
from ..families import family

__all__ = ["language_model_from_hf", "language_model_state_dict", "vl_args_from_hf_config"]


# Qwen3.5's vision-language model_type -> the packfwd family of its text model
_QWEN3_5 = {"qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe"}
_QWEN3_5_SECTION = (11, 11, 10)  # transformers' Qwen3_5TextRotaryEmbedding without rope_parameters["mrope_section"]


def vl_args_from_hf_config(hf_config) -> ModelArgs:
    """:class:`ModelArgs` (with ``mrope_section``) of a transformers ``Qwen2VLConfig`` / ``Qwen2_5_VLConfig`` (or
    their text configs), or of a ``Qwen3_5Config`` / ``Qwen3_5MoeConfig`` (interleaved sections, module docstring).

    >>> from transformers import Qwen2VLConfig
    >>> cfg = Qwen2VLConfig(text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                                      num_attention_heads=2, num_key_value_heads=1,
    ...                                      rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3])))
    >>> args = vl_args_from_hf_config(cfg)
    >>> args.mrope_section, args.qkv_bias, args.num_query_groups
    ((2, 3, 3), True, 1)
    """
    entry = family("qwen2_vl")
    kind = getattr(hf_config, "model_type", None)
    if kind in _QWEN3_5:
        text = hf_config.text_config
        params = getattr(text, "rope_parameters", None) or {}
        section = tuple(params.get("mrope_section") or _QWEN3_5_SECTION)
        return ModelArgs(**family(_QWEN3_5[kind]).hf_fields(hf_config), mrope_section=section, mrope_interleaved=True)
    if kind not in entry.hf_model_types:
        raise ValueError(f"model_type={kind!r} is not a vision-language config packfwd converts: "
                         f"{entry.hf_model_types + tuple(_QWEN3_5)}")
    return ModelArgs(**entry.hf_fields(hf_config))


def language_model_state_dict(hf_state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The language model's tensors of a Qwen2-VL state dict under the Qwen2 names (``model.layers.i...``,
    ``model.embed_tokens``, ``model.norm``, ``lm_head``); the vision tower's are left out.  No copies.

    >>> language_model_state_dict({"model.language_model.norm.weight": 1, "model.visual.x": 2, "lm_head.weight": 3})
    {'model.norm.weight': 1, 'lm_head.weight': 3}
    """
    out = {}
    for name, value in hf_state_dict.items():
        if name.startswith(("model.visual.", "visual.")):
            continue
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        out[name] = value
    return out


def language_model_from_hf(
    hf_model: torch.nn.Module,
    *,
    device: torch.device | str | None = None,
    params_dtype: torch.dtype | None = None,
    attention_backend: str | None = None,
    tp_size: int | None = None,
    sequence_parallel: bool = False,
    pp_rank: int = 0,
    pp_size: int = 1,
):
    """packfwd's Megatron-Core model (multimodal RoPE) with the language model of a transformers
    ``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration`` /
    ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` (this process's TP shard, pipeline
    stage ``pp_rank`` of ``pp_size``).  ``device``/``params_dtype`` default to the HF model's.  Like
    :func:`packfwd.models.from_hf`, it sets up a one-process group when ``torch.distributed`` is not initialised.

    >>> from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    >>> cfg = Qwen2VLConfig(text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                                      num_attention_heads=2, num_key_value_heads=1,
    ...                                      rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3])),
    ...                     vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2))
    >>> hf = Qwen2VLForConditionalGeneration(cfg).eval()
    >>> model = language_model_from_hf(hf)
    >>> ids = torch.randint(0, 64, (1, 5))                       # text only: three equal position coordinates
    >>> torch.allclose(model(ids, None, None), hf(input_ids=ids).logits, atol=1e-5)
    True
    """
    from megatron.core import parallel_state

    from packfwd.layers import layer_partition

    from ..runtime.gpt import build_model
    from .hf import load_weights
    from .hf_weights import hf_to_megatron
    from ..runtime.parallel_state import ensure_model_parallel

    if not isinstance(hf_model, torch.nn.Module) or not hasattr(hf_model, "config"):
        raise TypeError(f"language_model_from_hf takes a transformers model, got {type(hf_model).__name__}")
    if not hasattr(hf_model, "lm_head"):
        raise ValueError(f"{type(hf_model).__name__} has no lm_head; pass the whole ...ForConditionalGeneration")
    args = vl_args_from_hf_config(hf_model.config)
    first = next(hf_model.parameters())
    device = first.device if device is None else torch.device(device)
    params_dtype = first.dtype if params_dtype is None else params_dtype
    ensure_model_parallel(tp_size=tp_size)
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    model = build_model(args, device=device, params_dtype=params_dtype, attention_backend=attention_backend,
                        sequence_parallel=sequence_parallel, pp_rank=pp_rank, pp_size=pp_size, init=False)
    layers = layer_partition(args.num_layers, pp_size)[pp_rank][0]
    weights = hf_to_megatron(language_model_state_dict(hf_model.state_dict()), args, tp_size=tp, tp_rank=rank,
                             layers=layers, pre_process=model.pre_process, post_process=model.post_process)
    return load_weights(model, weights)
