"""The routed experts of packfwd's MoE layers as one grouped GEMM per linear: Megatron-Core's ``SequentialMLP``
(its modules, state-dict names, shapes and sharded state dict), computed on the GPU by ``torch._grouped_mm``.

::

    experts                 GroupedExperts (a SequentialMLP subclass: nothing added to the state dict)
      local_experts.{e}     MLP: linear_fc1.weight [2f, h] = [gate; up], linear_fc2.weight [h, f] (TP: f sharded)

The token dispatcher hands the experts ``x [n, h]`` (the tokens routed here, sorted by local expert),
``tokens_per_expert [E]`` and ``probs [n]``; the output is ``[n, h]`` in the same order.  For the grouped path
packfwd's dispatcher gives ``n = t * top_k`` rows and the counts on the device, no host sync
(:func:`packfwd.models.mlp.dispatch.fixed_rows`): the rows past the last expert's are sinks (slots of experts a token
did not reach), which no group covers, so the GEMMs leave them unwritten (any bits, NaN too) and the combine never
reads them.  For the sequential path it gives the routed pairs exactly and the counts on the host, which
Megatron-Core's ``SequentialMLP`` reads.  Grouped (``torch._grouped_mm``: CUTLASS, no host sync, on sm90 / sm100 in bf16)::

    offs = cumsum(tokens_per_expert) as int32 on x's device   (a copy from the host: no sync)
    y    = grouped_mm(x, W1[e].T)                            [n, 2f]   rows offs[e-1]:offs[e] by expert e
    a    = swiglu(y) * probs, rounded to x's dtype            [n, f]    (Megatron's MLP applies probs there; swiglu_scaled)
    out  = grouped_mm(a, W2[e].T)                            [n, h]
    backward: dx = grouped_mm(dy, W), dW = grouped_mm(dy.T, x) (an empty expert's dW set to zero)

Sequential: Megatron-Core's own ``SequentialMLP.forward`` (a Python loop over experts; bitwise Megatron's).

Which path (:attr:`GroupedExperts.grouped`, set at build with the spec param ``grouped`` or later with
:func:`set_grouped_experts`): ``None`` (default) grouped where ``torch._grouped_mm`` has its fused kernel (CUDA
bf16 on sm90 / sm100) and the config is the plain SwiGLU MLP packfwd builds, else sequential; ``True`` grouped
wherever torch can (elsewhere torch loops over groups itself and reads the offsets back: a sync), a ValueError
where it cannot; ``False`` sequential.

Weights without a copy: the constructor places each linear's weights of all local experts in one block
``[E, out, in]`` (each parameter a view of it; values and parameter objects unchanged), so the grouped path reads
them as one tensor and hands each parameter its slice of the gradient.  Where the weights no longer form such a
block (``model.to(...)``, ``.cuda()``, or a distributed optimizer's buffer relocates each parameter) they are
stacked in the forward and again in the backward (a transient copy each time, never kept), same numbers.  Tensor parallelism: each rank's experts are
its shards along ``f`` (Megatron's expert linears communicate nothing; the dispatcher does), so the same code
runs on every rank.  Biased experts and other gated activations (GPT-OSS's clamped SwiGLU) take
:func:`grouped_glu_mlp`: the same GEMMs, the biases gathered by each row's expert and the activation in torch;
a non-gated MLP, FP8 and ``moe_apply_probs_on_input`` are left to the sequential path (``grouped=True`` with them
is a ValueError).  This module imports Megatron-Core;
:func:`packfwd.models.mlp.moe.moe_spec` imports it only when a model is built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP
from torch import Tensor

from packfwd.ops.swiglu import swiglu, swiglu_scaled  # noqa: F401  (swiglu: the doctests use it)
from packfwd.ops.zero_groups import zero_groups_

__all__ = ["GroupedExperts", "GroupedLinear", "grouped_glu_mlp", "grouped_kernel", "grouped_swiglu_mlp",
           "set_grouped_experts"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what torch._grouped_mm takes (its kernel: bf16 only)


def grouped_kernel(x: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs its fused kernel (no host sync) on tensors like ``x``: a bf16 CUDA tensor
    on an sm90 / sm100 GPU (torch's own condition), with this torch having it.

    >>> grouped_kernel(torch.zeros(2, 8, dtype=torch.bfloat16))  # on the CPU torch loops over the groups
    False
    """
    if not (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16):
        return False
    return torch.cuda.get_device_capability(x.device)[0] in (9, 10)


def grouped_swiglu_mlp(x: Tensor, fc1, fc2, tokens_per_expert: Tensor, probs: Tensor) -> Tensor:
    """Every expert's gated MLP on its rows of ``x [n, h]`` (sorted by expert; ``tokens_per_expert [E]`` of them
    each, on the host or the device), scaled by ``probs [n]`` after the activation as Megatron-Core's MLP does:
    ``fc1`` the experts' ``[2f, h]`` weights (``[gate; up]``), ``fc2`` their ``[h, f]`` ones (sequences of ``E``
    tensors, or ``[E, ...]`` tensors); returns ``[n, h]``.  Two :class:`GroupedLinear`.

    >>> x, probs = torch.randn(5, 8), torch.rand(5)
    >>> fc1, fc2 = torch.randn(3, 8, 8), torch.randn(3, 8, 4)
    >>> out = grouped_swiglu_mlp(x, fc1, fc2, torch.tensor([2, 0, 3]), probs)
    >>> want = torch.cat([(swiglu(x[:2] @ fc1[0].T) * probs[:2, None]) @ fc2[0].T,
    ...                   (swiglu(x[2:] @ fc1[2].T) * probs[2:, None]) @ fc2[2].T])
    >>> torch.allclose(out, want, atol=1e-5)
    True
    """
    groups = _groups(tokens_per_expert, x)
    y = GroupedLinear.apply(x, *groups, *fc1)  # [n, 2f]
    a = swiglu_scaled(y, probs)  # Megatron's MLP: per_token_scale after the activation (one kernel on CUDA)
    return GroupedLinear.apply(a, *groups, *fc2)  # [n, h]


def grouped_glu_mlp(x: Tensor, fc1, fc2, tokens_per_expert: Tensor, probs: Tensor, glu, bias1=None,
                    bias2=None) -> Tensor:
    """:func:`grouped_swiglu_mlp` for experts with biases and another gated activation (GPT-OSS's clamped one),
    op for op as Megatron-Core's expert MLP: ``y = x W1.T + b1[e]``, ``a = (glu(y) * p).to(dtype)``, ``out = a W2.T +
    b2[e] * p``; ``glu`` the activation module (:class:`packfwd.ops.swiglu.SwiGLU` of the config: clamp, offset,
    ``activation_func``), ``bias1``/``bias2``: the experts' ``[2f]`` / ``[h]`` biases (sequences of ``E``, or None).
    Each row's expert comes from the groups' ends on the device (no host sync); the rows past the last group
    (sinks: :func:`packfwd.models.mlp.dispatch.fixed_rows`) are zeroed before the activation and get no
    probability, so whatever the GEMMs leave there never reaches a bias's gradient.

    >>> from types import SimpleNamespace
    >>> from packfwd.ops.swiglu import SwiGLU
    >>> glu = SwiGLU(SimpleNamespace(activation_func=torch.sigmoid, glu_linear_offset=1.0,
    ...                              activation_func_clamp_value=2.0))
    >>> x, probs = torch.randn(5, 8), torch.rand(5)
    >>> fc1, fc2, b1, b2 = torch.randn(3, 8, 8), torch.randn(3, 8, 4), torch.randn(3, 8), torch.randn(3, 8)
    >>> out = grouped_glu_mlp(x, fc1, fc2, torch.tensor([2, 0, 3]), probs, glu, b1, b2)
    >>> def one(rows, e):
    ...     return (glu(x[rows] @ fc1[e].T + b1[e]) * probs[rows, None]) @ fc2[e].T + b2[e] * probs[rows, None]
    >>> torch.allclose(out, torch.cat([one(slice(0, 2), 0), one(slice(2, 5), 2)]), atol=1e-5)
    True
    """
    groups = _groups(tokens_per_expert, x)
    offs = groups[0]
    rows = torch.arange(x.shape[0], device=x.device)
    inside = rows < offs[-1].to(rows.dtype)  # sink rows past the last group: none of the GEMMs write them
    expert = torch.searchsorted(offs.to(rows.dtype), rows, right=True).clamp(max=len(fc1) - 1)
    scale = torch.where(inside, probs, torch.zeros_like(probs)).unsqueeze(-1)  # a sink's probability: any bits
    y = GroupedLinear.apply(x, *groups, *fc1)  # [n, 2f]
    if bias1 is not None:
        y = y + torch.stack(list(bias1)).index_select(0, expert)
    y = torch.where(inside[:, None], y, torch.zeros_like(y))
    a = (glu(y) * scale).to(x.dtype)
    out = GroupedLinear.apply(a, *groups, *fc2)  # [n, h]
    if bias2 is not None:
        out = out + torch.stack(list(bias2)).index_select(0, expert) * scale
    return out


class GroupedLinear(torch.autograd.Function):
    """``GroupedLinear.apply(x [n, in], offs [E], empty, *weights [out, in])``: rows ``offs[e-1]:offs[e]`` of
    ``x`` times ``weights[e].T``, as one ``torch._grouped_mm``, ``[n, out]``; ``empty``: the experts without rows
    (indices, or a ``[E]`` bool mask).  The weights are read as one ``[E, out, in]`` tensor over their own memory
    where they lie at one stride (no copy), else stacked; nothing but the parameters themselves is saved for
    backward (a stacked copy is made again there, never kept).  Backward: ``dx = grouped_mm(dy, W)`` and
    ``dW = grouped_mm(dy.T, x)`` over the same groups, an empty expert's ``dW`` set to zero (a group of ``K = 0``
    is left to CUTLASS otherwise)."""

    @staticmethod
    def forward(ctx, x, offs, empty, *weights):
        ctx.save_for_backward(x, offs, empty, *weights)
        return torch._grouped_mm(x, _as_one(weights).transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, dy):
        x, offs, empty, *weights = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch._grouped_mm(dy, _as_one(weights), offs=offs) if ctx.needs_input_grad[0] else None
        if not any(ctx.needs_input_grad[3:]):
            return dx, None, None, *(None for _ in weights)
        dw = torch._grouped_mm(dy.transpose(0, 1), x, offs=offs)  # [E, out, in]
        if empty.dtype == torch.bool:
            zero_groups_(dw, empty)  # the empty experts' blocks only (a kernel on CUDA)
        elif empty.numel():
            dw.index_fill_(0, empty, 0)
        return dx, None, None, *dw.unbind(0)


def _groups(tokens_per_expert: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """The end row of each expert's group (int32) and the empty experts, on ``x``'s device, without a host sync:
    host counts (Megatron-Core's dispatchers) give the empty experts' indices, device counts a bool mask."""
    if tokens_per_expert.device.type == "cpu":
        total = int(tokens_per_expert.sum())  # host values: free to check
        if total > x.shape[0]:
            raise ValueError(f"tokens_per_expert sums to {total} but x has {x.shape[0]} rows; the dispatcher hands "
                             "the experts at least the tokens it counts (rows past them: sinks, left unwritten)")
        empty = torch.nonzero(tokens_per_expert == 0).flatten()
    else:
        empty = tokens_per_expert == 0
    offs = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
    return offs.to(x.device, non_blocking=True), empty.to(x.device, non_blocking=True)


class GroupedExperts(SequentialMLP):
    """Megatron-Core's ``SequentialMLP`` computed as grouped GEMMs where that pays (module docstring); built by the
    same arguments (``grouped`` besides: None, True or False, see :attr:`grouped`)."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, grouped: bool | None = None,
                 **kwargs):
        super().__init__(num_local_experts, config, submodules, pg_collection, **kwargs)
        self.unsupported = _unsupported(self.config)
        self.glu = None  # the activation of experts that are not plain SwiGLU (grouped_glu_mlp), else None
        if _glu_variant(self.config):
            from packfwd.ops.swiglu import SwiGLU

            self.glu = SwiGLU(self.config)
            self.glu.kernel = False  # Megatron's own glu op for op (the kernel is plain SwiGLU's)
        self.grouped = grouped
        with torch.no_grad():
            for name in ("linear_fc1", "linear_fc2"):
                _one_block([getattr(e, name).weight for e in self.local_experts])

    @property
    def grouped(self) -> bool | None:
        """None: grouped where ``torch._grouped_mm``'s kernel runs (:func:`grouped_kernel`), else sequential;
        True: grouped wherever torch can; False: Megatron-Core's sequential loop."""
        return self._grouped

    @grouped.setter
    def grouped(self, value: bool | None) -> None:
        if value is not None and not isinstance(value, bool):  # 0 == False: an int would pass `in (None, ...)`
            raise TypeError(f"grouped={value!r}: pass None (automatic), True or False")
        if value is True and self.unsupported:
            raise ValueError(f"grouped=True: these experts {self.unsupported}, which only the sequential path "
                             "computes; pass grouped=None or False")
        self._grouped = value

    def forward(self, permuted_local_hidden_states: Tensor, tokens_per_expert: Tensor, permuted_probs: Tensor):
        x = permuted_local_hidden_states
        if self.config.add_bias_linear and tokens_per_expert.device.type == "cpu" and not self.use_grouped(x):
            return self._biased_forward(x, tokens_per_expert, permuted_probs), None
        if not self.use_grouped(x):
            return super().forward(x, tokens_per_expert, permuted_probs)
        fc1 = [e.linear_fc1.weight for e in self.local_experts]
        fc2 = [e.linear_fc2.weight for e in self.local_experts]
        if self.glu is not None:  # biases or another gated activation (GPT-OSS)
            b1, b2 = ([getattr(e, name).bias for e in self.local_experts] if self.config.add_bias_linear else None
                      for name in ("linear_fc1", "linear_fc2"))
            return grouped_glu_mlp(x.contiguous(), fc1, fc2, tokens_per_expert, permuted_probs, self.glu, b1, b2), None
        return grouped_swiglu_mlp(x.contiguous(), fc1, fc2, tokens_per_expert, permuted_probs), None

    def _biased_forward(self, x: Tensor, tokens_per_expert: Tensor, probs: Tensor) -> Tensor:
        """Megatron-Core's ``SequentialMLP`` of biased experts (GPT-OSS), op for op, out of place: its expert MLP
        adds ``linear_fc2``'s bias times the probability in place on the output of a tensor-parallel region, which
        autograd refuses (megatron-core 0.19.2).  Per expert: ``fc1(x) + b1``, the GLU of the config (clamp, offset,
        activation: :class:`packfwd.ops.swiglu.SwiGLU`'s torch path, Megatron's ``glu``), times the probability and
        cast back, ``fc2(.) + b2 * probability``.  The experts are whole (Megatron-Core builds biased experts at
        expert-TP size 1), so no rank communicates here; ``tokens_per_expert`` are host counts."""
        from packfwd.ops.swiglu import SwiGLU

        glu = SwiGLU(self.config)
        glu.kernel = False  # Megatron's own glu op for op (its kernel is plain SwiGLU's)
        outs = []
        counts = tokens_per_expert.tolist()  # host values: no sync
        for expert, rows, scale in zip(self.local_experts, torch.split(x, counts), torch.split(probs, counts)):
            fc1, fc2 = expert.linear_fc1, expert.linear_fc2
            y = glu(F.linear(rows, fc1.weight) + fc1.bias)
            y = (y * scale.unsqueeze(-1)).to(rows.dtype)
            outs.append(F.linear(y, fc2.weight) + fc2.bias.unsqueeze(0) * scale.unsqueeze(-1))
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])

    def use_grouped(self, x: Tensor) -> bool:
        """Whether these experts compute tokens like ``x`` as grouped GEMMs (:attr:`grouped`); the token
        dispatcher asks too, before it permutes (the grouped path takes its sync-free layout:
        :func:`packfwd.models.mlp.dispatch.fixed_rows`)."""
        if self._grouped is False or x.shape[0] == 0 or self.unsupported:  # no tokens: nothing to group
            return False
        if self._grouped is None:
            return grouped_kernel(x) and _aligned(x, self.config.moe_ffn_hidden_size // self._tp_size())
        if not hasattr(torch, "_grouped_mm") or x.dtype not in _DTYPES:
            raise ValueError(f"grouped=True on {x.dtype} tokens: torch._grouped_mm takes {_DTYPES} (this torch: "
                             f"{'has it' if hasattr(torch, '_grouped_mm') else 'none'}); pass grouped=None or False")
        if not _aligned(x, self.config.moe_ffn_hidden_size // self._tp_size()):
            raise ValueError(f"grouped=True: torch._grouped_mm needs rows of 16 bytes' multiples, and hidden "
                             f"{x.shape[1]} or expert ffn {self.config.moe_ffn_hidden_size} (per TP rank) of "
                             f"{x.dtype} is not; pass grouped=None or False")
        return True

    def _tp_size(self) -> int:
        return self.tp_group.size() if self.tp_group is not None else 1


def set_grouped_experts(model: torch.nn.Module, grouped: bool | None) -> int:
    """Set :attr:`GroupedExperts.grouped` on every MoE layer's experts of ``model`` (any wrapper: it walks the
    modules); returns how many were set.  ``set_grouped_experts(model, False)`` checks a model against
    Megatron-Core's sequential experts on the same weights.

    >>> set_grouped_experts(torch.nn.Linear(2, 2), False)
    0
    """
    found = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    for m in found:
        m.grouped = grouped
    return len(found)


def _unsupported(config) -> str:
    """Why the grouped path cannot compute these experts as Megatron's MLP would ('' when it can)."""
    why = []
    if not config.gated_linear_unit:
        why.append("are not a gated linear unit")
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        why.append("run in FP8 / FP4")
    if getattr(config, "moe_apply_probs_on_input", False):
        why.append("apply the probabilities on the input")
    return ", ".join(why)


def _glu_variant(config) -> bool:
    """Whether gated experts are other than plain SwiGLU without biases (biases, another activation, an offset or a
    clamp: :func:`grouped_glu_mlp` computes them)."""
    return bool(config.gated_linear_unit and (
        config.add_bias_linear or config.activation_func is not F.silu or getattr(config, "glu_linear_offset", 0.0)
        or getattr(config, "activation_func_clamp_value", None) is not None))


def _aligned(x: Tensor, ffn: int) -> bool:
    """torch._grouped_mm's stride rule: each operand's rows a multiple of 16 bytes."""
    unit = 16 // x.element_size()
    return x.shape[1] % unit == 0 and ffn % unit == 0


def _one_block(weights: list) -> None:
    """Place ``weights`` (same shape, dtype, device) in one new block ``[E, *shape]``, each parameter's data a view
    of its slice (values kept)."""
    block = torch.empty((len(weights), *weights[0].shape), dtype=weights[0].dtype, device=weights[0].device)
    for i, w in enumerate(weights):
        block[i].copy_(w)
        w.data = block[i]


def _block_view(weights: list) -> Tensor | None:
    """``[E, out, in]`` over the weights' own memory when they lie one after another at one stride, else None.
    Host metadata only (pointers and strides)."""
    w0 = weights[0]
    if not all(w.is_contiguous() and w.shape == w0.shape and w.dtype == w0.dtype and w.device == w0.device
               for w in weights):
        return None
    size = w0.element_size()
    step = (weights[1].data_ptr() - w0.data_ptr()) if len(weights) > 1 else w0.numel() * size
    if step < w0.numel() * size or step % size:
        return None
    if any(w.data_ptr() != w0.data_ptr() + i * step or w.untyped_storage().data_ptr() != w0.untyped_storage().data_ptr()
           for i, w in enumerate(weights)):
        return None
    return w0.detach().as_strided((len(weights), *w0.shape), (step // size, *w0.stride()))


def _as_one(weights) -> Tensor:
    """The weights as one ``[E, out, in]`` tensor, outside autograd: a view where they form a block, else a copy."""
    block = _block_view(weights)
    return block if block is not None else torch.stack([w.detach() for w in weights])
