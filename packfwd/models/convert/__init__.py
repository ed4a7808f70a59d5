"""HF transformers models <-> packfwd's Megatron-Core models: :mod:`~packfwd.models.convert.hf` (configs, ``from_hf``,
``to_hf_state_dict``), :mod:`~packfwd.models.convert.hf_weights` (the state dicts both ways, TP-sharded) and
:mod:`~packfwd.models.convert.hf_vl` (a vision-language model's language model).

Importing this package does not import Megatron-Core.
"""

__all__: list[str] = []
