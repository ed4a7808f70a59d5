"""A value model's output layer (:class:`ValueHead`, width 1) and :func:`is_value_model`.  Imports no
Megatron-Core at import time."""

from __future__ import annotations

import torch

from packfwd._validate import unwrap

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


def is_value_model(model: torch.nn.Module) -> bool:
    """True if ``model`` (possibly wrapped) ends in a :class:`ValueHead`.

    >>> from packfwd.models import ModelArgs, build_model
    >>> args = ModelArgs(vocab_size=128, hidden_size=64, ffn_hidden_size=128, num_layers=1, num_attention_heads=4,
    ...                  value_head=True)
    >>> is_value_model(build_model(args, init=False)), is_value_model(torch.nn.Linear(2, 2))
    (True, False)
    """
    return isinstance(getattr(unwrap(model), "output_layer", None), ValueHead)
