"""The hybrid linear-attention families (Qwen3.5 dense, Qwen3.5-MoE, Qwen3-Next) against transformers.

Strategy: transformers is the oracle, run on each sequence alone (nothing to leak); packfwd runs the whole ragged
batch (left and right padding, sequences of 1 to 150 tokens: several 64-token chunks of the delta
rule) in THD, THD aligned (``seq_align=16``: pads between sequences), BSHD (rows compacted) and through
``model(ids, None, attention_mask)`` (Megatron-Core's calling convention), and every sequence's logits must equal
its lone run.  Tiny float64 models (hidden 32, 4 layers: 3 Gated DeltaNet, 1 gated full attention, the pattern of
``layer_types``; Qwen3-Next with a dense layer among its MoE ones), O(1)-scale weights.

transformers computes the delta rule, its gated norm and decay, the zero-centred norms and the router's softmax in
float32 whatever the model's dtype.  ``tests.oracles.hf_float64_module`` loads a copy of each modeling module with those upcasts lifted
to float64 (``torch.float32`` -> ``torch.float64``, ``.float()`` -> ``.double()``, the router's
``dtype=torch.float`` -> ``torch.float64``; the RoPE angles keep float32, as packfwd's); one test runs the
unmodified module in float32 at float32's tolerance, so the lift hides nothing.

Also: a Gated DeltaNet layer under ``torch.compile(fullgraph=True)``; gradients equal transformers'; Qwen3.5's MTP layer against the per-sequence reference of
``tests/mtp_support.py``; two pipeline stages equal to the whole model; conversion both ways bit for bit (whole and from two TP
shards); the MoE aux loss equal to transformers'
load-balancing loss over the real tokens and unchanged by padding; and, over gloo, TP=2 with sequence parallelism
(Qwen3.5, THD and BSHD), CP=2 (Qwen3.5, THD and THD aligned: logits equal transformers', the ranks' gradients summed
equal one process's), TP=2 + SP with CP=2 on four ranks (the same, a model with four key heads) and EP=2
(Qwen3.5-MoE) equal to transformers; CP refused where the heads do not divide.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from packfwd.forward import make_forward
from packfwd.models import build_model, from_hf, megatron_to_hf, to_hf_state_dict
from packfwd.models.convert.hf import args_from_hf_config
from packfwd.models.convert.hf_weights import hf_to_megatron

from .oracles import assert_equals_hf_per_sequence, hf_float64_module
from .test_compile_layer import quiet_megatron  # noqa: F401 (a fixture)

transformers = pytest.importorskip("transformers")
MODULES = {
    "qwen3_5": ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeTextConfig",
                    "Qwen3_5MoeForCausalLM"),
    "qwen3_next": ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM"),
}
if not all(hasattr(transformers, cfg) for _, cfg, _ in MODULES.values()):
    pytest.skip(f"transformers {transformers.__version__} lacks Qwen3.5 / Qwen3-Next", allow_module_level=True)

TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, rms_norm_eps=1e-6)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
           experts_implementation="eager")
EXTRA = {"qwen3_5": dict(intermediate_size=48), "qwen3_5_moe": MOE,
         "qwen3_next": dict(MOE, intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=True)}
FAMILIES = sorted(MODULES)
# Megatron-Core's router takes its softmax in float32 (tests/test_moe.py's tolerance); the dense model is exact
ATOL = {"qwen3_5": dict(atol=1e-10, rtol=0.0), "qwen3_5_moe": dict(atol=2e-5, rtol=1e-5),
        "qwen3_next": dict(atol=2e-5, rtol=1e-5)}


def hf_model(family: str, *, lifted: bool = True, seed: int = 0, **extra) -> torch.nn.Module:
    """The tiny float64 model of ``family`` (module docstring): weights ~ N(0, 1 / fan_in), norms and decays
    noisy around their starting values."""
    path, config_name, model_name = MODULES[family]
    config = getattr(transformers, config_name)(**{**TINY, **EXTRA[family], **extra})
    model_cls = getattr(hf_float64_module(path) if lifted else importlib.import_module(path), model_name)
    torch.manual_seed(seed)  # transformers draws A_log from the global generator: the same model in every process
    model = model_cls(config).double()
    randomise(model, torch.Generator().manual_seed(seed))
    return model.eval()


def randomise(model, g: torch.Generator) -> None:
    """In place: weights ~ N(0, 1 / fan_in); norms, decays (``A_log``, ``dt_bias``) noisy around their starting
    values (a linear-attention model's test weights)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            small = "norm" in name or name.endswith(("A_log", "dt_bias"))
            p.copy_(p + 0.3 * noise if small else noise * p.shape[-1] ** -0.5)


def ragged_batch(seed: int = 0):
    """Rows: left-padded, several chunks long and right-padded, right-padded, one token, long and left-padded."""
    g = torch.Generator().manual_seed(seed)
    lengths_pads = [(5, "left"), (150, "right"), (70, "right"), (1, "left"), (66, "left")]
    s = 152
    ids = torch.zeros(len(lengths_pads), s, dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, (n, side) in enumerate(lengths_pads):
        cols = slice(s - n, s) if side == "left" else slice(0, n)
        mask[i, cols] = True
        ids[i, cols] = torch.randint(1, TINY["vocab_size"], (n,), generator=g)
    return ids, mask


LAYOUTS = [("thd", {}), ("thd", {"seq_align": 16}), ("bshd", {}), ("masked", {})]


def _forward(data_format, layout, **kwargs):
    if data_format == "masked":  # Megatron-Core's calling convention: the padding mask into the model
        return lambda model, ids, mask: model(ids, None, mask)
    return make_forward(data_format, **layout, **kwargs)


@pytest.fixture(scope="module", params=FAMILIES)
def family_models(request):
    """(family, packfwd's model, transformers' logits of each row's sequence run alone)."""
    hf = hf_model(request.param)
    ids, mask = ragged_batch()
    with torch.no_grad():
        alone = [hf(ids[i][mask[i]][None]).logits[0] for i in range(ids.shape[0])]
    return request.param, from_hf(hf), alone


@pytest.mark.parametrize("data_format, layout", LAYOUTS, ids=lambda x: str(x))
def test_logits_equal_transformers_per_sequence(family_models, data_format, layout):
    family, model, alone = family_models
    ids, mask = ragged_batch()
    with torch.no_grad():
        logits = _forward(data_format, layout)(model, ids, mask)
    for i, want in enumerate(alone):
        torch.testing.assert_close(logits[i][mask[i]], want, **ATOL[family], msg=f"{family} {data_format} {layout} "
                                                                                f"row {i}")
    assert not logits[~mask].any(), "padding positions must be zero"


def test_gradients_equal_transformers():
    """Qwen3.5's gradients of every weight (through the packed convolution, delta rule, gated norm, output gate and
    zero-centred norms; THD aligned) equal transformers' of the same loss summed over each sequence run alone (the
    MoE families' routers are tests/test_moe.py's)."""
    hf = hf_model("qwen3_5")
    model = from_hf(hf)
    ids, mask = ragged_batch()
    logits = make_forward("thd", seq_align=16)(model, ids, mask)
    (logits.logsumexp(-1) * mask).sum().backward()
    got = megatron_to_hf([{n: p.grad for n, p in model.named_parameters()}], args_from_hf_config(hf.config))
    for i in range(ids.shape[0]):
        hf(ids[i][mask[i]][None]).logits.logsumexp(-1).sum().backward()
    for name, p in hf.named_parameters():
        torch.testing.assert_close(got[name], p.grad, atol=1e-9 * float(p.grad.abs().max()), rtol=0, msg=name)


def test_the_layer_pattern_is_the_configs():
    hf = hf_model("qwen3_next", layer_types=["linear_attention", "full_attention"] * 2)
    model = from_hf(hf)
    kinds = [type(layer.self_attention).__name__ for layer in model.decoder.layers]
    assert kinds == ["PackedGatedDeltaNet", "GatedSelfAttention"] * 2
    ids, mask = ragged_batch()
    with torch.no_grad():
        assert_equals_hf_per_sequence(hf, make_forward("thd")(model, ids, mask), ids, mask, **ATOL["qwen3_next"])


def test_two_pipeline_stages():
    """Qwen3-Next over PP=2 in one process (stage 0: layers 0-1, linear attention, a dense MLP; stage 1: layers 2-3,
    its full attention last): the stages' logits equal the whole model's, THD and BSHD."""
    hf = hf_model("qwen3_next")
    whole = from_hf(hf)
    stages = [from_hf(hf, pp_rank=r, pp_size=2) for r in range(2)]
    kinds = [type(layer.self_attention).__name__ for s in stages for layer in s.decoder.layers]
    assert kinds == ["PackedGatedDeltaNet"] * 3 + ["GatedSelfAttention"]
    ids, mask = ragged_batch()
    for data_format in ("thd", "bshd"):
        forward = make_forward(data_format)
        with torch.no_grad():
            stages[1].set_input_tensor(forward(stages[0], ids, mask))
            torch.testing.assert_close(forward(stages[1], ids, mask), forward(whole, ids, mask), atol=1e-10, rtol=0)


def test_unmodified_transformers_in_float32():
    """transformers as shipped (float32 upcasts), the models in float32: equal to float32's rounding."""
    hf = hf_model("qwen3_5", lifted=False).float()
    model = from_hf(hf)
    ids, mask = ragged_batch()
    with torch.no_grad():
        assert_equals_hf_per_sequence(hf, make_forward("thd")(model, ids, mask), ids, mask, atol=2e-4, rtol=1e-4)


def test_a_neighbour_changes_nothing_but_a_leak_would():
    """Negative control: the same rows with other neighbours give the same bits; a model whose convolution runs
    across sequence starts (cu_seqlens of one sequence) gives other logits at the second sequence."""
    model = from_hf(hf_model("qwen3_5"))
    ids, mask = ragged_batch()
    forward = make_forward("thd")
    with torch.no_grad():
        alone = forward(model, ids[1:3], mask[1:3])
        packed = forward(model, ids, mask)[1:3]
        assert torch.equal(alone, packed)
        one = ids[2][mask[2]][None]
        both = torch.cat([ids[1][mask[1]], ids[2][mask[2]]])[None]
        joined = model(both, None, None)[0, mask[1].sum():]  # one 220-token sequence: the state runs on
        assert (joined - model(one, None, None)[0]).abs().amax() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_convert_back_bit_for_bit(family):
    from packfwd.models.runtime.gpt import model_args

    hf = hf_model(family)
    sd = hf.state_dict()
    model = from_hf(hf)
    back = to_hf_state_dict(model)
    assert sorted(back) == sorted(sd) and all(torch.equal(back[n], t) for n, t in sd.items())
    args = args_from_hf_config(hf.config)
    assert model_args(model) == args  # the layer pattern, gate and norms read back from the model
    shards = [hf_to_megatron(sd, args, tp_size=2, tp_rank=r) for r in range(2)]
    merged = megatron_to_hf(shards, args)
    assert sorted(merged) == sorted(sd) and all(torch.equal(merged[n], t) for n, t in sd.items())


def _hf_aux_loss(hf, family, ids, mask):
    lb = importlib.import_module(MODULES[family][0]).load_balancing_loss_func
    out = hf(ids, attention_mask=mask.long(), output_router_logits=True)
    return lb(out.router_logits, hf.config.num_experts, hf.config.num_experts_per_tok, mask.long())


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_aux_loss_is_transformers_over_real_tokens(family):
    """transformers' load-balancing loss of the batch (its attention mask drops the pads' router logits), on
    right-padded rows (which transformers' own padded forward computes as if alone)."""
    hf = hf_model(family)
    model = from_hf(hf)
    ids, mask = ragged_batch()
    rows = [1, 2]  # right-padded rows
    with torch.no_grad():
        want = _hf_aux_loss(hf, family, ids[rows], mask[rows]).double()
        for data_format, layout in LAYOUTS[:3]:
            forward = _forward(data_format, layout, moe_aux_loss=True)
            got = forward(model, ids[rows], mask[rows])["moe_aux_loss"]
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
            padded = torch.nn.functional.pad(ids[rows], (3, 5)), torch.nn.functional.pad(mask[rows], (3, 5))
            torch.testing.assert_close(forward(model, *padded)["moe_aux_loss"], got, atol=1e-12, rtol=1e-12)


def test_what_is_refused_names_the_fix():
    from packfwd.models import ModelArgs
    from packfwd.models.mixers import DeltaNet

    args = args_from_hf_config(hf_model("qwen3_5").config)
    base = dict(vocab_size=64, hidden_size=32, ffn_hidden_size=48, num_layers=4, num_attention_heads=4)
    with pytest.raises(ValueError, match="linear_attention given for family='llama'.*'qwen3_5'"):
        ModelArgs(**base, linear_attention=args.linear_attention)
    with pytest.raises(ValueError, match="family='qwen3_5' has gated softmax attention: pass attention_output_gate"):
        ModelArgs(**base, family="qwen3_5")
    with pytest.raises(ValueError, match=r"DeltaNet.layers \[4\] lie outside num_layers=4"):
        ModelArgs(**base, family="qwen3_5", attention_output_gate=True, linear_attention=DeltaNet(2, 4, 8, 8, layers=(4,)))
    with pytest.raises(ValueError, match="num_v_heads=3 must be a multiple of num_k_heads=2"):
        DeltaNet(2, 3, 8, 8)
    one_key_head = dataclasses.replace(args, linear_attention=DeltaNet(1, 2, 8, 8, layers=(0, 1, 2)))
    with pytest.raises(ValueError, match="linear_num_key_heads=1 is not divisible by tp_size=2"):
        hf_to_megatron({}, one_key_head, tp_size=2, tp_rank=0)


@pytest.mark.parametrize("data_format", ["thd", "thd_aligned", "bshd"])
def test_mtp_layer_matches_the_per_sequence_reference(data_format):
    """Qwen3.5's MTP layer (a gated full-attention layer after its zero-centred enorm / hnorm / eh_proj, the
    model's own MTP block) over a hybrid decoder, against tests/mtp_support.py's per-sequence reference (the decoder
    run on each sequence alone, BSHD), logits, MTP log-probs and loss, and gradients.  Random weights (the
    checkpoint's ``mtp.*`` tensors through ``from_hf(hf, mtp_state_dict=)``: tests/test_qwen3_5_mtp_weights.py)."""
    from . import mtp_support as ms

    base = args_from_hf_config(hf_model("qwen3_5").config)
    args = dataclasses.replace(base, mtp_num_layers=1, vocab_size=ms.ARGS.vocab_size)
    model = ms.build(args)
    assert type(model.mtp.layers[0].enorm).__name__ == "ZeroCenteredRMSNorm"
    ids, mask, loss_mask, weights = ms.batch()
    want_logits, want_lp, want_loss = ms.reference(model, ids, mask, loss_mask)
    ms.test_loss({"logits": want_logits, "mtp_log_probs": want_lp[..., :1], "mtp_loss": want_loss},
                 weights[..., :1]).backward()
    want_grads = ms.grads(model)
    model.zero_grad(set_to_none=True)
    layout = {"seq_align": 4} if data_format == "thd_aligned" else {}
    out = make_forward(data_format[:4].rstrip("_"), mtp=True, **layout)(model, ids, mask, mtp_loss_mask=loss_mask)
    for name, want in (("mtp_log_probs", want_lp), ("mtp_loss", want_loss), ("logits", want_logits)):
        torch.testing.assert_close(out[name], want, **ms.TOL, msg=name)
    ms.test_loss(out, weights[..., :1]).backward()
    got = ms.grads(model)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got[name], grad, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.usefixtures("quiet_megatron")
def test_gated_deltanet_layer_compiles_fullgraph():
    """A Gated DeltaNet decoder layer under ``torch.compile(fullgraph=True, dynamic=True)`` (THD, max_seqlen
    given: no host sync), forward and input gradients equal to eager (tests/test_compile_layer.py's check)."""
    from .test_compile_layer import SMALL, compiled_matches_eager

    args = dataclasses.replace(args_from_hf_config(hf_model("qwen3_5").config), fused=False)
    assert args.hidden_size == SMALL.hidden_size
    torch.manual_seed(0)
    layer = build_model(args).decoder.layers[0]
    assert type(layer.self_attention).__name__ == "PackedGatedDeltaNet"
    compiled_matches_eager(layer)


def cp_builds_at_2_and_refuses_4(layer_class, args, keyword: str, match: str):
    """A linear-attention layer of ``args`` with 2 heads to split builds at cp=2 and raises ``match`` at cp=4."""
    from packfwd.models.runtime import ensure_model_parallel
    from packfwd.models.runtime.config import transformer_config

    ensure_model_parallel()
    layer_class(transformer_config(args, cp_size=2, init=False), layer_number=1, **{keyword: args.linear_attention})
    with pytest.raises(ValueError, match=match):
        layer_class(transformer_config(args, cp_size=4, init=False), layer_number=1,
                    **{keyword: args.linear_attention})


def test_context_parallelism_refuses_heads_that_do_not_divide():
    """CP cuts each TP rank's key heads over the CP ranks: 2 key heads split over cp=2 (built), not over cp=4."""
    from packfwd.models.mixers.gdn import PackedGatedDeltaNet

    args = args_from_hf_config(hf_model("qwen3_5").config)
    assert args.linear_attention.num_k_heads == 2
    cp_builds_at_2_and_refuses_4(PackedGatedDeltaNet, args, "deltanet",
                                 r"context parallelism \(cp_size=4\) with Gated DeltaNet .* "
                                 r"linear_num_key_heads=2 must be divisible by tp_size \* cp_size = 4")


# ------------------------------------------------------------------------------------------------- two ranks


CP_LAYOUTS = {"cp2_thd": {}, "cp2_thd_aligned": {"seq_align": 16}}


def _loss(logits, mask):
    return (logits.logsumexp(-1) * mask).sum()


def _ranks_worker(rank: int, world: int):
    """TP=2 + SP (Qwen3.5, THD and BSHD), CP=2 (Qwen3.5, THD and THD aligned: logits and gradients of
    :func:`_loss`), then EP=2 (Qwen3.5-MoE, THD): {case: this rank's logits (and gradients)}.  The models are made
    here, the same seeds (the lifted modeling modules cannot be pickled to the children)."""
    dense, moe = hf_model("qwen3_5"), hf_model("qwen3_5_moe")
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime import ensure_model_parallel
    from packfwd.models.runtime.cpu import host_collectives

    ids, mask = ragged_batch()
    out = {}
    ensure_model_parallel(cp_size=2)
    for case, layout in CP_LAYOUTS.items():
        model = from_hf(dense)
        logits = make_forward("thd", **layout, cp_size=2, cp_rank=ps.get_context_parallel_rank(),
                              cp_group=ps.get_context_parallel_group())(model, ids, mask)
        with host_collectives():
            _loss(logits, mask).backward()
        out[case] = dict(logits=logits.detach(), grads={n: p.grad for n, p in model.named_parameters()})
    ps.destroy_model_parallel()
    ensure_model_parallel(tp_size=2)
    model = from_hf(dense, tp_size=2, tp_rank=rank, sequence_parallel=True)
    with torch.no_grad():
        for data_format in ("thd", "bshd"):
            out[f"tp2_sp_{data_format}"] = make_forward(data_format, tp_size=2)(model, ids, mask)
    ps.destroy_model_parallel()
    ensure_model_parallel(ep_size=2)
    model = from_hf(moe, ep_size=2, ep_rank=rank)
    rows = slice(0, 3) if rank == 0 else slice(3, 5)  # each expert-parallel rank its own batch
    with torch.no_grad():
        out["ep2"] = make_forward("thd")(model, ids[rows], mask[rows])
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    from packfwd.testing import run_local

    dense, moe = hf_model("qwen3_5"), hf_model("qwen3_5_moe")
    return dense, moe, run_local(_ranks_worker, 2, backend="gloo", timeout=300)


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_tp2_with_sequence_parallelism(two_ranks, data_format):
    dense, _, ranks = two_ranks
    ids, mask = ragged_batch()
    logits = torch.cat([r[f"tp2_sp_{data_format}"] for r in ranks], -1)  # each rank its vocabulary half
    assert_equals_hf_per_sequence(dense, logits, ids, mask, atol=1e-10)


@pytest.mark.parametrize("case", sorted(CP_LAYOUTS))
def test_cp2_logits_and_gradients_equal_one_process(two_ranks, case):
    """Under CP=2 each Gated DeltaNet layer trades its zigzag tokens for whole sequences of half its heads and
    back: every rank's gathered logits equal transformers' per sequence, and the ranks' gradients summed (each
    rank's part: its tokens, its heads) equal one process's, to 1e-10 in float64 (sequences of 1 to 150 tokens,
    several 64-token chunks of the delta rule, odd lengths)."""
    dense, _, ranks = two_ranks
    ids, mask = ragged_batch()
    for r in ranks:
        assert_equals_hf_per_sequence(dense, r[case]["logits"], ids, mask, atol=1e-10)
    model = from_hf(dense)
    _loss(make_forward("thd", **CP_LAYOUTS[case])(model, ids, mask), mask).backward()
    for name, p in model.named_parameters():
        got = [r[case]["grads"][name] for r in ranks]
        assert not torch.equal(got[0], p.grad), f"{name}: one rank's part alone is the whole gradient"
        torch.testing.assert_close(got[0] + got[1], p.grad, atol=1e-10 * float(p.grad.abs().max()), rtol=0,
                                   msg=f"{case} {name}")


FOUR_HEADS = dict(linear_num_key_heads=4, linear_num_value_heads=8)  # one key head per TP x CP rank


def _vocab_loss(logits, mask, vocab_slice=slice(None)):
    """Linear in the logits (a vocabulary-parallel rank's share adds up): fixed random weights per logit."""
    weights = torch.randn(*mask.shape, TINY["vocab_size"], generator=torch.Generator().manual_seed(3),
                          dtype=torch.float64)
    return (logits * weights[..., vocab_slice] * mask[..., None]).sum()


def _tp_cp_worker(rank: int, world: int):
    """TP=2 + SP with CP=2 (Qwen3.5 with :data:`FOUR_HEADS`, THD): (TP rank, its vocabulary half of the logits,
    its gradients of :func:`_vocab_loss` over that half)."""
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime import ensure_model_parallel
    from packfwd.models.runtime.cpu import host_collectives

    ids, mask = ragged_batch()
    ensure_model_parallel(tp_size=2, cp_size=2)
    tp, half = ps.get_tensor_model_parallel_rank(), TINY["vocab_size"] // 2
    model = from_hf(hf_model("qwen3_5", **FOUR_HEADS), tp_size=2, tp_rank=tp, sequence_parallel=True)
    logits = make_forward("thd", tp_size=2, cp_size=2, cp_rank=ps.get_context_parallel_rank(),
                          cp_group=ps.get_context_parallel_group())(model, ids, mask)
    with host_collectives():
        _vocab_loss(logits, mask, slice(tp * half, (tp + 1) * half)).backward()
    ps.destroy_model_parallel()
    return tp, logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_tp2_sp_with_cp2_equals_transformers_and_one_process():
    """Four ranks: each TP rank's heads cut again over CP.  Logits (the TP ranks' vocabulary halves) equal
    transformers' per sequence on both CP ranks; the gradients summed over CP (and over TP for what TP
    replicates), merged from the TP shards, equal one process's, to 1e-10."""
    from packfwd.testing import run_local

    hf = hf_model("qwen3_5", **FOUR_HEADS)
    ids, mask = ragged_batch()
    by_tp = {0: [], 1: []}
    for tp, logits, grads in run_local(_tp_cp_worker, 4, backend="gloo", timeout=300):
        by_tp[tp].append((logits, grads))
    for (lo, _), (hi, _) in zip(by_tp[0], by_tp[1]):  # the two CP ranks
        assert_equals_hf_per_sequence(hf, torch.cat([lo, hi], -1), ids, mask, atol=1e-10)
    model = from_hf(hf)
    _vocab_loss(make_forward("thd")(model, ids, mask), mask).backward()
    whole = {n: p.grad for n, p in model.named_parameters()}
    shards = [{n: a[n] + b[n] for n in a} for (_, a), (_, b) in (by_tp[0], by_tp[1])]
    for name, grad in whole.items():  # replicated over TP (the norms): each TP rank's tokens' or heads' part
        if shards[0][name].shape == grad.shape:
            shards[0][name] = shards[1][name] = shards[0][name] + shards[1][name]
    args = args_from_hf_config(hf.config)
    want, got = megatron_to_hf([whole], args), megatron_to_hf(shards, args)
    assert sorted(got) == sorted(want)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, atol=1e-10 * float(grad.abs().max()), rtol=0, msg=name)


def test_ep2(two_ranks):
    _, moe, ranks = two_ranks
    ids, mask = ragged_batch()
    for rank, rows in enumerate((slice(0, 3), slice(3, 5))):
        assert_equals_hf_per_sequence(moe, ranks[rank]["ep2"], ids[rows], mask[rows], **ATOL["qwen3_5_moe"])
