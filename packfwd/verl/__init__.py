"""verl's Megatron-Core forwards with packfwd inside: swap the import, keep the call.

::

    # from verl.models.mcore.model_forward import model_forward_gen, gptmodel_forward_model_engine
    from packfwd.verl import model_forward_gen, gptmodel_forward_model_engine

Same signatures and results as verl 0.9.1's (``verl/models/mcore/model_forward.py``): parallel sizes, ranks and
groups from ``megatron.core.parallel_state``, sequence parallelism and FP8 from the model's config, verl's THD
layout token for token, the logits processor called with verl's shapes.  The packing and unpacking are
``make_forward``'s layout adapters in verl's flavour (:mod:`packfwd.verl.layouts`: verl's alignment from
:func:`packfwd.layout.rules.verl_alignment`, its ``PackedSeqParams``), so planned gathers (no Python loop over the
batch, one host sync to plan).  Where the results differ from verl's (labels at each sequence's last token, video
timing and positions given to a vision model, a few arguments verl crashes on): docs/verl.md, "Where
``packfwd.verl`` differs from verl".

``r3_replay_inputs(routed_experts, input_ids, response_mask)`` (:mod:`packfwd.verl.replay`): verl's R3 router
replay inputs (the rollout's routes aligned to the ids, the per-token ``replay_mask``) for
``gptmodel_forward_model_engine(..., routed_experts=, replay_mask=)``.

``packfwd_bridge(hf_config, dtype)`` (:mod:`packfwd.verl.bridge`): verl's HF <-> Megatron-Core bridge mbridge,
loading and exporting the weights of a model packfwd builds.

Importing this package imports neither verl, mbridge nor Megatron-Core.
"""

from .bridge import packfwd_bridge as packfwd_bridge
from .nested import gptmodel_forward_model_engine as gptmodel_forward_model_engine
from .padded import model_forward_gen as model_forward_gen
from .replay import r3_replay_inputs as r3_replay_inputs

__all__ = ["gptmodel_forward_model_engine", "model_forward_gen", "packfwd_bridge", "r3_replay_inputs"]
