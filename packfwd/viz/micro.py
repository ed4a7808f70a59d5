"""A micro-batch plan as a picture: DP ranks x micro-batches, each micro-batch's tokens against ``max_tokens``.

``draw_micro_batches(ax, plan)`` takes the ``MicroBatchPlan`` of :func:`packfwd.micro.plan_micro_batches`.  A row
per DP rank; along it the rank's micro-batches in the order it runs them, each a box ``max_tokens`` wide (the
budget, per CP rank) filled by its sequences' padded tokens (colour: the sequence, light: its alignment padding,
grey: the layout's tail padding).  How full the boxes are is the packing; how alike the rows are is the balance.
matplotlib is imported only when it runs; one collection per row, so thousands of sequences draw fast.
"""

from __future__ import annotations

import numpy as np

from packfwd.layout import rules
from packfwd.layout.display import percent
from packfwd.micro import MicroBatchPlan

from .style import PAD_RGBA, grid_axes, lighter, sequence_colours, wrapped_title

__all__ = ["draw_micro_batches"]

_GAP = 0.08  # space between micro-batches, as a share of max_tokens


def draw_micro_batches(ax, plan: MicroBatchPlan):
    """Draw ``plan``: a row per DP rank, its micro-batches side by side, each a box of ``max_tokens`` (per CP rank)
    filled by its sequences' tokens.  The text above a box is its token count when there are at most 48 boxes;
    beside each row the rank's balance cost.  Returns ``ax``.

    >>> from matplotlib.figure import Figure
    >>> from packfwd.micro import plan_micro_batches
    >>> plan = plan_micro_batches([7, 3, 9, 1, 6, 2], max_tokens=10, dp_size=2)
    >>> ax = draw_micro_batches(Figure().subplots(), plan)
    >>> [t.get_text() for t in ax.texts][:2]   # rank 0's micro-batches: 5 and 9 tokens of 10
    ['5', '9']
    """
    if not isinstance(plan, MicroBatchPlan):
        raise TypeError(f"plan is a {type(plan).__name__}; pass the MicroBatchPlan of plan_micro_batches(seqlens, "
                        "max_tokens=..., dp_size=...)")
    from matplotlib.patches import Rectangle

    cap, cp, m = plan.max_tokens, plan.cp_size, plan.num_micro_batches
    lengths = np.asarray(plan.seqlens, dtype=np.int64)
    padded = rules.round_up(lengths, plan.seq_align)
    colours = sequence_colours(len(lengths))
    step = cap * (1 + _GAP)
    label = plan.dp_size * m <= 48
    for r in range(plan.dp_size):
        for j, members in enumerate(plan.micro_batches[r]):
            x = j * step
            spans, faces = [], []
            for i in members:  # a sequence: its real tokens, then its alignment padding (per CP rank)
                spans += [(x, lengths[i] / cp), (x + lengths[i] / cp, (padded[i] - lengths[i]) / cp)]
                faces += [colours[i], lighter(colours[i], 0.65)]
                x += padded[i] / cp
            spans.append((x, plan.tokens[r][j] - (x - j * step)))  # the layout's tail padding
            faces.append(PAD_RGBA)
            ax.broken_barh(spans, (r + 0.15, 0.7), facecolors=faces, edgecolor="none")
            ax.add_patch(Rectangle((j * step, r + 0.15), cap, 0.7, fill=False, edgecolor="black", linewidth=0.8))
            if label:
                ax.text(j * step + cap / 2, r + 0.12, str(plan.tokens[r][j]), ha="center", va="bottom", fontsize=6)
        cost = sum(plan.costs[r])
        ax.text(m * step, r + 0.5, f" cost {cost:,.0f}" if cost < 1e7 else f" cost {cost:.3g}", va="center",
                fontsize=7)
    grid_axes(ax, m * step + 0.22 * m * step, plan.dp_size, [f"dp rank {r}" for r in range(plan.dp_size)])
    ax.set_xticks([j * step + cap / 2 for j in range(m)], [f"mb {j}" for j in range(m)] if m <= 24 else [""] * m,
                  fontsize=7)
    flat = [t for rank in plan.tokens for t in rank]
    costs = [sum(c) for c in plan.costs]
    balance = max(costs) / (sum(costs) / len(costs)) if sum(costs) else 1.0
    fill = percent(sum(flat), len(flat) * cap)
    wrapped_title(ax, f"{len(lengths)} sequences in dp={plan.dp_size} x {m} micro-batches, each box max_tokens={cap} "
                      f"per CP rank (tp={plan.tp_size}, cp={cp}, align={plan.seq_align}): {fill} full, rank cost "
                      f"max/mean {balance:.3f}")
    return ax
