"""Benchmark: a Qwen3-MoE-shaped model on one GPU, packed (THD) with grouped-GEMM experts against the same model's
sequential experts and against transformers on the padded batch, same weights, same run.

The model (``--layers``, default 12 where the card has 110 GiB free, 8 from 60 GiB (transformers' row runs out of
memory at 12 layers on an 80 GB card), else 4; 12 layers: about 4.4 B parameters, 0.9 B active per token): hidden 2048, 64 experts top-8
(normalised), expert ffn 768, 16 query / 4 key-value heads of 128, vocab 151936, untied, bf16; transformers'
``Qwen3MoeForCausalLM`` built on the GPU with its own initialisation, packfwd's model converted from it
(``from_hf``).  The batch (fixed seed): 6 rows of 4096, a 1024-column prompt region left-padded (prompts of 128 to
1024 tokens) and a response region right-padded (1 to 3072 tokens): about half real.  The loss: minus the mean
log-prob of each real token's next token (``next_token_labels``), log-probs by ``packfwd.logits.log_probs``.

Rows (``--variants``), each forward only (``fwd``: log-probs under no_grad) and forward + backward (``fwd+bwd``):

* ``grouped``: ``make_forward("thd", logits_processor=<log-probs>)``, the experts as two ``torch._grouped_mm``
  per MoE layer reading the weights in place (packfwd's default on sm90 / sm100 in bf16);
* ``grouped_scatter_combine``: grouped, with Megatron-Core's own permutation and combine (``index_select`` with
  an atomic ``index_add_`` backward, ``scatter_add_``: their bits following the batch) in place of packfwd's
  ordered ones (``packfwd.models.mlp.dispatch``): what the order costs;
* ``sequential``: the same model with Megatron-Core's loop over experts (``set_grouped_experts(model, False)``);
* ``grouped_cudnn``: grouped, a second packfwd model of the same weights with ``attention_backend="cudnn"``
  (cuDNN's ragged attention; skipped without nvidia-cudnn-frontend); ``grouped_cudnn_graph``: that model's
  forward + backward captured once as a CUDA graph (``forward.plan(..., bucket=)``, the captured forward called
  with ``plan=``; the grouped experts' dispatcher makes no host sync, so the MoE layers capture), each timed step
  planning the batch on the host, copying the plan in and replaying (fwd+bwd only);
* ``stacked``: grouped, with the weights no longer in one block (as after a distributed optimizer relocates
  them), so copied into one tensor in the forward and again in the backward: what the copies cost (this row moves
  the weights: it runs last);
* ``hf_padded``: transformers (sdpa; its default experts implementation, recorded) on the padded ``[6, 4096]``.

Measured in the same run: a bf16 8192^3 matmul (CUDA events, median: the ceiling); per row the median step time
(CUDA events around the whole step from an idle device, ``--runs`` after ``--warmup``; transformers fewer),
real tokens/s, peak memory (absolute, and above what was allocated before the step), model TFLOP/s on the active
parameters of the real tokens (per token and layer: q, k, v, o; the router; top-8 experts' fc1 and fc2; and the
output layer: ``2 P_active`` per token, plus causal attention ``4 h_q d l^2 / 2`` per sequence and layer; x3 for
forward + backward) and its fraction of the ceiling.  The run fails when a row's loss differs from
``grouped``'s beyond bf16 rounding, or a row ran another expert path than its name says (``torch._grouped_mm``
calls of one untimed step: 2 per MoE layer forward, 6 with the backward; none for ``sequential``).  A row that runs
out of memory (or fails otherwise) is recorded in ``skipped`` with its reason and the run goes on.

    PYTHONPATH=. python3 benchmarks/bench_moe.py --out benchmarks/out/moe.json          # H200: ~2-3 minutes
    (--profile: where the step's device time goes, per kernel category, for the packfwd rows)
    python benchmarks/bench_moe.py --smoke --out /tmp/moe_smoke.json                     # tiny, CPU, seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))
from bench_forward import Timer, matmul_tflops  # noqa: E402
from common import environment, graph_replay, table, write_json  # noqa: E402

from packfwd import next_token_labels  # noqa: E402
from packfwd.forward import make_forward  # noqa: E402
from packfwd.logits import log_probs, vocab_parallel  # noqa: E402

def set_combine(model, how: str) -> None:
    """Every MoE layer's dispatcher: packfwd's ordered permutation and combine, or Megatron-Core's ("scatter")."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from packfwd.models.mlp.dispatch import OrderedCombineDispatcher

    for m in model.modules():
        d = getattr(m, "token_dispatcher", None)
        if isinstance(d, MoEAllGatherTokenDispatcher) and d.ep_size == 1:
            d.__class__ = MoEAllGatherTokenDispatcher if how == "scatter" else OrderedCombineDispatcher


VARIANTS = ("grouped", "grouped_scatter_combine", "sequential", "grouped_cudnn", "grouped_cudnn_graph", "stacked",
            "hf_padded")
CUDNN = ("grouped_cudnn", "grouped_cudnn_graph")
PASSES = ("fwd", "fwd+bwd")


@dataclass(frozen=True)
class Shape:
    hidden: int = 2048
    experts: int = 64
    top_k: int = 8
    expert_ffn: int = 768
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 128
    vocab: int = 151936
    layers: int = 12
    batch: int = 6
    seq: int = 4096
    prompt: int = 1024  # columns of the prompt region; prompts of prompt // 8 .. prompt tokens


SMOKE = Shape(hidden=64, experts=8, top_k=2, expert_ffn=32, heads=4, kv_heads=2, head_dim=16, vocab=256, layers=2,
              batch=3, seq=48, prompt=16)


def active_params(c: Shape) -> int:
    """Weights each token multiplies: attention (q, k, v, o), router, top-k experts (fc1 = gate + up, fc2), and
    the output layer."""
    attention = c.hidden * (c.heads + 2 * c.kv_heads) * c.head_dim + c.heads * c.head_dim * c.hidden
    experts = c.top_k * 3 * c.hidden * c.expert_ffn
    return c.layers * (attention + c.experts * c.hidden + experts) + c.vocab * c.hidden


def forward_flops(c: Shape, lengths) -> float:
    attention = c.layers * 4.0 * c.heads * c.head_dim * sum(n * n for n in lengths) / 2
    return 2.0 * active_params(c) * sum(lengths) + attention


def rl_batch(c: Shape, device, seed: int = 0) -> dict:
    """Left-padded prompts, right-padded responses; labels, positions, host lengths."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(max(1, c.prompt // 8), c.prompt + 1, (c.batch,), generator=g)
    responses = torch.randint(1, c.seq - c.prompt + 1, (c.batch,), generator=g)
    col = torch.arange(c.seq)
    mask = (col >= c.prompt - prompts[:, None]) & (col < c.prompt + responses[:, None])
    ids = torch.randint(1, c.vocab, (c.batch, c.seq), generator=g).masked_fill(~mask, 0)
    ids, mask = ids.to(device), mask.to(device)
    labels = next_token_labels(ids, mask)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return dict(ids=ids, mask=mask, labels=labels, positions=positions, lengths=mask.sum(1).tolist(),
                n_loss=int((labels >= 0).sum()))


def build(c: Shape, device, dtype):
    """transformers' model (its initialisation, on ``device``) and packfwd's converted from it."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from packfwd.models import from_hf

    config = Qwen3MoeConfig(hidden_size=c.hidden, intermediate_size=4 * c.hidden, moe_intermediate_size=c.expert_ffn,
                            num_experts=c.experts, num_experts_per_tok=c.top_k, norm_topk_prob=True,
                            num_hidden_layers=c.layers, num_attention_heads=c.heads, num_key_value_heads=c.kv_heads,
                            head_dim=c.head_dim, vocab_size=c.vocab, max_position_embeddings=c.seq,
                            tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.manual_seed(0)
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            hf = Qwen3MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return hf, from_hf(hf)


@vocab_parallel
def next_token_log_probs(logits, labels, tp_group=None):
    return {"log_probs": log_probs(logits, labels, tp_group=tp_group)}


def packfwd_step(model, batch, backward: bool, forward=None, plan=None):
    """One step (forward, loss, backward when ``backward``): planning the batch inside the call, or with ``plan``."""
    forward = forward or make_forward("thd", logits_processor=next_token_log_probs)
    packing = dict(plan=plan) if plan is not None else dict(attention_mask=batch["mask"], seqlens=batch["lengths"])

    def step():
        with torch.set_grad_enabled(backward):
            lp = forward(model, batch["ids"], labels=batch["labels"], **packing)
            loss = -lp["log_probs"].sum() / batch["n_loss"]
        if backward:
            loss.backward()
        return loss.detach()

    return step


def graphed_step(model, batch, warmup: int = 2):
    """``packfwd_step`` (forward + backward) captured as one CUDA graph with a bucket plan of the batch's size; the
    returned step plans the batch, copies the plan into the captured one and replays."""
    from packfwd.layout.bucket import Bucket

    forward = make_forward("thd", logits_processor=next_token_log_probs)
    bucket = Bucket(tokens=sum(batch["lengths"]), max_seqlen=max(batch["lengths"]))

    def plan():
        return forward.plan(batch["ids"], batch["mask"], seqlens=batch["lengths"], bucket=bucket)

    captured = plan()
    body = packfwd_step(model, batch, True, forward, captured)
    return graph_replay(body, model, captured, plan, warmup)


def cudnn_model(hf, device, dtype):
    """packfwd's model of ``hf``'s weights with cuDNN's attention, or None where that backend is missing."""
    from packfwd.models import from_hf
    from packfwd.models.mixers.varlen import available_backends

    if "cudnn" not in available_backends(device):
        return None
    return from_hf(hf, device=device, params_dtype=dtype, attention_backend="cudnn")


def hf_step(hf, batch, backward: bool):
    def step():
        with torch.set_grad_enabled(backward):
            logits = hf(input_ids=batch["ids"], attention_mask=batch["mask"], position_ids=batch["positions"]).logits
            lp = log_probs(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
            loss = -lp.sum() / batch["n_loss"]
        if backward:
            loss.backward()
        return loss.detach()

    return step


def unblock_experts(model) -> int:
    """Give every expert weight its own memory (the ``stacked`` row): the grouped path then stacks them."""
    moved = 0
    for name, p in model.named_parameters():
        if ".local_experts." in name:
            p.data = p.data.clone()
            moved += 1
    return moved


def grouped_mm_calls(step, module) -> int:
    """``torch._grouped_mm`` calls of one (untimed) step: which expert path a row really ran."""
    calls, original = [], torch._grouped_mm
    torch._grouped_mm = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        step()
    finally:
        torch._grouped_mm = original
        module.zero_grad(set_to_none=True)
    return len(calls)


def measure(step, module, runs: int, warmup: int, timer, device) -> dict:
    loss = step()
    module.zero_grad(set_to_none=True)
    for _ in range(warmup - 1):
        step()
        module.zero_grad(set_to_none=True)
    out = {}
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(runs):
        times.append(timer(step))
        module.zero_grad(set_to_none=True)
    if device.type == "cuda":
        out["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
        out["step_GiB"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return {"ms": statistics.median(times), "ms_runs": times, "loss": float(loss), **out}


def layers_for_memory(device) -> int:
    """The default layer count for the card: 12 with 110 GiB free, 8 with 60 GiB, else 4 (the two models, their
    gradients, and transformers' padded step, whose activations grow with the layers)."""
    if device.type != "cuda":
        return 12
    free = torch.cuda.mem_get_info()[0] / 2**30
    return 12 if free >= 110 else 8 if free >= 60 else 4


def _free(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (CI): seconds")
    ap.add_argument("--out", type=Path, default=HERE / "out" / "moe.json", help="JSON file to write")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers (default: 12, 8 or 4 by the card's free memory; smoke 2)")
    ap.add_argument("--runs", type=int, default=None, help="timed steps per packfwd row (default 5; smoke 1)")
    ap.add_argument("--hf-runs", type=int, default=None, help="timed steps of transformers (default 3; smoke 1)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2; smoke 1)")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    ap.add_argument("--profile", action="store_true",
                    help="one more fwd+bwd step of each packfwd row under torch.profiler: device kernel time by "
                         "category (bench_step's: gemm, attention, norm, elementwise, copy, other) and the top "
                         "kernels of each, in the row's 'profile'")
    cfg = ap.parse_args(argv)
    t_start = time.perf_counter()
    cuda = torch.cuda.is_available() and not cfg.smoke
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    shape = SMOKE if cfg.smoke else Shape()
    layers = cfg.layers or (None if cfg.smoke else layers_for_memory(device))
    if layers:
        shape = Shape(**{**asdict(shape), "layers": layers})
    runs, hf_runs = cfg.runs or (1 if cfg.smoke else 5), cfg.hf_runs or (1 if cfg.smoke else 3)
    warmup = cfg.warmup or (1 if cfg.smoke else 2)
    timer = Timer(device)

    from packfwd.models.mlp.experts import grouped_kernel, set_grouped_experts

    ceiling = matmul_tflops(device, dtype, timer)
    t0 = time.perf_counter()
    hf, model = build(shape, device, dtype)
    build_s = time.perf_counter() - t0
    batch = rl_batch(shape, device)
    real = sum(batch["lengths"])
    flops = forward_flops(shape, batch["lengths"])
    kernel = grouped_kernel(torch.zeros(1, 8, dtype=dtype, device=device))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e9:.2f} B parameters, {active_params(shape) / 1e9:.2f} B active, {shape.layers} "
          f"layers ({dtype}, built in {build_s:.1f} s); batch {shape.batch} x {shape.seq}, "
          f"{real} real tokens ({real / (shape.batch * shape.seq):.0%}); grouped_mm kernel: {kernel}; matmul "
          f"ceiling {ceiling and round(ceiling)} TFLOP/s", flush=True)

    rows, skipped, cudnn = [], {}, None
    for variant in [v for v in VARIANTS if v in cfg.variants]:  # "stacked" moves the weights: after the others
        if variant in CUDNN:  # a model of its own per row: a graph is captured on a model no eager step touched
            cudnn = None
            try:
                cudnn = cudnn_model(hf, device, dtype)
            except torch.cuda.OutOfMemoryError as e:
                skipped[variant] = f"skipped: out of memory building its model ({str(e).splitlines()[0][:200]})"
                _free(device)
                continue
            if cudnn is None:
                skipped[variant] = "attention_backend='cudnn' is not available here (nvidia-cudnn-frontend, CUDA)"
                continue
        module = hf if variant == "hf_padded" else cudnn if variant in CUDNN else model
        if variant == "sequential":
            set_grouped_experts(model, False)
        elif variant in ("grouped", "grouped_scatter_combine", "stacked", *CUDNN):
            set_grouped_experts(module, None if kernel else True)  # the CPU smoke forces the grouped path
            if variant == "stacked":
                unblock_experts(model)
        set_combine(model, "scatter" if variant == "grouped_scatter_combine" else "ordered")
        for pass_ in cfg.passes:
            backward = pass_ == "fwd+bwd"
            if variant == "grouped_cudnn_graph":
                if not backward:
                    continue
                step = graphed_step(module, batch)
            else:
                step = (hf_step if variant == "hf_padded" else packfwd_step)(module, batch, backward)
            n = hf_runs if variant == "hf_padded" else runs
            try:
                row = {"variant": variant, "pass": pass_, **measure(step, module, n, warmup, timer, device)}
            except Exception as e:  # noqa: BLE001 - out of memory above all: recorded, the other rows still run
                oom = isinstance(e, torch.cuda.OutOfMemoryError)
                why = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
                skipped[f"{variant} {pass_}"] = ("skipped: out of memory" if oom else f"failed: {type(e).__name__}") \
                    + f" ({why})"
                print(f"  {variant} {pass_}: {skipped[f'{variant} {pass_}']}", flush=True)
                del step
                module.zero_grad(set_to_none=True)
                _free(device)
                continue
            if variant != "hf_padded":  # grouped rows: 2 per MoE layer forward, 6 with the backward; sequential 0
                row["grouped_mm_calls"] = getattr(step, "grouped_mm_calls", None) or grouped_mm_calls(step, module)
                if cfg.profile and backward:
                    from bench_step import profile_step

                    row["profile"] = profile_step(step, module, device)
            seconds = row["ms"] * 1e-3
            row["tokens/s"] = real / seconds
            row["TFLOP/s"] = (3.0 if backward else 1.0) * flops / seconds / 1e12
            row["of_ceiling"] = row["TFLOP/s"] / ceiling if ceiling else None
            rows.append(row)
            print(f"  {variant} {pass_}: {row['ms']:.1f} ms, {row['tokens/s']:.0f} tok/s, {row['TFLOP/s']:.1f} "
                  f"TFLOP/s, loss {row['loss']:.5f}, peak {row.get('peak_GiB', 0):.1f} GiB", flush=True)
    hf_impl = getattr(hf.config, "_experts_implementation", None)

    failed = []
    for pass_ in cfg.passes:
        ref = next((r for r in rows if r["pass"] == pass_ and r["variant"] == "grouped"), None)
        base = next((r for r in rows if r["pass"] == pass_ and r["variant"] == "hf_padded"), None)
        for r in rows:
            if r["pass"] != pass_:
                continue
            per_layer = 0 if r["variant"] in ("sequential", "hf_padded") else 6 if pass_ == "fwd+bwd" else 2
            want = per_layer * shape.layers
            if r.get("grouped_mm_calls", want) != want:
                failed.append(f"{r['variant']} {pass_}: {r['grouped_mm_calls']} grouped products, not {want}")
            if ref is not None:
                r["loss_vs_grouped"] = abs(r["loss"] - ref["loss"]) / abs(ref["loss"])
                if r["loss_vs_grouped"] > (1e-5 if cfg.smoke else 1e-2):
                    failed.append(f"{r['variant']} {pass_}: loss {r['loss']} vs grouped {ref['loss']}")
            if base is not None:
                r["speedup_vs_hf"] = base["ms"] / r["ms"]
    payload = {
        "benchmark": "moe", "smoke": cfg.smoke, "command": " ".join(sys.argv), "env": environment(),
        "model": {**asdict(shape), "parameters": n_params,
                  "active_parameters": active_params(shape), "dtype": str(dtype)},
        "batch": {"rows": shape.batch, "seq": shape.seq, "lengths": batch["lengths"], "real_tokens": real,
                  "fill": real / (shape.batch * shape.seq), "ideal_speedup": shape.batch * shape.seq / real},
        "grouped_mm_kernel": kernel, "hf_experts_implementation": hf_impl, "runs": runs, "hf_runs": hf_runs,
        "warmup": warmup, "matmul_ceiling_TFLOP/s": ceiling, "forward_flops": flops, "build_s": build_s,
        "results": rows, "skipped": skipped, "failed": failed, "wall_s": time.perf_counter() - t_start,
    }
    write_json(cfg.out, payload)
    print(table(rows, ["variant", "pass", "ms", "tokens/s", "TFLOP/s", "of_ceiling", "peak_GiB", "step_GiB",
                       "speedup_vs_hf", "loss", "loss_vs_grouped"]))
    print(f"transformers' experts: {hf_impl}; ideal speedup over padded {shape.batch * shape.seq / real:.2f}; "
          f"wall {payload['wall_s']:.0f} s; wrote {cfg.out}")
    if failed:
        print("losses disagree: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
