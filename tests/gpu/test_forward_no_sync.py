"""Host syncs of a whole packed forward of packfwd's Megatron-Core model on the GPU, caught by
``torch.cuda.set_sync_debug_mode``: with host ``seqlens`` passed to the forward, none (forward, forward with a
logits processor, forward + backward; THD and BSHD); from the device mask alone, exactly one (the plan reads the
lengths back once).  The no-sync forward gives the same logits as the planned-from-the-mask one, and the THD
logits of the real tokens agree with the padded model's (bf16 rounding).

Each sync is reported with the Python frames that made it, so a failure says where to look.

    PYTHONPATH=. python3 -m pytest -q tests/gpu/test_forward_no_sync.py
"""

from __future__ import annotations

import traceback
import warnings
from pathlib import Path

import pytest
import torch

from packfwd import next_token_labels
from packfwd.forward import make_forward
from packfwd.logits import log_probs_and_entropy
from packfwd.models import ModelArgs, build_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ARGS = ModelArgs(vocab_size=256, hidden_size=128, ffn_hidden_size=256, num_layers=2, num_attention_heads=4,
                 num_query_groups=2)
B, S = 5, 96


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(ARGS, device="cuda", params_dtype=torch.bfloat16)


@pytest.fixture
def batch():
    """ids, mask [5, 96] (right and left padding, a row with holes, a one-token row) and the host lengths."""
    g = torch.Generator(device="cuda").manual_seed(1)
    mask = torch.zeros(B, S, dtype=torch.bool, device="cuda")
    mask[0, :96] = True
    mask[1, :1] = True
    mask[2, 40:] = True  # left padding
    mask[3, :70] = True
    mask[3, 10:20] = False  # holes
    mask[4, :33] = True
    ids = torch.randint(1, ARGS.vocab_size, (B, S), device="cuda", generator=g)
    return ids, mask, [96, 1, 56, 60, 33]


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "warnings" not in f.filename]
    keep = [f for f in frames if "packfwd" in f.filename or "megatron" in f.filename] or frames
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(keep[-6:]))


def syncs(fn):
    """``(fn(), [where each host sync happened])`` under ``set_sync_debug_mode("warn")``."""
    found = []

    def record(message, category, filename, lineno, file=None, line=None):
        # torch's sync warning ("called a synchronizing CUDA operation"); set_sync_debug_mode's own first-use
        # notice is not a sync
        if "called a synchronizing" in str(message).lower():
            found.append(_where())

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return out, found


def no_sync(fn):
    """Run ``fn`` under ``set_sync_debug_mode("error")`` (after a recording run that names any sync)."""
    _, found = syncs(fn)
    assert found == [], "host syncs:\n" + "\n".join(found)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_forward_with_seqlens_makes_no_sync(model, batch, data_format):
    ids, mask, lengths = batch
    forward = make_forward(data_format)
    with torch.no_grad():
        want = forward(model, ids, mask)  # planned from the device mask; also the warm-up
        got = no_sync(lambda: forward(model, ids, mask, seqlens=lengths))
    assert torch.equal(got, want)
    assert got[mask].isfinite().all() and got[mask].abs().sum() > 0 and not got[~mask].any()


def test_forward_with_a_logits_processor_and_seqlens_makes_no_sync(model, batch):
    ids, mask, lengths = batch
    labels = next_token_labels(ids, mask)
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 2.0], device="cuda")
    forward = make_forward("thd", logits_processor=log_probs_and_entropy)
    with torch.no_grad():
        want = forward(model, ids, mask, labels=labels, temperature=temperature)
        got = no_sync(lambda: forward(model, ids, mask, seqlens=lengths, labels=labels, temperature=temperature))
    for key in ("log_probs", "entropy"):
        assert torch.equal(got[key], want[key])
    assert (got["log_probs"][mask & (labels >= 0)] < 0).all()


def test_forward_and_backward_with_seqlens_makes_no_sync(model, batch):
    ids, mask, lengths = batch
    forward = make_forward("thd")

    def step():
        model.zero_grad(set_to_none=True)
        out = forward(model, ids, mask, seqlens=lengths)
        (out.float() * out.float()).sum().backward()
        return out

    step()  # warm-up: first-use allocations of the backward
    no_sync(step)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.isfinite().all() for g in grads)


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_forward_from_the_device_mask_makes_exactly_one_sync(model, batch, data_format):
    ids, mask, _ = batch
    forward = make_forward(data_format)
    with torch.no_grad():
        forward(model, ids, mask)  # warm-up
        _, found = syncs(lambda: forward(model, ids, mask))
    assert len(found) == 1, "host syncs:\n" + "\n".join(found)


def test_thd_logits_match_the_padded_model(model, batch):
    """Packed RoPE and attention against the padded model (Megatron-Core's BSHD RoPE) on rows whose real tokens
    come first: the same function, up to bf16 rounding."""
    ids, _, lengths = batch
    mask = torch.arange(S, device="cuda")[None] < torch.tensor(lengths, device="cuda")[:, None]
    with torch.no_grad():
        packed = make_forward("thd")(model, ids, mask, seqlens=lengths)
        padded = model(input_ids=ids, position_ids=torch.arange(S, device="cuda").expand(B, S), attention_mask=None)
    a, b = packed[mask].float(), padded[mask].float()
    assert float((a - b).norm() / b.norm()) < 3e-2


def test_moe_forward_and_backward_on_grouped_experts_makes_no_sync(batch):
    """An MoE model (Qwen3-MoE kind, grouped experts: the dispatcher's ``t * top_k`` rows with device counts, the
    ordered combine's kernel) with host ``seqlens``: no sync in forward + backward; the logits agree with Megatron-Core's
    sequential experts' (host counts, exact pairs) to bf16 rounding on average (a near-tie may route elsewhere)."""
    from packfwd.models.mlp.experts import grouped_kernel, set_grouped_experts
    from packfwd.models.mlp import Moe

    ids, mask, lengths = batch
    args = ModelArgs(vocab_size=256, hidden_size=128, ffn_hidden_size=256, num_layers=2, num_attention_heads=4,
                     num_query_groups=2, family="qwen3_moe", qk_norm=True,
                     moe=Moe(num_experts=8, top_k=2, ffn_hidden_size=64))
    torch.manual_seed(0)
    moe = build_model(args, device="cuda", params_dtype=torch.bfloat16)
    if not grouped_kernel(torch.zeros(1, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("torch._grouped_mm's kernel needs sm90 / sm100")
    forward = make_forward("thd", seq_align=8)

    def step():
        moe.zero_grad(set_to_none=True)
        out = forward(moe, ids, mask, seqlens=lengths)
        (out.float() * out.float()).sum().backward()
        return out

    step()
    got = no_sync(step).detach()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in moe.parameters() if p.requires_grad)
    set_grouped_experts(moe, False)
    with torch.no_grad():
        want = forward(moe, ids, mask, seqlens=lengths)
    diff = (got[mask].float() - want[mask].float()).abs()
    assert diff.mean() < 0.05 * want[mask].float().abs().mean(), (diff.mean(), diff.max())  # a flipped route moves a few


@pytest.mark.parametrize("buckets", [False, True], ids=["plain", "padded"])
def test_run_micro_batches_with_host_counts_makes_no_sync(model, batch, buckets):
    """The whole step through ``run_micro_batches`` (two micro-batches, the loss and its backward), given the host
    lengths (the plan's) and each sequence's loss tokens (``loss_tokens``): no host sync, padded to the buckets or
    not (the rows, the loss weights and the outputs' order go up through pinned memory)."""
    from packfwd.micro import plan_micro_batches, run_micro_batches

    ids, mask, lengths = batch
    labels = next_token_labels(ids, mask)
    loss_mask = labels >= 0
    counts = loss_mask.sum(1).tolist()
    forward = make_forward("thd", logits_processor=log_probs_and_entropy)
    plan = plan_micro_batches(lengths, max_tokens=160, **forward.layout.plan_args)
    assert plan.num_micro_batches >= 2, plan.tokens

    def step():
        model.zero_grad(set_to_none=True)
        return run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, labels=labels, buckets=buckets,
                                 loss_fn=lambda o: -o["log_probs"], loss_mask=loss_mask, loss_tokens=counts)

    want = step()  # warm-up (and the padded steps' first inputs)
    got = no_sync(step)
    if buckets:  # the padded step ran, not the plain one it falls back to
        assert forward.padded_steps.reason is None and forward.padded_steps.eager > 0, forward.padded_steps
    assert torch.equal(got.loss, want.loss) and got.loss.isfinite()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
