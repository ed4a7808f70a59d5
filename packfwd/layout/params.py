"""Megatron-Core's ``PackedSeqParams`` as a THD plan hands them to a model: the same fields, plus the plan's
context-parallel place and, once the model adds them, the tokens' RoPE positions.

The CP place (:class:`CpPlace`: ``size``, ``rank``) is one frozen value, made by the plan that packed the batch for
that rank (``ThdInfo.packed_seq_params()``) and carried to the attention in the params (field ``cp``), so the
attention never re-derives it: packfwd's model checks it once per forward against the CP group its attention
communicates over, and its core attention reads it.  Params made elsewhere (verl's own) carry none (``cp=None``);
the model then takes the place from the group and carries it on.  ``position_ids`` (``[t]``, multimodal ``[3,
t]``): the caller's positions, added by the model for its core attention's RoPE.  ``layout_pads`` (``[1, t]``
bool): the plan's ``padding_mask()``, which an MoE model's routers skip when its caller passes no ``padding_mask``.
``bucket``: the :class:`~packfwd.layout.bucket.Bucket` that fixed every shape of the plan (None: shapes of the
batch's own): the batch's shapes recur, so the automatic attention takes cuDNN's, which builds a graph per shape,
where it has passed its check (:mod:`packfwd.models.mixers.varlen`).

The params class subclasses Megatron-Core's (not frozen: Megatron-Core's is not, and verl's MTP path sets an
attribute on it); Megatron-Core is imported when the first params are built, not at import.
"""

from __future__ import annotations

import dataclasses
import functools

from torch import Tensor

from . import display

__all__ = ["CpPlace", "cp_place", "thd_params", "with_cp", "with_positions"]


@dataclasses.dataclass(frozen=True)
class CpPlace:
    """This rank's place in the context-parallel split a THD batch was packed for: rank ``rank`` of ``size``.

    >>> CpPlace(2, 1)
    CpPlace(size=2, rank=1)
    """

    size: int = 1
    rank: int = 0


def thd_params(info):
    """The ``PackedSeqParams`` of a THD plan ``info``: its real and padded ``cu_seqlens``, ``max_seqlen`` and
    ``cp=CpPlace(info.cp_size, info.cp_rank)``.

    >>> import torch
    >>> from packfwd.layout import plan_thd
    >>> params = thd_params(plan_thd(torch.ones(1, 8, dtype=torch.bool), cp_size=2, cp_rank=1))
    >>> params.qkv_format, params.cu_seqlens_q_padded.tolist(), params.cp
    ('thd', [0, 8], CpPlace(size=2, rank=1))
    """
    return params_class()(
        qkv_format="thd",
        cu_seqlens_q=info.cu_seqlens,
        cu_seqlens_kv=info.cu_seqlens,
        cu_seqlens_q_padded=info.cu_seqlens_padded,
        cu_seqlens_kv_padded=info.cu_seqlens_padded,
        max_seqlen_q=info.max_seqlen,
        max_seqlen_kv=info.max_seqlen,
        cp=CpPlace(info.cp_size, info.cp_rank),
        layout_pads=info.padding_mask(),
        bucket=info.bucket,
    )


def cp_place(params) -> CpPlace | None:
    """The CP place ``params`` carry, or None (params made elsewhere)."""
    return getattr(params, "cp", None)


def with_cp(params, place: CpPlace):
    """``params`` carrying ``place`` (the same object when they already do)."""
    return params if cp_place(params) == place else _as_packfwd(params, cp=place)


def with_positions(params, positions: Tensor):
    """``params`` carrying ``position_ids`` (``[t]`` or ``[3, t]``) for packfwd's core attention's RoPE."""
    return _as_packfwd(params, position_ids=positions)


def _as_packfwd(params, **changes):
    if isinstance(params, params_class()):
        return dataclasses.replace(params, **changes)
    own = [f.name for f in dataclasses.fields(params_class()) if f.init and f.name not in changes]
    fields = {name: getattr(params, name) for name in own if hasattr(params, name)}
    out = params_class()(**fields, **changes)
    out.__dict__.update({k: v for k, v in vars(params).items() if k not in fields})  # attributes set on them
    return out


@functools.lru_cache(maxsize=None)
def params_class() -> type:
    """Megatron-Core's ``PackedSeqParams`` with ``cp`` (:class:`CpPlace`), ``position_ids``, ``layout_pads`` and
    ``bucket``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return dataclasses.make_dataclass(
        "PackfwdSeqParams",
        [("cp", CpPlace, dataclasses.field(default=None)), ("position_ids", Tensor, dataclasses.field(default=None)),
         ("layout_pads", Tensor, dataclasses.field(default=None)), ("bucket", object, dataclasses.field(default=None))],
        bases=(PackedSeqParams,),
        namespace={"__module__": __name__, "__repr__": _params_repr, "_repr_html_": _params_html},
        repr=False,
    )


def _params_fields(params) -> list[tuple[str, str]]:
    """The params' fields for people: tensors as dtype, shape and a few values (one host read); a kv field that is
    the q tensor itself is said so; fields at their default (None) are left out."""
    names = [f.name for f in dataclasses.fields(params)]
    values = {n: getattr(params, n) for n in names}
    cu = [n for n in names if n.startswith("cu_seqlens") and isinstance(values[n], Tensor)]
    read = dict(zip(cu, display.host_lists(*(values[n] for n in cu)) or [None] * len(cu)))
    rows = []
    for n in names:
        v = values[n]
        if v is None:
            continue
        twin = n.replace("_kv", "_q")
        if twin != n and isinstance(v, Tensor) and values.get(twin) is v:
            rows.append((n, f"{twin} (the same tensor)"))
        elif n in read:
            rows.append((n, display.tensor_text(v) + ("" if read[n] is None else f" {display.short_ints(read[n])}")))
        elif isinstance(v, Tensor):
            rows.append((n, display.tensor_text(v)))
        else:
            text = repr(v)
            rows.append((n, text if len(text) <= 60 else f"{type(v).__name__}(...)"))
    return rows


def _params_repr(self) -> str:  # for people: shapes and a few offsets, not the tensors
    return display.block(type(self).__name__, [f"{k}={v}" for k, v in _params_fields(self)])


def _params_html(self) -> str:
    return display.html_table(type(self).__name__, _params_fields(self))
