"""Pipeline parallelism over ``torch.distributed`` point-to-point: microbatches through every rank's stages.

Each pipeline rank holds one model chunk per virtual stage (``stages[v]`` for ``vpp_rank = v``, built with
``packfwd.models.build_model``/``from_hf(..., pp_rank=, pp_size=, vpp_rank=, vpp_size=)``, whose layers
``packfwd.layers.layer_partition`` places).  The chunks form one chain of ``pp * vpp`` global stages, stage
``g = v * pp + r`` living on pipeline rank ``r`` (Megatron-Core's interleaved order)::

    pp=2, vpp=2:   g0 (rank 0, v0) -> g1 (rank 1, v0) -> g2 (rank 0, v1) -> g3 (rank 1, v1) -> outputs

:func:`pipeline_forward_backward` runs the microbatches through it: stage ``g`` receives its input from stage
``g-1`` (``set_input_tensor``, as Megatron-Core's stages take it), runs, and sends its output to ``g+1``; with a
``loss_fn`` the last stage backpropagates the loss of each microbatch and the gradient of every stage's input goes
back along the chain.  Parameter gradients accumulate in ``.grad`` as in any backward.

Schedule: one microbatch at a time through the whole chain, forward (all microbatches) then backward (all
microbatches, stages in reverse).  Every rank performs its part of that one sequential program in the program's
order, so each blocking send meets its receive as the next communication of both ranks: no deadlock whatever the
backend buffers, and no reordering to reason about.  It is deliberately minimal (consecutive microbatches overlap
only on a plain pipeline, not across virtual stages).  Tensors travel with a small header (dtype and shape), so
stages may return any shape (packed lengths change from microbatch to microbatch); reading it is one host sync per
transfer.  A stage may hand on more than its hidden states: a tuple ``(hidden, *extra)`` goes to the next stage
whole, ``hidden`` through ``set_input_tensor`` and ``extra`` as ``forward_step(stage, microbatch, *extra)``, and the
gradients of the floating-point ones come back (``make_forward(..., moe_aux_loss=True)``'s stages hand on their
routing sums so, ``record_routing=True``'s their integer record of the routing, which has none).

Why not Megatron-Core's schedules (``megatron.core.pipeline_parallel.get_forward_backward_func``): they allocate
on CUDA unconditionally (``torch.zeros([], device="cuda")`` for the token count, shape buffers on
``torch.cuda.current_device()``, ``torch.cuda.synchronize()`` after each exchange in megatron-core 0.16), so they
cannot run on a CPU with gloo.  On GPUs they run packfwd's stages as they are; packfwd's GPU tests check them
against this module.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from .._validate import unwrap
from .agree import check_across_ranks
from .host import host_collectives

__all__ = ["pipeline_forward_backward"]

# dtypes a stage may send; the header carries the index.  The header: [dtype, ndim, *shape, 0...].
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
_HEADER = 10


def pipeline_forward_backward(
    stages: Sequence[torch.nn.Module],
    forward_step: Callable[[torch.nn.Module, Any], Any],
    microbatches: Sequence[Any],
    *,
    pp_group: Any,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
) -> list | None:
    """Run ``microbatches`` through the pipeline (see the module docstring); forward only when ``loss_fn`` is None.

    ``stages``: this rank's model chunks, ``stages[v]`` for virtual stage ``v`` (every rank the same number).
    ``forward_step(stage, microbatch)``: runs one chunk on one microbatch and returns its output: a tensor for
    every stage but the last (the hidden states, e.g. ``[t, 1, h]`` from ``packfwd.make_forward``'s forward on a
    middle stage), or a tuple of tensors ``(hidden, *extra)``; anything for the last.  Before the call the chunk
    gets the previous stage's hidden states through ``stage.set_input_tensor``, and its ``extra`` as further
    arguments: ``forward_step(stage, microbatch, *extra)``.  ``pp_group``: the pipeline process group (rank ``r`` holds stages ``v * pp + r``).
    ``loss_fn(output, microbatch) -> scalar``: on the last stage; its gradient is backpropagated through every
    stage (scale it yourself, e.g. by the number of microbatches, if you want a mean).

    Returns, on the rank that holds the last stage, the last stage's output for each microbatch (tensors detached);
    None on the other ranks.  Without ``loss_fn`` everything runs under ``torch.no_grad()``.  Every rank must pass
    the same number of microbatches and stages: this is checked across ``pp_group`` before any transfer, and a
    rank's bad arguments make every rank raise the same error.  Stages on the CPU run inside
    ``packfwd.parallel.host.host_collectives`` (forward and backward).

    >>> from packfwd.testing import run_local
    >>> from packfwd.parallel.pipeline import _example_pipeline
    >>> # stage 0 (rank 0): y = a0 * x with a0 = 2; stage 1 (rank 1): z = a1 * y + 1 with a1 = 1; loss = sum(z)
    >>> run_local(_example_pipeline, 2, backend="gloo")  # (outputs, d loss / d a) per rank; x = [1, 2]
    [(None, 3.0), ([[3.0, 5.0]], 6.0)]
    """
    import torch.distributed as dist

    error = None
    pp, rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
    try:
        _check_arguments(stages, forward_step, microbatches, loss_fn)
        _check_placement(stages, pp, rank)
    except (TypeError, ValueError) as exc:
        error = exc
    counts = (len(stages), len(microbatches)) if error is None else (0, 0)
    check_across_ranks(pp_group, error=error, values=counts, what="numbers of stages and microbatches")
    chain = _Chain(pp, rank, len(stages), pp_group)
    device = _device_of(stages[0])
    host = contextlib.ExitStack()
    if device.type == "cpu":
        host.enter_context(host_collectives())
    with host:
        with torch.no_grad() if loss_fn is None else contextlib.nullcontext():
            outputs, saved = _forward_all(stages, forward_step, microbatches, chain, device, loss_fn is not None)
        if loss_fn is not None:
            _backward_all(outputs, saved, microbatches, chain, device, loss_fn)
    if not chain.is_last(len(stages) - 1):
        return None
    return [_detached(outputs[m][len(stages) - 1]) for m in range(len(microbatches))]


class _Chain:
    """Where global stage ``v * pp + rank`` sends to and receives from."""

    def __init__(self, pp: int, rank: int, vpp: int, group: Any):
        self.pp, self.rank, self.vpp, self.group = pp, rank, vpp, group

    def stage(self, v: int) -> int:
        return v * self.pp + self.rank

    def is_first(self, v: int) -> bool:
        return self.stage(v) == 0

    def is_last(self, v: int) -> bool:
        return self.stage(v) == self.pp * self.vpp - 1

    def prev_rank(self) -> int:
        return (self.rank - 1) % self.pp

    def next_rank(self) -> int:
        return (self.rank + 1) % self.pp


def _forward_all(stages, forward_step, microbatches, chain: _Chain, device, need_grad: bool):
    """All microbatches forward; returns ``outputs[m][v]`` and the received inputs ``saved[m][v]`` (a list of
    tensors: the hidden states and what came with them; None on the first stage)."""
    outputs, saved = [], []
    for mb in microbatches:
        outs, ins = [], []
        for v, stage in enumerate(stages):
            got = None
            if not chain.is_first(v):
                got = _recv(chain.prev_rank(), chain.group, device)
                if need_grad:
                    for x in got:
                        if x.is_floating_point():
                            x.requires_grad_(True)
                unwrap(stage).set_input_tensor(got[0])
            out = forward_step(stage, mb, *got[1:]) if got else forward_step(stage, mb)
            if not chain.is_last(v):
                _send([x.detach() for x in _handed_on(out, chain.stage(v))], chain.next_rank(), chain.group)
            outs.append(out)
            ins.append(got)
        outputs.append(outs)
        saved.append(ins)
    return outputs, saved


def _backward_all(outputs, saved, microbatches, chain: _Chain, device, loss_fn) -> None:
    for m, mb in enumerate(microbatches):
        for v in reversed(range(len(outputs[m]))):
            out = outputs[m][v]
            if chain.is_last(v):
                loss = loss_fn(out, mb)
                if not isinstance(loss, Tensor) or loss.numel() != 1:
                    raise TypeError(f"loss_fn must return a scalar tensor, got {getattr(loss, 'shape', type(loss))}")
                torch.autograd.backward(loss)
            else:
                grads = _recv(chain.next_rank(), chain.group, device)  # one per floating-point tensor handed on
                handed = [x for x in _handed_on(out, chain.stage(v)) if x.is_floating_point()]
                pairs = [(x, g.to(x.dtype)) for x, g in zip(handed, grads) if x.requires_grad]
                if pairs:
                    torch.autograd.backward([x for x, _ in pairs], [g for _, g in pairs])
            got = saved[m][v]
            if got is not None:
                _send([x.grad if x.grad is not None else torch.zeros_like(x) for x in got if x.is_floating_point()],
                      chain.prev_rank(), chain.group)  # an integer tensor (a routing record) has no gradient


def _handed_on(out, stage: int) -> list[Tensor]:
    """What a stage before the last sends on: its tensor, or its tuple of tensors (the hidden states first)."""
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, tuple) and out and all(isinstance(x, Tensor) for x in out):
        return list(out)
    raise TypeError(
        f"forward_step returned {type(out).__name__} on pipeline stage {stage}, which is not the last; a middle "
        "stage must return its hidden-states tensor, or a tuple of tensors (the hidden states first)"
    )


# ----------------------------------------------------------------------------------------- point to point


def _send(tensors: list[Tensor], dst: int, group: Any) -> None:
    """Each tensor after a header ``[dtype, ndim, *shape, 0..., tensors after this one]``."""
    import torch.distributed as dist

    peer = dist.get_global_rank(group, dst)
    for i, x in enumerate(tensors):
        if x.dtype not in _DTYPES or x.dim() > _HEADER - 3:
            raise TypeError(f"cannot send a {x.dtype} tensor of {x.dim()} dims between stages; use one of "
                            f"{_DTYPES}, at most {_HEADER - 3} dims")
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1], header[-1] = _DTYPES.index(x.dtype), x.dim(), len(tensors) - 1 - i
        header[2 : 2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
        dist.send(header.to(x.device), peer, group=group)
        dist.send(x.contiguous(), peer, group=group)


def _recv(src: int, group: Any, device: torch.device) -> list[Tensor]:
    import torch.distributed as dist

    peer = dist.get_global_rank(group, src)
    got, more = [], 1
    while more:
        header = torch.empty(_HEADER, dtype=torch.int64, device=device)
        dist.recv(header, peer, group=group)
        code, ndim, *shape, more = header.tolist()
        x = torch.empty(shape[:ndim], dtype=_DTYPES[code], device=device)
        dist.recv(x, peer, group=group)
        got.append(x)
    return got


# ---------------------------------------------------------------------------------------------- helpers


def _check_placement(stages, pp: int, rank: int) -> None:
    """Each stage where the chain puts it: stage ``v`` of this rank is global stage ``v * pp + rank``; a stage that
    says whether it holds the embedding or the output layer (``pre_process`` / ``post_process``, as Megatron-Core's
    models do) must hold them exactly at the first and the last global stage, and one that says which virtual
    stage it was built for (Megatron-Core's ``vp_stage``) must be ``stages[vp_stage]`` (middle stages hold neither
    the embedding nor the output layer: in another order they would run their layers at other places, silently)."""
    n = pp * len(stages)
    for v, stage in enumerate(stages):
        gpt = unwrap(stage)
        built = getattr(gpt, "vp_stage", None)
        if built is not None and built != v:
            raise ValueError(
                f"stages[{v}] of pipeline rank {rank} was built for virtual stage {built} (vpp_rank={built}); pass "
                f"this rank's stages in order, stages[v] built with vpp_rank=v (vpp_size={len(stages)})"
            )
        pre, post = getattr(gpt, "pre_process", None), getattr(gpt, "post_process", None)
        at = v * pp + rank
        if (pre is not None and bool(pre) != (at == 0)) or (post is not None and bool(post) != (at == n - 1)):
            holds = ", ".join(f"{'holds' if flag else 'lacks'} the {what}"
                              for flag, what in ((pre, "embedding"), (post, "output layer")) if flag is not None)
            raise ValueError(
                f"stage {v} of pipeline rank {rank} is global stage {at} of {n} ({pp} ranks x {len(stages)} stages "
                f"each), but it {holds}: pass this rank's stages in order, each built for its place "
                f"(pp_rank={rank}, pp_size={pp}, vpp_rank=v, vpp_size={len(stages)}), with pp_group the pipeline's"
            )


def _check_arguments(stages, forward_step, microbatches, loss_fn) -> None:
    if not isinstance(stages, (list, tuple)) or not stages:
        raise TypeError("stages must be a non-empty list of this rank's model chunks, one per virtual stage")
    for v, stage in enumerate(stages):
        if not isinstance(stage, torch.nn.Module) or not hasattr(unwrap(stage), "set_input_tensor"):
            raise TypeError(f"stages[{v}] must be a model chunk with set_input_tensor (a Megatron-Core GPTModel)")
    if not callable(forward_step):
        raise TypeError("forward_step must be callable: forward_step(stage, microbatch) -> output")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError("loss_fn must be None (forward only) or callable: loss_fn(output, microbatch) -> scalar")
    if not isinstance(microbatches, (list, tuple)) or not microbatches:
        raise ValueError("microbatches must be a non-empty list (one entry per microbatch, given to forward_step)")


def _device_of(stage: torch.nn.Module) -> torch.device:
    for p in stage.parameters():
        return p.device
    return torch.device("cpu")


def _detached(out: Any) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.detach() if isinstance(x, Tensor) else x, out)


class _Affine(torch.nn.Module):
    """Doctest stage: ``y = a * x + b`` on its input (the first stage takes the microbatch itself)."""

    def __init__(self, a: float, b: float):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(a))
        self.b = b
        self.input_tensor = None

    def set_input_tensor(self, x: Tensor) -> None:
        self.input_tensor = x

    def forward(self, x: Tensor) -> Tensor:
        return self.a * (x if self.input_tensor is None else self.input_tensor) + self.b


def _example_pipeline(rank: int, world_size: int):
    """Doctest helper for :func:`pipeline_forward_backward` (module level, so that ``run_local`` can spawn it)."""
    import torch.distributed as dist

    stage = _Affine(2.0, 0.0) if rank == 0 else _Affine(1.0, 1.0)
    batches = [torch.tensor([1.0, 2.0])]
    out = pipeline_forward_backward([stage], lambda s, x: s(x), batches, pp_group=dist.group.WORLD,
                                    loss_fn=lambda y, x: y.sum())
    # d loss / d a1 = sum(y) = 2 + 4; d loss / d a0 = sum(a1 * x) = 1 + 2
    return (None if out is None else [o.tolist() for o in out]), stage.a.grad.item()
