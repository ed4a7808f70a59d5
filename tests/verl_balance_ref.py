"""verl 0.9.1's micro-batch planning (``verl/utils/seqlen_balancing.py``), loaded without the rest of verl, and
run the way verl's trainer runs it on a global batch: the DP split of ``_balance_batch`` (Karmarkar-Karp into
``dp_size`` parts of equal size on ``calculate_workload``), then ``rearrange_micro_batches`` on each rank with
the micro-batch count agreed across ranks (verl all-reduces it; here the count is raised until every rank
returns the same one).

The module imports ``DataProto`` and a tensordict helper it does not need for planning; both are stood in for
while it loads.  ``rearrange_micro_batches`` is given each rank's lengths as a "nested" ``input_ids`` stand-in
(its ``offsets``), so no ``[b, s]`` mask has to be built, and its index selection returns the indices.
"""

from __future__ import annotations

import importlib.util
import types

import torch

from .verl_ref import load_with_stubs


def load_verl_balancing():
    """verl's ``verl.utils.seqlen_balancing`` module object, or None when verl is not installed."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = spec.submodule_search_locations[0]
    stubs = {
        "verl": types.ModuleType("verl"),
        "verl.protocol": types.SimpleNamespace(DataProto=object),
        "verl.utils": types.ModuleType("verl.utils"),
        "verl.utils.tensordict_utils": types.SimpleNamespace(index_select_tensor_dict=lambda batch, idx: idx),
        "verl.utils.device": types.SimpleNamespace(get_device_name=lambda: "cpu"),
    }
    stubs["verl.utils"].tensordict_utils = stubs["verl.utils.tensordict_utils"]
    return load_with_stubs(f"{root}/utils/seqlen_balancing.py", "packfwd_ref_verl_balancing", stubs)


class _Lengths:
    """What ``rearrange_micro_batches`` reads of a nested ``input_ids``: ``is_nested`` and ``offsets()``."""

    is_nested = True

    def __init__(self, lengths: list[int]):
        self._offsets = torch.tensor([0, *lengths], dtype=torch.long).cumsum(0)

    def offsets(self) -> torch.Tensor:
        return self._offsets


def verl_plan(verl, seqlens: list[int], *, max_token_len: int, dp_size: int = 1,
              multiple_of: int | None = None) -> list[list[list[int]]]:
    """``[dp_rank][mb] -> global indices`` as verl plans them (see the module docstring).  ``max_token_len``:
    verl's budget on the raw token sum of a micro-batch (``max_token_len_per_gpu * cp_size`` in its Megatron
    engine)."""
    workload = verl.calculate_workload(torch.tensor(seqlens, dtype=torch.long)).tolist()
    if dp_size > 1:
        ranks = verl.get_seqlen_balanced_partitions(workload, k_partitions=dp_size, equal_size=True)
    else:
        ranks = [list(range(len(seqlens)))]
    count, plans = 1, None
    while True:
        plans = []
        for rows in ranks:
            local = [seqlens[i] for i in rows]
            _, parts = verl.rearrange_micro_batches({"input_ids": _Lengths(local)}, max_token_len,
                                                    num_batches_divided_by=multiple_of, min_num_micro_batch=count)
            plans.append([[rows[j] for j in part] for part in parts])
        counts = {len(p) for p in plans}
        if counts == {count}:
            return plans
        count = max(counts)


def verl_kk(verl, seqlens: list[int], *, max_token_len: int) -> list[list[int]]:
    """``get_seqlen_balanced_partitions`` alone, with verl's first count ``ceil(total / max_token_len)``: what verl
    ran before its count loop (and what a caller of the function gets)."""
    parts = -(-sum(seqlens) // max_token_len)
    workload = verl.calculate_workload(torch.tensor(seqlens, dtype=torch.long)).tolist()
    return verl.get_seqlen_balanced_partitions(workload, k_partitions=parts, equal_size=False)
