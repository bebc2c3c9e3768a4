"""Long-lived worker processes, one per Keras backend, and the pool that reuses them.

Starting Keras on a backend costs seconds (TensorFlow alone takes several), so the harness pays it
once: each worker serves many requests. A worker that dies is restarted and the request sent
again once; a worker that does not answer within the timeout is killed and the request fails with
``WorkerTimeout``. Every failure is a one-line ``EquivalenceError`` naming the backend, the
operation and the tail of the worker's stderr: a crash or a hang never hangs the caller.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

from kbackend.backend_choice import BACKENDS, validate_backend
from kbackend.equivalence.protocol import ChannelClosed, ChannelTimeout, receive, send
from kbackend.errors import KBackendError
from kbackend.runtime.child import child_environment

DEFAULT_TIMEOUT = 300.0
DEFAULT_STARTUP_TIMEOUT = 300.0


class EquivalenceError(KBackendError):
    """A comparison could not run (a worker failed, died or hung)."""

    # The backends whose workers failed the same request (``WorkerPool.call_each`` sets it).
    failed_backends: tuple[str, ...] = ()


class WorkerCrashed(EquivalenceError):
    """A worker process died."""


class WorkerTimeout(EquivalenceError):
    """A worker did not answer in time and was killed."""


class WorkerFailed(EquivalenceError):
    """An operation raised an exception inside a worker (the worker itself is fine)."""

    def __init__(self, message: str, backend: str, error: str, details: str) -> None:
        super().__init__(message)
        self.backend, self.error, self.details = backend, error, details


class Worker:
    """One Python process running Keras on ``backend``."""

    def __init__(self, backend: str, log_dir: str | os.PathLike,
                 startup_timeout: float = DEFAULT_STARTUP_TIMEOUT) -> None:
        self.backend = validate_backend(backend)
        self.log_path = Path(log_dir) / f"worker-{self.backend}.log"
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.busy_with: str | None = None  # the operation in flight, if any

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _launched(self) -> tuple[subprocess.Popen[bytes], IO[bytes], IO[bytes]]:
        """The process ``launch`` started, its stdin and its stdout (pipes, never None)."""
        process = self.process
        assert process is not None and process.stdin is not None and process.stdout is not None
        return process, process.stdin, process.stdout

    def launch(self) -> None:
        """Start the process (without waiting for it to be ready; see ``wait_ready``)."""
        env = child_environment(self.backend)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child process
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kbackend.equivalence.worker"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, env=env, cwd=os.getcwd(),
            )
        finally:
            log.close()
        self.starts += 1

    def wait_ready(self) -> None:
        """Wait for the worker's ready message (Keras imported on its backend)."""
        process, _, stdout = self._launched()
        try:
            hello = receive(stdout.fileno(), self.startup_timeout)
        except ChannelTimeout:
            self.kill()
            raise WorkerTimeout(f"The {self.backend} worker did not start within "
                                f"{self.startup_timeout:.0f} s; killed it. "
                                f"{self._log_tail()}") from None
        except ChannelClosed:
            raise WorkerCrashed(f"The {self.backend} worker exited while starting (status "
                                f"{process.wait()}). {self._log_tail()}") from None
        if hello.get("backend") != self.backend:
            self.kill()
            raise EquivalenceError(f"Worker started on backend {hello.get('backend')!r}, "
                                   f"expected {self.backend!r}.")

    def submit(self, op: str, args: dict[str, Any]) -> None:
        """Send one request; raises ``WorkerCrashed`` if the worker is gone."""
        if not self.alive():
            raise WorkerCrashed(f"The {self.backend} worker is not running.")
        _, stdin, _ = self._launched()
        try:
            send(stdin, {"op": op, "args": args})
            self.busy_with = op
        except (BrokenPipeError, OSError):
            raise WorkerCrashed(self._died_message(op)) from None

    def collect(self, op: str, timeout: float) -> Any:
        """The reply to the request in flight; raises on a crash, a timeout or a remote error."""
        _, _, stdout = self._launched()
        try:
            reply = receive(stdout.fileno(), timeout)
            self.busy_with = None
        except ChannelTimeout:
            self.kill()
            raise WorkerTimeout(f"The {self.backend} worker did not answer {op!r} within "
                                f"{timeout:.0f} s; killed it (it restarts on the next request). "
                                f"{self._log_tail()}") from None
        except ChannelClosed:
            raise WorkerCrashed(self._died_message(op)) from None
        if not reply["ok"]:
            raise WorkerFailed(f"{op!r} failed on {self.backend}: {reply['error']}",
                               self.backend, reply["error"], reply["traceback"])
        return reply["result"]

    def _died_message(self, op: str) -> str:
        status = self.process.wait() if self.process is not None else None
        return (f"The {self.backend} worker died during {op!r} (exit status {status}). "
                f"{self._log_tail()}")

    def _log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            return ""
        return ("Last worker log lines: " + " | ".join(text)) if text else ""

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def close(self, timeout: float = 3.0) -> None:
        """Ask the worker to exit; kill it if it does not."""
        if self.process is None:
            return
        if self.alive():
            try:
                self.submit("exit", {})
                self.process.wait(timeout)
            except (EquivalenceError, subprocess.TimeoutExpired, OSError):
                self.kill()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


class WorkerPool:
    """One worker per backend, started on first use, reused, restarted when one dies.

    ``call(backend, op, **args)`` runs one operation; ``call_each`` runs one per backend
    concurrently (both workers compute at the same time). A request whose worker dies is sent
    again once to a fresh worker; a second death, a timeout or a remote error raises.
    """

    def __init__(self, backends: Sequence[str] = BACKENDS, timeout: float = DEFAULT_TIMEOUT,
                 startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
                 log_dir: str | os.PathLike | None = None) -> None:
        self.backends = tuple(validate_backend(b) for b in backends)
        self.timeout = timeout
        self._own_dir: tempfile.TemporaryDirectory[str] | None = None
        if log_dir is None:
            self._own_dir = tempfile.TemporaryDirectory(prefix="kbackend-equiv-")
            self.work_dir = Path(self._own_dir.name)
        else:
            self.work_dir = Path(log_dir)
        self.workers = {b: Worker(b, self.work_dir, startup_timeout) for b in self.backends}
        self.restarts = 0

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, backends: Iterable[str] | None = None) -> None:
        """Start the workers not running yet, in parallel (their start-up costs overlap)."""
        wanted = self.backends if backends is None else [validate_backend(b) for b in backends]
        pending = [self.workers[b] for b in wanted if not self.workers[b].alive()]
        for worker in pending:
            if worker.starts:
                self.restarts += 1
                worker.kill()
            worker.launch()
        for worker in pending:
            worker.wait_ready()

    def call(self, backend: str, op: str, timeout: float | None = None, **args: Any) -> Any:
        """Run ``op`` on the ``backend`` worker and return its result."""
        return self.call_each({backend: args}, op, timeout)[backend]

    def call_each(self, args_by_backend: dict[str, dict[str, Any]], op: str,
                  timeout: float | None = None) -> dict[str, Any]:
        """Run ``op`` on several workers at once (each with its own arguments)."""
        timeout = self.timeout if timeout is None else timeout
        pending = dict(args_by_backend)
        results: dict[str, Any] = {}
        for attempt in (1, 2):
            self.start(list(pending))
            submitted, crashed = [], {}
            for backend, args in pending.items():
                try:
                    self.workers[backend].submit(op, args)
                    submitted.append(backend)
                except WorkerCrashed as error:
                    crashed[backend] = error
            failed: dict[str, EquivalenceError] = {}
            for backend in submitted:
                try:
                    results[backend] = self.workers[backend].collect(op, timeout)
                except WorkerCrashed as error:
                    crashed[backend] = error
                except EquivalenceError as error:
                    failed[backend] = error
            if failed:
                first_error = next(iter(failed.values()))
                first_error.failed_backends = tuple(failed)
                raise first_error
            if not crashed:
                return results
            if attempt == 2:
                raise next(iter(crashed.values()))
            pending = {b: pending[b] for b in crashed}
        return results

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
        if self._own_dir is not None:
            self._own_dir.cleanup()
            self._own_dir = None
