"""Mixture-of-Experts models (Qwen3-MoE, Mixtral) against transformers, and MoE under packing.

Strategy: tiny float64 models with O(1)-scale random weights (every matrix ~ N(0, 1/fan_in), norms ~ 1 + noise,
so the router logits are O(1) and the top-k choice is never a near tie).  The reference is transformers run on
each sequence alone; packfwd runs the whole ragged batch (left and right padding, a length-1 row) packed (THD,
also with alignment padding) or compacted (BSHD).  Both sides compute the routing softmax in float32
(transformers' routers and Megatron-Core's ``topk_routing_with_score_function`` do), so logits agree to ~1e-6,
not to float64 precision.  Weights convert both ways bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from packfwd.forward import make_forward
from packfwd.models import from_hf, to_hf_state_dict
from packfwd.models.gpt import model_args
from packfwd.models.hf import args_from_hf_config
from packfwd.models.hf_weights import hf_to_megatron, megatron_to_hf

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
}
CAUSAL_LM = {Qwen3MoeConfig: Qwen3MoeForCausalLM, MixtralConfig: MixtralForCausalLM}
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
        for i in range(ids.shape[0]):
            want = hf(ids[i][mask[i]][None]).logits[0]
            torch.testing.assert_close(logits[i][mask[i]], want, atol=2e-5, rtol=1e-5, msg=f"row {i}")
    assert not logits[~mask].any()


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


def test_config_reads_the_moe_choices():
    qwen = model_args(from_hf(hf_model("qwen3_moe-unnormalised-step2")))
    assert qwen.moe.dense_layers == (0, 2) and not qwen.moe.normalize_top_k and qwen.moe.ffn_hidden_size == 16
    assert qwen.ffn_hidden_size == 48
    config = from_hf(hf_model("qwen3_moe-norm")).config
    assert config.moe_layer_freq == [1, 0, 1] and not config.moe_router_pre_softmax
    assert config.moe_router_load_balancing_type == "none" and config.moe_expert_capacity_factor is None
    mixtral = from_hf(hf_model("mixtral")).config
    assert (mixtral.num_moe_experts, mixtral.moe_router_topk, mixtral.moe_ffn_hidden_size) == (4, 2, 16)


@pytest.mark.parametrize("flag, value", [("router_jitter_noise", 0.1), ("sliding_window", 4)])
def test_mixtral_choices_packfwd_cannot_build_are_refused(flag, value):
    with pytest.raises(ValueError, match=flag):
        args_from_hf_config(MixtralConfig(**TINY, **{**CONFIGS["mixtral"][1], flag: value}))


def test_the_router_names_a_mask_of_the_wrong_shape():
    """Megatron-Core checks the mask's shape on the first pipeline stage only; the router checks it everywhere."""
    router = from_hf(hf_model("mixtral")).decoder.layers[0].mlp.router
    with pytest.raises(ValueError, match="padding_mask covers 6 tokens per row but this MoE layer routes 5"):
        router(torch.randn(5, 2, 32, dtype=torch.float64), torch.zeros(6, 2, dtype=torch.bool))
