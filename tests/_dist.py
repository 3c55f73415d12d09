"""A pool of worker processes joined in one torch.distributed process group, reused across tests.

Each worker initialises the process group once (gloo on CPU, NCCL with one GPU per rank), then
runs tasks: a check function named ``"module:function"``, called as ``fn(rank, world_size, *args)``
on every rank. :meth:`DistPool.run` waits for all ranks under a timeout; a rank that raises fails
the task with every rank's traceback, and a task that does not finish in time (a hang) fails it
and tears the pool down (the next task starts a fresh one).

Test modules share pools through :func:`shared_pool` (one per world size, backend and timeout, kept
for the module's later tests; tests/conftest.py closes them after each module) and parametrize
their ``dist_run`` fixture with :func:`dist_params` / :func:`dist_runner`.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback


def _worker(rank, world_size, backend, init_file, pg_timeout_s, tasks, results, sys_path):
    sys.path[:] = sys_path
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kwargs["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
            **kwargs,
        )
        import verl_ops  # noqa: F401
    except BaseException:
        results.put(("ready", rank, False, traceback.format_exc()))
        return
    results.put(("ready", rank, True, None))
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, ref, args = task
        try:
            module, name = ref.split(":")
            fn = getattr(importlib.import_module(module), name)
            results.put((task_id, rank, True, fn(rank, world_size, *args)))
        except BaseException:
            results.put((task_id, rank, False, traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


class DistTimeout(AssertionError):
    pass


class DistPool:
    """``world_size`` processes in one process group; see the module doc."""

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        *,
        pg_timeout_s: float = 30.0,
        start_timeout_s: float = 180.0,
    ):
        self.world_size = world_size
        self.backend = backend
        self.pg_timeout_s = pg_timeout_s
        self.start_timeout_s = start_timeout_s
        self._procs = []
        self._next_id = 0

    def _start(self):
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="verl_ops_dist_")
        init_file = os.path.join(self._dir.name, "init")
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r, self.world_size, self.backend, init_file, self.pg_timeout_s,
                    self._tasks[r], self._results, list(sys.path),
                ),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect("ready", self.start_timeout_s)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def _collect(self, task_id, timeout_s):
        deadline = time.monotonic() + timeout_s
        got = {}
        while len(got) < self.world_size:
            left = deadline - time.monotonic()
            try:
                tid, rank, ok, payload = self._results.get(timeout=max(0.05, min(left, 1.0)))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if left <= 0 or dead:
                    missing = sorted(set(range(self.world_size)) - set(got))
                    self.close(force=True)
                    why = f"rank(s) {dead} died" if dead else f"no answer within {timeout_s:.0f} s (a hang?)"
                    raise DistTimeout(f"{task_id}: {why}; missing ranks {missing}") from None
                continue
            if tid != task_id:
                continue  # a late answer of an earlier, timed-out task
            got[rank] = (ok, payload)
        failed = {r: p for r, (ok, p) in got.items() if not ok}
        if failed:
            # Ranks may be out of step after a failure; the next task gets a fresh group.
            self.close(force=True)
            msg = "\n".join(f"--- rank {r}:\n{tb}" for r, tb in sorted(failed.items()))
            raise AssertionError(f"{task_id} failed on rank(s) {sorted(failed)}:\n{msg}")
        return [got[r][1] for r in range(self.world_size)]

    def run(self, ref: str, *args, timeout_s: float = 90.0):
        """Run ``ref`` on every rank; returns the per-rank results (picklable) in rank order."""
        if not self.alive:
            self.close(force=True)
            self._start()
        self._next_id += 1
        task_id = f"{ref}#{self._next_id}"
        for q in self._tasks:
            q.put((task_id, ref, args))
        return self._collect(task_id, timeout_s)

    def close(self, force: bool = False):
        if not self._procs:
            return
        if not force:
            for q in self._tasks:
                try:
                    q.put(None)
                except Exception:
                    pass
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
        self._dir.cleanup()


# --------------------------------------------------------------------------------------------
# Pools shared by the tests of one module.

_shared: dict = {}


def shared_pool(world_size: int, backend: str = "gloo", *, pg_timeout_s: float = 30.0) -> DistPool:
    """The pool of ``(world_size, backend, pg_timeout_s)``, started on its first task and reused by
    the module's later tests; :func:`close_shared_pools` ends them."""
    key = (world_size, backend, pg_timeout_s)
    if key not in _shared:
        _shared[key] = DistPool(world_size, backend, pg_timeout_s=pg_timeout_s)
    return _shared[key]


def close_shared_pools():
    for pool in _shared.values():
        pool.close()
    _shared.clear()


def skip_reason(backend: str, world_size: int):
    """Why a ``(backend, world_size)`` pool cannot run here, or None."""
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        if not torch.cuda.is_available():
            return "NCCL checks need CUDA"
        if torch.cuda.device_count() < world_size:
            return f"NCCL checks at {world_size} ranks need {world_size} GPUs, found {torch.cuda.device_count()}"
        if not dist.is_nccl_available():
            return "torch was built without NCCL"
    elif not dist.is_gloo_available():
        return "torch was built without gloo"
    return None


def dist_params(backends, world_sizes) -> list:
    """pytest params ``(backend, world_size)`` with ids like ``gloo2``; NCCL ones carry the gpu marker."""
    import pytest

    return [
        pytest.param((b, w), id=f"{b}{w}", marks=[pytest.mark.gpu] if b == "nccl" else [])
        for b in backends
        for w in world_sizes
    ]


def dist_runner(request, module: str, *, pass_backend: bool = True, pg_timeout_s: float = 30.0,
                timeout_s: float = 120.0):
    """For a fixture parametrized by :func:`dist_params`: skips where that pool cannot run, else
    returns ``run(check_name, *args, timeout_s=...)``, which calls ``module:check_name`` on every
    rank of the shared pool as ``check(rank, world_size, backend, *args)`` (``pass_backend=False``:
    without ``backend``) and returns the per-rank results. ``run.world`` and ``run.backend`` name
    the pool."""
    import pytest

    backend, world = request.param
    reason = skip_reason(backend, world)
    if reason:
        pytest.skip(reason)
    lead = (backend,) if pass_backend else ()

    def run(name, *args, timeout_s=timeout_s):
        pool = shared_pool(world, backend, pg_timeout_s=pg_timeout_s)
        return pool.run(f"{module}:{name}", *lead, *args, timeout_s=timeout_s)

    run.world = world
    run.backend = backend
    return run
