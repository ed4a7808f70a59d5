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
and, over gloo, TP=2 with sequence parallelism (THD, BSHD) and CP=2 (THD) equal to transformers.
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
from .test_hybrid_families import ragged_batch

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
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            small = "norm" in name or name.endswith(("A_log", "dt_bias"))
            p.copy_(p + 0.3 * noise if small else noise * p.shape[-1] ** -0.5)
        for module in model.modules():  # the routing bias float32, as transformers keeps it (and Megatron-Core)
            if hasattr(module, "e_score_correction_bias"):
                bias = module.e_score_correction_bias
                module.e_score_correction_bias = (0.1 * torch.randn(bias.shape, generator=g)).float()
    return model.eval()


LAYOUTS = [("thd", {}), ("thd", {"seq_align": 16}), ("bshd", {}), ("masked", {})]


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
    forward = (lambda m, i, k: m(i, None, k)) if data_format == "masked" else make_forward(data_format, **layout)
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


def _ranks_worker(rank: int, world: int):
    """TP=2 + SP (THD, BSHD), then CP=2 (THD aligned), the dense model: {case: this rank's logits}."""
    hf = hf_model("dense")
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
    return out


def test_tp2_sp_and_cp2_equal_transformers():
    """Over gloo: TP=2 with sequence parallelism (each rank half the KDA heads, the low-rank gates' down
    projections gathered; THD and BSHD) and CP=2 (each rank whole sequences of one KDA head, zigzag MLA)."""
    from packfwd.testing import run_local

    hf = hf_model("dense")
    ranks = run_local(_ranks_worker, 2, backend="gloo", timeout=300)
    ids, mask = ragged_batch()
    for data_format in ("thd", "bshd"):
        logits = torch.cat([r[f"tp2_sp_{data_format}"] for r in ranks], -1)  # each rank its vocabulary half
        assert_equals_hf_per_sequence(hf, logits, ids, mask, atol=1e-10)
    torch.testing.assert_close(ranks[0]["cp2"], ranks[1]["cp2"], atol=0, rtol=0)
    assert_equals_hf_per_sequence(hf, ranks[0]["cp2"], ids, mask, atol=1e-10)
