"""The RoPE fields of :class:`~packfwd.models.args.ModelArgs` checked: the fraction of channels rotated
(``rotary_percent``, GLM-4.5's partial RoPE) and the multimodal sections (``mrope_section``, Qwen2-VL; interleaved:
Qwen3.5).  Pure.
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


def check_mrope_section(section, rotary_dims: int, interleaved: bool = False) -> tuple[int, int, int]:
    """``section`` as three positive ints summing to ``rotary_dims // 2`` (the frequencies of the channels RoPE
    rotates: all of ``head_dim``, or ``int(head_dim * rotary_percent)``; :mod:`packfwd.models.mixers.mrope`).
    ``interleaved`` (Qwen3-VL / Qwen3.5's layout): frequency ``j`` takes the height for ``j % 3 == 1, j < 3 h``
    and the width for ``j % 3 == 2, j < 3 w``, so ``3 h - 2`` and ``3 w - 1`` must be frequencies too.

    >>> check_mrope_section([16, 24, 24], 128)
    (16, 24, 24)
    >>> check_mrope_section([11, 11, 10], 64, interleaved=True)
    (11, 11, 10)
    """
    values = tuple(section) if isinstance(section, (list, tuple)) else ()
    if (len(values) != 3 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values)
            or sum(values) * 2 != rotary_dims):
        raise ValueError(
            f"mrope_section={section!r}: pass three positive ints (temporal, height, width frequencies) that sum to "
            f"the rotated channels // 2 = {rotary_dims // 2} (head_dim, or int(head_dim * rotary_percent) with "
            "partial RoPE), as in the HF config's rope_parameters['mrope_section']"
        )
    if interleaved and max(3 * values[1] - 2, 3 * values[2] - 1) >= rotary_dims // 2:
        raise ValueError(
            f"mrope_section={section!r} interleaved over {rotary_dims // 2} frequencies: the height takes frequencies "
            f"1, 4, ..., {3 * values[1] - 2} and the width 2, 5, ..., {3 * values[2] - 1}, past the last one; "
            "pass the config's sections (Qwen3.5: [11, 11, 10] of 32)"
        )
    return values
