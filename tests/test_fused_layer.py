"""The fused layer switch (``ModelArgs.fused``): what each setting builds, that both hold the same state, and that
on the CPU (where every fused module falls back to its plain module's torch ops) both compute the same bits.

Strategy: each family shape that builds different modules (Llama: norms and a dense MLP; Qwen3: QK-norm; an MoE
model with a shared expert and a dense first layer; a value model with MTP-free defaults) is built both ways from
the same seed, and its modules, state dict, HF export and packed forward and backward are compared.  The kernels
themselves are tested in ``tests/gpu/test_{rmsnorm,swiglu,rope}_kernel.py`` (Triton's interpreter on the CPU), and
the fused model against the plain one on CUDA in ``tests/gpu/test_fused_layer_cuda.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from packfwd.forward import make_forward
from packfwd.models import ModelArgs, build_model
from packfwd.models.mlp import Moe
from packfwd.models.runtime.gpt import model_args
from packfwd.models.mixers.rope import PackedRope
from packfwd.models.norm import FusedRMSNorm, RMSNorm
from packfwd.ops.swiglu import SwiGLU

from .test_hf_interop import ragged_batch

SMALL = dict(vocab_size=128, hidden_size=32, ffn_hidden_size=48, num_layers=2, num_attention_heads=4,
             num_query_groups=2)
CASES = {
    "llama": ModelArgs(**SMALL),
    "qwen3": ModelArgs(**SMALL, family="qwen3", head_dim=16, qk_norm=True),
    "partial-rope": ModelArgs(**SMALL, rotary_percent=0.5),
    "moe": ModelArgs(**SMALL, family="qwen3_moe", qk_norm=True,
                     moe=Moe(num_experts=4, top_k=2, ffn_hidden_size=16, shared_ffn_hidden_size=24, dense_layers=(0,))),
    "value": ModelArgs(**SMALL, value_head=True),
}


def both(args: ModelArgs, **kwargs):
    """The fused and the plain model of ``args`` from the same seed."""
    torch.manual_seed(0)
    fused = build_model(dataclasses.replace(args, fused=True), **kwargs)
    torch.manual_seed(0)
    plain = build_model(dataclasses.replace(args, fused=False), **kwargs)
    return fused, plain


def norms(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]


def mlps(model):
    from megatron.core.transformer.mlp import MLP

    return [m for m in model.modules() if isinstance(m, MLP)]


def ropes(model):
    return {id(m.rope): m.rope for m in model.modules() if isinstance(getattr(m, "rope", None), PackedRope)}


def test_fused_is_the_default():
    assert ModelArgs(**SMALL).fused is True
    with pytest.raises(TypeError, match="ModelArgs.fused must be True"):
        ModelArgs(**SMALL, fused="no")


@pytest.mark.parametrize("name", list(CASES))
def test_switch_builds_fused_or_plain_modules(name):
    """fused=True: every RMSNorm (input, pre-MLP, QK, final) fused, every gated MLP (dense, each expert, the shared
    expert) with the SwiGLU module, the THD RoPE fused; fused=False: Megatron-Core's plain modules (packfwd's
    RMSNorm, the MLP's own unfused glu, the torch RoPE), as before the switch existed."""
    fused, plain = both(CASES[name])
    want_norms = 2 * 2 + 1 + (4 if CASES[name].qk_norm else 0)
    assert len(norms(fused)) == len(norms(plain)) == want_norms
    # the layer norms stay torch's (one fused CUDA kernel, as fast as packfwd's Triton one over the hidden size:
    # spec docstring); QK-norm's narrow rows take the kernels in a fused model
    qk = {n for n, m in fused.named_modules() if n.endswith(("q_layernorm", "k_layernorm"))
          and isinstance(m, torch.nn.RMSNorm)}
    assert len(qk) == (4 if CASES[name].qk_norm else 0)
    for n, m in fused.named_modules():
        if any(m is x for x in norms(fused)):
            assert (type(m) is FusedRMSNorm and m.fused) if n in qk else (type(m) is RMSNorm and not m.fused), n
    assert all(type(m) is RMSNorm and not m.fused for m in norms(plain))
    want_mlps = 1 + (4 + 1 if name == "moe" else 1)  # layer 0 dense; layer 1 dense, or 4 experts and a shared one
    assert len(mlps(fused)) == len(mlps(plain)) == want_mlps
    assert all(isinstance(m.activation_func, SwiGLU) for m in mlps(fused))
    assert all(m.activation_func is F.silu for m in mlps(plain))
    assert fused.config.use_te_activation_func and not plain.config.use_te_activation_func
    assert [r.fused for r in ropes(fused).values()] == [True] and [r.fused for r in ropes(plain).values()] == [False]
    assert model_args(fused).fused is True and model_args(plain).fused is False


@pytest.mark.parametrize("name", list(CASES))
def test_same_state(name):
    """Same parameter names, shapes and (same seed) values: the switch adds no state, so checkpoints, from_hf and
    to_hf are the same either way."""
    from packfwd.models import to_hf_state_dict

    fused, plain = both(CASES[name])
    a, b = fused.state_dict(), plain.state_dict()
    assert list(a) == list(b)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].shape == b[key].shape and torch.equal(a[key], b[key]), key
    if not CASES[name].value_head:
        hf_a, hf_b = to_hf_state_dict(fused), to_hf_state_dict(plain)
        assert list(hf_a) == list(hf_b) and all(torch.equal(hf_a[k], hf_b[k]) for k in hf_a)


def test_sharded_state_dict_is_the_same():
    """Megatron-Core's distributed checkpoint asks every child of an MLP for its sharded state dict (0.16): the
    activation module answers with nothing, so both models give the same keys."""
    fused, plain = both(CASES["moe"])
    assert sorted(fused.sharded_state_dict()) == sorted(plain.sharded_state_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_forward_and_backward_are_bitwise_the_plain_models(name, dtype):
    """On the CPU the fused modules take their plain modules' torch ops: a packed THD forward and the parameter
    gradients of a loss over it are bit for bit the plain model's."""
    fused, plain = both(CASES[name], params_dtype=dtype)
    ids, mask = ragged_batch("mixed")
    out = []
    for model in (fused, plain):
        logits = make_forward("thd")(model, ids, mask)
        weight = mask.reshape(*mask.shape, *[1] * (logits.dim() - 2))  # logits [b, s, v], values [b, s]
        (logits.float().square() * weight).sum().backward()
        out.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (la, ga), (lb, gb) = out
    assert la.dtype == dtype and torch.equal(la, lb) and la[mask].abs().sum() > 0
    assert list(ga) == list(gb)
    for n in ga:
        assert ga[n] is not None and torch.equal(ga[n], gb[n]), n


def test_from_hf_takes_the_switch():
    from transformers import LlamaConfig, LlamaForCausalLM

    from packfwd.models import from_hf, to_hf_state_dict

    hf = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)).eval()
    fused, plain = from_hf(hf), from_hf(hf, fused=False)
    assert model_args(fused).fused and not model_args(plain).fused
    assert type(plain.decoder.final_layernorm) is RMSNorm and type(fused.decoder.final_layernorm) is RMSNorm
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        assert torch.equal(fused(ids, None, None), plain(ids, None, None))
    a, b = to_hf_state_dict(fused), to_hf_state_dict(plain)
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
