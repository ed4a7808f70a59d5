"""Tests for packfwd.logits: log-probs and entropy, chunked, fused with the output layer, and vocab-parallel.

Strategy: the oracle is plain float64 math, ``torch.log_softmax(logits.double() / T)`` gathered at the labels
and ``-(p * log p).sum()``, differentiated by autograd.  Inputs in bf16/fp16 are upcast exactly, so the only
allowed error is packfwd's float32 arithmetic (and, for gradients returned in bf16, one rounding to bf16).
``gradcheck`` in float64 checks the hand-written backward passes on their own.  The vocab-parallel path runs
on 2 real gloo processes, each holding half of the vocab, and must reproduce the single-process results and
gradients.  Memory bounds are checked structurally: what the autograd graph saves, and the size of every
tensor allocated during forward + backward (recorded with a TorchDispatchMode).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from packfwd.testing import run_local
from packfwd.logits import entropy, fused_log_probs_and_entropy, log_probs, log_probs_and_entropy

IGNORE = -100
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # on a GPU machine, CUDA is checked too


# ------------------------------------------------------------------------------------------------- oracles


def reference(logits: torch.Tensor, labels: torch.Tensor, temperature=1.0) -> dict[str, torch.Tensor]:
    """float64 log-probs (0 at negative labels) and entropies; differentiable w.r.t. its float64 inputs."""
    x = logits.double()
    t = temperature.double() if isinstance(temperature, torch.Tensor) else torch.tensor(float(temperature))
    t = t.reshape(-1, 1) if t.dim() == 1 else t
    lsm = torch.log_softmax(x / t, dim=-1)
    valid = labels >= 0
    picked = lsm.gather(1, torch.where(valid, labels, 0)[:, None])[:, 0]
    return {"log_probs": torch.where(valid, picked, 0.0), "entropy": -(lsm.exp() * lsm).sum(-1)}


def reference_grads(logits, labels, temperature, g_logp, g_ent):
    """Gradients of ``sum(g_logp * log_probs + g_ent * entropy)`` w.r.t. logits (and a tensor temperature)."""
    x = logits.detach().double().requires_grad_()
    temp = temperature.detach().double().requires_grad_() if isinstance(temperature, torch.Tensor) else temperature
    out = reference(x, labels, temp)
    loss = (out["log_probs"] * g_logp.double()).sum() + (out["entropy"] * g_ent.double()).sum()
    inputs = [x] + ([temp] if isinstance(temp, torch.Tensor) else [])
    return torch.autograd.grad(loss, inputs)


def make_case(t, v, dtype, *, scale=4.0, seed=0, ignore_every=5):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(t, v, generator=g, dtype=torch.float64) * scale).to(dtype)
    labels = torch.randint(0, v, (t,), generator=g)
    labels[::ignore_every] = IGNORE
    temperature = torch.rand(t, generator=g, dtype=torch.float64).mul(1.5).add(0.3).float()
    return logits, labels, temperature


# -------------------------------------------------------------------------------------------- value checks


@dataclass(frozen=True)
class Case:
    name: str
    t: int
    v: int
    dtype: torch.dtype
    chunk_size: int | None
    temperature: str  # "float", "one" (the float 1.0), "scalar" (0-d tensor) or "per_token"
    atol: float  # on values (float32 math on logits of magnitude ~15 and lse up to ~20)


CASES = [
    Case("fp32-chunks", 37, 101, torch.float32, 8, "float", 2e-5),
    Case("fp32-per-token", 37, 101, torch.float32, 5, "per_token", 2e-5),
    Case("bf16-default-chunk", 64, 1000, torch.bfloat16, None, "per_token", 3e-5),
    Case("bf16-uneven-chunks", 65, 300, torch.bfloat16, 16, "scalar", 3e-5),
    Case("fp16", 20, 64, torch.float16, 7, "per_token", 2e-5),
    Case("fp64", 20, 64, torch.float64, 6, "per_token", 1e-12),
    Case("single-token-big-chunk", 1, 50, torch.float32, 999, "float", 2e-5),
    Case("bf16-unit-temperature", 50, 257, torch.bfloat16, 9, "one", 3e-5),
]


def temperature_of(case: Case, per_token: torch.Tensor):
    return {"float": 0.7, "one": 1.0, "scalar": torch.tensor(1.3), "per_token": per_token}[case.temperature]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_values_match_float64(case, device):
    logits, labels, per_token = make_case(case.t, case.v, case.dtype)
    temp = temperature_of(case, per_token)
    ref = reference(logits, labels, temp)
    if device != "cpu":
        logits, labels = logits.to(device), labels.to(device)
        temp = temp.to(device) if isinstance(temp, torch.Tensor) else temp
    out = log_probs_and_entropy(logits, labels, temperature=temp, chunk_size=case.chunk_size)
    expected_dtype = torch.float64 if case.dtype == torch.float64 else torch.float32
    for key in ("log_probs", "entropy"):
        assert out[key].dtype == expected_dtype and out[key].shape == (case.t,)
        torch.testing.assert_close(out[key].cpu().double(), ref[key], atol=case.atol, rtol=0)
    alone_lp = log_probs(logits, labels, temperature=temp, chunk_size=case.chunk_size)
    alone_h = entropy(logits, temperature=temp, chunk_size=case.chunk_size)
    torch.testing.assert_close(alone_lp.cpu().double(), ref["log_probs"], atol=case.atol, rtol=0)
    torch.testing.assert_close(alone_h.cpu().double(), ref["entropy"], atol=case.atol, rtol=0)
    assert torch.all(out["log_probs"][labels < 0] == 0)


@settings(deadline=None)
@given(
    t=st.integers(0, 20),
    v=st.integers(1, 40),
    chunk=st.one_of(st.none(), st.integers(1, 25)),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_values_property(t, v, chunk, bf16, seed):
    logits, labels, temp = make_case(t, v, torch.bfloat16 if bf16 else torch.float32, seed=seed, ignore_every=3)
    ref = reference(logits, labels, temp)
    out = log_probs_and_entropy(logits, labels, temperature=temp, chunk_size=chunk)
    torch.testing.assert_close(out["log_probs"].double(), ref["log_probs"], atol=3e-5, rtol=0)
    torch.testing.assert_close(out["entropy"].double(), ref["entropy"], atol=3e-5, rtol=0)


def test_masked_vocab_entries():
    """-inf logits (filtered vocab) behave as if those entries were absent, in values and gradients."""
    logits, labels, _ = make_case(12, 30, torch.float32)
    keep = torch.arange(30) % 3 != 1
    labels = torch.where(keep[labels.clamp(min=0)] | (labels < 0), labels, 0)
    masked = logits.masked_fill(~keep, float("-inf")).requires_grad_()
    out = log_probs_and_entropy(masked, labels, temperature=0.9, chunk_size=5)
    g_lp, g_h = torch.randn(12), torch.randn(12)
    (out["log_probs"] * g_lp + out["entropy"] * g_h).sum().backward()
    compact = torch.cumsum(keep.long(), 0) - 1  # label index inside the kept vocab
    compact_labels = torch.where(labels >= 0, compact[labels.clamp(min=0)], IGNORE)
    ref = reference(logits[:, keep], compact_labels, 0.9)
    torch.testing.assert_close(out["log_probs"].double(), ref["log_probs"], atol=2e-5, rtol=0)
    torch.testing.assert_close(out["entropy"].double(), ref["entropy"], atol=2e-5, rtol=0)
    (ref_grad,) = reference_grads(logits[:, keep], compact_labels, 0.9, g_lp, g_h)
    torch.testing.assert_close(masked.grad[:, keep].double(), ref_grad, atol=2e-5, rtol=0)
    assert torch.all(masked.grad[:, ~keep] == 0)


def test_confident_tokens_keep_relative_precision():
    """Low temperature, large logits, label = argmax: log-probs and entropies are tiny (~1e-6) and must keep
    their relative precision (forming lse ~ 150 in float32 would cost ~1e-5 absolute, i.e. everything)."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(16, 300, generator=g) * 4
    logits[:, 7] += 40  # one dominant entry per token
    labels = torch.full((16,), 7)
    for fn in (
        lambda: log_probs_and_entropy(logits, labels, temperature=0.3, chunk_size=4),
        lambda: fused_log_probs_and_entropy(torch.eye(300)[:16] * 0 + logits, torch.eye(300), labels,
                                            temperature=0.3, chunk_size=64),
    ):
        out = fn()
        ref = reference(logits, labels, 0.3)
        assert ref["log_probs"].abs().max() < 1e-3 and ref["entropy"].max() < 1e-2  # the regime under test
        torch.testing.assert_close(out["log_probs"].double(), ref["log_probs"], rtol=1e-3, atol=1e-12)
        torch.testing.assert_close(out["entropy"].double(), ref["entropy"], rtol=1e-3, atol=1e-12)


def test_padding_slot_temperatures_read_as_one():
    """Packed layouts fill padding slots with 0 (``real_tokens`` False there): such rows are computed at
    temperature 1, never NaN.  (At a real token a bad temperature raises: test_no_silent_wrong.py.)"""
    logits, labels, temp = make_case(10, 20, torch.float32)
    temp[[2, 7]] = 0.0
    real = torch.ones(10, dtype=torch.bool)
    real[[2, 7]] = False
    x = logits.clone().requires_grad_()
    tt = temp.clone().requires_grad_()
    out = log_probs_and_entropy(x, labels, temperature=tt, chunk_size=3, real_tokens=real)
    (out["log_probs"].sum() + out["entropy"].sum()).backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(tt.grad).all()
    assert torch.all(tt.grad[[2, 7]] == 0)
    ref = reference(logits, labels, torch.where(temp > 0, temp, 1.0))
    torch.testing.assert_close(out["entropy"].double(), ref["entropy"], atol=2e-5, rtol=0)


def test_empty_batch():
    logits = torch.zeros(0, 8, requires_grad=True)
    out = log_probs_and_entropy(logits, torch.zeros(0, dtype=torch.long))
    assert out["log_probs"].shape == (0,) and out["entropy"].shape == (0,)
    (out["log_probs"].sum() + out["entropy"].sum()).backward()
    assert logits.grad.shape == (0, 8)


# ----------------------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature_grad", [True, False], ids=["temperature-grad", "no-temperature-grad"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gradients_match_float64(case, temperature_grad, device):
    logits, labels, per_token = make_case(case.t, case.v, case.dtype, seed=1)
    temp = temperature_of(case, per_token)
    if isinstance(temp, torch.Tensor):
        temp = temp.clone().to(device).requires_grad_(temperature_grad)
    x = logits.clone().to(device).requires_grad_()
    g = torch.Generator().manual_seed(2)
    g_lp, g_h = torch.randn(case.t, generator=g), torch.randn(case.t, generator=g)
    out = log_probs_and_entropy(x, labels.to(device), temperature=temp, chunk_size=case.chunk_size)
    (out["log_probs"] * g_lp.to(device) + out["entropy"] * g_h.to(device)).sum().backward()
    temp_cpu = temp.detach().cpu() if isinstance(temp, torch.Tensor) else temp
    ref = reference_grads(logits, labels, temp_cpu, g_lp, g_h)
    x_grad = x.grad.cpu()
    temp_grad = temp.grad.cpu() if isinstance(temp, torch.Tensor) and temperature_grad else None
    assert x_grad.dtype == case.dtype
    # the gradient is rounded once to the logits' dtype (rtol), on top of float32 math whose absolute error
    # follows the largest terms of the sum p (g_lp + g_h (log p + H)), bounded via the largest gradient (atol)
    rtol = {torch.bfloat16: 2**-8, torch.float16: 2**-10, torch.float32: 1e-5, torch.float64: 1e-10}[case.dtype]
    atol = (1e-12 if case.dtype == torch.float64 else 1e-5) * ref[0].abs().max().item()
    torch.testing.assert_close(x_grad.double(), ref[0], atol=atol, rtol=rtol)
    if temp_grad is not None:
        torch.testing.assert_close(temp_grad.double(), ref[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("which", ["log_probs", "entropy"])
def test_single_output_gradients(which):
    """Only one output used: the other upstream gradient is None inside the backward."""
    logits, labels, temp = make_case(25, 60, torch.float32, seed=3)
    x = logits.clone().requires_grad_()
    g = torch.randn(25)
    out = log_probs(x, labels, temperature=temp, chunk_size=7) if which == "log_probs" else entropy(
        x, temperature=temp, chunk_size=7
    )
    (out * g).sum().backward()
    zeros = torch.zeros(25)
    ref = reference_grads(logits, labels, temp, *((g, zeros) if which == "log_probs" else (zeros, g)))
    torch.testing.assert_close(x.grad.double(), ref[0], atol=1e-5 * ref[0].abs().max().item(), rtol=1e-5)
    if which == "log_probs":  # ignored labels send no gradient at all
        assert torch.all(x.grad[labels < 0] == 0)


def test_gradcheck_chunked():
    logits, labels, temp = make_case(13, 11, torch.float64, seed=4, ignore_every=4)
    x = logits.clone().requires_grad_()
    per_token = temp.double().requires_grad_()
    scalar = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)

    def fn(x, temperature):
        out = log_probs_and_entropy(x, labels, temperature=temperature, chunk_size=4)
        return out["log_probs"], out["entropy"]

    assert torch.autograd.gradcheck(fn, (x, per_token))
    assert torch.autograd.gradcheck(fn, (x, scalar))
    assert torch.autograd.gradcheck(lambda x: entropy(x, temperature=1.7, chunk_size=3), (x,))


# ------------------------------------------------------------------------------------------------- fused


def fused_inputs(t, v, hdim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, hdim, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, hdim, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    labels = torch.randint(0, v, (t,), generator=g)
    labels[::4] = IGNORE
    temp = torch.rand(t, generator=g, dtype=torch.float64).add(0.5).float()
    return hidden, weight, labels, temp


def test_gradcheck_fused():
    hidden, weight, labels, temp = fused_inputs(9, 13, 5, torch.float64)
    args = [hidden.requires_grad_(), weight.requires_grad_(), temp.double().requires_grad_()]

    def fn(h, w, temperature):
        out = fused_log_probs_and_entropy(h, w, labels, temperature=temperature, chunk_size=4)
        return out["log_probs"], out["entropy"]

    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk_size", [None, 7], ids=lambda c: f"chunk{c}")
def test_fused_matches_float64(dtype, chunk_size, device):
    t, v, hdim = 40, 90, 16
    hidden, weight, labels, temp = fused_inputs(t, v, hdim, dtype, seed=5)
    h, w = hidden.clone().to(device).requires_grad_(), weight.clone().to(device).requires_grad_()
    g = torch.Generator().manual_seed(6)
    g_lp, g_h = torch.randn(t, generator=g), torch.randn(t, generator=g)
    out = fused_log_probs_and_entropy(h, w, labels.to(device), temperature=temp.to(device), chunk_size=chunk_size)
    (out["log_probs"] * g_lp.to(device) + out["entropy"] * g_h.to(device)).sum().backward()
    out = {k: v.detach().cpu() for k, v in out.items()}
    h, w = h.grad.cpu(), w.grad.cpu()

    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = reference(h64 @ w64.T, labels, temp)
    (ref["log_probs"] * g_lp.double() + ref["entropy"] * g_h.double()).sum().backward()
    # bf16: logits are rounded to bf16 (as a plain hidden @ weight.T is), so allow ~ulp(max |logit| / T)
    logit_max = (h64 @ w64.T).abs().max().item() / temp.min().item()
    val_atol = 2e-5 if dtype == torch.float32 else 2**-7 * logit_max
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(out[key].double(), ref[key].detach(), atol=val_atol, rtol=0)
    for got, want in ((h, h64.grad), (w, w64.grad)):
        assert got.dtype == dtype
        rel = (got.double() - want).norm() / want.norm()
        assert rel < (1e-5 if dtype == torch.float32 else 2e-2), rel


def test_fused_equals_unfused_fp32():
    hidden, weight, labels, temp = fused_inputs(30, 70, 8, torch.float32, seed=7)
    fused = fused_log_probs_and_entropy(hidden, weight, labels, temperature=temp, chunk_size=16)
    plain = log_probs_and_entropy(hidden @ weight.T, labels, temperature=temp)
    for key in fused:
        torch.testing.assert_close(fused[key], plain[key], atol=1e-5, rtol=0)


# -------------------------------------------------------------------------------------------------- memory


class AllocationRecorder(TorchDispatchMode):
    """Record (op, shape, dtype) of every freshly allocated op output (views of existing storage excluded)."""

    def __init__(self):
        super().__init__()
        self.fresh = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = torch.utils._pytree.tree_leaves((args, kwargs))
        known = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor)}
        out = func(*args, **kwargs)
        for o in torch.utils._pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in known:
                self.fresh.append((str(func), tuple(o.shape), o.dtype, o.numel()))
        return out


def saved_shapes(fn):
    saved = []

    def pack(x):
        saved.append((x.untyped_storage().data_ptr(), x.numel()))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn()
    return saved, out


def naive(logits, labels, temp):
    lsm = torch.log_softmax(logits.float() / temp[:, None], dim=-1)
    return {"log_probs": lsm.gather(1, labels.clamp(min=0)[:, None])[:, 0], "entropy": -(lsm.exp() * lsm).sum(-1)}


def test_memory_chunked():
    """Only [t] vectors are saved besides the input, and no [t, v] temporary is ever allocated: the only
    fresh tensor bigger than one block is the gradient itself, in the logits' dtype."""
    t, v, chunk = 64, 200, 16
    logits, labels, temp = make_case(t, v, torch.bfloat16)
    x = logits.clone().requires_grad_()
    saved, _ = saved_shapes(lambda: naive(x, labels, temp))
    assert any(n == t * v and p != x.untyped_storage().data_ptr() for p, n in saved)  # the check can see them
    saved, out = saved_shapes(lambda: log_probs_and_entropy(x, labels, temperature=temp, chunk_size=chunk))
    assert all(n <= t for p, n in saved if p != x.untyped_storage().data_ptr())
    with AllocationRecorder() as rec:
        out = log_probs_and_entropy(x, labels, temperature=temp, chunk_size=chunk)
        (out["log_probs"].sum() + out["entropy"].sum()).backward()
    big = [f for f in rec.fresh if f[3] > chunk * v]
    assert [(shape, dtype) for _, shape, dtype, _ in big] == [((t, v), torch.bfloat16)], big


def test_memory_fused():
    t, v, hdim, chunk = 64, 200, 4, 16
    hidden, weight, labels, temp = fused_inputs(t, v, hdim, torch.bfloat16)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    inputs = {h.untyped_storage().data_ptr(), w.untyped_storage().data_ptr()}
    saved, _ = saved_shapes(lambda: fused_log_probs_and_entropy(h, w, labels, temperature=temp, chunk_size=chunk))
    assert all(n <= t for p, n in saved if p not in inputs)
    with AllocationRecorder() as rec:
        out = fused_log_probs_and_entropy(h, w, labels, temperature=temp, chunk_size=chunk)
        (out["log_probs"].sum() + out["entropy"].sum()).backward()
    assert max(n for *_, n in rec.fresh) <= max(t * chunk, v * hdim), [f for f in rec.fresh if f[3] > t * chunk]


# ------------------------------------------------------------------------------------------ vocab parallel


def _tp_worker(rank, world_size, cases, device):
    """Each rank keeps its vocab slice, runs every function with the group, returns outputs and gradients."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world_size)))
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    results = []
    for case in cases:
        logits, labels, temp, g_lp, g_h, hidden, weight = (x.to(dev) for x in case)
        v_local = logits.shape[1] // world_size
        cols = slice(rank * v_local, (rank + 1) * v_local)
        r = {}
        # tensor temperature with a gradient (the backward's float32 path), small blocks
        x, tt = logits[:, cols].clone().requires_grad_(), temp.clone().requires_grad_()
        r["out"] = log_probs_and_entropy(x, labels, temperature=tt, tp_group=group, chunk_size=5)
        (r["out"]["log_probs"] * g_lp + r["out"]["entropy"] * g_h).sum().backward()
        r["grad"], r["grad_t"] = x.grad, tt.grad
        # float temperature (the backward's direct-write path), default blocks
        x1 = logits[:, cols].clone().requires_grad_()
        r["out1"] = log_probs_and_entropy(x1, labels, temperature=1.0, tp_group=group)
        (r["out1"]["log_probs"] * g_lp + r["out1"]["entropy"] * g_h).sum().backward()
        r["grad1"] = x1.grad
        r["lp_only"] = log_probs(logits[:, cols], labels, temperature=temp, tp_group=group)
        r["h_only"] = entropy(logits[:, cols], temperature=temp, tp_group=group)
        h, w, tf = hidden.clone().requires_grad_(), weight[cols].clone().requires_grad_(), temp.clone().requires_grad_()
        r["fused"] = fused_log_probs_and_entropy(h, w, labels, temperature=tf, tp_group=group, chunk_size=6)
        (r["fused"]["log_probs"] * g_lp + r["fused"]["entropy"] * g_h).sum().backward()
        r["fused_grads"] = (h.grad, w.grad, tf.grad)
        results.append(torch.utils._pytree.tree_map(lambda t: t.detach().cpu(), r))
    return results


def single_process(logits, labels, temp, g_lp, g_h, hidden, weight):
    """The same computations on the full vocab, in this process."""
    r = {}
    x, tt = logits.clone().requires_grad_(), temp.clone().requires_grad_()
    r["out"] = log_probs_and_entropy(x, labels, temperature=tt)
    (r["out"]["log_probs"] * g_lp + r["out"]["entropy"] * g_h).sum().backward()
    r["grad"], r["grad_t"] = x.grad, tt.grad
    x1 = logits.clone().requires_grad_()
    r["out1"] = log_probs_and_entropy(x1, labels, temperature=1.0)
    (r["out1"]["log_probs"] * g_lp + r["out1"]["entropy"] * g_h).sum().backward()
    r["grad1"] = x1.grad
    h, w, tf = hidden.clone().requires_grad_(), weight.clone().requires_grad_(), temp.clone().requires_grad_()
    r["fused"] = fused_log_probs_and_entropy(h, w, labels, temperature=tf)
    (r["fused"]["log_probs"] * g_lp + r["fused"]["entropy"] * g_h).sum().backward()
    r["fused_grads"] = (h.grad, w.grad, tf.grad)
    return r


def tp_cases():
    cases = []
    for dtype, seed in ((torch.float32, 8), (torch.bfloat16, 9)):
        t, v, hdim = 21, 48, 8
        logits, labels, temp = make_case(t, v, dtype, seed=seed)
        labels[1:5] = torch.tensor([0, v // 2 - 1, v // 2, v - 1])  # both sides of the shard boundary
        hidden, weight, _, _ = fused_inputs(t, v, hdim, dtype, seed=seed)
        g = torch.Generator().manual_seed(seed)
        cases.append((logits, labels, temp, torch.randn(t, generator=g), torch.randn(t, generator=g), hidden, weight))
    return cases


def check_tp_results(cases, per_rank):
    """Every rank's outputs equal the full-vocab ones; the slices of the logits/weight gradients put together
    equal the full-vocab gradient; hidden and temperature gradients are full on every rank."""
    for case, r0, r1 in zip(cases, *per_rank):
        ref = single_process(*case)
        bf16 = case[0].dtype == torch.bfloat16
        tol = dict(atol=1e-5, rtol=1e-5)
        # logits gradients: one bf16 rounding apart at most; fused ones: the per-block matmuls round
        # differently with another vocab split, so compare those by norm
        grad_tol = dict(atol=1e-6, rtol=2**-7) if bf16 else tol

        def by_norm(got, want, rel=1e-2 if bf16 else 1e-5):
            err = (got.double() - want.double()).norm() / want.double().norm()
            assert err < rel, err

        for r in (r0, r1):
            for out in ("out", "out1", "fused"):
                for key in ("log_probs", "entropy"):
                    torch.testing.assert_close(r[out][key], ref[out][key], **tol)
            torch.testing.assert_close(r["lp_only"], ref["out"]["log_probs"], **tol)
            torch.testing.assert_close(r["h_only"], ref["out"]["entropy"], **tol)
            torch.testing.assert_close(r["grad_t"], ref["grad_t"], atol=1e-4, rtol=1e-4)
            by_norm(r["fused_grads"][0], ref["fused_grads"][0])  # the full hidden gradient on every rank
            torch.testing.assert_close(r["fused_grads"][2], ref["fused_grads"][2], atol=1e-4, rtol=1e-4)
        for key in ("grad", "grad1"):
            torch.testing.assert_close(torch.cat([r0[key], r1[key]], dim=1), ref[key], **grad_tol)
        by_norm(torch.cat([r0["fused_grads"][1], r1["fused_grads"][1]]), ref["fused_grads"][1])


def test_vocab_parallel_two_ranks_gloo():
    cases = tp_cases()
    check_tp_results(cases, run_local(_tp_worker, 2, cases, "cpu", backend="gloo", timeout=120))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_vocab_parallel_two_ranks_nccl():
    cases = tp_cases()
    check_tp_results(cases, run_local(_tp_worker, 2, cases, "cuda", backend="nccl", timeout=120))


# ------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(labels=torch.zeros(4)), TypeError, "labels has dtype"),
        (dict(labels=torch.zeros(3, dtype=torch.long)), ValueError, "labels must have shape"),
        (dict(logits=torch.zeros(4, 2, 5)), ValueError, "logits must be 2-D"),
        (dict(logits=torch.zeros(4, 5, dtype=torch.long)), TypeError, "floating"),
        (dict(logits=torch.zeros(4, 0)), ValueError, "empty vocab"),
        (dict(temperature=0.0), ValueError, "temperature must be positive"),
        (dict(temperature="hot"), TypeError, "temperature must be a float"),
        (dict(temperature=torch.ones(3)), ValueError, "temperature must be a float, a 0-d"),
        (dict(temperature=torch.ones(4, dtype=torch.long)), TypeError, "temperature has dtype"),
        (dict(chunk_size=0), ValueError, "chunk_size must be >= 1"),
        (dict(chunk_size=2.0), TypeError, "chunk_size must be a Python int"),
        (dict(tp_group="tp"), TypeError, "tp_group must be"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    args = dict(logits=torch.zeros(4, 5), labels=torch.zeros(4, dtype=torch.long)) | kwargs
    with pytest.raises(error, match=match):
        log_probs_and_entropy(args.pop("logits"), args.pop("labels"), **args)


def test_bad_fused_arguments():
    labels = torch.zeros(4, dtype=torch.long)
    with pytest.raises(TypeError, match="share dtype"):
        fused_log_probs_and_entropy(torch.zeros(4, 3), torch.zeros(5, 3, dtype=torch.bfloat16), labels)
    with pytest.raises(ValueError, match="hidden size"):
        fused_log_probs_and_entropy(torch.zeros(4, 3), torch.zeros(5, 2), labels)
    with pytest.raises(ValueError, match="hidden must be 2-D"):
        fused_log_probs_and_entropy(torch.zeros(4), torch.zeros(5, 2), labels)
