"""One worker process per device on this machine (spawned), each holding its rank's share of the model.

A call is pickled once and written to every rank's pipe; each rank answers on its pipe (the driver with the
step's output, the others with None). The executor waits on the pipes and on the processes' sentinels
together, so a worker that dies is noticed at once, whatever it was doing. When one rank fails, its peers may
be stuck in a collective waiting for it: they get ``PEER_TIMEOUT_S`` to answer before the executor gives up.
Giving up (``ExecutorDead``) kills every worker; so do ``shutdown`` and the executor's finalizer, and each
worker exits by itself when the engine's process goes away: no orphans.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import socket
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait

import torch

from paged_runtime.executor.base import Executor
from paged_runtime.utils.devices import resolve_device
from paged_runtime.worker.worker import Placement, Worker, WorkerSpec

logger = logging.getLogger(__name__)

# After one rank failed, how long its peers get to answer (a peer blocked in a collective never will).
PEER_TIMEOUT_S = 30.0
SHUTDOWN_TIMEOUT_S = 5.0


class MultiprocExecutor(Executor):
    workers = "worker processes"

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)
        context = multiprocessing.get_context("spawn")  # fork would copy the engine's threads and CUDA state
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.conns: list[Connection] = []
        self.procs = []
        for rank in range(self.world_size):
            ours, theirs = context.Pipe()
            placement = Placement(rank, self.tp_size, self.pp_size, init_method, local_rank=rank)
            proc = context.Process(target=worker_main, args=(theirs, spec, placement, os.getpid()),
                                   name=f"paged-runtime-worker-{rank}", daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        try:
            self._gather(range(self.world_size))  # every worker built its share of the model
        except BaseException:
            self.shutdown()  # the others may wait for the failed one in the rendezvous
            raise

    @property
    def worker_pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def call(self, method: str, *args, driver_only: bool = False) -> list:
        self.check_dead()  # a worker that died since is seen by its sentinel while answers are awaited
        ranks = [self.driver] if driver_only else list(range(self.world_size))
        message = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for rank in ranks:
                self.conns[rank].send_bytes(message)
        except OSError as e:  # a broken pipe: the worker is gone
            self._die(f"a worker cannot be reached: {e}")
        return self._gather(ranks)

    def _gather(self, ranks) -> list:
        """Every rank's answer, in order; raises the first rank's error once all answered (or gave up)."""
        pending = {self.conns[rank]: rank for rank in ranks}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        results, failure, deadline = {}, None, None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(list(pending) + list(sentinels), timeout)
            if not ready:
                self._die(f"ranks {sorted(pending.values())} did not answer within {PEER_TIMEOUT_S:.0f} s after "
                          f"rank {failure[0]} failed: {failure[1]!r}")
            for conn in [r for r in ready if r in pending]:
                rank = pending.pop(conn)
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    self._die(f"worker {rank} exited ({self._exit_reason(rank)})")
                if status == "ok":
                    results[rank] = value
                elif failure is None:
                    failure, deadline = (rank, value), time.monotonic() + PEER_TIMEOUT_S
            for sentinel in [r for r in ready if r in sentinels]:
                self._die(f"worker {sentinels[sentinel]} exited ({self._exit_reason(sentinels[sentinel])})")
        if failure is not None:
            raise failure[1]
        return [results[rank] for rank in ranks]

    def _exit_reason(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(1.0)
        code = proc.exitcode
        return "still running" if code is None else (f"killed by signal {-code}" if code < 0 else f"exit code {code}")

    def check_health(self) -> None:
        self.check_dead()
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                self._die(f"worker {rank} exited ({self._exit_reason(rank)})")

    def alive(self) -> bool:
        return self.dead is None and all(proc.exitcode is None for proc in self.procs)

    def shutdown(self) -> None:
        self._finalizer()


def _stop(procs, conns: list[Connection]) -> None:
    """Ask every worker to exit, then make sure: terminate, kill."""
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(("close", ())))
        except OSError:
            pass
    deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(SHUTDOWN_TIMEOUT_S)
    for conn in conns:
        conn.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the worker process ------------------------------------------------------------------------------
def worker_main(conn: Connection, spec: WorkerSpec, placement: Placement, parent_pid: int) -> None:
    """Build this rank's worker, then answer calls until ``close`` (or the engine's process is gone)."""
    _exit_with_parent(parent_pid)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks meet on 127.0.0.1
    if resolve_device(spec.config.device).type == "cpu":  # the ranks share the cores instead of each taking all
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // placement.world_size))
    try:
        worker = Worker(spec, placement)
    except BaseException as e:
        logger.exception("worker %d failed to start", placement.rank)
        conn.send(("error", _portable(e)))
        return
    conn.send(("ok", None))
    try:
        while True:
            method, args = pickle.loads(conn.recv_bytes())
            if method == "close":
                break
            try:
                reply = ("ok", getattr(worker, method)(*args))
            except BaseException as e:
                logger.exception("worker %d: %s failed", placement.rank, method)
                reply = ("error", _portable(e))
            conn.send(reply)
    except (EOFError, OSError):  # the engine went away
        pass
    finally:
        worker.close()


def _portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling, else a RuntimeError carrying its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def _exit_with_parent(parent_pid: int) -> None:
    """Exit when the engine's process is gone, even from inside a collective that will never complete."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, name="paged-runtime-parent-watch", daemon=True).start()
