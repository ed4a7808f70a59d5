"""Tests for the command line (``packfwd.viz.cli``, run as ``python -m packfwd``).

Strategy: run ``main(argv)`` in-process and read what it prints. The layouts it prints are checked against
token lists written out by hand for small cases, and against ``tests/oracles.py``'s slicing reference for a few
more; pipeline tables against ranges written out by hand. Every error must give exit status 2, the usage line
and a message worded with the command line's own flags on stderr (never a Python argument name such as
``tp_size``), and no traceback: each error path reachable from the command line is listed below. One test runs
the real ``python -m packfwd`` in a subprocess.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from packfwd.viz.cli import main

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


# Python argument names of packfwd's functions that the command line does not have.
PYTHON_NAMES = re.compile(r"tp_size|cp_size|cp_rank|seq_align|num_layers|first_stage_layers|last_stage_layers|"
                          r"max_seqlen|(?<![\w-])v?pp=|(?<![\w-])layer=|\bNone\b")


def check_error(err: str, command: str) -> str:
    """The message of a well-formed error: usage line, ``packfwd <command>: error: ...``, no traceback."""
    assert "Traceback" not in err
    assert err.startswith(f"usage: packfwd {command}"), err
    lines = [line for line in err.splitlines() if line.startswith(f"packfwd {command}: error: ")]
    assert len(lines) == 1, err
    message = lines[0].removeprefix(f"packfwd {command}: error: ")
    assert not PYTHON_NAMES.search(message), f"Python argument name in {message!r}"
    return message


# Every error of packfwd's functions that the command line can reach, with the words it must say instead.
SIZE_ERRORS = [
    ("plan --cp 2 --seq-align 6 --lengths 5",
     ["--seq-align 6 breaks context parallelism", "2 x --cp", "multiple of 4", "leave it out"]),
    ("plan --cp 3 --tp 2 --seq-align 4 --lengths 5", ["--seq-align 4", "multiple of 6"]),
    ("layers --layers 30 --pp 4", ["--layers 30 is not divisible by --pp 4", "--first/--last"]),
    ("layers --layers 8 --pp 2 --vpp 3", ["divisible by --vpp 3", "pick --vpp from [1, 2, 4]"]),
    ("layers --layers 8 --pp 1 --vpp 2", ["--vpp 2 needs --pp >= 2", "pass --vpp 1"]),
    ("layers --layers 8 --pp 1 --first 4",
     ["--first 4 but --layers 8", "with --pp 1", "leave --first out or pass --first 8"]),
    ("layers --layers 8 --pp 1 --last 3", ["--last 3 but --layers 8"]),
    ("layers --layers 8 --pp 3 --vpp 2 --first 3", ["--first 3 must be divisible by --vpp 2"]),
    ("layers --layers 8 --pp 2 --first 2 --last 2",
     ["with --pp 2 there are no middle stages", "--first + --last (= 4) must equal --layers 8"]),
    ("layers --layers 8 --pp 2 --vpp 2 --first 4 --last 4",
     ["cannot place --pp 2, --vpp 2 with both --first and --last set", "pass only --first 4", "use --vpp 1"]),
    ("layers --layers 8 --pp 4 --first 2 --last 5",
     ["--layers - --first - --last = 1 layers", "(--pp 4)", "change --layers, --first or --last"]),
    ("layers --layers 14 --pp 4 --vpp 2 --first 2 --last 2",
     ["each middle pipeline stage gets 5 layers, not divisible by --vpp 2", "pick --vpp from [1] or change"]),
    ("layers --layers 20 --pp 4 --vpp 4 --first 2 --last 2",  # vpp 2 fits every stage's 2 or 8 layers
     ["--first 2 must be divisible by --vpp 4", "or --vpp from [1, 2]"]),
    ("layers --layers 32 --pp 4 --owner 40", ["--owner 40 is out of range; this model has layers 0..31"]),
    ("layers --layers 32 --pp 4 --owner 32", ["--owner 32 is out of range; this model has layers 0..31"]),
    ("layers --layers 8 --pp 2 --owner -1", ["--owner -1 is out of range; this model has layers 0..7"]),
]


@pytest.mark.parametrize("command, words", SIZE_ERRORS, ids=[case[0] for case in SIZE_ERRORS])
def test_size_errors_use_the_cli_flags(capsys, command, words):
    argv = command.split()
    code, out, err = run(argv, capsys)
    assert (code, out) == (2, "")
    message = check_error(err, argv[0])
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_valid_uneven_vpp_split(capsys):
    code, out, _ = run(["layers", "--layers", "12", "--pp", "4", "--vpp", "2", "--first", "2", "--last", "2"], capsys)
    assert code == 0
    rows = {int(line.split()[0]): line.split()[1:] for line in out.splitlines() if re.match(r"^\d\s", line)}
    assert rows == {0: ["0", "6", "2"], 1: ["1-2", "7-8", "4"], 2: ["3-4", "9-10", "4"], 3: ["5", "11", "2"]}


@pytest.mark.parametrize(
    "argv, words",
    [
        (["plan", "--tp", "0", "--lengths", "5"], ["argument --tp: expected an integer >= 1, got '0'", "--tp 2"]),
        (["plan", "--cp", "-1", "--lengths", "5"], ["argument --cp: expected an integer >= 1, got '-1'"]),
        (["plan", "--cp", "1.5", "--lengths", "5"], ["argument --cp: expected an integer >= 1, got '1.5'"]),
        (["plan", "--seq-align", "0", "--lengths", "5"], ["argument --seq-align: expected an integer >= 1"]),
        (["layers", "--layers", "0"], ["argument --layers: expected an integer >= 1, got '0'"]),
        (["layers", "--layers", "8", "--pp", "0"], ["argument --pp: expected an integer >= 1"]),
        (["layers", "--layers", "8", "--pp", "2", "--vpp", "0"], ["argument --vpp: expected an integer >= 1"]),
        (["layers", "--layers", "8", "--pp", "2", "--first", "0"], ["argument --first: expected an integer >= 1"]),
        (["layers", "--layers", "8", "--pp", "2", "--last", "-2"], ["argument --last: expected an integer >= 1"]),
        (["layers", "--layers", "8", "--owner", "x"], ["argument --owner: expected an integer, got 'x'"]),
    ],
    ids=lambda v: " ".join(v),
)
def test_bad_numbers_name_the_flag(capsys, argv, words):
    code, out, err = run(argv, capsys)
    assert (code, out) == (2, "")
    message = check_error(err, argv[0])
    for word in words:
        assert word in message


FORM = "--lengths takes comma-separated non-negative integers, e.g. --lengths 5,17,3"


@pytest.mark.parametrize(
    "lengths, what",
    [
        ("5,,3", "entry 2 in '5,,3' is empty"),  # was read as [5, 3]
        ("5,3,", "entry 3 in '5,3,' is empty"),  # was read as [5, 3]
        (",5", "entry 1 in ',5' is empty"),
        (",", "entry 1 in ',' is empty"),
        ("", "no lengths given"),
        ("5 17 3", "'5 17 3' is not an integer"),  # was read as [5173]
        ("5,x", "'x' in '5,x' is not an integer"),
        ("5,2.0", "'2.0' in '5,2.0' is not an integer"),
        ("5,-1", "-1 in '5,-1' is negative"),
        ("-4", "-4 is negative"),
    ],
)
def test_bad_lengths_name_the_flag_and_its_form(capsys, lengths, what):
    code, out, err = run(["plan", "--lengths", lengths], capsys)
    assert (code, out) == (2, "")
    assert check_error(err, "plan") == f"argument --lengths: {what}; {FORM}"


def test_lengths_allow_blanks_around_entries(capsys):
    code, out, _ = run(["plan", "--lengths", " 5, 3 "], capsys)
    assert code == 0
    assert out.splitlines()[0].startswith("THD layout of lengths [5, 3]")


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["plan", "--lengths", "5", "--lengths", "7"], "--lengths"),
        (["plan", "--tp", "2", "--tp", "4", "--lengths", "5"], "--tp"),
        (["plan", "--cp", "2", "--lengths", "5", "--cp", "2"], "--cp"),
        (["plan", "--seq-align", "4", "--seq-align", "8", "--lengths", "5"], "--seq-align"),
        (["layers", "--layers", "8", "--layers", "16", "--pp", "2"], "--layers"),
        (["layers", "--layers", "8", "--pp", "2", "--owner", "1", "--owner", "3"], "--owner"),
    ],
)
def test_a_flag_given_twice_is_an_error(capsys, argv, flag):
    # argparse keeps the last value and drops the first without a word; a repeated flag is a mistake to report.
    code, out, err = run(argv, capsys)
    assert (code, out) == (2, "")
    assert check_error(err, argv[0]) == f"{flag} is given twice; give it once"


def test_more_than_26_sequences_get_distinct_names(capsys):
    # Sequence 27 used to be named 'a' again, like sequence 1.
    code, out, _ = run(["plan", "--lengths", ",".join(["1"] * 28)], capsys)
    assert code == 0
    (seqs,) = rank_tokens(out).values()
    expected = [[f"{c}0"] for c in "abcdefghijklmnopqrstuvwxyz"] + [["aa0"], ["ab0"]]
    assert seqs == expected


def test_sequences_longer_than_1000_tokens_keep_their_names(capsys):
    # Token 1000 of the first sequence used to be printed as 'b0' (its code ran into the next sequence's).
    code, out, _ = run(["plan", "--lengths", "1002,2"], capsys)
    assert code == 0
    (seqs,) = rank_tokens(out).values()
    assert seqs == [[f"a{k}" for k in range(1002)], ["b0", "b1"]]


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
    assert "--layers 30 is not divisible by --pp 4" in bad.stderr and "Traceback" not in bad.stderr


def test_console_script_target_is_the_cli():
    # pyproject.toml's ``packfwd = "packfwd.__main__:main"`` must keep reaching the command line.
    import packfwd.__main__

    assert packfwd.__main__.main is main
