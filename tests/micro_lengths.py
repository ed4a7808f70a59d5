"""Seeded length distributions of RL and SFT batches, shared by the micro-batch tests and benchmark.

* ``uniform``    lengths uniform in ``[1, max_len]``
* ``longtail``   Pareto (Zipf-like): most sequences short, a few very long, clipped at ``max_len``
* ``rl``         a prompt (uniform 32..max_len/8) plus a response (exponential, mean max_len/6; one in five
                 truncated at the generation limit), as an RL rollout gives
* ``ones``       six in ten of length 1, the rest uniform
* ``at_budget``  one in ten exactly ``max_len`` long, the rest uniform in ``[1, max_len/4]``
"""

from __future__ import annotations

import numpy as np

KINDS = ("uniform", "longtail", "rl", "ones", "at_budget")


def lengths(kind: str, n: int, max_len: int, seed: int) -> list[int]:
    """``n`` lengths in ``[1, max_len]`` of distribution ``kind`` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        out = rng.integers(1, max_len + 1, n)
    elif kind == "longtail":
        out = np.floor(max(1, max_len // 256) * (1 + rng.pareto(1.1, n)))
    elif kind == "rl":
        prompt = rng.integers(min(32, max_len), max(min(32, max_len), max_len // 8) + 1, n)
        limit = np.maximum(max_len - prompt, 0)
        response = np.where(rng.random(n) < 0.2, limit, rng.exponential(max_len / 6, n))
        out = prompt + np.minimum(response, limit)
    elif kind == "ones":
        out = np.where(rng.random(n) < 0.6, 1, rng.integers(1, max_len + 1, n))
    elif kind == "at_budget":
        out = np.where(rng.random(n) < 0.1, max_len, rng.integers(1, max(1, max_len // 4) + 1, n))
    else:
        raise ValueError(f"kind={kind!r}; pass one of {KINDS}")
    return np.clip(out, 1, max_len).astype(np.int64).tolist()
