"""GLM-4.5 (transformers' ``Glm4MoeForCausalLM``) as a packfwd family, and partial RoPE (``rotary_percent``).

GLM-4.5 is a Llama-style decoder with: partial RoPE (``partial_rotary_factor``: only the first
``int(head_dim * factor)`` channels of each head rotate, the rest pass through; Megatron-Core's ``rotary_percent``),
a bias on q, k, v only when ``attention_bias`` (none on o), optional QK-norm (``use_qk_norm``), and DeepSeek-V3-style
MoE MLPs (sigmoid scores, the routing-only ``e_score_correction_bias``, group-limited top-k, shared experts, routed
scaling) after ``first_k_dense_replace`` dense layers.

Strategy: a tiny float64 GLM-4.5 with O(1)-scale random weights (a nonzero float32 correction bias) converted by
``from_hf``; logits of ``make_forward`` in THD, THD aligned to 8 and BSHD on a ragged batch (a full row, left and
right padding, a length-1 row) equal transformers run on each sequence alone.  Both sides route in float32, so
the MoE model agrees to ~1e-6 (as tests/test_moe_deepseek.py); an all-dense GLM (``first_k_dense_replace`` =
layers) checks the attention and partial RoPE alone to 1e-10 (transformers' RMSNorm computed in the input's
dtype).  A model built with full RoPE instead (``rotary_percent=1``) gives other logits, so the checks see the
partial rotation, and packfwd's THD rotation equals Megatron-Core's own THD RoPE bit for bit.  Weights convert
back bit for bit, whole and from TP=2 shards.  Under TP=2 with sequence parallelism (THD, BSHD), CP=2 (THD,
zigzag) and EP=2 (each rank its own batch) over gloo the logits equal transformers per sequence too; two pipeline
stages (in this process) give the one-stage model's logits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
from transformers.models.glm4_moe import modeling_glm4_moe

from packfwd.forward import make_forward
from packfwd.models import ModelArgs, from_hf, to_hf_state_dict
from packfwd.models.runtime.gpt import build_model, model_args
from packfwd.models.convert.hf import args_from_hf_config, load_weights
from packfwd.models.convert.hf_weights import hf_to_megatron

from .oracles import assert_hf_round_trip, rmsnorm_in_input_dtype
from .test_moe import randomise

V = 64
LAYOUTS = {"thd": dict(data_format="thd"), "thd-align8": dict(data_format="thd", seq_align=8),
           "bshd": dict(data_format="bshd")}


def glm_config(*, qk_norm: bool = True, dense: bool = False, **extra) -> Glm4MoeConfig:
    """3 layers unless ``extra`` says (the first dense; all dense with ``dense``), 8 routed experts in 2 groups (top-2 from the best
    group), 1 shared expert, GQA 4/2, head_dim 16 of which 8 rotate (partial_rotary_factor 0.5)."""
    return Glm4MoeConfig(
        hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=V, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=3 if dense else 1, routed_scaling_factor=2.5,
        norm_topk_prob=True, use_qk_norm=qk_norm, experts_implementation="eager", **{"attention_bias": True, "num_hidden_layers": 3, **extra})


def glm_model(cfg: Glm4MoeConfig, seed: int = 0) -> Glm4MoeForCausalLM:
    return with_expert_bias(randomise(Glm4MoeForCausalLM(cfg), seed), cfg, seed)


def with_expert_bias(hf, cfg, seed: int):
    """``hf`` (in place) with an O(1) routing-only expert bias in each MoE layer (GLM-4.5, DeepSeek-V3 layouts)."""
    g = torch.Generator().manual_seed(seed + 1)
    for layer in hf.model.layers[cfg.first_k_dense_replace:]:
        layer.mlp.gate.e_score_correction_bias.data = 0.3 * torch.randn(cfg.n_routed_experts, generator=g)
    return hf


def ragged_batch(seed: int = 0):
    """ids [4, 10]: a full row, a right-padded row, a left-padded row of length 1, a left-padded row."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(4, 10, dtype=torch.bool)
    mask[0], mask[1, :6], mask[2, 9:], mask[3, 3:] = True, True, True, True
    return torch.randint(1, V, (4, 10), generator=g).masked_fill(~mask, 0), mask


@pytest.fixture
def hf_norm_in_input_dtype(monkeypatch):
    """transformers' RMSNorm computed in the input's dtype (it casts to float32 otherwise)."""
    monkeypatch.setattr(modeling_glm4_moe.Glm4MoeRMSNorm, "forward", rmsnorm_in_input_dtype)


def per_sequence(hf, ids, mask, positions=None):
    """transformers' logits of each row's real tokens alone (``positions [b, s]``: the caller's, else 0, 1, ...)."""
    with torch.no_grad():
        return [hf(ids[i][mask[i]][None], position_ids=None if positions is None else positions[i][mask[i]][None])
                .logits[0] for i in range(ids.shape[0])]


def test_the_config_is_read_as_glm4_moe():
    args = args_from_hf_config(glm_config())
    assert (args.family, args.rotary_percent, args.qkv_bias, args.qk_norm, args.linear_bias) == (
        "glm4_moe", 0.5, True, True, False)
    moe = args.moe
    assert (moe.score_function, moe.expert_bias, moe.num_groups, moe.group_top_k) == ("sigmoid", True, 2, 1)
    assert (moe.shared_ffn_hidden_size, moe.scaling_factor, moe.dense_layers) == (16, 2.5, (0,))
    plain = args_from_hf_config(glm_config(qk_norm=False, attention_bias=False,
                                           rope_parameters=dict(rope_theta=10000.0, partial_rotary_factor=1.0)))
    assert (plain.qk_norm, plain.qkv_bias, plain.rotary_percent) == (False, False, 1.0)
    assert args_from_hf_config(glm_config(dense=True)).moe is None


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "no_qk_norm"])
def test_logits_equal_transformers_per_sequence(qk_norm, layout):
    hf = glm_model(glm_config(qk_norm=qk_norm))
    model = from_hf(hf)
    assert model_args(model) == args_from_hf_config(hf.config)  # qk_norm and rotary_percent read back
    assert_layout_equals_per_sequence(hf, model, layout)


def assert_layout_equals_per_sequence(hf, model, layout: str) -> None:
    """``model``'s logits of the ragged batch in ``LAYOUTS[layout]`` equal ``hf`` run on each sequence alone (O(1)
    logits, to 2e-5), and its padding positions are zero."""
    ids, mask = ragged_batch()
    with torch.no_grad():
        logits = make_forward(**LAYOUTS[layout])(model, ids, mask)
    for i, want in enumerate(per_sequence(hf, ids, mask)):
        assert want.abs().max() > 1  # O(1) weights: logits far from zero
        torch.testing.assert_close(logits[i][mask[i]], want, atol=2e-5, rtol=1e-5, msg=f"row {i}")
    assert not logits[~mask].any(), "padding positions must be zero"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_partial_rope_dense_equals_transformers_and_full_rope_does_not(layout, hf_norm_in_input_dtype):
    """All MLPs dense: attention with partial RoPE (8 of 16 channels), q/k/v bias and QK-norm to 1e-10; the same
    weights built with full RoPE (``rotary_percent=1``) give other logits."""
    hf = glm_model(glm_config(dense=True))
    model = from_hf(hf)
    args = model_args(model)
    full = build_model(dataclasses.replace(args, rotary_percent=1.0), params_dtype=torch.float64, init=False)
    full = load_weights(full, hf_to_megatron(hf.state_dict(), args))
    ids, mask = ragged_batch()
    forward = make_forward(**LAYOUTS[layout])
    with torch.no_grad():
        logits, wrong = forward(model, ids, mask), forward(full, ids, mask)
    for i, want in enumerate(per_sequence(hf, ids, mask)):
        torch.testing.assert_close(logits[i][mask[i]], want, atol=1e-10, rtol=0, msg=f"row {i}")
    assert not torch.allclose(wrong[0][mask[0]], logits[0][mask[0]], atol=1e-3)


@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "no_qk_norm"])
def test_the_way_back_is_bitwise(qk_norm):
    assert_hf_round_trip(glm_model(glm_config(qk_norm=qk_norm)))


def test_rotary_percent_is_validated():
    base = dict(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=1, num_attention_heads=4)  # d = 8
    assert ModelArgs(**base, rotary_percent=0.5).rotary_percent == 0.5
    for bad in (0.0, 1.5, "half", True):
        with pytest.raises(ValueError, match="pass a float in"):
            ModelArgs(**base, rotary_percent=bad)
    with pytest.raises(ValueError, match="= 3 channels"):
        ModelArgs(**base, rotary_percent=0.375)
    with pytest.raises(ValueError, match=r"sum to the rotated channels // 2 = 2"):  # partial: 4 of 8 rotate
        ModelArgs(**base, rotary_percent=0.5, mrope_section=(1, 2, 1))


# ------------------------------------------------------------------------------------------- model parallelism


def parallel_worker(rank: int, world: int, hf, probe=None):
    """TP=2 with sequence parallelism (THD, BSHD) and CP=2 (THD) over gloo: {case: this rank's logits}, and with
    ``probe`` (a module-level function of the TP model) ``out["probe"]``."""
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime import ensure_model_parallel

    ids, mask = ragged_batch()
    out = {}
    ensure_model_parallel(tp_size=2)
    model = from_hf(hf, tp_size=2, tp_rank=rank, sequence_parallel=True)
    if probe is not None:
        out["probe"] = probe(model)
    with torch.no_grad():
        for data_format in ("thd", "bshd"):
            out[f"tp2_sp_{data_format}"] = make_forward(data_format, tp_size=2)(model, ids, mask)
    ps.destroy_model_parallel()
    ensure_model_parallel(cp_size=2)
    forward = make_forward("thd", cp_size=2, cp_rank=ps.get_context_parallel_rank(),
                           cp_group=ps.get_context_parallel_group())
    with torch.no_grad():
        out["cp2"] = forward(from_hf(hf), ids, mask)
    ps.destroy_model_parallel()
    return out


def assert_parallel_equal_per_sequence(hf, ranks) -> None:
    """Each case of :func:`parallel_worker` (TP's vocab shards concatenated) equals transformers per sequence."""
    ids, mask = ragged_batch()
    cases = {"cp2": [r["cp2"] for r in ranks]}
    cases.update({f"tp2_sp_{f}": [torch.cat([r[f"tp2_sp_{f}"] for r in ranks], -1)] for f in ("thd", "bshd")})
    want = per_sequence(hf, ids, mask)
    for case, outputs in cases.items():
        for logits in outputs:
            for i, ref in enumerate(want):
                torch.testing.assert_close(logits[i][mask[i]], ref, atol=2e-5, rtol=1e-5, msg=f"{case} row {i}")


def test_tp2_sp_and_cp2_equal_transformers_per_sequence():
    """Partial RoPE on zigzag CP shards, q/k/v biases, QK-norm and the shared and routed experts split over TP."""
    from packfwd.testing import run_local

    hf = glm_model(glm_config())
    assert_parallel_equal_per_sequence(hf, run_local(parallel_worker, 2, hf, backend="gloo", timeout=300))


def test_pp2_equals_one_stage():
    """Stage 0: layers 0 (dense) and 1 (MoE); stage 1: layers 2 and 3 (MoE) and the head."""
    assert_two_stages_equal_one(glm_model(glm_config(num_hidden_layers=4)))


def assert_two_stages_equal_one(hf) -> None:
    """``hf`` as two pipeline stages (stage 1 fed stage 0's output) gives the one-stage model's logits, THD and
    BSHD, to 1e-10."""
    whole = from_hf(hf)
    stages = [from_hf(hf, pp_rank=r, pp_size=2) for r in range(2)]
    ids, mask = ragged_batch()
    for data_format in ("thd", "bshd"):
        forward = make_forward(data_format)
        with torch.no_grad():
            stages[1].set_input_tensor(forward(stages[0], ids, mask))
            torch.testing.assert_close(forward(stages[1], ids, mask), forward(whole, ids, mask), atol=1e-10, rtol=0)


def _ep_worker(rank: int, world: int, hf, batches):
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel(ep_size=2)
    model = from_hf(hf, ep_size=2, ep_rank=rank)
    with torch.no_grad():
        logits = make_forward("thd")(model, *batches[rank])
    state = to_hf_state_dict(model)
    experts = len(model.decoder.layers[1].mlp.experts.local_experts)
    ps.destroy_model_parallel()
    return dict(logits=logits, state=state, experts=experts)


def test_ep2_ranks_with_batches_of_their_own_shape_equal_transformers():
    """Expert parallelism (4 of the 8 routed experts per rank; shared experts, the correction bias and the dense
    layer replicated): each rank's own batch equals transformers per sequence; the weights gather back bitwise."""
    assert_ep2_equals_transformers(glm_model(glm_config()))


def assert_ep2_equals_transformers(hf) -> None:
    """EP=2 over gloo, rank 0 the ragged batch and rank 1 one of another shape: logits per sequence, 4 experts per
    rank, ``to_hf_state_dict`` whole and bitwise on each rank."""
    from packfwd.testing import run_local

    small = torch.zeros(3, 6, dtype=torch.bool)  # rank 1: lengths 6, 2 (left-padded), 4 (right-padded)
    small[0], small[1, 4:], small[2, :4] = True, True, True
    small_ids = torch.randint(1, V, (3, 6), generator=torch.Generator().manual_seed(1)).masked_fill(~small, 0)
    batches = [ragged_batch(), (small_ids, small)]
    ranks = run_local(_ep_worker, 2, hf, batches, backend="gloo", timeout=300)
    sd = hf.state_dict()
    assert [r["experts"] for r in ranks] == [4, 4]
    for r, (b_ids, b_mask) in zip(ranks, batches):
        for i, want in enumerate(per_sequence(hf, b_ids, b_mask)):
            torch.testing.assert_close(r["logits"][i][b_mask[i]], want, atol=2e-5, rtol=1e-5, msg=f"row {i}")
        assert sorted(r["state"]) == sorted(sd) and all(torch.equal(r["state"][n], t) for n, t in sd.items())


def test_partial_rope_is_megatron_cores_thd_rope_bitwise():
    """packfwd's THD rotation of the first 8 of 16 channels against Megatron-Core's own THD RoPE (``packed_rope=
    False``) on the same weights: the same arithmetic, so the same logits bit for bit."""
    hf = glm_model(glm_config(dense=True))
    model = from_hf(hf)
    args = model_args(model)
    megatron = load_weights(build_model(args, params_dtype=torch.float64, init=False, packed_rope=False),
                            hf_to_megatron(hf.state_dict(), args))
    assert megatron.rotary_pos_emb.inv_freq.numel() == 4  # 8 rotated channels
    ids, mask = ragged_batch()
    with torch.no_grad():
        for layout in ({}, {"seq_align": 8}):
            forward = make_forward("thd", **layout)
            assert torch.equal(forward(model, ids, mask), forward(megatron, ids, mask))


# ------------------------------------------------------------------------------------------- bf16: the router in fp32


def bf16_glm(seed: int = 0) -> Glm4MoeForCausalLM:
    """A GLM-4.5 as transformers loads a checkpoint in bfloat16 (``_keep_in_fp32_modules_strict``): every weight
    bf16 but the routers' gate weight and correction bias, float32.  16 experts, top-4, hidden 256; the gate
    N(0, 1 / hidden), the correction bias of scale 0.01 (a trained router's: it tips close choices only)."""
    cfg = Glm4MoeConfig(hidden_size=256, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64, vocab_size=V, n_routed_experts=16, num_experts_per_tok=4,
                        n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=2,
                        experts_implementation="eager")
    hf = Glm4MoeForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    gates = [layer.mlp.gate for layer in hf.model.layers[cfg.first_k_dense_replace:]]
    kept = [(torch.randn(16, 256, generator=g) / 16, 0.01 * torch.randn(16, generator=g)) for _ in gates]
    hf = hf.to(torch.bfloat16)
    for gate, (weight, bias) in zip(gates, kept):
        gate.float()
        gate.weight.data.copy_(weight)
        gate.e_score_correction_bias.copy_(bias)
    return hf.eval()


def test_bf16_router_is_float32_and_chooses_transformers_experts():
    """``from_hf(params_dtype=bf16)`` keeps the router's gate weight float32 (the HF tensor bit for bit, back too)
    and computes its logits in float32 from the bf16 hidden states, as transformers does: on 512 tokens the chosen
    experts equal transformers' for every token (a bf16 gate, as before, picks another set for ~1% of them)."""
    from packfwd.models.mlp.moe import routers

    hf = bf16_glm()
    model = from_hf(hf, params_dtype=torch.bfloat16)
    (router,) = routers(model)
    gate = hf.model.layers[1].mlp.gate
    assert model.config.moe_router_dtype == "fp32" and model.config.params_dtype == torch.bfloat16
    assert router.weight.dtype == torch.float32 and torch.equal(router.weight, gate.weight)
    assert model.decoder.layers[1].mlp.experts.local_experts[0].linear_fc1.weight.dtype == torch.bfloat16
    back = to_hf_state_dict(model)
    assert back["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert all(torch.equal(back[n], t) for n, t in hf.state_dict().items())
    x = torch.randn(512, 1, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)  # [s, b, h]
    with torch.no_grad():
        _, want, chosen = gate(x)
        probs, routing_map = router(x)
    want_map = torch.zeros(512, 16, dtype=torch.bool).scatter_(1, chosen, True)
    assert torch.equal(routing_map, want_map)
    assert probs.dtype == torch.float32  # transformers' weights, to an ulp (Megatron-Core's order of operations)
    torch.testing.assert_close(probs.gather(1, chosen), want, atol=0, rtol=1e-6)
    x.requires_grad_(True)
    router(x)[0].sum().backward()
    assert router.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
