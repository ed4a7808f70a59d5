"""Benchmark: a whole RL step as a trainer runs it, on one GPU: a global batch planned into micro-batches and run
forward + backward, packfwd's default path against verl 0.9.1's dynamic batching and transformers' padded
micro-batches on the same weights, random, built locally (``--model``):

* ``llama1b`` (the default): a Llama of ~1B parameters (hidden 2048, 16 layers, ffn 7168, 16 query / 8 key-value
  heads, vocab 32000; bench_step's ``hf_model``);
* ``qwen3_moe``: bench_moe's Qwen3-MoE shape (``bench_moe.Shape``: hidden 2048, 64 experts top-8 normalised, expert
  ffn 768, 16 query / 4 key-value heads of 128, vocab 151936, untied, bf16), transformers' ``Qwen3MoeForCausalLM``
  with its own initialisation and packfwd's model converted from it (``bench_moe.build``, ``from_hf``); packfwd's
  experts on its default path (``torch._grouped_mm`` on sm90 / sm100 in bf16; the CPU smoke forces the grouped
  path, as bench_moe's does).  Layers: ``--layers``, else by the card's free memory (``moe_layers_for``): 12 where
  the estimate below fits 80 % of it (an H200), 8 where that does (an 80 GB H100), else 4 or 2.  The estimate, for
  the largest micro-batch ``T`` (``max(--max-tokens, s)`` tokens): ``8 P`` bytes for ``P`` parameters (the two
  models' bf16 weights, the gradients, and the CUDA graphs' own set of gradients) plus ``T (735 KiB + 176 KiB per
  layer)``, transformers' padded step (the row that needs most per token): 176 KiB a token and layer measured at
  the full width on the CPU (torch.profiler's memory timeline of a second fwd+bwd step on 2 x 256 tokens: a peak of
  1,809 / 1,985 / 2,161 KiB a token above the weights and gradients with 1 / 2 / 3 layers), the 735 KiB the rest of
  bench_moe's measured 12-layer row (66.7 GiB above the weights for 6 x 4096 tokens on an H200, 2,845 KiB a token,
  less 12 x 176 KiB: the output layer and the loss); packfwd's rows took less per token there (26.6 GiB for 13,422
  real tokens, gradients included).  It errs high: transformers' row holds no graphs' gradients, packfwd's rows
  hold fewer activations.  For the defaults (``T`` = 16,384): 12 layers 77 GiB, 8 layers 57 GiB, so 12 on an H200
  (about 140 GiB free), 8 on an 80 GB card (about 79 GiB free; 12 would need about 69 GiB in transformers' row
  alone, too near the card's size), where bench_moe also runs 8.  Not yet timed on a GPU.

The global batches (``--batches``, default ``128x4096 256x2048``): ``n`` rows of ``s`` tokens laid out as verl hands
them over: a prompt left-padded into the first ``s / 8`` columns (32 to ``s / 8`` tokens), a response right-padded
after it (exponential with mean ``s / 6``, one in five cut at the generation limit); the loss is ``-mean`` of the
log-probs of the next token over the response tokens (token-mean over the whole global batch).  Each timed step
draws a new batch (``--runs`` of them, the same ones for every variant), so a variant that caches per shape pays for
the shapes a new batch brings.

Variants (``--variants``; one that cannot run is recorded as skipped with its reason, out of memory included, and
the run goes on):

* ``packfwd_default``: ``run_micro_batches`` with its defaults, what a user gets (``graphs=False``,
  ``buckets=None``: padded to the buckets where that pays, ``forward.padded_steps``; the row's ``padded`` says how
  many micro-batches were).
* ``packfwd``: ``plan_micro_batches(lengths, max_tokens=--max-tokens, cost=("flops", a, 1))`` (``a = 12 h`` for the
  Llama; for the MoE its per-layer active weights over the query width, about ``11.5 h``; ``plan_cost`` in the
  JSON) then ``run_micro_batches(make_forward("thd", logits_processor=<log-probs>), ..., graphs=True)``: CUDA graphs
  of each bucket (``forward.step_graphs``), ``--attention`` (default: the automatic choice), scored tokens only.
* ``packfwd_eager``: the plain step, ``graphs=False, buckets=False``.
* ``packfwd_fine``: ``packfwd`` with buckets 4 x finer (``bucket_steps=64``: a micro-batch padded by under
  ``max_tokens / 64`` tokens, where the default 16 padded 16k-token micro-batches by ~6 % in RESULTS history 20) and
  room for 64 graphs (``StepGraphs(max_graphs=64)``).
* ``packfwd_buckets``: ``packfwd_eager`` with each micro-batch padded to its bucket, as the graphed rows pad it,
  and run eagerly (``graphs=StepGraphs(capture=False)``).  A bucket plan's shapes recur, so where cuDNN's attention
  has passed its check the automatic attention takes it for these rows and the graphed ones (``packfwd``,
  ``packfwd_fine``); the plain eager rows keep the flash kernel (``"attention"`` in each row says which ran).
* ``packfwd_flash_buckets``, ``packfwd_flash_graphs``: ``packfwd_buckets`` and ``packfwd`` on a second packfwd model of
  the same weights with the flash kernel named (``torch_varlen``, or ``flash_attn`` where installed): what the
  buckets and the graphs give without cuDNN.
* ``packfwd_cudnn``: ``packfwd_eager`` on a second model with ``attention_backend="prefer_cudnn"``: cuDNN on the
  micro-batches' own shapes, nearly each a new one, for which it builds a graph.  The flash rows and this one fill no
  cache the automatic rows read (the automatic rows' cuDNN graphs are of the bucket shapes only).
* ``verl``: verl 0.9.1's own code: ``rearrange_micro_batches`` (its dynamic batching: micro-batches of at most
  ``--max-tokens`` real tokens) and per micro-batch ``model_forward_gen()(..., data_format="thd")`` (its THD packing
  ``preprocess_packed_seqs`` / ``postprocess_packed_seqs``) on the same packfwd model, the log-probs by the same
  processor on its packed logits, the loss normalised over the global batch as verl does.
* ``hf_padded``: transformers' ``LlamaForCausalLM`` (``Qwen3MoeForCausalLM`` for ``qwen3_moe``, its default experts
  implementation, recorded) (sdpa) on micro-batches of ``max_tokens / s`` padded rows in the batch's order (what a
  trainer without packing runs), the weights packfwd's model was converted from.

Measured per batch, variant and pass (``--passes``: ``fwd+bwd``, ``fwd``: the forward-only log-probs of
``compute_log_prob``, under ``no_grad``): CUDA events around each whole step from an idle device, planning
included (median of ``--runs`` after ``--warmup`` steps), real tokens/s, model TFLOP/s (the Llama's every weight; the
MoE's active parameters, bench_moe's ``forward_flops``: attention, router, top-8 experts and output layer, plus causal
attention) and % of a bf16 8192^3 matmul measured in the same run, micro-batches, peak allocated and reserved memory,
the graphs' memory, the attention backend the model runs, the loss (must agree across variants), the ratio to each
other variant (of the medians, ``ratios``) and, since every row times the same batches and a step's time follows its
batch (history 20 of benchmarks/RESULTS.md: steps of one row spread by 25 %, rows on one batch within 2-6 %), the
median of the per-batch ratios (``paired_ratios``, with their smallest and largest): the finer comparison.  The
JSON's ``model`` records which model ran: its name, shape, layers and parameters (and for the MoE its active
parameters, expert paths and memory estimate).

    PYTHONPATH=.:/tmp/site python3 benchmarks/bench_rl_step.py --out benchmarks/out/rl_step.json
    PYTHONPATH=.:/tmp/site python3 benchmarks/bench_rl_step.py --model qwen3_moe   # benchmarks/out/rl_step_moe.json
    python benchmarks/bench_rl_step.py --smoke --out /tmp/rl_step.json      # tiny model on the CPU (CI)
    python benchmarks/bench_rl_step.py --smoke --model qwen3_moe --out /tmp/rl_step_moe.json   # bench_moe's SMOKE

Time on an H100 (2026-12-06, 128 x 4096 only, three variants, 2 + 2 steps): about 1 minute after the model is built;
steps of 2.2-3.2 s (transformers padded, not run there, is the slowest). The default is 2 warm-up + 4 timed steps per
batch and variant (two identical eager rows in one run were 5-14 % apart with 2 timed steps, the first timed step of
each row being the slow one): about 5 minutes with the defaults; ``--batches 128x4096`` or ``--variants packfwd
packfwd_eager verl`` cut it, ``--passes fwd+bwd fwd`` adds the forward-only rows.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import bench_moe  # noqa: E402
from bench_forward import Timer, forward_flops, matmul_tflops  # noqa: E402
from bench_step import hf_model, next_token_log_probs, profile_step  # noqa: E402
from common import GiB, environment, table, write_json  # noqa: E402

import packfwd as pf  # noqa: E402
from packfwd.logits import log_probs  # noqa: E402
from packfwd.micro import StepGraphs, plan_micro_batches, run_micro_batches  # noqa: E402

VARIANTS = ("packfwd_default", "packfwd_eager", "verl", "hf_padded", "packfwd_cudnn", "packfwd_buckets", "packfwd_flash_buckets",
            "packfwd", "packfwd_fine", "packfwd_flash_graphs")  # the graphs last: their pool is freed after each row
SECOND = {"packfwd_cudnn": ("prefer_cudnn", False), "packfwd_flash_buckets": ("flash", "buckets"),
          "packfwd_flash_graphs": ("flash", True)}  # rows on a second model: its attention, the row's graphs
GRAPHED = ("packfwd_default", "packfwd", "packfwd_fine", "packfwd_buckets", "packfwd_flash_buckets", "packfwd_flash_graphs")
PASSES = ("fwd+bwd", "fwd")  # fwd: the forward-only log-probs of compute_log_prob
MODELS = ("llama1b", "qwen3_moe")


class Skip(Exception):
    """A variant that cannot run here: recorded with its reason, the run goes on."""


def rl_batch(n: int, s: int, vocab: int, seed: int, device) -> dict:
    """Left-padded prompts in the first ``s / 8`` columns, right-padded responses after them (module docstring)."""
    rng = np.random.default_rng(seed)
    region = max(1, s // 8)
    prompt = rng.integers(min(32, region), region + 1, n)
    limit = s - region
    response = np.where(rng.random(n) < 0.2, limit, rng.exponential(s / 6, n))
    response = np.clip(np.minimum(response, limit), 1, limit).astype(np.int64)
    col = torch.arange(s)[None, :]
    p, r = torch.tensor(prompt)[:, None], torch.tensor(response)[:, None]
    mask = (col >= region - p) & (col < region + r)
    ids = torch.randint(1, vocab, (n, s), generator=torch.Generator().manual_seed(seed)) * mask
    loss_mask = torch.zeros_like(mask)
    loss_mask[:, :-1] = (col[:, 1:] >= region) & mask[:, 1:]  # token i predicts token i + 1, a response token
    labels = torch.where(loss_mask, torch.roll(ids, -1, dims=1), -100)
    counts = loss_mask.sum(1).tolist()
    to = lambda x: x.to(device)  # noqa: E731
    return dict(ids=to(ids), mask=to(mask), labels=to(labels), loss_mask=to(loss_mask), lengths=(prompt + response).tolist(),
                counts=counts, n_loss=sum(counts), positions=to((mask.long().cumsum(1) - 1).clamp(min=0)))


# ------------------------------------------------------------------------------------------------ the steps


def packfwd_runner(model, cost, cfg, graphs, bucket_steps: int | None = None, max_graphs: int | None = None):
    """``graphs``: True, False (the plain step: ``buckets=False``), ``"buckets"``: each micro-batch padded to its
    bucket and run eagerly (``StepGraphs(capture=False)``: the shapes the graphs would replay, so a kernel that plans
    per shape, cuDNN's attention, sees few of them), or ``"default"``: ``run_micro_batches``' own defaults."""
    forward = pf.make_forward("thd", logits_processor=next_token_log_probs)
    buckets = {} if bucket_steps is None else {"bucket_steps": bucket_steps}
    if graphs == "buckets":
        graphs = forward.step_graphs = StepGraphs(capture=False)
    elif max_graphs is not None and cfg.device.type == "cuda":
        forward.step_graphs = StepGraphs(max_graphs=max_graphs)  # graphs=True takes the forward's own

    def run(batch, grad):
        plan = plan_micro_batches(batch["lengths"], max_tokens=cfg.max_tokens, cost=cost, **buckets,
                                  **forward.layout.plan_args)
        kw = dict(loss_fn=lambda o: -o["log_probs"], loss_mask=batch["loss_mask"], loss_tokens=batch["counts"]) \
            if grad else {}
        # named both ways: the rows stay what they say whatever the default is ("default": what a user gets)
        extra = {} if graphs == "default" else {"graphs": graphs, **({"buckets": False} if graphs is False else {})}
        with torch.set_grad_enabled(grad):
            res = run_micro_batches(forward, model, plan, batch["ids"], batch["mask"], dp_rank=0,
                                    labels=batch["labels"], **kw, **extra)
        return res.loss, plan.num_micro_batches

    run.forward = forward
    return run


def verl_runner(model, cfg):
    try:
        from tests.verl_balance_ref import _Lengths, load_verl_balancing
        from tests.verl_forward_ref import load_verl_forward

        vf, balancing = load_verl_forward(), load_verl_balancing()
    except Exception as e:  # noqa: BLE001 - verl or its megatron-core pieces missing
        raise Skip(f"verl is not importable: {type(e).__name__}: {e}") from e
    if vf is None or balancing is None:
        raise Skip("verl is not installed (pip install --no-deps verl==0.9.1)")
    forward = vf.model_forward_gen(False)

    def processor(logits, label, label_mask):  # on verl's packed [1, t, v] logits
        return {"log_probs": log_probs(logits[0], label[0]).unsqueeze(0)}

    def run(batch, grad):
        lengths = batch["lengths"]
        _, parts = balancing.rearrange_micro_batches({"input_ids": _Lengths(lengths)}, cfg.max_tokens)
        total = torch.zeros((), device=batch["ids"].device)
        for part in parts:
            rows = torch.tensor(part, device=batch["ids"].device)
            ids, mask, labels, lmask, pos = (batch[k].index_select(0, rows) for k in
                                             ("ids", "mask", "labels", "loss_mask", "positions"))
            with torch.set_grad_enabled(grad):
                out = forward(model, ids, mask, pos, {}, logits_processor=processor,
                              logits_processor_args={"label": labels.clamp(min=0), "label_mask": lmask},
                              data_format="thd")
                if grad:
                    loss = -(out["log_probs"].float() * lmask).sum() / batch["n_loss"]
                    loss.backward()
                    total = total + loss.detach()
        return total, len(parts)

    return run


def hf_runner(hf, cfg):
    def run(batch, grad):
        ids, mask = batch["ids"], batch["mask"]
        n, s = ids.shape
        rows = max(1, cfg.max_tokens // s)
        total = torch.zeros((), device=ids.device)
        for start in range(0, n, rows):
            sl = slice(start, min(start + rows, n))
            with torch.set_grad_enabled(grad):
                logits = hf(input_ids=ids[sl], attention_mask=mask[sl], position_ids=batch["positions"][sl]).logits
                lp = log_probs(logits.reshape(-1, logits.shape[-1]), batch["labels"][sl].reshape(-1).clamp(min=0))
                lp = lp.view(logits.shape[:2]) * batch["loss_mask"][sl]
                del logits
                if grad:
                    loss = -lp.float().sum() / batch["n_loss"]
                    loss.backward()
                    total = total + loss.detach()
        return total, -(-n // rows)

    return run


# ------------------------------------------------------------------------------------------------ measuring


def measure(run, module, batches, cfg, timer, grad: bool) -> dict:
    """``cfg.warmup`` steps (batch seeds 0..), then one timed step per entry of ``batches``; for the graphed row
    also how many graphs the warm-up captured (``_captured_warm``)."""
    cuda = cfg.device.type == "cuda"
    t0 = time.perf_counter()
    for w in range(cfg.warmup):
        run(batches["warmup"][w], grad)
        module.zero_grad(set_to_none=True)
    warm_s = time.perf_counter() - t0
    graphs = getattr(getattr(run, "forward", None), "step_graphs", None)
    captured_warm = graphs.captured if graphs is not None else 0
    if cuda:  # every row's peak from its own steps: what the warm-up left cached is released first
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, losses, mbs = [], [], []
    for batch in batches["timed"]:
        box = {}
        times.append(timer(lambda: box.update(zip(("loss", "mbs"), run(batch, grad)))))
        losses.append(float(box["loss"]))
        mbs.append(box["mbs"])
        module.zero_grad(set_to_none=True)
    out = {"ms": statistics.median(times), "ms_runs": times, "warmup_s": warm_s, "losses": losses,
           "micro_batches": mbs}
    if graphs is not None:
        out["_captured_warm"] = captured_warm
    if cuda:
        out["peak_allocated_GiB"] = torch.cuda.max_memory_allocated() / GiB
        out["peak_reserved_GiB"] = torch.cuda.max_memory_reserved() / GiB
    return out


def layers_for(cfg) -> int:
    """The layer count: ``--layers``, else 16 (the 1B Llama), fewer on a card with less than 70 GiB free (the four
    models' weights and gradients, one micro-batch's activations)."""
    if cfg.layers:
        return cfg.layers
    if cfg.smoke or cfg.device.type != "cuda":
        return 2
    free, _ = torch.cuda.mem_get_info()
    return 16 if free >= 70 * GiB else max(2, int(16 * free / (70 * GiB)))


# moe_layers_for's estimate of one micro-batch's memory per token (module docstring): transformers' padded Qwen3-MoE
# step, 176 KiB per layer (saved activations, measured on the CPU at the full width) and the rest of bench_moe's
# 12-layer H200 row, 2,845 KiB a token (benchmarks/results/h200-2026-12-01/moe_d71d8c2.json: step_GiB 66.7 for
# 6 x 4096), for the output layer and the loss
MOE_LAYER_BYTES_PER_TOKEN = 176 * 2**10
MOE_HEAD_BYTES_PER_TOKEN = 735 * 2**10
MOE_LAYER_CHOICES = (12, 8, 4, 2)
MOE_MEMORY_FRACTION = 0.8  # of the free memory: the allocator's fragmentation (each micro-batch routes its own
#                            counts to each expert), cuBLAS workspaces, what the estimate leaves out


def moe_params(shape) -> int:
    """Every parameter of bench_moe's ``Shape``: attention with its q / k norms, router, every expert, the two
    norms per layer, the final norm, embedding and output layer (untied).

    >>> moe_params(bench_moe.Shape(layers=12))
    4373664768
    """
    c = shape
    attention = c.hidden * (c.heads + 2 * c.kv_heads) * c.head_dim + c.heads * c.head_dim * c.hidden + 2 * c.head_dim
    layer = attention + c.experts * c.hidden + c.experts * 3 * c.hidden * c.expert_ffn + 2 * c.hidden
    return c.layers * layer + 2 * c.vocab * c.hidden + c.hidden


def moe_memory_bytes(shape, tokens: int) -> int:
    """moe_layers_for's estimate of the peak of the hungriest row, for micro-batches of ``tokens`` tokens: the two
    models' bf16 weights, the gradients and the graphs' set of them (``8 P``), and transformers' padded micro-batch.

    >>> round(moe_memory_bytes(bench_moe.Shape(layers=8), 16384) / 2**30, 1)
    56.8
    """
    per_token = MOE_HEAD_BYTES_PER_TOKEN + shape.layers * MOE_LAYER_BYTES_PER_TOKEN
    return 8 * moe_params(shape) + tokens * per_token


def moe_layers_for(cfg, tokens: int) -> int:
    """The MoE's layer count: ``--layers``, else bench_moe's SMOKE (2) for the smoke run, 2 without CUDA, else the
    largest of 12, 8, 4, 2 whose ``moe_memory_bytes`` fits ``MOE_MEMORY_FRACTION`` of the free memory (12 on an
    H200, 8 on an 80 GB H100 for the default 16,384-token micro-batches)."""
    if cfg.layers:
        return cfg.layers
    if cfg.smoke:
        return bench_moe.SMOKE.layers
    if cfg.device.type != "cuda":
        return 2
    free, _ = torch.cuda.mem_get_info()
    fits = [n for n in MOE_LAYER_CHOICES
            if moe_memory_bytes(bench_moe.Shape(layers=n), tokens) <= MOE_MEMORY_FRACTION * free]
    return fits[0] if fits else MOE_LAYER_CHOICES[-1]


def build_models(cfg, dtype, shapes):
    """transformers' model, packfwd's converted from it, the model's record for the JSON, its forward FLOPs of a
    batch's lengths, and the planning cost ``("flops", a, 1)``: ``a`` the per-layer weights each token multiplies
    over the query width (``12 h`` for a dense layer, packfwd.micro.plan; the MoE's active ones)."""
    from packfwd.models import from_hf
    from packfwd.models.convert.hf import args_from_hf_config

    if cfg.model == "llama1b":
        hf = hf_model("llama1b", cfg.smoke, cfg.device, dtype)
        layers = layers_for(cfg)
        if layers != hf.config.num_hidden_layers:
            hf.model.layers = hf.model.layers[:layers]
            hf.config.num_hidden_layers = layers
        model = from_hf(hf, device=cfg.device, params_dtype=dtype, attention_backend=cfg.attention)
        args = args_from_hf_config(hf.config)
        record = {"name": "llama1b", "family": type(hf).__name__, "hidden": args.hidden_size,
                  "ffn": args.ffn_hidden_size, "heads": args.num_attention_heads, "kv_heads": args.query_groups,
                  "head_dim": args.kv_channels, "vocab": args.vocab_size, "layers": layers,
                  "tied": bool(hf.config.tie_word_embeddings), "parameters": sum(p.numel() for p in model.parameters())}
        return hf, model, args, record, lambda lengths: forward_flops(args, lengths), \
            ("flops", 12 * args.hidden_size, 1)
    from dataclasses import asdict, replace

    from packfwd.models.mlp.experts import grouped_kernel, set_grouped_experts

    tokens = max(cfg.max_tokens, max(s for _, s in shapes))
    base = bench_moe.SMOKE if cfg.smoke else bench_moe.Shape()
    shape = replace(base, layers=moe_layers_for(cfg, tokens), seq=max(base.seq, max(s for _, s in shapes)))
    hf, model = bench_moe.build(shape, cfg.device, dtype)
    if cfg.attention is not None:  # bench_moe's build converts with the automatic attention: again with --attention
        del model
        model = from_hf(hf, device=cfg.device, params_dtype=dtype, attention_backend=cfg.attention)
    kernel = grouped_kernel(torch.zeros(1, 8, dtype=dtype, device=cfg.device))
    set_grouped_experts(model, None if kernel else True)  # bench_moe's rule: the CPU smoke forces the grouped path
    hf.train()
    args = args_from_hf_config(hf.config)
    active = bench_moe.active_params(shape)
    per_layer = (active - shape.vocab * shape.hidden) // shape.layers
    record = {"name": "qwen3_moe", "family": type(hf).__name__,
              **{k: v for k, v in asdict(shape).items() if k not in ("batch", "seq", "prompt")},
              "tied": bool(hf.config.tie_word_embeddings), "norm_topk_prob": bool(hf.config.norm_topk_prob),
              "parameters": sum(p.numel() for p in model.parameters()), "parameters_formula": moe_params(shape),
              "active_parameters": active, "grouped_mm_kernel": kernel,
              "hf_experts_implementation": getattr(hf.config, "_experts_implementation", None),
              "memory_estimate_GiB": moe_memory_bytes(shape, tokens) / GiB, "memory_estimate_tokens": tokens}
    return hf, model, args, record, lambda lengths: bench_moe.forward_flops(shape, lengths), \
        ("flops", per_layer // (shape.heads * shape.head_dim), 1)


def build_second_model(hf, cfg, dtype, args, attention: str):
    """A second packfwd model of ``hf``'s weights whose attention is ``attention``: ``"prefer_cudnn"`` (cuDNN's
    ragged attention on every batch) or ``"flash"`` (the flash kernel named: never cuDNN); Skip where that would not
    run here."""
    from packfwd.models import from_hf
    from packfwd.models.mixers.varlen import PREFER_CUDNN, choose_backend
    from packfwd.models.mlp.experts import grouped_kernel, set_grouped_experts

    if attention == "flash":
        backend = choose_backend(cfg.device, dtype, args.kv_channels)  # the automatic choice off bucket plans
        if backend not in ("flash_attn", "torch_varlen"):
            raise Skip(f"no flash kernel here (the automatic choice is {backend!r}): a CUDA device in fp16/bf16")
    else:
        backend = PREFER_CUDNN
        got = choose_backend(cfg.device, dtype, args.kv_channels, backend=PREFER_CUDNN)
        if got != "cudnn":
            raise Skip(f"cuDNN's attention does not run here (prefer_cudnn chose {got!r}): install "
                       "nvidia-cudnn-frontend on a CUDA device")
    model = from_hf(hf, device=cfg.device, params_dtype=dtype, attention_backend=backend)
    if cfg.model == "qwen3_moe":
        set_grouped_experts(model, None if grouped_kernel(torch.zeros(1, 8, dtype=dtype, device=cfg.device)) else True)
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model and batches on the CPU (CI): seconds")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON file to write (default benchmarks/out/rl_step.json; qwen3_moe: rl_step_moe.json)")
    ap.add_argument("--batches", nargs="+", default=None, help="global batches as NxS (default 128x4096 256x2048)")
    ap.add_argument("--max-tokens", type=int, default=None, help="micro-batch budget (default 16384; smoke 96)")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--attention", default="none",
                    help="attention_backend of the packfwd model the packfwd rows (but the second model's) and verl's run (default none: "
                         "the automatic choice, what a user gets; prefer_cudnn: cuDNN where it passes its check, "
                         "whose per-shape graph cache is shared by the rows: a later row reuses the graphs an earlier "
                         "one built for the same micro-batch shapes)")
    ap.add_argument("--passes", nargs="+", choices=PASSES, default=None, help="default fwd+bwd (smoke: both)")
    ap.add_argument("--runs", type=int, default=None, help="timed steps per variant (default 4; smoke 1)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps first, each a new batch (captures, compilation; default 2; smoke 1)")
    ap.add_argument("--profile", action="store_true",
                    help="one more step per row under torch.profiler (bench_step.profile_step): device time by "
                         "category, and on CUDA when the device was idle and what the host did then")
    ap.add_argument("--model", choices=MODELS, default="llama1b",
                    help="llama1b: the 1B Llama (default); qwen3_moe: bench_moe's Qwen3-MoE shape (module docstring)")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers (default: llama1b 16, fewer on a small card; qwen3_moe 12, 8, 4 or 2 by the "
                         "card's free memory; smoke 2)")
    cfg = ap.parse_args(argv)
    cfg.attention = None if cfg.attention in ("none", "None") else cfg.attention
    cfg.out = cfg.out or HERE / "out" / ("rl_step.json" if cfg.model == "llama1b" else "rl_step_moe.json")
    cuda = torch.cuda.is_available() and not cfg.smoke
    cfg.device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg.max_tokens = cfg.max_tokens or (96 if cfg.smoke else 16384)
    runs = cfg.runs or (1 if cfg.smoke else 4)
    cfg.passes = cfg.passes or (list(PASSES) if cfg.smoke else ["fwd+bwd"])
    cfg.warmup = cfg.warmup if cfg.warmup is not None else (1 if cfg.smoke else 2)
    shapes = [tuple(int(x) for x in b.lower().split("x")) for b in (cfg.batches or (
        ["6x48", "8x32"] if cfg.smoke else ["128x4096", "256x2048"]))]
    timer = Timer(cfg.device)

    from packfwd.models.mixers.varlen import choose_backend
    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel()
    hf, model, args, record, model_flops, cost = build_models(cfg, dtype, shapes)
    layers = record["layers"]
    backend = choose_backend(cfg.device, dtype, args.kv_channels, backend=cfg.attention)
    ceiling = matmul_tflops(cfg.device, dtype, timer)
    print(f"device {environment()['device']}, {cfg.model} ({record['parameters'] / 1e9:.2f} B parameters"
          + (f", {record['active_parameters'] / 1e9:.2f} B active" if "active_parameters" in record else "")
          + f"), {layers} layers, attention {backend}, matmul ceiling {ceiling} TFLOP/s", flush=True)

    runners, skipped, second = {}, {}, {}
    for name in cfg.variants:
        try:
            if name == "packfwd":
                runners[name] = (packfwd_runner(model, cost, cfg, graphs=True), model)
            elif name == "packfwd_default":
                runners[name] = (packfwd_runner(model, cost, cfg, graphs="default"), model)
            elif name == "packfwd_eager":
                runners[name] = (packfwd_runner(model, cost, cfg, graphs=False), model)
            elif name == "packfwd_fine":
                runners[name] = (packfwd_runner(model, cost, cfg, graphs=True, bucket_steps=64, max_graphs=64),
                                 model)
            elif name == "packfwd_buckets":
                runners[name] = (packfwd_runner(model, cost, cfg, graphs="buckets"), model)
            elif name in SECOND:
                attention, how = SECOND[name]
                if attention not in second:
                    second[attention] = build_second_model(hf, cfg, dtype, args, attention)
                runners[name] = (packfwd_runner(second[attention], cost, cfg, graphs=how), second[attention])
            elif name == "verl":
                runners[name] = (verl_runner(model, cfg), model)
            else:
                runners[name] = (hf_runner(hf.train(), cfg), hf)
        except Skip as e:
            skipped[name] = str(e)

    rows = []
    for n, s in shapes:
        seeds = {"warmup": range(cfg.warmup), "timed": range(100, 100 + runs)}
        batches = {k: [rl_batch(n, s, hf.config.vocab_size, 1000 * n + seed, cfg.device) for seed in v]
                   for k, v in seeds.items()}
        real = statistics.mean(sum(b["lengths"]) for b in batches["timed"])
        flops = statistics.mean(model_flops(b["lengths"]) for b in batches["timed"])
        for pass_ in cfg.passes:
            grad = pass_ == "fwd+bwd"
            for name in cfg.variants:
                row = {"batch": f"{n}x{s}", "pass": pass_, "variant": name, "real_tokens": real}
                rows.append(row)
                if name in skipped:
                    row["skipped"] = skipped[name]
                    continue
                run, module = runners[name]
                graphs = getattr(getattr(run, "forward", None), "step_graphs", None)
                try:
                    row.update(measure(run, module, batches, cfg, timer, grad))
                except torch.cuda.OutOfMemoryError as e:
                    row["skipped"] = f"out of memory: {str(e).splitlines()[0][:300]}"
                except Skip as e:
                    row["skipped"] = str(e)
                except Exception as e:  # noqa: BLE001 - recorded; the other rows still run
                    row["skipped"] = f"failed: {type(e).__name__}: {e}"[:2000]
                    row["traceback"] = traceback.format_exc()[-4000:]
                finally:
                    module.zero_grad(set_to_none=True)
                    if cuda:
                        torch.cuda.empty_cache()
                if "ms" in row and cfg.profile:
                    try:
                        row["profile"] = profile_step(lambda: run(batches["timed"][0], grad), module, cfg.device)
                    except Exception as e:  # noqa: BLE001 - the timed figures stand without it
                        row["profile_error"] = f"{type(e).__name__}: {e}"[:1000]
                    finally:
                        module.zero_grad(set_to_none=True)
                if "ms" in row:
                    tflop = flops * (3 if grad else 1) / 1e12
                    row["tokens/s"] = real / row["ms"] * 1e3
                    row["TFLOP/s"] = tflop / (row["ms"] / 1e3)
                    row["% ceiling"] = 100 * row["TFLOP/s"] / ceiling if ceiling else None
                held = getattr(run, "forward", None)  # graphs= rows: step_graphs; the default row: padded_steps
                graphs = getattr(held, "step_graphs", None) or getattr(held, "padded_steps", None)
                if name in GRAPHED and graphs is not None:  # captured: warm-up and timed steps
                    row["graphs"] = {"memory_GiB": graphs.memory_bytes / GiB, "captured": graphs.captured,
                                     "captured_in_timed_steps": graphs.captured - row.get("_captured_warm", 0),
                                     "replayed": graphs.replayed, "eager": graphs.eager, "reason": graphs.reason}
                    graphs.clear()  # its memory pool freed: the next row measures its own memory
                    graphs.captured = graphs.replayed = graphs.eager = 0
                if "ms" in row:  # what the row's attention ran: bucket plans (graphs, buckets) or the batch's own shapes
                    said = pf.make_forward("thd").attention_backend(module) if name != "hf_padded" else "sdpa"
                    bucketed = name in GRAPHED and not (graphs is not None and graphs.reason)
                    row["attention"] = said.split("; ")[-1].removesuffix(" on bucket plans") if bucketed \
                        else said.split("; ")[0]
                row.pop("_captured_warm", None)
                print(f"  {row['batch']} {pass_} {name}: " + (f"{row['ms']:.0f} ms, {row['micro_batches']} "
                      f"micro-batches, peak {row.get('peak_reserved_GiB')} GiB reserved" if "ms" in row
                      else row["skipped"][:200]), flush=True)
    bad = _compare(rows, 1e-4 if dtype == torch.float32 else 2e-2)
    payload = {"benchmark": "rl_step", "smoke": cfg.smoke, "command": " ".join(sys.argv), "env": environment(),
               "model": record, "plan_cost": list(cost), "dtype": str(dtype), "layers": layers,
               "attention_backend": backend, "matmul_TFLOPs": ceiling,
               "max_tokens": cfg.max_tokens, "runs": runs, "warmup": cfg.warmup, "rows": rows,
               "disagreements": bad}
    write_json(cfg.out, payload)
    print(table([r for r in rows if "ms" in r], ["batch", "pass", "variant", "ms", "tokens/s", "% ceiling",
                                                  "micro_batches", "peak_reserved_GiB", "vs packfwd"]))
    if bad:
        print(f"variants disagree on the loss: {bad}", file=sys.stderr)
        return 1
    return 0


def paired_ratio(theirs: list, mine: list) -> dict:
    """How many times faster ``mine`` is than ``theirs`` step by step: every timed step of every row runs the same
    batch (seeds 100, 101, ...), and a step's time follows its batch (its lengths, so its micro-batches), so the
    ratio of the two rows' times on the same batch cancels the batch's own cost.  The median over the batches, and
    the smallest and largest.

    >>> paired_ratio([300.0, 200.0, 260.0], [150.0, 100.0, 120.0])
    {'median': 2.0, 'min': 2.0, 'max': 2.1666666666666665, 'steps': 3}
    """
    steps = [t / m for t, m in zip(theirs, mine)]
    return {"median": statistics.median(steps), "min": min(steps), "max": max(steps), "steps": len(steps)}


def _compare(rows: list, rtol: float) -> list:
    """Ratios to packfwd's default row (``vs packfwd``: their time over packfwd's), and the losses checked against
    packfwd_eager's (or packfwd's) of the same batches."""
    bad = []
    for r in rows:
        if "ms" not in r:
            continue
        same = [o for o in rows if o["batch"] == r["batch"] and o["pass"] == r["pass"] and "ms" in o]
        base = next((o for o in same if o["variant"] == "packfwd"), None)
        if base is not None:
            r["vs packfwd"] = r["ms"] / base["ms"]
        r["ratios"] = {o["variant"]: o["ms"] / r["ms"] for o in same}  # how many times faster than each other
        r["paired_ratios"] = {o["variant"]: paired_ratio(o["ms_runs"], r["ms_runs"]) for o in same if o is not r}
        ref = next((o for o in same if o["variant"] == "packfwd_eager"), base)
        if r["pass"] == "fwd+bwd" and ref is not None and not all(
                math.isclose(a, b, rel_tol=rtol, abs_tol=rtol * 1e-2) for a, b in zip(r["losses"], ref["losses"])):
            bad.append((r["batch"], r["variant"], r["losses"], ref["losses"]))
    return bad


if __name__ == "__main__":
    sys.exit(main())
