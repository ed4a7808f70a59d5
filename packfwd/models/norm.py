"""packfwd's RMSNorm modules, built the way Megatron-Core builds a norm (``(config=, hidden_size=, eps=)``), and which
one each place of a model takes: every layer spec names them (the decoder's layer norms, QK-norm, MLA's latent
norms, the final norm).  No Megatron-Core.

Fused (``ModelArgs.fused``, the default): QK-norm is :class:`FusedRMSNorm` (packfwd's Triton kernels on CUDA).  The
layer norms stay :class:`RMSNorm` either way: over the hidden size torch's own ``rms_norm`` is one fused CUDA kernel
at least as fast as the Triton kernels on an H200 (RESULTS sections 11 and 15); QK-norm's rows of head_dim channels
go many to a Triton program, where torch's kernel is slow (``FUSED_NORMS``).  Same parameters, same state dict; on
the CPU the same numbers bit for bit.
"""

from __future__ import annotations

import torch

__all__ = ["FUSED_NORMS", "FusedRMSNorm", "RMSNorm", "ZeroCenteredRMSNorm", "norm_class"]


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built the way Megatron-Core builds a norm: ``(config=, hidden_size=, eps=)``.

    Parameters take ``config.params_dtype``, and are marked ``sequence_parallel`` under sequence parallelism
    (each rank then sees a slice of the tokens, so Megatron all-reduces their gradients over the TP group).

    ``fused=True`` (:class:`FusedRMSNorm`, for a spec that names it) computes the norm with the Triton kernels of
    :mod:`packfwd.ops.rmsnorm` where they take the input (CUDA, bf16 / fp16 / fp32), else as torch does; same
    math, equal within float32 rounding.

    >>> from types import SimpleNamespace
    >>> import torch
    >>> norm = RMSNorm(SimpleNamespace(params_dtype=torch.float32, sequence_parallel=False), hidden_size=4, eps=1e-6)
    >>> norm(torch.ones(2, 4))
    tensor([[1.0000, 1.0000, 1.0000, 1.0000],
            [1.0000, 1.0000, 1.0000, 1.0000]], grad_fn=<MulBackward0>)
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, fused: bool = False, **unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.fused = bool(fused)
        if getattr(config, "sequence_parallel", False):
            for p in self.parameters():
                p.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and self.weight is not None:
            from packfwd.ops import rmsnorm

            if rmsnorm.supported(x, self.weight):
                eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
                return rmsnorm.rms_norm(x, self.weight, eps, kernel=True)
        return super().forward(x)


class FusedRMSNorm(RMSNorm):
    """:class:`RMSNorm` with ``fused=True``, for a spec that names it (packfwd's fused models keep :class:`RMSNorm`:
    torch's own fused kernel is faster, see the module docstring).  A class of its own, not a spec param, because
    Megatron-Core 0.19 builds norms by calling the spec's class directly.

    >>> from types import SimpleNamespace
    >>> FusedRMSNorm(SimpleNamespace(params_dtype=torch.float32), hidden_size=4, eps=1e-6).fused
    True
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(config, hidden_size, eps, fused=True)


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm whose weight is stored centred on zero: ``rms_norm(x) * (1 + weight)``, computed in ``x``'s dtype
    promoted to float32 at least and rounded back once (transformers' ``Qwen3NextRMSNorm``; Megatron-Core's
    ``layernorm_zero_centered_gamma``).  The weight starts at zero (the identity scale).  Every norm of a model with
    ``ModelArgs.norm_zero_centered`` (Qwen3-Next, Qwen3.5) is one: the layer norms, QK-norm, the final norm.

    >>> from types import SimpleNamespace
    >>> norm = ZeroCenteredRMSNorm(SimpleNamespace(params_dtype=torch.float32), hidden_size=2, eps=0.0)
    >>> norm(torch.tensor([[3.0, 4.0]])).tolist(), norm.weight.tolist()
    ([[0.8485281467437744, 1.1313709020614624]], [0.0, 0.0])
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(config, hidden_size, eps)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cdt = torch.promote_types(x.dtype, torch.float32)
        xc = x.to(cdt)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        normed = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
        return (normed * (1.0 + self.weight.to(cdt))).to(x.dtype)


# The norm each place of a fused model takes: "torch" (:class:`RMSNorm`: torch's rms_norm) or "kernel"
# (:class:`FusedRMSNorm`: packfwd's Triton kernels, several rows to a program).  The layer norms over the hidden
# size keep torch's; QK-norm's narrow rows (head_dim) take the kernels.  Measured per place on an H200
# (``benchmarks/bench_kernels.py``'s rmsnorm / qk_norm rows, ``bench_step.py``'s packfwd_fused_*_norms variants).
FUSED_NORMS = {"layer": "torch", "qk": "kernel"}


def norm_class(args, place: str = "layer"):
    """The norm class of ``place`` ("layer" or "qk") in a model of ``args``: :class:`ZeroCenteredRMSNorm` everywhere
    in a model with ``norm_zero_centered``; else :class:`FusedRMSNorm` where the model is fused and ``FUSED_NORMS``
    picks the kernels there, else :class:`RMSNorm` (module docstring)."""
    if args is not None and getattr(args, "norm_zero_centered", False):
        return ZeroCenteredRMSNorm
    if args is not None and getattr(args, "fused", False) and FUSED_NORMS[place] == "kernel":
        return FusedRMSNorm
    return RMSNorm
