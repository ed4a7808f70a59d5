"""The fused layer (``ModelArgs.fused=True``: Triton RMSNorm, SwiGLU and THD RoPE) against Megatron-Core's plain
modules (``fused=False``) on the same weights, through a packed THD forward and backward.

Strategy: two models from one seed (the switch adds no state), a ragged batch packed to THD with host lengths, a
token-mean loss; compared are the logits and every parameter's gradient.

* float32: within 1e-5 relative (norm of the difference over the norm): the RoPE and (on the GPU) the SwiGLU
  kernels give the plain ops' bits; the RMSNorm kernel sums a row in another order (float32 rounding), which the
  next layers carry on.
* bf16: the kernels round once where the plain ops round two or three times (SwiGLU's ``silu(gate)``, RMSNorm's
  normalised row before the weight), so the two models differ by bf16 roundings.  The tolerance is stated against
  an float32 model of the same weights: the fused model's error is at most 1.5 times the plain model's plus one
  bf16 step (2^-8, relative), for the logits and for every gradient: fused is as accurate as today's path.
* The kernels run (each autograd Function counted: per layer two QK-norms, one SwiGLU, one RoPE of q and k; the
  layer norms stay torch's), and the fused forward and backward make no host sync (``set_sync_debug_mode``, the
  checker of ``test_forward_no_sync.py``).

Runs on a CUDA GPU; on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``) the float32 comparison and the
kernel count run with the kernels made to take CPU tensors (the GPU-only parts skip).

    PYTHONPATH=. python3 -m pytest -q tests/gpu/test_fused_layer_cuda.py
    TRITON_INTERPRET=1 PYTHONPATH=. python3 -m pytest -q tests/gpu/test_fused_layer_cuda.py   # CPU, slow-ish
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from packfwd.forward import make_forward
from packfwd.models import ModelArgs, build_model
from packfwd.models.convert.hf import load_weights
from packfwd.ops import rmsnorm, rope, swiglu

from ._kernel_device import DEVICE, gpu_only, needs_kernels

pytestmark = [needs_kernels]

# Qwen3-shaped: GQA 4 / 2 heads of 32, QK-norm, ffn not a power of 2
ARGS = ModelArgs(vocab_size=256, hidden_size=128, ffn_hidden_size=192, num_layers=2, num_attention_heads=4,
                 num_query_groups=2, head_dim=32, family="qwen3", qk_norm=True)
LENGTHS = [24, 1, 17, 9] if DEVICE == "cpu" else [96, 1, 57, 70, 33]
S = max(LENGTHS)


@pytest.fixture
def kernels(monkeypatch):
    """Counts of each kernel Function's calls; in the interpreter the kernels are made to take CPU tensors."""
    counts = {}
    for name, fn in ((rmsnorm.RMSNormKernel, "rmsnorm"), (swiglu.SwiGLUKernel, "swiglu"), (rope.RopeKernel, "rope")):
        original = name.apply

        def counted(*args, _original=original, _key=fn):
            counts[_key] = counts.get(_key, 0) + 1
            return _original(*args)

        monkeypatch.setattr(name, "apply", counted)
    if DEVICE == "cpu":
        for module in (rmsnorm, swiglu, rope):
            monkeypatch.setattr(module, "supported", lambda *tensors: True)
    return counts


def batch():
    g = torch.Generator().manual_seed(1)
    mask = torch.arange(S)[None] < torch.tensor(LENGTHS)[:, None]
    mask[0] = mask[0].roll(3)  # a row with a hole at its start
    ids = torch.randint(1, ARGS.vocab_size, mask.shape, generator=g)
    return ids.to(DEVICE), mask.to(DEVICE), mask.sum(1).tolist()


def models(dtype):
    """``(fused, plain)`` with the same weights: the plain model loads the fused one's state dict (a seed does not
    make two CUDA builds equal: Megatron-Core draws CUDA weights from its own RNG tracker, which runs on)."""
    torch.manual_seed(0)
    fused = build_model(dataclasses.replace(ARGS, fused=True), device=DEVICE, params_dtype=dtype)
    plain = build_model(dataclasses.replace(ARGS, fused=False), device=DEVICE, params_dtype=dtype)
    plain.load_state_dict(fused.state_dict())
    return fused, plain


def step(model, ids, mask, lengths):
    """Logits of a packed THD forward and the parameter gradients of a token-mean loss over them."""
    model.zero_grad(set_to_none=True)
    logits = make_forward("thd")(model, ids, mask, seqlens=lengths)
    loss = (logits.float().logsumexp(-1) * mask).sum() / sum(lengths)  # no boolean indexing: no host sync
    loss.backward()
    return logits.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_fp32_matches_plain(kernels):
    fused, plain = models(torch.float32)
    ids, mask, lengths = batch()
    got = step(fused, ids, mask, lengths)
    layers = ARGS.num_layers
    # the RMSNorm kernel runs QK-norm's two norms per layer only: the layer norms stay torch's rms_norm (as fast
    # on the H200 over the hidden size; spec docstring, FUSED_NORMS)
    assert kernels == {"swiglu": layers, "rope": layers, "rmsnorm": 2 * layers}
    want = step(plain, ids, mask, lengths)
    assert rel(got[0], want[0]) < 1e-5 and got[0][mask].abs().sum() > 0
    for name in want[1]:
        assert rel(got[1][name], want[1][name]) < 1e-5, name


@gpu_only
def test_bf16_within_bf16_rounding(kernels):
    fused, plain = models(torch.bfloat16)
    reference = load_weights(build_model(dataclasses.replace(ARGS, fused=False), device=DEVICE, init=False),
                             {n: p.detach().float() for n, p in plain.named_parameters()})
    ids, mask, lengths = batch()
    got, want, exact = (step(m, ids, mask, lengths) for m in (fused, plain, reference))
    assert kernels["rope"] == ARGS.num_layers
    bf16_step = 2.0**-8

    def check(a, b, ref, what):
        err_fused, err_plain = rel(a, ref), rel(b, ref)
        assert err_fused <= 1.5 * err_plain + bf16_step, (what, err_fused, err_plain)

    check(got[0][mask], want[0][mask], exact[0][mask], "logits")
    assert rel(got[0][mask], want[0][mask]) < 8 * bf16_step  # and the two bf16 models a few roundings apart
    for name in exact[1]:
        check(got[1][name], want[1][name], exact[1][name], name)


@gpu_only
def test_fused_forward_and_backward_make_no_sync():
    from .test_forward_no_sync import no_sync

    fused, _ = models(torch.bfloat16)
    ids, mask, lengths = batch()
    step(fused, ids, mask, lengths)  # warm-up: Triton compiles, first-use allocations
    no_sync(lambda: step(fused, ids, mask, lengths))
