"""Benchmark: the hybrid linear-attention models (Qwen3.5 dense, Qwen3.5-MoE; issue 30) on an RL batch, packfwd
packed against transformers padded on the same weights, forward + backward and forward only.

The batch and the loss are ``bench_step.py``'s (``rl_batch``: left-padded prompts, right-padded responses; ``-mean``
next-token log-prob over the response tokens); its step, measurement and loss check are reused as they are.
Variants (each optional; one that cannot run is recorded with its reason or its error, the run goes on):

* ``packfwd_fused``: ``make_forward("thd")`` on ``from_hf(hf)`` (fused layer), forward + backward (Gated DeltaNet through
  fla's varlen kernels where installed: ``packfwd.models.mixers.deltanet_cuda``);
* ``hf_padded``: transformers' ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` on the padded batch (sdpa for its
  full-attention layers), forward + backward.  Its chunked delta rule is the operator packfwd's rows run
  (``--hf-delta-rule packfwd``, the default on CUDA: fla's forward and packfwd's backward, each padded row one
  sequence), since fla's own backward refuses on Hopper with Triton < 3.7.1; ``--hf-delta-rule own`` keeps
  transformers' choice (fla where importable, else its torch loop).  Its convolution stays transformers' own
  (``causal_conv1d`` where installed, else ``F.conv1d``).  The JSON records which ran;
* ``packfwd_forward`` / ``hf_padded_forward``: the same forwards under ``torch.no_grad`` (scoring).

FLOPs (``hybrid_flops``, real tokens only, x3 for forward + backward): every matrix product per token (the full
layers' ``q_proj`` with its gate, k, v, o; the Gated DeltaNet layers' ``in_proj`` and ``out_proj``; the MLP, or the
MoE's ``top_k`` experts, shared expert, router and gate; the output layer) x2, causal attention ``4 q L^2 / 2`` on
the full layers, and the chunked delta rule ``2 hv (3 dk dv + C (dk + dv))`` per token (three state products and
the intra-chunk products of a chunk of ``C = 64``), ignoring the convolution and the norms.

    PYTHONPATH=. python benchmarks/bench_hybrid.py --out benchmarks/out/hybrid.json
    python benchmarks/bench_hybrid.py --smoke --out /tmp/hybrid_smoke.json     # tiny models on the CPU
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from bench_forward import Timer, matmul_tflops  # noqa: E402
from bench_step import Skip, check, hf_step, measure, next_token_log_probs, packfwd_step, rl_batch  # noqa: E402
from common import environment, table, write_json  # noqa: E402

from packfwd.forward import make_forward  # noqa: E402
from packfwd.logits import log_probs  # noqa: E402

VARIANTS = ("packfwd_fused", "hf_padded", "packfwd_forward", "hf_padded_forward")
LINEAR = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128)
SHAPES = {  # transformers text-config fields: ~1.5 B dense, ~2 B MoE (~0.6 B active), Qwen3.5's vocabulary
    "qwen3_5_1p5b": ("qwen3_5", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                                      num_attention_heads=16, num_key_value_heads=2, head_dim=128,
                                      vocab_size=248320, tie_word_embeddings=True, **LINEAR)),
    "qwen3_5_moe_2b": ("qwen3_5_moe", dict(hidden_size=1536, num_hidden_layers=16, num_attention_heads=16,
                                            num_key_value_heads=2, head_dim=128, vocab_size=248320,
                                            tie_word_embeddings=True, num_experts=64, num_experts_per_tok=8,
                                            moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                            **LINEAR)),
}
SMOKE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=160, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16)
SMOKE_EXTRA = {"qwen3_5": dict(intermediate_size=96),
               "qwen3_5_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=32)}


def hf_model(shape: str, smoke: bool, device, dtype):
    """The transformers model every variant's weights come from (random init, seeded)."""
    import transformers

    family, fields = SHAPES[shape]
    if smoke:
        fields = {**SMOKE, **SMOKE_EXTRA[family]}
    config_cls, model_cls = {
        "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
        "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM)}[family]
    config = config_cls(**fields, rms_norm_eps=1e-6, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(config)
    return model.to(dtype).train()


def use_packfwd_delta_rule(hf) -> str:
    """Make ``hf``'s Gated DeltaNet layers call packfwd's chunked delta rule (fla's forward, packfwd's backward on
    CUDA): each padded row of ``[b, s, h, d]`` is one sequence of ``s`` tokens from a zero state (transformers
    zeroes the pads' hidden states before the projections, so a left pad's ``k = v = 0`` leaves the state zero).
    Returns what was replaced (the module global the forward calls, or the layers' attribute), or ``"nothing"``."""
    import importlib

    from packfwd.models.mixers.deltanet_ops import chunk_gated_delta_rule_packed

    def rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_):
        # the model's other keywords pass through to here; transformers drops those fla does not take, and so here
        if initial_state is not None or output_final_state or cu_seqlens is not None:
            raise ValueError("the benchmark's delta rule takes padded rows from a zero state: no cache, no packed "
                             "cu_seqlens")
        b, s = query.shape[:2]
        cu = torch.arange(0, (b + 1) * s, s, device=query.device, dtype=torch.int32)
        out = chunk_gated_delta_rule_packed(query.flatten(0, 1), key.flatten(0, 1), value.flatten(0, 1),
                                            g.flatten(0, 1), beta.flatten(0, 1), cu, chunk_size, max_seqlen=s,
                                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return out.view(b, s, *out.shape[1:]), None

    done = []
    module = importlib.import_module(type(hf).__module__)
    for name in ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule"):
        if callable(getattr(module, name, None)):
            setattr(module, name, rule)
            done.append(f"{module.__name__}.{name}")
    layers = [m for m in hf.modules() if callable(getattr(m, "chunk_gated_delta_rule", None))]
    for m in layers:
        m.chunk_gated_delta_rule = rule
    if layers:
        done.append(f"{len(layers)} layers' chunk_gated_delta_rule")
    return ", ".join(done) or "nothing"


def hybrid_flops(args, lengths, chunk: int = 64) -> float:
    """Forward FLOPs of sequences of ``lengths`` through a hybrid model of ``args`` (module docstring)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    tokens = lengths.sum()
    h, d, lin = args.hidden_size, args.kv_channels, args.linear_attention
    q, kv = args.num_attention_heads * d, args.query_groups * d
    full = args.num_layers - len(lin.layers)
    per_token = full * (h * (2 * q + 2 * kv) + q * h)  # q_proj with its gate, k, v, o
    kd, vd, hv = lin.num_k_heads * lin.head_k_dim, lin.num_v_heads * lin.head_v_dim, lin.num_v_heads
    per_token += len(lin.layers) * (h * (2 * kd + 2 * vd + 2 * hv) + vd * h)  # in_proj, out_proj
    for layer in range(args.num_layers):
        if args.dense_mlp(layer):
            per_token += 3 * h * args.ffn_hidden_size
        else:
            m = args.moe
            per_token += 3 * h * (m.top_k * m.ffn_hidden_size + m.shared_ffn_hidden_size) + h * m.num_experts + h
    per_token += h * args.vocab_size
    attention = full * 4.0 * q * (lengths**2).sum() / 2
    delta = len(lin.layers) * 2.0 * hv * (3 * lin.head_k_dim * lin.head_v_dim
                                         + chunk * (lin.head_k_dim + lin.head_v_dim)) * tokens
    return 2.0 * per_token * tokens + attention + delta


def packfwd_forward_step(model, batch):
    """``bench_step.packfwd_step``'s forward alone, under ``torch.no_grad`` (scoring)."""
    forward = make_forward("thd", logits_processor=next_token_log_probs)

    def step():
        with torch.no_grad():
            lp = forward(model, batch["ids"], labels=batch["labels"], attention_mask=batch["mask"],
                         seqlens=batch["lengths"])["log_probs"]
        return -lp.sum() / batch["n_loss"], lp

    return step


def hf_forward_step(hf, batch):
    """``bench_step.hf_step``'s forward alone, under ``torch.no_grad``."""
    def step():
        with torch.no_grad():
            logits = hf(input_ids=batch["ids"], attention_mask=batch["mask"], position_ids=batch["positions"]).logits
            lp = log_probs(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1)).view(logits.shape[:2])
        return -lp.sum() / batch["n_loss"], lp

    return step


def run_shape(shape, cfg, timer) -> dict:
    from packfwd.models import from_hf
    from packfwd.models.convert.hf import args_from_hf_config

    hf = hf_model(shape, cfg.smoke, cfg.device, cfg.dtype)
    hf_rule = use_packfwd_delta_rule(hf) if cfg.hf_delta_rule == "packfwd" else "transformers' own"
    args = args_from_hf_config(hf.config)
    batch = rl_batch(cfg.batch, cfg.seq, cfg.prompt, cfg.fill, args.vocab_size, cfg.seed, cfg.device)
    real = sum(batch["lengths"])
    fwd = hybrid_flops(args, batch["lengths"])
    print(f"== {shape}: {sum(p.numel() for p in hf.parameters()) / 1e9:.3f} B parameters, {cfg.batch} x {cfg.seq}, "
          f"{real} real tokens (fill {real / (cfg.batch * cfg.seq):.3f})", flush=True)
    steps = {"packfwd_fused": packfwd_step, "hf_padded": hf_step, "packfwd_forward": packfwd_forward_step,
             "hf_padded_forward": hf_forward_step}
    rows, lps = [], {}
    model = None
    for name in cfg.variants:
        t0 = time.perf_counter()
        try:
            if name.startswith("packfwd"):
                model = model or from_hf(hf, device=cfg.device, params_dtype=cfg.dtype)
                module = model
            else:
                module = hf
            row = {"variant": name, **measure(steps[name](module, batch), module, cfg, timer)}
        except Skip as e:
            row = {"variant": name, "skipped": str(e)}
        except torch.cuda.OutOfMemoryError as e:  # a row this card cannot hold: skipped with its reason
            total = torch.cuda.get_device_properties(cfg.device).total_memory / 2**30
            row = {"variant": name, "skipped": f"out of memory on this {total:.0f} GiB card at {cfg.batch} x "
                                               f"{cfg.seq} (--batch smaller fits): {str(e).splitlines()[0][:200]}"}
        except Exception as e:  # noqa: BLE001 - one variant's failure must not end the run
            row = {"variant": name, "error": f"{type(e).__name__}: {e}"[:2000],
                   "traceback": traceback.format_exc()[-4000:]}
        if "ms" in row:
            lps[name] = row.pop("_lp")
            flops = fwd * (1 if name.endswith("_forward") else 3)
            row.update({"tokens/s": real / row["ms"] * 1e3, "TFLOP/s": flops / (row["ms"] * 1e-3) / 1e12})
            if cfg.ceiling:
                row["% ceiling"] = 100 * row["TFLOP/s"] / cfg.ceiling
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print(f"  {name}: " + (f"{row['ms']:.1f} ms, {row['TFLOP/s']:.1f} TFLOP/s, loss {row['loss']:.5f}"
                               if "ms" in row else row.get("skipped") or row.get("error")), flush=True)
        if cfg.device.type == "cuda":
            torch.cuda.empty_cache()
    for pair in (("packfwd_fused", "hf_padded"), ("packfwd_forward", "hf_padded_forward")):
        both = {r["variant"]: r for r in rows if r["variant"] in pair and "ms" in r}
        if len(both) == 2:
            both[pair[0]]["speedup_vs_hf"] = both[pair[1]]["ms"] / both[pair[0]]["ms"]
    check(rows, lps, batch, cfg)  # against hf_padded's, else packfwd_fused's
    return {"shape": shape, "hf_config": hf.config.to_dict(), "hf_delta_rule": hf_rule, "parameters": sum(p.numel() for p in hf.parameters()),
            "real_tokens": real, "padded_tokens": cfg.batch * cfg.seq, "forward_TFLOP": fwd / 1e12,
            "lengths": batch["lengths"], "results": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU (CI): seconds")
    ap.add_argument("--out", type=Path, default=HERE / "out" / "hybrid.json", help="JSON file to write")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--batch", type=int, default=None, help="rows (default 6; smoke 2)")
    ap.add_argument("--seq", type=int, default=None, help="padded width (default 4096; smoke 96)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt columns, left-padded (default 1024; smoke 16)")
    ap.add_argument("--fill", type=float, default=0.54, help="real tokens / (batch * seq)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=None, help="timed steps per variant (default 5; smoke 1)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first, >= 1 (default 2; smoke 1)")
    ap.add_argument("--hf-delta-rule", choices=("packfwd", "own"), default=None,
                    help="transformers' chunked delta rule: packfwd's operator (default on CUDA) or its own")
    cfg = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not cfg.smoke
    cfg.hf_delta_rule = cfg.hf_delta_rule or ("packfwd" if cuda else "own")
    cfg.device = torch.device("cuda" if cuda else "cpu")
    cfg.dtype = torch.bfloat16 if cuda else torch.float32
    cfg.batch = cfg.batch or (2 if cfg.smoke else 6)
    cfg.seq = cfg.seq or (96 if cfg.smoke else 4096)
    cfg.prompt = cfg.prompt if cfg.prompt is not None else (16 if cfg.smoke else 1024)
    cfg.runs = cfg.runs or (1 if cfg.smoke else 5)
    cfg.warmup = max(1, cfg.warmup if cfg.warmup is not None else (1 if cfg.smoke else 2))
    cfg.loss_tol = 1e-2 if cfg.dtype == torch.bfloat16 else 1e-4
    timer = Timer(cfg.device)
    cfg.ceiling = matmul_tflops(cfg.device, torch.bfloat16, timer)
    print(f"device {cfg.device} {cfg.dtype}; bf16 matmul: {cfg.ceiling and round(cfg.ceiling)} TFLOP/s", flush=True)
    shapes = []
    payload = {"benchmark": "hybrid", "smoke": cfg.smoke, "command": " ".join(sys.argv), "env": environment(),
               "dtype": str(cfg.dtype), "batch": cfg.batch, "seq": cfg.seq, "prompt": cfg.prompt, "fill": cfg.fill,
               "runs": cfg.runs, "warmup": cfg.warmup, "ceiling_TFLOP/s": cfg.ceiling, "shapes": shapes,
               "complete": False}
    for shape in cfg.shapes:
        shapes.append(run_shape(shape, cfg, timer))
        write_json(cfg.out, payload)
    payload["complete"] = True
    write_json(cfg.out, payload)
    for s in shapes:
        print(f"-- {s['shape']} ({s['real_tokens']} real of {s['padded_tokens']} tokens)")
        print(table([{**r, "status": r.get("skipped") and "skipped" or r.get("error") and "error"} for r in s["results"]],
                    ["variant", "ms", "tokens/s", "TFLOP/s", "% ceiling", "speedup_vs_hf", "peak_GiB", "loss",
                     "loss_diff", "logprob_max_abs_diff", "status"]))
    print(f"wrote {cfg.out}")
    bad = [(s["shape"], r["variant"]) for s in shapes for r in s["results"] if r.get("loss_ok") is False]
    if bad:
        print(f"losses disagree with the reference beyond tolerance: {bad}", file=sys.stderr)
        return 1
    if cfg.smoke and any("error" in r for s in shapes for r in s["results"]):
        print("a variant failed in the smoke run", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
