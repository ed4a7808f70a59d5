"""Megatron-Core-backed Llama/Qwen2 models: build them, load HF transformers weights into them, and back.

Importing this package does not import Megatron-Core; the functions do, when called.
"""

from .gpt import ModelArgs as ModelArgs
from .gpt import ValueHead as ValueHead
from .gpt import build_model as build_model
from .gpt import is_value_model as is_value_model
from .gpt import model_args as model_args
from .gpt import transformer_config as transformer_config
from .gpt import unwrap as unwrap
from .hf import args_from_hf_config as args_from_hf_config
from .hf import from_hf as from_hf
from .hf import hf_to_megatron as hf_to_megatron
from .hf import load_weights as load_weights
from .hf import megatron_to_hf as megatron_to_hf
from .hf import to_hf_state_dict as to_hf_state_dict
from .runtime import ensure_model_parallel as ensure_model_parallel
from .spec import layer_spec as layer_spec
