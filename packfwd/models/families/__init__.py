"""packfwd's model families, one module each: its :class:`~packfwd.models.families.entry.Family` entry (``FAMILY``:
the transformers ``model_type`` s it converts, its layer components and how to read their fields from a config,
what it refuses) and the readers of its config flags.  Its weight mapping is its components' tables
(:mod:`packfwd.models.mixers`, :mod:`packfwd.models.mlp`) with the entry's ``layer_weights``.

``FAMILIES`` maps a name to its entry; :func:`family` looks one up by name, :func:`family_of_hf_config` by a
transformers config's ``model_type``.  ``Family`` is the entry's type (:mod:`~packfwd.models.families.entry`).
**Adding a family** whose layers are built from existing components is one module here, listed in ``_MODULES``; a
new kind of token mixer or MLP is one component module beside the others.  Importing this package does not import Megatron-Core.
"""

from . import deepseek_v3, glm4_moe, llama, mixtral, qwen2, qwen2_moe, qwen2_vl, qwen3, qwen3_5, qwen3_5_moe, qwen3_moe
from . import gpt_oss, kimi_linear, qwen3_next
from .entry import Family as Family

__all__ = ["FAMILIES", "Family", "family", "family_of_hf_config"]

_MODULES = (llama, qwen2, qwen2_vl, qwen3, qwen3_moe, qwen2_moe, mixtral, glm4_moe, deepseek_v3, qwen3_next, qwen3_5,
            qwen3_5_moe, gpt_oss, kimi_linear)

FAMILIES: dict[str, Family] = {m.FAMILY.name: m.FAMILY for m in _MODULES}


def family(name: str) -> Family:
    """The entry of ``FAMILIES`` called ``name``.

    >>> family("qwen2").hf_model_types
    ('qwen2',)
    """
    if name not in FAMILIES:
        raise ValueError(f"family={name!r} is not one of packfwd's model families {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_of_hf_config(cfg) -> Family:
    """The entry whose ``hf_model_types`` holds the transformers config's ``model_type``.

    >>> from transformers import LlamaConfig
    >>> family_of_hf_config(LlamaConfig()).name
    'llama'
    """
    kind = getattr(cfg, "model_type", None)
    for entry in FAMILIES.values():
        if kind in entry.hf_model_types:
            return entry
    supported = tuple(t for entry in FAMILIES.values() for t in entry.hf_model_types)
    raise ValueError(f"model_type={kind!r} is not supported; packfwd converts {supported}")
