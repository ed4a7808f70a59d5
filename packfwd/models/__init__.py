"""Megatron-Core-backed decoders of packfwd's model families: build them, load HF transformers weights into them,
and back.

The public names are re-exported here: ``ModelArgs`` and ``build_model`` (a model with random weights, any
tp/cp/pp/vpp stage), ``from_hf`` / ``to_hf_state_dict`` / ``megatron_to_hf`` (transformers weights in and out),
``is_value_model``.  Inside, by floor (each imports only the ones above it in this list, ``tests/test_models_layout``):

* ``mapping`` (the weight-mapping vocabulary: a ``Weight`` row per tensor, its HF names, its TP cut), ``norm``
  (RMSNorm), ``component`` (what a layer component is);
* ``mixers`` (token mixers: ``softmax`` attention, multi-head latent attention ``latent`` / ``mla``; their core
  attention, varlen backends and RoPE) and ``mlp`` (``dense`` SwiGLU, ``moe`` Mixture of Experts and its router,
  experts, dispatchers, routing statistics): each component owns its ``ModelArgs`` fields, its Megatron-Core config
  fields, its layer spec and its weight table;
* ``families``: one module per family, its ``Family`` entry (its components and how to read their fields from a
  transformers config);
* ``args``: ``ModelArgs``;
* ``runtime``: the Megatron-Core model (``PackedGPTModel``), ``build_model``, ``transformer_config``, layer specs,
  MTP, the CPU adaptations, ``ensure_model_parallel``;
* ``convert``: ``from_hf``, ``args_from_hf_config``, the state dicts both ways (the engine applying the tables),
  the vision-language model's language model.

Importing this package does not import Megatron-Core; building a model does.
"""

from .args import ModelArgs as ModelArgs
from .runtime.gpt import build_model as build_model
from .runtime.gpt import is_value_model as is_value_model
from .convert.hf import from_hf as from_hf
from .convert.hf import to_hf_state_dict as to_hf_state_dict
from .convert.hf_weights import megatron_to_hf as megatron_to_hf

__all__ = ["ModelArgs", "build_model", "from_hf", "is_value_model", "megatron_to_hf", "to_hf_state_dict"]
