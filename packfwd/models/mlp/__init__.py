"""The MLPs of a decoder layer: the Mixture-of-Experts layer and its parts.

:mod:`~packfwd.models.mlp.moe` (the MLP kind of ``Moe``: config fields, layer spec), :mod:`~packfwd.models.mlp.router`
(``PackedRouter``), :mod:`~packfwd.models.mlp.experts` (grouped experts), :mod:`~packfwd.models.mlp.dispatch` (the
token dispatchers), :mod:`~packfwd.models.mlp.routing` (routing statistics, the load-balancing loss),
:mod:`~packfwd.models.mlp.aux_loss` (a model's auxiliary loss), :mod:`~packfwd.models.mlp.moe_weights` (HF weights).

Importing this package does not import Megatron-Core.
"""

__all__: list[str] = []
