"""packfwd's model families (packfwd.models.families): each one entry, each equal to transformers.

Strategy: per family, a tiny transformers causal LM (hidden 32, 2 layers, vocab 96) in float64 on the CPU with
O(1)-scale random weights (std 0.5 on every parameter, norms ``1 + 0.5 * noise``), so that a wrong layout,
norm or bias shows far above rounding.  The reference is the transformers model run on each sequence alone;
packfwd's model built by ``from_hf`` runs the whole ragged batch (right and left padding, a length-1 row) through
``make_forward("thd")``, ``make_forward("thd", seq_align=8)`` and ``make_forward("bshd")`` and must agree to
``atol=1e-10`` (the largest difference seen is ~2e-14 on logits up to ~15).  Qwen3 (QK-norm, an explicit
``head_dim`` with ``heads * head_dim != hidden_size``, tied and untied) also runs TP=2 over gloo: the ranks' vocab
slices of the logits equal the reference, their weight shards merge back to transformers' bit for bit, and their
gradients merged (QK-norm gradients summed over the TP ranks, as Megatron-Core's ``finalize_model_grads`` does
for ``qk_layernorm``) equal the one-process model's.  One change to transformers for
this: its RMSNorm casts to float32 whatever the input dtype (a speed choice that costs float64 its precision), so
the tests run it in the input's dtype (``hf_norm_in_input_dtype``).  Both sides compute RoPE's cos/sin in float32
from the same float32 angles, so they agree exactly there.  The way back (``to_hf_state_dict``, and the TP=2
shards merged) must give transformers' state dict bit for bit.

The family hooks are tested on their own: an MLP kind registered for :class:`Moe` is what the config, the layer
spec and the weight mapping consult for its layers (a one-expert toy kind), and without one building raises
NotImplementedError naming the fix.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

from packfwd.forward import make_forward
from packfwd.models import ModelArgs, build_model, from_hf, megatron_to_hf, to_hf_state_dict
import packfwd.models.mlp as mlp_module
from packfwd.models.families import FAMILIES, Family, family_of_hf_config
from packfwd.models.mlp import Moe
from packfwd.models.runtime import model_args, transformer_config
from packfwd.models.convert.hf import args_from_hf_config
from packfwd.models.convert.hf_weights import hf_to_megatron
from packfwd.models.norm import RMSNorm
from packfwd.testing import run_local

from .oracles import assert_equals_hf_per_sequence, assert_hf_round_trip, rmsnorm_in_input_dtype

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=96)
CASES = {  # name: (config class, model class, config fields)
    "llama": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=2, rope_theta=500000.0)),
    "llama-tied-bias": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=4, tie_word_embeddings=True,
                                                             attention_bias=True, mlp_bias=True)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(num_key_value_heads=2)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(num_key_value_heads=2, head_dim=24)),  # 4 x 24 != 32
    "qwen3-tied": (Qwen3Config, Qwen3ForCausalLM, dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
}
NORMS = [modeling_llama.LlamaRMSNorm, modeling_qwen2.Qwen2RMSNorm, modeling_qwen3.Qwen3RMSNorm]
LAYOUTS = {"thd": dict(data_format="thd"), "thd-align8": dict(data_format="thd", seq_align=8),
           "bshd": dict(data_format="bshd")}


@pytest.fixture
def hf_norm_in_input_dtype(monkeypatch):
    """transformers' RMSNorms computed in the input's dtype (they cast to float32 otherwise)."""
    for cls in NORMS:
        monkeypatch.setattr(cls, "forward", rmsnorm_in_input_dtype)


def hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    config_cls, model_cls, extra = CASES[name]
    model = model_cls(config_cls(**TINY, **extra)).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            p.copy_(1.0 + 0.5 * noise if "norm" in n else 0.5 * noise)
    return model.eval()


def ragged_batch(seed: int = 0):
    """ids [4, 10] and a mask: a full row, a right-padded row, a left-padded row of length 1, a left-padded row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY["vocab_size"], (4, 10), generator=g)
    mask = torch.zeros(4, 10, dtype=torch.bool)
    mask[0], mask[1, :6], mask[2, 9:], mask[3, 3:] = True, True, True, True
    return ids.masked_fill(~mask, 0), mask


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_equal_transformers_per_sequence(name, layout, hf_norm_in_input_dtype):
    hf = hf_model(name)
    model = from_hf(hf)
    assert model_args(model).family == family_of_hf_config(hf.config).name
    ids, mask = ragged_batch()
    with torch.no_grad():
        logits = make_forward(**LAYOUTS[layout])(model, ids, mask)
        want = [hf(ids[i][mask[i]][None]).logits[0] for i in range(ids.shape[0])]
    assert logits.dtype == torch.float64 and logits.shape == (*ids.shape, TINY["vocab_size"])
    for i, ref in enumerate(want):
        assert ref.abs().max() > 3  # O(1) weights: logits far from zero
        torch.testing.assert_close(logits[i][mask[i]], ref, atol=1e-10, rtol=0, msg=f"row {i}")
    assert not logits[~mask].any(), "padding positions must be zero"


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_way_back_is_bitwise(name):
    assert_hf_round_trip(hf_model(name))


def test_a_family_is_one_entry_read_from_the_hf_config():
    assert {f.name for f in FAMILIES.values()} == set(FAMILIES)
    assert args_from_hf_config(Qwen2Config(**TINY, num_key_value_heads=2)).family == "qwen2"
    assert args_from_hf_config(LlamaConfig(**TINY, num_key_value_heads=2)).family == "llama"
    assert args_from_hf_config(Qwen2Config(**TINY, num_key_value_heads=2)).qkv_bias  # the family reads its bias
    qwen2 = ModelArgs(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=1, num_attention_heads=4,
                      family="qwen2", qkv_bias=True)
    assert transformer_config(qwen2).add_qkv_bias  # one home: the field, which softmax attention turns into config
    assert not dataclasses.replace(qwen2, qkv_bias=False).qkv_bias  # no family default behind the field
    with pytest.raises(ValueError, match="not one of packfwd's model families"):
        dataclasses.replace(qwen2, family="gpt2")
    with pytest.raises(ValueError, match="packfwd builds 'rmsnorm' only"):
        Family("olmo", ("olmo",), norm="layernorm")
    with pytest.raises(ValueError, match="increasing"):
        Moe(num_experts=4, top_k=2, ffn_hidden_size=8, dense_layers=(1, 0))
    with pytest.raises(ValueError, match="beyond num_layers"):
        dataclasses.replace(qwen2, moe=Moe(num_experts=4, top_k=2, ffn_hidden_size=8, dense_layers=(1,)))


def test_qwen3_is_built_with_qk_norm_and_its_head_dim():
    hf = hf_model("qwen3")
    model = from_hf(hf)
    attention = model.decoder.layers[0].self_attention
    assert model.config.qk_layernorm and model.config.kv_channels == 24  # Megatron sums QK-norm grads over TP
    assert isinstance(attention.q_layernorm, RMSNorm) and attention.k_layernorm.weight.shape == (24,)
    assert attention.linear_proj.weight.shape == (32, 96)
    with pytest.raises(ValueError, match="attention_bias=False"):
        args_from_hf_config(Qwen3Config(**TINY, num_key_value_heads=2, attention_bias=True))
    with pytest.raises(ValueError, match="sliding"):
        args_from_hf_config(Qwen3Config(**TINY, num_key_value_heads=2, use_sliding_window=True))


def _loss(logits, mask, vocab_slice=slice(None)):
    g = torch.Generator().manual_seed(3)
    weights = torch.randn(*mask.shape, TINY["vocab_size"], generator=g, dtype=torch.float64)
    return (logits * weights[..., vocab_slice] * mask[..., None]).sum()


def tp_rank(rank: int, world_size: int, hf):
    """This TP rank's logits (its vocab slice), weights and gradients of :func:`_loss`."""
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel(tp_size=world_size)
    model = from_hf(hf, tp_size=world_size, tp_rank=rank)
    ids, mask = ragged_batch()
    logits = make_forward("thd", tp_size=world_size)(model, ids, mask)
    v = TINY["vocab_size"] // world_size
    _loss(logits, mask, slice(rank * v, (rank + 1) * v)).backward()
    out = {"logits": logits.detach(), "weights": {n: p.detach() for n, p in model.named_parameters()},
           "grads": {n: p.grad for n, p in model.named_parameters()}}
    ps.destroy_model_parallel()
    return out


@pytest.mark.parametrize("name", ["qwen3", "qwen3-tied"])
def test_qwen3_tensor_parallel_over_gloo(name, hf_norm_in_input_dtype):
    hf = hf_model(name)
    ranks = run_local(tp_rank, 2, hf, backend="gloo", timeout=300)
    args = args_from_hf_config(hf.config)
    merged = megatron_to_hf([r["weights"] for r in ranks], args)
    sd = hf.state_dict()
    assert sorted(merged) == sorted(sd) and all(torch.equal(merged[n], t) for n, t in sd.items())

    ids, mask = ragged_batch()
    logits = torch.cat([r["logits"] for r in ranks], dim=-1)
    assert_equals_hf_per_sequence(hf, logits, ids, mask)

    model = from_hf(hf)
    _loss(make_forward("thd")(model, ids, mask), mask).backward()
    want = megatron_to_hf([{n: p.grad for n, p in model.named_parameters()}], args)
    shards = [dict(r["grads"]) for r in ranks]
    for n in shards[0]:
        if "q_layernorm" in n or "k_layernorm" in n:  # each rank's heads' part
            total = sum(s[n] for s in shards)
            for s in shards:
                s[n] = total
    got = megatron_to_hf(shards, args)
    for n, g in want.items():
        torch.testing.assert_close(got[n], g, atol=1e-10, rtol=1e-10, msg=n)


# ------------------------------------------------------------------------------------------------ MLP kinds


class OneExpert:
    """A toy MLP kind: a "router-free MoE" of one SwiGLU expert, stored in HF as ``mlp.expert.*``."""

    def __init__(self):
        self.calls = []

    def config_fields(self, args):
        self.calls.append("config")
        return {}

    def layer_spec(self, args, layer):
        from packfwd.models.runtime.spec import mlp_spec

        self.calls.append(("spec", layer))
        return mlp_spec(None)

    def hf_to_megatron(self, args, sd, hf_layer, mg_layer, *, tp_size, tp_rank):
        rows = lambda name: sd[f"{hf_layer}mlp.expert.{name}.weight"].chunk(tp_size)[tp_rank]  # noqa: E731
        return {f"{mg_layer}mlp.linear_fc1.weight": torch.cat([rows("gate_proj"), rows("up_proj")]),
                f"{mg_layer}mlp.linear_fc2.weight": sd[f"{hf_layer}mlp.expert.down_proj.weight"].chunk(
                    tp_size, dim=1)[tp_rank].clone()}

    def megatron_to_hf(self, args, shards, mg_layer, hf_layer):
        gates, ups = zip(*(s[f"{mg_layer}mlp.linear_fc1.weight"].chunk(2) for s in shards))
        down = torch.cat([s[f"{mg_layer}mlp.linear_fc2.weight"] for s in shards], dim=1)
        return {f"{hf_layer}mlp.expert.gate_proj.weight": torch.cat(gates),
                f"{hf_layer}mlp.expert.up_proj.weight": torch.cat(ups), f"{hf_layer}mlp.expert.down_proj.weight": down}


def test_a_registered_mlp_kind_builds_and_converts_its_layers(monkeypatch):
    kind = OneExpert()
    monkeypatch.setitem(mlp_module._MLP_KINDS, Moe, kind)
    args = ModelArgs(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=3, num_attention_heads=4,
                     num_query_groups=2, head_dim=8,
                     moe=Moe(num_experts=1, top_k=1, ffn_hidden_size=64, dense_layers=(1,)))
    model = build_model(args)
    assert kind.calls == ["config", ("spec", 0), ("spec", 2)]  # layer 1 is dense: built by packfwd's spec
    assert model_args(model) == args
    back = to_hf_state_dict(model)
    assert "model.layers.0.mlp.expert.up_proj.weight" in back and "model.layers.1.mlp.up_proj.weight" in back
    shards = [hf_to_megatron(back, args, tp_size=2, tp_rank=r) for r in range(2)]
    merged = megatron_to_hf(shards, args)
    assert sorted(merged) == sorted(back) and all(torch.equal(merged[n], t) for n, t in back.items())


def test_without_a_registered_kind_a_moe_model_names_the_fix(monkeypatch):
    monkeypatch.delitem(mlp_module._MLP_KINDS, Moe, raising=False)
    args = ModelArgs(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=2, num_attention_heads=4,
                     moe=Moe(num_experts=4, top_k=2, ffn_hidden_size=16))
    with pytest.raises(NotImplementedError, match="register_mlp_kind"):
        build_model(args)
    with pytest.raises(TypeError, match="frozen dataclass"):
        mlp_module.register_mlp_kind(dict, OneExpert())


def test_qwen2_vl_is_an_entry_read_like_the_others():
    """The VL language model is the ``qwen2_vl`` entry (a Qwen2 with multimodal RoPE): the same reader as every
    family, its text config under ``text_config``; the generic ``from_hf`` points to the vision builders."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from packfwd.models.families import FAMILIES
    from packfwd.models.convert.hf_vl import vl_args_from_hf_config

    cfg = Qwen2VLConfig(text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
                                         rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3])),
                        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2))
    args = vl_args_from_hf_config(cfg)
    assert (args.family, args.mrope_section, args.qkv_bias, args.kv_channels) == ("qwen2_vl", (2, 3, 3), True, 16)
    assert FAMILIES["qwen2_vl"].mrope and not FAMILIES["qwen2"].mrope
    with pytest.raises(ValueError, match="packfwd.vision.from_hf"):
        from_hf(Qwen2VLForConditionalGeneration(cfg))


def test_attention_dropout_is_refused_not_ignored():
    """transformers applies attention dropout in train mode; packfwd builds none, so a config asking for it is
    refused (a training step would silently differ)."""
    cfg = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, attention_dropout=0.1)
    with pytest.raises(ValueError, match="attention_dropout=0.1"):
        args_from_hf_config(cfg)
