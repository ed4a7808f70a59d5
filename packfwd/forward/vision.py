"""``make_forward(vision=True)``: the hook for models that embed first and pack afterwards.

A vision-language model cannot take packed ids: under context parallelism a CP rank's share of a sequence holds
only part of an image's tokens, while the vision tower needs every image whole, and multimodal RoPE positions
depend on every image's grid.  So, as verl 0.9.1's vision branch of ``model_forward_gen`` does, the model gets
the batch as the caller laid it out, and packs after merging the image features into the token embeddings:

======================  ====================================================  =====================================
keyword                 THD                                                   BSHD
======================  ====================================================  =====================================
``input_ids``           ``[b, s]`` as given (padded)                          ``[b, s_c]`` real tokens moved left
``attention_mask``      ``[b, s]`` as given                                   ``[b, s_c]`` (its dtype), left-aligned
``position_ids``        the caller's ``[3, b, s]`` / ``[b, s]``, or None      the same, moved left, or None
``packed_seq_params``   the batch's ``PackedSeqParams`` (this CP rank's)      (none)
``packing``             a :class:`VisionPacking` of the same plan             a :class:`VisionPacking`
multimodal inputs       ``pixel_values``, ``image_grid_thw``, ... as given    as given
======================  ====================================================  =====================================

verl hands no positions (its vision models compute them); packfwd hands the caller's when given (a model may
use them instead of computing them), else None.  The model embeds ``input_ids``, merges the vision features,
then calls ``packing.embeddings(x)`` to get Megatron-Core's ``decoder_input`` in this rank's layout (THD ``[t, 1,
h]``, zigzag CP share included; BSHD ``[s_c, b, h]``) and ``packing.positions(p)`` for its positions, and returns
its output in that layout (``[1, t, v]`` / ``[b, s_c, v]``), which the forward unpacks as usual.  Image tokens thus
land on the CP rank that holds their text neighbours, with the same plan as everything else.

The plan owns what differs between the layouts (``inputs_to_embed``, ``decoder_input``, ``decoder_positions`` of
``ThdInfo`` and ``BshdInfo``); this module asks no plan which layout it is.

A model must declare the hook: its (unwrapped) ``forward`` has a parameter named ``packing``.  Any other model
gets a TypeError: a model that packs itself (verl's mbridge models pack with verl's alignment) would otherwise pack
a different layout than the ``PackedSeqParams`` it is given; run those through
``packfwd.verl.model_forward_gen(vision_model=True)``, whose layout is verl's.  The packfwd model that takes the
hook is :class:`packfwd.vision.model.VisionLanguageModel`.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import Tensor

from ..layout.bshd import BshdInfo
from ..layout.thd import ThdInfo
from ..engine.checks import check_positions

__all__ = ["VisionPacking", "decoder_input", "packed_positions", "takes_packing", "vision_call", "vision_kwargs"]

HOOK = "packing"


@dataclasses.dataclass(frozen=True)
class VisionPacking:
    """The hook a vision model gets (module docstring): the batch's plan, applied to what the model computed.

    ``embeddings(x)``: :func:`decoder_input`; ``positions(p)``: :func:`packed_positions`.  Pure (a gather); works
    under ``torch.func`` and ``torch.compile`` like every packfwd transform.

    >>> import torch
    >>> from packfwd import plan_thd
    >>> mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]).bool()
    >>> hook = VisionPacking(plan_thd(mask))
    >>> hook.embeddings(torch.arange(8.0).reshape(2, 4, 1)).flatten().tolist()   # [t, 1, h]
    [0.0, 1.0, 2.0, 4.0, 5.0]
    """

    plan: ThdInfo | BshdInfo

    def embeddings(self, x: Tensor) -> Tensor:
        return decoder_input(x, self.plan)

    def positions(self, positions: Tensor) -> Tensor:
        return packed_positions(positions, self.plan)


def decoder_input(x: Tensor, plan: ThdInfo | BshdInfo) -> Tensor:
    """Embeddings in the layout of the ids the model was given -> Megatron-Core's ``decoder_input``.

    THD: ``x [b, s, h]`` (the padded batch) -> ``[t_local, 1, h]``, this CP rank's tokens in ``plan``'s order.
    BSHD: ``x [b, s_c, h]`` (the compacted batch the model got) -> ``[s_c, b, h]``.

    >>> import torch
    >>> from packfwd import plan_thd
    >>> mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]).bool()
    >>> x = torch.arange(8.0).reshape(2, 4, 1)
    >>> [decoder_input(x, plan_thd(mask, cp_size=2, cp_rank=r)).flatten().tolist() for r in (0, 1)]
    [[0.0, 3.0, 4.0, 0.0], [1.0, 2.0, 5.0, 0.0]]
    """
    return _plan_method(plan, "decoder_input")(x)


def packed_positions(positions: Tensor, plan: ThdInfo | BshdInfo) -> Tensor:
    """Positions computed on the ids the model was given -> the model's: THD ``[3, b, s]`` -> ``[3, 1, t_local]``
    (``[b, s]`` -> ``[1, t_local]``), pads 0; BSHD: unchanged (already in the compacted layout).

    >>> import torch
    >>> from packfwd import plan_thd
    >>> mask = torch.tensor([[0, 1, 1], [1, 1, 0]]).bool()
    >>> pos = torch.stack([mask.cumsum(1) - 1] * 3) * mask                    # [3, b, s]
    >>> packed_positions(pos, plan_thd(mask))[:, 0].tolist()
    [[0, 1, 0, 1], [0, 1, 0, 1], [0, 1, 0, 1]]
    """
    return _plan_method(plan, "decoder_positions")(positions)


def takes_packing(model: torch.nn.Module) -> bool:
    """Whether ``model`` (possibly wrapped: DDP, Float16Module) declares the hook: a ``packing`` parameter.

    >>> class M(torch.nn.Module):
    ...     def forward(self, input_ids, position_ids, attention_mask, packing=None): ...
    >>> takes_packing(M()), takes_packing(torch.nn.Linear(1, 1))
    (True, False)
    """
    from ..models.runtime.gpt import unwrap  # imports no Megatron-Core

    try:
        return HOOK in inspect.signature(unwrap(model).forward).parameters
    except (TypeError, ValueError):
        return False


def vision_call(step) -> dict:
    """The engine's call strategy of ``make_forward(vision=True)``: :func:`vision_kwargs` of the step."""
    batch = step.batch
    return vision_kwargs(step.model, step.layout, step.plan, step.ids, batch.input_ids, batch.attention_mask,
                         batch.position_ids, step.facts.rope_coords)


def vision_kwargs(model, layout, plan, ids: Tensor, input_ids: Tensor, attention_mask, position_ids,
                  coords: int | str | None) -> dict:
    """The keyword arguments (module docstring's table, multimodal inputs aside) of ``model`` under ``layout``
    (the engine's ``Thd`` / ``Bshd`` adapter) with ``plan``; ``ids``: the packed ids.  ``coords``: the position
    coordinates the model takes (``ModelFacts.rope_coords``), checked in the caller's shapes before the model runs."""
    if not takes_packing(model):
        from ..models.runtime.gpt import unwrap

        raise TypeError(
            f"make_forward(vision=True) gives the model the padded batch and a `packing` argument to pack the "
            f"embeddings it merges; {type(unwrap(model)).__name__}.forward takes no `packing` parameter. Use "
            "packfwd.vision.VisionLanguageModel, add the parameter (call packing.embeddings / packing.positions), "
            "or run a model that packs itself with verl's layout through "
            "packfwd.verl.model_forward_gen(vision_model=True)"
        )
    if input_ids.is_nested:
        raise ValueError("make_forward(vision=True) takes a padded [b, s] batch with its attention_mask, not a jagged "
                         "nested one: pad it (input_ids.to_padded_tensor(pad_id)) and pass the mask")
    if position_ids is not None:
        check_positions(position_ids, input_ids, coords)
    given = _plan_method(plan, "inputs_to_embed")(input_ids, ids, attention_mask, position_ids)
    return dict(zip(("input_ids", "attention_mask", "position_ids"), given), packing=VisionPacking(plan),
                **layout.model_kwargs(plan))


def _plan_method(plan: object, name: str):
    """``plan``'s method ``name``, or a TypeError naming the plans that have it."""
    method = getattr(plan, name, None)
    if not callable(method):
        raise TypeError(f"plan must be a ThdInfo or BshdInfo (a layout plan with {name}), got {type(plan).__name__}")
    return method
