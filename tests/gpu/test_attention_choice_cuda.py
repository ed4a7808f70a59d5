"""``attention_backend="prefer_cudnn"`` on a real GPU (``packfwd.models.mixers.varlen.choose_backend``): with
nvidia-cudnn-frontend installed, cuDNN's ragged attention passes its device check and is the choice for a bf16
Llama (head dim 64), which ``forward.attention_backend(model)`` reports; its logits are the bits of the same model
built with ``attention_backend="cudnn"`` named; under batch invariance's split-K control, and for a head dim above
128, the flash kernel is chosen.  Without the package the flash kernel is chosen and reported.  The automatic
choice (``backend=None``) stays the flash kernel.

    PYTHONPATH=. python -m pytest -q tests/gpu/test_attention_choice_cuda.py
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_prefer_cudnn_is_checked_reported_and_named_alike():
    import packfwd as pf
    from transformers import LlamaConfig, LlamaForCausalLM

    from packfwd.models import from_hf
    from packfwd.models.mixers.varlen import available_backends, choose_backend

    cuda = torch.device("cuda", torch.cuda.current_device())
    has_cudnn = "cudnn" in available_backends(cuda)
    flash = next(b for b in available_backends(cuda) if b in ("flash_attn", "torch_varlen"))
    want = "cudnn" if has_cudnn else flash
    assert choose_backend(cuda, torch.bfloat16, 64) == flash
    assert choose_backend(cuda, torch.bfloat16, 64, backend="prefer_cudnn") == want
    assert choose_backend(cuda, torch.bfloat16, 256, backend="prefer_cudnn") == flash
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512))
    auto = from_hf(hf, device="cuda", params_dtype=torch.bfloat16, attention_backend="prefer_cudnn")
    forward = pf.make_forward("thd")
    assert forward.attention_backend(auto) == want
    named = from_hf(hf, device="cuda", params_dtype=torch.bfloat16, attention_backend=want)
    ids = torch.randint(1, 512, (4, 300), device="cuda")
    mask = torch.arange(300, device="cuda")[None] < torch.tensor([300, 17, 160, 255], device="cuda")[:, None]
    with torch.no_grad():
        assert torch.equal(forward(auto, ids, mask), forward(named, ids, mask))
    matmul = torch.backends.cuda.matmul
    if has_cudnn and hasattr(matmul, "allow_bf16_reduced_precision_reduction_split_k"):
        previous = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction_split_k)
        try:
            matmul.allow_bf16_reduced_precision_reduction = (False, False)  # batch_invariant's state
            assert choose_backend(cuda, torch.bfloat16, 64, backend="prefer_cudnn") == flash
        finally:
            matmul.allow_bf16_reduced_precision_reduction = previous
    print(f"prefer_cudnn attention: {forward.attention_backend(auto)}")
