"""``packfwd.ops.zero_groups``: the kernel zeroes exactly the groups the mask names, leaves the others' bits (NaN
included) as they were, and equals ``masked_fill_``; no group, all groups, a group smaller and larger than a
program's block, bad masks raise.  On a CUDA GPU or in Triton's interpreter (``TRITON_INTERPRET=1``).
"""

import pytest
import torch

from packfwd.ops import zero_groups as K

from ._kernel_device import DEVICE, needs_kernels

pytestmark = [needs_kernels]
triton = pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(5, 3, 7), (3, 5000), (1, 4)])
def test_zeroes_the_named_groups_only(shape, dtype):
    g = torch.Generator().manual_seed(shape[0])
    x = torch.randn(shape, generator=g).to(dtype)
    x[0].view(-1)[0] = float("nan")  # bits of a kept group stay as they are
    for mask in (torch.rand(shape[0], generator=g) > 0.5, torch.zeros(shape[0], dtype=torch.bool),
                 torch.ones(shape[0], dtype=torch.bool)):
        got = K.launch(x.clone().to(DEVICE), mask.to(DEVICE)).cpu()
        want = x.clone().masked_fill_(mask.view(-1, *(1,) * (x.dim() - 1)), 0)
        assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_bad_masks_raise():
    x = torch.zeros(3, 2, device=DEVICE)
    with pytest.raises(ValueError, match="empty must be a bool"):
        K.zero_groups_(x, torch.zeros(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="empty must be a bool"):
        K.zero_groups_(x, torch.zeros(2, dtype=torch.bool, device=DEVICE))
