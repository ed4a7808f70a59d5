"""What a layer component is: a token mixer (:mod:`packfwd.models.mixers`) or an MLP (:mod:`packfwd.models.mlp`)
owns the :class:`~packfwd.models.args.ModelArgs` fields that describe it, the Megatron-Core config fields and layer
spec they become, and its weight mapping, a declarative table (:mod:`packfwd.models.mapping`).  Everything that
builds or converts a model asks the layer's components instead of branching on their kinds: ``ModelArgs`` its
checks, ``transformer_config`` its config fields, ``layer_spec`` its spec, the weight conversion its table.

A component is an object with the methods of :class:`Component`; subclass it and override what differs (a
component whose weights cannot be a table, the routed experts, overrides :meth:`Component.hf_to_megatron` and
:meth:`Component.megatron_to_hf`).  No Megatron-Core at import.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from torch import Tensor

from .mapping import Weight, rows_to_hf, rows_to_megatron

__all__ = ["Component"]


class Component:
    """One kind of layer part.  ``args`` is the model's :class:`~packfwd.models.args.ModelArgs`; ``layer`` a global
    layer index (0-based; an MTP layer is ``num_layers``).

    >>> Component().weights(None), Component().config_fields(None)
    ((), {})
    """

    name = "component"  # what errors and docs call it
    fields: tuple[str, ...] = ()  # the ModelArgs fields it owns

    def check(self, args) -> None:
        """ValueError / TypeError naming the field and the fix, for ``args`` this component cannot build."""

    def config_fields(self, args) -> dict:
        """Megatron-Core ``TransformerConfig`` fields of this component for ``args``."""
        return {}

    def finish_config(self, config, args) -> None:
        """Set what Megatron-Core's config refuses at construction but builds right (MoE: one softmax-routed expert,
        renormalised); nothing by default."""

    def layer_spec(self, args, layer: int, **params):
        """The ``ModuleSpec`` of this part of global layer ``layer`` (``params``: the layer's build options)."""
        raise NotImplementedError(f"{type(self).__name__} builds no layer spec")

    def tp_widths(self, args) -> tuple[tuple[str, int], ...]:
        """The (name, width) pairs tensor parallelism splits (each must divide by the TP size)."""
        return ()

    def weights(self, args) -> tuple[Weight, ...]:
        """One layer's mapping table (names under ``decoder.layers.{j}.`` and ``model.layers.{i}.``)."""
        return ()

    def hf_to_megatron(self, args, sd: Mapping[str, Tensor], hf_layer: str, mg_layer: str, *, tp_size: int,
                       tp_rank: int) -> dict[str, Tensor]:
        """TP rank ``tp_rank``'s Megatron tensors of one layer's part: :meth:`weights` applied."""
        return rows_to_megatron(self.weights(args), args, sd, hf_layer, mg_layer, tp_size, tp_rank)

    def megatron_to_hf(self, args, shards: Sequence[Mapping[str, Tensor]], mg_layer: str,
                       hf_layer: str) -> dict[str, Tensor]:
        """The inverse: the HF tensors of one layer's part from every TP rank's state dict, in rank order."""
        return rows_to_hf(self.weights(args), args, shards, mg_layer, hf_layer)
