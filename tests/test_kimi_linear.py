"""Kimi-Linear (``kimi_linear``: Kimi Delta Attention layers, MLA without RoPE, DeepSeek-V3's MoE) against
transformers.

Strategy: as tests/test_hybrid_families.py: transformers' ``KimiLinearForCausalLM`` is the oracle, lifted to
float64 (``tests.oracles.hf_float64_module``: its float32 upcasts of the delta rule, the gates, the norms and the
router become float64), run on each sequence alone; packfwd runs the whole ragged batch (left and right padding,
sequences of 1 to 150 tokens: several 64-token chunks) in THD, THD aligned (``seq_align=16``), BSHD and through
``model(ids, None, attention_mask)``, and every sequence's logits must equal its lone run.  Tiny float64 models
(hidden 32, 4 layers: 3 KDA, 1 MLA, the pattern of ``layer_types``), O(1)-scale weights, noisy gates and decays.
The dense model (every MLP dense) is exact to 1e-10; the MoE one (sigmoid router, groups, correction bias, a
dense first layer, a shared expert) to 2e-5, since Megatron-Core's router computes in float32.

Also: gradients of every weight equal transformers' (dense); weights both ways bit for bit, whole and from two TP
shards; negative controls (a sequence joined to its neighbour changes, and the per-channel forget gate collapsed to
one per head changes the delta rule, which otherwise equals transformers' token-by-token recurrence); refusals;
two pipeline stages (in this process) equal to the whole model, logits, gradients and the experts' load;
``moe_aux_loss=True`` refused (sigmoid routing: transformers defines no load-balancing loss for Kimi-Linear) and
the experts' load equal to transformers' choices over the real tokens; and, over gloo (one ``run_local``), TP=2
with sequence parallelism (THD, BSHD) and CP=2 (THD) equal to transformers, EP=2 equal to one process and to
transformers.
"""

from __future__ import annotations

import pytest
import torch

from packfwd.forward import make_forward
from packfwd.models import from_hf, megatron_to_hf, to_hf_state_dict
from packfwd.models.convert.hf import args_from_hf_config
from packfwd.models.convert.hf_weights import hf_to_megatron

from .oracles import assert_equals_hf_per_sequence, hf_float64_module
from .test_compile_layer import quiet_megatron  # noqa: F401 (a fixture)
from .test_hybrid_families import LAYOUTS, _forward, cp_builds_at_2_and_refuses_4, ragged_batch, randomise

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "KimiLinearConfig"):
    pytest.skip(f"transformers {transformers.__version__} lacks Kimi-Linear", allow_module_level=True)
PATH = "transformers.models.kimi_linear.modeling_kimi_linear"

TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
            kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=6,
            linear_num_heads=2, linear_head_dim=8, intermediate_size=48, moe_intermediate_size=16,
            num_local_experts=8, num_experts_per_tok=2, n_group=4, topk_group=1, n_shared_experts=1,
            routed_scaling_factor=1.5, rms_norm_eps=1e-6, experts_implementation="eager", pad_token_id=0,
            bos_token_id=1, eos_token_id=2,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])
KINDS = {"dense": dict(mlp_layer_types=["dense"] * 4),
         "moe": dict(mlp_layer_types=["dense", "sparse", "sparse", "sparse"], q_lora_rank=12)}
ATOL = {"dense": dict(atol=1e-10, rtol=0.0), "moe": dict(atol=2e-5, rtol=1e-5)}  # moe: the float32 router


def hf_model(kind: str = "dense", *, seed: int = 0, **extra) -> torch.nn.Module:
    """The tiny float64 model (module docstring): weights ~ N(0, 1 / fan_in), norms, decays and the (float32)
    routing bias noisy around their starting values."""
    config = transformers.KimiLinearConfig(**{**TINY, **KINDS[kind], **extra})
    torch.manual_seed(seed)
    model = hf_float64_module(PATH).KimiLinearForCausalLM(config).double()
    g = torch.Generator().manual_seed(seed)
    randomise(model, g)
    with torch.no_grad():
        for module in model.modules():  # the routing bias float32, as transformers keeps it (and Megatron-Core)
            if hasattr(module, "e_score_correction_bias"):
                bias = module.e_score_correction_bias
                module.e_score_correction_bias = (0.1 * torch.randn(bias.shape, generator=g)).float()
    return model.eval()




@pytest.fixture(scope="module", params=sorted(KINDS))
def kind_models(request):
    """(kind, packfwd's model, transformers' logits of each row's sequence run alone)."""
    hf = hf_model(request.param)
    ids, mask = ragged_batch()
    with torch.no_grad():
        alone = [hf(ids[i][mask[i]][None]).logits[0] for i in range(ids.shape[0])]
    return request.param, from_hf(hf), alone


@pytest.mark.parametrize("data_format, layout", LAYOUTS, ids=lambda x: str(x))
def test_logits_equal_transformers_per_sequence(kind_models, data_format, layout):
    kind, model, alone = kind_models
    ids, mask = ragged_batch()
    forward = _forward(data_format, layout)
    with torch.no_grad():
        logits = forward(model, ids, mask)
    for i, want in enumerate(alone):
        torch.testing.assert_close(logits[i][mask[i]], want, **ATOL[kind], msg=f"{kind} {data_format} {layout} row {i}")
    assert not logits[~mask].any(), "padding positions must be zero"


def test_the_layer_pattern_is_the_configs():
    hf = hf_model("moe", layer_types=["full_attention", "linear_attention"] * 2)
    model = from_hf(hf)
    kinds = [(type(layer.self_attention).__name__, type(layer.mlp).__name__) for layer in model.decoder.layers]
    assert [k for k, _ in kinds] == ["PackedMLASelfAttention", "PackedKimiDeltaAttention"] * 2
    assert kinds[0][1] != kinds[1][1] == kinds[2][1] == kinds[3][1]  # the first MLP dense, the others MoE
    ids, mask = ragged_batch()
    with torch.no_grad():
        assert_equals_hf_per_sequence(hf, make_forward("thd")(model, ids, mask), ids, mask, **ATOL["moe"])


def test_gradients_equal_transformers():
    """Every weight's gradient (through the packed convolution, the per-channel delta rule, the low-rank gates, the
    sigmoid-gated norm and MLA without RoPE; THD aligned) equals transformers' of the same loss summed over each
    sequence run alone."""
    hf = hf_model("dense")
    model = from_hf(hf)
    ids, mask = ragged_batch()
    logits = make_forward("thd", seq_align=16)(model, ids, mask)
    (logits.logsumexp(-1) * mask).sum().backward()
    got = megatron_to_hf([{n: p.grad for n, p in model.named_parameters()}], args_from_hf_config(hf.config))
    for i in range(ids.shape[0]):
        hf(ids[i][mask[i]][None]).logits.logsumexp(-1).sum().backward()
    for name, p in hf.named_parameters():
        torch.testing.assert_close(got[name], p.grad, atol=1e-9 * float(p.grad.abs().max()), rtol=0, msg=name)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_weights_convert_back_bit_for_bit(kind):
    from packfwd.models.runtime.gpt import model_args

    hf = hf_model(kind)
    sd = hf.state_dict()
    model = from_hf(hf)
    back = to_hf_state_dict(model)
    assert sorted(back) == sorted(sd) and all(torch.equal(back[n], t) for n, t in sd.items())
    args = args_from_hf_config(hf.config)
    assert model_args(model) == args
    shards = [hf_to_megatron(sd, args, tp_size=2, tp_rank=r) for r in range(2)]
    merged = megatron_to_hf(shards, args)
    assert sorted(merged) == sorted(sd) and all(torch.equal(merged[n], t) for n, t in sd.items())


def test_a_bf16_model_keeps_the_float32_tensors_transformers_keeps():
    """transformers keeps ``dt_bias`` (and the router's weight and bias) in float32 in a bf16 Kimi-Linear
    (``_keep_in_fp32_modules_strict``): packfwd holds ``dt_bias`` in float32 too, so the round trip is bitwise with
    the dtypes, and the forward runs with the unrounded gate bias (an independent check found it rounded to bf16)."""
    config = transformers.KimiLinearConfig(**{**TINY, **KINDS["moe"]})
    torch.manual_seed(0)
    hf = transformers.KimiLinearForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("dt_bias"):
                p.normal_()
    sd = hf.state_dict()
    assert sd["model.layers.0.self_attn.forget_gate.dt_bias"].dtype == torch.float32
    model = from_hf(hf)
    assert {p.dtype for n, p in model.named_parameters() if n.endswith("dt_bias")} == {torch.float32}
    back = to_hf_state_dict(model)
    assert sorted(back) == sorted(sd)
    assert all(back[n].dtype == t.dtype and torch.equal(back[n], t) for n, t in sd.items()), \
        [n for n, t in sd.items() if back[n].dtype != t.dtype or not torch.equal(back[n], t)]
    ids, mask = ragged_batch()
    with torch.no_grad():
        out = make_forward("thd")(model, ids % TINY["vocab_size"], mask)
    assert out.dtype == torch.bfloat16 and out[mask].isfinite().all()


def test_a_neighbour_changes_nothing_but_a_leak_would():
    """Negative control: the same rows with other neighbours give the same bits; one sequence joined to the next
    (the state and the convolution running on) gives other logits at the second."""
    model = from_hf(hf_model("dense"))
    ids, mask = ragged_batch()
    forward = make_forward("thd")
    with torch.no_grad():
        assert torch.equal(forward(model, ids[1:3], mask[1:3]), forward(model, ids, mask)[1:3])
        one = ids[2][mask[2]][None]
        both = torch.cat([ids[1][mask[1]], ids[2][mask[2]]])[None]
        joined = model(both, None, None)[0, mask[1].sum():]
        assert (joined - model(one, None, None)[0]).abs().amax() > 1e-3


def test_the_forget_gate_is_per_channel():
    """The packed per-channel delta rule equals transformers' token-by-token recurrence (each sequence alone,
    several chunks, a chunk size that does not divide the lengths); collapsing the gate to one per head (Gated
    DeltaNet's form: its channel mean) moves it far beyond that: the comparison can fail."""
    from packfwd.models.mixers.deltanet_ops import chunk_gated_delta_rule_packed

    recurrence = hf_float64_module(PATH).recurrent_kimi_delta_attention
    g = torch.Generator().manual_seed(1)
    t, h, d, cu = 150, 2, 8, torch.tensor([0, 67, 70, 150])
    q, k, v = (torch.randn(t, h, d, generator=g, dtype=torch.float64) for _ in range(3))
    gate = -3 * torch.rand(t, h, d, generator=g, dtype=torch.float64)
    beta = torch.rand(t, h, generator=g, dtype=torch.float64)
    want = torch.cat([recurrence(*(x[None, a:b] for x in (q, k, v, gate, beta)), None, False,
                                 use_qk_l2norm_in_kernel=True)[0][0] for a, b in zip(cu[:-1], cu[1:])])
    got = chunk_gated_delta_rule_packed(q, k, v, gate, beta, cu, chunk_size=16, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    per_head = chunk_gated_delta_rule_packed(q, k, v, gate.mean(-1), beta, cu, chunk_size=16,
                                             use_qk_l2norm_in_kernel=True)
    assert (per_head - want).abs().amax() > 1e-2


def test_what_is_refused_names_the_fix():
    from packfwd.models import ModelArgs
    from packfwd.models.mixers import DeltaNet

    with pytest.raises(ValueError, match="attention_bias=True: packfwd builds MLA's projections without biases"):
        args_from_hf_config(hf_model("dense").config.__class__(**{**TINY, **KINDS["dense"], "attention_bias": True}))
    with pytest.raises(ValueError, match="num_key_value_heads=2 with num_attention_heads=4"):
        args_from_hf_config(transformers.KimiLinearConfig(**{**TINY, "num_key_value_heads": 2}))
    args = args_from_hf_config(hf_model("dense").config)
    with pytest.raises(ValueError, match="whose linear attention is kimi delta attention"):
        ModelArgs(**{**vars(args), "linear_attention": DeltaNet(2, 2, 8, 8, layers=(0,))})
    with pytest.raises(ValueError, match="linear_num_heads=2 is not divisible by tp_size=4"):
        hf_to_megatron({}, args, tp_size=4, tp_rank=0)
    from packfwd.models.mixers.kda import PackedKimiDeltaAttention

    cp_builds_at_2_and_refuses_4(PackedKimiDeltaAttention, args, "kda",
                                 r"context parallelism \(cp_size=4\) with Kimi Delta Attention layers .* "
                                 r"linear_num_heads=2 must be divisible by tp_size \* cp_size = 4")


# ------------------------------------------------------------------------------- two pipeline stages, one process


def test_two_pipeline_stages_equal_the_whole_model():
    """The MoE model as PP=2 in one process (stage 0: layers 0-1, KDA with the dense MLP, MLA with experts; stage 1:
    layers 2-3, KDA with experts: each stage builds its layers by their global index), THD aligned and BSHD: the
    stages' logits and, backpropagated through both stages, every weight's gradient equal the whole model's, and
    each stage's experts get the whole model's load (the later stage routes no pad although it is given no input
    ids).  Negative control: one token of stage 0's output changed moves its sequence's later logits, and only
    those."""
    from .test_moe import expert_load
    from .test_parallel_families import _stage_grads, run_stages

    hf = hf_model("moe")
    whole = from_hf(hf)
    stages = [from_hf(hf, pp_rank=r, pp_size=2) for r in range(2)]
    kinds = [(type(layer.self_attention).__name__, type(layer.mlp).__name__) for s in stages for layer in s.decoder.layers]
    assert kinds == [("PackedKimiDeltaAttention", "MLP"), ("PackedMLASelfAttention", "MoELayer"),
                     ("PackedKimiDeltaAttention", "MoELayer"), ("PackedKimiDeltaAttention", "MoELayer")]
    ids, mask = ragged_batch()
    for data_format, layout in (("thd", {"seq_align": 16}), ("bshd", {})):
        forward = make_forward(data_format, **layout)
        for m in (whole, *stages):
            m.zero_grad(set_to_none=True)
        want = forward(whole, ids, mask)
        (want.logsumexp(-1) * mask).sum().backward()
        hidden, handed, logits = run_stages(stages, forward, ids, mask)
        torch.testing.assert_close(logits, want, atol=1e-10, rtol=0, msg=data_format)
        (logits.logsumexp(-1) * mask).sum().backward()
        hidden.backward(handed.grad)
        got = {**_stage_grads(stages[0], 0), **_stage_grads(stages[1], 2)}
        assert sorted(got) == sorted(n for n, p in whole.named_parameters() if p.grad is not None)
        for name, p in whole.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(got[name], p.grad, atol=1e-10 * float(p.grad.abs().max()), rtol=0,
                                           msg=f"{data_format} {name}")
        staged = lambda m, *b: run_stages(stages, forward, *b)[2]  # noqa: E731
        load = torch.cat([expert_load(stages[0], forward, ids, mask), expert_load(stages[1], staged, ids, mask)])
        assert torch.equal(load, expert_load(whole, forward, ids, mask))
        assert load.sum() == 3 * TINY["num_experts_per_tok"] * mask.sum()  # three MoE layers, the real tokens
    forward = make_forward("thd")  # sequences packed in row order: row 1's tokens follow row 0's 5
    with torch.no_grad():
        hidden = forward(stages[0], ids, mask)
        hidden[5 + 40] += 0.1  # row 1, token 40
        stages[1].set_input_tensor(hidden)
        moved = (forward(stages[1], ids, mask) - forward(whole, ids, mask)).abs().amax(-1)
    assert moved[1, 40:150].min() > 1e-6 and not moved[1, :40].any()
    assert not moved[[0, 2, 3, 4]].any()


# ------------------------------------------------------------------------------------------------- the aux loss


def test_the_aux_loss_is_refused_and_the_load_is_transformers_choices_over_real_tokens():
    """Kimi-Linear balances its experts with the routing-only correction bias (sigmoid scores, DeepSeek-V3's
    router): transformers defines no load-balancing loss for it, so ``moe_aux_loss=True`` is refused naming the
    argument and the fix (on the whole model and on a pipeline stage), and the dense model is refused as having no
    MoE layers.  What a caller can read instead, the experts' load, is transformers' top-k choices counted by
    hand over each sequence's real tokens, in THD, THD aligned, BSHD and with more padding columns (2 groups of 4
    experts, top-2 from the best group: the load counts each expert, not only its group's pair).  Negative
    control: the correction bias flipped moves the load."""
    import importlib

    from .test_moe import expert_load, more_padding

    assert not hasattr(importlib.import_module(PATH), "load_balancing_loss_func")
    hf = hf_model("moe", n_group=2)
    model = from_hf(hf)
    ids, mask = ragged_batch()
    for m in (model, from_hf(hf, pp_rank=1, pp_size=2)):
        with pytest.raises(ValueError, match=r"moe_aux_loss=True on a model with sigmoid routing .* drop moe_aux_loss"):
            make_forward("thd", moe_aux_loss=True)(m, ids, mask)
    with pytest.raises(ValueError, match=r"moe_aux_loss=True on a model without MoE layers .* drop moe_aux_loss"):
        make_forward("thd", moe_aux_loss=True)(from_hf(hf_model("dense")), ids, mask)

    chosen = []  # transformers' top-k experts of each MoE layer, each sequence alone
    routers = [m for m in hf.modules() if type(m).__name__ == "KimiLinearTopkRouter"]
    hooks = [r.register_forward_hook(lambda m, a, out: chosen.append((m, out[2]))) for r in routers]
    try:
        with torch.no_grad():
            for i in range(ids.shape[0]):
                hf(ids[i][mask[i]][None])
    finally:
        for h in hooks:
            h.remove()
    want = torch.stack([sum(torch.bincount(top.flatten(), minlength=TINY["num_local_experts"])
                            for m, top in chosen if m is r) for r in routers])
    assert want.shape == (3, 8) and want.sum() == 3 * TINY["num_experts_per_tok"] * mask.sum()
    for data_format, layout in LAYOUTS[:3]:
        forward = make_forward(data_format, **layout)
        assert torch.equal(expert_load(model, forward, ids, mask), want), f"{data_format} {layout}"
        assert torch.equal(expert_load(model, forward, *more_padding(ids, mask)), want), f"{data_format} {layout}"
    flipped = hf_model("moe", n_group=2)
    for m in flipped.modules():
        if hasattr(m, "e_score_correction_bias"):
            m.e_score_correction_bias.neg_()
    assert not torch.equal(expert_load(from_hf(flipped), make_forward("thd"), ids, mask), want)


# ------------------------------------------------------------------------------------------------- two ranks


EP_ROWS = (slice(0, 3), slice(3, 5))  # each expert-parallel rank its own batch


def ep_batch(rank: int):
    """Rank 0: rows 0-2 of the ragged batch; rank 1: rows 3-4, their last 70 columns (a shape of its own)."""
    ids, mask = ragged_batch()
    ids, mask = ids[EP_ROWS[rank]], mask[EP_ROWS[rank]]
    return (ids, mask) if rank == 0 else (ids[:, -70:], mask[:, -70:])


def _ranks_worker(rank: int, world: int):
    """TP=2 + SP (THD, BSHD), then CP=2 (THD aligned), the dense model; then EP=2, the MoE model, each rank its
    own batch (:func:`ep_batch`): {case: this rank's logits}, and under EP its local experts per MoE layer and
    ``to_hf_state_dict``.  The models are made here, the same seeds (the lifted modeling module cannot be
    pickled to the children)."""
    hf, moe = hf_model("dense"), hf_model("moe")
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime import ensure_model_parallel

    ids, mask = ragged_batch()
    out = {}
    ensure_model_parallel(tp_size=2)
    model = from_hf(hf, tp_size=2, tp_rank=rank, sequence_parallel=True)
    with torch.no_grad():
        for data_format in ("thd", "bshd"):
            out[f"tp2_sp_{data_format}"] = make_forward(data_format, tp_size=2)(model, ids, mask)
    ps.destroy_model_parallel()
    ensure_model_parallel(cp_size=2)
    model = from_hf(hf)
    with torch.no_grad():
        out["cp2"] = make_forward("thd", seq_align=16, cp_size=2, cp_rank=ps.get_context_parallel_rank(),
                                  cp_group=ps.get_context_parallel_group())(model, ids, mask)
    ps.destroy_model_parallel()
    ensure_model_parallel(ep_size=2)
    model = from_hf(moe, ep_size=2, ep_rank=rank)
    with torch.no_grad():
        out["ep2"] = make_forward("thd", seq_align=16)(model, *ep_batch(rank))
    out["ep2_experts"] = [len(layer.mlp.experts.local_experts) for layer in model.decoder.layers[1:]]
    out["ep2_state"] = to_hf_state_dict(model)
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    """One ``run_local`` over gloo for every two-rank case (the ranks' start-up is most of the cost)."""
    from packfwd.testing import run_local

    return run_local(_ranks_worker, 2, backend="gloo", timeout=300)


def test_tp2_sp_and_cp2_equal_transformers(two_ranks):
    """Over gloo: TP=2 with sequence parallelism (each rank half the KDA heads, the low-rank gates' down
    projections gathered; THD and BSHD) and CP=2 (each rank whole sequences of one KDA head, zigzag MLA)."""
    hf = hf_model("dense")
    ranks = two_ranks
    ids, mask = ragged_batch()
    for data_format in ("thd", "bshd"):
        logits = torch.cat([r[f"tp2_sp_{data_format}"] for r in ranks], -1)  # each rank its vocabulary half
        assert_equals_hf_per_sequence(hf, logits, ids, mask, atol=1e-10)
    torch.testing.assert_close(ranks[0]["cp2"], ranks[1]["cp2"], atol=0, rtol=0)
    assert_equals_hf_per_sequence(hf, ranks[0]["cp2"], ids, mask, atol=1e-10)


def test_ep2_equals_one_process_and_transformers(two_ranks):
    """Over gloo, EP=2 (4 of the 8 routed experts per rank; KDA, MLA, the dense layer, the shared expert and the
    correction bias replicated), each rank a batch of its own shape (THD aligned): its logits equal one process's
    to 1e-6 (Megatron-Core combines the experts' output in the float32 router dtype across ranks: ~3e-7) and
    transformers' per sequence to the MoE tolerance; each rank's ``to_hf_state_dict`` gathers the whole state
    bitwise.  Negative control: one process with the other rank's experts (4-7) changed by 1% gives logits
    beyond that 1e-6 on rank 0's batch, so its tokens reached rank 1's experts."""
    hf = hf_model("moe")
    sd = hf.state_dict()
    one = from_hf(hf)
    forward = make_forward("thd", seq_align=16)
    for rank, r in enumerate(two_ranks):
        ids, mask = ep_batch(rank)
        assert r["ep2_experts"] == [4, 4, 4]
        with torch.no_grad():
            torch.testing.assert_close(r["ep2"], forward(one, ids, mask), atol=1e-6, rtol=0, msg=f"rank {rank}")
        assert_equals_hf_per_sequence(hf, r["ep2"], ids, mask, **ATOL["moe"])
        assert sorted(r["ep2_state"]) == sorted(sd) and all(torch.equal(r["ep2_state"][n], t) for n, t in sd.items())
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "experts"):
                layer.mlp.experts.down_proj[4:] *= 1.01
        ids, mask = ep_batch(0)
        assert (forward(from_hf(hf), ids, mask) - two_ranks[0]["ep2"]).abs().amax() > 1e-4
