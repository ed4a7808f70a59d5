"""DeepSeek-V3-style Mixture-of-Experts in packfwd's MoE kind, against transformers' ``DeepseekV3MoE``.

The routing: sigmoid scores; the routing-only correction bias (``e_score_correction_bias``, Megatron-Core's
``expert_bias``) added for the choice of experts, not to their weights; the experts searched in the best
``topk_group`` of ``n_group`` groups; the k chosen sigmoids renormalised and times ``routed_scaling_factor``;
shared experts every token also goes through; the first ``first_k_dense_replace`` layers dense.

Strategy: transformers' ``DeepseekV3MoE`` block and packfwd's MoE layer (Megatron-Core's ``MoELayer`` built from
``Moe(**deepseek_moe_fields(config))``) hold the same O(1)-scale float64 weights and a nonzero float32 correction
bias, and are given the same hidden states ``[b, s, h]`` with padding slots: outputs equal at the real tokens (both
route in float32, so to ~1e-6), the pads routed nowhere, the real tokens' outputs unchanged by the mask.  The bias
and the groups change the choice of some tokens (checked on transformers' router), so a router ignoring either
fails.  A whole DeepSeek-V3 model needs multi-head latent attention, which packfwd does not build: the whole-model
check puts the DeepSeek block into a Qwen3 decoder (GQA, QK-norm) on both sides, dense first layer included, and
runs it packed (THD, THD with alignment, BSHD) against transformers per sequence.  Weights convert both ways bit
for bit, whole and in TP=2 shards.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import DeepseekV3Config, Qwen3Config, Qwen3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP, DeepseekV3MoE

from packfwd.forward import make_forward
from packfwd.models.mlp import Moe, mlp_kind
from packfwd.models.families.deepseek_v3 import deepseek_moe_fields, read_moe
from packfwd.models.mlp.router import PackedRouter

from .oracles import assert_equals_hf_per_sequence
from .test_moe import expert_load, ragged_batch, randomise

H, V = 32, 64
DEEPSEEK = {  # name: DeepseekV3Config fields of the MoE (8 experts of width 16)
    "groups": dict(n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                   routed_scaling_factor=2.5),
    "two-shared-no-groups": dict(n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                                 n_shared_experts=2, routed_scaling_factor=1.0),
}


def deepseek_config(name: str, num_layers: int = 1, first_dense: int = 0) -> DeepseekV3Config:
    return DeepseekV3Config(hidden_size=H, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=num_layers,
                            num_attention_heads=4, vocab_size=V, first_k_dense_replace=first_dense,
                            norm_topk_prob=True, experts_implementation="eager", **DEEPSEEK[name])


def hf_block(cfg: DeepseekV3Config, seed: int = 0) -> DeepseekV3MoE:
    """transformers' block, float64 O(1) weights, a float32 correction bias (its checkpoint dtype) of scale 0.3."""
    block = randomise(DeepseekV3MoE(cfg), seed)
    g = torch.Generator().manual_seed(seed + 1)
    block.gate.e_score_correction_bias.data = 0.3 * torch.randn(cfg.n_routed_experts, generator=g)
    return block


def moe_args(cfg: DeepseekV3Config, **fields):
    from packfwd.models.args import ModelArgs

    return ModelArgs(vocab_size=V, hidden_size=H, ffn_hidden_size=cfg.intermediate_size,
                     num_layers=cfg.num_hidden_layers, num_attention_heads=4, moe=Moe(**deepseek_moe_fields(cfg)),
                     **fields)


def packfwd_block(block: DeepseekV3MoE, cfg: DeepseekV3Config, layer: int = 0):
    """packfwd's MoE layer of global layer ``layer`` (Megatron-Core's MoELayer, float64) with ``block``'s weights,
    converted by the MoE kind as a whole model's layer would be."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from packfwd.models.runtime import transformer_config
    from packfwd.models.convert.hf import load_weights
    from packfwd.models.runtime import ensure_model_parallel
    from packfwd.models.runtime.spec import mlp_spec

    ensure_model_parallel()
    args = moe_args(cfg)
    config = transformer_config(args, params_dtype=torch.float64, init=False)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    moe = build_module(mlp_spec(args, layer), config=config, pg_collection=groups)
    hf = {f"model.layers.{layer}.mlp.{k}": v for k, v in block.state_dict().items()}
    weights = mlp_kind(args.moe).hf_to_megatron(args, hf, f"model.layers.{layer}.", "", tp_size=1, tp_rank=0)
    return load_weights(moe, {k.removeprefix("mlp."): v for k, v in weights.items()}).eval()


def hidden_batch(seed: int = 0):
    """Hidden states [4, 9, H] (O(1), the padding slots too) and the ragged mask of tests/test_moe.py."""
    _, mask = ragged_batch(seed)
    return torch.randn(*mask.shape, H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64), mask


def sbh(x):
    """``[b, s, h]`` as Megatron-Core's layers take it: ``[s, b, h]``, contiguous."""
    return x.transpose(0, 1).contiguous()


@pytest.mark.parametrize("name", sorted(DEEPSEEK))
def test_block_equals_transformers_and_routes_no_pad(name):
    cfg = deepseek_config(name)
    block = hf_block(cfg)
    layer = packfwd_block(block, cfg)
    x, mask = hidden_batch()
    with torch.no_grad():
        want = block(x)
        got, bias = layer(sbh(x), padding_mask=~mask)
        unmasked, _ = layer(sbh(x))
    assert bias is None
    got, unmasked = got.transpose(0, 1), unmasked.transpose(0, 1)
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[mask], unmasked[mask], atol=1e-12, rtol=1e-12)
    assert not torch.allclose(got[~mask], unmasked[~mask])  # the pads lost their routed experts

    def load(m):
        return expert_load(m, lambda m, x, pads: m(x, padding_mask=pads), sbh(x), ~mask)

    assert load(layer).sum() == cfg.num_experts_per_tok * mask.sum()  # pads routed nowhere
    everything = expert_load(layer, lambda m, x, _: m(x), sbh(x), None)
    assert everything.sum() == cfg.num_experts_per_tok * mask.numel()  # without the mask: every slot


def test_the_bias_and_the_groups_change_the_choice():
    """On transformers' router: without the correction bias, or without the groups, some tokens choose other
    experts (so the block test above fails on a router that ignores either)."""
    cfg = deepseek_config("groups")
    block = hf_block(cfg)
    x, _ = hidden_batch()
    with torch.no_grad():
        chosen = block.gate(x)[2].sort(-1).values
        block.gate.e_score_correction_bias.zero_()
        unbiased = block.gate(x)[2].sort(-1).values
        block = hf_block(cfg)
        block.gate.num_group = block.gate.topk_group = 1
        ungrouped = block.gate(x)[2].sort(-1).values
    assert (chosen != unbiased).any(-1).sum() > 3 and (chosen != ungrouped).any(-1).sum() > 3


def test_block_weights_round_trip_bitwise_whole_and_tp2():
    cfg = deepseek_config("groups", num_layers=2, first_dense=1)
    args, block = moe_args(cfg), hf_block(cfg)
    sd = {f"model.layers.1.mlp.{k}": v for k, v in block.state_dict().items()}
    kind = mlp_kind(args.moe)
    whole = kind.hf_to_megatron(args, sd, "model.layers.1.", "decoder.layers.0.", tp_size=1, tp_rank=0)
    assert whole["decoder.layers.0.mlp.router.expert_bias"].dtype == torch.float32
    assert whole["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"].shape == (32, H)
    shards = [kind.hf_to_megatron(args, sd, "model.layers.1.", "decoder.layers.0.", tp_size=2, tp_rank=r)
              for r in (0, 1)]
    gate = sd["model.layers.1.mlp.shared_experts.gate_proj.weight"]
    up = sd["model.layers.1.mlp.shared_experts.up_proj.weight"]
    fc1 = shards[1]["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([gate[8:], up[8:]]))  # [gate_1; up_1]
    for parts in ([whole], shards):
        back = kind.megatron_to_hf(args, parts, "decoder.layers.0.", "model.layers.1.")
        assert sorted(back) == sorted(sd) and all(torch.equal(back[k], v) for k, v in sd.items())


def test_config_fields():
    cfg = deepseek_config("groups", num_layers=3, first_dense=2)
    moe = Moe(**deepseek_moe_fields(cfg))
    assert (moe.num_groups, moe.group_top_k, moe.scaling_factor, moe.dense_layers) == (4, 2, 2.5, (0, 1))
    from packfwd.models.mlp.moe import moe_config_fields

    fields = moe_config_fields(moe, 3)
    assert fields["moe_router_score_function"] == "sigmoid" and fields["moe_router_enable_expert_bias"]
    assert (fields["moe_router_num_groups"], fields["moe_router_group_topk"]) == (4, 2)
    assert fields["moe_router_topk_scaling_factor"] == 2.5 and fields["moe_shared_expert_intermediate_size"] == 16
    assert fields["moe_layer_freq"] == [0, 0, 1] and not fields["moe_router_pre_softmax"]
    assert deepseek_moe_fields(deepseek_config("groups", num_layers=2, first_dense=2)) is None  # all dense
    ungrouped = deepseek_moe_fields(deepseek_config("two-shared-no-groups"))
    assert ungrouped["num_groups"] is None and ungrouped["scaling_factor"] is None
    assert ungrouped["shared_ffn_hidden_size"] == 32


def test_the_router_dtype_is_fp32_for_deepseek_routing_only():
    """DeepSeek-V3-style routing (GLM-4.5) keeps transformers' float32 router: ``Moe.router_dtype="fp32"`` is
    Megatron-Core's ``moe_router_dtype``, and a bf16 model built with it (randomly initialised too) holds a float32
    gate weight; Qwen3-MoE and Mixtral (their transformers gates run in the hidden dtype) keep the model's dtype."""
    from packfwd.models.runtime.gpt import build_model
    from packfwd.models.convert.hf import args_from_hf_config
    from packfwd.models.mlp.moe import moe_config_fields, routers

    from .test_moe import CONFIGS, TINY

    moe = Moe(**deepseek_moe_fields(deepseek_config("groups")))
    assert moe.router_dtype == "fp32" and moe_config_fields(moe, 1)["moe_router_dtype"] == "fp32"
    for name, (config_cls, extra) in CONFIGS.items():
        args = args_from_hf_config(config_cls(**TINY, **extra))
        assert args.moe.router_dtype is None and moe_config_fields(args.moe, 2)["moe_router_dtype"] is None, name
    for router_dtype, weight in (("fp32", torch.float32), (None, torch.bfloat16)):
        args = moe_args(deepseek_config("groups", num_layers=2, first_dense=1))
        args = replace(args, moe=replace(args.moe, router_dtype=router_dtype))
        model = build_model(args, params_dtype=torch.bfloat16)
        (router,) = routers(model)
        assert router.weight.dtype == weight and router.expert_bias.dtype == torch.float32
        assert router.weight.std() > 0.01 and model.embedding.word_embeddings.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="Moe.router_dtype='bf16': pass 'fp32', 'fp64' or None"):
        Moe(num_experts=8, top_k=2, ffn_hidden_size=16, router_dtype="bf16")


@pytest.mark.parametrize("moe, error, match", [
    (dict(score_function="sigmoid", normalize_top_k=False), ValueError, "set Moe.normalize_top_k=True"),
    (dict(score_function="sigmoid", top_k=1), ValueError, "set Moe.normalize_top_k=False"),
    (dict(expert_bias=True), ValueError, "sigmoid scores only"),
    (dict(num_groups=4, group_top_k=4, top_k=2), ValueError, "pick Moe.group_top_k <= Moe.top_k"),
])
def test_routing_megatron_core_cannot_build_is_refused(moe, error, match):
    from packfwd.models.mlp.moe import moe_config_fields

    with pytest.raises(error, match=match):
        moe_config_fields(Moe(**{**dict(num_experts=8, top_k=2, ffn_hidden_size=16), **moe}), 1)


def test_a_shared_expert_gate_needs_a_shared_expert():
    with pytest.raises(ValueError, match="shared_expert_gate=True gates a shared expert: give it a width"):
        Moe(num_experts=8, top_k=2, ffn_hidden_size=16, shared_expert_gate=True)
    from packfwd.models.mlp.moe import moe_config_fields

    fields = moe_config_fields(Moe(num_experts=8, top_k=2, ffn_hidden_size=16, shared_ffn_hidden_size=8,
                                   shared_expert_gate=True), 1)
    assert fields["moe_shared_expert_gate"] and fields["moe_shared_expert_intermediate_size"] == 8


def test_group_scores_transformers_and_megatron_disagree_on_are_refused():
    """transformers scores a group by its best 2 experts, Megatron-Core by its best top_k // topk_group."""
    with pytest.raises(ValueError, match="num_experts_per_tok // topk_group == 2"):
        deepseek_moe_fields(replace(deepseek_config("groups"), num_experts_per_tok=2))


@pytest.mark.parametrize("change, message", [
    (dict(num_experts_per_tok=1), "norm_topk_prob=True with num_experts_per_tok=1 and sigmoid scores: .* set "
                                  "norm_topk_prob=False"),
    (dict(norm_topk_prob=False), "norm_topk_prob=False with num_experts_per_tok=2 .* set norm_topk_prob=True"),
    (dict(n_group=3, topk_group=2, num_experts_per_tok=4), "n_group=3 must divide n_routed_experts=8"),
])
def test_refusals_of_a_deepseek_config_name_its_flags(change, message):
    """Read from an HF config (from_hf, args_from_hf_config), a refusal names the config's flags, never packfwd's
    ``Moe`` fields the caller never set."""
    with pytest.raises(ValueError, match=message) as refused:
        read_moe(replace(deepseek_config("two-shared-no-groups"), **change))
    assert "Moe." not in str(refused.value)


def test_expert_bias_counts_real_tokens_only():
    """With grad on, the router counts each expert's tokens for Megatron-Core's expert-bias update
    (``finalize_model_grads``): real tokens only.  Megatron-Core's own count ANDs a [t, E] map with a [t] mask."""
    cfg = deepseek_config("groups")
    layer = packfwd_block(hf_block(cfg), cfg)
    router = layer.router
    assert isinstance(router, PackedRouter) and router.expert_bias.device.type == "cpu"
    assert router.local_tokens_per_expert.sum() == 0
    x, mask = hidden_batch()
    with torch.no_grad():
        layer(sbh(x), padding_mask=~mask)
    assert router.local_tokens_per_expert.sum() == 0  # not counted without grad (evaluation, recomputation)
    layer(sbh(x), padding_mask=~mask)
    assert router.local_tokens_per_expert.sum() == cfg.num_experts_per_tok * mask.sum()


def test_the_router_compiles_nothing():
    """Megatron-Core compiles ``TopKRouter._apply_expert_bias``; megatron-core 0.19.2's compiled one fails under
    torch 2.11 (``list indices must be integers or slices, not torch.device``), so packfwd's router never calls
    it: routing runs no frame through Dynamo."""
    from torch._dynamo.utils import counters

    cfg = deepseek_config("groups")
    for layer in (packfwd_block(hf_block(cfg), cfg), qwen3_deepseek_hybrid()[1].decoder.layers[1].mlp):
        x, mask = hidden_batch()
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            layer(sbh(x), padding_mask=~mask)
        assert not counters["frames"], dict(counters["frames"])


# ----------------------------------------------------------------------------------- a whole model


def qwen3_deepseek_hybrid(seed: int = 0):
    """A Qwen3 decoder (GQA, QK-norm) whose layer 0 has a dense MLP and layers 1, 2 the DeepSeek block, in
    transformers (its MLP modules swapped) and in packfwd (``Moe(**deepseek_moe_fields(...))``), same weights."""
    from packfwd.models.runtime.gpt import build_model
    from packfwd.models.convert.hf import args_from_hf_config, load_weights
    from packfwd.models.convert.hf_weights import hf_to_megatron

    qwen = Qwen3Config(hidden_size=H, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=V)
    cfg = deepseek_config("groups", num_layers=3, first_dense=1)
    hf = Qwen3ForCausalLM(qwen)
    hf.model.layers[0].mlp = DeepseekV3MLP(cfg)
    for i in (1, 2):
        hf.model.layers[i].mlp = DeepseekV3MoE(cfg)
    hf = randomise(hf, seed)
    for i in (1, 2):
        g = torch.Generator().manual_seed(seed + i)
        hf.model.layers[i].mlp.gate.e_score_correction_bias.data = 0.3 * torch.randn(8, generator=g)
    args = replace(args_from_hf_config(qwen), moe=Moe(**deepseek_moe_fields(cfg)))
    model = build_model(args, params_dtype=torch.float64, init=False)
    return hf, load_weights(model, hf_to_megatron(hf.state_dict(), args))


@pytest.mark.parametrize("data_format, layout", [("thd", {}), ("thd", {"seq_align": 8}), ("bshd", {})])
def test_a_qwen3_decoder_with_the_deepseek_block_equals_transformers_per_sequence(data_format, layout):
    hf, model = qwen3_deepseek_hybrid()
    ids, mask = ragged_batch()
    with torch.no_grad():
        logits = make_forward(data_format, **layout)(model, ids, mask)
    assert_equals_hf_per_sequence(hf, logits, ids, mask, atol=2e-5, rtol=1e-5)
    load = expert_load(model, make_forward(data_format, **layout), ids, mask)
    assert load.sum() == 2 * 4 * mask.sum()  # two MoE layers, top-4, real tokens only


def test_the_whole_model_converts_back_bitwise_and_refuses_an_aux_loss():
    from packfwd.models import to_hf_state_dict

    hf, model = qwen3_deepseek_hybrid()
    state, want = to_hf_state_dict(model), hf.state_dict()
    assert sorted(state) == sorted(want) and all(torch.equal(state[k], v) for k, v in want.items())
    ids, mask = ragged_batch()
    with pytest.raises(ValueError, match="sigmoid routing"):
        make_forward("thd", moe_aux_loss=True)(model, ids, mask)


def test_a_float64_models_correction_bias_keeps_float64_values():
    """Hazard: the router's expert_bias buffer was float32 in every model, so a float64 model rounded a float64
    checkpoint's correction bias (0.1 + 1e-12 came back 0.10000000149), against the dtype rule models.md states."""
    from packfwd.models import to_hf_state_dict
    from packfwd.models.mlp.moe import routers

    hf, model = qwen3_deepseek_hybrid()
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    wanted = torch.full((8,), 0.1, dtype=torch.float64) + 1e-12
    (router, *_) = routers(model)
    assert router.expert_bias.dtype == torch.float64 and router.local_tokens_per_expert.dtype == torch.float32
    with torch.no_grad():
        router.expert_bias.copy_(wanted)
    back = to_hf_state_dict(model)[name]
    assert back.dtype == torch.float64 and torch.equal(back, wanted)
