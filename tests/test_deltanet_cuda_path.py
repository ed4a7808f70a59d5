"""The CUDA path of Gated DeltaNet's operators (``packfwd.models.mixers.deltanet_cuda``), checked on the CPU.

Strategy: fla's kernels need a GPU (tests/gpu/test_deltanet_cuda.py runs them); here everything around them runs
with the torch path standing in for fla.  The chunk-aligned layout fla is given keeps every sequence whole, from a
chunk start, and its chunk index is fla's (a sequence's chunks in order); the delta rule's autograd.Function returns
the torch path's gradients bit for bit; and the whole dispatch, with fakes of fla's two functions that run the torch
path on the aligned buffer, equals the torch path on the packed one, gradients included.  Negative controls: a
layout one chunk short of a sequence, and a fake that ignores the sequence boundaries, are caught.
"""

from __future__ import annotations

import pytest
import torch

from packfwd.models.mixers import deltanet_cuda, deltanet_ops
from packfwd.models.mixers.deltanet_ops import causal_conv1d_packed, chunk_gated_delta_rule_packed, sequence_rows

LENGTHS = (5, 0, 1, 8, 13)  # empty, one token, a whole chunk, several chunks (chunk 4 below)
PADDED = (6, 1, 4, 8, 16)  # pads behind each sequence (THD aligned), and 3 rows past the last one


def _batch(lengths=LENGTHS, padded=PADDED, tail=3):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    cu_pad = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()])
    return cu, cu_pad, int(cu_pad[-1]) + tail


def _layout(cu, cu_pad, t, chunk):
    starts, lengths = deltanet_ops._starts_lengths(cu, cu_pad)
    seq, pos, real = sequence_rows(cu, t, cu_pad)
    return deltanet_cuda.chunk_layout(starts, lengths, pos, seq, real, chunk), real


def test_layout_keeps_each_sequence_whole_from_a_chunk_start():
    cu, cu_pad, t = _batch()
    layout, real = _layout(cu, cu_pad, t, chunk=4)
    x = torch.arange(1, t + 1, dtype=torch.float64)[:, None]  # row r holds r + 1: no zero among real rows
    aligned = layout.gather(x)[0, :, 0]
    bounds = layout.cu_seqlens.tolist()
    assert all(b % 4 == 0 for b in bounds) and bounds[-1] == aligned.shape[0] == (t // 4 + len(LENGTHS) + 1) * 4
    for i, (n, start) in enumerate(zip(LENGTHS, cu_pad[:-1].tolist())):
        assert bounds[i + 1] - bounds[i] == -(-n // 4) * 4  # whole chunks, no more
        assert aligned[bounds[i]: bounds[i] + n].tolist() == list(range(start + 1, start + n + 1))
    assert int((aligned != 0).sum()) == sum(LENGTHS)  # nothing else read: pads and trailing rows stay zero
    assert torch.equal(layout.scatter(layout.gather(x)), torch.where(real[:, None], x, 0))
    # fla's chunk index: every chunk of the buffer as (sequence, chunk within it), the tail sequence's included
    expected = [(i, c) for i in range(len(bounds) - 1) for c in range((bounds[i + 1] - bounds[i]) // 4)]
    assert [tuple(r) for r in layout.chunk_indices.tolist()] == expected


def test_layout_negative_control_detects_a_short_sequence():
    """A layout whose sequence 3 is given one chunk too few: the check above would see its rows missing."""
    cu, cu_pad, t = _batch()
    short = torch.tensor(LENGTHS)
    short[3] -= 4
    starts, _ = deltanet_ops._starts_lengths(cu, cu_pad)
    seq, pos, real = sequence_rows(cu, t, cu_pad)
    layout = deltanet_cuda.chunk_layout(starts, short, pos, seq, real, 4)
    x = torch.arange(1, t + 1, dtype=torch.float64)[:, None]
    assert not torch.equal(layout.scatter(layout.gather(x)), torch.where(real[:, None], x, 0))


def _inputs(t, hk=1, hv=2, dk=4, dv=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(t, hk, dk, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(t, hv, dv, generator=g, dtype=torch.float64)
    decay, beta = -torch.rand(t, hv, generator=g, dtype=torch.float64), torch.rand(t, hv, generator=g, dtype=torch.float64)
    return [x.requires_grad_() for x in (q, k, v, decay, beta)]


def test_function_returns_the_torch_paths_gradients_bitwise():
    """``_DeltaRule`` with the torch path as its forward too: output and every gradient bit for bit the torch
    path's autograd (also when only some inputs want a gradient)."""
    cu, cu_pad, t = _batch()

    def reference(*xs):
        return chunk_gated_delta_rule_packed(*xs, cu, 4, cu_seqlens_padded=cu_pad, use_qk_l2norm_in_kernel=True)

    inputs = _inputs(t)
    upstream = torch.randn(t, 2, 3, dtype=torch.float64)
    expected = reference(*inputs)
    want = torch.autograd.grad(expected, inputs, upstream)
    out = deltanet_cuda._DeltaRule.apply(*inputs, reference, reference)
    assert torch.equal(out, expected)
    for a, b in zip(torch.autograd.grad(out, inputs, upstream), want):
        assert torch.equal(a, b)
    q, k, v, decay, beta = (x.detach() for x in inputs)
    v.requires_grad_()
    (dv,) = torch.autograd.grad(deltanet_cuda._DeltaRule.apply(q, k, v, decay, beta, reference, reference), v, upstream)
    assert torch.equal(dv, want[2])


@pytest.fixture
def fake_fla(monkeypatch):
    """fla's two functions replaced by the torch path run on the aligned buffer ``[1, T, *]`` as fla would get it
    (its ``cu_seqlens``, its chunk index checked against it); the dispatch takes them for every tensor."""
    inside = []

    def check_index(cu, chunk_indices, chunk):
        bounds = cu.tolist()
        expected = [(i, c) for i in range(len(bounds) - 1) for c in range(-(-(bounds[i + 1] - bounds[i]) // chunk))]
        assert [tuple(r) for r in chunk_indices.tolist()] == expected

    def rule(q, k, v, g, beta, *, scale, use_qk_l2norm_in_kernel, cu_seqlens, chunk_indices, chunk_size):
        check_index(cu_seqlens, chunk_indices, chunk_size)
        inside.append(1)
        try:
            o = chunk_gated_delta_rule_packed(q[0], k[0], v[0], g[0], beta[0], cu_seqlens, chunk_size, scale=scale,
                                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        finally:
            inside.pop()
        return o[None], None

    def conv(x, weight, bias, *, activation, cu_seqlens, chunk_indices):
        check_index(cu_seqlens, chunk_indices, deltanet_cuda.CONV_CHUNK)
        inside.append(1)
        try:
            return causal_conv1d_packed(x[0], weight, bias, cu_seqlens, activation=activation)[None], None
        finally:
            inside.pop()

    monkeypatch.setattr(deltanet_cuda, "_fla", lambda: (rule, conv))
    monkeypatch.setattr(deltanet_cuda, "_fla_kernels", lambda: None)  # the recompute backward (fla's are CUDA-only)
    monkeypatch.setattr(deltanet_cuda, "fla_takes", lambda *tensors, **kw: not inside)
    return rule


def test_fla_path_with_torch_in_place_of_fla_equals_the_torch_path(fake_fla, monkeypatch):
    cu, cu_pad, t = _batch()
    inputs = _inputs(t, hk=2, hv=4, seed=1)
    upstream = torch.randn(t, 4, 3, dtype=torch.float64)
    results = []
    for fla in (True, False):
        if not fla:
            monkeypatch.setattr(deltanet_cuda, "fla_takes", lambda *tensors, **kw: False)
        out = chunk_gated_delta_rule_packed(*inputs, cu, 4, cu_seqlens_padded=cu_pad, max_seqlen=13, scale=0.3,
                                            use_qk_l2norm_in_kernel=True)
        results.append((out, *torch.autograd.grad(out, inputs, upstream)))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-12, atol=1e-12)  # other batch shapes: rounding
    for a, b in zip(results[0][1:], results[1][1:]):
        assert torch.equal(a, b)  # the backward is the torch path's on the same inputs


def test_conv_fla_path_with_torch_in_place_of_fla_equals_the_torch_path(fake_fla, monkeypatch):
    cu, cu_pad, t = _batch((70, 3, 64, 1), (72, 3, 64, 9))  # the convolution's chunk is 64
    x, weight, bias = (torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((t, 6), (6, 4), (6,)))
    results = []
    for fla in (True, False):
        if not fla:
            monkeypatch.setattr(deltanet_cuda, "fla_takes", lambda *tensors, **kw: False)
        out = causal_conv1d_packed(x, weight, bias, cu, cu_seqlens_padded=cu_pad)
        results.append((out, *torch.autograd.grad(out.square().sum(), (x, weight, bias))))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_fla_path_negative_control_a_boundary_ignored(fake_fla, monkeypatch):
    """A fake fla that runs the whole aligned buffer as one sequence differs from the torch path: the comparison
    above can fail."""
    cu, cu_pad, t = _batch()
    inputs = [x.detach() for x in _inputs(t)]

    def one_sequence(q, k, v, g, beta, *, scale, use_qk_l2norm_in_kernel, cu_seqlens, chunk_indices, chunk_size):
        monkeypatch.setattr(deltanet_cuda, "fla_takes", lambda *tensors, **kw: False)
        o = chunk_gated_delta_rule_packed(q[0], k[0], v[0], g[0], beta[0], cu_seqlens[[0, -1]], chunk_size,
                                          scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return o[None], None

    monkeypatch.setattr(deltanet_cuda, "_fla", lambda: (one_sequence, None))
    leaky = chunk_gated_delta_rule_packed(*inputs, cu, 4, cu_seqlens_padded=cu_pad)
    expected = chunk_gated_delta_rule_packed(*inputs, cu, 4, cu_seqlens_padded=cu_pad)  # fla_takes is False now
    first = cu_pad[:-1][torch.tensor(LENGTHS) > 0]
    torch.testing.assert_close(leaky[first[0]], expected[first[0]])  # the first sequence has nothing before it
    assert not torch.allclose(leaky[first[1:]], expected[first[1:]])  # the others start from a neighbour's state


def test_switch_and_inputs_choose_the_torch_path(monkeypatch):
    """On the CPU, in float64, or with ``PACKFWD_DELTANET=torch``, :func:`fla_takes` says no (whether fla is
    installed or not)."""
    x = torch.zeros(2, 1, 4)
    assert not deltanet_cuda.fla_takes(x, x, x, x[..., 0], x[..., 0])
    assert not deltanet_cuda.fla_takes(x, op="conv")
    if torch.cuda.is_available():
        y = x.cuda()
        assert not deltanet_cuda.fla_takes(y.double(), y.double(), y.double(), y[..., 0], y[..., 0])
        assert not deltanet_cuda.fla_takes(y, y, y, y[..., 0], y[..., 0], chunk_size=8)
    monkeypatch.setenv(deltanet_cuda.SWITCH, "torch")
    monkeypatch.setattr(deltanet_cuda, "_fla", lambda: ("rule", "conv"))
    assert not deltanet_cuda.fla_takes(x, op="conv")


def _chunk_function(q, k, w, c, u, state, scale, r):
    """A chunk's outputs and end state from its start state, in plain torch (the function whose vector-Jacobian
    product :func:`chunk_local_grads` computes): ``[nt, chunk, heads, d]`` blocks, key heads repeated ``r`` times."""
    q, k = (x.repeat_interleave(r, 2).transpose(1, 2) for x in (q, k))  # [nt, hv, chunk, dk]
    w, u, c = w.transpose(1, 2), u.transpose(1, 2), c.transpose(1, 2)
    chunk = q.shape[2]
    v_new = u - w @ state
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~torch.ones(chunk, chunk, dtype=torch.bool).tril(),
                                                          float("-inf")).exp()
    o = scale * (c.exp()[..., None] * q) @ state + scale * ((q @ k.transpose(-1, -2)) * decay) @ v_new
    end = c[..., -1:].exp()[..., None] * state + ((c[..., -1:] - c).exp()[..., None] * k).transpose(-1, -2) @ v_new
    return o, end, v_new


def test_chunk_local_grads_equal_autograd_of_the_chunk():
    """:func:`chunk_local_grads` (the step packfwd computes in place of fla's ``chunk_bwd_dqkwg``) equals autograd of
    one chunk's function in float64: dq, dk (summed over a key head's value heads), dw and the decay's gradient."""
    gen = torch.Generator().manual_seed(5)
    nt, chunk, hk, r, dk, dv, scale = 3, 4, 2, 2, 5, 3, 0.7
    hv = hk * r
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, w, u = rand(nt, chunk, hk, dk), rand(nt, chunk, hk, dk), rand(nt, chunk, hv, dk), rand(nt, chunk, hv, dv)
    c = (-torch.rand(nt, chunk, hv, generator=gen, dtype=torch.float64)).cumsum(1)  # log decay from the start
    state, d_o, d_end = rand(nt, hv, dk, dv), rand(nt, hv, chunk, dv), rand(nt, hv, dk, dv)
    leaves = [x.requires_grad_() for x in (q, k, w, c, u)]
    o, end, v_new = _chunk_function(*leaves, state, scale, r)
    dq, dk_, dw, dc, du = torch.autograd.grad((o * d_o).sum() + (end * d_end).sum(), leaves)
    t = nt * chunk
    flat = lambda x: x.detach().reshape(1, t, *x.shape[2:])  # noqa: E731
    got = deltanet_cuda.chunk_local_grads(
        flat(q), flat(k), flat(v_new.transpose(1, 2)), flat(w), flat(c) / torch.log(torch.tensor(2.0, dtype=c.dtype)),
        state[None], d_end[None], flat(d_o.transpose(1, 2)), flat(du), scale, chunk)
    for name, a, b in zip(("dq", "dk", "dw", "dg"), got, (dq, dk_, dw, dc)):
        torch.testing.assert_close(a, flat(b), rtol=1e-10, atol=1e-10, msg=name)
