"""``run_micro_batches``' fast path: each micro-batch padded to its bucket (:mod:`packfwd.micro.buckets`) and its
forward and backward replayed from CUDA graphs captured once per bucket; the cache is a :class:`StepGraphs` the
caller holds (with ``graphs=True``, the forward's ``forward.step_graphs``).  Opt-in: correct on an H100
(``tests/gpu/test_step_graphs_cuda.py``: bit for bit the padded eager step with the graphs' head size,
``StepGraphs(capture=False, head_quarters=True)``); on the one RL step timed (a 1B model,
16k-token micro-batches, H100) not faster than eager and 15.7 GiB more reserved (benchmarks/RESULTS.md history 20).

**What is captured.**  The model's forward on the bucket's static inputs (the padded rows of ``input_ids``, the
positions, the processor's arguments, and a bucket plan, ``packfwd.layout.bucket``), and as a second graph its
backward: the parameters' gradients of the forward's outputs, given the outputs' gradients.  The loss is *not*
captured: ``loss_fn`` runs eagerly on the real rows of the replayed outputs, with the step's own masks and weights,
so the loss and its normalisation are those of the eager step by construction, and no Python value of the loss
(a coefficient, a schedule) is frozen into a graph.  The replayed backward hands the parameters' gradients to
autograd, which accumulates them into ``.grad`` as an eager backward does, hooks included (a DDP's gradient
hooks run as usual); the optimizer may update the parameters in place between steps.

**Padding.**  The bucket adds empty rows (no real token) and spare sequences after the real ones (no real token
attends to them, their outputs are never read); only the real rows' outputs reach the loss and the result.  A real
token's result changes only by the rounding of a GEMM of another row count.

**The first micro-batch of a bucket** runs the same padded step eagerly (the warm-up: kernels compiled, cuDNN plans
built), the second captures the graphs and replays them, the rest replay.  A capture that fails (an operation that
synchronises with the host, a model that calls Python per step) is abandoned with one warning and that bucket stays
eager; nothing captured half-way is ever replayed.  Where graphs cannot work at all the step runs as
``run_micro_batches(buckets=)`` says: by default the plain step, or the padded one where that pays (:func:`why_eager`
names why: the CPU, pipelines, vision inputs, tensor/context/expert parallelism, a forward with MTP, the MoE aux loss
or routing replay, a forward without a logits processor (its ``[b, s, v]`` logits would be held by every bucket), a
processor argument that takes gradients, activation recompute, a model with module hooks, a DDP or FSDP wrapper, a
forward that is not ``make_forward``'s).

**Checked at every replay** (host ints): each parameter's and buffer's storage is where it was at capture (a
parameter replaced rather than updated in place is captured again; the model's tensors are listed once per
``run_micro_batches`` call and again after each warm-up, :class:`ModelTensors`), and the bucket's key: its shapes,
the model, its train/eval mode, grad and inference mode, autocast and torch's deterministic mode, which parameters take
gradients (graphs only: a padded eager step runs plain autograd on the model as it is), every non-tensor argument's
value.
"""

from __future__ import annotations

import collections
import warnings
import weakref
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from ..forward.scored import slots_for
from ..layout import rules
from ..layout.bucket import Bucket, _clone, copy_plan_

__all__ = ["StepGraphs", "WIDTH_STEP", "capturable", "graphed_step", "why_eager"]

WIDTH_STEP = 256  # a bucket's canvas: the batch's width rounded up to this, so batches padded to other widths share it


class StepGraphs:
    """The CUDA graphs of ``run_micro_batches``' micro-batch steps, one pair (forward, backward) per bucket.

    ``run_micro_batches(..., graphs=True)`` keeps one on the forward (``forward.step_graphs``); pass your own to
    hold it elsewhere; ``graphs=None`` graphs where they can work, quietly eager elsewhere; ``graphs=False`` (the
    default): no graphs.  ``capture=False``: the padded bucket step runs eagerly (what the graphs replay; what
    ``run_micro_batches(buckets=...)`` runs, held on ``forward.padded_steps``).  ``max_graphs``: buckets kept; past it
    every graph is dropped and captured again as needed (without graphs: the least recently used bucket's inputs are
    dropped, quietly).  All graphs share one memory pool.  ``head_quarters`` (default: ``capture``): a forward that
    scores the loss tokens only computes its head on their count rounded up to a quarter of the bucket (at most four
    graphs per bucket); False: rounded as the plain step rounds it (``packfwd.forward.scored.slots_for``: at most
    1/16 more rows, at least 64), but capped at the bucket's tokens where the plain step caps at the micro-batch's
    (so a micro-batch of fewer than 64 tokens gets up to 64 head rows), what a padded eager step does.
    ``StepGraphs(capture=False, head_quarters=True)`` runs what the graphs replay, bit for bit.

    After a step: ``memory_bytes`` (what the captures reserved: the graphs' activations and outputs, and one set of
    parameter gradients all buckets write, held while the object lives), ``captured`` / ``replayed`` / ``eager`` (micro-batch counts since made), ``reason`` (why the
    last step ran eagerly; None when it ran bucketed).  :meth:`clear` frees the graphs.

    >>> graphs = StepGraphs()
    >>> graphs
    StepGraphs(capture=True, buckets=0, captured=0, replayed=0, eager=0, memory=0.00 GiB)
    """

    def __init__(self, *, capture: bool = True, max_graphs: int = 16, head_quarters: bool | None = None):
        if not isinstance(capture, bool):
            raise TypeError(f"capture must be True or False, got {capture!r}")
        if head_quarters is not None and not isinstance(head_quarters, bool):
            raise TypeError(f"head_quarters must be True, False or None (capture's value), got {head_quarters!r}")
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"max_graphs={max_graphs!r}; pass a positive int (buckets kept)")
        self.capture, self.max_graphs = capture, max_graphs
        self.head_quarters = capture if head_quarters is None else head_quarters
        self.captured = self.replayed = self.eager = 0
        self.memory_bytes = 0
        self.reason: str | None = None
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._pool = None
        self._grads = None  # (the parameters' ids, the gradient buffers every bucket's backward graph writes)
        self._stream = None
        self._warned: set = set()

    def __repr__(self) -> str:
        return (f"StepGraphs(capture={self.capture}, buckets={len(self._entries)}, captured={self.captured}, "
                f"replayed={self.replayed}, eager={self.eager}, memory={self.memory_bytes / 2**30:.2f} GiB)")

    def clear(self) -> None:
        """Drop every graph and its memory pool (the next micro-batch of each bucket warms up again)."""
        self._entries.clear()
        self._pool = self._grads = None
        self.memory_bytes = 0

    def warn_once(self, message: str) -> None:
        """One warning per distinct message over this object's life."""
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, stacklevel=4)


def capturable(x: Tensor) -> bool:
    """Whether a batch on ``x``'s device could be captured (a CUDA tensor).

    >>> capturable(torch.zeros(1))
    False
    """
    return _DEVICE.takes(x)


def why_eager(forward: Callable, model, input_ids: Tensor, *, pp_group=None, multi_modal_inputs=None,
              processor_args: Mapping[str, Any] | None = None, cuda: bool = True) -> str | None:
    """Why this step cannot run bucketed (None: it can): host checks only.  ``cuda=False``: the bucketed step
    without graphs (``StepGraphs(capture=False)``), which runs on any device."""
    from ..forward.moe import RoutingReplay
    from ..forward.mtp import Mtp

    if pp_group is not None:
        return "pipeline parallelism (pp_group=)"
    if multi_modal_inputs is not None:
        return "a vision forward (multi_modal_inputs=)"
    engine, spec = getattr(forward, "engine", None), getattr(forward, "layout", None)
    if not _is_make_forward(forward) or engine is None or spec is None or not callable(getattr(forward, "plan", None)):
        return "the forward is not one make_forward made (its plan= path is what the graphs replay)"
    if spec.data_format != "thd" or spec.tp_size != 1 or spec.cp_size != 1:
        return f"the forward's layout ({spec.data_format}, tp_size={spec.tp_size}, cp_size={spec.cp_size}): graphs " \
               "take THD without tensor or context parallelism"
    if any(isinstance(e, Mtp) or (isinstance(e, RoutingReplay) and e.record) or type(e).__name__ == "MoeAuxLoss"
           for e in engine.extensions) or {"routed_experts", "replay_mask"} & set(processor_args or {}):
        return "the forward records or replays routing, or has MTP or the MoE aux loss"
    grads = sorted(k for k, v in (processor_args or {}).items() if isinstance(v, Tensor) and v.requires_grad)
    if grads:
        return (f"processor argument(s) {grads} take gradients: the padded step copies them into its own inputs, "
                "through which no gradient flows back")
    if not isinstance(model, torch.nn.Module):
        return "the model is not one torch.nn.Module"
    from ..engine.facts import is_value_model

    if engine.processor is None and engine.head is None and not is_value_model(model):
        return ("the forward has no logits processor: its [b, s, v] logits would be held by every bucket's graph "
                "(give it one, e.g. packfwd.logits.log_probs_and_entropy)")
    config = getattr(model, "config", None)
    for name in ("tensor_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
                 "pipeline_model_parallel_size"):
        if (getattr(config, name, 1) or 1) > 1:
            return f"the model's {name}={getattr(config, name)}"
    if cuda and getattr(config, "recompute_granularity", None):  # the graphs' backward is torch.autograd.grad
        return (f"activation recompute (recompute_granularity={config.recompute_granularity!r}): Megatron-Core's "
                "checkpointing refuses the graphs' torch.autograd.grad backward")
    if "DistributedDataParallel" in type(model).__name__ or "FSDP" in type(model).__name__:
        return f"the model is wrapped ({type(model).__name__}): its per-step Python would be frozen into a graph"
    hooked = odd = off = None  # one walk of the model (it runs every step), the reasons in this order
    for name, m in model.named_modules():
        if hooked is None and (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                               or getattr(m, "_backward_pre_hooks", None)):
            hooked = name or type(model).__name__
        for p in m._parameters.values():
            if p is None:
                continue
            if odd is None and type(p) is not torch.nn.Parameter and type(p) is not Tensor:
                odd = p
            if cuda and off is None and not _DEVICE.takes(p):
                off = p
    if hooked is not None:
        return f"module {hooked!r} has hooks, which a graph would run only at capture"
    if odd is not None:
        return "the model has parameters of another tensor type (DTensor, ...)"
    if cuda and (off is not None or not _DEVICE.takes(input_ids)):
        return "the batch or the model is not on a CUDA device"
    return None


def _is_make_forward(forward) -> bool:
    """``forward`` is make_forward's own function (or its deterministic guard around it), not a caller's wrapper."""
    own = _own_codes()
    f = forward
    while getattr(f, "__code__", None) is own["guard"]:
        f = f.__wrapped__
    return getattr(f, "__code__", None) is own["forward"]


def _own_codes() -> dict:
    if not _OWN:
        from ..forward.deterministic import guarded
        from ..forward.factory import make_forward

        plain = make_forward("thd")
        _OWN.update(forward=plain.__code__, guard=guarded(plain, deterministic=True, batch_invariant=False).__code__)
    return _OWN


_OWN: dict = {}


class ModelTensors:
    """A model's tensors as the bucketed step reads them: ``params`` (those that take gradients, in the model's
    order) and :meth:`storage`, every parameter's and buffer's data pointer.  Listed by walking the model when first
    read (at most once per ``run_micro_batches`` call: a parameter replaced between calls is found; never for padded
    eager steps) and again by :meth:`refresh` after a warm-up (a module may make a buffer on its first call); the
    walk costs milliseconds on a model of many modules (an MoE's experts), too much for every micro-batch."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._lists: tuple | None = None  # walked when first read: padded eager steps never read them

    def refresh(self) -> None:
        params = list(self.model.parameters())
        self._lists = ([*params, *self.model.buffers()], [p for p in params if p.requires_grad])

    @property
    def tensors(self) -> list:
        if self._lists is None:
            self.refresh()
        return self._lists[0]

    @property
    def params(self) -> list:
        if self._lists is None:
            self.refresh()
        return self._lists[1]

    def storage(self) -> tuple:
        """Every parameter's and buffer's data pointer: a graph reads them where they were at capture."""
        return tuple(t.data_ptr() for t in self.tensors)


def graphed_step(graphs: StepGraphs, forward, model, mb, shape: tuple[int, int], canvas: dict, loss_fn,
                 tensors: ModelTensors, counts=None):
    """One micro-batch ``mb`` (:class:`~packfwd.micro.batches.MicroBatchInputs`) through its bucket ``shape``
    ``(rows, tokens)``: returns ``(outputs of its real rows, detached copies; loss or None)`` like the eager
    step.  ``canvas``: ``{"width": s, "batch": the names of processor arguments cut per row}``; ``tensors``: the
    model's (:class:`ModelTensors`, made by the caller once per call);
    ``counts`` (a forward that scores the loss tokens only): each sequence's loss tokens, as the eager step passes
    them; here the forward gets the micro-batch's loss mask and, as ``scored_tokens``, its count rounded up
    (:class:`StepGraphs`' ``head_quarters``: for graphs to a quarter of the bucket, at most 4 head sizes per token
    size; for a padded eager step as the plain step rounds it, capped at the bucket's tokens)."""
    grad = loss_fn is not None
    rows, tokens = shape
    ids, mask, positions = mb.args
    b = ids.shape[0]
    kwargs = mb.kwargs
    if counts is not None:
        count = sum(counts[i] for i in mb.indices)
        if graphs.head_quarters:  # a graph per head size: a quarter of the bucket's tokens at a time (no
            quarter = -(-tokens // 4)  # fifth size, 0, for a micro-batch without loss tokens)
            scored = min(tokens, -(-max(count, 1) // quarter) * quarter)
        else:  # no graph kept: the plain step's head rows (the quarters add about an eighth of the bucket)
            scored = slots_for(count, tokens)
        kwargs = {**kwargs, "loss_mask": mb.loss_mask, "scored_tokens": scored}
        canvas = {**canvas, "batch": canvas["batch"] | {"loss_mask"}}
    canvas = {**canvas, "padded": rules.round_up(canvas["width"], WIDTH_STEP)}
    params = tensors.params if graphs.capture else []  # a padded eager step runs plain autograd: no list needed
    # a padded eager step takes its non-tensor arguments (the head's size among them) per call: not in its key, or
    # each new head size would make the bucket's static inputs again
    key = _key(model, rows, tokens, canvas, grad, ids, positions, kwargs, values=graphs.capture) + (
        tuple(map(id, params)),)
    storage = tensors.storage() if graphs.capture else ()  # no graph reads a pointer of a padded eager step
    entry = graphs._entries.get(key)
    if entry is not None and (entry.model() is not model or entry.storage != storage):
        graphs._entries.pop(key)  # parameters replaced, or another model at the same id: capture again
        entry = None
    if entry is None:
        if len(graphs._entries) >= graphs.max_graphs and not graphs.capture:
            graphs._entries.popitem(last=False)  # padded eager steps: only small static inputs, the oldest dropped
        elif len(graphs._entries) >= graphs.max_graphs:
            graphs.warn_once(f"packfwd: more than max_graphs={graphs.max_graphs} buckets; the CUDA graphs are "
                             "dropped and captured again (StepGraphs(max_graphs=...) keeps more)")
            graphs.clear()
        entry = graphs._entries[key] = _Entry(model, forward, rows, mb.args, kwargs, canvas, storage)
    graphs._entries.move_to_end(key)
    entry.params = params
    bucket = Bucket(tokens=tokens, max_seqlen=rules.round_up(canvas["padded"], forward.layout.seq_align))
    entry.load(mb.args, kwargs, forward.plan(entry.ids, _padded_mask(mask, rows, canvas["padded"]), bucket=bucket,
                                seqlens=list(mb.kwargs["seqlens"]) + [0] * (rows - b)))
    capture = graphs.capture and _DEVICE.takes(ids)
    if capture and graphs._stream is None:
        graphs._stream = _DEVICE.stream()
    if capture and entry.graphs is None and entry.warm and not entry.failed:
        _capture(graphs, entry, params, grad)
    if entry.failed:
        graphs.reason = entry.failed  # this bucket runs eagerly, and why
    if entry.graphs is not None:
        graphs.replayed += 1
    else:
        graphs.eager += 1
    if not capture:  # the padded step without graphs (StepGraphs(capture=False), the CPU): autograd as usual
        out, loss = _run(entry, b, params, grad, mb, loss_fn, direct=True)
    elif entry.warm:
        out, loss = _run(entry, b, params, grad, mb, loss_fn)
    else:  # the warm-up, on the stream the capture will use
        out, loss = _DEVICE.run_on(graphs._stream, lambda: _run(entry, b, params, grad, mb, loss_fn))
    if not entry.warm and graphs.capture:  # after the warm-up: what the capture will read (a new buffer included)
        tensors.refresh()
        entry.storage = tensors.storage()
    entry.warm = True
    kept = {k: v.clone() for k, v in out.items()} if isinstance(out, Mapping) else out.clone()  # the statics change
    return kept, None if loss is None else loss.clone()


def _run(entry, b: int, params: list, grad: bool, mb, loss_fn, direct: bool = False):
    """Replay (or run eagerly) the bucket's forward, the loss on the real rows, its backward; the outputs of the
    real rows (views of the static outputs, detached) and the loss.  ``direct``: a bucket that is never captured
    runs its forward as a plain call, its backward by autograd through the model (no node of every parameter, no
    nested backward: on a model of many parameters, an MoE's experts, that node cost the host more than the step
    saved)."""
    if grad and direct:
        flat = entry.body()
    elif grad:
        flat = _Replay.apply(entry, *params)
    else:
        with torch.no_grad():
            flat = entry.forward(grad=False)
    s = mb.args[0].shape[1]
    out = _unflatten(entry.names, [o[:b, :s] if o.dim() > 1 else o[:b] for o in flat])  # the real rows and columns
    loss = None
    if grad:
        loss = mb.loss(loss_fn, out)
        if loss.requires_grad:
            loss.backward()
        loss = loss.detach()
    entry._live = None  # an eager bucket's activations, when no backward consumed them
    return ({k: v.detach() for k, v in out.items()} if isinstance(out, Mapping) else out.detach()), loss


class _Replay(torch.autograd.Function):
    """The bucket's forward as one autograd node: forward replays (or runs) it, backward replays (or runs) the
    parameters' gradients of its outputs and returns them, for autograd to accumulate into ``.grad``."""

    @staticmethod
    def forward(ctx, entry, *params):
        flat = entry.forward(grad=True)
        ctx.entry = entry
        ctx.diff = entry.diff  # the static outputs of a graph are detached: which ones take gradients, as captured
        out = tuple(o.detach() for o in flat)
        ctx.mark_non_differentiable(*[o for o, d in zip(out, ctx.diff) if not d])
        return out

    @staticmethod
    def backward(ctx, *grads):
        entry = ctx.entry
        given = [g for g, d in zip(grads, ctx.diff) if d]
        return (None, *entry.backward(given))


class _Entry:
    """One bucket: its static inputs and plan, and how it runs (eagerly, or from its two graphs)."""

    def __init__(self, model, forward, rows: int, args: tuple, kwargs: dict, canvas: dict, storage: tuple):
        self.model, self.forward_fn, self.storage = weakref.ref(model), forward, storage
        ids, _, positions = args
        self.ids = ids.new_zeros(_static_shape(ids, rows, canvas, 0))
        self.positions = None if positions is None else positions.new_zeros(
            _static_shape(positions, rows, canvas, _row_dim(positions)))
        self.kwargs = {k: v.new_zeros(_static_shape(v, rows, canvas, 0 if k in canvas["batch"] else None))
                       if isinstance(v, Tensor) else v for k, v in kwargs.items() if k != "seqlens"}
        self.plan = self.names = self.params = self.diff = None
        self.graphs = None  # (forward graph, backward graph, static outputs, static output grads, static grads)
        self.warm = False
        self.failed = None  # why its capture failed: it stays eager
        self._live = None

    def load(self, args: tuple, kwargs: dict, plan) -> None:
        """Copy the micro-batch's rows (zeros after them) and its bucket plan into the static inputs."""
        ids, _, positions = args
        _fill(self.ids, ids)
        if positions is not None:
            _fill(self.positions, positions)
        for k, static in self.kwargs.items():
            if isinstance(static, Tensor):
                _fill(static, kwargs[k])
            else:  # a graph's key holds these values (the same); a padded eager step takes this call's
                self.kwargs[k] = kwargs[k]
        if self.plan is None:
            self.plan = _clone(plan)
        else:
            copy_plan_(self.plan, plan)

    def body(self) -> list:
        out = self.forward_fn(self.model(), self.ids, plan=self.plan, position_ids=self.positions, **self.kwargs)
        self.names = list(out) if isinstance(out, Mapping) else None
        flat = list(out.values()) if isinstance(out, Mapping) else [out]
        self.diff = [o.requires_grad for o in flat]
        return flat

    def forward(self, grad: bool) -> list:
        if self.graphs is not None:
            self.graphs[0].replay()
            return self.graphs[2]
        if not grad:
            return self.body()
        with torch.enable_grad():  # autograd.Function.forward runs with grad mode off
            self._live = self.body()
        return self._live

    def backward(self, given: list) -> tuple:
        if self.graphs is not None:
            _, bwd, _, static_grads_out, static_grads = self.graphs
            for static, g in zip(static_grads_out, given):
                static.copy_(g) if g is not None else static.zero_()
            bwd.replay()
            return static_grads
        flat, self._live = self._live, None
        diff = [o for o in flat if o.requires_grad]
        given = [torch.zeros_like(o) if g is None else g for o, g in zip(diff, given)]
        return _grads(diff, given, self.params)


def _grads(outputs: list, grads_out: list, params: list) -> tuple:
    got = torch.autograd.grad(outputs, params, grads_out, allow_unused=True)
    return tuple(got)


def _shared_grads(graphs: StepGraphs, params: list) -> list:
    """One set of parameter-gradient buffers for every bucket's backward graph (each writes its gradients there and
    autograd accumulates them from there before the next replay): one model's gradients, not one per bucket."""
    ids = tuple(map(id, params))
    if graphs._grads is None or graphs._grads[0] != ids:
        buffers = [torch.empty_like(p) for p in params]
        graphs._grads = (ids, buffers)
        graphs.memory_bytes += sum(b.numel() * b.element_size() for b in buffers)
    return graphs._grads[1]


def _capture(graphs: StepGraphs, entry: _Entry, params: list, grad: bool) -> None:
    """Capture the entry's forward (and backward) graphs in the shared pool; on failure, warn and stay eager.
    The backward graph computes the gradients of the forward graph's outputs (``state``: a replayed forward's) and
    copies them into the buffers every bucket shares (its own gradients are temporaries of the pool)."""
    if graphs._pool is None:
        graphs._pool = _DEVICE.pool()
    shared = _shared_grads(graphs, params) if grad else []
    before = _DEVICE.reserved(settle=True)
    state = {}

    def forward():
        with torch.set_grad_enabled(grad):
            state["outs"] = entry.body()
        return state["outs"]

    def backward():
        diff = [o for o in state["outs"] if o.requires_grad]
        got = _grads(diff, grads_out, params)
        for buffer, g in zip(shared, got):
            if g is not None:
                buffer.copy_(g)
        return tuple(None if g is None else buffer for buffer, g in zip(shared, got))

    try:
        fwd, outs = _DEVICE.record(forward, graphs._pool, graphs._stream)
        bwd = statics = None
        grads_out = [torch.empty_like(o) for o in outs if o.requires_grad]
        if grad:
            bwd, statics = _DEVICE.record(backward, graphs._pool, graphs._stream)
        outs = [o.detach() for o in outs]
    except Exception as e:  # noqa: BLE001 - any failure: this bucket stays eager, nothing captured is used
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        graphs.reason = entry.failed = f"capture failed: {type(e).__name__}: {first}"
        graphs.warn_once(f"packfwd: run_micro_batches could not capture the step as a CUDA graph ({graphs.reason}); "
                         "this bucket runs eagerly (padded); pass graphs=False, buckets=False to run the plain eager "
                         "step")
        _DEVICE.reserved(settle=True)
        return
    entry.graphs = (fwd, bwd, outs, grads_out if grad else [], statics)
    graphs.memory_bytes += max(0, _DEVICE.reserved(settle=True) - before)
    graphs.captured += 1


class _Device:
    """The CUDA calls the step graphs make, in one place (``_DEVICE``; ``tests/test_step_graphs.py`` puts a CPU
    stand-in there to run the graphed path's bookkeeping without a GPU)."""

    @staticmethod
    def takes(x: Tensor) -> bool:
        """Whether a batch on ``x``'s device can be captured."""
        return x.is_cuda

    @staticmethod
    def stream():
        return torch.cuda.Stream()

    @staticmethod
    def pool():
        return torch.cuda.graph_pool_handle()

    @staticmethod
    def run_on(stream, fn: Callable):
        """``fn()`` on ``stream``, ordered after the current stream's work and before its next."""
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            result = fn()
        torch.cuda.current_stream().wait_stream(stream)
        return result

    @staticmethod
    def record(fn: Callable, pool, stream):
        """``(graph, fn())`` with ``fn`` captured on ``stream`` into a CUDA graph allocating from ``pool``; a replay
        recomputes into the tensors ``fn`` returned."""
        graph, caller = torch.cuda.CUDAGraph(), torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                result = fn()
        except BaseException:
            torch.cuda.set_stream(caller)  # a failed capture_end leaves the capture stream current
            # and the device's random generator in capture mode (its capture epilogue never ran): every later random
            # op outside a graph would raise; a clone of its state (same seed and offset) is out of capture mode
            generator = torch.cuda.default_generators[torch.cuda.current_device()]
            generator.graphsafe_set_state(generator.clone_state())
            raise
        return graph, result

    @staticmethod
    def reserved(settle: bool = False) -> int:
        """Bytes the caching allocator holds (its cached blocks released first, after the device is idle)."""
        if settle:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return torch.cuda.memory_reserved()


_DEVICE = _Device()


def _key(model, rows, tokens, canvas, grad, ids, positions, kwargs, values: bool = True) -> tuple:
    """What a bucket's entry is made for; ``values=False`` (no graph: the entry takes its non-tensor arguments per
    call, :meth:`_Entry.load`): their names only."""
    args = tuple(sorted((k, _signature(v, rows, canvas, 0 if k in canvas["batch"] else None)
                         if values or isinstance(v, Tensor) else "per call")
                        for k, v in kwargs.items() if k != "seqlens"))
    autocast = torch.is_autocast_enabled("cuda")
    positions = None if positions is None else _signature(positions, rows, canvas, _row_dim(positions))
    return (id(model), rows, tokens, canvas["padded"], grad, torch.is_inference_mode_enabled(), model.training, autocast,
            torch.get_autocast_dtype("cuda") if autocast else None,
            torch.are_deterministic_algorithms_enabled(), ids.dtype, positions, args)


def _signature(v, rows: int, canvas: dict, row_dim: int | None):
    if isinstance(v, Tensor):
        return ("tensor", v.dtype, v.device, _static_shape(v, rows, canvas, row_dim))
    try:
        hash(v)
    except TypeError:
        return ("object", id(v))  # an unhashable value: only the same object finds its bucket again
    return ("value", type(v).__name__, v)


def _row_dim(positions: Tensor) -> int:
    return 1 if positions.dim() == 3 else 0  # [k, b, s] multimodal positions, else [b, s]


def _static_shape(v: Tensor, rows: int, canvas: dict, row_dim: int | None) -> tuple:
    """The static tensor a per-row value ``v`` is copied into: ``rows`` rows, and the bucket's padded width where
    ``v`` runs over the batch's columns (the dimension after the rows, of the batch's width); others as they are."""
    shape = list(v.shape)
    if row_dim is not None:
        shape[row_dim] = rows
        if len(shape) > row_dim + 1 and shape[row_dim + 1] == canvas["width"]:
            shape[row_dim + 1] = canvas["padded"]
    return tuple(shape)


def _fill(static: Tensor, value: Tensor) -> None:
    """``value`` into the leading block of ``static`` (its rows and columns), zeros elsewhere."""
    with torch.no_grad():  # the static input keeps no autograd history (why_eager refuses inputs that take grads)
        static.zero_()
        static[tuple(slice(0, n) for n in value.shape)].copy_(value)


def _padded_mask(mask: Tensor, rows: int, width: int) -> Tensor:
    out = torch.zeros(rows, width, dtype=torch.bool, device=mask.device)
    out[: mask.shape[0], : mask.shape[1]] = mask.to(torch.bool)
    return out


def _unflatten(names, flat: list):
    return flat[0] if names is None else dict(zip(names, flat))


