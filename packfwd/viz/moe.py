"""Expert load as a picture: MoE layers x experts, from the routing statistics a forward records.

``draw_expert_load(ax, stats)`` takes what :func:`packfwd.models.mlp.moe.routing_stats` yields (a list of
``RoutingStats``, one per MoE layer), one ``RoutingStats``, or a ``[layers, E]`` count of tokens per expert (e.g.
transformers' router logits, top-k counted).  Pass a dict of them to compare, e.g. with and without padding routed:
one heat map each, on one colour scale.  ``draw_routing_agreement(ax, first, second)`` compares two routing
records (``make_forward(..., record_routing=True)``'s ``"routed_experts"``, what router replay replays): per MoE
layer, the share of real tokens that keep their experts.  matplotlib is imported only when it runs.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .inputs import expert_load
from .style import wrapped_title

__all__ = ["draw_expert_load", "draw_routing_agreement", "routing_agreement"]

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


def routing_agreement(first, second) -> dict[str, list[float]]:
    """How alike two routings of one batch are, per MoE layer, over the real tokens: ``"same"``, the share of tokens
    sent to the same set of experts; ``"overlap"``, the mean share of a token's ``k`` experts the two have in common.
    ``first``, ``second``: records ``[b, s, L, k]`` (``make_forward(..., record_routing=True)``'s
    ``"routed_experts"``, -1 at padding), e.g. the rollout's and the trainer's own, or before and after an update.

    >>> import torch
    >>> a = torch.tensor([[[[0, 1]], [[2, 3]], [[-1, -1]]]])   # [1, 3, 1, 2]: two tokens, one padding slot
    >>> routing_agreement(a, torch.tensor([[[[1, 0]], [[2, 0]], [[-1, -1]]]]))
    {'same': [0.5], 'overlap': [0.75]}
    """
    a, b = (_record(r, name) for r, name in ((first, "first"), (second, "second")))
    if a.shape != b.shape:
        raise ValueError(f"first has shape {tuple(a.shape)} and second {tuple(b.shape)}; pass two records "
                         "[b, s, L, k] of the same batch and model")
    real = (a >= 0).all(-1).all(-1) & (b >= 0).all(-1).all(-1)  # [b, s]
    a, b = a[real], b[real]  # [t, L, k]
    same = (a.sort(-1).values == b.sort(-1).values).all(-1).double()  # [t, L]
    overlap = (a[..., :, None] == b[..., None, :]).any(-1).double().mean(-1)  # [t, L]
    n = max(int(real.sum()), 1)
    return {"same": (same.sum(0) / n).tolist(), "overlap": (overlap.sum(0) / n).tolist()}


def _record(r, name: str):
    import torch

    if not isinstance(r, torch.Tensor) or r.is_floating_point() or r.dim() != 4:
        got = f"a {r.dtype} tensor of shape {tuple(r.shape)}" if isinstance(r, torch.Tensor) else type(r).__name__
        raise TypeError(f"{name} is {got}; pass a routing record [b, s, L, k] of expert ids (-1 at padding), "
                        "make_forward(..., record_routing=True)'s \"routed_experts\"")
    if r.is_nested:
        raise TypeError(f"{name} is a jagged record; pass {name}.to_padded_tensor(-1)")
    return r.detach().cpu().long()


def draw_routing_agreement(ax, first, second, *, labels: tuple[str, str] = ("first", "second")):
    """Bars per MoE layer of :func:`routing_agreement`: the share of real tokens routed to the same experts, and
    the mean share of their experts in common.  Returns ``ax``.

    >>> import torch
    >>> from matplotlib.figure import Figure
    >>> a = torch.tensor([[[[0, 1]], [[2, 3]]]])
    >>> ax = draw_routing_agreement(Figure().subplots(), a, torch.tensor([[[[1, 0]], [[2, 0]]]]))
    >>> [float(p.get_height()) for p in ax.patches]
    [0.5, 0.75]
    """
    agree = routing_agreement(first, second)
    layers = np.arange(len(agree["same"]))
    ax.bar(layers - 0.2, agree["same"], width=0.4, label="same experts (all k)")
    ax.bar(layers + 0.2, agree["overlap"], width=0.4, label="experts in common")
    ax.set_xticks(layers.tolist(), [str(i) for i in layers] if len(layers) <= 48 else [""] * len(layers),
                  fontsize=7)
    ax.set_xlabel("MoE layer")
    ax.set_ylim(0, 1.15)
    ax.set_ylabel("share of real tokens", fontsize=8)
    ax.legend(fontsize=7, frameon=False, ncols=2, loc="upper left")
    mean = float(np.mean(agree["same"])) if agree["same"] else 1.0
    wrapped_title(ax, f"routing {labels[1]} against {labels[0]}: {100 * mean:.1f}% of the tokens keep their experts "
                      f"(mean over layers)", fontsize=8)
    return ax
