"""Plain per-sequence loops: the independent references the transforms are checked against."""

from __future__ import annotations

import math

import torch


def ref_sequences(x: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Each row's real tokens, in order."""
    return [x[i][mask[i].bool()] for i in range(mask.shape[0])]


def ref_unpad(x, mask):
    seqs = ref_sequences(x, mask)
    if not seqs:
        return x.reshape(0, *x.shape[2:])
    return torch.cat(seqs)


def ref_padded_lengths(lengths: list[int], tp: int, cp: int, align: int | None) -> list[int]:
    """The documented rule: round each length up to the alignment (2*cp under CP, 1 without, unless given), then
    grow the last sequence until the total divides by lcm(align, tp*cp)."""
    a = align if align is not None else (2 * cp if cp > 1 else 1)
    p = [math.ceil(n / a) * a for n in lengths]
    unit = math.lcm(a, tp * cp)
    while p and sum(p) % unit:
        p[-1] += a
    return p


def ref_thd_rank(x, mask, tp, cp, rank, align=None):
    """This rank's THD tensor, built sequence by sequence with slicing (no index arithmetic shared with packfwd)."""
    seqs = ref_sequences(x, mask)
    p = ref_padded_lengths([len(s) for s in seqs], tp, cp, align)
    parts = []
    for seq, pl in zip(seqs, p):
        padded = torch.zeros((pl, *x.shape[2:]), dtype=x.dtype)
        padded[: len(seq)] = seq
        if cp == 1:
            parts.append(padded)
            continue
        chunks = padded.chunk(2 * cp) if pl else []
        if pl:
            parts += [chunks[rank], chunks[2 * cp - 1 - rank]]
    if not parts:
        return x.new_zeros((0, *x.shape[2:]))
    return torch.cat(parts)


def ref_verl_layout(x, mask, tp, cp, rank):
    """The layout verl's packing builds for CP rank ``rank``, written from its definition: each sequence padded to a
    multiple of ``tp*cp*2`` (``tp`` without CP) and, under CP, this rank's half-chunks ``rank`` and ``2cp-1-rank``
    taken from the front and from the back of the padded sequence."""
    align = tp * cp * 2 if cp > 1 else tp
    out = []
    for i in range(mask.shape[0]):
        d = x[i][mask[i].bool()]
        n = d.shape[0]
        pl = (n + align - 1) // align * align
        if cp == 1:
            seg = torch.zeros((pl, *x.shape[2:]), dtype=x.dtype)
            seg[:n] = d
            out.append(seg)
            continue
        half = pl // cp // 2
        seg = torch.zeros((2 * half, *x.shape[2:]), dtype=x.dtype)
        front = d[half * rank : half * (rank + 1)]
        seg[: front.shape[0]] = front
        back_start = pl - half * (rank + 1)
        back = d[back_start : pl - half * rank]
        seg[half : half + back.shape[0]] = back
        out.append(seg)
    return torch.cat(out) if out else x.new_zeros((0, *x.shape[2:]))


def ref_masked(x, mask, fill=0):
    """``x`` with ``fill`` at padded positions."""
    m = mask.bool().reshape(*mask.shape, *([1] * (x.dim() - 2)))
    return torch.where(m, x, torch.full_like(x, fill))


def ref_next_token_labels(ids, mask, ignore=-100):
    out = torch.full_like(ids, ignore)
    for i in range(ids.shape[0]):
        cols = mask[i].bool().nonzero().flatten().tolist()
        for a, b in zip(cols, cols[1:]):
            out[i, a] = ids[i, b]
    return out


def ref_positions(lengths_padded, cp, rank):
    pos = []
    for pl in lengths_padded:
        r = list(range(pl))
        if cp == 1:
            pos += r
        elif pl:
            c = pl // (2 * cp)
            pos += r[rank * c : (rank + 1) * c] + r[(2 * cp - 1 - rank) * c : (2 * cp - rank) * c]
    return pos


def assert_equals_hf_per_sequence(hf, logits, ids, mask, atol=1e-10, rtol=0.0, what=""):
    """``logits [b, s, v]`` of a packed forward equal transformers' ``hf`` run on each sequence alone, at the real
    tokens; zero at padding."""
    with torch.no_grad():
        for i in range(ids.shape[0]):
            want = hf(ids[i][mask[i]][None]).logits[0]
            torch.testing.assert_close(logits[i][mask[i]], want, atol=atol, rtol=rtol, msg=f"{what}row {i}")
    assert not logits[~mask].any(), "padding positions must be zero"


def assert_hf_round_trip(hf, tp_size=2):
    """packfwd's weights of ``hf`` convert back to its state dict bit for bit, whole and merged from ``tp_size``
    shards."""
    from packfwd.models import from_hf, megatron_to_hf, to_hf_state_dict
    from packfwd.models.convert.hf import args_from_hf_config
    from packfwd.models.convert.hf_weights import hf_to_megatron

    sd = hf.state_dict()
    back = to_hf_state_dict(from_hf(hf))
    assert sorted(back) == sorted(sd) and all(torch.equal(back[n], t) for n, t in sd.items())
    args = args_from_hf_config(hf.config)
    shards = [hf_to_megatron(sd, args, tp_size=tp_size, tp_rank=r) for r in range(tp_size)]
    merged = megatron_to_hf(shards, args)
    assert sorted(merged) == sorted(sd) and all(torch.equal(merged[n], t) for n, t in sd.items())


def hf_float64_module(name: str):
    """A copy of transformers' modeling module ``name`` (e.g. ``"transformers.models.qwen3_next.modeling_qwen3_next"``)
    with the float32 upcasts of its linear-attention, norm and router code lifted to float64, so that a float64 model
    of it is float64 throughout: ``torch.float32`` -> ``torch.float64``, ``.float()`` -> ``.double()``, the router's
    ``softmax(..., dtype=torch.float, dim=-1)`` -> ``torch.float64``.  The RoPE angles keep float32
    (``position_ids[..., None].float()``, ``inv_freq.float()``: transformers 5.17's spelling too), as packfwd computes
    them.  One copy per module, registered in
    ``sys.modules`` under ``._f64_modeling_...``."""
    import importlib
    import importlib.util
    import sys

    original = importlib.import_module(name)
    lifted = name.replace(".modeling_", "._f64_modeling_")
    if lifted in sys.modules:
        return sys.modules[lifted]
    source = open(original.__file__).read()
    # the RoPE angles' float32 casts, as transformers 5.17 to 5.25 write them (packfwd computes them in float32)
    keep = ("position_ids[..., None].float()", "position_ids_expanded.float()", "inv_freq.float()",
            "inv_freq_expanded.float()", "[:, :, None, :].float()")
    assert source.count(".to(torch.float32") >= 4 and source.count("A_log.float()") == 1, "transformers changed"
    for i, text in enumerate(keep):
        source = source.replace(text, f"@KEEP{i}@")
    source = (source.replace("torch.float32", "torch.float64").replace(".float()", ".double()")
              .replace("dtype=torch.float, dim=-1", "dtype=torch.float64, dim=-1"))
    for i, text in enumerate(keep):
        source = source.replace(f"@KEEP{i}@", text)
    spec = importlib.util.spec_from_loader(lifted, loader=None, origin=original.__file__)
    module = importlib.util.module_from_spec(spec)
    module.__package__, module.__file__ = original.__package__, original.__file__
    sys.modules[lifted] = module  # before exec: transformers reads its classes' annotations from sys.modules
    exec(compile(source, original.__file__, "exec"), module.__dict__)
    return module


def rmsnorm_in_input_dtype(self, x):
    """A transformers RMSNorm's ``forward`` computed in the input's dtype (transformers casts to float32): set it on a
    family's norm class (``monkeypatch.setattr(SomeRMSNorm, "forward", rmsnorm_in_input_dtype)``) so that a float64
    model is float64 throughout, as packfwd's norm is."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))
