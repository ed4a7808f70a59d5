"""Multimodal positions on CUDA: ``mrope_position_ids`` of CUDA tensors equals the CPU result and transformers'
``get_rope_index`` run on the same CUDA tensors (the GPU machine's transformers version), and ``pack_positions``
with plans made on CUDA (the Triton planning kernel where it is available) equals the CPU plans' result, for
unpad, THD (tp, cp, every rank) and BSHD, round trip included.

    PYTHONPATH=. python -m pytest -q tests/gpu/test_vision_positions_cuda.py
"""

import random

import pytest
import torch

import packfwd as pf
from packfwd.vision import mrope_position_ids

from ..test_vision_positions import HF5, IDS, IMAGE, START, END, VIDEO, WHOLE_SECONDS, hf_rope_index

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def random_batch(seed: int):
    """A padded text+image+video batch (left or right padding per row), its grids and seconds per grid."""
    rng = random.Random(seed)
    merge = rng.choice([1, 2])
    rows, images, videos, seconds = [], [], [], []
    for _ in range(rng.randint(1, 6)):
        row = []
        for _ in range(rng.randint(0, 4)):
            row += [rng.randint(10, 99) for _ in range(rng.randint(0, 5))]
            video = rng.random() < 0.4
            t, h, w = rng.randint(1, 4 if video else 1), merge * rng.randint(1, 4), merge * rng.randint(1, 4)
            row += [START] + [VIDEO if video else IMAGE] * (t * h * w // merge**2) + [END]
            (videos if video else images).append([t, h, w])
            if video:
                seconds.append(float(rng.randint(1, 3)) if WHOLE_SECONDS else rng.choice([0.5, 1.0, 1.5, 2.0]))
        rows.append(row + [rng.randint(10, 99) for _ in range(rng.randint(1, 5))])
    s = max(map(len, rows)) + rng.randint(0, 4)
    ids = torch.zeros(len(rows), s, dtype=torch.long)
    mask = torch.zeros(len(rows), s, dtype=torch.bool)
    for i, row in enumerate(rows):
        cols = slice(s - len(row), s) if rng.random() < 0.5 else slice(0, len(row))
        ids[i, cols] = torch.tensor(row)
        mask[i, cols] = True
    grid = lambda g: torch.tensor(g) if g else None  # noqa: E731
    return ids, mask, merge, grid(images), grid(videos), grid(seconds)


def cuda(x):
    return None if x is None else x.cuda()


@pytest.mark.parametrize("seed", range(20))
def test_mrope_on_cuda_equals_cpu_and_transformers(seed):
    ids, mask, merge, images, videos, seconds = random_batch(seed)
    kw = dict(spatial_merge_size=merge, tokens_per_second=2, **IDS)
    cpu = mrope_position_ids(ids, mask, image_grid_thw=images, video_grid_thw=videos, second_per_grid_ts=seconds, **kw)
    gpu = mrope_position_ids(ids.cuda(), mask.cuda(), image_grid_thw=cuda(images), video_grid_thw=cuda(videos),
                             second_per_grid_ts=cuda(seconds), **kw)
    assert gpu[0].is_cuda and all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu))
    if HF5:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

        ref = hf_rope_index(Qwen2_5_VLModel, ids.cuda(), mask.cuda(), merge=merge, tps=2, images=cuda(images),
                            videos=cuda(videos), seconds=cuda(seconds))
        assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, ref))


@pytest.mark.parametrize("seed", range(6))
def test_pack_positions_with_cuda_plans_equals_cpu(seed):
    ids, mask, merge, images, videos, seconds = random_batch(100 + seed)
    pos, _ = mrope_position_ids(ids, mask, image_grid_thw=images, video_grid_thw=videos, spatial_merge_size=merge,
                                **IDS)
    for tp, cp in ((1, 1), (2, 1), (1, 2), (2, 4)):
        on_cpu = [pf.plan_thd(mask, tp_size=tp, cp_size=cp, cp_rank=r) for r in range(cp)]
        on_gpu = [pf.plan_thd(mask.cuda(), tp_size=tp, cp_size=cp, cp_rank=r) for r in range(cp)]
        packed = []
        for a, b in zip(on_cpu, on_gpu):
            want = pf.pack_positions(pos, a)
            got = pf.pack_positions(pos.cuda(), b)
            assert torch.equal(got.cpu(), want)
            assert torch.equal(pf.pack_positions(pos.movedim(0, -1).cuda(), b, coord_dim=-1).cpu(), want.T)
            packed.append(got)
        back = pf.unpack_positions(packed if cp > 1 else packed[0], on_gpu[0])
        assert torch.equal(back.cpu(), pos)
    for plan_cpu, plan_gpu in ((pf.plan_unpad(mask), pf.plan_unpad(mask.cuda())),
                               (pf.plan_bshd(mask, tp_size=2), pf.plan_bshd(mask.cuda(), tp_size=2))):
        got = pf.pack_positions(pos.cuda(), plan_gpu)
        assert torch.equal(got.cpu(), pf.pack_positions(pos, plan_cpu))
        assert torch.equal(pf.unpack_positions(got, plan_gpu).cpu(), pos)
