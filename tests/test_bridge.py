"""mbridge 0.15.1 (the HF <-> Megatron-Core bridge verl uses) as an independent oracle of packfwd's weight mapping.

Strategy: per family, a tiny transformers causal LM with random float64 weights is saved with ``save_pretrained``
(the checkpoint a user has: transformers 5 writes MoE experts back under their per-expert names).  mbridge's
``load_weights`` reads that directory into a packfwd model built by ``build_model`` (weights first set to NaN),
and every parameter must equal ``from_hf``'s bit for bit; mbridge's ``export_weights`` of that model must give
the checkpoint back, names and bits.  Under TP=2 over gloo each rank's shard loaded by mbridge (it scatters
from TP rank 0) equals ``from_hf``'s shard, and the export (it all-gathers) is the checkpoint again.

The adapter is public, :func:`packfwd.verl.packfwd_bridge` (``packfwd/verl/bridge.py``), and mostly renames:
packfwd builds Megatron-Core's non-TE layers, so its norms are ``input_layernorm`` / ``pre_mlp_layernorm`` (mbridge
knows TE's fused ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``) and its experts are
``SequentialMLP``'s ``local_experts.{e}.linear_fc1.weight`` (mbridge knows TEGroupedMLP's ``linear_fc1.weight{e}``).
It also fills ``head_dim`` when transformers 5 leaves it None (Mixtral), gives each bridge its own
``_DIRECT_MAPPING`` and sets the bridge's ``dtype`` to the model's.  mbridge's own model, config and layer spec are
not used: packfwd builds the model (so no ``rope_theta`` shim is needed: only mbridge's model provider reads it).
``test_the_documented_use`` is the module docstring's example, step by step.

The last tests pin where mbridge 0.15.1 is missing or wrong (the evidence for keeping packfwd's hand-written
mapping as the default, docs/models.md "Conversion, hand-written or a bridge"); one failing after an mbridge
upgrade means that paragraph needs another look.  Skipped when mbridge is not importable (``make`` installs it).
"""

from __future__ import annotations

import copy
import subprocess
import sys
import types

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen2ForTokenClassification, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from packfwd.models import build_model, from_hf
from packfwd.models.convert.hf import args_from_hf_config
from packfwd.verl import packfwd_bridge

try:
    from mbridge.core.bridge import _MODEL_REGISTRY
except ImportError as error:  # ModuleNotFoundError too: mbridge itself, or einops (it imports it)
    pytest.skip(f"mbridge is not importable ({error}); install it with `.venv/bin/pip install --no-deps "
                "mbridge==0.15.1 einops`, as the Makefile's .venv/.packfwd-installed recipe does",
                allow_module_level=True)

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
MOE = dict(num_experts_per_tok=2, experts_implementation="eager")
CASES = {  # name: (model class, config)
    "llama": (LlamaForCausalLM, LlamaConfig(**TINY, intermediate_size=48, rope_theta=500000.0)),
    "llama-tied": (LlamaForCausalLM, LlamaConfig(**TINY, intermediate_size=48, tie_word_embeddings=True)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**TINY, intermediate_size=48)),  # qkv biases
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**TINY, intermediate_size=48, head_dim=24)),  # 4 x 24 != 32
    "qwen3-tied": (Qwen3ForCausalLM, Qwen3Config(**TINY, intermediate_size=48, head_dim=16, tie_word_embeddings=True)),
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**TINY, **MOE, intermediate_size=48, moe_intermediate_size=16,
                                                      num_experts=4, norm_topk_prob=True, head_dim=16)),
    "mixtral": (MixtralForCausalLM, MixtralConfig(**TINY, **MOE, intermediate_size=16, num_local_experts=4)),
    "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig(**TINY, **MOE, intermediate_size=48, moe_intermediate_size=16,
                                                      num_experts=4, shared_expert_intermediate_size=24)),
}


def randomised(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """``model`` in float64, every matrix ~ N(0, 1 / fan_in), norms ~ 1 + noise."""
    g = torch.Generator().manual_seed(seed)
    model = model.double()
    with torch.no_grad():
        for n, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            p.copy_(1.0 + 0.2 * noise if "norm" in n else noise * p.shape[-1] ** -0.5)
    return model.eval()


def hf_model(name: str) -> torch.nn.Module:
    model_cls, config = CASES[name]
    return randomised(model_cls(copy.deepcopy(config)))


def checkpoint(hf, directory) -> dict:
    """Save ``hf`` as transformers does; return the tensors of its checkpoint."""
    from safetensors.torch import load_file

    hf.save_pretrained(directory)
    return load_file(f"{directory}/model.safetensors")


def load_and_export(hf, directory, **parallel) -> tuple[dict, dict, dict]:
    """(from_hf's parameters, mbridge's parameters loaded into a NaN model, mbridge's export of that model).

    The model is built for loading (``init=False``, as ``from_hf`` builds it): mbridge's export gathers only weights
    with Megatron-Core's TP attributes, which packfwd sets on such a model too."""
    want = {n: p.detach() for n, p in from_hf(hf, **parallel).named_parameters()}
    model = build_model(args_from_hf_config(hf.config), params_dtype=torch.float64, init=False)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    bridge = packfwd_bridge(hf.config, torch.float64)
    bridge.load_weights([model], str(directory))
    got = {n: p.detach() for n, p in model.named_parameters()}
    return want, got, dict(bridge.export_weights([model]))


def differences(want: dict, got: dict) -> list[str]:
    """Names in one dict only, and names whose tensors differ (bitwise)."""
    return sorted(set(want) ^ set(got)) + [n for n in want if n in got and not torch.equal(want[n], got[n])]


@pytest.mark.parametrize("name", sorted(CASES))
def test_mbridge_loads_and_exports_what_the_hand_written_mapping_does(name, tmp_path):
    hf = hf_model(name)
    ckpt = checkpoint(hf, tmp_path)
    want, got, exported = load_and_export(hf, tmp_path)
    assert differences(want, got) == []
    assert differences(ckpt, exported) == []


def _tp_rank(rank: int, world_size: int, cases: dict) -> dict:
    """Per case (name: (HF model, checkpoint directory)): the differences of this TP rank's shard and export."""
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel(tp_size=world_size)
    out = {}
    for name, (hf, directory) in cases.items():
        want, got, exported = load_and_export(hf, directory, tp_size=world_size, tp_rank=rank)
        out[name] = (differences(want, got), exported)
    ps.destroy_model_parallel()
    return out


def test_tp2_over_gloo_each_rank_loads_its_shard_and_exports_the_checkpoint(tmp_path):
    """mbridge needs a real TP group (TP rank 0 reads and scatters; the export all-gathers), so this spawns two."""
    from packfwd.testing import run_local

    cases, ckpts = {}, {}
    for name in ("qwen3", "qwen3_moe"):
        hf = hf_model(name)
        ckpts[name] = checkpoint(hf, tmp_path / name)
        cases[name] = (hf, str(tmp_path / name))
    for rank in run_local(_tp_rank, 2, cases, backend="gloo", timeout=300):
        for name, (shard_differences, exported) in rank.items():
            assert shard_differences == [], name
            assert differences(ckpts[name], exported) == [], name


def test_the_documented_use(tmp_path):
    """``packfwd/verl/bridge.py``'s example: a bfloat16 packfwd model of a HF config loads the checkpoint (as
    ``from_hf`` converts it) and exports it back, names and bits."""
    hf = randomised(Qwen3ForCausalLM(copy.deepcopy(CASES["qwen3"][1]))).to(torch.bfloat16)
    ckpt = checkpoint(hf, tmp_path)
    hf_config, checkpoint_dir = hf.config, str(tmp_path)
    model = build_model(args_from_hf_config(hf_config), params_dtype=torch.bfloat16, init=False)

    bridge = packfwd_bridge(hf_config, torch.bfloat16)   # the model's parameter dtype
    bridge.load_weights([model], checkpoint_dir)         # the HF safetensors into the model's parameters
    hf_weights = dict(bridge.export_weights([model]))    # and back, by HF name

    want = {n: p.detach() for n, p in from_hf(hf, params_dtype=torch.bfloat16).named_parameters()}
    assert differences(want, {n: p.detach() for n, p in model.named_parameters()}) == []
    assert differences(ckpt, hf_weights) == []


def test_a_bridge_of_another_dtype_rounds_the_weights(tmp_path):
    """Why ``dtype`` has no default: mbridge casts every HF weight to the bridge's dtype on load, so a float64 model
    loaded by a bfloat16 bridge (mbridge's default) holds rounded weights (the negative control of the test above)."""
    hf = hf_model("qwen3")
    checkpoint(hf, tmp_path)
    model = build_model(args_from_hf_config(hf.config), params_dtype=torch.float64, init=False)
    packfwd_bridge(hf.config, torch.bfloat16).load_weights([model], str(tmp_path))
    want = {n: p.detach() for n, p in from_hf(hf).named_parameters()}
    assert differences(want, {n: p.detach() for n, p in model.named_parameters()})  # every matrix rounded
    with pytest.raises(TypeError, match="torch.dtype"):
        packfwd_bridge(hf.config, "bfloat16")


def test_a_model_type_mbridge_lacks_is_named():
    with pytest.raises(ValueError, match="no bridge for model_type='qwen2_vl'"):
        packfwd_bridge(types.SimpleNamespace(model_type="qwen2_vl"), torch.float32)


def test_importing_packfwd_verl_imports_neither_mbridge_verl_nor_megatron():
    code = ("import sys, packfwd.verl; bad = sorted({m.split('.')[0] for m in sys.modules} & "
            "{'mbridge', 'verl', 'megatron'}); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------- where mbridge 0.15.1 is missing or wrong


def test_mixtral_needs_the_head_dim_shim():
    """transformers 5's MixtralConfig has head_dim=None; mbridge's qkv merge multiplies it."""
    with pytest.raises(TypeError, match="NoneType"):
        _MODEL_REGISTRY["mixtral"](CASES["mixtral"][1], dtype=torch.float64)._weight_to_mcore_format(
            "decoder.layers.0.self_attention.linear_qkv.weight", [torch.zeros(32, 32)] * 3)


def test_a_tied_bridge_rewires_every_later_untied_qwen_bridge(monkeypatch):
    """Qwen2Bridge._adjust_mapping_for_shared_weights writes into the class's dict (Qwen3Bridge shares it): after
    a tied Qwen2/Qwen3 bridge, an untied one loads the embedding into output_layer (the adapter copies the dict)."""
    from mbridge.models.qwen2 import Qwen2Bridge

    monkeypatch.setitem(Qwen2Bridge._DIRECT_MAPPING, "output_layer.weight", "lm_head.weight")  # restored after
    _MODEL_REGISTRY["qwen3"](CASES["qwen3-tied"][1], dtype=torch.float64)
    untied = _MODEL_REGISTRY["qwen2"](CASES["qwen2"][1], dtype=torch.float64)
    assert untied._DIRECT_MAPPING["output_layer.weight"] == "model.embed_tokens.weight"
    assert packfwd_bridge(CASES["qwen2"][1], torch.float64)._DIRECT_MAPPING["output_layer.weight"] == "lm_head.weight"


def test_tied_llama_last_pipeline_stage_asks_for_a_missing_lm_head(tmp_path):
    """A tied model's last stage holds a copy of the embedding as output_layer.weight: mbridge's Qwen bridges map
    it to model.embed_tokens, its Llama bridge to lm_head.weight, which a tied checkpoint does not have."""
    hf = hf_model("llama-tied")
    checkpoint(hf, tmp_path)
    last = from_hf(hf, pp_rank=1, pp_size=2)
    with pytest.raises(ValueError, match="lm_head.weight"):
        packfwd_bridge(hf.config, torch.float64).load_weights([last], str(tmp_path))


def test_qwen3_moe_dense_layers_are_not_mapped(tmp_path):
    """mlp_only_layers / decoder_sparse_step: mbridge's Qwen3-MoE mapping has no dense-MLP names."""
    config = copy.deepcopy(CASES["qwen3_moe"][1])
    config.mlp_only_layers = [1]
    hf = randomised(Qwen3MoeForCausalLM(config))
    checkpoint(hf, tmp_path)
    with pytest.raises(NotImplementedError, match="decoder.layers.1.mlp.linear_fc1.weight"):
        packfwd_bridge(hf.config, torch.float64).load_weights([from_hf(hf)], str(tmp_path))


def test_llama_biases_on_every_linear_are_not_mapped(tmp_path):
    """Llama's attention_bias + mlp_bias (packfwd converts them): mbridge maps only the q, k, v biases."""
    hf = randomised(LlamaForCausalLM(LlamaConfig(**TINY, intermediate_size=48, attention_bias=True, mlp_bias=True)))
    checkpoint(hf, tmp_path)
    with pytest.raises(NotImplementedError, match="linear_proj.bias"):
        packfwd_bridge(hf.config, torch.float64).load_weights([from_hf(hf)], str(tmp_path))


def test_a_value_head_is_not_mapped(tmp_path):
    """A value model's output_layer (transformers' score, with its bias) has no HF name in mbridge."""
    hf = randomised(Qwen2ForTokenClassification(Qwen2Config(**TINY, intermediate_size=48, num_labels=1)))
    checkpoint(hf, tmp_path)
    with pytest.raises(IndexError):
        packfwd_bridge(hf.config, torch.float64).load_weights([from_hf(hf)], str(tmp_path))


def test_mbridge_configs_route_differently_from_transformers():
    """mbridge's own TransformerConfig (used when it builds the model, not here): Mixtral's softmax before top-k
    without renormalising (transformers renormalises the top-k), Qwen3-MoE's norm_topk_prob and
    mlp_only_layers ignored.  packfwd's config follows the HF fields."""
    from packfwd.models.runtime import transformer_config

    config = copy.deepcopy(CASES["qwen3_moe"][1])
    config.norm_topk_prob, config.mlp_only_layers = False, [1]
    for hf_config in (CASES["mixtral"][1], config):
        theirs = packfwd_bridge(hf_config, torch.float64).config
        ours = transformer_config(args_from_hf_config(hf_config), init=False)
        assert theirs.moe_router_pre_softmax != ours.moe_router_pre_softmax, hf_config.model_type
    assert packfwd_bridge(config, torch.float64).config.moe_layer_freq == 1 and ours.moe_layer_freq == [1, 0]


def test_from_hf_weights_carry_megatron_tp_attributes():
    model = from_hf(hf_model("qwen3"))
    assert all(getattr(p, "tensor_model_parallel", False) for n, p in model.named_parameters()
               if n.endswith(("linear_qkv.weight", "linear_proj.weight", "word_embeddings.weight")))


def test_qwen2_vl_is_not_a_bridge():
    assert "qwen2_vl" not in _MODEL_REGISTRY and "qwen2_5_vl" in _MODEL_REGISTRY



def test_glm4_moe_loads_like_from_hf_and_exports_only_on_cuda(tmp_path):
    """GLM-4.5 (DeepSeek-style routing: sigmoid scores, the correction bias as a buffer, groups, a shared expert,
    partial RoPE, q/k/v biases, QK-norm): mbridge loads every parameter and buffer as ``from_hf`` does, bit for
    bit; its export moves state-dict entries that are not parameters (the expert bias) to CUDA, so it cannot run on
    a CPU-only machine."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    config = Glm4MoeConfig(**TINY, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, n_group=2,
                           topk_group=1, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                           routed_scaling_factor=2.5, partial_rotary_factor=0.5, attention_bias=True,
                           use_qk_norm=True, head_dim=16, experts_implementation="eager")
    hf = randomised(Glm4MoeForCausalLM(config))
    checkpoint(hf, tmp_path)
    with torch.no_grad():
        hf.model.layers[1].mlp.gate.e_score_correction_bias.normal_()  # a buffer: randomised() leaves it 0
    checkpoint(hf, tmp_path)

    def state(model):
        return {n: t.detach() for n, t in model.state_dict().items() if t is not None and "_extra_state" not in n}

    want = state(from_hf(hf))
    model = build_model(args_from_hf_config(hf.config), params_dtype=torch.float64, init=False)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    bridge = packfwd_bridge(hf.config, torch.float64)
    bridge.load_weights([model], str(tmp_path))
    got = state(model)
    assert any("expert_bias" in n for n in got) and differences(want, got) == []
    if not torch.cuda.is_available():
        # a CPU build of torch says "not compiled with CUDA", a CUDA build on a machine without a GPU "no NVIDIA driver"
        with pytest.raises((AssertionError, RuntimeError), match="CUDA|NVIDIA driver"):
            dict(bridge.export_weights([model]))
