"""The layout half of ``make demo``: a ragged batch's THD layout per CP rank, padding overheads, a layer
partition, and a round-trip check."""

from __future__ import annotations

import torch

from .layers import layer_partition
from .show import describe_thd, lengths_mask, padding_overhead
from .thd import from_thd, to_thd

LENGTHS = (5, 17, 3, 9)


def print_layout_demo() -> None:
    tp, cp = 2, 2
    print(f"== THD layout of a ragged batch, lengths {list(LENGTHS)}, tp={tp}, cp={cp} ==")
    print(describe_thd(LENGTHS, tp_size=tp, cp_size=cp))
    print(f"\n== padding overhead: packfwd's default alignment vs verl's (2*tp*cp, or tp without CP) ==")
    print(f"{'tp':>3} {'cp':>3} {'real':>6} {'packfwd':>8} {'verl':>6}")
    for t, c in [(1, 1), (2, 1), (8, 1), (2, 2), (4, 2), (8, 4)]:
        o = padding_overhead(LENGTHS, tp_size=t, cp_size=c)
        print(f"{t:>3} {c:>3} {o['real']:>6} {o['packfwd']:>8} {o['verl']:>6}")
    print("\n== layer partition of a 32-layer model, pp=4, vpp=2 (global layer indices) ==")
    for rank, stages in enumerate(layer_partition(32, 4, 2)):
        print(f"pp rank {rank}: " + "  ".join(f"vpp {v}: {r.start}-{r.stop - 1}" for v, r in enumerate(stages)))
    mask = lengths_mask(LENGTHS)
    x = torch.randn(*mask.shape, 8)
    outs = [to_thd(x, mask, tp_size=tp, cp_size=cp, cp_rank=r)[0] for r in range(cp)]
    info = to_thd(x, mask, tp_size=tp, cp_size=cp, cp_rank=0)[1]
    back = from_thd(outs, info)
    exact = torch.equal(back, x * mask[..., None])
    print(f"\nround trip from_thd(all ranks of to_thd(x)) == x * mask: {exact}")
    if not exact:
        raise SystemExit("round trip failed")


if __name__ == "__main__":
    print_layout_demo()
