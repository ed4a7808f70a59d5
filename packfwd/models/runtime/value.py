"""A value model's output layer (:class:`ValueHead`, width 1) and :func:`is_value_model`.  Imports no
Megatron-Core at import time."""

from __future__ import annotations

import torch

from packfwd.engine.facts import is_value_model as is_value_model  # what the engine reads: ValueHead.value_head

__all__ = ["ValueHead", "is_value_model"]


class ValueHead(torch.nn.Linear):
    """The width-1 output layer of a value model, called like Megatron's output layer:
    ``(hidden [s, b, h], weight=None, runtime_gather_output=None) -> ([s, b, 1], None)``.

    Replicated on every TP rank; under sequence parallelism the token slices are gathered first.

    >>> import torch
    >>> head = ValueHead(4, bias=False)
    >>> head(torch.ones(3, 2, 4))[0].shape
    torch.Size([3, 2, 1])
    """

    value_head = True  # what packfwd.engine.facts.is_value_model reads

    def __init__(self, hidden_size: int, *, bias: bool, dtype: torch.dtype = torch.float32,
                 sequence_parallel: bool = False, tp_group=None):
        super().__init__(hidden_size, 1, bias=bias, dtype=dtype)
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, group=self.tp_group)
        return super().forward(hidden), None
