"""Gated DeltaNet over packed sequences (``packfwd.models.mixers.deltanet``) against transformers' own torch path.

Strategy: transformers is the oracle, run on each sequence alone (no packing, so nothing to leak); packfwd runs the
whole ragged batch packed, and every sequence's rows must equal its lone run.  Lengths cover 1, shorter than the
convolution, below, at and above the chunk size; layouts cover THD and THD aligned (``seq_align=8``: pads between
sequences), packed and unpacked with ``packfwd.plan_thd`` / ``to_thd`` / ``from_thd``.  Negative controls show the
checks can fail: a convolution or a state that runs across the boundary differs at the next sequence's first tokens.
Also: Qwen3.5's layer (flat projections), gradients, batch invariance bit for bit, and a fullgraph compile (no host
sync once ``max_seqlen`` is given).

transformers computes the delta rule, the gated norm and the decay in float32 whatever the input dtype.  To compare
in float64, ``tests.oracles.hf_float64_module`` loads a copy of transformers' ``modeling_qwen3_next`` with those
upcasts lifted to float64 (``torch.float32`` -> ``torch.float64``, ``.float()`` -> ``.double()``, the router's softmax
too; the RoPE angles stay float32); one test runs the
unmodified module in float32, at float32's tolerance, so the lift hides nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import packfwd
from packfwd.models.mixers.deltanet import DeltaNetShape, gated_deltanet_packed, gated_rms_norm
from packfwd.models.mixers.deltanet_ops import causal_conv1d_packed, chunk_gated_delta_rule_packed, sequence_rows

from .oracles import hf_float64_module

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


HF64 = hf_float64_module(hf.__name__)  # the float32 upcasts lifted (the module docstring)


@dataclass(frozen=True)
class Case:
    name: str
    lengths: tuple[int, ...]
    chunk: int = 8


CASES = [
    Case("single token and shorter than the kernel", (1, 2, 3, 5)),
    Case("below, at and above the chunk", (7, 8, 9, 20), chunk=8),
    Case("several chunks of 64", (1, 64, 130, 17), chunk=64),
]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _per_seq(lengths, fn, *xs):
    """``fn`` on each sequence alone (a batch of one), rows concatenated back."""
    cu = _cu(lengths).tolist()
    return torch.cat([fn(*(x[cu[i]:cu[i + 1]] for x in xs)) for i in range(len(lengths))])


# --- the convolution ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c.name)
def test_conv_equals_transformers_per_sequence(case):
    torch.manual_seed(0)
    t, c, w = sum(case.lengths), 6, 4
    x, weight, bias = (torch.randn(*shape, dtype=torch.float64) for shape in ((t, c), (c, w), (c,)))
    got = causal_conv1d_packed(x, weight, bias, _cu(case.lengths))
    want = _per_seq(case.lengths, lambda xi: hf.causal_conv1d_fn(xi.T[None], weight, bias, "silu")[0].T, x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-14)
    # negative control: the same convolution without the restart reads the previous sequence's last tokens
    plain = hf.causal_conv1d_fn(x.T[None], weight, bias, "silu")[0].T
    first = _cu(case.lengths)[1:-1]
    assert (plain[first] - want[first]).abs().amax() > 1e-3


def test_conv_aligned_never_reads_pads_or_neighbours():
    torch.manual_seed(1)
    cu, cu_pad = torch.tensor([0, 3, 4, 9]), torch.tensor([0, 8, 16, 24])
    x = torch.randn(24, 5, dtype=torch.float64)
    weight = torch.randn(5, 4, dtype=torch.float64)
    _, _, real = sequence_rows(cu, 24, cu_pad)
    got = causal_conv1d_packed(x, weight, None, cu, cu_seqlens_padded=cu_pad)
    noisy = causal_conv1d_packed(torch.where(real[:, None], x, 1e3), weight, None, cu, cu_seqlens_padded=cu_pad)
    torch.testing.assert_close(noisy, got, rtol=0, atol=0)  # pads changed, real rows did not
    assert not got[~real].any()


# --- the delta rule -------------------------------------------------------------------------------------------


def _qkvgb(t, hk, hv, dk, dv, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(t, hk, dk, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(t, hv, dv, generator=gen, dtype=dtype)
    g = -F.softplus(torch.randn(t, hv, generator=gen, dtype=dtype))
    beta = torch.rand(t, hv, generator=gen, dtype=dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("heads", [(2, 2), (1, 3)], ids=["mha", "gqa"])
def test_delta_rule_equals_transformers_per_sequence(case, heads):
    hk, hv = heads
    q, k, v, g, beta = _qkvgb(sum(case.lengths), hk, hv, 8, 4)
    got = chunk_gated_delta_rule_packed(q, k, v, g, beta, _cu(case.lengths), case.chunk, use_qk_l2norm_in_kernel=True)

    def alone(rule, **kw):
        return lambda *xs: rule(*(x[None] for x in xs), use_qk_l2norm_in_kernel=True, **kw)[0][0]

    want = _per_seq(case.lengths, alone(HF64.torch_chunk_gated_delta_rule, chunk_size=case.chunk), q, k, v, g, beta)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    if case.chunk == 8:  # transformers' token-by-token recurrence, the independent form
        rec = _per_seq(case.lengths, alone(HF64.torch_recurrent_gated_delta_rule), q, k, v, g, beta)
        torch.testing.assert_close(got, rec, rtol=1e-9, atol=1e-9)
    # negative control: one state across the whole buffer differs at the second sequence's first token
    carried = alone(HF64.torch_chunk_gated_delta_rule, chunk_size=case.chunk)(q, k, v, g, beta)
    second = case.lengths[0]
    assert (carried[second] - want[second]).abs().amax() > 1e-3


def test_delta_rule_unmodified_transformers_float32():
    """Equal key and value heads: transformers' torch function repeats grouped key heads itself only since 5.2x
    (the floor, 5.17, takes them repeated); the grouped case is checked in float64 above."""
    lengths = (3, 9, 16)
    q, k, v, g, beta = _qkvgb(sum(lengths), 2, 2, 8, 8, dtype=torch.float32)
    got = chunk_gated_delta_rule_packed(q, k, v, g, beta, _cu(lengths), 8, use_qk_l2norm_in_kernel=True)
    want = _per_seq(lengths, lambda *xs: hf.torch_chunk_gated_delta_rule(
        *(x[None] for x in xs), chunk_size=8, use_qk_l2norm_in_kernel=True)[0][0], q, k, v, g, beta)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_delta_rule_aligned_and_max_seqlen_bound():
    """Sequences at rows ``cu_seqlens_padded``, pads between them, a ``max_seqlen`` above the longest: the real rows
    are the unaligned result, pads come out zero and never change real rows."""
    lengths = (5, 1, 12)
    cu, cu_pad = _cu(lengths), torch.tensor([0, 8, 16, 32])
    dense = _qkvgb(sum(lengths), 1, 2, 4, 4)
    seq, pos, real = sequence_rows(cu, 32, cu_pad)
    src = (cu[seq] + pos).clamp(max=sum(lengths) - 1)
    aligned = [torch.where(real.view(-1, *[1] * (x.dim() - 1)), x[src], 7.0) for x in dense]  # pads hold junk
    aligned[3] = torch.where(real[:, None], aligned[3], -0.5)  # a junk decay that is still a decay
    got = chunk_gated_delta_rule_packed(*aligned, cu, 4, cu_seqlens_padded=cu_pad, max_seqlen=16)
    want = chunk_gated_delta_rule_packed(*dense, cu, 4)
    torch.testing.assert_close(got[real], want, rtol=0, atol=1e-12)
    assert not got[~real].any()


# --- the layer ------------------------------------------------------------------------------------------------


def _layer(hk=2, hv=4, seed=0):
    config = hf.Qwen3NextConfig(hidden_size=32, linear_num_key_heads=hk, linear_num_value_heads=hv,
                                linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                                num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(seed)
    layer = HF64.Qwen3NextGatedDeltaNet(config, 0).double()
    with torch.no_grad():
        layer.norm.weight.uniform_(0.5, 1.5)
        layer.dt_bias.normal_()
    return layer, config


def _batch(lengths, h=32, seed=0):
    """A right-padded ``[b, s, h]`` batch (pads hold junk) and its mask."""
    torch.manual_seed(seed)
    s = max(lengths)
    mask = torch.arange(s)[None] < torch.tensor(lengths)[:, None]
    x = torch.where(mask[..., None], torch.randn(len(lengths), s, h, dtype=torch.float64), 5.0)
    return x, mask


def _hf_alone(layer, x, mask):
    """transformers' layer on each sequence alone, as a ``[b, s, h]`` batch (zero at pads)."""
    out = torch.zeros_like(x)
    for i, n in enumerate(mask.sum(1).tolist()):
        out[i, :n] = layer(x[i : i + 1, :n])[0]
    return out


LAYER_CASES = [Case("ragged", (1, 3, 11, 20), chunk=8), Case("several chunks of 64", (70, 2, 140), chunk=64)]


@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("seq_align", [None, 8], ids=["thd", "thd-aligned"])
def test_layer_equals_transformers_per_sequence(case, seq_align):
    layer, config = _layer()
    x, mask = _batch(case.lengths)
    packed, info = packfwd.to_thd(x, mask, seq_align=seq_align)
    y = gated_deltanet_packed(packed, layer, config, info.cu_seqlens, cu_seqlens_padded=info.cu_seqlens_padded,
                              max_seqlen=info.max_seqlen, chunk_size=case.chunk)
    want = _hf_alone(layer, x, mask)
    torch.testing.assert_close(packfwd.from_thd(y, info), want, rtol=1e-10, atol=1e-10)
    # pads: junk in every pad row of the packed buffer changes no real token's output
    _, _, real = sequence_rows(info.cu_seqlens, packed.shape[0], info.cu_seqlens_padded)
    junk = gated_deltanet_packed(torch.where(real[:, None], packed, 3.0), layer, config, info.cu_seqlens,
                                 cu_seqlens_padded=info.cu_seqlens_padded, chunk_size=case.chunk)
    torch.testing.assert_close(junk, y, rtol=0, atol=0)
    if seq_align:
        assert (~real).any()  # the aligned case does hold pads between sequences


def test_layer_gqa_heads_and_dict_weights():
    layer, config = _layer(hk=1, hv=3, seed=3)
    x, mask = _batch((4, 9))
    packed, info = packfwd.to_thd(x, mask)
    weights = {name: p.detach() for name, p in layer.named_parameters()}
    y = gated_deltanet_packed(packed, weights, DeltaNetShape.from_hf(config), info.cu_seqlens, chunk_size=4)
    torch.testing.assert_close(packfwd.from_thd(y, info), _hf_alone(layer, x, mask), rtol=1e-10, atol=1e-10)


def test_layer_qwen3_5_flat_projections():
    """Qwen3.5's layer: the same operators, its q/k/v/z/b/a projections flat instead of grouped per key head."""
    q35 = hf_float64_module(pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5").__name__)
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                               num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(4)
    layer = q35.Qwen3_5GatedDeltaNet(config, 0).double()
    with torch.no_grad():
        layer.norm.weight.uniform_(0.5, 1.5)
        layer.dt_bias.normal_()
    x, mask = _batch((2, 13, 9), seed=4)
    packed, info = packfwd.to_thd(x, mask, seq_align=8)
    y = gated_deltanet_packed(packed, layer, config, info.cu_seqlens, cu_seqlens_padded=info.cu_seqlens_padded,
                              chunk_size=8)
    torch.testing.assert_close(packfwd.from_thd(y, info), _hf_alone(layer, x, mask), rtol=1e-10, atol=1e-10)


def test_batch_invariant_bitwise():
    """A sequence's rows do not depend on its neighbours, bit for bit (float32): its chunks start at its first token
    whatever else is packed, and pads past its end never reach it."""
    lengths = (37, 100, 5, 64)
    q, k, v, g, beta = _qkvgb(sum(lengths), 2, 4, 16, 16, dtype=torch.float32, seed=5)
    packed = chunk_gated_delta_rule_packed(q, k, v, g, beta, _cu(lengths), 64, use_qk_l2norm_in_kernel=True)
    rows = slice(37, 137)
    alone = chunk_gated_delta_rule_packed(q[rows], k[rows], v[rows], g[rows], beta[rows], torch.tensor([0, 100]), 64,
                                          use_qk_l2norm_in_kernel=True)
    assert torch.equal(packed[rows], alone)
    x, weight = torch.randn(sum(lengths), 6), torch.randn(6, 4)
    assert torch.equal(causal_conv1d_packed(x, weight, None, _cu(lengths))[rows],
                       causal_conv1d_packed(x[rows], weight, None, torch.tensor([0, 100])))


def test_layer_compiles_fullgraph():
    """With ``max_seqlen`` given the layer has no host sync: ``torch.compile(fullgraph=True)`` traces it forward and
    backward (aot_eager, as tests/test_compile_layer.py does) and equals eager."""
    layer, config = _layer(seed=6)
    layer = layer.float()
    lengths = (3, 10, 17)
    x = torch.randn(sum(lengths), 32)
    cu = _cu(lengths)

    def run(h):
        return gated_deltanet_packed(h, layer, config, cu, max_seqlen=17, chunk_size=8)

    torch._dynamo.reset()
    results = []
    for fn in (torch.compile(run, fullgraph=True, backend="aot_eager"), run):
        h = x.clone().requires_grad_()
        out = fn(h)
        out.square().sum().backward()
        results.append((out.detach(), h.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_layer_negative_control_one_sequence():
    """Packing the batch as one sequence (no restart) differs from transformers per sequence: the check can fail."""
    layer, config = _layer()
    x, mask = _batch((6, 6))
    packed, info = packfwd.to_thd(x, mask)
    y = gated_deltanet_packed(packed, layer, config, torch.tensor([0, 12]), chunk_size=8)
    assert (packfwd.from_thd(y, info) - _hf_alone(layer, x, mask))[1].abs().amax() > 1e-3


def test_layer_gradients_equal_per_sequence():
    layer, config = _layer(seed=1)
    x, mask = _batch((3, 10, 17), seed=1)
    packed, info = packfwd.to_thd(x, mask, seq_align=8)
    gen = torch.Generator().manual_seed(2)
    cotangent = torch.randn(x.shape, generator=gen, dtype=torch.float64) * mask[..., None]
    params = dict(layer.named_parameters())

    def grads(run):
        xs = x.clone().requires_grad_()
        loss = (run(xs) * cotangent).sum()
        return torch.autograd.grad(loss, [xs, *params.values()])

    def packed_run(xs):
        p, _ = packfwd.to_thd(xs, info)
        return packfwd.from_thd(gated_deltanet_packed(p, layer, config, info.cu_seqlens, chunk_size=8,
                                                      cu_seqlens_padded=info.cu_seqlens_padded), info)

    got, want = grads(packed_run), grads(lambda xs: _hf_alone(layer, xs, mask))
    for name, a, b in zip(["hidden", *params], got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")


def test_gated_rms_norm_equals_transformers():
    torch.manual_seed(0)
    norm = hf.Qwen3NextRMSNormGated(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, z = torch.randn(5, 3, 8), torch.randn(5, 3, 8)
    torch.testing.assert_close(gated_rms_norm(x, z, norm.weight), norm(x, z), rtol=0, atol=0)
    bf = torch.bfloat16
    torch.testing.assert_close(gated_rms_norm(x.to(bf), z.to(bf), norm.weight.to(bf)), norm.to(bf)(x.to(bf), z.to(bf)),
                               rtol=0, atol=0)


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="squeeze"):
        causal_conv1d_packed(torch.zeros(3, 2), torch.zeros(2, 1, 4), None, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="multiple of hk"):
        q = torch.zeros(3, 2, 4)
        chunk_gated_delta_rule_packed(q, q, torch.zeros(3, 3, 4), torch.zeros(3, 3), torch.zeros(3, 3),
                                      torch.tensor([0, 3]))
    with pytest.raises(KeyError, match="in_proj_qkvz"):
        gated_deltanet_packed(torch.zeros(3, 32), {}, _layer()[1], torch.tensor([0, 3]))
