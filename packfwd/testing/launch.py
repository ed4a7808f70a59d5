"""Run a function on ``world_size`` local processes joined in one ``torch.distributed`` group.

``run_local`` is the small launcher behind packfwd's multi-process tests and examples: it spawns the ranks,
initialises the process group (gloo on CPU, NCCL with one GPU per rank), runs ``fn(rank, world_size, *args)``
on each, and brings the results back in rank order.  It never hangs: a failing rank, a rank that dies without
reporting (segfault, ``os._exit``), a rank that dies while starting (a calling script without the
``if __name__ == "__main__":`` guard) or the overall timeout end the whole run, and every child is reaped.

Nothing large goes through the spawn pipe (whose writer blocks on a child that died before reading it): the
pickled ``fn`` and ``args`` go to a file in a private temporary directory, which also holds the group's
``FileStore`` rendezvous (no TCP port picked in advance, so nothing another process can take in between); the
directory is removed when the call ends.

One file on purpose: spawning, the result pipes, the watchdog and the reaping make the no-hang guarantee
together, and read best in one place.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing import connection
from typing import Any, Callable

__all__ = ["RankError", "run_local"]

# After the first rank fails, wait this long for the others to report (they often fail the same way, or fail
# in a collective once the first one is gone) before killing them.
_FAILURE_GRACE_S = 2.0
# A rank whose process has ended gets this long for its report to arrive in the pipe.
_EXIT_GRACE_S = 1.0
# Children terminated with SIGTERM get this long before SIGKILL.
_TERM_GRACE_S = 1.0
_ENV_LOCK = threading.Lock()
_GUARD = 'if __name__ == "__main__":'


class RankError(RuntimeError):
    """A rank of :func:`run_local` raised or died.

    Attributes: ``rank`` (the first rank that failed), ``traceback`` (its formatted traceback, ``""`` when the
    process died without reporting) and ``failures`` (``{rank: (type_name, message, traceback)}`` for every
    rank that failed before the others were stopped).
    """

    def __init__(self, message: str, rank: int, tb: str, failures: dict[int, tuple[str, str, str]]):
        super().__init__(message)
        self.rank = rank
        self.traceback = tb
        self.failures = failures

    def __reduce__(self):
        return type(self), (str(self), self.rank, self.traceback, self.failures)


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return the results by rank.

    Each child joins ``torch.distributed.init_process_group(backend, rank=rank, world_size=world_size)``
    through a ``FileStore`` in a private temporary directory, runs ``fn``, destroys the group and sends its
    result back (through ``torch.save``, so tensors work; CUDA tensors arrive on the CPU).  ``backend=None``
    picks ``"nccl"`` with one GPU per rank (``torch.cuda.set_device(rank)``) when CUDA is available, else
    ``"gloo"``.

    ``fn`` must be a module-level function of an importable module: lambdas, closures and functions defined in
    a notebook or an interactive ``__main__`` cannot reach the spawned children and raise ``TypeError`` here.
    ``args`` must be picklable (they are copied to each child, through a file, so their size does not matter).
    A script that calls ``run_local`` needs the main guard, because every spawned child first re-imports the
    calling script and runs its top-level code again::

        if __name__ == "__main__":
            print(run_local(fn, 2))

    Without it, each child's re-import calls ``run_local`` again, which raises ``RuntimeError`` there (naming
    the guard); the child dies before it starts, and this call raises ``RankError`` within a second or two,
    saying so and naming the guard.  The children's stdout and stderr are those of this process (from a
    notebook, they show in the kernel's terminal, not the cell).

    The children's environment is this process's, plus ``env``, plus ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``NCCL_NVLS_ENABLE=0`` and, unless set, ``OMP_NUM_THREADS=1`` (as torchrun does, to
    avoid oversubscribing the cores); there is no ``MASTER_PORT`` (no TCP rendezvous).

    Start-up: each rank is a fresh interpreter (multiprocessing's ``spawn``), which imports torch, Megatron-Core
    and transformers anew: seconds per rank.  With ``PACKFWD_RUN_LOCAL_PRELOAD`` set to comma-separated module
    names (packfwd's ``make test`` sets ``torch,megatron.core,transformers``), the ranks fork from a server
    process that imported those once (``forkserver``, started at the first call and kept for the process); the
    rest is the same: the main script re-imported, the environment this process's at the call (set again in the
    child, and ``torch.set_num_threads`` from its ``OMP_NUM_THREADS``), the children exit when this process does.

    Raises ``RankError`` when a rank raises or dies (it names the rank and carries the child's traceback; the
    other ranks are killed after a short grace), and ``TimeoutError`` naming the unfinished ranks when
    ``timeout`` seconds pass (also naming the main guard when some never got past starting).  The call never
    outlasts ``timeout`` by more than a few seconds of clean-up, and no child outlives it.

    >>> from packfwd.testing.launch import run_local, _example_all_reduce
    >>> run_local(_example_all_reduce, 2, 10.0, backend="gloo")
    [21.0, 21.0]
    """
    _refuse_while_bootstrapping()
    world_size, backend, timeout = _check_arguments(fn, world_size, backend, timeout, env)
    payload = _pickle_payload(fn, args)
    deadline = time.monotonic() + timeout
    ctx, forked = _context()
    run_dir = tempfile.mkdtemp(prefix="packfwd-run-local-")  # private (0700): the payload and the FileStore
    procs, conns = [], []
    try:
        with open(os.path.join(run_dir, "payload.pkl"), "wb") as f:
            f.write(payload)
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            # The process object stays small (a path, not the payload): spawn writes it into a pipe the child
            # reads only after re-importing the main script, and that write would block forever on a child that
            # died in the re-import once it is over the pipe's 64 KB buffer.
            # (Likewise a forked rank's environment goes through a file: the caller's may be any size.)
            rank_env = _rank_env(rank, world_size, env)
            if forked:
                with open(os.path.join(run_dir, f"environ{rank}.pkl"), "wb") as f:
                    pickle.dump({**os.environ, **rank_env}, f)
            proc = ctx.Process(
                target=_child_main, args=(rank, world_size, backend, run_dir, writer, forked),
                name=f"packfwd-rank{rank}",
            )
            with _child_env(rank_env):
                proc.start()
            writer.close()  # the parent's copy: with it closed, a dead child shows as EOF on `reader`
            procs.append(proc)
            conns.append(reader)
        return _collect(procs, conns, deadline, timeout)
    finally:
        _stop(procs)
        for c in conns:
            c.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def _context():
    """The multiprocessing context of the ranks, and whether they fork from a preloaded server (docstring)."""
    import multiprocessing as mp

    preload = [m.strip() for m in os.environ.get("PACKFWD_RUN_LOCAL_PRELOAD", "").split(",") if m.strip()]
    if not preload:
        return mp.get_context("spawn"), False
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload)  # read when the server starts: the first call of this process
    return ctx, True


def _refuse_while_bootstrapping() -> None:
    import multiprocessing as mp

    if getattr(mp.current_process(), "_inheriting", False):  # set by spawn while it re-imports the main module
        raise RuntimeError(
            "run_local was called while a spawned rank re-imported the calling script: the script calls it at "
            f"top level. Put that call under `{_GUARD}` (spawn runs the script's top-level code in every rank)"
        )


def _check_arguments(fn, world_size, backend, timeout, env) -> tuple[int, str, float]:
    if not callable(fn):
        raise TypeError(f"fn must be a module-level function, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be a Python int, got {type(world_size).__name__}; pass e.g. 2")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if env is not None and not (
        isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise TypeError("env must be a dict of str to str, e.g. env={'OMP_NUM_THREADS': '2'}")
    import torch

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str such as 'gloo' or 'nccl', got {type(backend).__name__}")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("backend='nccl' needs CUDA, which is not available; use backend='gloo'")
        if torch.cuda.device_count() < world_size:
            raise ValueError(
                f"backend='nccl' uses one GPU per rank, but world_size={world_size} > "
                f"{torch.cuda.device_count()} visible GPUs; lower world_size or use backend='gloo'"
            )
    return world_size, backend, float(timeout)


def _pickle_payload(fn, args) -> bytes:
    name = getattr(fn, "__qualname__", repr(fn))
    if "<lambda>" in name or "<locals>" in name:
        raise TypeError(f"fn={name} is a lambda or closure; pass a function defined at module level")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(sys.modules.get("__main__"), "__file__", None):
        raise TypeError(
            f"fn={name} is defined in an interactive session (notebook); spawned processes cannot import it. "
            "Put it in a .py module and import it from there"
        )
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file is not None and not os.path.exists(main_file):
        raise RuntimeError(
            f"the main script {main_file!r} is not a file (read from stdin?), and spawned processes re-import "
            "it; save the script to a file and run that"
        )
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(f"fn={name} is not picklable ({exc}); pass a function defined at module level") from exc
    try:
        return pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(f"args of run_local are not picklable ({exc}); pass tensors, numbers, strings...") from exc


def _rank_env(rank: int, world_size: int, env: dict[str, str] | None) -> dict[str, str]:
    out = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": "1"}
    out.update(env or {})
    out.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        NCCL_NVLS_ENABLE="0",
    )
    return out


@contextlib.contextmanager
def _child_env(updates: dict[str, str]):
    """Set ``updates`` in ``os.environ`` while a child starts (spawn copies the environment at exec time, so
    variables read at import, such as ``OMP_NUM_THREADS``, take effect); restore it afterwards."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in updates}
        os.environ.update(updates)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _collect(procs, conns, deadline: float, timeout: float) -> list:
    n = len(procs)
    results: dict[int, Any] = {}
    failures: dict[int, tuple[str, str, str]] = {}  # in the order the failures were seen
    started: set[int] = set()  # ranks whose bootstrap (the re-import of the main script) is over
    eof: set[int] = set()
    dead_since: dict[int, float] = {}
    first_failure_at = None
    while len(results) + len(failures) < n:
        now = time.monotonic()
        if first_failure_at is not None and now - first_failure_at > _FAILURE_GRACE_S:
            break
        if now > deadline:
            if failures:
                break
            raise TimeoutError(_timeout_message(timeout, [r for r in range(n) if r not in results], started))
        running = [r for r in range(n) if r not in results and r not in failures]
        waitables = [conns[r] for r in running if r not in eof] + [procs[r].sentinel for r in running]
        connection.wait(waitables, timeout=min(0.2, max(deadline - now, 0.0)))
        for r in running:
            while r not in eof and r not in results and r not in failures and conns[r].poll():
                _receive(r, conns[r], results, failures, eof, started)
            if r not in results and r not in failures and not procs[r].is_alive():
                # A report written before exit is already in the pipe; give it a moment before calling it lost.
                dead_since.setdefault(r, time.monotonic())
                if r in eof or time.monotonic() - dead_since[r] > _EXIT_GRACE_S:
                    failures[r] = ("ProcessDied", _exit_description(procs[r].exitcode, r in started), "")
            if r in failures and first_failure_at is None:
                first_failure_at = time.monotonic()
    if failures:
        killed = [r for r in range(n) if r not in results and r not in failures]
        raise _rank_error(failures, n, killed, started)
    return [results[r] for r in range(n)]


def _receive(rank: int, conn, results: dict, failures: dict, eof: set, started: set) -> None:
    try:
        data = conn.recv_bytes()
    except (EOFError, OSError):
        eof.add(rank)  # closed without a report: the exit-code path reports it
        return
    try:
        msg = pickle.loads(data)
        if msg[0] == "started":
            started.add(rank)
        elif msg[0] == "ok":
            import torch

            results[rank] = torch.load(io.BytesIO(msg[1]), map_location="cpu", weights_only=False)
        else:
            failures[rank] = tuple(msg[1:])
    except Exception as exc:  # noqa: BLE001 - a result this process cannot load is that rank's failure
        failures[rank] = ("ResultNotLoadable", f"its report could not be loaded here: {type(exc).__name__}: {exc}",
                          traceback.format_exc())


def _exit_description(code: int | None, started: bool) -> str:
    when = "" if started else " while starting (before run_local's code ran in it)"
    if code is not None and code < 0:
        try:
            sig = signal.Signals(-code).name
        except ValueError:
            sig = f"signal {-code}"
        return f"process was killed by {sig}{when} without reporting a result"
    return f"process exited with code {code}{when} without reporting a result"


def _startup_hint() -> str:
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    script = f"the calling script ({main})" if main else "the calling script"
    return (
        f"each spawned rank first re-imports {script} and runs its top-level code again, so a script that calls "
        f"run_local must do so under `{_GUARD}`; the rank's own error, if any, is on stderr above"
    )


def _timeout_message(timeout: float, pending: list[int], started: set[int]) -> str:
    msg = (f"run_local timed out after {timeout:g} s; ranks {pending} did not finish (pass a larger timeout=, or "
           "find the collective a rank skipped)")
    never = [r for r in pending if r not in started]
    if never:
        msg += f"; ranks {never} never got past starting: {_startup_hint()} (or raise timeout if it is just slow)"
    return msg


def _rank_error(failures: dict, world_size: int, killed: list[int], started: set[int]) -> RankError:
    rank = next(iter(failures))  # the first failure seen: later ones are often its echo in a collective
    kind, message, tb = failures[rank]
    head = f"rank {rank} of {world_size} failed: {kind}: {message}"
    if len(failures) == world_size and len({f[:2] for f in failures.values()}) == 1:
        verb = "died the same way" if kind == "ProcessDied" else "raised the same"
        head = f"every rank ({world_size} of {world_size}) {verb} {kind}: {message}"
    elif len(failures) > 1:
        head += f" (ranks {sorted(failures)} failed)"
    if killed:
        head += f"; ranks {killed} were still running and were killed"
    if any(f[0] == "ProcessDied" and r not in started for r, f in failures.items()):
        head += f".\nLikely cause: {_startup_hint()}"
    body = f"\n\n--- traceback of rank {rank} ---\n{tb}" if tb else ""
    return RankError(head + body, rank, tb, dict(failures))


def _stop(procs) -> None:
    """Terminate (then kill) every child still running and reap them all, so that none is left a zombie."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + _TERM_GRACE_S
    for p in procs:
        p.join(timeout=max(end - time.monotonic(), 0.0))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
        p.close()


# ----------------------------------------------------------------------------------------------- child side


def _child_main(rank: int, world_size: int, backend: str, run_dir: str, conn, forked: bool = False) -> None:
    if forked:  # from the preloaded server: the caller's environment at the call, not the server's
        with open(os.path.join(run_dir, f"environ{rank}.pkl"), "rb") as f:
            environ = pickle.load(f)
        os.environ.clear()
        os.environ.update(environ)
        if "torch" in sys.modules and environ.get("OMP_NUM_THREADS", "").isdigit():
            sys.modules["torch"].set_num_threads(int(environ["OMP_NUM_THREADS"]))
    _exit_with_parent()
    _send(conn, ("started",))  # the re-import of the main script is over: a death from here on is not the guard
    failed = False
    try:
        import torch
        import torch.distributed as dist

        with open(os.path.join(run_dir, "payload.pkl"), "rb") as f:
            fn, args = pickle.load(f)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(os.path.join(run_dir, "store"), world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        _wait_for_every_rank(store, world_size)
        result = fn(rank, world_size, *args)
        dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(result, buf)
        msg = ("ok", buf.getvalue())
    except BaseException as exc:  # noqa: BLE001 - every failure, SystemExit included, goes to the parent
        failed = True
        msg = ("err", *_describe(exc))  # strings only: the exception object itself may hold a lock or a group
    _send(conn, msg)  # report first: tearing down a broken group may block
    conn.close()
    if failed:
        _best_effort_destroy()


def _wait_for_every_rank(store, world_size: int) -> None:
    """Return once every rank's ``init_process_group`` has returned.  gloo's init can return on one rank while a
    peer is still connecting to it; a rank that then ran a quick ``fn`` and exited would fail that peer's init
    ("connectFullMesh failed ... Connection closed by peer").  Through the store, so no backend is involved."""
    store.add("packfwd/joined", 1)
    while store.add("packfwd/joined", 0) < world_size:  # the parent's timeout bounds this wait
        time.sleep(0.01)


def _describe(exc: BaseException) -> tuple[str, str, str]:
    def text(make) -> str:
        try:
            return str(make())
        except BaseException as inner:  # noqa: BLE001 - a broken __str__ must not lose the report
            return f"<unprintable: {type(inner).__name__}>"

    return type(exc).__name__, text(lambda: exc), text(traceback.format_exc)


def _send(conn, msg: tuple) -> None:
    try:
        conn.send_bytes(pickle.dumps(msg))
    except OSError:  # the parent is gone or stopped listening: nobody to tell
        pass


def _best_effort_destroy() -> None:
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the parent already has the real error
        pass


def _exit_with_parent() -> None:
    """Exit this child if its parent disappears (killed parent: no orphan stuck in a collective)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="packfwd-parent-watch").start()


def _example_all_reduce(rank: int, world_size: int, x: float) -> float:
    """Doctest helper for :func:`run_local`: all-reduce ``x + rank`` over the group."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([x + rank])
    dist.all_reduce(t)
    return t.item()
