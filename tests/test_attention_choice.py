"""The attention backend chosen on CUDA (``packfwd.models.mixers.varlen.choose_backend``), without a GPU: the
CUDA kernels are stood in for (cuDNN's op by the reference with flash-attn's semantics) and the device check's
verdict is set.  The automatic choice (``backend=None``) is the flash kernel; with ``backend="prefer_cudnn"`` cuDNN
is taken for fp16/bf16 with one head dim of at most 128 once its check passed, never when
it failed, for other head dims, under split-K control (batch invariance) or for a layer with a window or sinks;
the check itself runs (forward and gradients against the reference) and a wrong kernel fails it with a warning;
a named backend is kept.  The real kernels: ``tests/gpu/check_attention_backends.py`` and the GPU tests."""

import pytest
import torch

from packfwd.models.mixers import varlen
from packfwd.models.mixers.varlen import choose_backend, cudnn_check, varlen_attention_reference


def reference_as_cudnn(q, k, v, *, scale, is_causal, causal_bottom_right, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                       max_seqlen_kv, return_lse):
    return varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, is_causal,
                                      scale), None


@pytest.fixture
def cuda_kernels(monkeypatch):
    """torch's flash kernel and cuDNN present on a CUDA device (stand-ins); the check's verdicts reset."""
    monkeypatch.setattr(varlen, "_cudnn_func", lambda: reference_as_cudnn)
    monkeypatch.setattr(varlen, "_torch_varlen_func", lambda: object())
    monkeypatch.setattr(varlen, "_flash_attn_func", lambda: None)
    monkeypatch.setattr(varlen, "available_backends",
                        lambda device="cpu", lookup=varlen.available_backends: lookup("cuda"))
    monkeypatch.setattr(varlen, "_CUDNN_CHECKED", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    return monkeypatch


def test_cudnn_is_chosen_where_it_is_faster_once_checked(cuda_kernels):
    checks = []
    cuda_kernels.setattr(varlen, "cudnn_check", lambda device, dtype: checks.append((device, dtype)) or True)
    cuda = torch.device("cuda", 0)
    assert choose_backend(cuda, torch.bfloat16, 128) == "torch_varlen" and not checks  # automatic: the flash kernel

    def prefer(*args, **kwargs):
        return choose_backend(*args, backend="prefer_cudnn", **kwargs)

    assert prefer(cuda, torch.bfloat16, 128) == prefer(cuda, torch.bfloat16, 64) == "cudnn"
    assert checks == [(cuda, torch.bfloat16)]  # once per device and dtype
    assert prefer(cuda, torch.float16, 128) == "cudnn" and len(checks) == 2
    assert prefer(cuda, torch.bfloat16, 192) == "torch_varlen"  # a head dim it was not measured on
    assert prefer(cuda, torch.bfloat16, 192, 128) == "torch_varlen"  # MLA's two head dims
    assert prefer(cuda, torch.float32, 128) == "reference"
    assert choose_backend(cuda, torch.bfloat16, 128, backend="torch_varlen") == "torch_varlen"  # named: kept
    assert prefer(cuda, torch.bfloat16, 128, features=("window",)) != "cudnn"  # cuDNN has no window
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "allow_bf16_reduced_precision_reduction_split_k"):
        previous = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction_split_k)
        try:
            matmul.allow_bf16_reduced_precision_reduction = (False, False)  # what batch_invariant=True sets
            assert prefer(cuda, torch.bfloat16, 128) == "torch_varlen"
        finally:
            matmul.allow_bf16_reduced_precision_reduction = previous


def test_a_failed_check_keeps_the_flash_kernel(cuda_kernels):
    cuda_kernels.setattr(varlen, "cudnn_check", lambda device, dtype: False)
    assert choose_backend(torch.device("cuda", 0), torch.bfloat16, 128, backend="prefer_cudnn") == "torch_varlen"


def test_the_check_compares_forward_and_gradients_with_the_reference(cuda_kernels):
    assert cudnn_check("cpu", torch.float32)  # the stand-in is the reference: passes

    def off_by_a_little(q, k, v, **kw):  # a kernel whose output is 5 % off
        out, lse = reference_as_cudnn(q, k, v, **kw)
        return out * 1.05, lse

    cuda_kernels.setattr(varlen, "_KERNELS", dict(varlen._KERNELS, cudnn=off_by_a_little))
    cuda_kernels.setattr(varlen, "_kernels", lambda: varlen._KERNELS)
    with pytest.warns(UserWarning, match="failed its check"):
        assert not cudnn_check("cpu", torch.float32)

    def raises(*a, **k):
        raise RuntimeError("no cuDNN library")

    cuda_kernels.setattr(varlen, "_KERNELS", dict(varlen._KERNELS, cudnn=raises))
    with pytest.warns(UserWarning, match="RuntimeError: no cuDNN library"):
        assert not cudnn_check("cpu", torch.float32)


def test_prefer_cudnn_on_the_cpu_is_the_automatic_choice():
    assert choose_backend("cpu", torch.bfloat16, 64, backend="prefer_cudnn") == "reference"
    with pytest.raises(ValueError, match="prefer_cudnn"):  # the message lists every name backend= takes
        choose_backend("cpu", torch.bfloat16, 64, backend="fastest")


def _tiny_llama():
    from packfwd.models import ModelArgs, build_model

    torch.manual_seed(0)
    return build_model(ModelArgs(vocab_size=32, hidden_size=16, ffn_hidden_size=32, num_layers=2,
                                 num_attention_heads=2))


def test_a_bucket_plan_asks_for_cudnn_and_other_plans_do_not(monkeypatch):
    """A bucket plan's batch (shapes that recur: CUDA graphs, StepGraphs) reaches the automatic attention as
    ``prefer_cudnn`` (cuDNN where checked); a batch planned for its own shapes, and a named backend, as before; on
    the CPU both resolve to the reference (the logits agree to float32 rounding: the bucket's padding changes the
    GEMMs' shapes)."""
    import packfwd as pf
    from packfwd.layout.bucket import Bucket
    from packfwd.models.mixers import attention

    asked = []
    real = attention.varlen_attention

    def spy(*args, backend=None, **kwargs):
        asked.append(backend)
        return real(*args, backend=backend, **kwargs)

    monkeypatch.setattr(attention, "varlen_attention", spy)
    model = _tiny_llama()
    forward = pf.make_forward("thd")
    ids = torch.randint(1, 32, (3, 10))
    mask = torch.arange(10)[None] < torch.tensor([10, 4, 7])[:, None]
    with torch.no_grad():
        plain = forward(model, ids, mask)
        assert asked == [None, None]
        asked.clear()
        plan = forward.plan(ids, mask, bucket=Bucket(tokens=32, max_seqlen=16))
        assert plan.bucket == Bucket(tokens=32, max_seqlen=16) and plan.packed_seq_params().bucket == plan.bucket
        bucketed = forward(model, ids, plan=plan)
        assert asked == ["prefer_cudnn", "prefer_cudnn"]
    torch.testing.assert_close(bucketed, plain, rtol=1e-5, atol=1e-6)
    assert forward.plan(ids, mask).bucket is None and forward.plan(ids, mask).packed_seq_params().bucket is None
    layer = next(m for m in model.modules() if isinstance(m, attention.CoreAttention))
    layer.backend = "reference"  # named: kept for bucket plans too
    assert layer.backend_for(plan.packed_seq_params().bucket is not None) == "reference"


def test_the_forward_reports_what_bucket_plans_run(monkeypatch):
    import packfwd as pf
    from packfwd.models.mixers import attention

    model = _tiny_llama()
    forward = pf.make_forward("thd")
    assert forward.attention_backend(model) == "reference"  # the CPU: one answer for both

    def on_cuda(device, dtype, d, d_v, *, backend=None, features=()):  # cuDNN checked on a CUDA device
        return "cudnn" if backend == "prefer_cudnn" else backend or "torch_varlen"

    monkeypatch.setattr(attention, "choose_backend", on_cuda)
    assert attention.attention_backends(model) == {"torch_varlen": 2}
    assert attention.attention_backends(model, bucket_plans=True) == {"cudnn": 2}
    assert forward.attention_backend(model) == "torch_varlen; cudnn on bucket plans"
