"""Benchmark: the packed RL training step (forward + backward of a token-mean log-prob loss) against the matmul
ceiling measured in the same run, and against what a user would run instead on the same weights.

The batch (fixed seed): ``--batch`` rows of ``--seq`` tokens as an RL trainer hands them over: a prompt region of
``--prompt`` columns, left-padded, then a response region, right-padded, at about ``--fill`` real tokens overall.
The loss: ``-mean`` of the log-probs of the next token over the response tokens (the last prompt token predicts
the first response token), the same tokens and the same loss in every variant.

Variants (``--variants``, each optional; a variant that cannot run is recorded with its reason, the run goes on):

* ``packfwd_plain``: ``make_forward("thd", logits_processor=<log-probs>)`` on packfwd's model with Megatron-Core's
  plain modules (today's path).
* ``packfwd_fused``: the same with the model built with the fused layer switch (SwiGLU, THD RoPE, QK-norm
  kernels; ``packfwd.models.norm.FUSED_NORMS``), when this checkout has one (``from_hf(fused=)``,
  ``build_model(fused=)`` or ``ModelArgs.fused``); ``packfwd_fused_torch_norms`` / ``packfwd_fused_kernel_norms``:
  the fused model with every norm torch's ``rms_norm`` / packfwd's Triton RMSNorm (which norm wins where);
  ``packfwd_fused_cudnn``: the fused model with ``attention_backend="cudnn"`` (cuDNN's ragged attention through
  ``nvidia-cudnn-frontend``; skipped when that package is not importable); ``packfwd_fused_graph`` /
  ``packfwd_fused_cudnn_graph``: the same step captured once as a CUDA graph (``forward.plan(..., bucket=)`` of the
  batch's own size, ``plan=`` in the captured forward) and replayed: each timed step plans the batch on the host
  (no sync), copies the plan into the captured one (``copy_plan_``) and replays, so the device runs the step's
  kernels without waiting for Python's launches (CUDA only).
* ``packfwd_default``: what a user gets: ``from_hf``'s model (fused layers, the automatic attention) and
  ``run_micro_batches`` with its defaults, the batch planned as one micro-batch (``plan_micro_batches(lengths,
  max_tokens=<its real tokens>)``, planned in each timed step; each sequence's loss tokens passed from the host,
  ``loss_tokens=``, as the RL benchmark passes them): padded to its bucket where that pays (cuDNN's
  attention on bucket plans, ``forward.padded_steps``), else the plain step; the row's ``padded_steps`` and
  ``attention`` say which ran.  ``packfwd_micro_cudnn``: the same ``run_micro_batches`` call with ``buckets=False``
  on the fused model with ``attention_backend="cudnn"``: the plain cuDNN step through the micro-batch runner, so
  that ``packfwd_fused_cudnn`` -> ``packfwd_micro_cudnn`` -> ``packfwd_default`` splits the default row's cost into
  the runner's and the padding's.
* ``packfwd_compiled``: the plain model with each ``TransformerLayer`` compiled (regional ``torch.compile``,
  ``dynamic=True``; fullgraph, else with graph breaks), or where dynamo cannot trace the layer its MLP and norms
  (``--compile-scope``); every failure recorded.  Megatron-Core's row-parallel linears warn on every call (a graph
  break each): that one warning is silenced during this variant (``--compile-keep-warnings`` keeps it).
* ``hf_padded``: transformers' ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` (sdpa) on the padded batch, the weights
  packfwd's model was converted from; log-probs by ``packfwd.logits.log_probs`` on its ``[b * s, v]`` logits.
* ``hf_liger``: the same model with liger-kernel's RMSNorm, SwiGLU and RoPE patched in, and the log-probs from
  liger's fused linear cross-entropy (``reduction="none"``: per-token ``-log p``, no ``[b * s, v]`` logits).

Measured in one run: a bf16 8192^3 matmul (CUDA events, median; at the start and the end, the higher one is the
ceiling), per variant the median step time over ``--runs`` after ``--warmup`` (CUDA events around the whole step,
from an idle device), real tokens/s, model TFLOP/s (``bench_forward``'s count on the real tokens: linear layers
``6 * P_linear * tokens`` plus causal attention, x3 for forward + backward), % of the ceiling, peak memory, the
loss and gradient norm against ``hf_padded`` (bf16 tolerance: the run fails when the losses disagree).

On the GPU also ``ms_back_to_back``: two steps queued back to back (gradients accumulating, as micro-batches
do), the device's time per step once the host runs ahead of it.

``--profile``: one more step per variant under ``torch.profiler``; kernel time by category (gemm, attention,
norm, elementwise, copy, other) with the top kernels of each; on the GPU the step's timeline (``device_timeline``:
the time before the first kernel, the device's idle gaps by length and by the host thread then working, the
longest gaps with the host op and Python frames they waited on).  ``--host-profile``: five more steps per variant
under cProfile, the host's time per step by Python function (own and cumulative, the top 30 of each).
``--attention-bench``: ``varlen_attn`` forward and
forward + backward on the step's packed shapes against torch's SDPA backends (cuDNN first) on a nested jagged
tensor.

    PYTHONPATH=. python benchmarks/bench_step.py --out benchmarks/out/step.json --profile --attention-bench
    python benchmarks/bench_step.py --smoke --out /tmp/step_smoke.json       # tiny models on the CPU (CI)

On an H200 (estimated, not yet run): about 20 s of imports, then per shape a few seconds to build each model,
~11 steps per variant (0.2-1 s each), and for ``packfwd_compiled`` the compilation (two graphs per shape, forward
and backward: tens of seconds); about 4-5 minutes for both shapes and all variants.  ``hf_liger`` needs
liger-kernel importable (``pip install --no-deps --target /tmp/site liger_kernel-0.8.5-py3-none-any.whl`` and
``PYTHONPATH=.:/tmp/site``); without it the variant is recorded as skipped.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import inspect
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))
from bench_forward import Timer, forward_flops, linear_params, matmul_tflops  # noqa: E402
from common import device_ms, environment, graph_replay, table, write_json  # noqa: E402

from packfwd.forward import make_forward  # noqa: E402
from packfwd.logits import log_probs, vocab_parallel  # noqa: E402

VARIANTS = ("packfwd_plain", "packfwd_fused", "packfwd_compiled", "hf_padded", "hf_liger",
            "packfwd_fused_torch_norms", "packfwd_fused_kernel_norms", "packfwd_fused_cudnn", "packfwd_fused_graph",
            "packfwd_fused_cudnn_graph", "packfwd_default", "packfwd_micro_cudnn")
# the fused model with every norm torch's rms_norm / packfwd's Triton kernels (packfwd.models.norm.FUSED_NORMS)
NORM_VARIANTS = {"packfwd_fused_torch_norms": "torch", "packfwd_fused_kernel_norms": "kernel"}
SHAPES = {  # transformers config fields: the full shapes, and tiny ones for --smoke
    "llama1b": ("llama", dict(hidden_size=2048, intermediate_size=7168, num_hidden_layers=16, num_attention_heads=16,
                              num_key_value_heads=8, vocab_size=32000, max_position_embeddings=8192,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "qwen3_1p7b": ("qwen3", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                                 max_position_embeddings=40960,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}
SMOKE_SHAPES = {
    "llama1b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=128),
    "qwen3_1p7b": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, vocab_size=160),
}
CATEGORIES = ("gemm", "attention", "norm", "elementwise", "copy", "other")


class Skip(Exception):
    """A variant that cannot run here: recorded with its reason, the run goes on."""


# ------------------------------------------------------------------------------------------------ the batch


def rl_batch(b: int, s: int, prompt: int, fill: float, vocab: int, seed: int, device):
    """Left-padded prompts in columns ``[0, prompt)``, right-padded responses after them, ~``fill`` real overall."""
    rng = np.random.default_rng(seed)
    p_len = rng.integers(max(1, prompt // 8), prompt + 1, size=b)
    r_draw = rng.integers(1, s - prompt + 1, size=b).astype(np.float64)
    want = max(b, round(fill * b * s) - int(p_len.sum()))
    r_len = np.clip(np.round(r_draw * want / r_draw.sum()), 1, s - prompt).astype(np.int64)
    col = torch.arange(s, device=device)[None, :]
    p_t, r_t = (torch.tensor(x, device=device)[:, None] for x in (p_len, r_len))
    mask = (col >= prompt - p_t) & (col < prompt + r_t)
    response = (col >= prompt) & mask
    ids = torch.randint(1, vocab, (b, s), generator=torch.Generator(device="cpu").manual_seed(seed)).to(device)
    ids = ids * mask
    loss_mask = torch.zeros_like(mask)
    loss_mask[:, :-1] = response[:, 1:]  # token i is scored on predicting token i + 1, a response token
    labels = torch.where(loss_mask, torch.roll(ids, -1, dims=1), -100)
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)
    lengths = (p_len + r_len).tolist()
    return dict(ids=ids, mask=mask, labels=labels, positions=positions, lengths=lengths,
                n_loss=int(loss_mask.sum()), prompt_lengths=p_len.tolist(), response_lengths=r_len.tolist())


# ------------------------------------------------------------------------------------------------ the models


def hf_model(shape: str, smoke: bool, device, dtype):
    """The transformers model every variant's weights come from (random init, seeded)."""
    import transformers

    family, fields = SHAPES[shape]
    if smoke:
        fields = {**SMOKE_SHAPES[shape], **({"tie_word_embeddings": True} if family == "qwen3" else {})}
    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
    config = config_cls(**fields, rms_norm_eps=1e-6, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(config)
    return model.to(dtype).train()


def fused_switch() -> str | None:
    """Where this checkout takes the fused-layer switch: 'from_hf', 'build_model', 'args', or None (absent)."""
    from packfwd.models import ModelArgs, build_model, from_hf

    if "fused" in inspect.signature(from_hf).parameters:
        return "from_hf"
    if "fused" in inspect.signature(build_model).parameters:
        return "build_model"
    if "fused" in {f.name for f in dataclasses.fields(ModelArgs)}:
        return "args"
    return None


def packfwd_model(hf, device, dtype, fused: bool, attention_backend: str | None = None):
    """packfwd's model with ``hf``'s weights; ``fused`` picks the layer (explicitly wherever the switch exists)."""
    if attention_backend is not None:
        from packfwd.models import from_hf
        from packfwd.models.mixers.varlen import available_backends

        if attention_backend not in available_backends(device):
            raise Skip(f"attention_backend={attention_backend!r} is not available here: {available_backends(device)}")
        return from_hf(hf, device=device, params_dtype=dtype, fused=fused, attention_backend=attention_backend)
    from packfwd.models import build_model, from_hf
    from packfwd.models.convert.hf import args_from_hf_config, load_weights
    from packfwd.models.convert.hf_weights import hf_to_megatron

    how = fused_switch()
    if how is None:
        if fused:
            raise Skip("this checkout has no fused-layer switch (looked for from_hf(fused=), build_model(fused=) "
                       "and ModelArgs.fused); rerun with packfwd_fused once it lands")
        return from_hf(hf, device=device, params_dtype=dtype)
    if how == "from_hf":
        return from_hf(hf, device=device, params_dtype=dtype, fused=fused)
    args = args_from_hf_config(hf.config)
    kwargs = {}
    if how == "args":
        args = dataclasses.replace(args, fused=fused)
    else:
        kwargs["fused"] = fused
    model = build_model(args, device=device, params_dtype=dtype, init=False, **kwargs)
    return load_weights(model, hf_to_megatron(hf.state_dict(), args, layers=range(args.num_layers)))


def layer_modules(model) -> dict:
    """The classes the first decoder layer is built from (which norm, activation and RoPE a variant really ran)."""
    layer = model.decoder.layers[0]
    out = {name: type(m).__name__ for name, m in layer.named_modules() if name and "." not in name.replace(
        "self_attention.", "").replace("mlp.", "")}
    rope = getattr(layer.self_attention.core_attention, "rope", None)
    if rope is not None:
        out["core_attention.rope"] = f"{type(rope).__name__}(fused={getattr(rope, 'fused', None)})"
    return out


def compile_regions(model, scope: str, fullgraph: bool) -> int:
    """Compile each decoder layer ('layer') or its MLP and norms ('mlp_norm') in place, dynamic shapes; how many."""
    mods = []
    for layer in model.decoder.layers:
        if scope == "layer":
            mods.append(layer)
            continue
        attn = layer.self_attention
        mods += [m for m in (layer.mlp, layer.input_layernorm, layer.pre_mlp_layernorm,
                             getattr(attn, "q_layernorm", None), getattr(attn, "k_layernorm", None))
                 if m is not None and type(m).__name__ != "IdentityOp"]
    for m in mods:
        m.compile(dynamic=True, fullgraph=fullgraph)
    return len(mods)


class quiet_megatron_warnings:
    """Megatron-Core's row-parallel linear passes ``tp_group=None`` on every call, and the helper it calls warns
    (``warnings.warn`` with a category: a dynamo graph break in every linear).  Inside this block, that helper's
    module sees a ``warnings`` whose ``warn`` does nothing (what it returns is unchanged); restored on exit."""

    def __enter__(self):
        import megatron.core.utils as mcu

        self.module, self.saved = mcu, getattr(mcu, "warnings", None)
        if self.saved is not warnings:
            return "megatron.core.utils does not use the warnings module here: nothing changed"
        mcu.warnings = type("SilentWarnings", (), {"warn": staticmethod(lambda *a, **k: None),
                                                   "__getattr__": lambda self, n: getattr(warnings, n)})()
        return "megatron.core.utils' warnings.warn silenced during this variant (its tp_group deprecation warning)"

    def __exit__(self, *exc):
        if self.saved is not None:
            self.module.warnings = self.saved


def compiled_variant(hf, batch, cfg, timer, row) -> tuple[object, object]:
    """``packfwd_compiled``: the first attempt that runs a step (--compile-scope auto: the layer fullgraph, the
    layer with graph breaks, its MLP and norms), each on a fresh plain model; every failure recorded."""
    from torch._dynamo.utils import counters

    attempts = {"auto": [("layer", True), ("layer", False), ("mlp_norm", False)],
                "layer": [("layer", True), ("layer", False)], "mlp_norm": [("mlp_norm", False)]}[cfg.compile_scope]
    info = row["compile"] = {"dynamic": True, "errors": []}
    torch._dynamo.config.cache_size_limit = max(64, 2 * hf.config.num_hidden_layers)
    for scope, fullgraph in attempts:
        torch._dynamo.reset()
        counters.clear()
        module = packfwd_model(hf, cfg.device, cfg.dtype, fused=False)
        step = packfwd_step(module, batch)
        info.update(scope=scope, fullgraph=fullgraph, modules=compile_regions(module, scope, fullgraph))
        try:
            row.update(measure(step, module, cfg, timer))
        except Exception as e:  # noqa: BLE001 - dynamo's errors are recorded, the next attempt runs
            info["errors"].append({"scope": scope, "fullgraph": fullgraph, "error": f"{type(e).__name__}: {e}"[:2000]})
            del module, step
            continue
        info["graph_breaks"] = sum(counters["graph_break"].values())
        info["graph_break_reasons"] = {k[:300]: v for k, v in counters["graph_break"].most_common(12)}
        info["unique_graphs"] = counters["stats"].get("unique_graphs")
        return module, step
    raise Skip(f"torch.compile failed in every attempt: {info['errors']}")


# ------------------------------------------------------------------------------------------------ the steps


@vocab_parallel
def next_token_log_probs(logits, labels, tp_group=None):
    return {"log_probs": log_probs(logits, labels, tp_group=tp_group)}


def packfwd_step(model, batch, forward=None, plan=None):
    """One step: the forward (planning the batch inside the call, or packing with ``plan``), the loss, its backward."""
    forward = forward or make_forward("thd", logits_processor=next_token_log_probs)
    packing = dict(plan=plan) if plan is not None else dict(attention_mask=batch["mask"], seqlens=batch["lengths"])

    def step():
        lp = forward(model, batch["ids"], labels=batch["labels"], **packing)["log_probs"]
        loss = -lp.sum() / batch["n_loss"]
        loss.backward()
        return loss.detach(), lp.detach()

    return step


def graphed_step(model, batch, warmup: int = 2):
    """``packfwd_step`` captured as one CUDA graph (forward + backward) with a bucket plan of the batch's size;
    the returned step plans the batch, copies the plan into the captured one and replays."""
    from packfwd.layout.bucket import Bucket

    forward = make_forward("thd", logits_processor=next_token_log_probs)
    bucket = Bucket(tokens=sum(batch["lengths"]), max_seqlen=max(batch["lengths"]))

    def plan():
        return forward.plan(batch["ids"], batch["mask"], seqlens=batch["lengths"], bucket=bucket)

    captured = plan()
    body = packfwd_step(model, batch, forward, captured)
    return graph_replay(body, model, captured, plan, warmup)


def default_step(model, batch, **run_args):
    """``run_micro_batches`` with its defaults (and ``run_args``) on the batch as one micro-batch (module
    docstring)."""
    from packfwd.micro import plan_micro_batches, run_micro_batches

    forward = make_forward("thd", logits_processor=next_token_log_probs)
    loss_mask = batch["labels"] >= 0
    counts = loss_mask.sum(1).tolist()  # each sequence's loss tokens on the host, as a trainer has them: no sync

    def step():
        plan = plan_micro_batches(batch["lengths"], max_tokens=sum(batch["lengths"]))
        res = run_micro_batches(forward, model, plan, batch["ids"], batch["mask"], dp_rank=0, labels=batch["labels"],
                                loss_fn=lambda o: -o["log_probs"], loss_mask=loss_mask, loss_tokens=counts,
                                **run_args)
        return res.loss, res.outputs["log_probs"]

    step.forward = forward
    return step


def hf_step(hf, batch):
    def step():
        logits = hf(input_ids=batch["ids"], attention_mask=batch["mask"], position_ids=batch["positions"]).logits
        lp = log_probs(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1)).view(logits.shape[:2])
        loss = -lp.sum() / batch["n_loss"]
        loss.backward()
        return loss.detach(), lp.detach()

    return step


def liger_step(hf, batch, family: str):
    """liger-kernel's RMSNorm / SwiGLU / RoPE patched into ``hf`` (in place, and into transformers' module: run it
    after hf_padded), per-token ``-log p`` from its fused linear cross-entropy on the final hidden states."""
    if hf.lm_head.weight.device.type != "cuda":
        raise Skip("liger-kernel's kernels are Triton kernels for CUDA; not run on the CPU")
    try:
        import liger_kernel.transformers as liger
    except Exception as e:  # noqa: BLE001 - any import failure is the reason recorded
        raise Skip(f"import liger_kernel failed: {type(e).__name__}: {e}") from e
    patch = {"llama": liger.apply_liger_kernel_to_llama, "qwen3": liger.apply_liger_kernel_to_qwen3}[family]
    patch(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False, model=hf)
    flce = liger.LigerFusedLinearCrossEntropyLoss(reduction="none", ignore_index=-100)

    def step():
        hidden = hf.model(input_ids=batch["ids"], attention_mask=batch["mask"],
                          position_ids=batch["positions"]).last_hidden_state
        nll = flce(hf.lm_head.weight, hidden.reshape(-1, hidden.shape[-1]), batch["labels"].reshape(-1))
        nll = nll[0] if isinstance(nll, tuple) else getattr(nll, "loss", nll)
        loss = nll.float().sum() / batch["n_loss"]
        loss.backward()
        return loss.detach(), (-nll.float()).detach().view(batch["ids"].shape)

    return step


# ------------------------------------------------------------------------------------------------ measuring


def grad_norm(module) -> float:
    sq = [p.grad.float().pow(2).sum() for p in module.parameters() if p.grad is not None]
    return float(torch.stack(sq).sum().sqrt()) if sq else 0.0


def measure(step, module, cfg, timer) -> dict:
    """Warm-up (the first step's wall time recorded: compilation), then ``cfg.runs`` timed steps."""
    t0 = time.perf_counter()
    loss, lp = step()
    first_s = time.perf_counter() - t0
    norm = grad_norm(module)
    module.zero_grad(set_to_none=True)
    for _ in range(cfg.warmup - 1):
        step()
        module.zero_grad(set_to_none=True)
    cuda = cfg.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(cfg.runs):
        times.append(timer(step))
        module.zero_grad(set_to_none=True)
    out = {"ms": statistics.median(times), "ms_runs": times, "first_step_s": first_s, "loss": float(loss),
           "grad_norm": norm, "_lp": lp}
    if cuda:  # two steps queued back to back (gradients accumulating, as micro-batches do): the device's time per
        #       step once the host runs ahead, without the first launches' latency from an idle device
        pairs = []
        for _ in range(max(2, cfg.runs // 2)):
            pairs.append(device_ms(step, cfg.device, back_to_back=2))
            module.zero_grad(set_to_none=True)
        out["ms_back_to_back"] = statistics.median(pairs)
        out["ms_back_to_back_runs"] = pairs
    if cuda:
        out["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
        out["peak_above_start_GiB"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return out


def kernel_category(name: str) -> str:
    """The profile category of a kernel (or, on the CPU, an aten op) name; first match wins."""
    n = name.lower()
    if any(k in n for k in ("flash", "fmha", "varlen", "attention", "sdpa")):
        return "attention"
    if any(k in n for k in ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm")):
        return "gemm"
    if "rms" in n or "norm" in n:
        return "norm"
    if not n.startswith("triton_") and any(k in n for k in ("copy", "catarray", "cat_", "index", "gather", "scatter",
                                                              "memcpy", "memset", "aten::cat")):
        return "copy"
    if any(k in n for k in ("elementwise", "vectorized", "unrolled", "triton_", "silu", "swiglu", "rope", "mul",
                            "add", "neg", "aten::")):
        return "elementwise"
    return "other"


STEP_RANGE = "bench_step::step"


def host_profile(step, module, device, steps: int = 5, top: int = 30) -> dict:
    """``steps`` steps under cProfile, the device synchronised after each outside the profile (the wait for the
    device is in ``wall_ms_per_step``, not in the functions' times; cProfile slows the host, so compare rows with
    each other, not with the timed steps): the host's milliseconds per step in total and per function, the ``top`` functions by their own time and by their
    cumulative time (packfwd's, Megatron-Core's, torch's and cuDNN-frontend's Python): where a step's host time
    goes, which the device timeline only shows as gaps.  A sync inside the step shows as the time of the call that
    made it (a ``.item()``, a blocking copy)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    for _ in range(steps):
        prof.enable()
        step()
        prof.disable()
        if device.type == "cuda":
            torch.cuda.synchronize()
        module.zero_grad(set_to_none=True)
    wall = (time.perf_counter() - t0) / steps * 1e3
    stats = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}

    def rows(key):
        ranked = sorted(stats.items(), key=lambda kv: kv[1][key], reverse=True)[:top]
        return [{"function": f"{Path(f).name}:{line}({name})" if f != "~" else name, "calls": nc / steps,
                 "own_ms": own / steps * 1e3, "cumulative_ms": cum / steps * 1e3}
                for (f, line, name), (_, nc, own, cum, _) in ranked]

    total = sum(v[2] for v in stats.values()) / steps * 1e3
    return {"steps": steps, "wall_ms_per_step": wall, "profiled_ms_per_step": total,
            "calls_per_step": sum(v[1] for v in stats.values()) / steps, "by_own": rows(2), "by_cumulative": rows(3)}


def profile_step(step, module, device) -> dict:
    """One step under torch.profiler: device (CPU: self host) time per category, ms and %, top kernels of each;
    on CUDA also the step's timeline (:func:`device_timeline`: when the device had no kernel to run, and what the
    host was doing then), from a second profiled step with Python stacks recorded for the attribution."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        with record_function(STEP_RANGE):
            step()
        if cuda:
            torch.cuda.synchronize()
    module.zero_grad(set_to_none=True)
    by_name = {}  # name -> [ms, calls]: device-side events only on CUDA (kernels, memcpy, memset: no double count
    #              through the host events that launched them); self host time of each op on the CPU
    if cuda:
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA and e.name != STEP_RANGE:  # not the range's
                #  device-side annotation (spans kernels, is none)
                acc = by_name.setdefault(e.name, [0.0, 0])
                acc[0] += e.time_range.elapsed_us() / 1e3
                acc[1] += 1
    else:
        by_name = {e.key: [e.self_cpu_time_total / 1e3, e.count] for e in prof.key_averages()}
    per = {c: 0.0 for c in CATEGORIES}
    kernels = {c: [] for c in CATEGORIES}
    for key, (ms, n) in by_name.items():
        c = kernel_category(key)
        per[c] += ms
        kernels[c].append((ms, n, key[:160]))
    total = sum(per.values())
    out = {"total_ms": total, "source": "device kernels" if cuda else "host ops (CPU run)",
           "categories": {c: {"ms": per[c], "%": 100 * per[c] / total if total else 0.0} for c in CATEGORIES},
           "top": {c: [{"ms": ms, "calls": n, "name": k} for ms, n, k in sorted(kernels[c], reverse=True)[:8]]
                   for c in CATEGORIES}}
    if cuda:
        try:
            out["timeline"] = device_timeline(prof.events())
            with profile(activities=activities, with_stack=True) as prof:
                with record_function(STEP_RANGE):
                    step()
                torch.cuda.synchronize()
            module.zero_grad(set_to_none=True)
            out["timeline_with_stacks"] = device_timeline(prof.events(), stacks=True)
        except Exception as e:  # noqa: BLE001 - the categories above stand without it
            out["timeline_error"] = f"{type(e).__name__}: {e}"[:1000]
    return out


def device_timeline(events, *, stacks: bool = False, top: int = 12) -> dict:
    """Where a profiled step's device was idle: from the host entering the step (``STEP_RANGE``) to its last kernel,
    the time before the first kernel (``lead_in_ms``), the time with kernels running (``busy_ms``, overlapping
    kernels merged) and the gaps between them (``idle_ms``; counted by length), the idle time split by the host
    thread working at each gap's end (the caller's thread: forward; autograd's: backward), and the ``top`` longest
    gaps with the innermost host op running when the kernel after the gap started (and, with ``stacks``, its
    packfwd / Megatron-Core / torch Python frames, or its nearest caller's, and the top-level ops its thread began
    during the gap): what the device waited for; and the CUDA runtime's allocations, frees, pinned allocations,
    synchronising calls and copies in the step (``runtime_calls``: count, host ms)."""
    cpu_t, cuda_t = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    span = [e for e in events if e.name == STEP_RANGE and e.device_type == cpu_t]
    if not span:
        raise RuntimeError(f"no {STEP_RANGE!r} range in the profile")
    t0 = span[0].time_range.start
    main_thread = span[0].thread
    k = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
               if e.device_type == cuda_t and e.name != STEP_RANGE and e.time_range.end > t0)
    if not k:
        raise RuntimeError("no device kernel after the step began")
    host = sorted(((e.time_range.start, e.time_range.end, e) for e in events
                   if e.device_type == cpu_t and e.name != STEP_RANGE and not e.name.startswith(("cuda", "cu"))),
                  key=lambda x: x[0])
    gaps, busy = [], 0.0
    cur_s, cur_e = k[0][0], k[0][1]
    for s, e, name in k[1:]:
        if s > cur_e:
            gaps.append((cur_e, s, name))
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s

    starts = [s for s, _, _ in host]

    def innermost(t):  # the latest-starting host op still running at t (nested ops: the innermost)
        i = bisect.bisect_right(starts, t) - 1
        for j in range(i, max(-1, i - 20000), -1):
            if host[j][1] >= t:
                return host[j][2]
        return None

    sizes = {"<10us": 0.0, "10-50us": 0.0, "50-200us": 0.0, ">200us": 0.0}
    by_thread = {"forward (caller's thread)": 0.0, "backward (autograd thread)": 0.0, "no host op": 0.0}
    longest = sorted(gaps, key=lambda g: g[0] - g[1])[:top]
    for g0, g1, _ in gaps:
        d = g1 - g0
        sizes["<10us" if d < 10 else "10-50us" if d < 50 else "50-200us" if d < 200 else ">200us"] += d / 1e3
    rows = []
    for g0, g1, name in gaps:
        op = innermost(g1)
        key = "no host op" if op is None else (
            "forward (caller's thread)" if op.thread == main_thread else "backward (autograd thread)")
        by_thread[key] += (g1 - g0) / 1e3
    def frames(op):  # the Python frames of op or of its nearest ancestor that has them (nested aten ops have none)
        while op is not None and not op.stack:
            op = op.cpu_parent
        return [f for f in (op.stack if op is not None else []) or []
                if any(w in f for w in ("packfwd", "megatron", "bench_step", "torch/autograd", "torch/nn"))][:8]

    for g0, g1, name in longest:
        op = innermost(g1)
        row = {"at_ms": (g0 - t0) / 1e3, "us": g1 - g0, "next_kernel": name[:120],
               "host_op": None if op is None else op.name[:120],
               "host_thread": None if op is None else ("caller" if op.thread == main_thread else "autograd")}
        if stacks and op is not None:
            row["stack"] = frames(op)
            # what the host did while the device waited: the top-level ops of that thread begun inside the gap
            during = [h for s, _, h in host[bisect.bisect_left(starts, g0):bisect.bisect_left(starts, g1)]
                      if h.thread == op.thread and (h.cpu_parent is None or h.cpu_parent.name == STEP_RANGE)]
            row["host_ops_during"] = [{"op": h.name[:80], "us": h.time_range.end - h.time_range.start,
                                       "frames": frames(h)[:3]} for h in during[:6]]
        rows.append(row)
    # the CUDA runtime's own calls in the step: an allocation (cudaMalloc / cudaFree: the caching allocator missed),
    # a pinned host allocation, a synchronising call; each stalls the host, and a free or sync the device too
    runtime = {}
    for e in events:
        if (e.device_type == cpu_t and e.name.startswith("cuda") and e.time_range.start >= t0
                and any(w in e.name for w in ("Malloc", "Free", "HostAlloc", "Synchronize", "Memcpy"))):
            acc = runtime.setdefault(e.name, [0, 0.0])
            acc[0] += 1
            acc[1] += (e.time_range.end - e.time_range.start) / 1e3
    end = max(e for _, e, _ in k)
    return {"host_step_ms": (span[0].time_range.end - t0) / 1e3, "device_span_ms": (end - t0) / 1e3,
            "lead_in_ms": (k[0][0] - t0) / 1e3, "busy_ms": busy / 1e3, "idle_ms": sum(b - a for a, b, _ in gaps) / 1e3,
            "gaps": len(gaps), "idle_ms_by_gap_length": sizes, "idle_ms_by_host_thread": by_thread,
            "longest_gaps": rows, "kernels": len(k), "with_stacks": stacks,
            "runtime_calls": {n: {"calls": c, "host_ms": ms} for n, (c, ms) in sorted(runtime.items())}}


@contextlib.contextmanager
def deterministic_algorithms():
    """torch's deterministic mode for the block (the flash and cuDNN backwards read it when they run)."""
    from packfwd.forward.deterministic import enabled

    with enabled(batch_invariant=False):  # warn_only=True would leave the flash backward atomic (it only warns)
        yield


def attention_bench(args, batch, device, dtype, timer, runs: int) -> dict:
    """``varlen_attn`` (causal, GQA) vs torch's SDPA backends on a nested jagged tensor, one layer's shapes."""
    if device.type != "cuda":
        return {"skipped": "attention kernels are CUDA-only"}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from packfwd.models.mixers.varlen import available_backends, varlen_attention

    lengths = batch["lengths"]
    t, hq, hkv, d = sum(lengths), args.num_attention_heads, args.query_groups, args.kv_channels
    cu = torch.tensor([0, *np.cumsum(lengths)], device=device, dtype=torch.int32)
    q = torch.randn(t, hq, d, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(t, hkv, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    g = torch.randn(t, hq, d, device=device, dtype=dtype)
    fwd_flops = 4.0 * hq * d * sum(n * n for n in lengths) / 2
    out = {"tokens": t, "heads": [hq, hkv], "head_dim": d, "lengths": lengths, "rows": []}

    ref = []

    def time_it(name, fn):
        row = {"impl": name}
        try:  # the same numbers as varlen_attn (the first one timed)?
            with torch.no_grad():
                o = fn().float()
            ref.append(o) if not ref else row.update(max_abs_diff_vs_varlen=float((o - ref[0]).abs().max()))
        except Exception:  # noqa: BLE001 - the timing below records the error
            pass
        for pass_, mult in (("fwd", 1), ("fwd+bwd", 3.5)):  # flash-attention's convention: bwd = 2.5 x fwd
            def run():
                if pass_ == "fwd":
                    with torch.no_grad():
                        fn()
                else:
                    fn().backward(g)
            try:
                t0 = time.perf_counter()
                run()
                torch.cuda.synchronize()
                row[f"{pass_}_first_call_s"] = time.perf_counter() - t0  # cuDNN builds its graphs here
                ms = statistics.median(timer(run) for _ in range(runs))
                row[f"{pass_}_ms"], row[f"{pass_}_TFLOP/s"] = ms, mult * fwd_flops / (ms * 1e-3) / 1e12
            except Exception as e:  # noqa: BLE001 - record why a backend cannot run these shapes
                row[f"{pass_}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        out["rows"].append(row)

    time_it("varlen_attn", lambda: varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), backend="torch_varlen"))
    if "cudnn" in available_backends(device):
        time_it("packfwd cudnn backend (nvidia-cudnn-frontend, ragged offsets, GQA)",
                lambda: varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), backend="cudnn"))
        with deterministic_algorithms():
            time_it("packfwd cudnn backend, deterministic backward",
                    lambda: varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), backend="cudnn"))
    with deterministic_algorithms():
        time_it("varlen_attn, deterministic backward",
                lambda: varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), backend="torch_varlen"))
    offsets = cu.long()

    def njt(x):  # [t, h, d] -> nested [n, h, j, d]
        return torch.nested.nested_tensor_from_jagged(x, offsets).transpose(1, 2)

    def cudnn_ragged(kk, vv):  # what the nested path calls for cuDNN: [t, h, d] with cu_seqlens (ragged offsets)
        return torch.ops.aten._cudnn_attention_forward(q, kk, vv, None, cu, cu, max(lengths), max(lengths), True,
                                                       0.0, True, False)[0]

    rep = hq // hkv  # k and v repeated to hq heads once, outside the timing, for the paths without GQA
    kk, vv = (x.detach().repeat_interleave(rep, dim=1).requires_grad_() for x in (k, v))
    time_it("cudnn ragged (aten._cudnn_attention_forward, GQA)", lambda: cudnn_ragged(k, v))
    time_it("cudnn ragged (aten._cudnn_attention_forward, kv repeated)", lambda: cudnn_ragged(kk, vv))
    for backend, gqa in ((SDPBackend.CUDNN_ATTENTION, True), (SDPBackend.CUDNN_ATTENTION, False),
                         (SDPBackend.FLASH_ATTENTION, False), (SDPBackend.EFFICIENT_ATTENTION, False)):
        def call(backend=backend, gqa=gqa):
            with sdpa_kernel([backend]):
                o = torch.nn.functional.scaled_dot_product_attention(
                    njt(q), njt(k if gqa else kk), njt(v if gqa else vv), is_causal=True, enable_gqa=gqa)
            return o.transpose(1, 2).values()
        time_it(f"sdpa nested {backend.name} ({'enable_gqa' if gqa else 'kv repeated'})", call)
    return out


# ------------------------------------------------------------------------------------------------ main


def run_variant(name, hf, family, batch, cfg, timer) -> tuple[dict, object]:
    """One variant: its result row (or Skip with the reason it cannot run) and the module it trained."""
    row = {"variant": name}
    if name == "packfwd_compiled":
        if cfg.device.type != "cuda" and not cfg.compile_on_cpu:
            raise Skip("torch.compile is not run on the CPU smoke (slow C++ builds); pass --compile-on-cpu")
        with quiet_megatron_warnings() if cfg.quiet_megatron else contextlib.nullcontext("kept") as note:
            row["megatron_warning"] = note
            module, step = compiled_variant(hf, batch, cfg, timer, row)
            if cfg.profile:
                row["profile"] = profile_step(step, module, cfg.device)
            if cfg.host_profile:
                row["host_profile"] = host_profile(step, module, cfg.device)
        return row, module
    if name.startswith("packfwd"):
        from packfwd.models import norm

        kept = dict(norm.FUSED_NORMS)
        if name in NORM_VARIANTS:
            norm.FUSED_NORMS.update(dict.fromkeys(norm.FUSED_NORMS, NORM_VARIANTS[name]))
        try:
            fused = name.startswith(("packfwd_fused", "packfwd_default", "packfwd_micro"))
            module = packfwd_model(hf, cfg.device, cfg.dtype, fused=fused,
                                   attention_backend="cudnn" if "_cudnn" in name else None)
        finally:
            norm.FUSED_NORMS.update(kept)
        row["norms"] = {type(m).__name__ for m in module.modules() if "RMSNorm" in type(m).__name__}
        row["norms"] = sorted(row["norms"])
        if name.endswith("_graph"):
            if cfg.device.type != "cuda":
                raise Skip("CUDA graphs need a CUDA device")
            step = graphed_step(module, batch)
        elif name == "packfwd_default":
            step = default_step(module, batch)
        elif name == "packfwd_micro_cudnn":
            step = default_step(module, batch, buckets=False)
        else:
            step = packfwd_step(module, batch)
        row["fused_switch"] = fused_switch()
        row["layer_modules"] = layer_modules(module)
    else:
        module = hf
        step = hf_step(hf, batch) if name == "hf_padded" else liger_step(hf, batch, family)
    row.update(measure(step, module, cfg, timer))
    if cfg.profile:
        row["profile"] = profile_step(step, module, cfg.device)
    if cfg.host_profile:
        row["host_profile"] = host_profile(step, module, cfg.device)
    if name in ("packfwd_default", "packfwd_micro_cudnn"):
        row["attention"] = step.forward.attention_backend(module)
        padded = getattr(step.forward, "padded_steps", None)
        row["padded_steps"] = None if padded is None else {
            k: getattr(padded, k) for k in ("captured", "replayed", "eager", "reason")}
    return row, module


def run_shape(shape, cfg, timer) -> dict:
    from packfwd.models.convert.hf import args_from_hf_config

    family = SHAPES[shape][0]
    hf = hf_model(shape, cfg.smoke, cfg.device, cfg.dtype)
    args = args_from_hf_config(hf.config)
    batch = rl_batch(cfg.batch, cfg.seq, cfg.prompt, cfg.fill, args.vocab_size, cfg.seed, cfg.device)
    real = sum(batch["lengths"])
    flops = 3.0 * forward_flops(args, batch["lengths"])
    print(f"== {shape}: {sum(p.numel() for p in hf.parameters()) / 1e9:.3f} B parameters, {cfg.batch} x {cfg.seq}, "
          f"{real} real tokens (fill {real / (cfg.batch * cfg.seq):.3f}), {batch['n_loss']} scored", flush=True)
    rows, lps = [], {}
    for name in cfg.variants:
        t0 = time.perf_counter()
        try:
            row, module = run_variant(name, hf, family, batch, cfg, timer)
        except Skip as e:
            row, module = {"variant": name, "skipped": str(e)}, None
        except Exception as e:  # noqa: BLE001 - one variant's failure must not end the run
            row, module = {"variant": name, "error": f"{type(e).__name__}: {e}"[:2000],
                           "traceback": traceback.format_exc()[-4000:]}, None
        if "ms" in row:
            lps[name] = row.pop("_lp")
            row.update({"tokens/s": real / row["ms"] * 1e3, "TFLOP/s": flops / (row["ms"] * 1e-3) / 1e12})
            if cfg.ceiling:
                row["% ceiling"] = 100 * row["TFLOP/s"] / cfg.ceiling
            if "ms_back_to_back" in row:
                row["TFLOP/s back-to-back"] = flops / (row["ms_back_to_back"] * 1e-3) / 1e12
                if cfg.ceiling:
                    row["% ceiling back-to-back"] = 100 * row["TFLOP/s back-to-back"] / cfg.ceiling
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print(f"  {name}: " + (f"{row['ms']:.1f} ms, {row['TFLOP/s']:.0f} TFLOP/s, loss {row['loss']:.5f}"
                               if "ms" in row else row.get("skipped") or row.get("error")), flush=True)
        if module is not None and module is not hf:
            del module
        if cfg.device.type == "cuda":
            torch.cuda.empty_cache()
    check(rows, lps, batch, cfg)
    result = {"shape": shape, "family": family, "hf_config": hf.config.to_dict(),
              "linear_parameters": linear_params(args), "parameters": sum(p.numel() for p in hf.parameters()),
              "real_tokens": real, "scored_tokens": batch["n_loss"], "fill": real / (cfg.batch * cfg.seq),
              "lengths": batch["lengths"], "prompt_lengths": batch["prompt_lengths"],
              "response_lengths": batch["response_lengths"], "step_TFLOP": flops / 1e12, "results": rows}
    if cfg.attention_bench:
        result["attention"] = attention_bench(args, batch, cfg.device, cfg.dtype, timer, max(3, cfg.runs))
    del hf
    return result


def check(rows, lps, batch, cfg) -> None:
    """Each variant's loss, gradient norm and per-token log-probs against hf_padded's (or packfwd_plain's, or
    packfwd_fused's); and its log-probs against packfwd_fused's (today's default path), where both ran."""
    scored = batch["labels"] >= 0
    if "packfwd_fused" in lps:
        for r in rows:
            if r["variant"] in lps:
                diff = (lps[r["variant"]].float() - lps["packfwd_fused"].float())[scored].abs()
                r["logprob_max_abs_diff_vs_fused"], r["logprob_mean_abs_diff_vs_fused"] = map(
                    float, (diff.max(), diff.mean()))
    ref_name = next((n for n in ("hf_padded", "packfwd_plain", "packfwd_fused") if n in lps), None)
    if ref_name is None:
        return
    ref = next(r for r in rows if r["variant"] == ref_name)
    for r in rows:
        if r["variant"] not in lps:
            continue
        diff = (lps[r["variant"]].float() - lps[ref_name].float())[scored].abs()
        r["vs"] = ref_name
        r["loss_diff"] = abs(r["loss"] - ref["loss"])
        r["grad_norm_rel_diff"] = abs(r["grad_norm"] - ref["grad_norm"]) / max(ref["grad_norm"], 1e-30)
        r["logprob_max_abs_diff"], r["logprob_mean_abs_diff"] = float(diff.max()), float(diff.mean())
        r["loss_ok"] = r["loss_diff"] <= cfg.loss_tol * max(1.0, abs(ref["loss"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU (CI): seconds")
    ap.add_argument("--out", type=Path, default=HERE / "out" / "step.json", help="JSON file to write")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--batch", type=int, default=None, help="rows (default 6; smoke 2)")
    ap.add_argument("--seq", type=int, default=None, help="padded width (default 4096; smoke 32)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt columns, left-padded (default 1024; smoke 8)")
    ap.add_argument("--fill", type=float, default=0.54, help="real tokens / (batch * seq)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=None, help="timed steps per variant (default 8; smoke 1)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first, >= 1 (default 2; smoke 1)")
    ap.add_argument("--compile-scope", choices=("auto", "layer", "mlp_norm"), default="auto",
                    help="packfwd_compiled: auto = the layer fullgraph, else with graph breaks, else its MLP and norms")
    ap.add_argument("--compile-keep-warnings", dest="quiet_megatron", action="store_false",
                    help="packfwd_compiled: leave Megatron-Core's per-call tp_group warning (a graph break per linear)")
    ap.add_argument("--compile-on-cpu", action="store_true", help="run packfwd_compiled on the CPU too")
    ap.add_argument("--profile", action="store_true", help="one profiled step per variant: time by kernel category")
    ap.add_argument("--host-profile", action="store_true",
                    help="five more steps per variant under cProfile: the host's time by Python function")
    ap.add_argument("--fp32", action="store_true",
                    help="float32 models on the GPU too (a correctness check of every variant against transformers "
                         "with bf16 rounding out of the way; packfwd's attention then runs its reference backend)")
    ap.add_argument("--attention-bench", action="store_true", help="varlen_attn vs SDPA on nested tensors")
    cfg = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not cfg.smoke
    cfg.device = torch.device("cuda" if cuda else "cpu")
    cfg.dtype = torch.float32 if not cuda or cfg.fp32 else torch.bfloat16
    cfg.batch = cfg.batch or (2 if cfg.smoke else 6)
    cfg.seq = cfg.seq or (32 if cfg.smoke else 4096)
    cfg.prompt = cfg.prompt if cfg.prompt is not None else (8 if cfg.smoke else 1024)
    cfg.runs = cfg.runs or (1 if cfg.smoke else 8)
    cfg.warmup = max(1, cfg.warmup if cfg.warmup is not None else (1 if cfg.smoke else 2))
    cfg.loss_tol = 1e-2 if cfg.dtype == torch.bfloat16 else 1e-4
    if not 0 < cfg.prompt < cfg.seq:
        ap.error(f"--prompt {cfg.prompt} must lie in (0, --seq {cfg.seq})")
    timer = Timer(cfg.device)
    ceilings = [matmul_tflops(cfg.device, torch.bfloat16, timer)]
    cfg.ceiling = ceilings[0]
    print(f"device {cfg.device} {cfg.dtype}; bf16 matmul: {cfg.ceiling and round(cfg.ceiling)} TFLOP/s; "
          f"fused switch: {fused_switch()}", flush=True)
    shapes = []
    payload = {"benchmark": "step", "smoke": cfg.smoke, "command": " ".join(sys.argv), "env": environment(),
               "dtype": str(cfg.dtype), "batch": cfg.batch, "seq": cfg.seq, "prompt": cfg.prompt, "fill": cfg.fill,
               "seed": cfg.seed, "runs": cfg.runs, "warmup": cfg.warmup, "fused_switch": fused_switch(),
               "matmul_TFLOP/s_start_end": ceilings, "ceiling_TFLOP/s": cfg.ceiling, "loss_tol": cfg.loss_tol,
               "shapes": shapes, "complete": False}
    for shape in cfg.shapes:
        shapes.append(run_shape(shape, cfg, timer))
        write_json(cfg.out, payload)  # after each shape: a run cut short by a time limit keeps what it measured
    ceilings.append(matmul_tflops(cfg.device, torch.bfloat16, timer))
    if cuda and ceilings[1] > ceilings[0]:  # the higher one is the ceiling: percentages never flatter
        for s in shapes:
            for r in s["results"]:
                if "TFLOP/s" in r:
                    r["% ceiling"] = 100 * r["TFLOP/s"] / ceilings[1]
                if "TFLOP/s back-to-back" in r:
                    r["% ceiling back-to-back"] = 100 * r["TFLOP/s back-to-back"] / ceilings[1]
    payload.update({"ceiling_TFLOP/s": max(filter(None, ceilings), default=None), "complete": True})
    write_json(cfg.out, payload)
    for s in shapes:
        print(f"-- {s['shape']} ({s['real_tokens']} real tokens, {s['step_TFLOP']:.1f} TFLOP per step)")
        print(table([{**r, "status": r.get("skipped") and "skipped" or r.get("error") and "error"} for r in s["results"]],
                    ["variant", "ms", "tokens/s", "TFLOP/s", "% ceiling", "ms_back_to_back", "% ceiling back-to-back", "peak_GiB", "loss", "loss_diff",
                     "grad_norm_rel_diff", "logprob_max_abs_diff", "status"]))
        if cfg.profile:
            prof = [{"variant": r["variant"], **{c: r["profile"]["categories"][c]["ms"] for c in CATEGORIES}}
                    for r in s["results"] if "profile" in r]
            print(table(prof, ["variant", *CATEGORIES]))
            for r in s["results"]:
                tl = r.get("profile", {}).get("timeline")
                if tl:
                    print(f"  {r['variant']} timeline: lead-in {tl['lead_in_ms']:.2f} ms, busy {tl['busy_ms']:.1f}, "
                          f"idle {tl['idle_ms']:.2f} in {tl['gaps']} gaps {tl['idle_ms_by_gap_length']}, by host "
                          f"thread {tl['idle_ms_by_host_thread']}")
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
