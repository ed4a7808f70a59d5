"""Token mixers: the parts of a decoder layer that mix information across tokens, and what they are built from.

* softmax attention: :mod:`~packfwd.models.mixers.attention` (``CoreAttention``, packfwd's core attention over THD
  or BSHD batches), :mod:`~packfwd.models.mixers.varlen` (its varlen backends), :mod:`~packfwd.models.mixers.rope`
  and :mod:`~packfwd.models.mixers.mrope` (RoPE without host syncs, multimodal RoPE);
* multi-head latent attention (DeepSeek-V3): :mod:`~packfwd.models.mixers.latent` (the ``Mla`` description),
  :mod:`~packfwd.models.mixers.mla` (the Megatron-Core module), :mod:`~packfwd.models.mixers.mla_weights`.

Importing this package does not import Megatron-Core.
"""

__all__: list[str] = []
