"""DeepSeek-V3 (transformers' ``DeepseekV3ForCausalLM``) as a packfwd family: multi-head latent attention (MLA).

MLA (``packfwd.models.mixers.mla``): queries through a low-rank latent (``q_lora_rank``, ``q_a_layernorm``) or a plain
``q_proj``, keys and values through one shared latent (``kv_lora_rank``, ``kv_a_layernorm``) projected up per
head, ``qk_rope_head_dim`` rotated channels (one key head shared by all), a value head dim of its own; RoPE plain or
YaRN (frequencies, cos/sin factor and the ``mscale_all_dim`` softmax correction), rotated channels interleaved
(``rope_interleave``) or not; then DeepSeek-V3's MoE layers after ``first_k_dense_replace`` dense ones.

Strategy: tiny float64 models (hidden 64, 4 heads, q/k head dim 8 + 4, v head dim 6, 3 layers the first dense,
8 routed experts in 2 groups and a shared one) with O(1)-scale random weights, converted by ``from_hf``; logits of
``make_forward`` in THD, THD aligned to 8 and BSHD on a ragged batch (a full row, right and left padding, a
length-1 row) equal transformers run on each sequence alone, for q_lora_rank set and None and for YaRN +
interleaved and plain + not interleaved.  transformers' RMSNorm computes in float32 and both sides route in
float32, so these agree to ~1e-6 (atol 2e-5, rtol 1e-5, as GLM-4.5's); all dense with transformers' norm in the
input's dtype the attention alone agrees to 1e-10, and the same weights with the interleave flipped or without
YaRN give other logits (the checks see both).  Caller positions (shifted rows) reach the RoPE in THD and BSHD.
The YaRN numbers equal transformers' (inverse frequencies bit for bit).  The weights convert back bit for bit,
whole and from TP=2 shards.  Under TP=2 with sequence parallelism (THD, BSHD) and CP=2 (THD) over gloo the
logits equal transformers per sequence too, and under EP=2 (each rank its own batch, of its own shape); two pipeline
stages (in this process) give the one-stage model's
logits.  A flash kernel (a stand-in on the CPU) gets q, k and v padded to one head dim and the value's channels
come back exact.  Bad configurations raise naming the field and the fix.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3 import modeling_deepseek_v3

from packfwd.forward import make_forward
from packfwd.models import ModelArgs, from_hf
from packfwd.models.runtime.gpt import build_model, model_args
from packfwd.models.convert.hf import args_from_hf_config, load_weights
from packfwd.models.convert.hf_weights import hf_to_megatron
from packfwd.models.mixers.latent import Mla, Yarn

from .oracles import assert_hf_round_trip, rmsnorm_in_input_dtype
from .test_glm4_moe import (LAYOUTS, assert_ep2_equals_transformers, assert_layout_equals_per_sequence,
                             assert_parallel_equal_per_sequence, assert_two_stages_equal_one, parallel_worker,
                             per_sequence, ragged_batch, with_expert_bias)
from .test_moe import randomise

V = 64
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8, mscale=0.9,
            mscale_all_dim=0.7, beta_fast=32.0, beta_slow=1.0)  # ragged rows of 10 reach past the original 8
ROPES = {"yarn-interleaved": dict(rope_parameters=YARN, rope_interleave=True),
         "default-halves": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0), rope_interleave=False)}


def ds_config(*, q_lora_rank: int | None = 12, dense: bool = False, rope: str = "yarn-interleaved",
              **extra) -> DeepseekV3Config:
    """3 layers (the first dense; all dense with ``dense``), 4 heads of q/k 8 + 4 channels and v 6, kv latent 16."""
    fields = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=V, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                  topk_group=1, n_shared_experts=1, first_k_dense_replace=3 if dense else 1, num_hidden_layers=3,
                  routed_scaling_factor=2.5, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8,
                  qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=32, experts_implementation="eager",
                  **ROPES[rope])
    return DeepseekV3Config(**{**fields, **extra})


def ds_model(cfg: DeepseekV3Config, seed: int = 0) -> DeepseekV3ForCausalLM:
    return with_expert_bias(randomise(DeepseekV3ForCausalLM(cfg), seed), cfg, seed)


@pytest.fixture
def hf_norm_in_input_dtype(monkeypatch):
    """transformers' RMSNorm computed in the input's dtype (it casts to float32 otherwise)."""
    monkeypatch.setattr(modeling_deepseek_v3.DeepseekV3RMSNorm, "forward", rmsnorm_in_input_dtype)


def test_the_config_is_read_as_deepseek_v3_and_yarn_is_transformers():
    hf = ds_model(ds_config())
    args = args_from_hf_config(hf.config)
    assert (args.family, args.head_dim, args.num_query_groups, args.qk_norm, args.qkv_bias) == (
        "deepseek_v3", 12, 4, False, False)
    mla = args.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        12, 16, 8, 4, 6)
    assert mla.rope_interleave and mla.yarn == Yarn(factor=4.0, original_max_position_embeddings=8, beta_fast=32.0,
                                                   beta_slow=1.0, mscale=0.9, mscale_all_dim=0.7)
    assert (args.moe.num_experts, args.moe.dense_layers, args.moe.scaling_factor) == (8, (0,), 2.5)
    rotary = hf.model.rotary_emb
    assert torch.equal(mla.inv_freq(args.rope_theta), rotary.inv_freq)  # bit for bit
    assert mla.cos_sin_factor() == rotary.attention_scaling != 1.0
    assert mla.softmax_scale() == hf.model.layers[0].self_attn.scaling != 12 ** -0.5
    plain = args_from_hf_config(ds_config(q_lora_rank=None, rope="default-halves")).mla
    assert (plain.q_lora_rank, plain.yarn, plain.rope_interleave) == (None, None, False)
    assert args_from_hf_config(ds_config(dense=True)).moe is None
    model = from_hf(hf)
    assert model_args(model) == dataclasses.replace(args, rope_scaling_factor=None)
    assert model.config.multi_latent_attention and model.config.rope_type == "yarn"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("q_lora_rank", [12, None], ids=["q_lora", "q_proj"])
def test_logits_equal_transformers_per_sequence(q_lora_rank, rope, layout):
    hf = ds_model(ds_config(q_lora_rank=q_lora_rank, rope=rope))
    model = from_hf(hf)
    assert_layout_equals_per_sequence(hf, model, layout)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_dense_attention_to_1e10_and_the_rope_choices_are_seen(layout, hf_norm_in_input_dtype):
    """All MLPs dense, transformers' norms in float64: MLA with YaRN and interleaved pairs to 1e-10; the same
    weights with the interleave flipped, or without YaRN, give other logits."""
    hf = ds_model(ds_config(dense=True))
    model = from_hf(hf)
    args = model_args(model)
    forward = make_forward(**LAYOUTS[layout])
    ids, mask = ragged_batch()
    with torch.no_grad():
        logits = forward(model, ids, mask)
        for i, want in enumerate(per_sequence(hf, ids, mask)):
            torch.testing.assert_close(logits[i][mask[i]], want, atol=1e-10, rtol=0, msg=f"row {i}")
        for change in (dict(rope_interleave=False), dict(yarn=None)):
            other = dataclasses.replace(args, mla=dataclasses.replace(args.mla, **change))
            wrong = load_weights(build_model(other, params_dtype=torch.float64, init=False),
                                 hf_to_megatron(hf.state_dict(), other))
            assert not torch.allclose(forward(wrong, ids, mask)[0][mask[0]], logits[0][mask[0]], atol=1e-3), change


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_caller_positions_reach_the_rope(data_format, hf_norm_in_input_dtype):
    """Rows whose positions start at 5 (THD: through the params; BSHD: the model's per-token angles)."""
    hf = ds_model(ds_config(dense=True, q_lora_rank=None))
    model = from_hf(hf)
    ids, mask = ragged_batch()
    positions = (mask.cumsum(1) - 1).clamp(min=0) + 5
    with torch.no_grad():
        logits = make_forward(data_format)(model, ids, mask, positions)
    for i, want in enumerate(per_sequence(hf, ids, mask, positions)):
        torch.testing.assert_close(logits[i][mask[i]], want, atol=1e-10, rtol=0, msg=f"row {i}")


@pytest.mark.parametrize("q_lora_rank", [12, None], ids=["q_lora", "q_proj"])
def test_the_way_back_is_bitwise(q_lora_rank):
    assert_hf_round_trip(ds_model(ds_config(q_lora_rank=q_lora_rank)))


def test_a_flash_kernel_gets_one_head_dim_and_the_value_channels_come_back(monkeypatch):
    """The flash kernels take one head dim: with v's 6 against q/k's 12, a kernel (here a stand-in that refuses
    other shapes and computes the reference) gets q, k, v zero-padded to 12, and the first 6 output channels are
    the reference's; q/k narrower than v (4 against 6) are padded instead."""
    from packfwd.models.mixers import varlen

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, dropout_p, softmax_scale, causal):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1]
        return varlen.varlen_attention_reference(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale)

    monkeypatch.setattr(varlen, "available_backends", lambda device="cpu": ("flash_attn", "reference"))
    monkeypatch.setitem(varlen._KERNELS, "flash_attn", kernel)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    for d, d_v in ((12, 6), (4, 6)):
        q, k, v = (torch.randn(8, 2, n, generator=g, dtype=torch.float64) for n in (d, d, d_v))
        out = varlen.varlen_attention(q, k, v, cu, cu, 5, 5, backend="flash_attn")
        want = varlen.varlen_attention_reference(q, k, v, cu, cu, 5, 5)  # scale d ** -0.5, not the padded width's
        assert out.shape == (8, 2, d_v)
        torch.testing.assert_close(out, want, atol=1e-14, rtol=0)


def test_bad_configs_name_the_field_and_the_fix():
    for extra, match in ((dict(attention_bias=True), "attention_bias=True.*set attention_bias=False"),
                         (dict(num_key_value_heads=2), "num_key_value_heads=2.*set num_key_value_heads=4"),
                         (dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0)),
                          "rope_type='linear'")):
        with pytest.raises(ValueError, match=match):
            args_from_hf_config(ds_config(**extra))
    mla = Mla(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    base = dict(vocab_size=V, hidden_size=64, ffn_hidden_size=96, num_layers=1, num_attention_heads=4)
    assert ModelArgs(**base, family="deepseek_v3", mla=mla).kv_channels == 12
    for extra, match in ((dict(head_dim=16), "head_dim"), (dict(num_query_groups=2), "num_query_groups"),
                         (dict(qk_norm=True), "qk_norm"), (dict(mtp_num_layers=1), "mtp_num_layers"),
                         (dict(rotary_percent=0.5), "rotary_percent")):
        with pytest.raises(ValueError, match=f"{match}.*leave these at their defaults"):
            ModelArgs(**base, family="deepseek_v3", mla=mla, **extra)
    with pytest.raises(ValueError, match="pass mla=Mla"):
        ModelArgs(**base, family="deepseek_v3")
    with pytest.raises(ValueError, match="pass family='deepseek_v3' or 'kimi_linear' or mla=None"):
        ModelArgs(**base, mla=mla)
    with pytest.raises(ValueError, match="qk_rope_head_dim=3.*even"):
        Mla(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=3, v_head_dim=6)
    with pytest.raises(ValueError, match="use packed_rope=True"):
        build_model(ModelArgs(**base, family="deepseek_v3", mla=mla), packed_rope=False, init=False)
    args = args_from_hf_config(ds_config(kv_lora_rank=15))  # 15 + 4 rows of kv_a_proj_with_mqa
    with pytest.raises(ValueError, match="kv_lora_rank \\+ qk_rope_head_dim=19 is not divisible by tp_size=2"):
        hf_to_megatron({}, args, tp_size=2, tp_rank=0)


# ------------------------------------------------------------------------------------------- model parallelism


def test_pp2_equals_one_stage():
    """Stage 0: layers 0 (dense) and 1 (MoE); stage 1: layers 2 and 3 and the head (positions from the hidden
    states' shape in BSHD, from the params in THD)."""
    assert_two_stages_equal_one(ds_model(ds_config(num_hidden_layers=4)))


def _mla_rows(model) -> tuple[int, int]:
    attention = model.decoder.layers[0].self_attention
    return attention.linear_q_up_proj.weight.shape[0], attention.linear_kv_down_proj.weight.shape[0]


def test_tp2_sp_and_cp2_equal_transformers_per_sequence():
    """Heads split over TP (the down projections' outputs gathered, cut back to each rank's tokens under SP), YaRN
    RoPE at each token's zigzag position under CP, the value head dim gathered with the keys."""
    from packfwd.testing import run_local

    hf = ds_model(ds_config())
    ranks = run_local(parallel_worker, 2, hf, _mla_rows, backend="gloo", timeout=300)
    assert [r["probe"] for r in ranks] == [(2 * 12, (16 + 4) // 2)] * 2  # 2 of 4 heads; half the kv latent's rows
    assert_parallel_equal_per_sequence(hf, ranks)


def test_ep2_ranks_with_batches_of_their_own_shape_equal_transformers():
    """Expert parallelism with latent attention (the attention replicated, 4 of the 8 routed experts per rank, the
    shared expert and the correction bias replicated): each rank's own batch equals transformers per sequence, and
    the weights gather back bitwise."""
    assert_ep2_equals_transformers(ds_model(ds_config()))

