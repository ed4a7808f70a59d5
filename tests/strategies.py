"""Hypothesis strategies for ragged batches: every mask pattern, shape, trailing dims and dtype."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool, torch.float16]
PATTERNS = ["right", "left", "prompt_response", "holes", "empty_rows", "all_empty", "full"]


@st.composite
def masks(draw, max_b: int = 8, max_s: int = 64, min_b: int = 0):
    """A [b, s] bool mask in one of PATTERNS."""
    b = draw(st.integers(min_b, max_b))
    s = draw(st.integers(0, max_s))
    pattern = draw(st.sampled_from(PATTERNS))
    mask = torch.zeros(b, s, dtype=torch.bool)
    for i in range(b):
        if pattern == "all_empty":
            continue
        if pattern == "full":
            mask[i] = True
            continue
        n = draw(st.integers(0, s))
        if pattern == "right":
            mask[i, :n] = True
        elif pattern == "left":
            mask[i, s - n :] = True
        elif pattern == "prompt_response":
            # a left-padded prompt of width w followed by a right-padded response
            w = draw(st.integers(0, s))
            pl = draw(st.integers(0, w))
            rl = draw(st.integers(0, s - w))
            mask[i, w - pl : w] = True
            mask[i, w : w + rl] = True
        elif pattern == "holes":
            bits = draw(st.lists(st.booleans(), min_size=s, max_size=s))
            mask[i] = torch.tensor(bits, dtype=torch.bool) if s else mask[i]
        elif pattern == "empty_rows":
            mask[i, :n] = draw(st.booleans())
    return mask


@st.composite
def batches(draw, max_b: int = 8, max_s: int = 64, dtypes=DTYPES, min_b: int = 0):
    """(x [b, s, *trailing], mask [b, s]) with random non-zero data in a random dtype."""
    mask = draw(masks(max_b=max_b, max_s=max_s, min_b=min_b))
    trailing = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**16))
    x = random_tensor((*mask.shape, *trailing), dtype, seed)
    mask_kind = draw(st.sampled_from(["bool", "int64", "int32", "uint8"]))
    if mask_kind != "bool":
        mask = mask.to(getattr(torch, mask_kind))
    return x, mask


def random_tensor(shape, dtype, seed: int = 0) -> torch.Tensor:
    """Random data without zeros (zeros would hide unwritten or misplaced rows)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool)  # pads are False, so True marks every real slot
    if dtype.is_floating_point:
        x = torch.rand(shape, generator=g, dtype=torch.float64) + 0.5
        sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
        return (x * sign).to(dtype)
    return torch.randint(1, 1000, shape, generator=g, dtype=torch.int64).to(dtype)


parallel = st.tuples(st.integers(1, 8), st.integers(1, 8)).flatmap(
    lambda tc: st.tuples(st.just(tc[0]), st.just(tc[1]), st.integers(0, tc[1] - 1))
)
