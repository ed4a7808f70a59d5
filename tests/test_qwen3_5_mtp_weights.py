"""Qwen3.5's and Qwen3-Next's MTP weights in and out: ``from_hf(hf, mtp_state_dict=)`` and ``to_hf_state_dict``.

Strategy: a random ``mtp.*`` state dict, named as the checkpoints name it (transformers drops these tensors), is
loaded; it must come back bit for bit (whole, and from two TP shards merged), and the loaded model's MTP outputs
must equal a reference built from those HF-named tensors alone with transformers' own modules, one sequence at a
time: the decoder's final-normed hidden state, ``mtp.pre_fc_norm_embedding`` of the next token's embedding and
``mtp.pre_fc_norm_hidden`` of the hidden state (transformers' zero-centred norm), ``mtp.fc`` over ``[embedding,
hidden]``, a full-attention decoder layer holding ``mtp.layers.0.*``, ``mtp.norm``, the shared ``lm_head``.  So
each tensor's place is checked, not just the round trip; the negative control swaps the two pre-fc norms (and the
reference must then differ).  Bad dicts and families without an MTP mapping are refused.  Tiny float64 models of
``tests/test_hybrid_families.py``; the batch of ``tests/mtp_support.py`` (ragged: left, right and holey padding).
Qwen3-Next also as its checkpoints come: a config without ``mtp_num_hidden_layers`` and the MTP layer's routed
experts one tensor per expert (``mtp.layers.0.mlp.experts.{e}.gate_proj.weight`` ...).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import transformers

from packfwd.forward import make_forward
from packfwd.models import from_hf, megatron_to_hf, to_hf_state_dict
from packfwd.models.convert.hf import args_from_hf_config
from packfwd.models.convert.hf_weights import hf_to_megatron

from . import mtp_support as ms
from .test_hybrid_families import ATOL, hf_model

FULL = 3  # the tiny models' full-attention layer (layer_types: 3 linear, then 1 full)
MROPE = {"qwen3_5_text": True, "qwen3_5_moe_text": True, "qwen3_next": False}  # positions per M-RoPE section


def mtp_state(hf, seed: int = 1) -> dict:
    """A random ``mtp.*`` state dict for ``hf`` (the inner layer shaped as its full-attention layer); norms around 0
    (zero-centred), weights ~ N(0, 1 / fan_in)."""
    g = torch.Generator().manual_seed(seed)
    h, prefix = hf.config.hidden_size, f"model.layers.{FULL}."
    shapes = {f"mtp.layers.0.{n[len(prefix):]}": t.shape for n, t in hf.state_dict().items() if n.startswith(prefix)}
    shapes.update({"mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,),
                   "mtp.norm.weight": (h,), "mtp.fc.weight": (h, 2 * h)})
    return {n: torch.randn(s, generator=g, dtype=torch.float64) * (0.3 if "norm" in n else s[-1] ** -0.5)
            for n, s in shapes.items()}


def hf_reference(hf, mtp: dict, seq: torch.Tensor) -> torch.Tensor:
    """Depth 1's log-prob of token ``i + 2`` at token ``i`` of one sequence ``[n]`` (0 at the last two), from
    transformers' modules and the ``mtp.*`` tensors by their HF names (module docstring)."""
    model, n = hf.model, seq.shape[0]

    def norm(name):
        out = copy.deepcopy(model.norm)  # Qwen3_5RMSNorm: rms_norm(x) * (1 + weight)
        out.weight.data = mtp[f"mtp.{name}.weight"].clone()
        return out

    layer = copy.deepcopy(model.layers[FULL])
    layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in mtp.items() if k.startswith("mtp.layers.0.")})
    with torch.no_grad():
        hidden = model(seq[None]).last_hidden_state  # [1, n, h], final-normed
        later = model.embed_tokens(torch.cat([seq[1:], seq.new_zeros(1)])[None])  # token i + 1 (0 past the end)
        x = torch.nn.functional.linear(torch.cat([norm("pre_fc_norm_embedding")(later),
                                                  norm("pre_fc_norm_hidden")(hidden)], dim=-1), mtp["mtp.fc.weight"])
        positions = torch.arange(n)[None]  # Qwen3.5's rotary embedding takes them per M-RoPE section, [3, 1, n]
        causal = torch.full((n, n), float("-inf"), dtype=x.dtype).triu(1)[None, None]
        rope = model.rotary_emb(x, positions.expand(3, 1, n) if MROPE[hf.config.model_type] else positions)
        x = layer(x, position_embeddings=rope, attention_mask=causal, position_ids=positions)
        log_p = torch.log_softmax(hf.lm_head(norm("norm")(x))[0], dim=-1)
    out = log_p.new_zeros(n)
    if n > 2:
        out[: n - 2] = log_p[torch.arange(n - 2), seq[2:]]
    return out


def hf_reference_batch(hf, mtp, ids, mask) -> torch.Tensor:
    out = torch.zeros(ids.shape, dtype=torch.float64)
    for i in range(ids.shape[0]):
        out[i, mask[i]] = hf_reference(hf, mtp, ids[i][mask[i]])
    return out


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_mtp_weights_load_into_the_right_places(family):
    """The loaded model's depth-1 log-probs (THD, a ragged batch) equal the HF-named reference; the main logits
    equal transformers'."""
    hf = hf_model(family, mtp_num_hidden_layers=1)
    mtp = mtp_state(hf)
    model = from_hf(hf, mtp_state_dict=mtp)
    assert model.config.mtp_num_layers == 1
    ids, mask, _, _ = ms.batch()
    with torch.no_grad():
        out = make_forward("thd", mtp=True)(model, ids, mask)
        want_logits = [hf(ids[i][mask[i]][None]).logits[0] for i in range(ids.shape[0])]
    torch.testing.assert_close(out["mtp_log_probs"][..., 0], hf_reference_batch(hf, mtp, ids, mask),
                               **ATOL[family])
    for i, want in enumerate(want_logits):
        torch.testing.assert_close(out["logits"][i][mask[i]], want, **ATOL[family])


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_the_reference_tells_the_norms_apart(family):
    """Negative control: with the two pre-fc norms swapped the reference differs from the loaded model's outputs, so
    the test above would catch a mapping that swapped them."""
    hf = hf_model(family, mtp_num_hidden_layers=1)
    mtp = mtp_state(hf)
    model = from_hf(hf, mtp_state_dict=mtp)
    swapped = {**mtp, "mtp.pre_fc_norm_embedding.weight": mtp["mtp.pre_fc_norm_hidden.weight"],
               "mtp.pre_fc_norm_hidden.weight": mtp["mtp.pre_fc_norm_embedding.weight"]}
    ids, mask, _, _ = ms.batch()
    with torch.no_grad():
        got = make_forward("thd", mtp=True)(model, ids, mask)["mtp_log_probs"][..., 0]
    assert (got - hf_reference_batch(hf, swapped, ids, mask)).abs().amax() > 1e-3


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_mtp_weights_convert_back_bit_for_bit(family):
    """``to_hf_state_dict`` gives the checkpoint's names back, MTP included, bit for bit; two TP shards merge back
    too, ``mtp.fc`` cut by rows as Megatron-Core's column-parallel ``eh_proj`` is; the last of two pipeline stages
    (which holds the MTP layer and a copy of the embedding) loads and gives its part back."""
    hf = hf_model(family, mtp_num_hidden_layers=1)
    mtp = mtp_state(hf)
    model = from_hf(hf, mtp_state_dict=mtp)
    want = {**hf.state_dict(), **mtp}
    back = to_hf_state_dict(model)
    assert sorted(back) == sorted(want) and all(torch.equal(back[n], t) for n, t in want.items())
    args = dataclasses.replace(args_from_hf_config(hf.config), mtp_num_layers=1)
    shards = [hf_to_megatron(want, args, tp_size=2, tp_rank=r) for r in range(2)]
    eh_proj = model.mtp.layers[0].eh_proj.weight
    assert eh_proj.partition_dim == 0 and shards[1]["mtp.layers.0.eh_proj.weight"].shape == (16, 64)
    assert torch.equal(shards[1]["mtp.layers.0.eh_proj.weight"], mtp["mtp.fc.weight"][16:])
    merged = megatron_to_hf(shards, args)
    assert sorted(merged) == sorted(want) and all(torch.equal(merged[n], t) for n, t in want.items())
    last = to_hf_state_dict(from_hf(hf, mtp_state_dict=mtp, pp_rank=1, pp_size=2))  # MTP on the last stage
    assert set(mtp) <= set(last) and all(torch.equal(last[n], want[n]) for n in last)


def test_bad_mtp_state_dicts_are_refused():
    hf = hf_model("qwen3_5", mtp_num_hidden_layers=1)
    mtp = mtp_state(hf)
    fc = "mtp.fc.weight"
    cases = [({k: v for k, v in mtp.items() if k != fc}, r"missing \['mtp.fc.weight'\], unexpected \[\]"),
             ({**mtp, "mtp.embed_tokens.weight": torch.zeros(64, 32)}, r"unexpected \['mtp.embed_tokens.weight'\]"),
             ({**mtp, fc: mtp[fc].T.contiguous()}, r"mtp.fc.weight \(64, 32\) \(want \(32, 64\)\)"),
             ({**mtp, "mtp.layers.0.self_attn.q_norm.weight": torch.zeros(8)}, "q_norm.weight \\(8,\\)")]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            from_hf(hf, mtp_state_dict=bad)
    with pytest.raises(TypeError, match="mtp_state_dict must map"):
        from_hf(hf, mtp_state_dict=list(mtp.items()))
    with pytest.raises(ValueError, match="mtp_num_hidden_layers is 0 or absent"):
        from_hf(hf_model("qwen3_5"), mtp_state_dict=mtp)
    with pytest.raises(ValueError, match="mtp_num_hidden_layers=2: .*packfwd converts one MTP depth"):
        from_hf(hf_model("qwen3_5", mtp_num_hidden_layers=2), mtp_state_dict=mtp)
    qwen2 = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, mtp_num_hidden_layers=1))
    with pytest.raises(ValueError, match="no MTP weight mapping for family 'qwen2'.*leave mtp_state_dict out"):
        from_hf(qwen2, mtp_state_dict=mtp)


def per_expert(mtp: dict) -> dict:
    """``mtp`` with the MTP layer's fused routed experts cut into one tensor per expert, as Qwen3-Next's safetensors
    files hold them (transformers' own conversion fuses ``[gate; up]`` along dim 1)."""
    out, p = dict(mtp), "mtp.layers.0.mlp.experts."
    gate_up, down = out.pop(p + "gate_up_proj"), out.pop(p + "down_proj")
    for e in range(gate_up.shape[0]):
        gate, up = gate_up[e].chunk(2)
        out.update({f"{p}{e}.gate_proj.weight": gate.clone(), f"{p}{e}.up_proj.weight": up.clone(),
                    f"{p}{e}.down_proj.weight": down[e].clone()})
    return out


def test_qwen3_next_as_its_checkpoints_come():
    """A Qwen3-Next config without ``mtp_num_hidden_layers`` (the released configs name none) reads one MTP depth,
    and the MTP experts one tensor per expert load to the same outputs as fused; they come back fused (transformers'
    names, as the decoder's), bit for bit; per-expert tensors missing or misshapen are named."""
    hf = hf_model("qwen3_next")
    assert getattr(hf.config, "mtp_num_hidden_layers", None) is None
    mtp = mtp_state(hf)
    split = per_expert(mtp)
    model = from_hf(hf, mtp_state_dict=split)
    assert model.config.mtp_num_layers == 1
    ids, mask, _, _ = ms.batch()
    with torch.no_grad():
        got = make_forward("thd", mtp=True)(model, ids, mask)["mtp_log_probs"][..., 0]
    torch.testing.assert_close(got, hf_reference_batch(hf, mtp, ids, mask), **ATOL["qwen3_next"])
    back = to_hf_state_dict(model)
    assert all(torch.equal(back[n], t) for n, t in mtp.items()) and not set(split) - set(mtp) & set(back)
    e3 = "mtp.layers.0.mlp.experts.3."
    with pytest.raises(ValueError, match=r"missing \['mtp.layers.0.mlp.experts.3.down_proj.weight'\]"):
        from_hf(hf, mtp_state_dict={n: t for n, t in split.items() if n != e3 + "down_proj.weight"})
    with pytest.raises(ValueError, match=r"experts.3.up_proj.weight \(32, 16\) \(want \(16, 32\)\)"):
        from_hf(hf, mtp_state_dict={**split, e3 + "up_proj.weight": split[e3 + "up_proj.weight"].T.contiguous()})


def test_a_family_without_an_mtp_mapping_refuses_to_convert_its_mtp_layer():
    """A Llama-family model built with MTP layers: ``to_hf_state_dict`` refuses (it would drop them), naming how to
    convert the rest."""
    model = ms.build(dataclasses.replace(ms.ARGS, mtp_num_layers=1))
    with pytest.raises(ValueError, match="no MTP weight mapping for family 'llama'.*mtp_num_layers=0"):
        to_hf_state_dict(model)


def _tp2_ep2_worker(rank: int, world: int):
    """Qwen3.5-MoE with its MTP layer loaded as TP rank ``rank`` of 2, then as EP rank ``rank`` of 2: what
    ``to_hf_state_dict`` gathers back each time, and this rank's ``eh_proj`` shard."""
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime import ensure_model_parallel

    hf = hf_model("qwen3_5_moe", mtp_num_hidden_layers=1)
    out = {}
    for kind in ("tp", "ep"):
        ensure_model_parallel(**{f"{kind}_size": 2})
        model = from_hf(hf, mtp_state_dict=mtp_state(hf), **{f"{kind}_size": 2, f"{kind}_rank": rank})
        out[kind] = to_hf_state_dict(model)
        out[f"{kind}_eh_proj"] = model.mtp.layers[0].eh_proj.weight.detach().clone()
        out[f"{kind}_experts"] = sum(n.startswith("mtp.") and n.endswith("linear_fc1.weight") and ".local_experts." in n
                                     for n, _ in model.named_parameters())
        ps.destroy_model_parallel()
    return out


def test_tp2_and_ep2_load_and_gather_the_mtp_layer():
    """Over gloo: each TP rank loads its rows of ``mtp.fc`` (and its shards of the MTP layer's attention and experts),
    each EP rank its half of the MTP layer's experts; ``to_hf_state_dict`` gathers the checkpoint back bit for bit."""
    from packfwd.testing import run_local

    hf = hf_model("qwen3_5_moe", mtp_num_hidden_layers=1)
    mtp = mtp_state(hf)
    want = {**hf.state_dict(), **mtp}
    ranks = run_local(_tp2_ep2_worker, 2, backend="gloo", timeout=300)
    for rank, out in enumerate(ranks):
        assert torch.equal(out["tp_eh_proj"], mtp["mtp.fc.weight"].chunk(2)[rank])
        assert torch.equal(out["ep_eh_proj"], mtp["mtp.fc.weight"])
        assert (out["tp_experts"], out["ep_experts"]) == (4, 2)  # EP: this rank's half of the MTP layer's experts
        for kind in ("tp", "ep"):
            assert sorted(out[kind]) == sorted(want), kind
            assert all(torch.equal(out[kind][n], t) for n, t in want.items()), kind
