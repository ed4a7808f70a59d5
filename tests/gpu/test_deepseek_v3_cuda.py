"""DeepSeek-V3 (multi-head latent attention) on the GPU: the flash kernels' path for a value head dim other than
the query/key one (q, k, v zero-padded to one head dim, the output cut back: ``packfwd/models/varlen.py``).

The CPU tests check the model against transformers per sequence in float64, with the reference attention only.
Here, on CUDA: torch's varlen flash kernel runs the padded head dims; in bf16 packfwd's packed log-probs are no
further from the float32 transformers model than transformers' own bf16 padded log-probs, the backward runs
through the padding (every parameter's gradient as close to the float32 model's as through the reference
attention), and the float32 model equals transformers within TF32-free float32 rounding.  CUDA only (skipped elsewhere).

    PYTHONPATH=. python3 -m pytest -q tests/gpu/test_deepseek_v3_cuda.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256, mscale=1.0,
            mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0)


def ds_config(**extra):
    """q/k head dim 32 + 16 = 48 against v's 32: the flash kernel gets all three padded to 48."""
    from transformers import DeepseekV3Config

    fields = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=512, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                  topk_group=1, n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3,
                  routed_scaling_factor=2.5, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                  qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=2048, rope_parameters=YARN,
                  rope_interleave=True, attn_implementation="sdpa", experts_implementation="eager")
    return DeepseekV3Config(**{**fields, **extra})


def rl_batch(vocab: int, seed: int = 0):
    """Left-padded prompts, right-padded responses, a one-token response; [4, 768]."""
    from .test_vs_transformers_cuda import rl_batch as padded_batch

    ids, mask = padded_batch(vocab, seed, prompt_cols=256, s=768, prompts=(200, 256, 17, 64),
                             responses=(300, 512, 1, 450))
    return ids.masked_fill(~mask, 0).cuda(), mask.cuda()


def packed_log_probs(model, ids, mask):
    import packfwd as pf
    from packfwd.logits import log_probs, vocab_parallel

    @vocab_parallel
    def processor(logits, labels, tp_group=None):
        return {"lp": log_probs(logits, labels, tp_group=tp_group)}

    return pf.make_forward("thd", logits_processor=processor)(model, ids, mask, labels=pf.next_token_labels(ids, mask))["lp"]


def padded_log_probs(hf, ids, mask):
    from packfwd.logits import log_probs
    import packfwd as pf

    labels = pf.next_token_labels(ids, mask)
    positions = (mask.long().cumsum(1) - 1).clamp_min(0)
    logits = hf(input_ids=ids, attention_mask=mask.long(), position_ids=positions).logits
    return log_probs(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).clamp_min(0)).view(ids.shape)


@pytest.fixture(scope="module")
def models():
    from transformers import DeepseekV3ForCausalLM

    from packfwd.models import from_hf

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    hf32 = DeepseekV3ForCausalLM(ds_config()).cuda().eval()
    with torch.no_grad():  # O(1)-scale routing: the expert correction bias matters
        for layer in hf32.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    hf16 = DeepseekV3ForCausalLM(ds_config()).cuda().eval()
    hf16.load_state_dict(hf32.state_dict())
    return dict(hf32=hf32, hf16=hf16.to(torch.bfloat16),
                pf32=from_hf(hf32, device="cuda", params_dtype=torch.float32),
                pf16=from_hf(hf32, device="cuda", params_dtype=torch.bfloat16),
                pf16_ref=from_hf(hf32, device="cuda", params_dtype=torch.bfloat16, attention_backend="reference"))


def test_the_bf16_model_runs_a_flash_kernel_on_padded_head_dims(models, monkeypatch):
    from packfwd.models.mixers import varlen

    backends = varlen.available_backends("cuda")
    assert backends[0] != "reference", backends
    seen = []
    real = varlen.varlen_attention_reference

    def spy(*a, **k):
        seen.append("reference")
        return real(*a, **k)

    monkeypatch.setattr(varlen, "varlen_attention_reference", spy)
    ids, mask = rl_batch(512)
    with torch.no_grad():
        lp = packed_log_probs(models["pf16"], ids, mask)
    assert not seen, "the bf16 model fell back to the reference attention"
    assert torch.isfinite(lp).all()


def test_bf16_log_probs_as_close_to_fp32_transformers_as_transformers_bf16(models):
    import packfwd as pf

    ids, mask = rl_batch(512)
    scored = pf.next_token_labels(ids, mask) >= 0  # [b, s]: the outputs come back in the caller's layout
    with torch.no_grad():
        truth = padded_log_probs(models["hf32"], ids, mask).float()
        errors = {name: (fn(models[name], ids, mask).float() - truth).abs()[scored]
                  for name, fn in (("pf32", packed_log_probs), ("pf16", packed_log_probs),
                                   ("hf16", padded_log_probs))}
    print("|log p - fp32 transformers| mean/max: " + ", ".join(
        f"{n} {float(e.mean()):.2e}/{float(e.max()):.2e}" for n, e in errors.items()))
    assert int(scored.sum()) > 1000
    assert float(errors["pf32"].max()) < 1e-3
    assert float(errors["pf16"].mean()) <= 1.5 * float(errors["hf16"].mean()) + 2**-8


@pytest.fixture(scope="module")
def dense_models():
    """All layers dense (no routing: a bf16 rounding cannot flip an expert choice and move a gradient by O(1))."""
    from transformers import DeepseekV3ForCausalLM

    from packfwd.models import from_hf

    torch.manual_seed(1)
    hf32 = DeepseekV3ForCausalLM(ds_config(first_k_dense_replace=3)).cuda().eval()
    return dict(pf32=from_hf(hf32, device="cuda", params_dtype=torch.float32),
                pf16=from_hf(hf32, device="cuda", params_dtype=torch.bfloat16),
                pf16_ref=from_hf(hf32, device="cuda", params_dtype=torch.bfloat16, attention_backend="reference"))


def test_backward_through_the_padded_head_dims_as_close_to_fp32_as_the_reference_backend(dense_models):
    """Every parameter's bf16 gradient through the flash kernel (padded head dims) is as close to the float32
    model's as the bf16 gradient through the reference attention: within 1.5 times its error plus one bf16 step
    (a wrong head dim or a lost value channel would be off by O(1)).  All-dense layers: with MoE layers the router
    gradients follow bf16 routing flips (on the H200 a router weight's error was 0.081 through flash against 0.043
    through the reference attention, the first gradient over the bound), not the attention alone."""
    models = dense_models
    ids, mask = rl_batch(512, seed=1)
    grads = {}
    for name in ("pf32", "pf16", "pf16_ref"):
        model = models[name]
        model.zero_grad(set_to_none=True)
        lp = packed_log_probs(model, ids, mask)
        (-lp.float().mean()).backward()
        grads[name] = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
    assert grads["pf16"].keys() == grads["pf16_ref"].keys() == grads["pf32"].keys() and len(grads["pf16"]) > 10

    def rel(a, b):
        return float((a - b).norm() / b.norm().clamp_min(1e-12))

    worst = []
    for n, truth in grads["pf32"].items():
        flash, ref = rel(grads["pf16"][n], truth), rel(grads["pf16_ref"][n], truth)
        assert torch.isfinite(grads["pf16"][n]).all(), n
        assert flash <= 1.5 * ref + 2**-8, (n, flash, ref)
        worst.append((flash, ref, n))
    print("largest relative gradient errors against float32 (flash, reference, parameter):",
          sorted(worst, reverse=True)[:3])
