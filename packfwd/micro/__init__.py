"""Micro-batches for variable-length batches: a pure planner and a CPU step that runs a forward over them.

* ``plan``  ``plan_micro_batches``: which sequences each DP rank runs in each micro-batch, within a token budget
  on the real padded footprint, balanced in tokens or FLOPs (``MicroBatchPlan``, with ``restore``)
* ``pack``  the packing algorithm and why (capacity-aware LPT, Karmarkar-Karp on small batches, best fit)
* ``bestfit``, ``kk``, ``refine``, ``ranks``  best fit and bounds on the costliest micro-batch, Karmarkar-Karp,
  pairwise exchanges, micro-batches to DP ranks
* ``buckets``, ``graphs``  the fixed shapes micro-batches are padded to and the CUDA graphs of their steps
  (``StepGraphs``: run_micro_batches(graphs=True or None) on CUDA; off by default)
* ``step``, ``pipeline``  ``run_micro_batches``: forward (and backward) of one rank's micro-batches, losses
  normalised over the whole global batch, also through a pipeline schedule (``pp_group=``);
  ``agree_micro_batch_count`` for ranks that plan their own lengths

Public: ``plan_micro_batches`` and its ``MicroBatchPlan``; ``run_micro_batches`` and its ``StepResult``;
``sequence_weights`` (each sequence's share of the global loss); ``agree_micro_batch_count``; ``StepGraphs`` (the
step's CUDA graphs, held by the caller).
"""

from .graphs import StepGraphs as StepGraphs
from .plan import MicroBatchPlan as MicroBatchPlan
from .plan import plan_micro_batches as plan_micro_batches
from .step import StepResult as StepResult
from .step import agree_micro_batch_count as agree_micro_batch_count
from .step import run_micro_batches as run_micro_batches
from .step import sequence_weights as sequence_weights

__all__ = ["MicroBatchPlan", "StepGraphs", "StepResult", "agree_micro_batch_count", "plan_micro_batches", "run_micro_batches",
           "sequence_weights"]
