"""What the pictures take: the objects a user holds, read once into host facts.

A THD picture (``draw_thd``, ``draw_zigzag``, ``describe_thd``, ``attention_work``, ...) takes a ``layout``:

* sequence lengths: a list of ints, a 1-D integer tensor or array;
* a ``[b, s]`` attention mask (bool, or integers 0/1; left padding and holes are fine);
* a plan: a ``ThdInfo`` (of any CP rank: every plan holds the whole layout), the list of every CP rank's
  ``ThdInfo``, or an ``UnpadInfo`` (packed tokens, no alignment or CP).

With lengths or a mask, ``tp_size``, ``cp_size`` and ``seq_align`` say how to pack (defaults 1, 1 and packfwd's
smallest alignment); a plan brings its own, and a different value passed beside it is an error.  Only small host
facts are kept (a length and a padded length per sequence), so any batch size is cheap; a plan's are read back in
one transfer.  Every error names the argument, what it got (its type, never its values) and what to pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from packfwd import BshdInfo, ThdInfo, UnpadInfo
from packfwd.layout import padded_lengths
from packfwd.layout import rules

__all__ = ["ThdFacts", "thd_facts", "mask_of", "host_lengths", "expert_load", "LAYOUT_KINDS"]

LAYOUT_KINDS = ("sequence lengths (a list of ints), a [b, s] attention mask, or a plan (a ThdInfo, the list of every "
                "CP rank's ThdInfo, an UnpadInfo)")


@dataclass(frozen=True)
class ThdFacts:
    """A THD layout on the host: the real and padded length of every sequence, and how it was packed."""

    lengths: np.ndarray  # [n] int64, real tokens of each sequence
    padded: np.ndarray  # [n] int64, its padded length (all CP ranks together)
    tp_size: int
    cp_size: int
    seq_align: int
    what: str  # where it came from, for titles: "lengths", "mask [4, 17]", "ThdInfo", ...
    plan_max_seqlen: int | None = None  # a plan's own max_seqlen (a bucket's, or plan_thd(max_seqlen=)), else None

    @property
    def max_seqlen(self) -> int:
        """What Megatron-Core is given as ``max_seqlen``: the plan's, else the longest padded sequence."""
        if self.plan_max_seqlen is not None:
            return self.plan_max_seqlen
        return int(self.padded.max()) if self.n else 0

    @property
    def n(self) -> int:
        return len(self.lengths)

    @property
    def cu_seqlens(self) -> list[int]:
        return [0, *np.cumsum(self.lengths).tolist()]

    @property
    def cu_seqlens_padded(self) -> list[int]:
        return [0, *np.cumsum(self.padded).tolist()]

    @property
    def total_tokens(self) -> int:
        return int(self.padded.sum())

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def local_tokens(self) -> int:
        return self.total_tokens // self.cp_size

    def chunk(self) -> np.ndarray:
        """``[n]``: tokens per zigzag chunk of every sequence (the whole padded sequence without CP)."""
        return self.padded if self.cp_size == 1 else rules.chunk_size(self.padded, self.cp_size)

    def chunk_owner(self, k: int) -> int:
        """The CP rank that holds chunk ``k`` (of ``2 * cp_size``) of every sequence."""
        return int(rules.zigzag_owner(k, 1, self.cp_size)[0])

    def rank_tokens(self, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(seq, pos, real)``, each ``[local_tokens]``: the sequence of every token of CP rank ``rank``'s THD
        tensor, its position in that padded sequence, and whether it is a real token (not padding)."""
        starts = np.concatenate([[0], np.cumsum(self.padded // self.cp_size)])
        u = np.arange(self.local_tokens)
        seq = np.clip(np.searchsorted(starts[1:], u, side="right"), 0, max(self.n - 1, 0))
        within = u - starts[seq]
        if self.cp_size == 1:
            pos = within
        else:
            pos = rules.zigzag_position(within, self.chunk()[seq], self.cp_size, rank)
        return seq, pos, pos < self.lengths[seq] if self.n else np.zeros(0, dtype=bool)


def host_lengths(values: object, arg: str = "lengths") -> np.ndarray:
    """Sequence lengths as a host int64 array: a list/tuple of ints, a 1-D integer tensor or numpy array."""
    if isinstance(values, Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point or values.dtype == torch.bool:
            raise TypeError(f"{arg} is a {values.dtype} tensor of shape {tuple(values.shape)}; pass 1-D integer "
                            "lengths, or a [b, s] attention mask")
        arr = values.detach().cpu().numpy()
    elif isinstance(values, np.ndarray):
        arr = values
    elif isinstance(values, (list, tuple, range)):
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
            kinds = sorted({type(v).__name__ for v in values if not isinstance(v, (int, np.integer))} or {"bool"})
            raise TypeError(f"{arg} holds {', '.join(kinds)} values; pass {LAYOUT_KINDS}")
        arr = np.asarray(values, dtype=np.int64).reshape(-1)
    else:
        raise TypeError(f"{arg} is a {type(values).__name__}; pass {LAYOUT_KINDS}")
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise TypeError(f"{arg} has shape {arr.shape} and dtype {arr.dtype}; pass 1-D integer lengths, e.g. [5, 17, 3]")
    if arr.size and arr.min() < 0:
        i = int(np.argmin(arr))
        raise ValueError(f"{arg}[{i}] = {int(arr[i])} is negative; lengths must be >= 0, e.g. [5, 17, 3]")
    return arr.astype(np.int64)


def _mask(mask: Tensor, arg: str) -> Tensor:
    """``mask`` checked (2-D, bool or integers 0/1) and as a bool CPU tensor."""
    if mask.dim() != 2:
        raise ValueError(f"{arg} is a tensor of shape {tuple(mask.shape)}; pass a 2-D [b, s] attention mask "
                         "(or 1-D integer lengths)")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(f"{arg} has dtype {mask.dtype}; pass a bool or 0/1 integer mask (mask.bool())")
    mask = mask.detach().cpu()
    if mask.dtype != torch.bool:
        if mask.numel() and (int(mask.min()) < 0 or int(mask.max()) > 1):
            raise ValueError(f"{arg} holds values other than 0 and 1; pass a bool mask or 0/1 integers")
        mask = mask.bool()
    return mask


def _plan_lengths(plan) -> tuple[np.ndarray, np.ndarray | None]:
    """A plan's real and (THD) padded lengths, read back in one transfer."""
    padded = getattr(plan, "cu_seqlens_padded", None)
    both = torch.stack([plan.cu_seqlens, padded]) if padded is not None else plan.cu_seqlens[None]
    both = both.to(torch.long).cpu().numpy()
    return np.diff(both[0]), (np.diff(both[1]) if padded is not None else None)


def _same_plans(plans: Sequence[ThdInfo], arg: str) -> ThdInfo:
    first = plans[0]
    cp = first.cp_size
    ranks = sorted(p.cp_rank for p in plans)
    if ranks != list(range(cp)):
        raise ValueError(f"{arg} holds plans of CP ranks {ranks} but they were planned with cp_size={cp}; pass one "
                         f"ThdInfo per rank 0..{cp - 1} (or a single ThdInfo: any rank's plan holds the whole layout)")
    for p in plans[1:]:
        same = (p.tp_size, p.cp_size, p.seq_align) == (first.tp_size, cp, first.seq_align) and all(
            torch.equal(getattr(p, f).cpu(), getattr(first, f).cpu()) for f in ("cu_seqlens", "cu_seqlens_padded"))
        if not same:
            raise ValueError(f"the plans in {arg} are of different batches or layouts (tp_size, cp_size, seq_align, "
                             "cu_seqlens or cu_seqlens_padded differ); pass the CP ranks' plans of one batch")
    return first


def thd_facts(layout: object, *, tp_size: int | None = None, cp_size: int | None = None,
              seq_align: int | None = None, arg: str = "layout") -> ThdFacts:
    """The THD layout of ``layout`` (lengths, a mask, a plan or every rank's plans; see the module docstring), or
    ``layout`` itself when it is a ``ThdFacts`` already."""
    if isinstance(layout, ThdFacts):
        for key, given in (("tp_size", tp_size), ("cp_size", cp_size), ("seq_align", seq_align)):
            if given is not None and given != getattr(layout, key):
                raise ValueError(f"{arg} has {key}={getattr(layout, key)} but {key}={given} was passed; pass one")
        return layout
    if isinstance(layout, (list, tuple)) and layout and all(isinstance(p, ThdInfo) for p in layout):
        layout = _same_plans(layout, arg)
    if isinstance(layout, (list, tuple)) and any(isinstance(p, (ThdInfo, UnpadInfo, BshdInfo)) for p in layout):
        raise TypeError(f"{arg} is a list holding {sorted({type(p).__name__ for p in layout})}; a list of plans must "
                        "be every CP rank's ThdInfo of one batch")
    if isinstance(layout, BshdInfo):
        raise TypeError(f"{arg} is a BshdInfo, which has no THD layout; draw_mask(ax, plan) draws its compacted "
                        "[b, width] batch, or pass the attention mask to picture its THD layout")
    if isinstance(layout, (ThdInfo, UnpadInfo)):
        return _plan_facts(layout, tp_size, cp_size, seq_align, arg)
    if isinstance(layout, Tensor) and layout.dim() == 2:
        mask = _mask(layout, arg)
        lengths, what = mask.sum(1).numpy().astype(np.int64), f"mask [{mask.shape[0]}, {mask.shape[1]}]"
    else:
        lengths, what = host_lengths(layout, arg), "lengths"
    tp = _size(tp_size, "tp_size")
    cp = _size(cp_size, "cp_size")
    align = rules.check_seq_align(seq_align, cp, tp)
    padded = padded_lengths(lengths, seq_align=align, tp_size=tp, cp_size=cp) if lengths.size else lengths
    return ThdFacts(lengths, np.asarray(padded, dtype=np.int64), tp, cp, align, what)


def _size(value, name: str) -> int:
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__} {value!r}; pass {name}=int(...)")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}; use {name}=1 when that parallelism is off")
    return value


def _plan_facts(plan, tp_size, cp_size, seq_align, arg) -> ThdFacts:
    name = type(plan).__name__
    own = dict(tp_size=1, cp_size=1, seq_align=1) if isinstance(plan, UnpadInfo) else dict(
        tp_size=plan.tp_size, cp_size=plan.cp_size, seq_align=plan.seq_align)
    for key, given in (("tp_size", tp_size), ("cp_size", cp_size), ("seq_align", seq_align)):
        if given is not None and given != own[key]:
            raise ValueError(f"{arg} is a {name} planned with {key}={own[key]} but {key}={given} was passed; pass "
                             f"the plan alone (it brings its own tp_size, cp_size and seq_align), or the mask with "
                             f"{key}={given}")
    lengths, padded = _plan_lengths(plan)
    return ThdFacts(lengths, lengths if padded is None else padded, what=name, plan_max_seqlen=plan.max_seqlen, **own)


def mask_of(what: object, arg: str = "mask") -> tuple[Tensor, str]:
    """A ``[b, s]`` bool CPU mask to draw, and what it is: a mask as given, lengths right-padded, a plan's source
    mask (a ``BshdInfo``: its compacted ``[b, width]`` batch)."""
    if isinstance(what, (list, tuple)) and what and all(isinstance(p, ThdInfo) for p in what):
        what = _same_plans(what, arg)
    if isinstance(what, BshdInfo):
        return what.attention_mask.detach().cpu(), "BshdInfo.attention_mask (the compacted batch)"
    if isinstance(what, (ThdInfo, UnpadInfo)):
        source = what.source
        if source.mask is not None:
            return source.mask.detach().cpu(), f"the mask {type(what).__name__} was planned from"
        lengths, _ = _plan_lengths(what)
        return _right_padded(lengths[: source.batch_size]), f"{type(what).__name__} (nested batch, right-aligned)"
    if isinstance(what, Tensor) and (what.dim() != 1 or what.dtype == torch.bool):
        return _mask(what, arg), "attention_mask"  # a 1-D bool or 3-D tensor: the 2-D error
    try:
        lengths = host_lengths(what, arg)
    except TypeError:
        raise TypeError(f"{arg} is a {type(what).__name__}; pass a [b, s] attention mask, sequence lengths (a list of "
                        "ints) or a plan (UnpadInfo, ThdInfo, BshdInfo)") from None
    return _right_padded(lengths), "lengths, right-padded"


def _right_padded(lengths: np.ndarray) -> Tensor:
    s = int(lengths.max()) if lengths.size else 0
    return torch.arange(s)[None, :] < torch.as_tensor(lengths)[:, None]


def expert_load(stats: object, arg: str = "stats") -> np.ndarray:
    """``[layers, E]`` float64: the tokens routed to each expert of each MoE layer, from a list of ``RoutingStats``
    (what ``routing_stats(model)`` gives), one ``RoutingStats``, or a ``[layers, E]`` / ``[E]`` tensor or array."""
    if hasattr(stats, "tokens_per_expert"):  # one RoutingStats
        stats = [stats]
    if isinstance(stats, (list, tuple)) and stats and all(hasattr(s, "tokens_per_expert") for s in stats):
        sizes = {tuple(s.tokens_per_expert.shape) for s in stats}
        if len(sizes) != 1:
            raise ValueError(f"the RoutingStats in {arg} have tokens_per_expert of shapes {sorted(sizes)}; pass the "
                             "layers of one model (one expert count)")
        rows = torch.stack([s.tokens_per_expert.detach() for s in stats]).to(torch.float64).cpu()
        return rows.numpy()
    if isinstance(stats, (Tensor, np.ndarray)):
        arr = stats.detach().cpu().double().numpy() if isinstance(stats, Tensor) else np.asarray(stats, np.float64)
        if arr.ndim in (1, 2):
            return arr.reshape(-1, arr.shape[-1])
        raise ValueError(f"{arg} has shape {arr.shape}; pass tokens per expert as [layers, E] or [E]")
    raise TypeError(f"{arg} is a {type(stats).__name__}; pass the list of RoutingStats that routing_stats(model) "
                    "records (one per MoE layer), or a [layers, E] tensor of tokens per expert")
