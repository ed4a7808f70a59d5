"""Tests for packfwd.testing.launch.run_local.

Strategy: every test spawns real gloo processes (the same path the multi-process tests of packfwd use) and
checks what the parent sees: results in rank order, a collective's value computed independently here, and the
failure modes (a raising rank, a rank stuck in a collective, a rank that ignores SIGTERM, a rank that dies
without reporting, a run past its timeout, a calling script without the main guard).  After every run the
children must be reaped: no process of the run is left alive or as a zombie, and its temporary directory (the
payload and the FileStore rendezvous) is gone.  The workers write their pid to a file first, so the check also
covers runs that end in an error.  Scripts without the main guard run in a subprocess with its own timeout, so
that a hang fails the test instead of hanging the suite.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
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


def _env_threads_parent(rank: int, world_size: int, name: str):
    return os.environ.get(name), torch.get_num_threads(), os.getppid(), "megatron.core" in sys.modules


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


class _UnprintableError(Exception):
    def __init__(self):
        super().__init__()
        import threading

        self.lock = threading.Lock()  # neither this exception nor its lock can be pickled back to the parent

    def __str__(self):
        raise RuntimeError("no str for you")


def _raises_unprintable(rank: int, world_size: int, pid_dir: str):
    _note_pid(pid_dir, rank)
    raise _UnprintableError()


def _fail_to_load():
    raise ValueError("this object cannot be rebuilt here")


class _LoadsBadly:
    def __reduce__(self):
        return _fail_to_load, ()


def _unloadable_result(rank: int, world_size: int, pid_dir: str):
    _note_pid(pid_dir, rank)
    return _LoadsBadly()


def _look_at_run_dir(rank: int, world_size: int, pid_dir: str, temp_root: str):
    _note_pid(pid_dir, rank)
    dist.barrier()
    runs = sorted(os.listdir(temp_root))
    return runs, sorted(os.listdir(Path(temp_root, runs[0]))), "MASTER_PORT" in os.environ


# ------------------------------------------------------------------------------------------------- helpers


@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    """run_local's temporary directories go here, so that a test can check they are removed."""
    root = tmp_path / "temp_root"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


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


@pytest.mark.parametrize("preload", ["", "torch,megatron.core"])
def test_spawned_or_forked_from_a_preloaded_server_the_ranks_see_the_callers_environment(preload, monkeypatch):
    """Both start-ups (``PACKFWD_RUN_LOCAL_PRELOAD`` unset: spawn; set: forked from a server that imported the
    modules once): a variable set just before the call (after the server may have started; 70 KB) reaches every rank,
    and torch runs on OMP_NUM_THREADS=1 threads.  Spawned ranks are this process's children and import nothing
    they do not need; forked ones are the server's, with its modules imported."""
    monkeypatch.setenv("PACKFWD_RUN_LOCAL_PRELOAD", preload)
    late = f"set-{preload}" + "x" * 70_000  # larger than a pipe's buffer: the environment must not go through one
    monkeypatch.setenv("PACKFWD_LATE_VAR", late)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    out = run_local(_env_threads_parent, 2, "PACKFWD_LATE_VAR", backend="gloo")
    for value, threads, parent, megatron in out:
        assert value == late and threads == 1
        assert (parent == os.getpid()) == (not preload) and megatron == bool(preload)


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


def test_rendezvous_is_a_file_store_in_a_private_temp_dir_removed_afterwards(tmp_path, temp_root):
    # No TCP port is picked in advance (another process could take it before rank 0 binds it): the group meets
    # through a FileStore beside the payload, in a directory of its own, which is gone when the call returns.
    out = run_local(_look_at_run_dir, 2, str(tmp_path), str(temp_root), backend="gloo", timeout=120)
    for runs, files, has_master_port in out:
        assert len(runs) == 1 and runs[0].startswith("packfwd-run-local-")
        assert "store" in files and "payload.pkl" in files
        assert not has_master_port
    assert out[0][0] == out[1][0]  # both ranks met in the same directory
    assert os.listdir(temp_root) == []
    _assert_reaped(tmp_path, 2)


def test_temp_dir_removed_after_a_failing_run(tmp_path, temp_root):
    with pytest.raises(RankError, match="deliberate failure on rank one"):
        run_local(_rank1_raises, 2, str(tmp_path), backend="gloo", timeout=120)
    assert os.listdir(temp_root) == []
    _assert_reaped(tmp_path, 2)


def test_unprintable_exception_is_still_reported_with_its_traceback(tmp_path):
    # Before: str(exc) raised inside the child's error handler, the child died without a report, and the parent
    # said only "exited with code 1".
    with pytest.raises(RankError) as info:
        run_local(_raises_unprintable, 2, str(tmp_path), backend="gloo", timeout=120)
    kind, message, tb = info.value.failures[info.value.rank]
    assert kind == "_UnprintableError" and message.startswith("<unprintable")
    assert "_raises_unprintable" in tb
    _assert_reaped(tmp_path, 2)


def test_result_the_parent_cannot_load_is_a_rank_error(tmp_path):
    # Before: the unpickling error escaped from run_local itself, naming no rank.
    with pytest.raises(RankError) as info:
        run_local(_unloadable_result, 2, str(tmp_path), backend="gloo", timeout=120)
    assert set(info.value.failures) == {0, 1}
    assert "ResultNotLoadable" in str(info.value) and "cannot be rebuilt here" in str(info.value)
    _assert_reaped(tmp_path, 2)


_NO_GUARD_SCRIPT = """
import sys

from packfwd.testing import run_local


def count(rank, world_size, blob):
    return len(blob)


try:
    print(run_local(count, 2, b"x" * {size}, backend="gloo", timeout={timeout}))
except Exception as exc:
    if __name__ != "__main__":
        raise  # a rank re-importing this script (as __mp_main__): its own error goes to stderr
    print(f"parent: {{type(exc).__name__}}: {{exc}}")
    sys.exit(3)
"""


@pytest.mark.parametrize("size", [10, 200_000], ids=["small-arg", "arg-over-64KB"])
def test_script_without_main_guard_fails_fast_naming_the_guard(tmp_path, size):
    # Before: an argument over the spawn pipe's 64 KB buffer hung the parent for good (it blocked writing to a
    # child that had died re-importing the script); a small one gave "exited with code 1" or a bare timeout.
    # Now each rank dies at once, and the parent raises RankError, well before the timeout, naming the guard.
    timeout = 90
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent(_NO_GUARD_SCRIPT.format(size=size, timeout=timeout)))
    try:
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=2 * timeout,
                              cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail("run_local hung past its timeout in a script without the main guard")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stdout.count("parent: ") == 1, proc.stdout
    report = proc.stdout[proc.stdout.index("parent: "):]
    assert report.startswith("parent: RankError: ")  # the deaths were seen, not waited out to the timeout
    assert "while starting" in report and str(script) in report
    assert 'under `if __name__ == "__main__":`' in report
    # a rank's own error says the same (the parent stops the other ranks once it sees the first death: under load
    # a second rank may be stopped before it writes its own)
    assert 1 <= proc.stderr.count("run_local was called while a spawned rank re-imported the calling script") <= 2


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
