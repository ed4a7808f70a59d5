"""The Megatron-Core runtime of packfwd's models: the model class (:mod:`~packfwd.models.runtime.model`), its
builder (:mod:`~packfwd.models.runtime.gpt`), layer specs (:mod:`~packfwd.models.runtime.spec`), MTP
(:mod:`~packfwd.models.runtime.mtp`), the CPU adaptations (:mod:`~packfwd.models.runtime.cpu`) and Megatron-Core's
parallel state (:mod:`~packfwd.models.runtime.parallel_state`: ``ensure_model_parallel``, ``stage_process_groups``,
``StagePlacement``, re-exported here).

Importing this package does not import Megatron-Core.
"""

from .parallel_state import StagePlacement as StagePlacement
from .parallel_state import ensure_model_parallel as ensure_model_parallel
from .parallel_state import stage_process_groups as stage_process_groups

__all__ = ["StagePlacement", "ensure_model_parallel", "stage_process_groups"]
