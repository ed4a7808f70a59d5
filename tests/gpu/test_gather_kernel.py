"""The Triton row-gather kernel (``packfwd.ops.gather``) against the plain-torch reference, bit for bit (it only
moves bytes): every dtype, rows that move as words of 8, 4, 2 and 1 bytes, widths that end in a partial block of
columns (also under a tiny tiling, so short rows span several blocks), 1 to 4 sources, index offsets, fill
values (NaN and -0.0 included), non-contiguous and misaligned sources, empty inputs; and every transform routed
through the kernel against the torch path (values, gradients, vmap; on the GPU also gradcheck and compile).

Runs on a CUDA GPU, or on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``; see ``_kernel_device``):

    TRITON_INTERPRET=1 python -m pytest -q tests/gpu/test_gather_kernel.py

Under the interpreter the tests call ``_launch`` on CPU tensors, and route the custom op's CPU implementation to
it for the transforms (on CUDA the op launches it by itself).  What the interpreter cannot show: the CUDA
dispatch (``use_op``, the op's CUDA registration and its direct-launch fast path), anything about concurrency
or speed (it runs the programs one after another, with numpy; ``num_warps`` is ignored), and index arithmetic
at sizes it is too slow to reach.  Sources in separate allocations work there as on the GPU: the kernel reads
them through their address offsets from the first source, and the interpreter reads host memory by address.
"""

import pytest
import torch

from packfwd.ops import gather as _gather
from packfwd.ops.gather import _launch, _reference, _word_size

from ..test_gather_op import check_transforms_through_the_op
from ._kernel_device import DEVICE, gpu_only, needs_kernels

pytestmark = [needs_kernels, pytest.mark.filterwarnings("ignore::UserWarning")]
triton = pytest.importorskip("triton")

TINY = {"row_bytes": 16, "tile_bytes": 64, "num_warps": 1}  # many programs per row and per tile, for short rows

# (dtype, trailing shape of a row, the word size it moves in)
CASES = [
    (torch.bfloat16, (4,), 8), (torch.bfloat16, (2,), 4), (torch.bfloat16, (3,), 2), (torch.bfloat16, (), 2),
    (torch.float32, (6,), 8), (torch.float32, (3,), 4), (torch.float32, (), 4), (torch.float16, (5,), 2),
    (torch.float64, (7,), 8), (torch.int64, (), 8), (torch.int64, (5,), 8), (torch.int32, (3,), 4),
    (torch.int8, (12,), 4), (torch.uint8, (3,), 1), (torch.bool, (), 1), (torch.bool, (5,), 1),
    (torch.bool, (6,), 2), (torch.bool, (8,), 8), (torch.bfloat16, (1000,), 8), (torch.float32, (4096,), 8),
]
FILLS = {"float": [0.0, 3.0, -0.0, float("nan")], "signed": [0.0, 7.0, -3.0], "unsigned": [0.0, 7.0], "bool": [0.0, 1.0]}


def fills(dtype):
    if dtype == torch.bool:
        return FILLS["bool"]
    if dtype.is_floating_point:
        return FILLS["float"]
    return FILLS["unsigned" if dtype == torch.uint8 else "signed"]


def rand(shape, dtype, g):
    x = torch.randn(shape, generator=g, device=DEVICE) * 100 + 0.5
    return x.to(dtype)


def assert_same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))  # NaN and -0.0 too


def narrow(trailing):
    return torch.Size(trailing).numel() <= 8


PARAMS = [(i, config) for i, (_, trailing, _) in enumerate(CASES) for config in ("default", "tiny")
          if config == "default" or narrow(trailing)]


@pytest.mark.parametrize("case, config", PARAMS)
def test_kernel_equals_reference(case, config, monkeypatch):
    dtype, trailing, word = CASES[case]
    if config == "tiny":
        monkeypatch.setattr(_gather, "CONFIG", TINY)
    g = torch.Generator(device=DEVICE).manual_seed(case)
    nsrc, offset = [(1, 0), (2, 0), (3, 5), (4, 2)][case % 4]
    fill = fills(dtype)[case % len(fills(dtype))]
    rows, n_out = 37, 301 if DEVICE == "cuda" else 61
    srcs = [rand((rows, *trailing), dtype, g) for _ in range(nsrc)]
    assert _word_size(srcs) == word
    index = torch.randint(-2, rows * nsrc + offset + 3, (n_out,), generator=g, device=DEVICE)
    out = _launch(srcs, index, offset, fill)
    assert_same_bits(out, _reference(srcs, index, offset, fill))


def test_cases_cover_every_word_size_and_both_column_paths():
    """Every word size, and both branches of the kernel: whole blocks of columns and a partial last block."""
    assert {word for _, _, word in CASES} == {8, 4, 2, 1}
    partial = set()
    for config, (dtype, trailing, word) in [(c, CASES[i]) for i, c in PARAMS]:
        width = torch.Size(trailing).numel() * dtype.itemsize // word
        block_w = min(triton.next_power_of_2(width), max(1, (TINY if config == "tiny" else _gather.CONFIG)["row_bytes"] // word))
        partial.add(width % block_w != 0)
    assert partial == {True, False}


def test_kernel_reads_non_contiguous_and_misaligned_sources():
    g = torch.Generator(device=DEVICE).manual_seed(0)
    big = rand((64, 2, 33), torch.float32, g)
    srcs = [big[:32, 0], big[1:33, 1]]  # strided views
    index = torch.randint(-1, 64, (50,), generator=g, device=DEVICE)
    assert_same_bits(_launch(srcs, index, 0, 2.0), _reference(srcs, index, 0, 2.0))
    # rows of 8 bytes at an address that is only 2-byte aligned: moved as 2-byte words
    flat = rand((2 * 37 * 4 + 1,), torch.bfloat16, g)
    srcs = [flat[1 : 1 + 37 * 4].view(37, 4), flat[1 + 37 * 4 :].view(37, 4)]
    assert _word_size(srcs) == 2
    index = torch.randint(-1, 80, (50,), generator=g, device=DEVICE)
    assert_same_bits(_launch(srcs, index, 3, -1.0), _reference(srcs, index, 3, -1.0))


def test_kernel_handles_empty_inputs():
    fill_rows = _launch([torch.randn(0, 8, device=DEVICE)] * 2, torch.tensor([-1, 0, 3], device=DEVICE), 0, 4.0)
    assert torch.equal(fill_rows, torch.full((3, 8), 4.0, device=DEVICE))
    no_rows = torch.empty(0, dtype=torch.long, device=DEVICE)
    assert _launch([torch.randn(5, 8, device=DEVICE)], no_rows, 0, 0.0).shape == (0, 8)
    assert _launch([torch.randn(5, 0, device=DEVICE)], torch.tensor([1, -1], device=DEVICE), 0, 1.0).shape == (2, 0)
    nothing_read = _launch([torch.randn(5, 3, device=DEVICE)], torch.full((4,), -1, device=DEVICE), 0, -2.0)
    assert torch.equal(nothing_read, torch.full((4, 3), -2.0, device=DEVICE))


def test_transforms_through_the_kernel_equal_the_torch_path(monkeypatch):
    """tests/test_gather_op.py's check of every transform through the custom op, with the op on the kernel."""
    launches = []

    def counted_launch(srcs, index, index_offset, fill, launch=_launch):
        launches.append(len(srcs))
        return launch(srcs, index, index_offset, fill)

    monkeypatch.setattr(_gather, "_launch", counted_launch)
    if DEVICE == "cpu":  # the op's CPU implementation is the torch reference: send it to the kernel instead
        monkeypatch.setattr(_gather, "_reference", counted_launch)
    check_transforms_through_the_op(monkeypatch, DEVICE, slow_checks=DEVICE == "cuda")
    assert launches and max(launches) == 2  # the CP ranks' outputs read in place by from_thd


@gpu_only
def test_large_tensors_take_the_kernel_path():
    x = torch.empty(_gather.KERNEL_MIN_BYTES // 4, device="cuda")
    assert _gather.use_op(x) and not _gather.use_op(x[:-1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_take_rows_with_repeated_rows_equals_index_select(dtype, monkeypatch):
    """``take_rows`` (the MoE permutation: every token's row ``top_k`` times, in expert order) is
    ``index_select`` bit for bit, through the kernel: under the interpreter its CPU tensors are routed to it."""
    g = torch.Generator().manual_seed(3)
    src = torch.randn(37, 2048 // 8, generator=g).to(DEVICE, dtype)
    index = torch.randint(0, 37, (37 * 8,), generator=g).to(DEVICE)
    launched = []

    def launch(*args):
        launched.append(True)
        return _launch(*args)

    monkeypatch.setattr(_gather, "KERNEL_MIN_BYTES", 0)
    monkeypatch.setattr(_gather, "_launch", launch)
    if str(DEVICE) == "cpu":  # the interpreter: take the kernel path for CPU tensors too
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    got = _gather.take_rows(src, index)
    monkeypatch.undo()
    assert launched and torch.equal(got, src.index_select(0, index))


@gpu_only
def test_take_rows_below_the_threshold_is_index_select():
    src, index = torch.randn(8, 4, device="cuda"), torch.tensor([3, 3, 0], device="cuda")
    assert torch.equal(_gather.take_rows(src, index), src[index])
