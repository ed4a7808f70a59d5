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
