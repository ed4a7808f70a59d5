"""Do a sequence's log-probs depend on which other sequences share its micro-batch?

The same global batch is planned twice with different token budgets (so the micro-batches differ), run through
``run_micro_batches`` with ``make_forward("thd", logits_processor=log_probs)``, and each sequence's log-probs are
compared between the two compositions, and against the sequence run alone.  The largest difference is the number
to report (making it zero, batch-invariant kernels, is a later goal).  Random weights, built locally.

    python benchmarks/bench_composition.py                      # CPU, float32, a tiny Llama
    python benchmarks/bench_composition.py --device cuda        # bfloat16, a ~0.3B Llama
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.common import environment, write_json  # noqa: E402

import packfwd as pf  # noqa: E402
from packfwd.logits import log_probs  # noqa: E402
from packfwd.micro import plan_micro_batches, run_micro_batches  # noqa: E402
from packfwd.models import ModelArgs, build_model  # noqa: E402


def log_prob_processor(logits, labels):
    return {"log_probs": log_probs(logits, labels)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    ap.add_argument("--out", type=Path, default=HERE / "out" / "composition.json")
    cfg = ap.parse_args(argv)
    cuda = cfg.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        args = ModelArgs(vocab_size=32000, hidden_size=1024, ffn_hidden_size=4096, num_layers=16,
                         num_attention_heads=16, num_query_groups=8)
        n, longest, budgets = 64, 2048, (8192, 20000)
    else:
        args = ModelArgs(vocab_size=512, hidden_size=128, ffn_hidden_size=256, num_layers=2, num_attention_heads=4,
                         num_query_groups=2)
        n, longest, budgets = (8, 24, (48, 100)) if cfg.smoke else (32, 96, (256, 640))
    torch.manual_seed(0)
    model = build_model(args, device=cfg.device, params_dtype=dtype).eval()
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, longest + 1, (n,), generator=g)
    mask = torch.arange(longest)[None, :] < lengths[:, None]
    ids = torch.randint(1, args.vocab_size, (n, longest), generator=g).masked_fill(~mask, 0)
    ids, mask = ids.to(cfg.device), mask.to(cfg.device)
    labels = pf.next_token_labels(ids, mask)
    forward = pf.make_forward("thd", logits_processor=log_prob_processor)

    def run(budget):
        plan = plan_micro_batches(lengths.tolist(), max_tokens=budget)
        out = run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, labels=labels)
        return plan, out.outputs["log_probs"].float()

    (plan_a, a), (plan_b, b) = run(budgets[0]), run(budgets[1])
    with torch.no_grad():
        alone = torch.cat([forward(model, ids[i : i + 1], mask[i : i + 1], labels=labels[i : i + 1])["log_probs"]
                           for i in range(n)]).float()
    real = labels >= 0
    rows = {
        "budgets": list(budgets),
        "micro_batches": [len(plan_a.micro_batches[0]), len(plan_b.micro_batches[0])],
        "max_abs_diff_between_compositions": float((a - b)[real].abs().max()),
        "max_abs_diff_vs_alone": float(torch.maximum((a - alone).abs(), (b - alone).abs())[real].max()),
        "mean_abs_log_prob": float(a[real].abs().mean()),
        "sequences_differing": int(((a - b).abs().amax(1) > 0).sum()),
    }
    payload = {"benchmark": "composition", "env": environment(), "device": cfg.device, "dtype": str(dtype),
               "model": vars(args), "sequences": n, "longest": longest, **rows}
    write_json(cfg.out, payload)
    for k, v in rows.items():
        print(f"{k:36s} {v}")
    print(f"wrote {cfg.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
