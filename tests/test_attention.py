"""packfwd.models.mixers.varlen and packfwd.models.mixers.attention: the varlen backends, the automatic choice among them, and
the Megatron-facing CoreAttention.

Strategy: every result is checked against a float64 loop over sequences and heads that builds each sequence's
causal mask with ``torch.tril`` (bottom-right aligned, as flash-attn defines it) and applies a plain softmax;
rows with no visible key are zero.  The CUDA backends are compared with the reference on the GPU machine by
tests/gpu/check_attention_backends.py; here the automatic choice is checked for a CUDA device with its kernels
stubbed in, so it runs on the CPU.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from packfwd.models.mixers import varlen
from packfwd.models.mixers.attention import CoreAttention
from packfwd.models.mixers.varlen import BACKENDS, available_backends, varlen_attention, varlen_attention_reference


def loop_attention(q, k, v, lens_q, lens_k, causal, scale=None):
    """float64, one (sequence, head) at a time."""
    h, hk = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros(q.shape[0], h, v.shape[-1], dtype=torch.float64)
    oq = ok = 0
    for lq, lk in zip(lens_q, lens_k):
        for head in range(h):
            kv_head = head // (h // hk)
            qi = q[oq : oq + lq, head].double()
            ki = k[ok : ok + lk, kv_head].double()
            vi = v[ok : ok + lk, kv_head].double()
            scores = qi @ ki.T * scale
            allowed = torch.ones(lq, lk, dtype=torch.bool)
            if causal:
                allowed = allowed.tril(diagonal=lk - lq)
            scores = scores.masked_fill(~allowed, -math.inf)
            for a in range(lq):
                if allowed[a].any():
                    out[oq + a, head] = torch.softmax(scores[a], 0) @ vi
        oq, ok = oq + lq, ok + lk
    return out


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


CASES = {
    "ragged-gqa": ([5, 1, 7, 3], [5, 1, 7, 3], 4, 2),
    "mha": ([4, 6], [4, 6], 2, 2),
    "mqa-with-empty": ([3, 0, 5], [3, 0, 5], 4, 1),
    "q-shorter-than-k": ([2, 3], [5, 3], 2, 1),  # bottom-right causal alignment
    "q-longer-than-k": ([4, 2], [2, 2], 2, 2),  # the first queries of sequence 0 see no key -> zeros
}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_matches_loop(case, causal):
    lens_q, lens_k, h, hk = CASES[case]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lens_q), h, 8, generator=g)
    k = torch.randn(sum(lens_k), hk, 8, generator=g)
    v = torch.randn(sum(lens_k), hk, 8, generator=g)
    got = varlen_attention_reference(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), causal)
    want = loop_attention(q, k, v, lens_q, lens_k, causal)
    assert got.dtype == q.dtype
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)


def test_reference_gradients_match_loop():
    lens, h, hk = [3, 6, 1], 4, 2
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(10, n, 8, generator=g, dtype=torch.float64, requires_grad=True) for n in (h, hk, hk))
    w = torch.randn(10, h, 8, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((varlen_attention_reference(q, k, v, cu(lens), cu(lens), 6, 6, True) * w).sum(),
                              (q, k, v))
    want = torch.autograd.grad((loop_attention(q, k, v, lens, lens, True) * w).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_reference_scale_half_inputs_and_tail_tokens():
    lens = [4, 3]
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(9, 2, 8, generator=g) for _ in range(3))  # 2 tokens past cu_seqlens[-1]
    got = varlen_attention_reference(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu(lens), cu(lens), 4, 4, True, 0.3)
    assert got.dtype == torch.bfloat16
    want = loop_attention(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), lens, lens, True, 0.3)
    torch.testing.assert_close(got[:7].double(), want[:7], atol=2e-2, rtol=2e-2)
    assert torch.equal(got[7:], torch.zeros_like(got[7:]))


def test_dispatch_on_cpu():
    assert available_backends("cpu") == ("reference",)
    assert set(available_backends("cuda")) <= set(BACKENDS)
    q = k = v = torch.randn(5, 2, 4)
    c = cu([2, 3])
    torch.testing.assert_close(varlen_attention(q, k, v, c, c, 3, 3, backend="reference"),
                               varlen_attention_reference(q, k, v, c, c, 3, 3))
    with pytest.raises(ValueError, match="not one of"):
        varlen_attention(q, k, v, c, c, 3, 3, backend="flash")
    with pytest.raises(ValueError, match="not usable"):
        varlen_attention(q, k, v, c, c, 3, 3, backend="torch_varlen")


def test_automatic_choice_on_cuda_warns_once_per_slow_dtype(monkeypatch, recwarn):
    """Selection only (no CUDA needed): a CUDA device whose varlen kernel is present (stubbed)."""
    monkeypatch.setattr(varlen, "_torch_varlen_func", lambda: object())
    monkeypatch.setattr(varlen, "_flash_attn_func", lambda: None)
    monkeypatch.setattr(varlen, "_WARNED_DTYPES", set())
    cuda = torch.device("cuda", 0)
    assert varlen._resolve(None, cuda, torch.bfloat16) == varlen._resolve(None, cuda, torch.float16) == "torch_varlen"
    assert not recwarn.list
    for _ in range(2):
        assert varlen._resolve(None, cuda, torch.float32) == "reference"
        assert varlen._resolve(None, cuda, torch.float64) == "reference"
    messages = [str(w.message) for w in recwarn.list]
    assert len(messages) == 2 and all(issubclass(w.category, UserWarning) for w in recwarn.list)
    for dtype, message in zip(("torch.float32", "torch.float64"), messages):
        assert dtype in message and "'torch_varlen'" in message and "bfloat16" in message
    assert varlen._resolve("reference", cuda, torch.float32) == "reference"  # chosen knowingly: no warning
    assert varlen._resolve(None, torch.device("cpu"), torch.float32) == "reference"  # nothing faster on the CPU
    assert len(recwarn.list) == 2


@pytest.mark.parametrize(
    "change, error",
    [
        (dict(q=torch.randn(5, 3, 4)), "divide"),
        (dict(k=torch.randn(5, 2, 6)), "head_dim"),
        (dict(v=torch.randn(4, 2, 4)), "same tokens"),
        (dict(q=torch.randn(5, 2)), "tokens, heads, head_dim"),
        (dict(cu_k=torch.tensor([0, 5])), "n\\+1"),
        (dict(cu_q=torch.tensor([0.0, 5.0])), "integer"),
    ],
)
def test_bad_inputs(change, error):
    base = dict(q=torch.randn(5, 2, 4), k=torch.randn(5, 2, 4), v=torch.randn(5, 2, 4), cu_q=cu([2, 3]),
                cu_k=cu([2, 3]))
    base.update(change)
    with pytest.raises(ValueError, match=error):
        varlen_attention(base["q"], base["k"], base["v"], base["cu_q"], base["cu_k"], 3, 3)


# ----------------------------------------------------------------------------------------------- CoreAttention


def core(**config):
    cfg = SimpleNamespace(attention_dropout=0.0, window_size=None, kv_channels=8)
    cfg.__dict__.update(config)
    return CoreAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                         softmax_scale=None, cp_comm_type=None, pg_collection=None, backend="reference")


def test_core_attention_thd_uses_padded_offsets():
    real, padded = [3, 2], [4, 4]  # each sequence padded at its tail
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(8, n, 8, generator=g) for n in (4, 2, 2))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu(real), cu_seqlens_kv=cu(real),
                             cu_seqlens_q_padded=cu(padded), cu_seqlens_kv_padded=cu(padded),
                             max_seqlen_q=4, max_seqlen_kv=4)
    out = core()(q, k, v, None, attn_mask_type=AttnMaskType.causal, attention_bias=None, packed_seq_params=params)
    assert out.shape == (8, 4 * 8)
    want = loop_attention(q, k, v, padded, padded, True).reshape(8, -1)
    torch.testing.assert_close(out.double(), want, atol=1e-6, rtol=1e-5)
    # Real tokens never see the tail padding: the same as attending over the unpadded sequences.
    keep = torch.tensor([0, 1, 2, 4, 5])
    alone = loop_attention(q[keep], k[keep], v[keep], real, real, True).reshape(5, -1)
    torch.testing.assert_close(out[keep].double(), alone, atol=1e-6, rtol=1e-5)
    # Megatron may also hand [t, 1, h, d].
    out4 = core()(q[:, None], k[:, None], v[:, None], None, packed_seq_params=params)
    torch.testing.assert_close(out4, out)


def test_core_attention_bshd_rows():
    s, b = 5, 3
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(s, b, n, 8, generator=g) for n in (4, 1, 1))
    out = core()(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    assert out.shape == (s, b, 32)
    for row in range(b):
        want = loop_attention(q[:, row], k[:, row], v[:, row], [s], [s], True).reshape(s, -1)
        torch.testing.assert_close(out[:, row].double(), want, atol=1e-6, rtol=1e-5)
    no_mask = core()(q, k, v, None, attn_mask_type=AttnMaskType.no_mask)
    want = loop_attention(q[:, 0], k[:, 0], v[:, 0], [s], [s], False).reshape(s, -1)
    torch.testing.assert_close(no_mask[:, 0].double(), want, atol=1e-6, rtol=1e-5)


def test_core_attention_refuses_what_it_cannot_do():
    q = torch.randn(4, 1, 2, 8)
    with pytest.raises(ValueError, match="attention_mask=None"):
        core()(q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention_bias"):
        core()(q, q, q, None, attention_bias=torch.zeros(1))
    with pytest.raises(ValueError, match="padding"):
        core()(q, q, q, None, attn_mask_type=AttnMaskType.padding)
    with pytest.raises(ValueError, match="dropout"):
        core(attention_dropout=0.1)
    with pytest.raises(ValueError, match="window_size"):  # a window is causal: (w, 0) (GPT-OSS: test_gpt_oss.py)
        core(window_size=(4, 2))


def test_cudnn_backend_is_named_only_and_keeps_flash_semantics(monkeypatch):
    """Selection and argument mapping of the ``cudnn`` backend (no CUDA needed: cuDNN's op stubbed by the reference
    with the diagonal it is asked for).  The automatic choice never takes it; fp32 is refused by name; causal
    self-attention asks for the top-left diagonal, other offsets (context parallelism's chunks) for the bottom-right
    one, flash-attn's; ``max_seqlen`` rounded up to a multiple of 64 (one cached graph for similar batches)."""
    calls = []

    def fake_cudnn(q, k, v, *, scale, is_causal, causal_bottom_right, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                   max_seqlen_kv, return_lse):
        calls.append(dict(bottom_right=causal_bottom_right, max_q=max_seqlen_q, max_k=max_seqlen_kv,
                          lse=return_lse, dtype=cu_seqlens_q.dtype))
        if is_causal and not causal_bottom_right:
            assert torch.equal(cu_seqlens_q, cu_seqlens_kv), "top-left causal asked for unequal sequences"
        out = varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                                         is_causal, scale)
        return out, None

    monkeypatch.setattr(varlen, "_cudnn_func", lambda: fake_cudnn)
    monkeypatch.setattr(varlen, "_torch_varlen_func", lambda: object())
    monkeypatch.setattr(varlen, "_flash_attn_func", lambda: None)
    monkeypatch.setattr(varlen, "_flex_func", lambda: None)
    monkeypatch.setattr(varlen, "available_backends",
                        lambda device="cpu", lookup=varlen.available_backends: lookup("cuda"))
    cuda = torch.device("cuda", 0)
    assert varlen.available_backends(cuda) == ("torch_varlen", "cudnn", "reference")
    assert varlen._resolve(None, cuda, torch.bfloat16) == "torch_varlen"
    with pytest.raises(TypeError, match="backend='cudnn' takes float16/bfloat16"):
        varlen._resolve("cudnn", cuda, torch.float32)

    g = torch.Generator().manual_seed(3)
    lens_q, lens_k = [3, 1, 5], [4, 6, 5]
    q = torch.randn(sum(lens_q), 4, 8, generator=g).bfloat16()
    k, v = (torch.randn(sum(lens_k), 2, 8, generator=g).bfloat16() for _ in range(2))
    c = cu(lens_q)
    got = varlen_attention(q, q[:, :2], q[:, 2:], c, c, 5, 5, True, 0.5, backend="cudnn")
    torch.testing.assert_close(got, varlen_attention_reference(q, q[:, :2], q[:, 2:], c, c, 5, 5, True, 0.5))
    assert calls[-1] == dict(bottom_right=False, max_q=64, max_k=64, lse=True, dtype=torch.int32)
    got = varlen_attention(q, k, v, c, cu(lens_k), 5, 130, True, None, backend="cudnn")
    want = loop_attention(q.float(), k.float(), v.float(), lens_q, lens_k, True, 8**-0.5)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    assert calls[-1] == dict(bottom_right=True, max_q=64, max_k=192, lse=True, dtype=torch.int32)
