"""The fused Triton RoPE (``packfwd.ops.rope``) against today's torch rotation, Megatron-Core's own and float64 math.

Strategy: the kernel claims the bits of Megatron-Core's arithmetic (``x * cos + rotate_half(x) * sin`` in the
input's dtype) and of autograd through it, so the main oracle is :func:`packfwd.models.mixers.rope.apply_rope` (what
packfwd's models run unfused) compared with ``torch.equal``, outputs and gradients; Megatron-Core's
``_apply_rotary_pos_emb_bshd`` (given the angles) is a second, independent one; float64 math on the same rounded
inputs bounds the error of both.  Cases: fp32 / bf16 / fp16, GQA (4 query heads, 2 key-value heads), full and
partial rotary (channels past ``d_rot`` pass through), halves and interleaved pairs, q and k as strided views out
of one fused QKV output and with a non-unit channel stride, heads split over several programs, no tokens, the
same bits twice, refused arguments; and ``PackedRope(fused=True)`` against the unfused ``PackedRope``.

Runs on a CUDA GPU, or on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``; see ``_kernel_device``) at tiny
sizes.  Unlike the other kernels', these comparisons are bitwise in the interpreter too: the kernel rounds to
bf16 with integer arithmetic, not with the interpreter's truncating cast.

    TRITON_INTERPRET=1 PYTHONPATH=. python -m pytest -q tests/gpu/test_rope_kernel.py
"""

import pytest
import torch

from packfwd.ops import rope as K

from ._kernel_device import DEVICE, gpu_only, needs_kernels

pytestmark = [needs_kernels]
triton = pytest.importorskip("triton")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STEP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # half an ulp, relative


def make(t, hq, hk, d, rot, dtype, seed=0, scale=3.0):
    """q, k as views of one fused ``[t, (hq + 2 hk) d]`` QKV output (row stride wider than the head block),
    per-token angles ``[t, rot]`` laid out as Megatron's table (halves repeated), and upstream gradients."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (hq + 2 * hk) * d, generator=g) * scale).to(dtype).to(DEVICE)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hk) * d].view(t, hk, d)
    freqs = torch.rand(t, rot // 2, generator=g) * 40
    angles = torch.cat((freqs, freqs), dim=-1).to(DEVICE)
    gq = torch.randn(t, hq, d, generator=g).to(dtype).to(DEVICE)
    gk = torch.randn(t, hk, d, generator=g).to(dtype).to(DEVICE)
    return q, k, angles, gq, gk


def interleave(angles):
    """The interleaved table of the same frequencies: pairs (2i, 2i+1) share an angle."""
    half = angles.shape[-1] // 2
    return angles[:, :half].repeat_interleave(2, dim=-1)


def cos_sin(angles, dtype):
    return angles.cos().to(dtype), angles.sin().to(dtype)


def fused(q, k, cos, sin, gq, gk, interleaved, kernel=True, paired=False):
    """Outputs and gradients of the kernels (``kernel=False``: of ``rope``'s torch path)."""
    q, k = q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)
    yq, yk = K.rope(q, k, cos, sin, interleaved, kernel=kernel, paired=paired)
    torch.autograd.backward([yq, yk], [gq, gk])
    return yq.detach(), yk.detach(), q.grad, k.grad


def unfused(q, k, cos, sin, gq, gk, interleaved, rotate=None):
    """Outputs and gradients of a torch rotation ``rotate(t, cos [t, 1, d_rot], sin)`` (default: apply_rope)."""
    from packfwd.models.mixers.rope import apply_rope

    rotate = rotate or (lambda t, c, s: apply_rope(t, c, s, interleaved))
    q, k = q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)
    yq, yk = rotate(q, cos[:, None], sin[:, None]), rotate(k, cos[:, None], sin[:, None])
    torch.autograd.backward([yq, yk], [gq, gk])
    return yq.detach(), yk.detach(), q.grad, k.grad


def equal(got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == b.dtype, (i, a.shape, b.shape, a.dtype, b.dtype)
        assert torch.equal(a, b), (i, (a.double() - b.double()).abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("rot", [16, 6], ids=["full", "partial"])
def test_bitwise_apply_rope(dtype, interleaved, rot):
    """Outputs and the gradients of q and k are ``apply_rope``'s and its autograd's, bit for bit."""
    q, k, angles, gq, gk = make(11, 4, 2, 16, rot, dtype)
    cos, sin = cos_sin(interleave(angles) if interleaved else angles, dtype)
    got = fused(q, k, cos, sin, gq, gk, interleaved)
    equal(got, unfused(q, k, cos, sin, gq, gk, interleaved))
    assert all(t.is_contiguous() for t in got)
    assert torch.equal(got[0][..., rot:], q[..., rot:]) and torch.equal(got[2][..., rot:], gq[..., rot:])


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_any_table(interleaved):
    """cos / sin whose two channels of a pair differ (no RoPE table does that): still apply_rope's bits, so each
    channel reads its own entry (the backward the other channel's sine)."""
    q, k, _, gq, gk = make(6, 4, 2, 16, 10, torch.bfloat16, seed=10)
    cos, sin = cos_sin(torch.rand(6, 10, generator=torch.Generator().manual_seed(0)).to(DEVICE) * 40, torch.bfloat16)
    equal(fused(q, k, cos, sin, gq, gk, interleaved), unfused(q, k, cos, sin, gq, gk, interleaved))


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_paired_table(interleaved):
    """cos / sin given per pair of channels (``paired``: ``[t, d_rot / 2]``, partial rotary here): the bits of the
    full table of repeated entries (``full_table``), through the kernels and through the torch path."""
    q, k, angles, gq, gk = make(9, 4, 2, 16, 12, torch.bfloat16, seed=11)
    cos, sin = cos_sin(angles[:, :6], torch.bfloat16)
    full = (K.full_table(cos, interleaved), K.full_table(sin, interleaved))
    want = unfused(q, k, *full, gq, gk, interleaved)
    equal(fused(q, k, *full, gq, gk, interleaved), want)
    equal(fused(q, k, cos, sin, gq, gk, interleaved, paired=True), want)
    equal(fused(q, k, cos, sin, gq, gk, interleaved, kernel=False, paired=True), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_bitwise_megatron(dtype, interleaved):
    """Megatron-Core's own rotation, given the float32 angles (it takes their cos / sin in the input's dtype)."""
    rope_utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")
    megatron = getattr(rope_utils, "_apply_rotary_pos_emb_bshd", None)
    if megatron is None:
        pytest.skip("this Megatron-Core has no _apply_rotary_pos_emb_bshd")
    q, k, angles, gq, gk = make(9, 4, 2, 16, 12, dtype, seed=1)
    angles = interleave(angles) if interleaved else angles
    cos, sin = cos_sin(angles, dtype)

    def rotate(t, c, s):  # Megatron computes cos / sin of the angles itself; [s, b, h, d] with b = 1
        return megatron(t[:, None], angles[:, None, None], rotary_interleaved=interleaved)[:, 0]

    equal(fused(q, k, cos, sin, gq, gk, interleaved), unfused(q, k, cos, sin, gq, gk, interleaved, rotate))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_against_float64(dtype, interleaved):
    """Float64 rotation of the same rounded q, k, cos, sin (and its exact transpose for the gradients): each
    entry within 3 half-ulps of the larger term (two product roundings and the sum's)."""
    q, k, angles, gq, gk = make(13, 4, 2, 16, 12, dtype, seed=2)
    cos, sin = cos_sin(interleave(angles) if interleaved else angles, dtype)
    got = fused(q, k, cos, sin, gq, gk, interleaved)
    c64, s64 = cos.double()[:, None], sin.double()[:, None]
    want = unfused(q.double(), k.double(), c64.squeeze(1), s64.squeeze(1), gq.double(), gk.double(), interleaved,
                   rotate=lambda t, c, s: K.reference(t, c, s, interleaved))
    for a, b, t in zip(got, want, (q, k, gq, gk)):
        bound = 3 * STEP[dtype] * t.double().abs().amax(-1, keepdim=True) * 2 + 1e-300
        assert bool(((a.double() - b).abs() <= bound).all()), ((a.double() - b).abs() / bound).max().item()


def test_gqa_and_heads_over_programs(monkeypatch):
    """8 query heads over programs of 2 heads (the last block of key heads partly masked): same bits as one block."""
    q, k, angles, gq, gk = make(7, 8, 3, 16, 16, torch.bfloat16, seed=3)
    cos, sin = cos_sin(angles, torch.bfloat16)
    whole = fused(q, k, cos, sin, gq, gk, False)
    monkeypatch.setitem(K.CONFIG, "pairs", 16)  # 16 pairs per program: 2 heads of 8 pairs
    equal(fused(q, k, cos, sin, gq, gk, False), whole)
    equal(whole, unfused(q, k, cos, sin, gq, gk, False))


def test_strided_channels():
    """q with a channel stride of 2 (every other column of a wider buffer) and a transposed-heads k are read in
    place: the contiguous copies' bits; the inputs are never written."""
    q, k, angles, gq, gk = make(5, 4, 2, 16, 16, torch.float32, seed=4)
    cos, sin = cos_sin(angles, torch.float32)
    want = fused(q.contiguous(), k.contiguous(), cos, sin, gq, gk, False)
    wide = torch.zeros(5, 4, 32, device=DEVICE)
    wide[..., ::2] = q
    k_t = k.transpose(0, 1).contiguous().transpose(0, 1)  # [t, hk, d] with stride(0) = d
    before = wide.clone()
    got = fused(wide[..., ::2], k_t, cos, sin, gq, gk, False)
    equal(got, want)
    assert torch.equal(wide, before)


def test_bitwise_twice():
    q, k, angles, gq, gk = make(37, 4, 2, 16, 16, torch.bfloat16, seed=5)
    cos, sin = cos_sin(angles, torch.bfloat16)
    equal(fused(q, k, cos, sin, gq, gk, False), fused(q, k, cos, sin, gq, gk, False))


def test_one_gradient_only():
    """A loss of q alone: k's gradient is None through the Function, and q's is still apply_rope's."""
    q, k, angles, gq, _ = make(5, 4, 2, 16, 16, torch.float32, seed=6)
    cos, sin = cos_sin(angles, torch.float32)
    qa, ka = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    K.rope(qa, ka, cos, sin, kernel=True)[0].backward(gq)
    qb = q.clone().requires_grad_(True)
    K.reference(qb, cos[:, None], sin[:, None]).backward(gq)
    assert ka.grad is None and torch.equal(qa.grad, qb.grad)


def test_no_tokens():
    q, k = torch.zeros(0, 4, 16, device=DEVICE), torch.zeros(0, 2, 16, device=DEVICE)
    cos = torch.zeros(0, 16, device=DEVICE)
    yq, yk = K.rope(q, k, cos, cos, kernel=True)
    assert yq.shape == (0, 4, 16) and yk.shape == (0, 2, 16)


def test_refused():
    q, k, cos = torch.zeros(3, 4, 8, device=DEVICE), torch.zeros(3, 2, 8, device=DEVICE), torch.zeros(3, 8,
                                                                                                      device=DEVICE)
    with pytest.raises(ValueError, match=r"\[t, d_rot\]"):
        K.rope(q, k, cos[:, :5], cos[:, :5])  # odd d_rot
    with pytest.raises(ValueError, match=r"\[t, d_rot\]"):
        K.rope(q, k, torch.zeros(3, 10, device=DEVICE), torch.zeros(3, 10, device=DEVICE))  # d_rot > d
    with pytest.raises(ValueError, match=r"\[t, d_rot\]"):
        K.rope(q, k, cos[:2], cos[:2])  # not one row per token
    with pytest.raises(ValueError, match=r"\[t, d_rot / 2\]"):
        K.rope(q, k, cos, cos, paired=True)  # 8 pairs: d_rot 16 > d
    with pytest.raises(ValueError, match=r"\[t, hq, d\]"):
        K.rope(q, k[:2], cos, cos)
    with pytest.raises(TypeError, match="floating-point"):
        K.rope(q, k.int(), cos, cos)
    with pytest.raises(TypeError, match="share one dtype"):
        K.rotate(q, cos.double(), cos.double())


def test_dispatch():
    """``rope`` takes the kernels exactly where ``supported``: CUDA, one dtype, cos / sin without gradients;
    elsewhere the torch reference, which gives a gradient to a cos that needs one."""
    q, k, angles, gq, gk = make(5, 4, 2, 16, 16, torch.float32, seed=7)
    cos, sin = cos_sin(angles, torch.float32)
    yq, _ = K.rope(q.clone().requires_grad_(True), k, cos, sin)
    if DEVICE == "cuda":
        assert yq.grad_fn.name() == "RopeKernelBackward"
        assert not K.supported(q, k.half(), cos, sin)
    else:
        assert not K.supported(q, k, cos, sin) and yq.grad_fn.name() == "CatBackward0"
    c = cos.clone().requires_grad_(True)
    assert not K.supported(q, k, c, sin)
    K.rope(q, k, c, sin)[0].sum().backward()
    assert c.grad is not None


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_packed_rope_fused(monkeypatch, interleaved):
    """``PackedRope(fused=True)`` takes the kernels where they take the tensors (on the CPU: made to here) and
    gives the unfused ``PackedRope``'s bits, gradients included; partial rotary (``rotary_percent=0.5``)."""
    from packfwd.models.mixers.rope import PackedRope, PackedRotaryEmbedding

    rotary = PackedRotaryEmbedding(kv_channels=16, rotary_percent=0.5, rotary_interleaved=interleaved,
                                   use_cpu_initialization=True).to(DEVICE)
    q, k, _, gq, gk = make(12, 4, 2, 16, 8, torch.bfloat16, seed=8)
    cu = torch.tensor([0, 5, 12], device=DEVICE)
    calls = []
    monkeypatch.setattr(K, "supported", lambda *ts: calls.append(1) or True)

    def run(rope):
        qa, ka = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        yq, yk = rope(qa, ka, cu)
        torch.autograd.backward([yq, yk], [gq, gk])
        return yq.detach(), yk.detach(), qa.grad, ka.grad

    got = run(PackedRope(rotary, fused=True))
    assert calls == [1]
    equal(got, run(PackedRope(rotary)))
    assert calls == [1]  # the unfused one never asks


@gpu_only
def test_step_shape_bitwise():
    """The 1B Llama step's shape (16 query / 8 key-value heads of 128, 4096 tokens), bf16: apply_rope's bits."""
    q, k, angles, gq, gk = make(4096, 16, 8, 128, 128, torch.bfloat16, seed=9)
    cos, sin = cos_sin(angles, torch.bfloat16)
    equal(fused(q, k, cos, sin, gq, gk, False), unfused(q, k, cos, sin, gq, gk, False))
