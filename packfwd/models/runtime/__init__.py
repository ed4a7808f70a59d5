"""The Megatron-Core runtime of packfwd's models: the builder (:mod:`~packfwd.models.runtime.gpt`: ``build_model``,
``model_args``), the config (:mod:`~packfwd.models.runtime.config`: ``transformer_config``), the model class
(:mod:`~packfwd.models.runtime.model`), the layer specs assembled from the components
(:mod:`~packfwd.models.runtime.spec`), MTP (:mod:`~packfwd.models.runtime.mtp`), the CPU adaptations
(:mod:`~packfwd.models.runtime.cpu`) and Megatron-Core's parallel state (:mod:`~packfwd.models.runtime.parallel_state`:
``ensure_model_parallel``, ``stage_process_groups``, ``StagePlacement``).  The names in backticks are re-exported here.

Importing this package does not import Megatron-Core.
"""

from .config import transformer_config as transformer_config
from .gpt import build_model as build_model
from .gpt import model_args as model_args
from .parallel_state import StagePlacement as StagePlacement
from .parallel_state import ensure_model_parallel as ensure_model_parallel
from .parallel_state import stage_process_groups as stage_process_groups

__all__ = ["StagePlacement", "build_model", "ensure_model_parallel", "model_args", "stage_process_groups",
           "transformer_config"]
