"""A stand-in packed forward for the GPU tests: THD packing, a causal attention over cu_seqlens_padded
(``torch.nn.attention.varlen.varlen_attn``) between two small linear maps, and unpacking."""

from __future__ import annotations

import inspect

import torch

from packfwd import from_thd, to_thd

HEADS, HEAD_DIM = 4, 64


def causal_varlen_attn(q, k, v, cu, max_seqlen):
    from torch.nn.attention.varlen import varlen_attn

    if "is_causal" in inspect.signature(varlen_attn).parameters:
        return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, is_causal=True)
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, window_size=(-1, 0))


def make_weights(hidden: int, device, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    w_qkv = torch.randn(hidden, 3 * HEADS * HEAD_DIM, generator=g, device=device, dtype=dtype) / hidden**0.5
    w_out = torch.randn(HEADS * HEAD_DIM, hidden, generator=g, device=device, dtype=dtype) / (HEADS * HEAD_DIM) ** 0.5
    return w_qkv, w_out


def forward(x, info, weights, attention: bool = True):
    """x: [b, s, hidden] -> [b, s, hidden], computed on the THD tokens only (cp_size must be 1)."""
    w_qkv, w_out = weights
    h = to_thd(x, info)[0]  # [t, hidden]
    qkv = (h @ w_qkv).view(h.shape[0], 3, HEADS, HEAD_DIM)
    q, k, v = qkv.unbind(1)
    if attention:
        o = causal_varlen_attn(q, k, v, info.cu_seqlens_padded, info.max_seqlen)
    else:
        o = torch.nn.functional.gelu(q) * v
    y = o.reshape(h.shape[0], HEADS * HEAD_DIM) @ w_out
    return from_thd(y, info)
