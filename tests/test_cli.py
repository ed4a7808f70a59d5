"""Tests for the command line (``python -m packfwd``).

Strategy: run ``main(argv)`` in-process and read what it prints. The layouts it prints are checked against
token lists written out by hand for small cases, and against ``tests/oracles.py``'s slicing reference for a few
more; pipeline tables against ranges written out by hand. Errors must give exit status 2, packfwd's message on
stderr and no traceback. One test runs the real ``python -m packfwd`` in a subprocess.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from packfwd.__main__ import main

from .oracles import ref_thd_rank

REPO = Path(__file__).resolve().parents[1]


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def rank_tokens(out: str) -> dict[int, list[list[str]]]:
    """``{cp_rank: [tokens of each sequence]}`` parsed from the ``cp rank r (n tokens): ...`` lines."""
    ranks = {}
    for line in out.splitlines():
        m = re.fullmatch(r"cp rank (\d+) \((\d+) tokens\): ?(.*)", line)
        if m:
            seqs = [part.split() for part in m.group(3).split(" | ")] if m.group(3) else []
            assert sum(map(len, seqs)) == int(m.group(2))
            ranks[int(m.group(1))] = seqs
    return ranks


def field(out: str, name: str) -> list[int]:
    m = re.search(rf"^{name}\s+\[([\d, ]*)\]", out, re.M)
    assert m, f"no {name} line in:\n{out}"
    return [int(v) for v in m.group(1).split(",") if v.strip()]


def test_plan_tp2_cp2_by_hand(capsys):
    # lengths 5, 17, 3 with cp=2: every sequence padded to a multiple of 2*cp = 4 -> 8, 20, 4 (32 tokens, which
    # tp*cp = 4 divides). Each padded sequence is cut into 4 chunks; rank 0 keeps chunks 0 and 3, rank 1 chunks 1, 2.
    code, out, err = run(["plan", "--tp", "2", "--cp", "2", "--lengths", "5,17,3"], capsys)
    assert code == 0 and err == ""
    assert field(out, "cu_seqlens") == [0, 5, 22, 25]
    assert field(out, "cu_seqlens_padded") == [0, 8, 28, 32]
    b = [f"b{k}" for k in range(17)] + ["."] * 3  # sequence b padded to 20, chunks of 5
    assert rank_tokens(out) == {
        0: [["a0", "a1", ".", "."], b[0:5] + b[15:20], ["c0", "."]],
        1: [["a2", "a3", "a4", "."], b[5:10] + b[10:15], ["c1", "c2"]],
    }
    assert "16 tokens split over tp=2 ranks, 8 each" in out
    # verl pads every sequence to 2*tp*cp = 8: 8 + 24 + 8 = 40 tokens, 15 of them padding.
    assert re.search(r"^packfwd \(align 4\)\s+32 tokens,\s+7 pad", out, re.M)
    assert re.search(r"^verl\s+\(align 8\)\s+40 tokens,\s+15 pad", out, re.M)
    assert re.search(r"^real tokens\s+25$", out, re.M)


def test_plan_without_cp_by_hand(capsys):
    # cp=1: no per-sequence padding; the last sequence grows until tp=4 divides the total (3+2 -> 8 tokens).
    code, out, _ = run(["plan", "--tp", "4", "--lengths", "3,2"], capsys)
    assert code == 0
    assert field(out, "cu_seqlens_padded") == [0, 3, 8]
    assert rank_tokens(out) == {0: [["a0", "a1", "a2"], ["b0", "b1", ".", ".", "."]]}
    assert re.search(r"^verl\s+\(align 4\)\s+8 tokens,\s+3 pad", out, re.M)


def test_plan_seq_align_by_hand(capsys):
    # seq_align=8 with cp=2: 5 -> 8 (chunks of 2), 3 -> 8 (chunks of 2).
    code, out, _ = run(["plan", "--cp", "2", "--seq-align", "8", "--lengths", "5,3"], capsys)
    assert code == 0
    assert "seq_align=8" in out.splitlines()[0]
    assert rank_tokens(out) == {
        0: [["a0", "a1", ".", "."], ["b0", "b1", ".", "."]],
        1: [["a2", "a3", "a4", "."], ["b2", ".", ".", "."]],
    }
    assert re.search(r"^chosen\s+\(align 8\)\s+16 tokens,\s+8 pad", out, re.M)


@pytest.mark.parametrize(
    "lengths, tp, cp, align",
    [([7, 1, 12], 1, 4, None), ([9, 4], 3, 2, None), ([6, 6, 6, 2], 2, 3, 12), ([1], 8, 1, None), ([0, 5], 2, 2, None)],
)
def test_plan_matches_slicing_reference(capsys, lengths, tp, cp, align):
    argv = ["plan", "--tp", str(tp), "--cp", str(cp), "--lengths", ",".join(map(str, lengths))]
    if align is not None:
        argv += ["--seq-align", str(align)]
    code, out, _ = run(argv, capsys)
    assert code == 0
    s = max(lengths)
    mask = torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]
    names = [[f"{'abcdefgh'[i]}{k}" for k in range(s)] for i in range(len(lengths))]
    codes = torch.tensor([[1 + i * s + k for k in range(s)] for i in range(len(lengths))])  # 0 means padding
    flat = ["."] + [n for row in names for n in row]
    printed = rank_tokens(out)
    assert sorted(printed) == list(range(cp))
    for rank in range(cp):
        expected = [flat[c] for c in ref_thd_rank(codes, mask, tp, cp, rank, align).tolist()]
        assert [tok for seq in printed[rank] for tok in seq] == expected


def test_layers_32_pp4_vpp2_by_hand(capsys):
    code, out, err = run(["layers", "--layers", "32", "--pp", "4", "--vpp", "2", "--owner", "21"], capsys)
    assert code == 0 and err == ""
    lines = out.splitlines()
    # rank r holds layers 4r..4r+3 in virtual stage 0 and 16+4r..16+4r+3 in virtual stage 1.
    rows = {int(line.split()[0]): line.split()[1:] for line in lines if re.match(r"^\d\s", line)}
    assert rows == {0: ["0-3", "16-19", "8"], 1: ["4-7", "20-23", "8"], 2: ["8-11", "24-27", "8"],
                    3: ["12-15", "28-31", "8"]}
    grid = {int(m.group(1)): m.group(2) for m in re.finditer(r"^pp rank (\d+)\s+([0-9.]+)$", out, re.M)}
    for rank in range(4):
        expected = ["."] * 32
        for v in range(2):
            for layer in range(16 * v + 4 * rank, 16 * v + 4 * rank + 4):
                expected[layer] = str(v)
        assert grid[rank] == "".join(expected)
    assert lines[-1] == "layer 21: pp rank 1, vpp stage 1, local index 1"


def test_layers_uneven_by_hand(capsys):
    code, out, _ = run(["layers", "--layers", "30", "--pp", "4", "--first", "6", "--last", "6"], capsys)
    assert code == 0
    rows = {int(line.split()[0]): line.split()[1:] for line in out.splitlines() if re.match(r"^\d\s", line)}
    assert rows == {0: ["0-5", "6"], 1: ["6-14", "9"], 2: ["15-23", "9"], 3: ["24-29", "6"]}
    assert "first_stage_layers=6, last_stage_layers=6" in out.splitlines()[0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--tp", "0", "--lengths", "5"], "tp_size must be >= 1"),
        (["plan", "--cp", "-1", "--lengths", "5"], "cp_size must be >= 1"),
        (["plan", "--cp", "2", "--seq-align", "6", "--lengths", "5"], "seq_align must be a multiple of 4"),
        (["layers", "--layers", "30", "--pp", "4"], "num_layers=30 is not divisible by pp=4"),
        (["layers", "--layers", "8", "--pp", "2", "--vpp", "3"], "divisible by vpp=3"),
        (["layers", "--layers", "8", "--pp", "1", "--vpp", "2"], "vpp=2 needs pp >= 2"),
        (["layers", "--layers", "8", "--pp", "2", "--owner", "8"], "layer=8 is out of range"),
    ],
)
def test_bad_sizes_exit_2_with_packfwd_message(capsys, argv, message):
    code, out, err = run(argv, capsys)
    assert code == 2
    assert out == ""
    assert message in err and err.startswith(f"packfwd {argv[0]}: error: ")
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--lengths", "5,x"], "expected comma-separated integers"),
        (["plan", "--lengths", "5,-1"], "must be >= 0"),
        (["plan", "--lengths", ","], "at least one sequence length"),
        (["plan"], "--lengths"),
        (["layers", "--pp", "2"], "--layers"),
        ([], "required"),
        (["unpack"], "invalid choice"),
    ],
)
def test_usage_errors_exit_2(capsys, argv, message):
    code, out, err = run(argv, capsys)
    assert code == 2
    assert message in err and "usage: packfwd" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"], ["layers", "-h"]])
def test_help_exits_0(capsys, argv):
    code, out, _ = run(argv, capsys)
    assert code == 0
    assert out.startswith("usage: packfwd")


def test_python_dash_m_subprocess():
    ok = subprocess.run(
        [sys.executable, "-m", "packfwd", "plan", "--cp", "2", "--lengths", "5,3"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert "cp rank 1 (6 tokens): a2 a3 a4 . | b1 b2" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "packfwd", "layers", "--layers", "30", "--pp", "4"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert bad.returncode == 2
    assert "not divisible by pp=4" in bad.stderr and "Traceback" not in bad.stderr
