"""Megatron-Core's parallel state for packfwd's model builders.

Megatron-Core's modules read their tensor-, context- and pipeline-parallel groups from
``megatron.core.parallel_state``, which needs ``torch.distributed``.  :func:`ensure_model_parallel` makes that
state usable: in a process where ``torch.distributed`` is not initialised it creates a one-process ``gloo``
world (an in-memory store: no port, no environment variables) and Megatron's groups of size 1, so the builders
work in a fresh Python process.  Under a real launcher (torchrun, ``packfwd.testing.run_local``) the caller
initialises both and the sizes are only checked.

:func:`stage_process_groups` lets one process build any pipeline stage: Megatron-Core takes a stage's rank from
``pg_collection.pp`` (its layer numbers, and whether it is the first or last stage), so when the real pipeline
group is smaller than the requested ``pp`` (building all stages in one process, to compose them in a test)
it stands in a :class:`StagePlacement` that reports the requested rank and size.
"""

from __future__ import annotations

import warnings

from dataclasses import dataclass

import torch  # noqa: F401  (the doctests read torch.distributed)

__all__ = ["StagePlacement", "ensure_model_parallel", "ensure_pipeline", "stage_process_groups"]


def ensure_model_parallel(
    *,
    tp_size: int | None = None,
    cp_size: int | None = None,
    pp_size: int | None = None,
    vpp_size: int | None = None,
    ep_size: int | None = None,
    etp_size: int | None = None,
) -> None:
    """Make ``megatron.core.parallel_state`` usable; check its sizes against the given ones (None: any).

    Side effect, documented: without an initialised ``torch.distributed`` this creates a single-process gloo
    world and Megatron's model-parallel groups (all of size 1).  A size other than 1 then is a ValueError: a
    real TP/CP/PP run needs a launcher that starts one process per rank.  Under a launcher (``torch.distributed``
    initialised, Megatron's state not yet), it initialises Megatron's groups with the given sizes (None: 1), the
    ranks laid out in Megatron's default order (TP fastest, then CP, DP, PP); ``ep_size`` splits the experts over
    ``ep_size`` consecutive data-parallel ranks (Megatron-Core's ``expert_model_parallel_size``: expert-parallel
    ranks are data-parallel ranks, each with its own batch).  ``etp_size`` is the experts' tensor-parallel size
    (Megatron-Core's ``expert_tensor_parallel_size``; None: TP's); with ``etp_size=1`` the expert grid (ETP, then
    EP, then expert-DP) puts ``ep_size`` consecutive ranks in an expert-parallel group: with TP=2, EP=2 each TP
    group is an expert-parallel group (the TP ranks of one batch hold different experts, whole).

    >>> ensure_model_parallel(tp_size=1)
    >>> from megatron.core import parallel_state
    >>> parallel_state.get_tensor_model_parallel_world_size(), torch.distributed.get_world_size()
    (1, 1)
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    wanted = {"tp_size": tp_size, "cp_size": cp_size, "pp_size": pp_size, "vpp_size": vpp_size, "ep_size": ep_size,
              "etp_size": etp_size}
    if not dist.is_initialized():
        if any((v or 1) != 1 for v in wanted.values()):
            given = ", ".join(f"{k}={v}" for k, v in wanted.items() if v is not None)
            raise ValueError(
                f"{given} need one process per rank; start them with torchrun or packfwd.testing.run_local (which "
                "initialise torch.distributed) and call this again there"
            )
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp_size or 1,
            pipeline_model_parallel_size=pp_size or 1,
            virtual_pipeline_model_parallel_size=vpp_size if (vpp_size or 1) > 1 else None,
            context_parallel_size=cp_size or 1,
            expert_model_parallel_size=ep_size or 1,
            expert_tensor_parallel_size=etp_size,
        )
    have = {
        "tp_size": parallel_state.get_tensor_model_parallel_world_size(),
        "cp_size": parallel_state.get_context_parallel_world_size(),
        "pp_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "vpp_size": parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
        "ep_size": parallel_state.get_expert_model_parallel_world_size(),
        "etp_size": parallel_state.get_expert_tensor_parallel_world_size(),
    }
    for name, want in wanted.items():
        if want is not None and want != have[name]:
            raise ValueError(
                f"{name}={want} but megatron.core.parallel_state was initialised with {have[name]}; pass "
                f"{name}={have[name]} (or None), or initialise the parallel state with the sizes you want"
            )


@dataclass(frozen=True)
class StagePlacement:
    """A stand-in for the pipeline process group when one process builds a stage of a larger pipeline.

    Megatron-Core asks the group only for its ``rank()`` and ``size()`` while building and running a stage.

    >>> StagePlacement(rank_=1, size_=4).rank()
    1
    """

    rank_: int
    size_: int

    def rank(self) -> int:
        return self.rank_

    def size(self) -> int:
        return self.size_


def ensure_pipeline(pp_size: int, vpp_size: int = 1, *, warn: bool = True, **sizes) -> None:
    """:func:`ensure_model_parallel` for building a stage of a ``pp_size``-stage pipeline: under a launcher (more
    than one process) whose Megatron state is not yet made, its groups are made with the pipeline's sizes too, so that
    the data-parallel group holds one stage's replicas, not every stage (whose gradients a DP all-reduce would add
    up).  Megatron's state made earlier without that pipeline, with data parallelism, is what the caller chose (every
    process may hold every stage), said once in a warning: a process holding one stage must make the state with
    ``ensure_model_parallel(pp_size=...)`` first.  In one process any stage may be built (a :class:`StagePlacement`
    stands in for the pipeline group).  ``warn=False``: no warning (a caller that builds the stage next, which
    warns)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    launched = dist.is_initialized() and dist.get_world_size() > 1
    if launched and pp_size > 1 and not parallel_state.model_parallel_is_initialized():
        sizes = {**sizes, "pp_size": pp_size, "vpp_size": vpp_size}
    ensure_model_parallel(**sizes)
    real = parallel_state.get_pipeline_model_parallel_world_size()
    if warn and launched and pp_size > 1 and real != pp_size and parallel_state.get_data_parallel_world_size() > 1:
        warnings.warn(
            f"packfwd: a stage of pp_size={pp_size} in a world of {dist.get_world_size()} processes whose "
            f"megatron.core.parallel_state has a pipeline of {real} and data parallelism of "
            f"{parallel_state.get_data_parallel_world_size()}: a process that holds one stage has other stages in "
            "its data-parallel group, and a gradient all-reduce over it adds them up. Make the state with the "
            f"pipeline first: packfwd.models.runtime.ensure_model_parallel(pp_size={pp_size}, vpp_size={vpp_size}, "
            "...) (every process holding every stage: fine as it is)", stacklevel=3)


def stage_process_groups(pp_rank: int, pp_size: int):
    """Megatron-Core's ``ProcessGroupCollection`` for pipeline stage ``pp_rank`` of ``pp_size``.

    The real groups of ``parallel_state``, except ``pp`` (a :class:`StagePlacement` when the real pipeline group
    does not have ``pp_size`` ranks) and, then, ``embd`` (None: the first and last stages are not separate
    processes that could share tied embeddings).

    >>> ensure_model_parallel()
    >>> groups = stage_process_groups(pp_rank=1, pp_size=2)   # in a process without pipeline parallelism
    >>> groups.pp.rank(), groups.pp.size(), groups.embd
    (1, 2, None)
    """
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection.use_mpu_process_groups()
    real = parallel_state.get_pipeline_model_parallel_world_size()
    if real == pp_size:
        if parallel_state.get_pipeline_model_parallel_rank() != pp_rank:
            raise ValueError(
                f"pp_rank={pp_rank} but this process is pipeline rank "
                f"{parallel_state.get_pipeline_model_parallel_rank()}; pass that rank"
            )
        return groups
    if real != 1:
        raise ValueError(
            f"pp_size={pp_size} but the pipeline group has {real} ranks; pass pp_size={real}, or build stages "
            "of another pipeline size only in a process without pipeline parallelism"
        )
    groups.pp = StagePlacement(rank_=pp_rank, size_=pp_size)
    groups.embd = None
    return groups
