"""Megatron-Core-backed decoders of packfwd's model families: build them, load HF transformers weights into them,
and back.  A family is one entry of ``family.FAMILIES`` (:mod:`packfwd.models.families.family`); the config, the layer
spec and the weight mapping are derived from it.

The public names are re-exported here: ``ModelArgs`` and ``build_model`` (a model with random weights, any
tp/cp/pp/vpp stage), ``from_hf`` / ``to_hf_state_dict`` / ``megatron_to_hf`` (transformers weights in and out),
``is_value_model``.  The rest stays in the submodules: ``family`` (``Family``, ``FAMILIES``, ``Moe``, the MLP
kinds), ``gpt`` (``transformer_config``, ``model_args``, ``unwrap``, ``ValueHead``), ``model``
(``PackedGPTModel``, the model class), ``mtp`` (its multi-token prediction block), ``spec`` (``layer_spec``),
``attention`` (``CoreAttention``), ``varlen`` (the attention backends), ``rope``, ``hf`` (``args_from_hf_config``,
``load_weights``), ``hf_weights`` (``hf_to_megatron``), ``runtime`` (``ensure_model_parallel``) and ``cpu``.
Importing this package does not import Megatron-Core; building a model does.
"""

from .args import ModelArgs as ModelArgs
from .runtime.gpt import build_model as build_model
from .runtime.gpt import is_value_model as is_value_model
from .convert.hf import from_hf as from_hf
from .convert.hf import to_hf_state_dict as to_hf_state_dict
from .convert.hf_weights import megatron_to_hf as megatron_to_hf

__all__ = ["ModelArgs", "build_model", "from_hf", "is_value_model", "megatron_to_hf", "to_hf_state_dict"]
