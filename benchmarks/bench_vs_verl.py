"""packfwd against what RL trainers run today: verl's own THD packing (``preprocess_packed_seqs`` /
``postprocess_packed_seqs``, tp=2, cp=2) and flash-attn-style ``unpad_input`` / ``pad_input``, at
b = 8, 64, 256, 1024 and s = 2048 (lengths uniform in [1, s], about half fill).

What is timed, wall clock from an idle device to an idle device, median of several calls:

  verl      preprocess_packed_seqs(input_ids [b, s] int64, mask) for CP rank 0, then postprocess_packed_seqs of
            the per-token output of both CP ranks (log-probs, [1, t_local] float32), as verl's actor does.
  packfwd   plan_thd(mask, tp=2, cp=2, cp_rank=0, seq_align=8) (verl's layout, token for token), then
            to_thd(input_ids) and from_thd of both ranks' outputs.  Also split into plan and apply, and planned
            with host ``seqlens`` (no sync at all).

verl's postprocess all-gathers the CP ranks' outputs over its CP group.  Here, in one process,
``torch.distributed.all_gather`` is replaced for the duration of verl's call by one device copy per rank of the
outputs passed in (what a local all-gather writes), and the group getter returns None.  Outputs are checked
equal between verl and packfwd before timing.

  flash     unpad_input: mask.sum, nonzero, .item() (two host syncs), then a gather of input_ids;
            pad_input: zeros + index_put of the log-probs.  packfwd: plan_unpad + unpad + pad.

    PYTHONPATH=.:/tmp/site python benchmarks/bench_vs_verl.py [--smoke] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, pick_device, random_lengths, random_nonzero, right_padded_mask, table, time_host, write_json  # noqa: E402

from packfwd.ops import gather as _rows
from packfwd import from_thd, pad, plan_thd, to_thd, unpad  # noqa: E402

TP, CP = 2, 2


def load_verl():
    try:
        from tests.verl_ref import load_verl_util, patched_mpu

        return load_verl_util(), patched_mpu
    except Exception as e:  # verl missing, or megatron-core not importable
        print(f"verl reference unavailable: {type(e).__name__}: {e}")
        return None, None


@contextlib.contextmanager
def local_all_gather(verl, rank_outputs):
    """verl's CP all-gather, done in this process: one copy per rank of the outputs given."""

    def all_gather(output_list, tensor, group=None, async_op=False):
        for out, src in zip(output_list, rank_outputs):
            out.copy_(src)

    saved = (torch.distributed.all_gather, verl.mpu.get_context_parallel_group)
    torch.distributed.all_gather = all_gather
    verl.mpu.get_context_parallel_group = lambda *a, **k: None
    try:
        yield
    finally:
        torch.distributed.all_gather, verl.mpu.get_context_parallel_group = saved


def flash_unpad_input(ids, mask):
    seqlens = mask.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item())
    cu = torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    return ids.reshape(-1)[indices], indices, cu, max_seqlen


def flash_pad_input(values, indices, b, s):
    out = values.new_zeros(b * s)
    out[indices] = values
    return out.reshape(b, s)


def run_size(b, s, device, verl, patched_mpu, iters):
    lengths = random_lengths(b, s, seed=b)
    mask = right_padded_mask(lengths, s, device)
    ids = random_nonzero((b, s), torch.int64, device, seed=b + 1)
    infos = [plan_thd(mask, tp_size=TP, cp_size=CP, cp_rank=r, seq_align=2 * TP * CP) for r in range(CP)]
    outs = [random_nonzero((infos[0].local_tokens,), torch.float32, device, seed=b + 2 + r) for r in range(CP)]
    row = {"b": b, "s": s, "tokens": sum(lengths)}

    def packfwd_all():
        info = plan_thd(mask, tp_size=TP, cp_size=CP, cp_rank=0, seq_align=2 * TP * CP)
        return to_thd(ids, info)[0], from_thd(outs, info)

    def packfwd_seqlens():
        info = plan_thd(mask, tp_size=TP, cp_size=CP, cp_rank=0, seq_align=2 * TP * CP, seqlens=lengths)
        return to_thd(ids, info)[0], from_thd(outs, info)

    row["packfwd ms"] = time_host(packfwd_all, device, iters=iters)
    row["plan ms"] = time_host(lambda: plan_thd(mask, tp_size=TP, cp_size=CP, cp_rank=0, seq_align=8), device, iters=iters)
    apply = lambda: (to_thd(ids, infos[0])[0], from_thd(outs, infos[0]))  # noqa: E731
    row["apply ms"] = time_host(apply, device, iters=iters)
    if device.type == "cuda":  # both gather paths, whatever the size threshold picks
        for use, label in ((True, "apply kernel ms"), (False, "apply torch ms")):
            saved, _rows.use_op = _rows.use_op, (lambda src, use=use: use)
            try:
                row[label] = time_host(apply, device, iters=iters)
            finally:
                _rows.use_op = saved
    row["seqlens ms"] = time_host(packfwd_seqlens, device, iters=iters)

    if verl is not None:
        def verl_all():
            with patched_mpu(verl, TP, CP, 0), local_all_gather(verl, [o[None] for o in outs]):
                packed, psp = verl.preprocess_packed_seqs(ids, mask)
                return packed, verl.postprocess_packed_seqs(outs[0][None], psp, mask, b, s)

        v_ids, v_out = verl_all()
        p_ids, p_out = packfwd_all()
        row["equal"] = torch.equal(v_ids[0], p_ids) and torch.equal(v_out, p_out)
        row["verl ms"] = time_host(verl_all, device, warmup=1, iters=max(3, min(iters, 10)))
        row["speedup"] = row["verl ms"] / row["packfwd ms"]

    lp = random_nonzero((sum(lengths),), torch.float32, device, seed=b + 9)

    def flash_pair():
        packed, indices, _, _ = flash_unpad_input(ids, mask)
        return packed, flash_pad_input(lp, indices, b, s)

    def packfwd_pair():
        packed, info = unpad(ids, mask)
        return packed, pad(lp, info)

    f, p = flash_pair(), packfwd_pair()
    row["unpad/pad equal"] = torch.equal(f[0], p[0]) and torch.equal(f[1], p[1])
    row["flash ms"] = time_host(flash_pair, device, iters=iters)
    row["packfwd unpad/pad ms"] = time_host(packfwd_pair, device, iters=iters)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (CI keeps the script working)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = ap.parse_args(argv)
    device = pick_device(args.smoke)
    sizes = [(2, 32), (8, 32)] if args.smoke else [(8, 2048), (64, 2048), (256, 2048), (1024, 2048)]
    iters = 3 if args.smoke else 30
    verl, patched_mpu = load_verl()
    rows = [run_size(b, s, device, verl, patched_mpu, iters) for b, s in sizes]
    result = {"env": environment(), "tp": TP, "cp": CP, "rows": rows}
    print(f"device {result['env']['device']}  tp={TP} cp={CP}")
    print(table(rows, ["b", "s", "verl ms", "packfwd ms", "speedup", "plan ms", "apply ms", "seqlens ms", "equal"]))
    print(table(rows, ["b", "s", "apply kernel ms", "apply torch ms"]))
    print(table(rows, ["b", "s", "flash ms", "packfwd unpad/pad ms", "unpad/pad equal"]))
    path = args.out / ("vs_verl_smoke.json" if args.smoke else "vs_verl.json")
    write_json(path, result)
    print(f"wrote {path}")
    return 0 if all(r.get("equal", True) and r["unpad/pad equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
