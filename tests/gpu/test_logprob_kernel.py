"""The fused Triton log-prob / entropy kernels (``packfwd.ops.logprob``) against float64 math and against the torch
path of ``packfwd.logits``: values and gradients, bf16 / fp16 / fp32, ignored labels, per-token temperature,
vocab sizes that are not a multiple of the block (also under a tiny block, so every row spans many blocks),
``-inf`` logits, a near-certain label, non-contiguous rows; and (GPU) the dispatch of ``packfwd.logits``.

Runs on a CUDA GPU, or on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``; see ``_kernel_device``) at
smaller sizes.  ``packfwd.logits`` takes the kernels only for CUDA logits, so on the CPU the ``launches``
fixture lets it take them for CPU logits too.  What the interpreter cannot show: the GPU's own float math (it
computes ``exp`` / ``log`` with numpy, so the comparisons hold to the same tolerances, not bit for bit), the
dispatch on CUDA, and vocab sizes of 128k (GPU only).

    PYTHONPATH=. python -m pytest -q tests/gpu/test_logprob_kernel.py
"""

import pytest
import torch

from packfwd import logits as L
from packfwd.ops import logprob as K

from ._kernel_device import DEVICE, gpu_only, needs_kernels

pytestmark = [needs_kernels, pytest.mark.filterwarnings("ignore::RuntimeWarning")]  # numpy's log(0) in the interpreter
triton = pytest.importorskip("triton")

ON_GPU = DEVICE == "cuda"


@pytest.fixture
def launches(monkeypatch):
    """Counts the forward kernel's launches; on the CPU also lets ``packfwd.logits`` take the kernels."""
    calls = []

    def counted(*args, run=K.forward_stats):
        calls.append(args[0].shape)
        return run(*args)

    monkeypatch.setattr(K, "forward_stats", counted)
    if not ON_GPU:
        monkeypatch.setattr(L, "_use_kernel", lambda logits, group, inv_t: group is None and not inv_t.requires_grad
                            and logits.dtype in K.DTYPES and logits.shape[0] > 0)
    return calls


def padding(temperature):
    """The packed layout's padding slots, as ``make_forward`` marks them: where a tensor temperature holds 0."""
    return {"real_tokens": temperature != 0} if isinstance(temperature, torch.Tensor) else {}


def reference(logits, labels, temperature, g_lp, g_ent):
    """float64 log-probs, entropy and d(sum g_lp logp + g_ent ent)/dlogits by plain autograd."""
    x = logits.detach().double().requires_grad_(True)
    temp = temperature.double() if isinstance(temperature, torch.Tensor) else torch.tensor(float(temperature))
    temp = torch.where(temp > 0, temp, 1.0).to(x.device)
    lsm = torch.log_softmax(x / (temp[:, None] if temp.dim() else temp), dim=-1)
    valid = labels >= 0
    lp = torch.where(valid, lsm.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    p = lsm.exp()
    ent = -(p * torch.where(p > 0, lsm, 0.0)).sum(-1)  # 0 log 0 = 0, with a finite gradient
    (lp * g_lp.double() + ent * g_ent.double()).sum().backward()
    return lp.detach(), ent.detach(), x.grad


def make(t, v, dtype, seed, scale=3.0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = (torch.randn(t, v, generator=g, device=DEVICE) * scale).to(dtype)
    labels = torch.randint(0, v, (t,), generator=g, device=DEVICE)
    labels[::5] = -100
    temperature = torch.rand(t, generator=g, device=DEVICE) * 1.5 + 0.25
    temperature[3::11] = 0.0  # padding slots (real_tokens False): computed at 1, never checked
    g_lp, g_ent = torch.randn(t, generator=g, device=DEVICE), torch.randn(t, generator=g, device=DEVICE)
    return logits, labels, temperature, g_lp, g_ent


def tols(dtype):
    # the reference sees the same rounded logits, so only float32 arithmetic separates them; the gradient is
    # rounded to the logits' dtype on output
    return (2e-5, {torch.bfloat16: 1e-2, torch.float16: 2e-3}.get(dtype, 1e-5))


VOCABS = [1, 7, 4096, 5003, 131072 + 77] if ON_GPU else [1, 7, 300, 5003]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("v", VOCABS)
@pytest.mark.parametrize("temp_kind", ["float", "tensor", "one"] if ON_GPU else ["tensor"])
def test_kernel_against_float64(dtype, v, temp_kind, launches):
    t = (33 if v > 100000 else 97) if ON_GPU else 23
    logits, labels, temperature, g_lp, g_ent = make(t, v, dtype, seed=v + len(temp_kind))
    temperature = {"float": 0.7, "tensor": temperature, "one": 1.0}[temp_kind]
    x = logits.clone().requires_grad_(True)
    out = L.log_probs_and_entropy(x, labels, temperature=temperature, **padding(temperature))
    ((out["log_probs"] * g_lp).sum() + (out["entropy"] * g_ent).sum()).backward()
    assert launches
    lp, ent, grad = reference(logits, labels, temperature, g_lp, g_ent)
    val_tol, grad_tol = tols(dtype)
    assert out["log_probs"].dtype == torch.float32 and x.grad.dtype == dtype
    torch.testing.assert_close(out["log_probs"].double(), lp, rtol=1e-5, atol=val_tol * max(1, v ** 0.5 / 100))
    torch.testing.assert_close(out["entropy"].double(), ent, rtol=1e-5, atol=val_tol * max(1, v ** 0.5 / 100))
    assert (out["log_probs"][labels < 0] == 0).all()
    scale = grad.abs().max().item()
    err = (x.grad.double() - grad).abs().max().item()
    assert err <= grad_tol * scale + 1e-7, (err, scale)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_kernel_over_many_blocks(temperature, launches, monkeypatch):
    """A tiny block: every row is read in many blocks (the running max and sums rescaled at each)."""
    monkeypatch.setattr(K, "CONFIG", {"block": 16, "num_warps": 1})
    logits, labels, _, g_lp, g_ent = make(19, 203, torch.float32, seed=3)
    logits[:4] = torch.linspace(-20, 20, 203, device=DEVICE)  # the max grows at every block
    x = logits.clone().requires_grad_(True)
    out = L.log_probs_and_entropy(x, labels, temperature=temperature, **padding(temperature))
    ((out["log_probs"] * g_lp).sum() + (out["entropy"] * g_ent).sum()).backward()
    assert launches
    lp, ent, grad = reference(logits, labels, temperature, g_lp, g_ent)
    torch.testing.assert_close(out["log_probs"].double(), lp, rtol=1e-5, atol=3e-5)
    torch.testing.assert_close(out["entropy"].double(), ent, rtol=1e-5, atol=3e-5)
    assert (x.grad.double() - grad).abs().max() <= 1e-5 * grad.abs().max() + 1e-7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_logp_only_and_entropy_only(dtype, launches):
    logits, labels, temperature, g_lp, g_ent = make(64 if ON_GPU else 24, 5003, dtype, seed=11)
    zero = torch.zeros_like(g_lp)
    x = logits.clone().requires_grad_(True)
    (L.log_probs(x, labels, temperature=temperature, **padding(temperature)) * g_lp).sum().backward()
    lp, _, grad = reference(logits, labels, temperature, g_lp, zero)
    torch.testing.assert_close(L.log_probs(logits, labels, temperature=temperature, **padding(temperature)).double(), lp, rtol=1e-5, atol=3e-5)
    assert (x.grad.double() - grad).abs().max() <= tols(dtype)[1] * grad.abs().max() + 1e-7
    assert (x.grad[labels < 0] == 0).all()  # ignored labels send no gradient

    x = logits.clone().requires_grad_(True)
    (L.entropy(x, temperature=temperature, **padding(temperature)) * g_ent).sum().backward()
    _, ent, grad = reference(logits, labels, temperature, zero, g_ent)
    torch.testing.assert_close(L.entropy(logits, temperature=temperature, **padding(temperature)).double(), ent, rtol=1e-5, atol=3e-5)
    assert (x.grad.double() - grad).abs().max() <= tols(dtype)[1] * grad.abs().max() + 1e-7
    assert launches


def test_kernel_matches_torch_blocks_and_masked_logits():
    """Kernel path against the torch path of packfwd.logits, with -inf entries and a near-certain label."""
    logits, labels, temperature, g_lp, g_ent = make(80 if ON_GPU else 24, 6000, torch.float32, seed=5)
    logits[:, 100:3000] = -float("inf")
    labels = torch.where((labels >= 100) & (labels < 3000), labels + 2900, labels)  # labels on finite logits
    logits[1, labels[1].clamp(min=0)] = 80.0  # p -> 1 at the label: the expm1 path
    outs, grads = [], []
    for kernel in (True, False):
        x = logits.clone().requires_grad_(True)
        out = L._chunked(x, labels, temperature, None, 16, True, kernel=kernel, **padding(temperature))
        ((out["log_probs"] * g_lp).sum() + (out["entropy"] * g_ent).sum()).backward()
        outs.append(out)
        grads.append(x.grad)
    for k in ("log_probs", "entropy"):
        assert torch.isfinite(outs[0][k]).all()
        torch.testing.assert_close(outs[0][k], outs[1][k], rtol=1e-5, atol=2e-6)
    assert torch.isfinite(grads[0]).all() and (grads[0][:, 100:3000] == 0).all()
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)
    lp, ent, grad = reference(logits, labels, temperature, g_lp, g_ent)
    torch.testing.assert_close(outs[0]["log_probs"].double(), lp, rtol=1e-5, atol=2e-6)


def test_non_contiguous_rows(launches):
    logits, labels, temperature, g_lp, g_ent = make(40 if ON_GPU else 12, 2 * 3001, torch.bfloat16, seed=9)
    view = logits[:, ::2]  # stride 2 in the vocab
    lp, ent, _ = reference(view, labels.clamp(max=3000), temperature, g_lp, g_ent)
    out = L.log_probs_and_entropy(view, labels.clamp(max=3000), temperature=temperature, **padding(temperature))
    torch.testing.assert_close(out["log_probs"].double(), lp, rtol=1e-5, atol=3e-5)
    torch.testing.assert_close(out["entropy"].double(), ent, rtol=1e-5, atol=3e-5)
    wide = logits[:, :3001]  # row stride 6002, unit column stride: no copy
    lp, ent, _ = reference(wide, labels.clamp(max=3000), temperature, g_lp, g_ent)
    out = L.log_probs_and_entropy(wide, labels.clamp(max=3000), temperature=temperature, **padding(temperature))
    torch.testing.assert_close(out["log_probs"].double(), lp, rtol=1e-5, atol=3e-5)
    assert len(launches) == 2 and launches[1][1] == 3001


@gpu_only
def test_dispatch():
    logits, labels, temperature, *_ = make(8, 300, torch.bfloat16, seed=1)
    assert L._use_kernel(logits, None, temperature)
    assert not L._use_kernel(logits, None, temperature.requires_grad_(True))
    assert not L._use_kernel(logits.double(), None, temperature.detach())
    assert not L._use_kernel(logits.cpu(), None, temperature.cpu())
    # a temperature that requires grad takes the torch path and still gets its gradient
    temp = temperature.detach().clamp(min=0.5).requires_grad_(True)
    L.log_probs(logits.float(), labels, temperature=temp).sum().backward()
    assert temp.grad is not None and torch.isfinite(temp.grad).all()
