"""GPT-OSS (transformers' ``GptOssForCausalLM``) as a packfwd family: attention sinks, sliding windows, YaRN, and
an MoE with router and expert biases and the clamped SwiGLU.

Strategy: a tiny float64 GPT-OSS (hidden 32, 4 heads over 2 kv heads of 8, 3 layers: sliding window 4, full,
sliding window 4; 4 experts top-2 of width 16; YaRN of factor 4 over an original 8 positions; ``swiglu_limit``
1.0 so that the clamps bind at O(1) activations) with O(1)-scale random weights (sinks, router and expert biases
included), converted by ``from_hf``.  Logits of ``make_forward`` in THD, THD aligned to 8 and BSHD on a ragged batch
(rows of 10 tokens and 6: longer than the window; left and right padding; a length-1 row) equal transformers run
on each sequence alone (to 2e-5: transformers' RMSNorm computes in float32; to 1e-10 with its norm in the input's
dtype).  Negative controls: the same weights built without the windows, without the sinks or without YaRN give
other logits.  The weights convert back bit for bit, whole and from TP=2 shards; the MoE auxiliary loss equals
transformers' load-balancing loss over the real tokens and is unchanged by padding; gradients of the sinks and
the router biases equal transformers'.  Over gloo (one ``run_local``): TP=2 with sequence parallelism and EP=2
(the biased experts whole, ``expert_tp_size=1``; THD and BSHD), CP=2 (THD: exact, the window counted at each
token's zigzag position and the sink in each chunk's softmax) and EP=2 (each rank its own batch) equal
transformers per sequence; two pipeline stages give one stage's logits.  The reference backend's window and sinks
equal a plain loop over sequences, heads and queries (self-attention and bottom-right chunks, gradients too).
Refusals name the field and the fix.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss",
                              reason="this transformers has no GPT-OSS")

from transformers import GptOssConfig, GptOssForCausalLM  # noqa: E402

from packfwd.forward import make_forward  # noqa: E402
from packfwd.models import ModelArgs, from_hf, to_hf_state_dict  # noqa: E402
from packfwd.models.convert.hf import args_from_hf_config, load_weights  # noqa: E402
from packfwd.models.convert.hf_weights import hf_to_megatron  # noqa: E402
from packfwd.models.mixers import varlen  # noqa: E402
from packfwd.models.mixers.latent import yarn_inv_freq  # noqa: E402
from packfwd.models.runtime.gpt import build_model, model_args  # noqa: E402

from .oracles import assert_hf_round_trip, rmsnorm_in_input_dtype  # noqa: E402
from .test_glm4_moe import (LAYOUTS, V, assert_layout_equals_per_sequence, assert_two_stages_equal_one,  # noqa: E402
                            per_sequence, ragged_batch)
from .test_moe import more_padding, randomise  # noqa: E402

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=8)


def oss_config(**extra) -> GptOssConfig:
    """3 layers (sliding 4, full, sliding 4), 4 heads / 2 kv heads of 8, 4 experts top-2 of width 16."""
    fields = dict(hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, vocab_size=V, num_local_experts=4, num_experts_per_tok=2,
                  sliding_window=4, max_position_embeddings=32, rope_parameters=YARN, experts_implementation="eager")
    if hasattr(GptOssConfig(), "swiglu_limit"):  # releases without the field hard-code 7.0, and so does the reader
        fields["swiglu_limit"] = 1.0
    return GptOssConfig(**{**fields, **extra})


def oss_model(cfg: GptOssConfig | None = None, seed: int = 0) -> GptOssForCausalLM:
    return randomise(GptOssForCausalLM(cfg or oss_config()), seed)


@pytest.fixture
def hf_norm_in_input_dtype(monkeypatch):
    """transformers' RMSNorm computed in the input's dtype (it casts to float32 otherwise)."""
    monkeypatch.setattr(gpt_oss.GptOssRMSNorm, "forward", rmsnorm_in_input_dtype)


def test_the_config_is_read_as_gpt_oss_and_yarn_is_transformers():
    hf = oss_model()
    args = args_from_hf_config(hf.config)
    assert (args.family, args.linear_bias, args.attention_sinks, args.attention_windows) == (
        "gpt_oss", True, True, (4, None, 4))
    moe = args.moe
    assert (moe.activation, moe.activation_clamp, moe.glu_linear_offset, moe.normalize_top_k) == (
        "quick_gelu", hf.model.layers[0].mlp.experts.limit, 1.0, True)
    rotary = hf.model.rotary_emb
    assert torch.equal(yarn_inv_freq(args.rope_yarn, args.rope_theta, 8), rotary.inv_freq)  # bit for bit
    assert args.rope_yarn.cos_sin_factor() == rotary.attention_scaling != 1.0
    model = from_hf(hf)
    assert model_args(model) == args
    config = model.config
    assert (config.window_size, config.window_attn_skip_freq, config.softmax_type) == ((3, 0), [1, 0, 1], "learnable")
    windows = [layer.self_attention.core_attention.window for layer in model.decoder.layers]
    assert windows == [3, None, 3]  # transformers' sliding_window 4: the query and the 3 keys before it
    plain = args_from_hf_config(oss_config(layer_types=["full_attention"] * 3,
                                           rope_parameters=dict(rope_type="default", rope_theta=10000.0)))
    assert (plain.attention_windows, plain.rope_yarn) == (None, None)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_logits_equal_transformers_per_sequence(layout):
    hf = oss_model()
    assert_layout_equals_per_sequence(hf, from_hf(hf), layout)


PLAIN_ROPE = dict(rope_type="default", rope_theta=10000.0)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_to_1e10_and_the_window_and_sinks_are_seen(layout, hf_norm_in_input_dtype):
    """One expert per token (its weight 1: Megatron-Core's softmax over the chosen logits is float32, ~1e-7
    otherwise), plain RoPE (transformers rounds YaRN's scaled cos and sin to float32) and transformers' norms in
    float64: 1e-10; the same weights without the windows or without the sinks give other logits (the rows of 10
    and 6 tokens reach past the window of 4)."""
    hf = oss_model(oss_config(rope_parameters=PLAIN_ROPE, num_experts_per_tok=1))
    assert_without_changes_differ(hf, layout, 1e-10, dict(attention_windows=None), dict(attention_sinks=False))


def test_yarn_is_seen():
    """The YaRN model equals transformers per sequence (2e-5); the same weights with plain RoPE do not."""
    assert_without_changes_differ(oss_model(), "thd", 2e-5, dict(rope_yarn=None))


def assert_without_changes_differ(hf, layout: str, atol: float, *changes: dict) -> None:
    """``from_hf(hf)`` equals ``hf`` per sequence to ``atol``; the same weights built with each change of its
    ModelArgs give other logits."""
    model = from_hf(hf)
    args = model_args(model)
    forward = make_forward(**LAYOUTS[layout])
    ids, mask = ragged_batch()
    with torch.no_grad():
        logits = forward(model, ids, mask)
        for i, want in enumerate(per_sequence(hf, ids, mask)):
            torch.testing.assert_close(logits[i][mask[i]], want, atol=atol, rtol=0, msg=f"row {i}")
        for change in changes:
            other = dataclasses.replace(args, **change)
            wrong = load_weights(build_model(other, params_dtype=torch.float64, init=False),
                                 hf_to_megatron(hf.state_dict(), other))
            assert not torch.allclose(forward(wrong, ids, mask)[0][mask[0]], logits[0][mask[0]], atol=1e-3), change


def test_the_way_back_is_bitwise():
    assert_hf_round_trip(oss_model())


def test_aux_loss_is_transformers_over_real_tokens_and_gradients_are_transformers():
    """``moe_aux_loss`` equals transformers' load-balancing loss of the padded batch with its mask (real tokens),
    unchanged by more padding; the gradients of a loss of the logits reach the sinks, the router biases and the
    expert biases as transformers' (each sequence alone)."""
    hf = oss_model()
    model = from_hf(hf)
    ids, mask = ragged_batch()
    out = hf(ids, attention_mask=mask.long(), output_router_logits=True)
    want = gpt_oss.load_balancing_loss_func(out.router_logits, 4, 2, mask.long()).double()
    forward = make_forward("thd", moe_aux_loss=True)
    got = forward(model, ids, mask)
    torch.testing.assert_close(got["moe_aux_loss"], want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(forward(model, *more_padding(ids, mask))["moe_aux_loss"], got["moe_aux_loss"],
                               atol=1e-12, rtol=1e-12)
    (got["logits"][mask].sin().sum()).backward()
    sum(hf(ids[i][mask[i]][None]).logits[0].sin().sum() for i in range(len(ids))).backward()
    for i in range(3):
        ours, theirs = model.decoder.layers[i], hf.model.layers[i]
        pairs = [(ours.self_attention.core_attention.softmax_offset.grad, theirs.self_attn.sinks.grad),
                 (ours.mlp.router.bias.grad, theirs.mlp.router.bias.grad),
                 (ours.mlp.experts.local_experts[1].linear_fc2.bias.grad, theirs.mlp.experts.down_proj_bias.grad[1])]
        for mine, ref in pairs:
            torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-4, msg=f"layer {i}")
        assert theirs.self_attn.sinks.grad.abs().max() > 1e-3


def test_pp2_equals_one_stage():
    """Stage 0: layers 0 (window) and 1 (full); stage 1: layers 2 (window) and 3 (full) and the head."""
    assert_two_stages_equal_one(oss_model(oss_config(num_hidden_layers=4)))


# ------------------------------------------------------------------------------------------- model parallelism


def _parallel_worker(rank: int, world: int, hf, batches):
    """TP=2 + SP with EP=2 (whole experts), THD and BSHD; CP=2 (THD); EP=2 alone on this rank's own batch."""
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime import ensure_model_parallel

    ids, mask = ragged_batch()
    out = {}
    ensure_model_parallel(tp_size=2, ep_size=2, etp_size=1)
    model = from_hf(hf, tp_size=2, tp_rank=rank, ep_size=2, ep_rank=rank, expert_tp_size=1, sequence_parallel=True)
    out["experts"] = len(model.decoder.layers[0].mlp.experts.local_experts)
    with torch.no_grad():
        for data_format in ("thd", "bshd"):
            out[f"tp2_sp_ep2_{data_format}"] = make_forward(data_format, tp_size=2)(model, ids, mask)
    out["tp2_state"] = to_hf_state_dict(model)
    ps.destroy_model_parallel()
    ensure_model_parallel(cp_size=2)
    forward = make_forward("thd", cp_size=2, cp_rank=ps.get_context_parallel_rank(),
                           cp_group=ps.get_context_parallel_group())
    with torch.no_grad():
        out["cp2"] = forward(from_hf(hf), ids, mask)
    ps.destroy_model_parallel()
    ensure_model_parallel(ep_size=2)
    model = from_hf(hf, ep_size=2, ep_rank=rank)
    with torch.no_grad():
        out["ep2"] = make_forward("thd")(model, *batches[rank])
    ps.destroy_model_parallel()
    return out


def test_tp2_sp_ep2_cp2_and_ep2_equal_transformers_per_sequence():
    from packfwd.testing import run_local

    hf = oss_model()
    small = torch.zeros(3, 6, dtype=torch.bool)  # rank 1's own batch: lengths 6, 2 (left-padded), 4 (right-padded)
    small[0], small[1, 4:], small[2, :4] = True, True, True
    small_ids = torch.randint(1, V, (3, 6), generator=torch.Generator().manual_seed(1)).masked_fill(~small, 0)
    batches = [ragged_batch(), (small_ids, small)]
    ranks = run_local(_parallel_worker, 2, hf, batches, backend="gloo", timeout=300)
    ids, mask = ragged_batch()
    want = per_sequence(hf, ids, mask)
    cases = {"cp2": [r["cp2"] for r in ranks]}
    cases.update({f"tp2_sp_ep2_{f}": [torch.cat([r[f"tp2_sp_ep2_{f}"] for r in ranks], -1)] for f in ("thd", "bshd")})
    for case, outputs in cases.items():
        for logits in outputs:
            for i, ref in enumerate(want):
                torch.testing.assert_close(logits[i][mask[i]], ref, atol=2e-5, rtol=1e-5, msg=f"{case} row {i}")
    assert [r["experts"] for r in ranks] == [2, 2]
    sd = hf.state_dict()
    for r in ranks:
        assert sorted(r["tp2_state"]) == sorted(sd) and all(torch.equal(r["tp2_state"][n], t) for n, t in sd.items())
    for r, (b_ids, b_mask) in zip(ranks, batches):
        for i, ref in enumerate(per_sequence(hf, b_ids, b_mask)):
            torch.testing.assert_close(r["ep2"][i][b_mask[i]], ref, atol=2e-5, rtol=1e-5, msg=f"ep2 row {i}")


# ------------------------------------------------------------------------------- the reference's window and sinks


def _loop_attention(q, k, v, cu_q, cu_k, window, sinks, scale):
    """Each sequence, head and query alone: softmax over its keys in reach (bottom-right causal, the window) and
    the sink's logit, the sink's weight dropped."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
    group = q.shape[1] // k.shape[1]
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        for i in range(q1 - q0):
            last = i + (k1 - k0) - (q1 - q0)  # the query's own position among the keys
            first = 0 if window is None else last - window
            keys = [j for j in range(k1 - k0) if first <= j <= last]
            for h in range(q.shape[1]):
                logits = [q[q0 + i, h] @ k[k0 + j, h // group] * scale for j in keys]
                if sinks is not None:
                    logits.append(sinks[h])
                if not logits:
                    continue
                weights = torch.softmax(torch.stack(logits), 0)
                out[q0 + i, h] = sum((w * v[k0 + j, h // group] for w, j in zip(weights, keys)),
                                     torch.zeros(v.shape[2], dtype=q.dtype))
    return out


@pytest.mark.parametrize("window", [None, 0, 2, 6])
@pytest.mark.parametrize("with_sinks", [True, False], ids=["sinks", "no_sinks"])
@pytest.mark.parametrize("chunks", [False, True], ids=["self", "bottom_right"])
def test_reference_window_and_sinks_equal_a_loop(window, with_sinks, chunks):
    """Ragged sequences (7, 1, 4, 9 tokens), 4 query heads over 2 kv heads; ``chunks``: the queries are the last
    tokens of longer key sequences (context parallelism's calls), one with no query; gradients of q, k, v, sinks."""
    if window is None and not with_sinks:
        pytest.skip("plain attention: tested in test_attention.py")
    g = torch.Generator().manual_seed(0)
    # "blocks": 128 queries and 256 keys, whole blocks (the backend pads other counts to them: this runs unpadded)
    lens_k = torch.tensor([100, 1, 40, 115]) if chunks == "blocks" else torch.tensor([7, 1, 4, 9])
    lens_q = {False: lens_k, True: torch.tensor([3, 1, 0, 5]), "blocks": torch.tensor([60, 1, 0, 67])}[chunks]
    cu_q, cu_k = (torch.cat([torch.zeros(1, dtype=torch.long), x.cumsum(0)]).int() for x in (lens_q, lens_k))
    q = torch.randn(int(lens_q.sum()), 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(int(lens_k.sum()), 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    sinks = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True) if with_sinks else None
    got = varlen.varlen_attention(q, k, v, cu_q, cu_k, int(lens_q.max()), 9, window=window, sinks=sinks)
    want = _loop_attention(q, k, v, cu_q, cu_k, window, sinks, 8**-0.5)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    leaves = [x for x in (q, k, v, sinks) if x is not None]
    grad_out = torch.randn(got.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, leaves, grad_out), torch.autograd.grad(want, leaves, grad_out)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    if window is not None:  # the window bites: without it the long rows differ
        assert not torch.allclose(varlen.varlen_attention(q, k, v, cu_q, cu_k, 9, 9, sinks=sinks)[-1], got[-1])


@pytest.mark.parametrize("window", [None, 0, 2])
@pytest.mark.parametrize("chunks", [False, True, "blocks"], ids=["self", "bottom_right", "whole_128_blocks"])
def test_flex_backend_forward_equals_the_reference(window, chunks):
    """The ``flex`` backend's block mask and sink rescaling (eager ``flex_attention`` on the CPU, forward only:
    torch has no CPU backward for it; the compiled CUDA kernel and its gradients: tests/gpu/test_gpt_oss_cuda.py)."""
    from packfwd.models.mixers.varlen_flex import flex_available, flex_varlen_attention

    if not flex_available():
        pytest.skip("this torch has no flex_attention with a log-sum-exp request")
    g = torch.Generator().manual_seed(0)
    # "blocks": 128 queries and 256 keys, whole blocks (the backend pads other counts to them: this runs unpadded)
    lens_k = torch.tensor([100, 1, 40, 115]) if chunks == "blocks" else torch.tensor([7, 1, 4, 9])
    lens_q = {False: lens_k, True: torch.tensor([3, 1, 0, 5]), "blocks": torch.tensor([60, 1, 0, 67])}[chunks]
    cu_q, cu_k = (torch.cat([torch.zeros(1, dtype=torch.long), x.cumsum(0)]).int() for x in (lens_q, lens_k))
    q = torch.randn(int(lens_q.sum()), 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(int(lens_k.sum()), 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    for sinks in (None, torch.randn(4, generator=g, dtype=torch.float64)):
        want = varlen.varlen_attention_reference(q, k, v, cu_q, cu_k, int(lens_q.max()), int(lens_k.max()),
                                                 window=window, sinks=sinks)
        got = flex_varlen_attention(q, k, v, cu_q, cu_k, window=window, sinks=sinks)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------- the experts, grouped or not


def _oss_experts(dtype, grouped):
    """GPT-OSS-style experts (biases, quick_gelu, clamp 1.0, offset 1.0) built as the model builds them, and
    Megatron-Core's ``SequentialMLP`` with the same weights (biases O(1): Megatron initialises them to zero)."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    from .test_moe_grouped import experts_pair

    mine, theirs = experts_pair(dtype, grouped=grouped, add_bias_linear=True, activation_func=quick_gelu,
                                glu_linear_offset=1.0, activation_func_clamp_value=1.0)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for e in mine.local_experts:
            for linear in (e.linear_fc1, e.linear_fc2):
                linear.bias.copy_(torch.randn(linear.bias.shape, generator=g, dtype=dtype))
    theirs.load_state_dict(mine.state_dict())
    return mine, theirs


def test_biased_clamped_experts_sequential_is_megatrons_and_grouped_equals_it():
    """The out-of-place loop equals Megatron-Core's ``SequentialMLP`` bit for bit (float64, forward: its backward
    fails on the in-place bias add); the grouped path (``grouped_glu_mlp``, float32: torch's ``_grouped_mm``)
    equals the loop, outputs and every gradient (the biases' too), also with sink rows past the groups holding NaN
    (the sync-free dispatcher's layout), which reach no gradient."""
    from .test_moe_grouped import dispatched

    counts = torch.tensor([3, 0, 5, 1])
    mine, theirs = _oss_experts(torch.float64, None)
    x, probs, _ = dispatched(counts.tolist(), torch.float64)
    with torch.no_grad():
        assert torch.equal(mine(x, counts, probs)[0], theirs(x, counts, probs)[0])
    loop, _ = _oss_experts(torch.float32, False)
    grouped, _ = _oss_experts(torch.float32, True)
    x, probs, grad = dispatched(counts.tolist(), torch.float32)
    sinks = torch.full((3, x.shape[1]), float("nan"))
    results = []
    for module, rows in ((loop, x), (grouped, x), (grouped, torch.cat([x, sinks]))):
        module.zero_grad()
        inp = rows.clone().requires_grad_()
        scale = torch.cat([probs, torch.full((rows.shape[0] - x.shape[0],), float("nan"))])
        out = module(inp, counts, scale)[0]
        out[: x.shape[0]].backward(grad)
        results.append((out[: x.shape[0]].detach(), inp.grad[: x.shape[0]],
                        {n: p.grad.clone() for n, p in module.named_parameters()}))
    for out, dx, grads in results[1:]:
        torch.testing.assert_close(out, results[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dx, results[0][1], atol=1e-5, rtol=1e-5)
        for name, want in results[0][2].items():
            torch.testing.assert_close(grads[name], want, atol=1e-5, rtol=1e-5, msg=name)


def test_a_float32_model_on_grouped_experts_equals_the_loop():
    """The whole model (float32, 8 experts top-2 of width 16) with its experts grouped (the dispatcher's sync-free
    layout, sink rows included) gives the sequential loop's logits and gradients within float32 rounding."""
    from packfwd.models.mlp.experts import set_grouped_experts

    hf = oss_model(oss_config(num_local_experts=8)).float()
    ids, mask = ragged_batch()
    results = []
    for grouped in (False, True):
        model = from_hf(hf)
        assert set_grouped_experts(model, grouped) == 3
        logits = make_forward("thd")(model, ids, mask)
        logits[mask].sin().sum().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-4, rtol=1e-4)
    assert sorted(results[1][1]) == sorted(results[0][1])
    for name, want in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], want, atol=1e-4, rtol=1e-4, msg=name)


# ------------------------------------------------------------------------------------------------- refusals


def test_refusals_name_the_field_and_the_fix():
    q = torch.randn(5, 4, 8)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    for backend in ("torch_varlen", "flash_attn", "cudnn"):
        with pytest.raises(ValueError, match=f"backend='{backend}' cannot compute attention with window"):
            varlen._resolve_features(backend, torch.device("cuda"), torch.bfloat16, ("window", "sinks"))
    # flex honours windows and sinks: named where it cannot run, the error says that, not that it drops them
    with pytest.raises(ValueError, match="backend='flex' is not usable for tensors on cpu here.*move the inputs"):
        varlen._resolve_features("flex", torch.device("cpu"), torch.float64, ("window", "sinks"))
    with pytest.raises(ValueError, match="window= with causal=False"):
        varlen.varlen_attention(q, q, q, cu, cu, 5, 5, False, window=2)
    with pytest.raises(ValueError, match="sinks must be a float tensor \\[h\\]"):
        varlen.varlen_attention(q, q, q, cu, cu, 5, 5, sinks=torch.zeros(3))
    for extra, match in ((dict(attention_bias=False), "attention_bias=False.*attention_bias=True"),
                         (dict(swiglu_alpha=1.5), "swiglu_alpha=1.5.*use swiglu_alpha=1.702"),
                         (dict(layer_types=["chunked_attention"] * 3), "layer_types="),
                         # sliding layers without a window were built as full attention
                         (dict(sliding_window=None), "sliding_window=None.*sliding_attention"),
                         (dict(sliding_window=0), "sliding_window=0.*sliding_attention")):
        with pytest.raises(ValueError, match=match):
            args_from_hf_config(oss_config(**extra))
    args = args_from_hf_config(oss_config())
    for change, match in ((dict(attention_windows=(4, None)), "one entry per layer"),
                          (dict(attention_windows=(4, None, 8)), "one window_size"),
                          (dict(rope_scaling_factor=8.0), "one RoPE scaling at a time")):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(args, **change)
    with pytest.raises(ValueError, match="one activation"):
        dataclasses.replace(args.moe, dense_layers=(0,))
    from packfwd.forward.deterministic import check_attention
    from packfwd.models.mlp.moe_weights import interleaved_experts_from_hf

    with pytest.raises(ValueError, match="batch_invariant=True is not promised for attention with a sliding window"):
        check_attention(from_hf(oss_model()))

    with pytest.raises(ValueError, match="MXFP4 blocks and scales; load the checkpoint dequantized"):
        interleaved_experts_from_hf({"m.experts.gate_up_proj_blocks": torch.zeros(1)}, "m.", "g.", range(1))
    with pytest.raises(ValueError, match="pass expert_tp_size=1 with ep_size > 1"):
        from packfwd.models.runtime.gpt import _check_expert_parallel

        _check_expert_parallel(args, 1, 2, 1, sequence_parallel=True, etp=2)
    assert ModelArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)}) == args


def test_the_automatic_choice_for_windows_and_sinks(monkeypatch):
    """On CUDA in fp16/bf16 the automatic backend of a window or sinks is flex (its GPU tests passed on an H100), not
    under batch invariance;
    float32, or a torch without flex, take the exact reference with a one-time warning; the CPU the reference, mute."""
    features = ("window", "sinks")
    cuda = torch.device("cuda")
    monkeypatch.setattr(varlen, "available_backends",
                        lambda device="cpu": ("torch_varlen", "flex", "reference") if torch.device(device).type == "cuda"
                        else ("reference",))
    monkeypatch.setattr(varlen, "_WARNED_FEATURES", set())
    for dtype in (torch.bfloat16, torch.float16):
        assert varlen._resolve_features(None, cuda, dtype, features) == "flex"
        assert varlen._resolve_features(None, cuda, dtype, ("window",)) == "flex"
    with pytest.warns(UserWarning, match="'reference' backend"):
        assert varlen._resolve_features(None, cuda, torch.float32, features) == "reference"
    monkeypatch.setattr(varlen, "_batch_invariance_asked", lambda dtype: True)  # batch_invariant=True: not flex
    assert varlen._resolve_features(None, cuda, torch.bfloat16, features) == "reference"
    assert varlen._resolve_features("flex", cuda, torch.bfloat16, features) == "flex"  # named: taken
    monkeypatch.setattr(varlen, "_batch_invariance_asked", lambda dtype: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert varlen._resolve_features(None, torch.device("cpu"), torch.bfloat16, features) == "reference"
    monkeypatch.setattr(varlen, "available_backends",
                        lambda device="cpu": ("torch_varlen", "reference") if torch.device(device).type == "cuda"
                        else ("reference",))
    monkeypatch.setattr(varlen, "_WARNED_FEATURES", set())
    with pytest.warns(UserWarning, match="'reference' backend"):
        assert varlen._resolve_features(None, cuda, torch.bfloat16, features) == "reference"
