"""GPT-OSS on the GPU: the ``flex`` varlen backend (``flex_attention`` compiled to Triton, a block mask per packed
sequence, the sinks from its log-sum-exp; ``packfwd/models/mixers/varlen_flex.py``), the one CUDA path that honours
sliding windows and sinks, against the exact reference.

The CPU tests check the model against transformers per sequence in float64 with the reference backend, and the flex
backend's forward in eager mode.  Here, on CUDA: the compiled kernel's output and its gradients (q, k, v and the
sinks) equal the reference's (float32 math) within bf16 rounding, on ragged sequences longer than the window, with
grouped heads, for self-attention and for context parallelism's bottom-right chunks (the automatic choice for windows
and sinks in fp16/bf16 since this file passed on an H100); a bf16 GPT-OSS model built with it is as close to a float32
run as the reference backend in bf16 (logits, the sinks' and an expert bias's gradients); its biased, clamped experts as grouped GEMMs
(``grouped_glu_mlp``, the automatic path on sm90 bf16) give the loop over experts' logits and gradients.  CUDA
only (skipped elsewhere).

    PYTHONPATH=. python3 -m pytest -q tests/gpu/test_gpt_oss_cuda.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@pytest.fixture(autouse=True)
def no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _flex_or_skip():
    from packfwd.models.mixers.varlen_flex import flex_available

    if not flex_available():
        pytest.skip("this torch has no flex_attention with a log-sum-exp request (torch >= 2.9)")


@pytest.mark.parametrize("chunks", [False, True], ids=["self", "bottom_right"])
def test_flex_equals_the_reference_with_window_and_sinks(chunks):
    from packfwd.models.mixers import varlen

    _flex_or_skip()
    assert varlen._resolve("flex", torch.device("cuda"), torch.bfloat16, ("window", "sinks")) == "flex"
    g = torch.Generator(device="cuda").manual_seed(0)
    lens_k = torch.tensor([300, 17, 1, 700, 128])
    lens_q = torch.tensor([100, 17, 1, 350, 64]) if chunks else lens_k
    cu_q, cu_k = (torch.cat([torch.zeros(1, dtype=torch.long), x.cumsum(0)]).int().cuda() for x in (lens_q, lens_k))
    q = torch.randn(int(lens_q.sum()), 8, 64, device="cuda", generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(int(lens_k.sum()), 2, 64, device="cuda", generator=g).bfloat16().requires_grad_()
            for _ in range(2))
    sinks = torch.randn(8, device="cuda", generator=g).bfloat16().requires_grad_()
    grad_out = torch.randn(q.shape, device="cuda", generator=g).bfloat16()
    for window in (127, None):
        out = varlen.varlen_attention(q, k, v, cu_q, cu_k, int(lens_q.max()), int(lens_k.max()), window=window,
                                      sinks=sinks, backend="flex")
        grads = torch.autograd.grad(out, (q, k, v, sinks), grad_out)
        q32, k32, v32, s32 = (x.detach().float().requires_grad_() for x in (q, k, v, sinks))
        ref = varlen.varlen_attention_reference(q32, k32, v32, cu_q, cu_k, int(lens_q.max()), int(lens_k.max()),
                                                window=window, sinks=s32)
        ref_grads = torch.autograd.grad(ref, (q32, k32, v32, s32), grad_out.float())
        assert rel_err(out, ref) < 1e-2, (window, rel_err(out, ref))
        for name, a, b in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
            assert rel_err(a, b) < 2e-2, (window, name, rel_err(a, b))
        again = varlen.varlen_attention(q, k, v, cu_q, cu_k, int(lens_q.max()), int(lens_k.max()), window=window,
                                        sinks=sinks, backend="flex")
        assert torch.equal(again, out)  # the forward run to run, bit for bit
        deterministic = [torch.equal(a, b) for a, b in zip(torch.autograd.grad(again, (q, k, v, sinks), grad_out),
                                                            grads)]
        print(f"flex window={window} chunks={chunks}: backward bitwise run to run (dq, dk, dv, dsinks): "
              f"{deterministic}")  # reported, not asserted: flex's backward determinism is not promised yet


def test_a_bf16_gpt_oss_on_flex_equals_the_reference_backend():
    """hidden 256, 8 heads of 64 over 4 kv heads, 4 layers (window 64, full, ...), 8 experts top-2; sequences of
    300, 17, 1 and 200 tokens: logits within bf16 rounding of the reference backend's, gradients of the sinks too."""
    from transformers import GptOssConfig, GptOssForCausalLM

    import packfwd as pf
    from packfwd.models import from_hf

    _flex_or_skip()
    torch.manual_seed(0)
    cfg = GptOssConfig(hidden_size=256, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=64, vocab_size=512, num_local_experts=8, num_experts_per_tok=2,
                       sliding_window=64, max_position_embeddings=1024, experts_implementation="eager")
    hf = GptOssForCausalLM(cfg).cuda().eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.normal_(0, 1.0)
    lengths = [300, 17, 1, 200]
    ids = torch.randint(1, 512, (4, 300), device="cuda")
    mask = torch.arange(300, device="cuda")[None] < torch.tensor(lengths, device="cuda")[:, None]
    ids = ids.masked_fill(~mask, 0)
    from packfwd.models.mlp.experts import set_grouped_experts

    out = {}
    runs = (("flex", None, torch.bfloat16), ("reference", None, torch.bfloat16), ("flex", False, torch.bfloat16),
            ("reference", False, torch.float32))  # the last: the float32 truth every bf16 run is judged against
    for backend, grouped, dtype in runs:
        model = from_hf(hf, device="cuda", params_dtype=dtype, attention_backend=backend)
        set_grouped_experts(model, grouped)  # None: grouped_glu_mlp on sm90 bf16; False: the loop over experts
        logits = pf.make_forward("thd")(model, ids, mask)
        logits[mask].float().logsumexp(-1).sum().backward()
        sinks = model.decoder.layers[0].self_attention.core_attention.softmax_offset.grad
        bias = model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.bias.grad
        out[backend, grouped, dtype] = (logits[mask].float(), sinks.float(), bias.float())
    # bf16 rounding flips a few tokens' top-2 experts in a 4-layer MoE, which moves their logits by whole percents
    # whatever the attention kernel (seen on an H100: flex against the reference backend 4.3e-2 in norm); so each
    # bf16 run is judged against the float32 truth, and flex must be as close to it as the reference backend is
    truth = out["reference", False, torch.float32]
    errors = {run[:2]: [rel_err(a, b) for a, b in zip(out[run], truth)] for run in runs[:3]}
    print("gpt-oss bf16 against float32 (logits, sinks' gradient, expert bias gradient):", errors)
    for i, name in enumerate(("logits", "sinks' gradient", "an expert bias's gradient")):
        for run in (("flex", None), ("flex", False)):
            assert errors[run][i] <= 1.5 * errors["reference", None][i] + 5e-3, (run, name, errors)
