"""Gated DeltaNet's operators on CUDA through fla's varlen kernels (``packfwd.models.mixers.deltanet_cuda``), against
the torch path, which is exact.

* forward (the delta rule and the convolution, bf16): within bf16 rounding of the torch path run in float32 on the
  same bf16 inputs (tolerances of fla's bf16 state and intermediates, a few bf16 ulps of the output's scale);
* gradients within bf16 rounding of the float32 torch path: the delta rule's (fla's backward kernels with packfwd's
  chunk-local step in place of the one fla refuses on Hopper), the convolution's (fla's own backward); with
  ``PACKFWD_DELTANET=recompute`` the delta rule's are the torch path's bit for bit;
* every sequence's rows packed equal the sequence run alone, bit for bit (THD aligned: pads between sequences);
* the chunk index packfwd builds on the device is the one fla builds on the host for the same boundaries;
* forward and backward of both operators make no host sync (``max_seqlen`` given).

    PYTHONPATH=.:/tmp/site python3 -m pytest -q tests/gpu/test_deltanet_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from packfwd.models.mixers import deltanet_cuda, deltanet_ops
from packfwd.models.mixers.deltanet_ops import causal_conv1d_packed, chunk_gated_delta_rule_packed, sequence_rows

from .test_no_sync import sync_mode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
fla = pytest.importorskip("fla")

LENGTHS = (300, 1, 64, 129, 7, 211)  # one token, a whole chunk, chunks and a partial one
ALIGN = 16  # THD aligned: pads behind each sequence
HK, HV, D, CONV = 2, 4, 128, 4


def _cu(lengths, align=1):
    padded = [-(-n // align) * align for n in lengths]
    to = lambda xs: torch.tensor([0, *xs], device="cuda").cumsum(0).to(torch.int32)  # noqa: E731
    return to(lengths), to(padded)


def _inputs(t, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    q, k, v = rand(t, HK, D).to(dtype), rand(t, HK, D).to(dtype), rand(t, HV, D).to(dtype)
    decay = -torch.nn.functional.softplus(rand(t, HV)) * 0.5  # float32, as the layer computes it
    beta = rand(t, HV).sigmoid().to(dtype)
    return q, k, v, decay, beta


def _rule(inputs, cu, cu_pad, **kw):
    return chunk_gated_delta_rule_packed(*inputs, cu, 64, cu_seqlens_padded=cu_pad, max_seqlen=max(LENGTHS),
                                         use_qk_l2norm_in_kernel=True, **kw)


def _torch(monkeypatch):
    monkeypatch.setenv(deltanet_cuda.SWITCH, "torch")


def test_fla_is_taken():
    q, k, v, decay, beta = _inputs(8)
    assert deltanet_cuda.fla_takes(q, k, v, decay, beta), "fla is installed but the CUDA path is not taken"


def _rel(a, b):
    return float((a.detach().float() - b.detach()).abs().max() / b.detach().abs().max())


def test_rule_forward_and_gradients_within_bf16_of_the_torch_path(monkeypatch):
    """fla's forward and the backward of fla's kernels with packfwd's chunk-local step, against the torch path in
    float32 on the same bf16 inputs; with ``PACKFWD_DELTANET=recompute`` the gradients are the torch path's bits."""
    cu, cu_pad = _cu(LENGTHS, ALIGN)
    t = int(cu_pad[-1]) + 5  # and rows past the last sequence
    inputs = [x.requires_grad_() for x in _inputs(t)]
    upstream = torch.randn(t, HV, D, device="cuda", dtype=torch.bfloat16)
    out = _rule(inputs, cu, cu_pad)
    grads = torch.autograd.grad(out, inputs, upstream)
    monkeypatch.setenv(deltanet_cuda.SWITCH, "recompute")
    recomputed = torch.autograd.grad(_rule(inputs, cu, cu_pad), inputs, upstream)
    _torch(monkeypatch)
    same = _rule(inputs, cu, cu_pad)
    for a, b in zip(recomputed, torch.autograd.grad(same, inputs, upstream)):
        assert torch.equal(a, b)  # the recompute backward is the torch path on the same bf16 inputs
    exact_in = [x.detach().float().requires_grad_() for x in inputs]
    exact = _rule(exact_in, cu, cu_pad)
    exact_grads = torch.autograd.grad(exact, exact_in, upstream.float())
    for name, a, a_torch, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), (out, *grads), (same, *recomputed),
                                   (exact, *exact_grads)):
        err, err_torch = _rel(a, b), _rel(a_torch, b)
        print(f"{name}: fla {err:.2e}, torch path in bf16 {err_torch:.2e} (of the largest float32 value)")
        assert err < 2e-2, f"{name} on fla's kernels differs from the float32 torch path by {err:.2e} of its max " \
                           f"(the torch path in bf16: {err_torch:.2e})"
    _, _, real = sequence_rows(cu, t, cu_pad)
    assert out[~real].eq(0).all() and all(g[~real].eq(0).all() for g in grads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes_take_the_torch_path(dtype):
    """Only bfloat16 takes fla (the dtype it has run in here): float32 would round to tf32 in fla's dots."""
    inputs = _inputs(64, seed=4, dtype=dtype)
    assert not deltanet_cuda.fla_takes(*inputs)
    assert deltanet_cuda.fla_takes(*_inputs(64, seed=4))


def test_conv_forward_and_backward_within_bf16(monkeypatch):
    cu, cu_pad = _cu(LENGTHS, ALIGN)
    t = int(cu_pad[-1]) + 5
    c = 64  # the channels of the other tests: one autotuning of fla's kernels (most of this file's time)
    g = torch.Generator(device="cuda").manual_seed(1)
    x, weight, bias = (torch.randn(*s, device="cuda", generator=g).bfloat16().requires_grad_()
                       for s in ((t, c), (c, CONV), (c,)))
    upstream = torch.randn(t, c, device="cuda", generator=g).bfloat16()
    out = causal_conv1d_packed(x, weight, bias, cu, cu_seqlens_padded=cu_pad)
    grads = torch.autograd.grad(out, (x, weight, bias), upstream)
    _torch(monkeypatch)
    ins = [y.detach().float().requires_grad_() for y in (x, weight, bias)]
    exact = causal_conv1d_packed(*ins, cu, cu_seqlens_padded=cu_pad)
    for a, b in zip((out, *grads), (exact, *torch.autograd.grad(exact, ins, upstream.float()))):
        err = (a.float() - b).abs().max() / b.abs().max()
        assert err < 1e-2, f"fla's convolution differs from the float32 torch path by {err:.2e} of the max"


def test_packed_equals_each_sequence_alone_bitwise():
    cu, cu_pad = _cu(LENGTHS, ALIGN)
    t = int(cu_pad[-1])
    inputs = _inputs(t, seed=2)
    x = torch.randn(t, 64, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(64, CONV, device="cuda", dtype=torch.bfloat16)
    packed, conv = _rule(inputs, cu, cu_pad), causal_conv1d_packed(x, weight, None, cu, cu_seqlens_padded=cu_pad)
    for n, start in zip(LENGTHS, cu_pad[:-1].tolist()):
        rows = slice(start, start + n)
        alone_cu = torch.tensor([0, n], device="cuda", dtype=torch.int32)
        alone = chunk_gated_delta_rule_packed(*(y[rows] for y in inputs), alone_cu, 64, use_qk_l2norm_in_kernel=True)
        assert torch.equal(packed[rows], alone), f"the sequence of {n} tokens changes when packed"
        assert torch.equal(conv[rows], causal_conv1d_packed(x[rows], weight, None, alone_cu))


def test_chunk_index_is_flas():
    from fla.ops.utils.index import prepare_chunk_indices

    cu, cu_pad = _cu(LENGTHS, ALIGN)
    t = int(cu_pad[-1])
    starts, lengths = deltanet_ops._starts_lengths(cu, cu_pad)
    seq, pos, real = sequence_rows(cu, t, cu_pad)
    for chunk in (16, 64):
        layout = deltanet_cuda.chunk_layout(starts, lengths, pos, seq, real, chunk)
        assert torch.equal(layout.chunk_indices, prepare_chunk_indices(layout.cu_seqlens, chunk))


def test_forward_and_backward_make_no_host_sync():
    cu, cu_pad = _cu(LENGTHS, ALIGN)
    t = int(cu_pad[-1])
    inputs = [y.requires_grad_() for y in _inputs(t, seed=3)]
    x = torch.randn(t, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(64, CONV, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        out = _rule(inputs, cu, cu_pad).float().sum() + causal_conv1d_packed(x, weight, None, cu,
                                                                             cu_seqlens_padded=cu_pad).float().sum()
        out.backward()

    step()  # warm-up: Triton's autotuning and first-use allocations sync
    torch.cuda.synchronize()
    with sync_mode("error"):
        step()
    torch.cuda.synchronize()
