"""The hybrid linear-attention models (Qwen3.5's layer pattern: 3 Gated DeltaNet layers, 1 gated full attention) on
the GPU, random bf16 weights of a small Qwen3.5 shape (hidden 512, Gated DeltaNet 4 key / 8 value heads of 64):

* batch invariance (``make_forward("thd", batch_invariant=True)``): a target sequence of several 64-token chunks has
  the same logits, bit for bit, alone, with neighbours before / after / around it, with the batch reversed and among
  many very short sequences; dense and MoE (Qwen3.5-MoE's MLP: 16 experts top-4 and a gated shared expert; its
  invariance is also the MoE path's, as ``tests/gpu/test_batch_invariance_cuda.py``'s "moe" model);
* the CUDA path (fla's varlen kernels where installed, else the torch path on the GPU) against the torch path on
  the CPU with the same weights: float32 on both within float32 rounding of the chunked scan, bf16 within bf16
  rounding (relative to the logits' scale); the bf16 backward runs and its gradients point where the float32
  CPU model's do.

Each test prints its numbers (``hybrid ...``).

    CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=. python -m pytest -q -s tests/gpu/test_hybrid_cuda.py
"""

from __future__ import annotations

import functools

import pytest
import torch

import packfwd as pf
from packfwd.forward import deterministic as det
from packfwd.models import ModelArgs, build_model
from packfwd.models.convert.hf import load_weights
from packfwd.models.mixers import DeltaNet
from packfwd.models.mlp import Moe
from tests.test_batch_invariance import CASES, composition, padded, random_sequences

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HYBRID = dict(vocab_size=32000, hidden_size=512, ffn_hidden_size=1536, num_layers=4, num_attention_heads=8,
              num_query_groups=2, head_dim=64, qk_norm=True, rotary_percent=0.25, attention_output_gate=True,
              norm_zero_centered=True, linear_attention=DeltaNet(num_k_heads=4, num_v_heads=8, head_k_dim=64,
                                                                 head_v_dim=64, layers=(0, 1, 2)))
MODELS = {
    "dense": ModelArgs(**HYBRID, family="qwen3_5"),
    "moe": ModelArgs(**HYBRID, family="qwen3_5_moe",
                     moe=Moe(num_experts=16, top_k=4, ffn_hidden_size=256, shared_ffn_hidden_size=256,
                             shared_expert_gate=True)),
}


@functools.lru_cache(maxsize=None)
def cpu_model(name: str):
    torch.manual_seed(0)
    return build_model(MODELS[name]).eval()


@functools.lru_cache(maxsize=None)
def cuda_model(name: str, dtype: torch.dtype = torch.bfloat16):
    return _copy(cpu_model(name), build_model(MODELS[name], device="cuda", params_dtype=dtype, init=False)).eval()


def _copy(source, model):
    """``model`` with ``source``'s weights, in ``model``'s device and dtype."""
    p = next(model.parameters())
    return load_weights(model, {n: w.detach().to(p.device, p.dtype) for n, w in source.named_parameters()})


def _logits(forward, model, seqs, rows):
    ids, mask = padded(seqs, next(model.parameters()).device)
    with torch.no_grad():
        out = forward(model, ids, mask)
    return [out[r, : len(seqs[r])] for r in rows]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("target_len", [1, 300])
def test_batch_invariant_bitwise(name, target_len):
    model = cuda_model(name)
    forward = pf.make_forward("thd", batch_invariant=True)
    vocab = MODELS[name].vocab_size
    target = random_sequences([target_len], vocab, 1)[0]
    others = random_sequences([17, 129, 1, 640, 64], vocab, 2)
    shorts = random_sequences([1, 3, 5, 8] * 4, vocab, 3)
    bad = []
    with det.enabled(deterministic=False):
        alone = _logits(forward, model, [target], [0])[0]
        for case in CASES[1:]:
            seqs, row = composition(case, target, others, shorts)
            got = _logits(forward, model, seqs, [row])[0]
            if not torch.equal(got, alone):
                diff = (got.float() - alone.float()).abs()
                bad.append(f"{case}: {int((diff.amax(-1) > 0).sum())}/{len(target)} tokens differ, max {diff.max():.3g}")
    print(f"hybrid invariance {name} target={target_len}: {'ok' if not bad else bad}")
    assert not bad, "not batch invariant:\n" + "\n".join(bad)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float().cpu() - want.float()).abs().max() / want.float().abs().max())


# fp32: fla's Triton dots may round through TF32; bf16: the logits' own rounding after 4 bf16 layers (dense only: in
# bf16 a router may pick another expert for a token whose scores tie within rounding)
@pytest.mark.parametrize("name, dtype, tolerance", [("dense", torch.float32, 5e-3), ("moe", torch.float32, 5e-3),
                                                    ("dense", torch.bfloat16, 5e-2)], ids=["dense-fp32", "moe-fp32",
                                                                                           "dense-bf16"])
def test_cuda_equals_the_cpu_torch_path(name, dtype, tolerance):
    seqs = random_sequences([5, 130, 300, 64], MODELS[name].vocab_size, 4)
    forward = pf.make_forward("thd", seq_align=16)
    want = _logits(forward, cpu_model(name), seqs, range(len(seqs)))
    got = _logits(forward, cuda_model(name, dtype), seqs, range(len(seqs)))
    errors = [_relative(g, w) for g, w in zip(got, want)]
    print(f"hybrid cuda vs cpu {name} {dtype}: max |diff| / max |logit| per sequence {[f'{e:.2e}' for e in errors]}")
    assert max(errors) < tolerance


def test_bf16_backward_follows_the_float32_gradients():
    name = "dense"
    seqs = random_sequences([130, 300, 7], MODELS[name].vocab_size, 5)
    forward = pf.make_forward("thd")
    grads = {}
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        model = _copy(cpu_model(name), build_model(MODELS[name], device=device, params_dtype=dtype, init=False))
        ids, mask = padded(seqs, device)
        logits = forward(model, ids, mask)
        (logits.float().logsumexp(-1) * mask).sum().backward()
        grads[device] = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
    worst = 1.0
    for n, want in grads["cpu"].items():
        got = grads["cuda"][n]
        assert torch.isfinite(got).all(), n
        if want.norm() > 0:
            worst = min(worst, float(torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)))
    print(f"hybrid bf16 backward: worst cosine similarity of a parameter's gradient to float32's {worst:.5f}")
    assert worst > 0.98


def test_megatron_cores_gated_deltanet_agrees():
    """Megatron-Core's own ``GatedDeltaNet`` (fla's varlen kernels, THD) loaded with packfwd's layer's state dict
    gives the same outputs at the real tokens within bf16 rounding: the parameter names and layout are Megatron's."""
    pytest.importorskip("fla")
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from packfwd.models.norm import RMSNorm

    model = cuda_model("dense")
    mine = model.decoder.layers[0].self_attention
    theirs = GatedDeltaNet(model.config, GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=RMSNorm,
                                                                 out_proj=RowParallelLinear),
                           layer_number=1, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    theirs = theirs.to(device="cuda", dtype=torch.bfloat16)  # the norm packfwd passes is built on the CPU
    state = mine.state_dict()
    names = lambda sd: sorted(k for k in sd if not k.endswith("_extra_state"))  # noqa: E731 - TE's bookkeeping
    assert names(theirs.state_dict()) == names(state)
    theirs.load_state_dict(state, strict=False)
    lengths = [5, 130, 300, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    torch.manual_seed(0)
    x = torch.randn(int(cu[-1]), 1, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want, got = theirs(x, None, packed_seq_params=params)[0], mine(x, None, packed_seq_params=params)[0]
    error = _relative(got, want.float().cpu())
    print(f"hybrid packfwd vs Megatron-Core GatedDeltaNet (bf16): max |diff| / max |out| {error:.2e}")
    assert error < 2e-2
