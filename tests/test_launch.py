"""Tests for packfwd.testing.launch.run_local.

Strategy: every test spawns real gloo processes (the same path the multi-process tests of packfwd use) and
checks what the parent sees: results in rank order, a collective's value computed independently here, and the
failure modes (a raising rank, a rank stuck in a collective, a rank that ignores SIGTERM, a rank that dies
without reporting, a run past its timeout).  After every run the children must be reaped: no process of the
run is left alive or as a zombie.  The workers write their pid to a file first, so the check also covers runs
that end in an error.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from packfwd.testing import RankError, run_local


# ------------------------------------------------------------------------------- workers (module level: spawned)


def _note_pid(pid_dir: str, rank: int) -> None:
    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))


def _rank_info_and_all_reduce(rank: int, world_size: int, pid_dir: str, base: float):
    _note_pid(pid_dir, rank)
    t = torch.tensor([base * (rank + 1)], dtype=torch.float64)
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world_size": world_size,
        "dist_rank": dist.get_rank(),
        "backend": dist.get_backend(),
        "sum": t,
        "env": os.environ.get("PACKFWD_TEST_VAR"),
        "nvls": os.environ.get("NCCL_NVLS_ENABLE"),
    }


def _rank1_raises(rank: int, world_size: int, pid_dir: str):
    _note_pid(pid_dir, rank)
    if rank == 1:
        raise ValueError("deliberate failure on rank one")
    return rank


def _unpicklable_result(rank: int, world_size: int, pid_dir: str):
    _note_pid(pid_dir, rank)
    return threading_lock()


def threading_lock():
    import threading

    return threading.Lock()  # torch.save cannot pickle a lock: every rank fails the same way


def _rank0_stuck_ignoring_sigterm(rank: int, world_size: int, pid_dir: str):
    _note_pid(pid_dir, rank)
    if rank == 1:
        raise KeyError("rank one gives up before the all-reduce")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL can stop this rank
    try:
        dist.all_reduce(torch.ones(1))  # its peer never joins: this blocks, or fails once the peer is gone
    except Exception:
        pass
    time.sleep(600)


def _rank1_sleeps(rank: int, world_size: int, pid_dir: str):
    _note_pid(pid_dir, rank)
    if rank == 1:
        time.sleep(600)
    return rank


def _ranks_die(rank: int, world_size: int, pid_dir: str):
    _note_pid(pid_dir, rank)
    dist.barrier()  # both ranks are running: they die within moments of each other, whatever the load
    if rank == 0:
        os._exit(3)
    os.kill(os.getpid(), signal.SIGSEGV)


# ------------------------------------------------------------------------------------------------- helpers


def _assert_reaped(pid_dir: Path, world_size: int) -> None:
    # A rank that was still starting when the run ended has no pid file; active_children covers it.
    files = [Path(pid_dir, f"{r}.pid") for r in range(world_size)]
    pids = [int(f.read_text()) for f in files if f.exists()]
    for pid in pids:
        with pytest.raises(ChildProcessError):  # not our child any more: it was reaped, not a zombie
            os.waitpid(pid, os.WNOHANG)
        status = Path(f"/proc/{pid}/status")
        if status.exists():  # only a recycled pid may remain, never our zombie
            assert "zombie" not in status.read_text()
    assert multiprocessing.active_children() == []


# --------------------------------------------------------------------------------------------------- tests


def test_results_in_rank_order_with_all_reduce(tmp_path):
    out = run_local(_rank_info_and_all_reduce, 3, str(tmp_path), 1.5, backend="gloo",
                    env={"PACKFWD_TEST_VAR": "hello"})
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert [o["dist_rank"] for o in out] == [0, 1, 2]
    for o in out:
        assert o["world_size"] == 3 and o["backend"] == "gloo"
        assert o["env"] == "hello" and o["nvls"] == "0"
        # sum of 1.5 * (rank + 1) over three ranks, by hand: 1.5 + 3 + 4.5
        torch.testing.assert_close(o["sum"], torch.tensor([9.0], dtype=torch.float64), rtol=0, atol=0)
    assert "PACKFWD_TEST_VAR" not in os.environ  # the parent's environment is restored
    _assert_reaped(tmp_path, 3)


def test_failing_rank_raises_rank_error_with_traceback(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_local(_rank1_raises, 2, str(tmp_path), timeout=60, backend="gloo")
    err = info.value
    assert isinstance(err, RuntimeError)
    assert err.rank == 1
    assert "rank 1" in str(err) and "ValueError: deliberate failure on rank one" in str(err)
    assert "_rank1_raises" in err.traceback and "Traceback" in err.traceback
    assert err.traceback in str(err)
    assert time.monotonic() - t0 < 30
    _assert_reaped(tmp_path, 2)


def test_every_rank_same_error_is_said_once(tmp_path):
    with pytest.raises(RankError) as info:
        run_local(_unpicklable_result, 2, str(tmp_path), timeout=60, backend="gloo")
    assert "every rank (2 of 2) raised the same" in str(info.value)
    assert set(info.value.failures) == {0, 1}
    _assert_reaped(tmp_path, 2)


def test_rank_stuck_in_collective_is_killed_after_peer_fails(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_local(_rank0_stuck_ignoring_sigterm, 2, str(tmp_path), timeout=60, backend="gloo")
    assert time.monotonic() - t0 < 30  # far below the timeout: the failure ends the run
    err = info.value
    assert err.rank == 1 and "KeyError" in str(err) and "rank one gives up" in err.traceback
    assert "ranks [0] were still running and were killed" in str(err)
    _assert_reaped(tmp_path, 2)


def test_timeout_names_unfinished_ranks(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        run_local(_rank1_sleeps, 2, str(tmp_path), timeout=6, backend="gloo")
    elapsed = time.monotonic() - t0
    assert 6 <= elapsed < 20
    msg = str(info.value)
    assert "did not finish" in msg and "1]" in msg  # "[1]", or "[0, 1]" on a machine too busy to start rank 0
    _assert_reaped(tmp_path, 2)


def test_dead_ranks_detected_by_exit_code(tmp_path):
    with pytest.raises(RankError) as info:
        run_local(_ranks_die, 2, str(tmp_path), timeout=60, backend="gloo")
    failures = info.value.failures
    assert set(failures) == {0, 1}, str(info.value)
    assert failures[0][0] == failures[1][0] == "ProcessDied"
    assert "exited with code 3" in failures[0][1]
    assert "SIGSEGV" in failures[1][1]
    assert info.value.traceback == ""
    _assert_reaped(tmp_path, 2)


def _closure_maker():
    def inner(rank, world_size):
        return rank

    return inner


@pytest.mark.parametrize(
    "fn, args, match",
    [
        (lambda rank, world_size: rank, (), "lambda or closure"),
        (_closure_maker(), (), "lambda or closure"),
        (_rank1_raises, (lambda: 0,), "args of run_local are not picklable"),
        ("not a function", (), "module-level function"),
    ],
)
def test_unpicklable_fn_or_args_raise_type_error_early(fn, args, match):
    t0 = time.monotonic()
    with pytest.raises(TypeError, match=match):
        run_local(fn, 2, *args, backend="gloo")
    assert time.monotonic() - t0 < 1.0  # raised before any process started
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        ({"world_size": 0}, ValueError),
        ({"world_size": 2.0}, TypeError),
        ({"world_size": 2, "timeout": 0}, ValueError),
        ({"world_size": 2, "env": {"A": 1}}, TypeError),
    ],
)
def test_bad_arguments(kwargs, exc):
    world_size = kwargs.pop("world_size")
    with pytest.raises(exc):
        run_local(_rank1_raises, world_size, "/nonexistent", backend="gloo", **kwargs)


def _nccl_all_reduce(rank: int, world_size: int):
    t = torch.full((2,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    return t, torch.cuda.current_device(), dist.get_backend(), os.environ.get("NCCL_NVLS_ENABLE")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_nccl_one_gpu_per_rank():
    out = run_local(_nccl_all_reduce, 2)  # backend=None picks NCCL when CUDA is available
    for rank, (t, device, backend, nvls) in enumerate(out):
        assert t.device.type == "cpu"  # results come back on the CPU
        torch.testing.assert_close(t, torch.full((2,), 3.0))
        assert device == rank and backend == "nccl" and nvls == "0"
