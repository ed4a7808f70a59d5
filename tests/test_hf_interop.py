"""packfwd's Megatron-Core models against HF transformers.

Strategy: tiny Llama and Qwen2 models with random weights (every parameter randomised, biases and norms
included, so a layout error cannot hide behind zeros or ones).  The reference is the HF model run on each
sequence alone, unpadded, in float32: packfwd's model run on the whole ragged batch (right, left and mixed
padding with holes), packed (THD) or compacted (BSHD), must reproduce it token for token.  Log-probs and
entropy are checked against a float64 computation on the HF logits; gradients against HF's gradients of the
same loss.  Weight conversion is checked exactly (round trip) and, for TP shards, against slices written out
head by head.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForTokenClassification,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForTokenClassification,
)

from packfwd import next_token_labels
from packfwd.forward import make_forward
from packfwd.logits import log_probs_and_entropy
from packfwd.models import from_hf, megatron_to_hf, to_hf_state_dict
from packfwd.models.runtime.gpt import model_args
from packfwd.models.convert.hf import args_from_hf_config
from packfwd.models.convert.hf_weights import hf_to_megatron

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)
CONFIGS = {
    "llama-gqa": (LlamaConfig, dict(num_key_value_heads=2, rope_theta=500000.0)),
    "llama-tied-mha": (LlamaConfig, dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-linear-bias": (LlamaConfig, dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True)),
    "qwen2-gqa-bias": (Qwen2Config, dict(num_key_value_heads=2, rms_norm_eps=1e-5)),
}
CAUSAL_LM = {LlamaConfig: LlamaForCausalLM, Qwen2Config: Qwen2ForCausalLM}
VALUE = {LlamaConfig: LlamaForTokenClassification, Qwen2Config: Qwen2ForTokenClassification}


def randomise(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)
    return model.eval()


def hf_model(name: str, *, value: bool = False, seed: int = 0):
    config_cls, extra = CONFIGS[name]
    config = config_cls(**TINY, **extra, **({"num_labels": 1} if value else {}))
    model_cls = VALUE[config_cls] if value else CAUSAL_LM[config_cls]
    return randomise(model_cls(config), seed)


def ragged_batch(padding: str, seed: int = 0):
    """ids [4, 12] and a mask: lengths 12, 7, 3, 9 placed right, left, or mixed (right, left, holes)."""
    g = torch.Generator().manual_seed(seed)
    b, s, lengths = 4, 12, [12, 7, 3, 9]
    ids = torch.randint(0, 128, (b, s), generator=g)
    mask = torch.zeros(b, s, dtype=torch.bool)
    for i, n in enumerate(lengths):
        side = padding if padding != "mixed" else ("right", "left", "holes", "left")[i]
        if side == "right":
            mask[i, :n] = True
        elif side == "left":
            mask[i, s - n :] = True
        else:  # real tokens at every other column, then the rest at the end
            cols = list(range(0, s, 2))[:n]
            cols += [c for c in range(s - 1, -1, -1) if c not in cols][: n - len(cols)]
            mask[i, cols] = True
    ids = ids.masked_fill(~mask, 0)
    return ids, mask


def per_sequence(hf, ids, mask):
    """The HF model's output ([n_i, ...]) on each sequence alone."""
    with torch.no_grad():
        return [hf(ids[i][mask[i]][None]).logits[0] for i in range(ids.shape[0])]


@pytest.mark.parametrize("padding", ["right", "left", "mixed"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_hf_per_sequence(name, padding):
    hf = hf_model(name)
    model = from_hf(hf)
    ids, mask = ragged_batch(padding)
    want = per_sequence(hf, ids, mask)
    for data_format in ("thd", "bshd"):
        with torch.no_grad():
            logits = make_forward(data_format)(model, ids, mask)
        assert logits.shape == (*ids.shape, 128)
        for i, ref in enumerate(want):
            torch.testing.assert_close(logits[i][mask[i]], ref, atol=2e-5, rtol=1e-4, msg=f"{data_format} row {i}")
        assert not logits[~mask].any(), "padding positions must be zero"


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-gqa-bias"])
def test_value_head_matches_hf_token_classifier(name):
    hf = hf_model(name, value=True)
    model = from_hf(hf)
    ids, mask = ragged_batch("mixed")
    want = [w[:, 0] for w in per_sequence(hf, ids, mask)]
    for data_format in ("thd", "bshd"):
        with torch.no_grad():
            values = make_forward(data_format)(model, ids, mask)
        assert values.shape == ids.shape
        for i, ref in enumerate(want):
            torch.testing.assert_close(values[i][mask[i]], ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cls", ["LlamaForSequenceClassification", "Qwen2ForSequenceClassification"])
def test_a_sequence_classifier_reward_model_gives_its_reward_at_each_last_token(cls):
    """A reward model (``...ForSequenceClassification``, one label, a score head without bias) loads as a value
    model whatever its config's ``token_classification_bias`` says: its value at a sequence's last token is the
    transformers model's reward for that sequence alone."""
    import transformers

    config = (LlamaConfig if cls.startswith("Llama") else Qwen2Config)(**TINY, num_key_value_heads=2, num_labels=1,
                                                                        pad_token_id=0)
    hf = randomise(getattr(transformers, cls)(config)).eval()
    model = from_hf(hf)
    ids, mask = ragged_batch("mixed")
    with torch.no_grad():
        values = make_forward("thd")(model, ids, mask)
        for i in range(ids.shape[0]):
            reward = hf(ids[i][mask[i]][None]).logits[0, 0]
            last = int(mask[i].nonzero()[-1, 0])
            torch.testing.assert_close(values[i, last], reward, atol=2e-5, rtol=1e-4)


def test_log_probs_and_entropy_match_float64():
    hf = hf_model("qwen2-gqa-bias")
    model = from_hf(hf)
    ids, mask = ragged_batch("mixed")
    labels = next_token_labels(ids, mask)
    temperature = torch.tensor([1.0, 0.7, 2.0, 1.3])
    with torch.no_grad():
        out = make_forward("thd", logits_processor=log_probs_and_entropy, scored_only=False)(  # every token's
            model, ids, mask, labels=labels, temperature=temperature
        )
    for i, logits in enumerate(per_sequence(hf, ids, mask)):
        logp = torch.log_softmax(logits.double() / temperature[i].double(), -1)
        lab = labels[i][mask[i]]
        want_lp = torch.where(lab >= 0, logp.gather(-1, lab.clamp(min=0)[:, None])[:, 0], 0.0)
        want_ent = -(logp.exp() * logp).sum(-1)
        torch.testing.assert_close(out["log_probs"][i][mask[i]].double(), want_lp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out["entropy"][i][mask[i]].double(), want_ent, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama-tied-mha", "qwen2-gqa-bias"])
@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_gradients_match_hf(name, data_format):
    hf = hf_model(name)
    model = from_hf(hf)
    ids, mask = ragged_batch("mixed")
    labels = next_token_labels(ids, mask)
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(5))

    forward = make_forward(data_format, logits_processor=log_probs_and_entropy, scored_only=False)  # every token
    out = forward(model, ids, mask, labels=labels)
    ((out["log_probs"] + 0.1 * out["entropy"]) * weights * mask).sum().backward()

    total = 0.0
    for i in range(ids.shape[0]):
        logits = hf(ids[i][mask[i]][None]).logits[0]
        logp = torch.log_softmax(logits, -1)
        lab = labels[i][mask[i]]
        lp = torch.where(lab >= 0, logp.gather(-1, lab.clamp(min=0)[:, None])[:, 0], 0.0)
        ent = -(logp.exp() * logp).sum(-1)
        total = total + ((lp + 0.1 * ent) * weights[i][mask[i]]).sum()
    total.backward()

    grads = {n: p.grad for n, p in model.named_parameters()}
    mapped = megatron_to_hf([grads], model_args(model))
    hf_grads = dict(hf.named_parameters())
    hf_grads = {n: hf_grads.get(n, hf_grads.get("model.embed_tokens.weight") if n == "lm_head.weight" else None).grad
                for n in mapped}
    for n in mapped:
        torch.testing.assert_close(mapped[n], hf_grads[n], atol=2e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("value", [False, True])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_state_dict_round_trip_is_exact(name, value):
    hf = hf_model(name, value=value)
    back = to_hf_state_dict(from_hf(hf))
    ref = hf.state_dict()
    assert sorted(back) == sorted(ref)
    for n, t in ref.items():
        assert torch.equal(back[n], t), n


def test_tp_shards_by_hand():
    """Each TP rank's shard written out head by head from the HF weights; merging all shards gives them back."""
    hf = hf_model("llama-gqa")
    args = args_from_hf_config(hf.config)
    sd = hf.state_dict()
    tp, groups, per_group, d = 2, 2, 2, 16
    shards = [hf_to_megatron(sd, args, tp_size=tp, tp_rank=r) for r in range(tp)]
    p = "model.layers.1."
    for r, shard in enumerate(shards):
        rows = []
        for grp in range(r * groups // tp, (r + 1) * groups // tp):
            for head in range(grp * per_group, (grp + 1) * per_group):
                rows.append(sd[p + "self_attn.q_proj.weight"][head * d : (head + 1) * d])
            rows.append(sd[p + "self_attn.k_proj.weight"][grp * d : (grp + 1) * d])
            rows.append(sd[p + "self_attn.v_proj.weight"][grp * d : (grp + 1) * d])
        assert torch.equal(shard["decoder.layers.1.self_attention.linear_qkv.weight"], torch.cat(rows))
        half = 128 // tp
        fc1 = torch.cat([sd[p + "mlp.gate_proj.weight"][r * half : (r + 1) * half],
                         sd[p + "mlp.up_proj.weight"][r * half : (r + 1) * half]])
        assert torch.equal(shard["decoder.layers.1.mlp.linear_fc1.weight"], fc1)
        assert torch.equal(shard["decoder.layers.1.mlp.linear_fc2.weight"],
                           sd[p + "mlp.down_proj.weight"][:, r * half : (r + 1) * half])
        assert torch.equal(shard["decoder.layers.1.self_attention.linear_proj.weight"],
                           sd[p + "self_attn.o_proj.weight"][:, r * 32 : (r + 1) * 32])
        embedding = sd["model.embed_tokens.weight"][r * 64 : (r + 1) * 64]
        assert torch.equal(shard["embedding.word_embeddings.weight"], embedding)
        assert torch.equal(shard["output_layer.weight"], sd["lm_head.weight"][r * 64 : (r + 1) * 64])
    merged = megatron_to_hf(shards, args)
    assert sorted(merged) == sorted(sd)
    assert all(torch.equal(merged[n], sd[n]) for n in sd)


def test_tp_merge_with_biases_and_four_ranks():
    hf = hf_model("llama-tied-mha")
    hf.config.attention_bias = hf.config.mlp_bias = False
    args = args_from_hf_config(hf.config)
    sd = hf.state_dict()
    merged = megatron_to_hf([hf_to_megatron(sd, args, tp_size=4, tp_rank=r) for r in range(4)], args)
    assert all(torch.equal(merged[n], sd[n]) for n in sd)
    bias = hf_model("llama-linear-bias")
    args = args_from_hf_config(bias.config)
    sd = bias.state_dict()
    merged = megatron_to_hf([hf_to_megatron(sd, args, tp_size=1, tp_rank=0)], args)
    assert all(torch.equal(merged[n], sd[n]) for n in sd)


def test_llama3_rope_scaling_matches_hf_frequencies():
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    hf = randomise(LlamaForCausalLM(LlamaConfig(**TINY, num_key_value_heads=2, rope_parameters=rope)))
    args = args_from_hf_config(hf.config)
    assert (args.rope_theta, args.rope_scaling_factor) == (500000.0, 8.0)
    model = from_hf(hf)
    torch.testing.assert_close(model.rotary_pos_emb.inv_freq, hf.model.rotary_emb.inv_freq.float())
    ids, mask = ragged_batch("right")
    logits = make_forward("thd")(model, ids, mask)
    for i, ref in enumerate(per_sequence(hf, ids, mask)):
        torch.testing.assert_close(logits[i][mask[i]], ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "config, error",
    [
        (SimpleNamespace(model_type="gpt2"), "not supported"),
        (LlamaConfig(**TINY, attention_bias=True, mlp_bias=False), "both must be equal"),
        (LlamaConfig(**TINY, hidden_act="gelu"), "silu"),
        (Qwen2Config(**TINY, use_sliding_window=True, sliding_window=4), "sliding"),
        (LlamaConfig(**TINY, rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}), "rope_type"),
    ],
)
def test_unsupported_configs_are_refused(config, error):
    with pytest.raises(ValueError, match=error):
        args_from_hf_config(config)


def test_tp_size_must_divide():
    hf = hf_model("llama-gqa")
    with pytest.raises(ValueError, match="num_query_groups=2 is not divisible by tp_size=4"):
        hf_to_megatron(hf.state_dict(), args_from_hf_config(hf.config), tp_size=4, tp_rank=0)
    with pytest.raises(ValueError, match="tp_rank"):
        hf_to_megatron(hf.state_dict(), args_from_hf_config(hf.config), tp_size=2, tp_rank=2)
