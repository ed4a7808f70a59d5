"""Expert load as a picture: MoE layers x experts, from the routing statistics a forward records.

``draw_expert_load(ax, stats)`` takes what :func:`packfwd.models.mlp.moe.routing_stats` yields (a list of
``RoutingStats``, one per MoE layer), one ``RoutingStats``, or a ``[layers, E]`` count of tokens per expert (e.g.
transformers' router logits, top-k counted).  Pass a dict of them to compare, e.g. with and without padding routed:
one heat map each, on one colour scale.  matplotlib is imported only when it runs.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .inputs import expert_load
from .style import wrapped_title

__all__ = ["draw_expert_load"]

_NUMBER_LIMIT = 160  # write the counts in the cells up to this many cells


def draw_expert_load(ax_or_axes, stats, *, share: bool = False):
    """Heat map of the tokens routed to each expert (columns) of each MoE layer (rows); each row labelled with its
    imbalance, max/mean over the experts.  ``stats``: a list of ``RoutingStats``, one ``RoutingStats``, a ``[layers,
    E]`` tensor or array, or a dict ``{title: any of those}`` drawn side by side on one colour scale (one Axes each,
    ``ax_or_axes`` a sequence of as many).  ``share``: each row divided by its mean (1.0: an even share).  Returns
    the list of Axes.

    >>> import torch
    >>> from matplotlib.figure import Figure
    >>> from packfwd.models.mlp.routing import RoutingStats
    >>> layer = RoutingStats(torch.tensor([3.0, 1.0]), torch.tensor([0.6, 0.4]), torch.tensor(2.0))
    >>> (ax,) = draw_expert_load(Figure().subplots(), [layer, layer])
    >>> ax.images[0].get_array().tolist(), [t.get_text() for t in ax.texts]
    ([[3.0, 1.0], [3.0, 1.0]], ['3', '1', '3', '1'])
    """
    panels = list(stats.items()) if isinstance(stats, Mapping) else [(None, stats)]
    axes = [ax_or_axes] if hasattr(ax_or_axes, "imshow") else list(ax_or_axes)
    if len(axes) != len(panels):
        raise ValueError(f"got {len(axes)} axes for {len(panels)} sets of routing statistics; pass one Axes per "
                         "entry of the dict (or one Axes and one set)")
    loads = [expert_load(s, "stats" if title is None else f"stats[{title!r}]") for title, s in panels]
    shapes = {load.shape for load in loads}
    if len(shapes) > 1:
        raise ValueError(f"the routing statistics have shapes {sorted(shapes)} ([layers, experts]); compare the same "
                         "model's layers")
    values = [_share(load) if share else load for load in loads]
    top = max((float(v.max()) for v in values if v.size), default=1.0) or 1.0
    for ax, (title, _), load, v in zip(axes, panels, loads, values):
        image = ax.imshow(v, cmap="viridis", vmin=0, vmax=top, aspect="auto", interpolation="nearest")
        layers, experts = v.shape
        if layers * experts <= _NUMBER_LIMIT:
            for (i, e), value in np.ndenumerate(v):
                text = f"{value:.2f}" if share else f"{value:.0f}"
                ax.text(e, i, text, ha="center", va="center", fontsize=6,
                        color="white" if value < 0.6 * top else "black")
        imbalance = load.max(1) / np.maximum(load.mean(1), 1e-12)
        ax.set_yticks(range(layers), [f"MoE layer {i} ({b:.2f})" for i, b in enumerate(imbalance)], fontsize=7)
        ax.set_xlabel("expert")
        head = f"{title}: " if title else ""
        wrapped_title(ax, f"{head}{int(load.sum())} assignments over {layers} MoE layers x {experts} experts "
                          f"(row label: max/mean)", fontsize=8)
    axes[-1].figure.colorbar(image, ax=axes, label="tokens / even share" if share else "tokens routed",
                             fraction=0.05)
    return axes


def _share(load: np.ndarray) -> np.ndarray:
    return load / np.maximum(load.mean(1, keepdims=True), 1e-12)
