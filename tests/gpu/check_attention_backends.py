"""GPU check of packfwd's CUDA attention backends against the pure-PyTorch reference, and of the CUDA model path.

Run on a machine with a CUDA GPU, from the repository root:

    python tests/gpu/check_attention_backends.py

1. Attention: for every CUDA backend present (``torch_varlen``; ``flash_attn``, ``cudnn`` when installed) and each dtype
   (bf16, fp16, and fp32 where the backend takes it), ragged batches with GQA/MQA/MHA: the forward output and
   the gradients of q, k, v against ``varlen_attention_reference`` on the same inputs (computed in float32).
   The error is max|backend - reference| / max|reference|, per tensor.  Then bf16 causal attention of query chunks
   to longer key ranges (context parallelism's calls: the bottom-right diagonal) and value heads narrower than the
   query heads (multi-head latent attention).
2. Model: a tiny random Llama (transformers) loaded with ``packfwd.models.from_hf`` on CUDA (Megatron-Core's
   unmodified CUDA path), THD logits vs the HF model per sequence (fp32, reference backend), and bf16 logits with
   each CUDA backend vs the reference backend.  Skipped if transformers is missing.

Prints one line per check and exits 1 if any error exceeds its tolerance (or a backend that should take a
dtype fails), 2 if there is no GPU.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 2e-4}
GRAD_TOLERANCE = {torch.bfloat16: 6e-2, torch.float16: 1e-2, torch.float32: 5e-4}
CASES = {  # name: (lengths, query heads, kv heads, head dim)
    "gqa-ragged": ([1, 17, 256, 3, 1000, 64], 8, 2, 64),
    "mqa": ([5, 129, 33], 4, 1, 128),
    "mha-one-long": ([2048], 4, 4, 64),
    "with-an-empty-sequence": ([3, 0, 70], 4, 2, 64),
}
# causal attention of query chunks to longer key ranges, as context parallelism calls it (bottom-right diagonal):
# (query lengths, key lengths, query heads, kv heads, head dim, value head dim)
CROSS_CASES = {
    "cp-chunks": ([4, 60, 1, 128], [10, 64, 33, 256], 8, 2, 64, 64),
    "mla-head-dims": ([5, 129, 33], [5, 129, 33], 4, 4, 48, 32),
}
failures: list[str] = []


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()


def check(name: str, err: float, tol: float) -> None:
    ok = err <= tol
    print(f"{'ok  ' if ok else 'FAIL'} {name:<58} rel err {err:.2e} (tol {tol:.0e})")
    if not ok:
        failures.append(name)


def attention_checks(device: torch.device) -> None:
    from packfwd.models.mixers.varlen import available_backends, varlen_attention, varlen_attention_reference

    backends = [b for b in available_backends(device) if b != "reference"]
    print(f"CUDA backends found: {backends}")
    if "torch_varlen" not in backends:
        failures.append("torch_varlen missing")
    for backend in backends:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for case, (lengths, h, hk, d) in CASES.items():
                label = f"{backend} {str(dtype)[6:]} {case}"
                g = torch.Generator(device=device).manual_seed(0)
                t = sum(lengths)
                q, k, v = (torch.randn(t, n, d, device=device, generator=g).to(dtype).requires_grad_()
                           for n in (h, hk, hk))
                grad_out = torch.randn(t, h, d, device=device, generator=g).to(dtype)
                cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
                m = max(lengths)
                try:
                    out = varlen_attention(q, k, v, cu, cu, m, m, True, None, backend=backend)
                    grads = torch.autograd.grad(out, (q, k, v), grad_out)
                except Exception as e:  # noqa: BLE001 - report any kernel refusal
                    if dtype == torch.float32:
                        print(f"n/a  {label:<58} ({type(e).__name__}: {str(e).splitlines()[0][:60]})")
                        break
                    print(f"FAIL {label:<58} raised {type(e).__name__}: {e}")
                    failures.append(label)
                    continue
                q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
                ref = varlen_attention_reference(q32, k32, v32, cu, cu, m, m, True, None)
                ref_grads = torch.autograd.grad(ref, (q32, k32, v32), grad_out.float())
                check(f"{label} out", rel_err(out, ref), TOLERANCE[dtype])
                for gname, a, b in zip("qkv", grads, ref_grads):
                    check(f"{label} d{gname}", rel_err(a, b), GRAD_TOLERANCE[dtype])


def cross_checks(device: torch.device) -> None:
    """Unequal ``cu_seqlens`` (bottom-right causal) and ``d_v != d``, bf16, against the reference."""
    from packfwd.models.mixers.varlen import available_backends, varlen_attention, varlen_attention_reference

    for backend in [b for b in available_backends(device) if b != "reference"]:
        for case, (lq, lk, h, hk, d, dv) in CROSS_CASES.items():
            label = f"{backend} bfloat16 {case}"
            g = torch.Generator(device=device).manual_seed(1)
            q = torch.randn(sum(lq), h, d, device=device, generator=g).bfloat16().requires_grad_()
            k = torch.randn(sum(lk), hk, d, device=device, generator=g).bfloat16().requires_grad_()
            v = torch.randn(sum(lk), hk, dv, device=device, generator=g).bfloat16().requires_grad_()
            grad_out = torch.randn(sum(lq), h, dv, device=device, generator=g).bfloat16()
            cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device=device)
                          for x in (lq, lk))
            try:
                out = varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), True, None, backend=backend)
                grads = torch.autograd.grad(out, (q, k, v), grad_out)
            except Exception as e:  # noqa: BLE001 - report any kernel refusal
                print(f"FAIL {label:<58} raised {type(e).__name__}: {e}")
                failures.append(label)
                continue
            q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
            ref = varlen_attention_reference(q32, k32, v32, cu_q, cu_k, max(lq), max(lk), True, None)
            ref_grads = torch.autograd.grad(ref, (q32, k32, v32), grad_out.float())
            check(f"{label} out", rel_err(out, ref), TOLERANCE[torch.bfloat16])
            for gname, a, b in zip("qkv", grads, ref_grads):
                check(f"{label} d{gname}", rel_err(a, b), GRAD_TOLERANCE[torch.bfloat16])


def model_checks(device: torch.device) -> None:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        print("skip model checks: transformers is not installed")
        return
    from packfwd.models.mixers.varlen import available_backends
    from packfwd.forward import make_forward
    from packfwd.models import from_hf

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=256, attn_implementation="eager")
    hf = LlamaForCausalLM(config).to(device).eval()
    lengths = [37, 5, 120, 64]
    s = max(lengths)
    ids = torch.randint(0, 256, (len(lengths), s), device=device)
    mask = torch.zeros(len(lengths), s, dtype=torch.bool, device=device)
    for i, n in enumerate(lengths):
        if i % 2:
            mask[i, s - n :] = True
        else:
            mask[i, :n] = True
    with torch.no_grad():
        model = from_hf(hf, attention_backend="reference")
        assert next(model.parameters()).is_cuda and model.rotary_pos_emb.inv_freq.is_cuda
        logits = make_forward("thd")(model, ids, mask)
        ref = [hf(ids[i][mask[i]][None]).logits[0] for i in range(len(lengths))]
        err = max(rel_err(logits[i][mask[i]], ref[i]) for i in range(len(lengths)))
        check("model fp32 THD (reference backend) vs HF per sequence", err, 1e-4)
        bshd = make_forward("bshd")(model, ids, mask)
        check("model fp32 BSHD (reference backend) vs HF per sequence",
              max(rel_err(bshd[i][mask[i]], ref[i]) for i in range(len(lengths))), 1e-4)
        base = make_forward("thd")(from_hf(hf, params_dtype=torch.bfloat16, attention_backend="reference"), ids, mask)
        for backend in [b for b in available_backends(device) if b != "reference"]:
            half = from_hf(hf, params_dtype=torch.bfloat16, attention_backend=backend)
            for fmt in ("thd", "bshd"):
                out = make_forward(fmt)(half, ids, mask)
                check(f"model bf16 {fmt.upper()} {backend} vs reference backend", rel_err(out[mask], base[mask]), 3e-2)


def main() -> int:
    warnings.filterwarnings("ignore")  # Megatron-Core's import-time notices about optional extensions
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `import packfwd`
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    import megatron.core

    print(f"torch {torch.__version__}, megatron-core {megatron.core.__version__}, {torch.cuda.get_device_name(device)}")
    attention_checks(device)
    cross_checks(device)
    model_checks(device)
    print(f"\n{len(failures)} failure(s)" + (f": {failures}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
