"""Mixture-of-Experts models (Qwen3-MoE, Mixtral) against transformers, and MoE under packing.

Strategy: tiny float64 models with O(1)-scale random weights (every matrix ~ N(0, 1/fan_in), norms ~ 1 + noise,
so the router logits are O(1) and the top-k choice is never a near tie).  The reference is transformers run on
each sequence alone; packfwd runs the whole ragged batch (left and right padding, a length-1 row) packed (THD,
also with alignment padding) or compacted (BSHD).  Both sides compute the routing softmax in float32
(transformers' routers and Megatron-Core's ``topk_routing_with_score_function`` do), so logits agree to ~1e-6,
not to float64 precision.  Weights convert both ways bit for bit.

MoE under packing: the experts' load (the tokens each expert is handed, read off Megatron-Core's
``SequentialMLP``), the load-balancing loss and its gradients do not change when padding columns, rows or
alignment slots are added, and the loss equals transformers' ``load_balancing_loss_func`` on the padded batch.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from packfwd.forward import make_forward
from packfwd.layout import plan_bshd, plan_thd, to_bshd, to_thd
from packfwd.models import from_hf, to_hf_state_dict
from packfwd.models.runtime.gpt import model_args
from packfwd.models.convert.hf import args_from_hf_config
from packfwd.models.convert.hf_weights import hf_to_megatron, megatron_to_hf

from .oracles import assert_equals_hf_per_sequence

V = 64
TINY = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
            num_experts_per_tok=2, experts_implementation="eager")
CONFIGS = {  # name: (config, model class); each MoE layer has 4 experts, top-2
    "qwen3_moe-norm": (Qwen3MoeConfig, dict(intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                             norm_topk_prob=True, mlp_only_layers=[1], head_dim=16)),
    "qwen3_moe-unnormalised-step2": (Qwen3MoeConfig, dict(intermediate_size=48, moe_intermediate_size=16,
                                                          num_experts=4, norm_topk_prob=False, decoder_sparse_step=2,
                                                          head_dim=8, tie_word_embeddings=True)),
    "mixtral": (MixtralConfig, dict(intermediate_size=16, num_local_experts=4)),
    "qwen2_moe": (Qwen2MoeConfig, dict(intermediate_size=48, moe_intermediate_size=16, num_experts=4,  # a gated
                                       shared_expert_intermediate_size=24, mlp_only_layers=[2])),   # shared expert
}
CAUSAL_LM = {Qwen3MoeConfig: Qwen3MoeForCausalLM, MixtralConfig: MixtralForCausalLM,
             Qwen2MoeConfig: Qwen2MoeForCausalLM}
LAYOUTS = [("thd", {}), ("thd", {"seq_align": 8}), ("bshd", {})]


def randomise(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """O(1)-scale weights: each matrix row ~ N(0, 1 / fan_in), norms 1 + noise (float64)."""
    g = torch.Generator().manual_seed(seed)
    model = model.double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else noise * p.shape[-1] ** -0.5)
    return model.eval()


def hf_model(name: str, seed: int = 0):
    config_cls, extra = CONFIGS[name]
    return randomise(CAUSAL_LM[config_cls](config_cls(**TINY, **extra)), seed)


def ragged_batch(seed: int = 0):
    """ids [4, 9]: lengths 9, 5 (left-padded), 1, 6 (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(4, 9, dtype=torch.bool)
    mask[0], mask[1, 4:], mask[2, 3], mask[3, :6] = True, True, True, True
    return torch.randint(1, V, (4, 9), generator=g).masked_fill(~mask, 0), mask


def more_padding(ids, mask):
    """The same sequences with two padding columns on each side and an empty row between rows 1 and 2."""
    cols = torch.zeros(ids.shape[0], 2, dtype=ids.dtype)
    ids = torch.cat([cols, ids, cols], 1)
    mask = torch.cat([cols.bool(), mask, cols.bool()], 1)
    empty = torch.zeros(1, ids.shape[1], dtype=ids.dtype)
    return torch.cat([ids[:2], empty, ids[2:]]), torch.cat([mask[:2], empty.bool(), mask[2:]])


@pytest.mark.parametrize("data_format, layout", LAYOUTS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers_per_sequence(name, data_format, layout):
    hf = hf_model(name)
    model = from_hf(hf)
    ids, mask = ragged_batch()
    with torch.no_grad():
        logits = make_forward(data_format, **layout)(model, ids, mask)
    assert_equals_hf_per_sequence(hf, logits, ids, mask, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_weights_round_trip_bitwise(name):
    hf = hf_model(name)
    state, want = to_hf_state_dict(from_hf(hf)), hf.state_dict()
    assert sorted(state) == sorted(want)
    assert all(torch.equal(state[k], v) for k, v in want.items())


def test_tp_shards_of_the_experts():
    hf = hf_model("qwen3_moe-norm")
    args, sd = args_from_hf_config(hf.config), hf.state_dict()
    shards = [hf_to_megatron(sd, args, tp_size=2, tp_rank=r) for r in (0, 1)]
    fc1 = shards[1]["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]  # [gate_1; up_1] of expert 3
    gate, up = sd["model.layers.0.mlp.experts.gate_up_proj"][3].chunk(2)
    assert torch.equal(fc1, torch.cat([gate[8:], up[8:]]))
    fc2 = shards[0]["decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight"]
    assert torch.equal(fc2, sd["model.layers.2.mlp.experts.down_proj"][1][:, :8])
    assert torch.equal(shards[1]["decoder.layers.0.mlp.router.weight"], sd["model.layers.0.mlp.gate.weight"])
    back = megatron_to_hf(shards, args)
    assert sorted(back) == sorted(sd) and all(torch.equal(back[k], v) for k, v in sd.items())


def test_tp_shards_of_the_gated_shared_expert():
    """Qwen2-MoE: the shared expert TP-sharded like a dense MLP, its sigmoid gate replicated; back bit for bit."""
    hf = hf_model("qwen2_moe")
    args, sd = args_from_hf_config(hf.config), hf.state_dict()
    assert args.moe.shared_expert_gate and args.moe.shared_ffn_hidden_size == 24 and args.moe.dense_layers == (2,)
    shards = [hf_to_megatron(sd, args, tp_size=2, tp_rank=r) for r in (0, 1)]
    for r in (0, 1):
        assert torch.equal(shards[r]["decoder.layers.1.mlp.shared_experts.gate_weight"],
                           sd["model.layers.1.mlp.shared_expert_gate.weight"])
        fc1 = shards[r]["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"]
        gate, up = (sd[f"model.layers.1.mlp.shared_expert.{n}_proj.weight"][12 * r:12 * (r + 1)] for n in ("gate", "up"))
        assert torch.equal(fc1, torch.cat([gate, up]))
    back = megatron_to_hf(shards, args)
    assert sorted(back) == sorted(sd) and all(torch.equal(back[k], v) for k, v in sd.items())
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=0"):
        args_from_hf_config(Qwen2MoeConfig(**TINY, **{**CONFIGS["qwen2_moe"][1], "shared_expert_intermediate_size": 0}))


def test_config_reads_the_moe_choices():
    qwen = model_args(from_hf(hf_model("qwen3_moe-unnormalised-step2")))
    assert qwen.moe.dense_layers == (0, 2) and not qwen.moe.normalize_top_k and qwen.moe.ffn_hidden_size == 16
    assert qwen.ffn_hidden_size == 48
    config = from_hf(hf_model("qwen3_moe-norm")).config
    assert config.moe_layer_freq == [1, 0, 1] and not config.moe_router_pre_softmax
    assert config.moe_router_load_balancing_type == "none" and config.moe_expert_capacity_factor is None
    mixtral = from_hf(hf_model("mixtral")).config
    assert (mixtral.num_moe_experts, mixtral.moe_router_topk, mixtral.moe_ffn_hidden_size) == (4, 2, 16)


@pytest.mark.parametrize("name", ["qwen3_moe-norm", "mixtral"])
def test_one_expert_per_token_renormalised_is_built_exactly(name):
    """``num_experts_per_tok=1`` with renormalisation (Qwen3-MoE's ``norm_topk_prob=True``; Mixtral always): every
    routing weight is 1 in transformers (``p / p``) and in packfwd (Megatron-Core's softmax over the one kept logit;
    its config refuses the pair, ``MixtureOfExperts.finish_config`` sets it after).  Logits equal transformers' per
    sequence, and the router's gate gets no gradient from the logits (its weight is a constant 1; transformers' only
    the rounding of the float32 ``p / p``)."""
    config_cls, extra = CONFIGS[name]
    hf = randomise(CAUSAL_LM[config_cls](config_cls(**{**TINY, "num_experts_per_tok": 1}, **extra)))
    model = from_hf(hf)
    assert model.config.moe_router_topk == 1 and not model.config.moe_router_pre_softmax
    ids, mask = ragged_batch()
    logits = make_forward("thd", seq_align=8)(model, ids, mask)
    assert_equals_hf_per_sequence(hf, logits.detach(), ids, mask, atol=2e-5, rtol=1e-5)
    logits[mask].square().sum().backward()
    hf(ids[0][mask[0]][None]).logits.square().sum().backward()
    moe_layer = 0  # a MoE layer in both configs
    assert model.decoder.layers[moe_layer].mlp.router.weight.grad.abs().max() == 0
    assert hf.model.layers[moe_layer].mlp.gate.weight.grad.abs().max() < 1e-5
    assert model.decoder.layers[moe_layer].self_attention.linear_qkv.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("config, message", [
    (Qwen3MoeConfig(**{**TINY, "num_experts_per_tok": 5}, **CONFIGS["qwen3_moe-norm"][1]),
     "num_experts_per_tok=5 exceeds num_experts=4"),
    (MixtralConfig(**{**TINY, "num_experts_per_tok": 0}, **CONFIGS["mixtral"][1]),
     "num_experts_per_tok=0: pass an int"),
    (Qwen2MoeConfig(**TINY, **{**CONFIGS["qwen2_moe"][1], "moe_intermediate_size": 0}), "moe_intermediate_size=0"),
])
def test_refusals_of_a_config_name_its_flags(config, message):
    """A from_hf user never sets packfwd's ``Moe`` fields: a refused MoE config names the config's flags."""
    with pytest.raises(ValueError, match=message) as refused:
        args_from_hf_config(config)
    assert "Moe." not in str(refused.value)


@pytest.mark.parametrize("flag, value", [("router_jitter_noise", 0.1), ("sliding_window", 4)])
def test_mixtral_choices_packfwd_cannot_build_are_refused(flag, value):
    with pytest.raises(ValueError, match=flag):
        args_from_hf_config(MixtralConfig(**TINY, **{**CONFIGS["mixtral"][1], flag: value}))


@pytest.mark.parametrize("layout", [dict(seq_align=8), dict(cp_size=2, cp_rank=1), dict(tp_size=4)])
def test_plans_know_their_padding_slots(layout):
    """The plan's ``padding_mask()`` is True exactly where packing the mask itself gives False (a pad slot)."""
    ids, mask = ragged_batch()
    info = plan_thd(mask, **layout)
    assert torch.equal(info.padding_mask(), ~to_thd(mask, info)[0][None])
    wide = plan_bshd(mask, tp_size=layout.get("tp_size", 1))
    assert torch.equal(wide.padding_mask(), ~to_bshd(mask, wide)[0])


def test_the_router_names_a_mask_of_the_wrong_shape():
    """Megatron-Core checks the mask's shape on the first pipeline stage only; the router checks it everywhere."""
    router = from_hf(hf_model("mixtral")).decoder.layers[0].mlp.router
    with pytest.raises(ValueError, match="padding_mask covers 6 tokens per row but this MoE layer routes 5"):
        router(torch.randn(5, 2, 32, dtype=torch.float64), torch.zeros(6, 2, dtype=torch.bool))


def expert_load(model, forward, ids, mask):
    """Tokens handed to each expert of each MoE layer ([layers, E]), read where Megatron-Core's experts run."""
    from megatron.core.transformer.moe.experts import SequentialMLP  # packfwd's GroupedExperts is one

    loads = []
    hooks = [m.register_forward_pre_hook(lambda m, a: loads.append(a[1].clone()))
             for m in model.modules() if isinstance(m, SequentialMLP)]
    try:
        with torch.no_grad():
            forward(model, ids, mask)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(loads)


def test_padding_is_never_routed():
    """Without the plan's mask every slot is routed: 256 at seq_align=64 for the batch's 21 real tokens."""
    model = from_hf(hf_model("qwen3_moe-norm"))
    ids, mask = ragged_batch()
    want = expert_load(model, make_forward("thd"), ids, mask)
    assert want.sum() == 2 * 2 * mask.sum()  # two MoE layers, top-2, real tokens only
    wide_ids, wide_mask = more_padding(ids, mask)
    for data_format, layout in [("thd", {"seq_align": 8}), ("thd", {"seq_align": 64}), ("bshd", {})]:
        for batch in ((ids, mask), (wide_ids, wide_mask)):
            got = expert_load(model, make_forward(data_format, **layout), *batch)
            assert torch.equal(got, want), (data_format, layout)


def hf_aux_loss(hf, ids, mask):
    out = hf(ids, attention_mask=mask.long(), output_router_logits=True)
    return load_balancing_loss_func(out.router_logits, hf.config.num_experts, 2, mask.long())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_aux_loss_equals_transformers_and_ignores_padding(name):
    hf = hf_model(name)
    model = from_hf(hf)
    ids, mask = ragged_batch()
    with torch.no_grad():
        want = hf_aux_loss(hf, ids, mask).double()
        assert torch.allclose(hf_aux_loss(hf, *more_padding(ids, mask)).double(), want, rtol=1e-6)
        for data_format, layout in [*LAYOUTS, ("thd", {"seq_align": 64})]:
            forward = make_forward(data_format, moe_aux_loss=True, **layout)
            out = forward(model, ids, mask)
            assert sorted(out) == ["logits", "moe_aux_loss"]
            torch.testing.assert_close(out["moe_aux_loss"], want, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(forward(model, *more_padding(ids, mask))["moe_aux_loss"], out["moe_aux_loss"],
                                       atol=1e-12, rtol=1e-12)


def test_aux_loss_gradients_equal_transformers():
    hf = hf_model("mixtral")
    model = from_hf(hf)
    ids, mask = ragged_batch()
    hf_aux_loss(hf, ids, mask).backward()
    make_forward("thd", seq_align=8, moe_aux_loss=True)(model, ids, mask)["moe_aux_loss"].backward()
    for i in range(3):
        want = hf.model.layers[i].mlp.gate.weight.grad
        got = model.decoder.layers[i].mlp.router.weight.grad
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    want = hf.model.layers[0].self_attn.q_proj.weight.grad  # flows back through the router's input
    got = model.decoder.layers[0].self_attention.linear_qkv.weight.grad
    assert got.abs().sum() > 0 and want.abs().sum() > 0


def test_aux_loss_with_a_processor_and_the_refusals():
    model = from_hf(hf_model("mixtral"))
    ids, mask = ragged_batch()

    def hit(logits, labels):
        return {"hit": logits.gather(-1, labels[:, None])[:, 0]}

    out = make_forward("bshd", logits_processor=hit, moe_aux_loss=True)(model, ids, mask, labels=ids)
    assert sorted(out) == ["hit", "moe_aux_loss"] and out["hit"].shape == ids.shape
    dense = from_hf(randomise(Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY, intermediate_size=48, num_experts=4,
                                                                   mlp_only_layers=[0, 1, 2]))))
    with pytest.raises(ValueError, match="without MoE layers"):
        make_forward("thd", moe_aux_loss=True)(dense, ids, mask)


@pytest.mark.parametrize("flag", ["moe_aux_loss", "record_routing", "mtp"])
@pytest.mark.parametrize("value", [2, "yes", None])
def test_make_forward_names_a_flag_that_is_not_a_bool(flag, value):
    """``moe_aux_loss=2`` built two aux-loss extensions (the call then raised "routing_stats is already open");
    ``"yes"`` or None raised "can't multiply sequence by non-int" (the extensions are repeated by the flag).
    Refused when the forward is made, naming the flag, as ``deterministic`` and ``scored_only`` are."""
    with pytest.raises(TypeError, match=f"{flag} must be a bool, got {type(value).__name__}"):
        make_forward("thd", **{flag: value})


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_aux_loss_composes_with_mtp(data_format):
    """``moe_aux_loss=True`` with ``mtp=True`` (two extensions of one engine): the loss pools the decoder's MoE
    layers as transformers does (an MTP block's MoE layer, which transformers never runs, is not pooled), so it
    equals transformers' and the MTP-less model's; the MTP outputs equal the MTP forward's without the loss."""
    import dataclasses

    from packfwd.models import build_model

    hf = hf_model("mixtral")
    plain = from_hf(hf)
    # initialised, not init=False: the MTP block is not in the checkpoint, and uninitialised memory can hold NaN
    # (NaN != NaN: the bitwise comparison below then failed or passed by what the allocator handed back)
    model = build_model(dataclasses.replace(model_args(plain), mtp_num_layers=1),
                        params_dtype=plain.config.params_dtype)
    missing, unexpected = model.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith("mtp.") for k in missing)
    ids, mask = ragged_batch()
    with torch.no_grad():
        want = hf_aux_loss(hf, ids, mask).double()
        both = make_forward(data_format, mtp=True, moe_aux_loss=True)(model, ids, mask)
        mtp_only = make_forward(data_format, mtp=True)(model, ids, mask)
    assert sorted(both) == ["logits", "moe_aux_loss", "mtp_log_probs", "mtp_loss"]
    torch.testing.assert_close(both["moe_aux_loss"], want, atol=1e-6, rtol=1e-6)
    for name in mtp_only:
        assert torch.equal(both[name], mtp_only[name]), name


def test_an_empty_batch_has_zero_aux_loss():
    model = from_hf(hf_model("mixtral"))
    ids, mask = ragged_batch()
    out = make_forward("thd", moe_aux_loss=True)(model, ids, torch.zeros_like(mask))
    assert out["moe_aux_loss"].item() == 0.0 and not out["logits"].any()


def test_an_empty_micro_batch_keeps_the_aux_losss_dtype():
    """An all-padding batch's aux loss was a float32 0 in a float64 model (every other batch's is the routers'
    score dtype), and ``StepResult.moe_aux_loss`` takes its first micro-batch's dtype: a plan whose first
    micro-batch held only empty sequences reported the float64 loss rounded to float32."""
    from packfwd.micro import plan_micro_batches, run_micro_batches

    model = from_hf(hf_model("mixtral"))
    ids, mask = ragged_batch()
    forward = make_forward("thd", moe_aux_loss=True)
    with torch.no_grad():
        assert forward(model, ids, torch.zeros_like(mask))["moe_aux_loss"].dtype == torch.float64
    ids, mask = torch.cat([ids[:1] * 0, ids]), torch.cat([mask[:1] & False, mask])  # an empty sequence first
    plan = plan_micro_batches(mask.sum(1).tolist(), max_tokens=10, min_micro_batches=5, **forward.layout.plan_args)
    assert not any(mask[i].any() for i in plan.micro_batches[0][0])  # the first micro-batch: the empty one
    got = run_micro_batches(forward, model, plan, ids, mask, dp_rank=0)
    with torch.no_grad():
        want = sum(forward(model, ids[g], mask[g])["moe_aux_loss"] * mask[g].sum()
                   for g in plan.micro_batches[0] if mask[g].any()) / mask.sum()
    assert got.moe_aux_loss.dtype == torch.float64
    torch.testing.assert_close(got.moe_aux_loss, want, atol=1e-12, rtol=1e-12)


def _parallel_worker(rank: int, world: int, hf, layouts):
    """Per layout ``(name, tp, cp)`` (TP with sequence parallelism): this rank's logits, aux loss, router grads."""
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime.cpu import host_collectives
    from packfwd.models.runtime import ensure_model_parallel

    results = {}
    for name, tp, cp in layouts:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ensure_model_parallel(tp_size=tp, cp_size=cp)
        tp_rank, cp_rank = ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank()
        model = from_hf(hf, tp_size=tp, tp_rank=tp_rank, sequence_parallel=tp > 1)
        forward = make_forward("thd", tp_size=tp, cp_size=cp, cp_rank=cp_rank, moe_aux_loss=True,
                               cp_group=ps.get_context_parallel_group() if cp > 1 else None)
        out = forward(model, *ragged_batch())
        with host_collectives():  # under TP each rank's logits are its vocabulary half: their sums add up
            (out["moe_aux_loss"] + out["logits"].sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if n.endswith(GATES)}
        results[name] = dict(logits=out["logits"].detach(), loss=out["moe_aux_loss"].detach(), grads=grads)
    ps.destroy_model_parallel()
    return results


GATES = ("router.weight", "shared_experts.gate_weight")  # the gradients the parallel test compares


@pytest.mark.parametrize("name", ["qwen3_moe-norm", "qwen2_moe", "mixtral"])
def test_tp2_sp_and_cp2_over_gloo_equal_one_process(name):
    """Sequence-parallel TP=2 routes each rank's half of the tokens (the plan's pads cut with them), CP=2 each
    rank's zigzag share: logits and aux loss equal the single process's, the gradients of the routers (of the aux
    loss) and of Qwen2-MoE's shared-expert gates (replicated over TP: of the logits' part of it) sum to its."""
    from packfwd.testing import run_local

    hf = hf_model(name)
    model = from_hf(hf)
    out = make_forward("thd", moe_aux_loss=True)(model, *ragged_batch())
    (out["moe_aux_loss"] + out["logits"].sum()).backward()
    want = {n: p.grad for n, p in model.named_parameters() if n.endswith(GATES)}
    assert len(want) == {"qwen3_moe-norm": 2, "qwen2_moe": 4, "mixtral": 3}[name]  # routers (and gates)
    ranks = run_local(_parallel_worker, 2, hf, [("tp2_sp", 2, 1), ("cp2", 1, 2)], backend="gloo", timeout=300)
    tp = [r["tp2_sp"] for r in ranks]
    torch.testing.assert_close(torch.cat([r["logits"] for r in tp], -1), out["logits"].detach(), atol=1e-10, rtol=0)
    for layout in ("tp2_sp", "cp2"):
        got = [r[layout] for r in ranks]
        for r in got:
            torch.testing.assert_close(r["loss"], out["moe_aux_loss"].detach(), atol=1e-12, rtol=1e-12)
        for name, grad in want.items():
            torch.testing.assert_close(got[0]["grads"][name] + got[1]["grads"][name], grad, atol=1e-12, rtol=1e-10)
    for r in ranks:
        torch.testing.assert_close(r["cp2"]["logits"], out["logits"].detach(), atol=1e-10, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_logits_load_and_aux_loss():
    """The same model on a GPU (float32): Megatron-Core's MoE layer, packfwd's router and the loss run there."""
    hf = hf_model("qwen3_moe-norm").float().cuda()
    model = from_hf(hf)
    ids, mask = (x.cuda() for x in ragged_batch())
    with torch.no_grad():
        out = make_forward("thd", seq_align=8, moe_aux_loss=True)(model, ids, mask)
        for i in range(ids.shape[0]):
            want = hf(ids[i][mask[i]][None]).logits[0]
            torch.testing.assert_close(out["logits"][i][mask[i]], want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out["moe_aux_loss"], hf_aux_loss(hf, ids, mask), atol=1e-5, rtol=1e-5)
    load = expert_load(model, make_forward("thd", seq_align=64), ids, mask)
    assert load.sum() == 2 * 2 * mask.sum()


def test_verls_engine_forward_honours_router_padding_mask():
    """packfwd.verl's nested forward hands verl's ``router_padding_mask`` [1, t] to the model: those slots are
    routed nowhere (verl sets it for dynamic CP's padding); the logits of the other tokens do not change."""
    from packfwd.verl import gptmodel_forward_model_engine

    model = from_hf(hf_model("mixtral"))
    ids, mask = ragged_batch()
    nested = torch.nested.nested_tensor([ids[i][mask[i]] for i in range(4)], layout=torch.jagged)
    pads = torch.zeros(1, int(mask.sum()), dtype=torch.bool)
    pads[0, 9:14] = True  # the second sequence's 5 tokens
    with torch.no_grad():
        plain = gptmodel_forward_model_engine(model, nested, {})
        masked = gptmodel_forward_model_engine(model, nested, {}, router_padding_mask=pads)
    load = expert_load(model, lambda m, *_: gptmodel_forward_model_engine(m, nested, {}, router_padding_mask=pads),
                       None, None)
    assert load.sum() == 3 * 2 * (mask.sum() - 5)  # three MoE layers, top-2
    for i in (0, 2, 3):
        torch.testing.assert_close(masked[i], plain[i], atol=1e-12, rtol=0)


def test_run_micro_batches_weighs_each_micro_batch_by_its_tokens():
    """``StepResult.moe_aux_loss`` is ``sum_m loss_m * n_m / N`` (the loss does not split over micro-batches: it
    pools counts and scores); one micro-batch gives the whole batch's loss.  A ``loss_fn`` that adds it to every
    token backpropagates exactly that."""
    from packfwd.micro import plan_micro_batches, run_micro_batches

    model = from_hf(hf_model("mixtral"))
    ids, mask = ragged_batch()
    forward = make_forward("thd", moe_aux_loss=True)
    whole = forward(model, ids, mask)["moe_aux_loss"]
    one = plan_micro_batches(mask.sum(1).tolist(), max_tokens=64, **forward.layout.plan_args)
    got = run_micro_batches(forward, model, one, ids, mask, dp_rank=0)
    torch.testing.assert_close(got.moe_aux_loss, whole.detach())
    plan = plan_micro_batches(mask.sum(1).tolist(), max_tokens=10, **forward.layout.plan_args)
    groups = [g for g in plan.micro_batches[0] if g]
    assert len(groups) > 1
    want = sum(forward(model, ids[g], mask[g])["moe_aux_loss"] * mask[g].sum() for g in groups) / mask.sum()
    want.backward()
    want_grad = model.decoder.layers[1].mlp.router.weight.grad.clone()
    model.zero_grad()
    got = run_micro_batches(forward, model, plan, ids, mask, dp_rank=0,
                            loss_fn=lambda out: out["moe_aux_loss"].expand(out["logits"].shape[:2]))
    torch.testing.assert_close(got.moe_aux_loss, want.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got.loss, want.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(model.decoder.layers[1].mlp.router.weight.grad, want_grad, atol=1e-12, rtol=1e-10)
    assert "moe_aux_loss" not in got.outputs and got.outputs["logits"].shape == (*ids.shape, V)


def test_the_steps_aux_loss_is_detached_and_a_loss_fn_weighs_it_by_loss_tokens():
    """What docs/moe.md tells a trainer: ``StepResult.moe_aux_loss`` is detached (a value to log: added to a loss
    after the step it gives no gradient, the docs once said to train on it so), and a ``loss_fn`` adding
    ``out["moe_aux_loss"]`` to every token backpropagates the micro-batches' losses weighted by their *loss*
    tokens: with ``labels=`` (each sequence's last token has none) that is not the reported real-token weighting."""
    from packfwd.logits import log_probs_and_entropy
    from packfwd.micro import plan_micro_batches, run_micro_batches
    from packfwd.layout import next_token_labels

    model = from_hf(hf_model("mixtral"))
    ids, mask = ragged_batch()
    labels = next_token_labels(ids, mask)
    forward = make_forward("thd", logits_processor=log_probs_and_entropy, moe_aux_loss=True)
    plan = plan_micro_batches(mask.sum(1).tolist(), max_tokens=10, **forward.layout.plan_args)
    groups = [g for g in plan.micro_batches[0] if g]
    assert len(groups) > 1
    with torch.no_grad():
        losses = [forward(model, ids[g], mask[g], labels=labels[g])["moe_aux_loss"] for g in groups]
    scored = [(labels[g] >= 0).sum() for g in groups]
    got = run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, labels=labels,
                            loss_fn=lambda out: out["moe_aux_loss"].expand(out["log_probs"].shape))
    assert not got.moe_aux_loss.requires_grad and got.moe_aux_loss.grad_fn is None
    by_real = sum(loss * mask[g].sum() for loss, g in zip(losses, groups)) / mask.sum()
    by_scored = sum(loss * n for loss, n in zip(losses, scored)) / (labels >= 0).sum()
    torch.testing.assert_close(got.moe_aux_loss, by_real, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got.loss, by_scored, atol=1e-12, rtol=1e-12)
    assert (got.loss - got.moe_aux_loss).abs() > 1e-4


def test_a_dp_rank_without_sequences_reports_a_zero_aux_loss():
    """A plan with fewer sequences than DP ranks leaves a rank nothing to run: its ``StepResult.moe_aux_loss`` was
    None (the docstring: None only without ``moe_aux_loss=True``), so summing or all-reducing the ranks' values over
    DP failed on that rank alone.  It is its share, 0, and the ranks' values add up to the whole batch's."""
    from packfwd.micro import plan_micro_batches, run_micro_batches

    model = from_hf(hf_model("mixtral"))
    ids, mask = ragged_batch()
    ids, mask = ids[:3], mask[:3]
    forward = make_forward("thd", moe_aux_loss=True)
    plan = plan_micro_batches(mask.sum(1).tolist(), max_tokens=16, dp_size=4, **forward.layout.plan_args)
    results = [run_micro_batches(forward, model, plan, ids, mask, dp_rank=r) for r in range(4)]
    empty = [r for r in results if r.outputs is None]
    assert len(empty) == 1 and empty[0].moe_aux_loss is not None and empty[0].moe_aux_loss == 0
    assert {r.moe_aux_loss.dtype for r in results} == {torch.float64}  # one dtype: an all-reduce over DP
    with torch.no_grad():
        want = sum(forward(model, ids[[i]], mask[[i]])["moe_aux_loss"] * mask[i].sum() for i in range(3)) / mask.sum()
    torch.testing.assert_close(sum(r.moe_aux_loss for r in results).double(), want, atol=1e-12, rtol=1e-12)
