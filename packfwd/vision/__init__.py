"""Vision-language inputs: multimodal (3-D) RoPE positions of a text+image+video batch.

* ``mrope_position_ids``  Qwen2-VL / Qwen2.5-VL positions ``[3, b, s]`` and deltas ``[b]``, equal to
  transformers' ``get_rope_index``, computed without a loop over tokens or images
* ``VisionLanguageModel`` / ``from_hf``  transformers' Qwen2-VL vision tower + packfwd's multimodal-RoPE language
  model, packing its merged embeddings with ``make_forward(vision=True)``'s hook (``packfwd.forward.vision``)
"""

from .rope_index import mrope_position_ids as mrope_position_ids
from .model import VisionLanguageModel as VisionLanguageModel
from .model import from_hf as from_hf

__all__ = ["VisionLanguageModel", "from_hf", "mrope_position_ids"]
