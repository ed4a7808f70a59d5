"""The RoPE fields of :class:`~packfwd.models.args.ModelArgs` checked: the fraction of channels rotated
(``rotary_percent``, GLM-4.5's partial RoPE) and the multimodal sections (``mrope_section``, Qwen2-VL).  Pure.
"""

from __future__ import annotations

__all__ = ["check_mrope_section", "check_rotary_percent"]


def check_rotary_percent(percent, kv_channels: int) -> float:
    """``percent`` as a float if ``0 < percent <= 1`` and ``int(kv_channels * percent)`` (the channels RoPE rotates,
    Megatron-Core's and transformers' rounding; the rest pass through) is even and positive; else ValueError.

    >>> check_rotary_percent(0.5, 128)
    0.5
    >>> check_rotary_percent(0.375, 8)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: rotary_percent=0.375 of head_dim=8 rotates int(8 * 0.375) = 3 channels; RoPE turns pairs of ...
    """
    if isinstance(percent, bool) or not isinstance(percent, (int, float)) or not 0 < percent <= 1:
        raise ValueError(f"rotary_percent={percent!r}: pass a float in (0, 1], the fraction of each head's channels "
                         "RoPE rotates (transformers' partial_rotary_factor)")
    dims = int(kv_channels * percent)
    if dims < 2 or dims % 2:
        raise ValueError(f"rotary_percent={percent} of head_dim={kv_channels} rotates int({kv_channels} * {percent}) "
                         f"= {dims} channels; RoPE turns pairs of channels, so pick a fraction giving an even number "
                         ">= 2")
    return float(percent)


def check_mrope_section(section, kv_channels: int) -> tuple[int, int, int]:
    """``section`` as three positive ints summing to ``kv_channels // 2`` (:mod:`packfwd.models.mixers.mrope`).

    >>> check_mrope_section([16, 24, 24], 128)
    (16, 24, 24)
    """
    values = tuple(section) if isinstance(section, (list, tuple)) else ()
    if (len(values) != 3 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values)
            or sum(values) * 2 != kv_channels):
        raise ValueError(
            f"mrope_section={section!r}: pass three positive ints (temporal, height, width frequencies) that sum to "
            f"head_dim // 2 = {kv_channels // 2}, as in the HF config's rope_parameters['mrope_section']"
        )
    return values

