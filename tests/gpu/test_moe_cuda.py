"""packfwd's MoE layers on the GPU: grouped-GEMM experts against Megatron-Core's sequential ones, host syncs, a
whole Qwen3-MoE packed forward and backward, and DeepSeek-V3-style routing (sigmoid, expert bias) on CUDA.

* Experts alone (8 experts, two of them empty, hidden 256, ffn 128): in bf16 the grouped path
  (``torch._grouped_mm``'s kernel, sm90 / sm100) is as close to a float64 reference as Megatron-Core's
  ``SequentialMLP`` is (outputs, the gradients of tokens, probabilities and every weight; an empty expert's weight
  gradient exactly zero); in float32 (``grouped=True``: torch loops over groups) equal to it within 1e-5.
* No host sync in the grouped forward and backward, whether the token counts come as a CPU tensor (Megatron-Core's
  dispatchers) or a CUDA one (the sequential path syncs there: the checker sees it).
* A tiny Qwen3-MoE (from transformers' weights) packed THD on CUDA in bf16: the default path is the grouped one
  (two grouped products per MoE layer), and its logits and gradients are as close to the float32 model's as the
  sequential path's.
* GLM-4.5 (DeepSeek-V3-style routing: sigmoid scores, the routing-only expert bias, group-limited top-k) on CUDA
  in one process under Megatron-Core 0.19.2: logits equal transformers per sequence, routing compiles no frame
  (Megatron-Core compiles its ``_apply_expert_bias``; packfwd's router overrides it), the expert-bias token
  counts are the real tokens', and Megatron-Core's own bias update runs on them.

    PYTHONPATH=. python3 -m pytest -q tests/gpu/test_moe_cuda.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

COUNTS = [37, 0, 200, 1, 0, 64, 5, 150]  # tokens per expert: ragged, two empty experts
SIZES = dict(experts=len(COUNTS), hidden=256, ffn=128)


def needs_kernel():
    from packfwd.models.mlp.experts import grouped_kernel

    if not grouped_kernel(torch.zeros(1, 8, dtype=torch.bfloat16, device="cuda")):
        pytest.skip("torch._grouped_mm has no kernel on this GPU (sm90 / sm100 only)")


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def results(got):
    """(name, tensor) of a ``run`` result: output, x and probs gradients, weight gradients."""
    out, dx, dprobs, grads = got
    return [("out", out), ("x.grad", dx), ("probs.grad", dprobs), *sorted(grads.items())]


def test_the_kernel_is_used_exactly_on_sm90_and_sm100():
    from packfwd.models.mlp.experts import grouped_kernel

    major = torch.cuda.get_device_capability()[0]
    x = torch.zeros(4, 8, device="cuda", dtype=torch.bfloat16)
    assert grouped_kernel(x) == (major in (9, 10) and hasattr(torch, "_grouped_mm"))
    assert not grouped_kernel(x.float()) and not grouped_kernel(x.cpu())


def test_bf16_grouped_is_as_close_to_float64_as_sequential():
    needs_kernel()
    from tests.test_moe_grouped import dispatched, experts_pair, run

    mine, theirs = experts_pair(torch.bfloat16, device="cuda", **SIZES)
    assert mine.use_grouped(torch.zeros(1, SIZES["hidden"], device="cuda", dtype=torch.bfloat16))
    x, probs, grad = dispatched(COUNTS, torch.bfloat16, hidden=SIZES["hidden"], device="cuda")
    reference = experts_pair(torch.float64, device="cuda", **SIZES)[1]
    reference.load_state_dict(theirs.state_dict())
    want = results(run(reference, x.double(), COUNTS, probs, grad.double()))
    grouped, sequential = results(run(mine, x, COUNTS, probs, grad)), results(run(theirs, x, COUNTS, probs, grad))
    for (name, w), (_, g), (_, s) in zip(want, grouped, sequential):
        if not w.any():  # an empty expert's weights: no gradient at all
            assert not g.any() and not s.any(), name
            continue
        err_g, err_s = rel(g, w), rel(s, w)
        assert err_g <= max(2 * err_s, 1e-2), f"{name}: grouped {err_g:.2e}, sequential {err_s:.2e}"
        assert rel(g, s) < 2e-2, name
    empty = [n for n, w in want if n.startswith(("local_experts.1.", "local_experts.4.")) and n.endswith("weight")]
    assert len(empty) == 4


def test_float32_grouped_equals_sequential():
    from tests.test_moe_grouped import dispatched, experts_pair, run

    mine, theirs = experts_pair(torch.float32, grouped=True, device="cuda", **SIZES)
    x, probs, grad = dispatched(COUNTS, torch.float32, hidden=SIZES["hidden"], device="cuda")
    for (name, g), (_, s) in zip(results(run(mine, x, COUNTS, probs, grad)), results(run(theirs, x, COUNTS, probs,
                                                                                          grad))):
        torch.testing.assert_close(g, s, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("counts_on", ["cpu", "cuda"])
def test_grouped_forward_and_backward_make_no_host_sync(counts_on):
    needs_kernel()
    from tests.gpu.test_forward_no_sync import no_sync, syncs
    from tests.test_moe_grouped import dispatched, experts_pair, run

    mine, theirs = experts_pair(torch.bfloat16, device="cuda", **SIZES)
    x, probs, grad = dispatched(COUNTS, torch.bfloat16, hidden=SIZES["hidden"], device="cuda")
    counts = torch.tensor(COUNTS, device=counts_on)
    want = results(run(mine, x, COUNTS, probs, grad))  # also warms up: Triton compiles the SwiGLU kernels
    got = results(no_sync(lambda: run(mine, x, counts, probs, grad)))
    for (name, a), (_, b) in zip(got, want):  # device counts (empty experts as a mask) give the same numbers
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    if counts_on == "cuda":  # Megatron-Core's loop reads the counts back: the checker sees it
        assert syncs(lambda: run(theirs, x, counts, probs, grad))[1]


def qwen3_moe(seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.test_moe import randomise

    config = Qwen3MoeConfig(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                            num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, vocab_size=256, experts_implementation="eager")
    return randomise(Qwen3MoeForCausalLM(config), seed)


def rl_batch(b=6, s=64, vocab=256):
    """ids, mask [b, s] on CUDA (left-padded prompts, right-padded responses) and the host lengths."""
    g = torch.Generator().manual_seed(3)
    mask = torch.zeros(b, s, dtype=torch.bool)
    for i in range(b):
        start = int(torch.randint(0, s // 3, (1,), generator=g))
        mask[i, start:int(torch.randint(s // 2, s + 1, (1,), generator=g))] = True
    ids = torch.randint(1, vocab, (b, s), generator=g).masked_fill(~mask, 0)
    return ids.cuda(), mask.cuda(), mask.sum(1).tolist()


def test_qwen3_moe_packed_forward_and_backward_grouped_vs_sequential(monkeypatch):
    needs_kernel()
    from packfwd.forward import make_forward
    from packfwd.models import from_hf
    from packfwd.models.mlp.experts import set_grouped_experts

    hf = qwen3_moe()
    ids, mask, lengths = rl_batch()
    weight = torch.randn(*ids.shape, 256, generator=torch.Generator().manual_seed(4)).cuda()

    def step(model):
        model.zero_grad(set_to_none=True)
        logits = make_forward("thd")(model, ids, mask, seqlens=lengths)
        (logits.float() * weight)[mask].sum().backward()
        return logits[mask].detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    want_logits, want_grads = step(from_hf(hf, device="cuda", params_dtype=torch.float32))
    model = from_hf(hf, device="cuda", params_dtype=torch.bfloat16)
    calls, original = [], torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or original(*a, **k))
    grouped = step(model)
    assert len(calls) == 2 * 2 * 3  # two MoE layers, fc1 and fc2: forward, backward dx and dW
    assert set_grouped_experts(model, False) == 2
    sequential = step(model)
    assert len(calls) == 12
    # bf16 against float32 through two O(1)-scale MoE layers: rounding and the odd routing flip, chaotic per
    # parameter (either path is 1-2.5x the other's error on some); so the logits and all gradients together
    assert rel(grouped[0], want_logits) <= max(2 * rel(sequential[0], want_logits), 1e-2)
    flat = lambda grads: torch.cat([grads[n].double().flatten() for n in sorted(want_grads)])  # noqa: E731
    err_g, err_s = rel(flat(grouped[1]), flat(want_grads)), rel(flat(sequential[1]), flat(want_grads))
    assert err_g <= max(2 * err_s, 2e-2), f"gradients: grouped {err_g:.2e}, sequential {err_s:.2e}"


def test_deepseek_style_router_with_expert_bias_on_cuda():
    """GLM-4.5's routing (sigmoid, expert bias, groups) through a packed forward and backward on CUDA."""
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias
    from torch._dynamo.utils import counters

    from packfwd.forward import make_forward
    from packfwd.models import from_hf
    from packfwd.models.mlp.moe import routers
    from tests.oracles import assert_equals_hf_per_sequence
    from tests.test_glm4_moe import glm_config, glm_model, ragged_batch

    cfg = glm_config()
    hf = glm_model(cfg)
    model = from_hf(hf, device="cuda", params_dtype=torch.float32).train()
    ids, mask = ragged_batch()
    torch._dynamo.reset()
    counters.clear()
    logits = make_forward("thd", seq_align=8)(model, ids.cuda(), mask.cuda())
    logits.float().square().sum().backward()
    assert not counters["frames"], dict(counters["frames"])
    assert_equals_hf_per_sequence(hf, logits.detach().cpu().double(), ids, mask, atol=5e-4, rtol=1e-4)
    found = routers(model)
    assert found and all(r.expert_bias.is_cuda and r.expert_bias.dtype == torch.float32 for r in found)
    for r in found:
        assert int(r.local_tokens_per_expert.sum()) == cfg.num_experts_per_tok * int(mask.sum())
    counts = [r.local_tokens_per_expert.clone() for r in found]
    before = [r.expert_bias.clone() for r in found]
    _update_router_expert_bias([model], model.config)  # Megatron-Core's own update (finalize_model_grads)
    rate = model.config.moe_router_bias_update_rate
    for r, n, b in zip(found, counts, before):
        torch.testing.assert_close(r.expert_bias, b + torch.sign(n.mean() - n) * rate)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "per_expert_mm"])
def test_an_expert_rows_bits_do_not_depend_on_the_group_sizes(grouped):
    """Batch invariance through an MoE layer needs an expert's product of a token's row to be the same bits
    whatever the other tokens routed to it and to the other experts (their counts change with the batch).
    The same 5 rows for expert 2 (of 8, widths of the bench_moe shape) at offsets and group sizes of several
    batches: ``torch._grouped_mm`` (packfwd's grouped path), and one ``x @ w.T`` per expert (the sequential
    path) with split-K off as under ``batch_invariant=True``."""
    if grouped:
        needs_kernel()
    g = torch.Generator(device="cuda").manual_seed(0)
    e, h, f = 8, 2048, 768
    w = torch.randn(e, f, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    mine = torch.randn(5, h, device="cuda", dtype=torch.bfloat16, generator=g)
    prior = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    try:
        results = []
        for counts in ([0, 0, 5, 0, 0, 0, 0, 0], [3, 17, 40, 1, 0, 9, 2, 64], [700, 1, 1300, 5, 0, 2100, 33, 1],
                       [16, 16, 16, 16, 16, 16, 16, 16]):
            counts = list(counts)
            counts[2] = max(counts[2], 5)
            x = torch.randn(sum(counts), h, device="cuda", dtype=torch.bfloat16, generator=g)
            start = sum(counts[:2]) + (counts[2] - 5) // 2  # my rows in the middle of expert 2's group
            x[start:start + 5] = mine
            if grouped:
                offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
                y = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
            else:
                ends = torch.tensor(counts).cumsum(0).tolist()
                y = torch.cat([x[a:b] @ w[i].T for i, (a, b) in enumerate(zip([0, *ends[:-1]], ends))])
            results.append((counts, y[start:start + 5]))
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = prior
    base = results[0][1]
    differ = [(c, float((r.float() - base.float()).abs().max())) for c, r in results[1:] if not torch.equal(r, base)]
    print(f"{'grouped_mm' if grouped else 'per-expert mm'}: batches whose rows differ from expert 2 alone: {differ}")
    assert not differ, differ
