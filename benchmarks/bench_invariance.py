"""Benchmark: batch invariance and a deterministic backward, measured (docs/guarantees.md states the guarantees).

(a) The invariance table.  8 target sequences (16-2048 tokens) of a 1B Llama shape (bf16, random weights: a
transformers ``LlamaForCausalLM`` and packfwd's model converted from it) and 56 others; each target's log-probs
in each case against the target alone (b=1): the same call twice, the 8 together, reversed, after 24 and after 56
others, interleaved with the others, ``run_micro_batches`` over all 64 at budgets 8192 and 32768.  Per case: how
many of the 8 are bitwise equal, and the max |diff|.  packfwd THD with the logits processor and with the fused
head, each with torch's defaults and with ``batch_invariant=True`` (split-K off, cuBLASLt); transformers padded
(sdpa): alone against the 8 in one padded batch, and reversed.

(b) The cost: the 1B step (h 2048, 16 layers, ffn 7168, GQA 16/8, vocab 32000; 6 rows of 4096 at about 54 %
fill), forward (log-probs, no grad) and forward + backward (a token-mean log-prob loss), with the guarantees off,
``batch_invariant``, ``deterministic``, both: median ms by CUDA events.  Also the attention alone (varlen, the
step's lengths, 16 heads of 128) forward + backward with torch's deterministic mode off and on.  Every mode runs
with ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (set before the first matmul), so only the option differs.

(c) CP=1 against CP=2 and TP=1 against TP=2 (NCCL; two GPUs): the 8 targets' log-probs, bitwise count and max
|diff|.  With fewer than two GPUs (or --smoke) the same comparison runs on the CPU over gloo instead, labelled
"CPU/gloo": TP=2 with sequence parallelism and CP=2, float32 and float64, log-probs and logits, on a small Llama
(the smoke model with --smoke); tests/test_batch_invariance.py asserts the CPU bounds and why they are not bitwise.

    PYTHONPATH=. python benchmarks/bench_invariance.py --out benchmarks/out/invariance.json      # the GPU
    python benchmarks/bench_invariance.py --smoke --out /tmp/invariance_smoke.json               # CPU, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before any cuBLAS call: every mode runs with it

import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from common import environment, pick_device, skip_reason, table, time_device, write_json  # noqa: E402

import packfwd as pf  # noqa: E402
from packfwd.forward import deterministic as det  # noqa: E402
from packfwd.logits import log_probs_and_entropy  # noqa: E402
from packfwd.micro import plan_micro_batches, run_micro_batches  # noqa: E402

FULL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=7168, num_hidden_layers=16, num_attention_heads=16,
            num_key_value_heads=8, max_position_embeddings=8192)
SMOKE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def hf_and_packfwd(config: dict, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    from packfwd.models import from_hf

    torch.manual_seed(0)
    with torch.device(device):  # random weights drawn where they live (1B on the host would take a minute)
        hf = LlamaForCausalLM(LlamaConfig(**config, attn_implementation="sdpa")).to(dtype).eval()
    return hf, from_hf(hf, device=device, params_dtype=dtype).eval()


def sequences(lengths, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (int(n),), generator=g) for n in lengths]


def padded(seqs, device):
    s = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), s, dtype=torch.long)
    mask = torch.zeros(len(seqs), s, dtype=torch.bool)
    for i, x in enumerate(seqs):
        ids[i, : len(x)], mask[i, : len(x)] = x, True
    return ids.to(device), mask.to(device)


# --------------------------------------------------------------------------------------------- (a) the table


def packfwd_log_probs(forward, model, seqs, rows):
    ids, mask = padded(seqs, next(model.parameters()).device)
    with torch.no_grad():
        out = forward(model, ids, mask, labels=pf.next_token_labels(ids, mask))["log_probs"]
    return [out[r, : len(seqs[r])].float().cpu() for r in rows]


def hf_log_probs(hf, seqs, rows):
    ids, mask = padded(seqs, next(hf.parameters()).device)
    labels = pf.next_token_labels(ids, mask)
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=mask.long()).logits.float()
    lp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0] * (labels >= 0)
    return [lp[r, : len(seqs[r])].cpu() for r in rows]


def compare(got, want) -> dict:
    equal = sum(torch.equal(a, b) for a, b in zip(got, want))
    return {"bitwise": f"{equal}/{len(want)}", "max_abs_diff": max(float((a - b).abs().max()) for a, b in
                                                                   zip(got, want))}


def packfwd_cases(forward, model, targets, others, budgets) -> list[dict]:
    n = len(targets)
    alone = [packfwd_log_probs(forward, model, [x], [0])[0] for x in targets]
    cases = {"same call twice": lambda: [packfwd_log_probs(forward, model, [x], [0])[0] for x in targets],
             "the 8 together": lambda: packfwd_log_probs(forward, model, targets, range(n)),
             "reversed": lambda: packfwd_log_probs(forward, model, targets[::-1], range(n))[::-1]}
    for k in (24, 56):
        cases[f"after {k} others"] = (lambda k=k: packfwd_log_probs(forward, model, others[:k] + targets,
                                                                    range(k, k + n)))
    mixed = list(others)
    for j, x in enumerate(targets):  # a target every 8th slot among the others
        mixed.insert(8 * j + 3, x)
    where = [next(i for i, y in enumerate(mixed) if y is x) for x in targets]
    cases["interleaved"] = lambda: packfwd_log_probs(forward, model, mixed, where)
    for budget in budgets:
        cases[f"run_micro_batches {budget}"] = lambda budget=budget: micro(forward, model, targets + others, n, budget)
    return [{"case": name, **compare(fn(), alone)} for name, fn in cases.items()]


def micro(forward, model, seqs, n, budget):
    ids, mask = padded(seqs, next(model.parameters()).device)
    lengths = [len(x) for x in seqs]
    plan = plan_micro_batches(lengths, max_tokens=budget, **forward.layout.plan_args)
    out = run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, labels=pf.next_token_labels(ids, mask))
    return [out.outputs["log_probs"][i, : lengths[i]].float().cpu() for i in range(n)]


def invariance_table(hf, model, cfg, cuda) -> list[dict]:
    g = np.random.default_rng(0)
    hi = 2048 if not cfg.smoke else 24
    vocab = hf.config.vocab_size
    targets = sequences(g.integers(16 if not cfg.smoke else 2, hi + 1, 8), vocab, 1)
    others = sequences(g.integers(1, hi + 1, 56), vocab, 2)
    budgets = (8192, 32768) if not cfg.smoke else (64, 256)
    rows = []
    modes = [("default", False)] + ([("batch_invariant", True)] if cuda else [])
    for mode, invariant in modes:
        for head in ("logits", "fused"):
            forward = pf.make_forward("thd", logits_processor=log_probs_and_entropy, head=head,
                                      batch_invariant=invariant)
            with det.enabled(deterministic=False) if invariant else contextlib.nullcontext():
                for row in packfwd_cases(forward, model, targets, others, budgets):
                    rows.append({"system": f"packfwd thd head={head}", "mode": mode, **row})
    alone = [hf_log_probs(hf, [x], [0])[0] for x in targets]
    rows.append({"system": "transformers padded", "mode": "default", "case": "same call twice",
                 **compare([hf_log_probs(hf, [x], [0])[0] for x in targets], alone)})
    rows.append({"system": "transformers padded", "mode": "default", "case": "b=8 padded",
                 **compare(hf_log_probs(hf, targets, range(8)), alone)})
    rows.append({"system": "transformers padded", "mode": "default", "case": "b=8 reversed",
                 **compare(hf_log_probs(hf, targets[::-1], range(8))[::-1], alone)})
    return rows


# ---------------------------------------------------------------------------------------------- (b) the cost


MODES = {"off": {}, "batch_invariant": dict(batch_invariant=True), "deterministic": dict(deterministic=True),
         "both": dict(batch_invariant=True, deterministic=True)}


def cost(model, vocab: int, cfg, device) -> list[dict]:
    g = np.random.default_rng(5)
    b, s = (6, 4096) if not cfg.smoke else (6, 32)
    lengths = np.clip(g.normal(0.54 * s, 0.25 * s, b).round(), 1, s).astype(int).tolist()
    ids, mask = padded(sequences(lengths, vocab, 6), device)
    labels = pf.next_token_labels(ids, mask)
    rows = []
    for mode, options in MODES.items():
        if device.type != "cuda" and options.get("batch_invariant"):
            rows.append({"mode": mode, "skipped": "batch_invariant is a CUDA guarantee"})
            continue
        forward = pf.make_forward("thd", logits_processor=log_probs_and_entropy, **options)
        state = (det.enabled(batch_invariant=options.get("batch_invariant", False),
                             deterministic=options.get("deterministic", False)) if options
                 else contextlib.nullcontext())

        def fwd():
            with torch.no_grad():
                forward(model, ids, mask, labels=labels, seqlens=lengths)

        def fwd_bwd():
            out = forward(model, ids, mask, labels=labels, seqlens=lengths)
            (-out["log_probs"].sum() / (labels >= 0).sum()).backward()
            model.zero_grad(set_to_none=True)

        with state:
            row = {"mode": mode, "tokens": sum(lengths)}
            row["fwd ms"] = time_device(fwd, device, warmup=3, iters=cfg.runs)
            row["fwd+bwd ms"] = time_device(fwd_bwd, device, warmup=3, iters=cfg.runs)
        rows.append(row)
    base = rows[0]
    for row in rows[1:]:
        for k in ("fwd ms", "fwd+bwd ms"):
            if k in row:
                row[k.replace(" ms", " x")] = row[k] / base[k]
    return rows + attention_cost(lengths, cfg, device)


def attention_cost(lengths, cfg, device) -> list[dict]:
    if device.type != "cuda":
        return [{"mode": "attention", "skipped": "the flash backward runs on CUDA only"}]
    from packfwd.models.mixers.varlen import varlen_attention

    t = sum(lengths)
    cu = torch.tensor([0, *np.cumsum(lengths)], device=device, dtype=torch.int32)
    q = torch.randn(t, 16, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(t, 8, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(t, 8, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(t, 16, 128, device=device, dtype=torch.bfloat16)

    def step():
        out = varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths))
        out.backward(grad)

    rows = []
    for mode, on in (("attention fwd+bwd, default", False), ("attention fwd+bwd, deterministic", True)):
        with det.enabled(batch_invariant=False) if on else contextlib.nullcontext():
            rows.append({"mode": mode, "tokens": t, "fwd+bwd ms": time_device(step, device, warmup=3,
                                                                               iters=cfg.runs)})
    rows[1]["fwd+bwd x"] = rows[1]["fwd+bwd ms"] / rows[0]["fwd+bwd ms"]
    return rows


# ---------------------------------------------------------------------------------- (c) CP and TP over NCCL


PARALLEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=4,
                num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)


def _parallel_hf():
    """The same random transformers model in every process (drawn on the host from one seed), bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**PARALLEL, attn_implementation="sdpa")).to(torch.bfloat16).eval()


def _parallel_worker(rank: int, world: int, seqs, kind: str):
    from megatron.core import parallel_state as ps

    from packfwd.models import from_hf
    from packfwd.models.runtime import ensure_model_parallel

    torch.cuda.set_device(rank)
    ensure_model_parallel(**{f"{kind}_size": world})
    hf = _parallel_hf().to(f"cuda:{rank}")
    ids, mask = padded(seqs, f"cuda:{rank}")
    if kind == "tp":
        model = from_hf(hf, tp_size=world, tp_rank=rank)
        forward = pf.make_forward("thd", logits_processor=log_probs_and_entropy)
    else:
        model = from_hf(hf)
        forward = pf.make_forward("thd", logits_processor=log_probs_and_entropy, cp_size=world,
                                  cp_rank=ps.get_context_parallel_rank(), cp_group=ps.get_context_parallel_group())
    with torch.no_grad():
        out = forward(model.eval(), ids, mask, labels=pf.next_token_labels(ids, mask))["log_probs"]
    return [out[i, : len(x)].float().cpu() for i, x in enumerate(seqs)]


def parallel_layouts(cfg, cuda) -> list[dict]:
    """CP=2 and TP=2 against 1 on a 4-layer h1024 Llama (bf16) over NCCL, each in two fresh processes."""
    if not cuda or torch.cuda.device_count() < 2:
        return cpu_parallel_layouts(cfg, torch.cuda.device_count() if cuda else 0)
    from packfwd.models import from_hf
    from packfwd.testing import run_local

    g = np.random.default_rng(7)
    seqs = sequences(g.integers(16, 2049, 8), PARALLEL["vocab_size"], 8)
    model = from_hf(_parallel_hf().cuda()).eval()
    want = packfwd_log_probs(pf.make_forward("thd", logits_processor=log_probs_and_entropy), model, seqs, range(8))
    rows = []
    for kind in ("cp", "tp"):
        got = run_local(_parallel_worker, 2, seqs, kind, backend="nccl", timeout=900)
        for rank, lp in enumerate(got):
            rows.append({"case": f"{kind.upper()}=2 rank {rank} vs {kind.upper()}=1", **compare(lp, want)})
    return rows


# ------------------------------------------------------------------ (c) on the CPU over gloo, fewer than 2 GPUs


CPU_PARALLEL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512)


def _cpu_parallel_hf(config: dict, dtype):
    """The same random transformers model in every process (one seed), in ``dtype``, on the CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**config, attn_implementation="sdpa")).to(dtype).eval()


def _cpu_parallel_worker(rank: int, world: int, config: dict, seqs):
    """This rank's per-sequence (log-probs, logits) under TP=2 + SP and CP=2, float32 and float64 (gloo)."""
    from megatron.core import parallel_state as ps

    from packfwd.models import from_hf
    from packfwd.models.runtime import ensure_model_parallel

    out = {}
    for dtype in (torch.float32, torch.float64):
        hf = _cpu_parallel_hf(config, dtype)
        for kind in ("tp", "cp"):
            ensure_model_parallel(**{f"{kind}_size": world})
            if kind == "tp":
                model, kw = from_hf(hf, tp_size=world, tp_rank=rank, sequence_parallel=True), {"tp_size": world}
            else:
                model, kw = from_hf(hf), {"cp_size": world, "cp_rank": ps.get_context_parallel_rank(),
                                          "cp_group": ps.get_context_parallel_group()}
            out[str(dtype), kind] = _per_sequence(model.eval(), seqs, **kw)
            ps.destroy_model_parallel()
    return out


def _per_sequence(model, seqs, **layout) -> tuple[list, list]:
    """(log-probs [n], logits [n, v_local]) of each sequence's real tokens (CP: all-gathered by the forward)."""
    ids, mask = padded(seqs, next(model.parameters()).device)
    with torch.no_grad():
        lp = pf.make_forward("thd", logits_processor=log_probs_and_entropy, **layout)(
            model, ids, mask, labels=pf.next_token_labels(ids, mask))["log_probs"]
        logits = pf.make_forward("thd", **layout)(model, ids, mask)
    return ([lp[i, : len(x)].cpu() for i, x in enumerate(seqs)],
            [logits[i, : len(x)].cpu() for i, x in enumerate(seqs)])


def cpu_parallel_layouts(cfg, gpus: int) -> list[dict]:
    """TP=2 (+SP) and CP=2 against 1 on the CPU over gloo, float32 and float64: every row labelled CPU/gloo."""
    from packfwd.models import from_hf
    from packfwd.testing import run_local

    config = SMOKE if cfg.smoke else CPU_PARALLEL
    g = np.random.default_rng(7)
    seqs = sequences(g.integers(2 if cfg.smoke else 16, (24 if cfg.smoke else 256) + 1, 8), config["vocab_size"], 8)
    ranks = run_local(_cpu_parallel_worker, 2, config, seqs, backend="gloo", timeout=900)
    why = f"{gpus} GPU(s): NCCL needs 2"
    rows = []
    for dtype in (torch.float32, torch.float64):
        lp_want, logits_want = _per_sequence(from_hf(_cpu_parallel_hf(config, dtype)).eval(), seqs)
        name = str(dtype).removeprefix("torch.")
        for kind, label in (("tp", "TP=2+SP"), ("cp", "CP=2")):
            for rank, (lp, logits) in enumerate(r[str(dtype), kind] for r in ranks):
                if kind == "tp":  # each rank's vocab slice, in rank order
                    logits = [torch.cat(parts, -1) for parts in zip(*(r[str(dtype), kind][1] for r in ranks))]
                case = f"CPU/gloo {name} {label} rank {rank} vs {label[:2]}=1"
                rows.append({"case": case, "output": "log_probs", **compare(lp, lp_want), "why": why})
                rows.append({"case": case, "output": "logits", **compare(logits, logits_want), "why": why})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (CI)")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--skip", nargs="*", default=[], choices=["table", "cost", "parallel"])
    ap.add_argument("--out", type=Path, default=HERE / "out" / "invariance.json")
    cfg = ap.parse_args(argv)
    if cfg.smoke:
        cfg.runs = 2
    device = pick_device(cfg.smoke)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    hf, model = hf_and_packfwd(SMOKE if cfg.smoke else FULL, device, dtype)
    payload = {"benchmark": "invariance", "env": environment(), "device": str(device), "dtype": str(dtype),
               "model": SMOKE if cfg.smoke else FULL}
    sections = {
        "table": (lambda: invariance_table(hf, model, cfg, cuda), ["system", "mode", "case", "bitwise", "max_abs_diff"]),
        "cost": (lambda: cost(model, hf.config.vocab_size, cfg, device),
                 ["mode", "tokens", "fwd ms", "fwd x", "fwd+bwd ms", "fwd+bwd x", "skipped"]),
        "parallel": (lambda: parallel_layouts(cfg, cuda), ["case", "output", "bitwise", "max_abs_diff", "skipped"]),
    }
    for name, (run, columns) in sections.items():
        if name in cfg.skip:
            continue
        try:
            payload[name] = run()
        except torch.cuda.OutOfMemoryError as e:  # recorded; the other sections still run
            payload[f"{name}_skipped"] = skip_reason(e)
            print(f"{name}: {payload[f'{name}_skipped']}", flush=True)
            continue
        print(table(payload[name], columns))
    write_json(cfg.out, payload)
    print(f"wrote {cfg.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
