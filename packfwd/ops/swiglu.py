"""A fused Triton SwiGLU, forward and backward, for the gated MLP: ``y [*, 2f] -> silu(gate) * up [*, f]``.

Megatron-Core's gated MLP (``megatron/core/transformer/mlp.py``, the ``glu`` branch and ``bias_swiglu_impl``)
chunks ``linear_fc1``'s output on the last dimension into ``[gate; up]`` (first half gate, second half up; under
tensor parallelism each rank's fc1 shard is its own ``[gate; up]``, so the activation is rank-local) and takes::

    out   = silu(gate) * up,            silu(g) = g * sigmoid(g)
    d_gate = d_out * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate)))
    d_up   = d_out * silu(gate)

Conventions: float32 math inside, one rounding to the input's dtype on output.  Megatron's unfused torch path
(what packfwd runs today: ``bias_activation_fusion=False``) rounds ``silu(gate)`` and ``d_out * up`` to a bf16 /
fp16 input's dtype on the way, so low-precision results differ from it within those roundings.  In float32 the
kernels do torch's CUDA operations in torch's order (``silu(x) = x / (1 + exp(-x))`` with CUDA's ``expf`` and
division to nearest; ``silu_backward``'s ``dy * s * (1 + x (1 - s))``), meant to give today's bits: asserted by a
GPU-only test not yet run (the interpreter has no CUDA ``expf``: numpy's ``exp`` there).  The output is a new
contiguous ``[*, f]`` tensor; the gradient a new contiguous ``[*, 2f]`` one in the input's dtype.  Inputs whose
last dimension is not unit-strided are copied once (any row stride is read as is).  Blocks of rows by blocks of
``f`` per program, no atomics: deterministic, bit for bit run to run.

``swiglu_scaled(y, scale)`` is the MoE experts' activation: Megatron-Core applies the routing probability of each
row after the activation (``(swiglu(fc1) * probs[:, None]).to(dtype)``); two more kernels take it whole (the
product and its cast forward; the broadcast product and the row sum of the scale's gradient backward), the
output and d/dy the composition's bits.

One file holds both forms, plain and scaled: the scaled kernels share the plain ones' tile, exp and launch
helpers, and their tests compare the two.

``swiglu(y)`` is the entry point: the kernels (``SwiGLUKernel``, over the launchers ``forward`` and ``backward``;
the kernels follow them) for a CUDA tensor with Triton installed, else the torch reference ``reference``.
:class:`SwiGLU` is the activation module packfwd's fused models hand Megatron-Core's MLP (the kernels on CUDA,
Megatron's own unfused ``glu`` elsewhere).  Importing this module without Triton works, launching does not.

Tested (``tests/gpu/test_swiglu_kernel.py``, on a GPU or in Triton's interpreter on the CPU) against float64
math and Megatron-Core's own SwiGLU (the unfused ``glu`` of ``MLP.forward`` and the fused ``bias_swiglu_impl``):
fp32 / bf16 / fp16, ``f`` not a power of 2, 1 to 37 rows, 3-D and non-contiguous inputs, gradients, bitwise
twice; on the GPU also float32 bit for bit against the unfused ``glu``.  Performance is not measured yet.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs never launch these (importing this module must still work)
    triton = None

# Rows and columns of f per program; warps per program.  From the H200 sweep of every kernel over its launch
# configurations (``bench_kernels.py --sweep-swiglu``, RESULTS section 18): 8 x 256 is the best at the MoE's expert rows
# (f = 768: 1024 columns left a quarter of every tile masked; 2.2 x faster scaled backward) and within 8 % of the
# best at the dense 1B's f = 7168.
CONFIG = {"rows": 8, "block_f": 256, "num_warps": 4}

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def supported(y: Tensor) -> bool:
    """Whether the kernels can take ``y``: a CUDA tensor of bf16 / fp16 / fp32, with Triton installed."""
    return triton is not None and y.is_cuda and y.dtype in DTYPES


def swiglu(y: Tensor) -> Tensor:
    """``silu(gate) * up`` of ``y [*, 2f] = [gate; up]``, as ``[*, f]``: the kernels where ``supported``, else the
    torch reference (both differentiable).

    >>> y = torch.tensor([[0.0, 2.0, 3.0, 5.0]])
    >>> swiglu(y)
    tensor([[0.0000, 8.8080]])
    """
    _check(y, "y")
    return SwiGLUKernel.apply(y) if supported(y) else reference(y)


def reference(y: Tensor) -> Tensor:
    """The torch reference: float32 math, one rounding to ``y``'s dtype (autograd differentiates it).

    >>> reference(torch.tensor([[1.0, -1.0, 2.0, 2.0]], dtype=torch.bfloat16))
    tensor([[ 1.4609, -0.5391]], dtype=torch.bfloat16)
    """
    gate, up = y.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(y.dtype)


def reference_backward(grad_out: Tensor, y: Tensor) -> Tensor:
    """``d/dy [*, 2f]`` of ``reference`` given ``grad_out [*, f]``: float32 math, in ``y``'s dtype.

    >>> reference_backward(torch.ones(1, 1), torch.tensor([[0.0, 3.0]]))
    tensor([[1.5000, 0.0000]])
    """
    gate, up = y.float().chunk(2, dim=-1)
    g = grad_out.float()
    sig = torch.sigmoid(gate)
    d_gate = g * up * sig * (1 + gate * (1 - sig))
    return torch.cat((d_gate, g * gate * sig), dim=-1).to(y.dtype)


class SwiGLU(torch.nn.Module):
    """The gated activation of Megatron-Core's MLP as a module: ``[*, 2f] = [gate; up] -> [*, f]``.

    Megatron-Core's ``MLP`` (and the ``SequentialMLP`` experts' and the shared experts' MLPs) build it from
    ``MLPSubmodules(activation_func=SwiGLU)`` as ``SwiGLU(config=config)`` and call it on ``linear_fc1``'s output
    (bias added) when ``config.use_te_activation_func`` is set (Megatron's hook for an activation module, named
    after TransformerEngine's; :func:`packfwd.models.args.transformer_config` sets it for ``ModelArgs.fused``).
    Per-token scaling stays Megatron's, after the module.

    Computes :func:`swiglu`'s kernels where they take the input (CUDA, bf16 / fp16 / fp32) and the config is the
    plain SwiGLU (``activation_func`` silu, no ``glu_linear_offset``, no clamp); else Megatron-Core's unfused
    ``glu`` of ``MLP.forward`` op for op, ``activation_func(gate) * (up + glu_linear_offset)`` after the clamp,
    so on the CPU the numbers are the plain MLP's bit for bit.  No parameters, nothing in the state dict.

    >>> from types import SimpleNamespace
    >>> act = SwiGLU(config=SimpleNamespace(activation_func=torch.nn.functional.silu, glu_linear_offset=0.0,
    ...                                     activation_func_clamp_value=None))
    >>> act(torch.tensor([[0.0, 2.0, 3.0, 5.0]]))
    tensor([[0.0000, 8.8080]])
    """

    def __init__(self, config, **unused):
        super().__init__()
        self.activation_func = config.activation_func
        self.offset = getattr(config, "glu_linear_offset", 0.0)
        self.clamp = getattr(config, "activation_func_clamp_value", None)
        self.kernel = (self.activation_func is torch.nn.functional.silu and not self.offset and self.clamp is None)

    def forward(self, y: Tensor) -> Tensor:
        if self.kernel and supported(y):
            return SwiGLUKernel.apply(y)
        gate, up = torch.chunk(y, 2, dim=-1)  # Megatron-Core's glu (megatron/core/transformer/mlp.py)
        if self.clamp is not None:
            gate = gate.clamp(min=None, max=self.clamp)
            up = up.clamp(min=-self.clamp, max=self.clamp)
        return self.activation_func(gate) * (up + self.offset)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """Nothing to checkpoint (Megatron-Core 0.16's ``MLP.sharded_state_dict`` asks every child)."""
        return {}


class SwiGLUKernel(torch.autograd.Function):
    """``silu(gate) * up`` of ``y [*, 2f]`` through the kernels; saves ``y`` only."""

    @staticmethod
    def forward(ctx, y):
        ctx.save_for_backward(y)
        return forward(y)

    @staticmethod
    def backward(ctx, grad_out):
        (y,) = ctx.saved_tensors
        return backward(grad_out, y)


def forward(y: Tensor) -> Tensor:
    """The forward kernel's launcher: ``[*, 2f] -> [*, f]`` in ``y``'s dtype."""
    rows, f = _rows(y, "y")
    out = torch.empty((*y.shape[:-1], f), dtype=y.dtype, device=y.device)
    if rows.shape[0] > 0:
        block_f, grid = _grid(rows.shape[0], f)
        _swiglu_fwd_kernel[grid](
            rows, rows.stride(0), out, rows.shape[0], f,
            ROWS=CONFIG["rows"], BLOCK_F=block_f, CUDA_EXP=_CUDA_EXP, num_warps=CONFIG["num_warps"],
        )
    return out


def backward(grad_out: Tensor, y: Tensor) -> Tensor:
    """The backward kernel's launcher: ``grad_out [*, f]``, ``y [*, 2f] -> d/dy [*, 2f]`` in ``y``'s dtype."""
    rows, f = _rows(y, "y")
    if grad_out.shape != (*y.shape[:-1], f):
        raise ValueError(f"grad_out has shape {tuple(grad_out.shape)}; the output of y {tuple(y.shape)} is "
                         f"{(*y.shape[:-1], f)}")
    g = grad_out.reshape(-1, f)
    g = g if g.stride(-1) == 1 else g.contiguous()
    grad = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    if rows.shape[0] > 0:
        block_f, grid = _grid(rows.shape[0], f)
        _swiglu_bwd_kernel[grid](
            rows, rows.stride(0), g, g.stride(0), grad, rows.shape[0], f,
            ROWS=CONFIG["rows"], BLOCK_F=block_f, CUDA_EXP=_CUDA_EXP, num_warps=CONFIG["num_warps"],
        )
    return grad


def swiglu_scaled(y: Tensor, scale: Tensor) -> Tensor:
    """``swiglu(y)`` rounded to ``y``'s dtype, times ``scale [n]`` per row in float32, rounded again: Megatron-Core's
    expert MLP (``(swiglu(fc1) * probs[:, None]).to(dtype)``, the routing probability applied after the
    activation) op for op, so the forward is its bits; ``y [n, 2f]``, returns ``[n, f]``.  On CUDA (``scale``
    float32) one kernel each way instead of the activation, the product, its cast and their backward (a broadcast
    product and a row sum): the gradient of ``y`` is today's bits, that of ``scale`` its row sum in float32 in another
    order, rounded once to ``scale``'s dtype (torch rounds each product to a half dtype first).  Elsewhere the torch ops themselves.

    >>> swiglu_scaled(torch.tensor([[0.0, 2.0, 3.0, 5.0]]), torch.tensor([0.5]))
    tensor([[0.0000, 4.4040]])
    """
    _check(y, "y")
    if not isinstance(scale, Tensor) or scale.shape != y.shape[:-1] or not scale.is_floating_point():
        raise ValueError(f"scale must be a floating-point tensor of one value per row of y, shape "
                         f"{tuple(y.shape[:-1])}, got {getattr(scale, 'dtype', type(scale).__name__)} "
                         f"{tuple(getattr(scale, 'shape', ()))}")
    if supported(y) and y.dim() == 2 and scale.dtype in DTYPES:
        return SwiGLUScaledKernel.apply(y, scale)
    a = swiglu(y)
    return (a * scale.unsqueeze(-1)).to(a.dtype)


class SwiGLUScaledKernel(torch.autograd.Function):
    """:func:`swiglu_scaled` through the kernels; saves ``y`` and ``scale``."""

    @staticmethod
    def forward(ctx, y, scale):
        ctx.save_for_backward(y, scale)
        return scaled_forward(y, scale)

    @staticmethod
    def backward(ctx, grad_out):
        y, scale = ctx.saved_tensors
        return scaled_backward(grad_out, y, scale)


def scaled_forward(y: Tensor, scale: Tensor) -> Tensor:
    """The scaled forward kernel's launcher: ``[n, 2f]``, ``[n]`` (a float dtype) ``-> [n, f]`` in ``y``'s dtype."""
    rows, f = _rows(y, "y")
    out = torch.empty((rows.shape[0], f), dtype=y.dtype, device=y.device)
    if rows.shape[0] > 0:
        block_f, grid = _grid(rows.shape[0], f)
        _swiglu_scaled_fwd_kernel[grid](
            rows, rows.stride(0), scale.contiguous(), out, rows.shape[0], f,
            ROWS=CONFIG["rows"], BLOCK_F=block_f, CUDA_EXP=_CUDA_EXP, num_warps=CONFIG["num_warps"],
        )
    return out


def scaled_backward(grad_out: Tensor, y: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """The scaled backward kernel's launcher: ``(d/dy [n, 2f] in y's dtype, d/dscale [n] in scale's)``; the row sums
    of ``d/dscale`` over blocks of ``f`` are added in a fixed order (no atomics)."""
    rows, f = _rows(y, "y")
    g = grad_out.reshape(-1, f)
    g = g if g.stride(-1) == 1 else g.contiguous()
    grad = torch.empty(rows.shape, dtype=y.dtype, device=y.device)
    n = rows.shape[0]
    if n == 0:
        return grad, torch.zeros_like(scale)
    block_f, grid = _grid(n, f)
    parts = torch.empty((n, grid[1]), dtype=torch.float32, device=y.device)
    _swiglu_scaled_bwd_kernel[grid](
        rows, rows.stride(0), g, g.stride(0), scale.contiguous(), grad, parts, grid[1], n, f,
        ROWS=CONFIG["rows"], BLOCK_F=block_f, CUDA_EXP=_CUDA_EXP, num_warps=CONFIG["num_warps"],
    )
    return grad, (parts[:, 0] if grid[1] == 1 else parts.sum(1)).to(scale.dtype)


def _check(y: Tensor, name: str) -> int:
    if not isinstance(y, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(y).__name__}")
    if y.dim() < 1 or y.shape[-1] == 0 or y.shape[-1] % 2:
        raise ValueError(f"{name} must be [*, 2f] with f >= 1 ([gate; up] on the last dimension), got shape "
                         f"{tuple(y.shape)}")
    if not y.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {y.dtype}")
    return y.shape[-1] // 2


def _rows(y: Tensor, name: str) -> tuple[Tensor, int]:
    """``y`` as ``[n, 2f]`` rows with a unit last stride (a view where one exists), and ``f``."""
    f = _check(y, name)
    if triton is None:
        raise RuntimeError("packfwd.ops.swiglu's kernels need Triton; use swiglu() or reference() without it")
    if y.dtype not in DTYPES:
        raise TypeError(f"{name} must be bf16, fp16 or fp32 for the kernels, got {y.dtype}")
    rows = y.reshape(-1, 2 * f)
    return (rows if rows.stride(-1) == 1 else rows.contiguous()), f


def _grid(n: int, f: int):
    block_f = min(CONFIG["block_f"], triton.next_power_of_2(f))
    return block_f, (triton.cdiv(n, CONFIG["rows"]), triton.cdiv(f, block_f))


# ---------------------------------------------------------------------------------------------------- the kernels

# CUDA's expf (libdevice) and IEEE division, the operations of torch's CUDA silu / silu_backward, so that float32
# gives today's unfused path's bits (checked on the GPU only); Triton's interpreter has no libdevice: numpy's exp.
_CUDA_EXP = os.environ.get("TRITON_INTERPRET") != "1"

if triton is not None:

    @triton.jit
    def _exp(x, CUDA_EXP: tl.constexpr):
        """exp of float32 ``x``: CUDA's expf (what torch's silu calls) on the GPU, numpy's in the interpreter."""
        if CUDA_EXP:
            return libdevice.exp(x)
        else:
            return tl.exp(x)

    @triton.jit
    def _tile(y, stride, N, F, ROWS: tl.constexpr, BLOCK_F: tl.constexpr):
        """This program's rows ``r`` and columns ``c`` of f, their mask, and its gate and up halves in float32."""
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        c = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        ok = (r < N)[:, None] & (c < F)[None, :]
        at = y + r[:, None] * stride + c[None, :]
        gate = tl.load(at, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(at + F, mask=ok, other=0.0).to(tl.float32)
        return r, c, ok, gate, up

    @triton.jit
    def _swiglu_fwd_kernel(y, stride, out, N, F, ROWS: tl.constexpr, BLOCK_F: tl.constexpr, CUDA_EXP: tl.constexpr):
        r, c, ok, gate, up = _tile(y, stride, N, F, ROWS, BLOCK_F)
        e = _exp(-gate, CUDA_EXP)
        o = tl.math.div_rn(gate, 1.0 + e) * up  # torch: silu(x) = x / (1 + exp(-x)), then the product
        tl.store(out + r[:, None] * F + c[None, :], o.to(out.dtype.element_ty), mask=ok)

    @triton.jit
    def _swiglu_bwd_kernel(
        y, stride, g, g_stride, grad, N, F, ROWS: tl.constexpr, BLOCK_F: tl.constexpr, CUDA_EXP: tl.constexpr,
    ):
        r, c, ok, gate, up = _tile(y, stride, N, F, ROWS, BLOCK_F)
        go = tl.load(g + r[:, None] * g_stride + c[None, :], mask=ok, other=0.0).to(tl.float32)
        e = _exp(-gate, CUDA_EXP)
        sig = tl.math.div_rn(tl.full(gate.shape, 1.0, tl.float32), 1.0 + e)
        # autograd of silu(gate) * up: d_up = go * silu(gate); d_gate = silu_backward(go * up, gate), in torch's order
        d_gate = (go * up) * sig * (1.0 + gate * (1.0 - sig))
        d_up = go * tl.math.div_rn(gate, 1.0 + e)
        dst = grad + r[:, None] * (2 * F) + c[None, :]
        tl.store(dst, d_gate.to(grad.dtype.element_ty), mask=ok)
        tl.store(dst + F, d_up.to(grad.dtype.element_ty), mask=ok)

    @triton.jit
    def _swiglu_scaled_fwd_kernel(y, stride, scale, out, N, F, ROWS: tl.constexpr, BLOCK_F: tl.constexpr,
                                  CUDA_EXP: tl.constexpr):
        r, c, ok, gate, up = _tile(y, stride, N, F, ROWS, BLOCK_F)
        p = tl.load(scale + r, mask=r < N, other=0.0).to(tl.float32)
        e = _exp(-gate, CUDA_EXP)
        a = (tl.math.div_rn(gate, 1.0 + e) * up).to(out.dtype.element_ty).to(tl.float32)  # swiglu, rounded
        tl.store(out + r[:, None] * F + c[None, :], (a * p[:, None]).to(out.dtype.element_ty), mask=ok)

    @triton.jit
    def _swiglu_scaled_bwd_kernel(
        y, stride, g, g_stride, scale, grad, parts, BLOCKS, N, F, ROWS: tl.constexpr, BLOCK_F: tl.constexpr,
        CUDA_EXP: tl.constexpr,
    ):
        r, c, ok, gate, up = _tile(y, stride, N, F, ROWS, BLOCK_F)
        go = tl.load(g + r[:, None] * g_stride + c[None, :], mask=ok, other=0.0).to(tl.float32)
        p = tl.load(scale + r, mask=r < N, other=0.0).to(tl.float32)
        e = _exp(-gate, CUDA_EXP)
        sig = tl.math.div_rn(tl.full(gate.shape, 1.0, tl.float32), 1.0 + e)
        silu = tl.math.div_rn(gate, 1.0 + e)
        a = (silu * up).to(grad.dtype.element_ty).to(tl.float32)  # the forward's rounded activation
        # d scale: sum over f of go * a (this block's part); d a: go * scale rounded to the dtype (autograd's)
        tl.store(parts + r * BLOCKS + tl.program_id(1), tl.sum(tl.where(ok, go * a, 0.0), axis=1), mask=r < N)
        ga = (go * p[:, None]).to(grad.dtype.element_ty).to(tl.float32)
        d_gate = (ga * up) * sig * (1.0 + gate * (1.0 - sig))
        d_up = ga * silu
        dst = grad + r[:, None] * (2 * F) + c[None, :]
        tl.store(dst, d_gate.to(grad.dtype.element_ty), mask=ok)
        tl.store(dst + F, d_up.to(grad.dtype.element_ty), mask=ok)
