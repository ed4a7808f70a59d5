"""Stand-in models for examples and tests of the forwards, with nothing to learn and nothing to download."""

from __future__ import annotations

from types import SimpleNamespace

import torch


class OneHotModel(torch.nn.Module):
    """A model whose "logits" are the one-hot of its input ids, under any packing: ``[..., t] -> [..., t, v]``.

    It carries the config fields packfwd's and verl's forwards read (no sequence or tensor parallelism, no FP8) and
    is a whole model (``pre_process`` and ``post_process``), so the packing is all there is to see.

    >>> OneHotModel(4)(torch.tensor([[1, 3]]), None, None).tolist()
    [[[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]]
    """

    pre_process = post_process = True

    def __init__(self, vocab_size: int = 5):
        super().__init__()
        self.vocab_size = vocab_size
        self.config = SimpleNamespace(sequence_parallel=False, fp8=None)

    def forward(self, input_ids, position_ids, attention_mask, packed_seq_params=None):
        return torch.nn.functional.one_hot(input_ids, self.vocab_size).float()
