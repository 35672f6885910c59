"""Trial compiles of guided-decoding constraints in worker processes that are killed past a time limit.

Why a process: neither shipped compiler can be interrupted, and input size does not bound their
time. Measured on one core: xgrammar compiles an EBNF grammar in time superlinear in its nested
rules (300 rules ``r{i} ::= (r{i+1} | "q")*``, 7 KB, take 1.8 s; 3000 take minutes), and
lm-format-enforcer builds a DFA exponential in a regex (``(a|b)*a(a|b){14}`` takes a minute, ``{20}``
hours; it is the fallback for every regex xgrammar refuses, e.g. one with ``(?i)``). A thread cannot
be stopped, so such a compile would hold a core forever. So each new constraint is first compiled
here, in one of a few long-lived worker processes; one that runs past the limit is killed (the
request gets a 400) and replaced. A constraint that compiled in time is then compiled again in the
server's process, which is cheaper than shipping the result back (xgrammar's serialized grammars
run to megabytes and take longer to serialize and load than to compile).

Workers are plain ``python -m kiln.engine.guided_sandbox`` children (not ``multiprocessing``
spawns, which re-import the caller's ``__main__``), talking over a socket pair with
``multiprocessing.connection`` framing. The limit counts the compile only, not a worker's start
(imports, building the backend's tokenizer tables).
"""

from __future__ import annotations

import pickle
import signal
import socket
import subprocess
import sys
import threading
import weakref
from multiprocessing.connection import Connection
from typing import Any

from kiln.engine.guided_limits import check_admits_output, field_name
from kiln.interfaces.guided import GuidedDecodingParams, UnsupportedConstraint

# Starting a worker (python, torch, the backend's tables) is slow on a busy machine, but must end.
START_TIMEOUT_S = 300.0
_STARTED = "started"


class CompileSandbox:
    """Trial-compiles constraints in up to ``workers`` processes, each compile bounded by ``timeout_s``.

    ``factories`` maps backend names to ``"module:Class"`` references (importable by a fresh
    interpreter). ``check`` raises what the backend's ``compile`` would (``UnsupportedConstraint``,
    ``ValueError``), plus a ``ValueError`` for a compile that ran too long or crashed the worker (which
    is then replaced).
    While every worker is busy, a caller waits for one (at most ``timeout_s`` per compile ahead of it).
    """

    def __init__(
        self, factories: dict[str, str], tokenizer, vocab_size: int, timeout_s: float, workers: int = 2
    ) -> None:
        self.timeout_s = timeout_s
        self._config = (factories, tokenizer, vocab_size)
        self._setup: bytes | None = None  # the pickled config, made when the first worker starts
        self._slots = threading.Semaphore(workers)
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._all: set[_Worker] = set()  # every live worker, idle or busy
        weakref.finalize(self, _stop_all, self._all)  # workers end with the manager that owns them

    def check(self, backend: str, params: GuidedDecodingParams) -> None:
        """Compile ``params`` with ``backend`` in a worker and check there that it admits some output."""
        with self._slots:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            if worker is not None and worker.proc.poll() is not None:  # it died idle (killed from outside)
                worker.stop(self._all)
                worker = None
            try:
                if worker is None:
                    self._setup = self._setup or pickle.dumps(self._config)
                    worker = _Worker(self._setup, self._all)
                outcome, message = worker.run((backend, params), self.timeout_s)
            except (_WorkerLost, OSError) as exc:
                if worker is not None:
                    worker.stop(self._all)
                raise ValueError(f"{field_name(params)}: {exc}") from None
            with self._lock:
                self._idle.append(worker)
        if outcome == "unsupported":
            raise UnsupportedConstraint(message)
        if outcome == "invalid":
            raise ValueError(message)


class _WorkerLost(Exception):
    pass


class _Worker:
    def __init__(self, setup: bytes, registry: set[_Worker]) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.engine.guided_sandbox", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        registry.add(self)
        self.conn.send(sys.path)  # first, so that what follows unpickles as it does here
        self.conn.send_bytes(setup)

    def run(self, job: tuple, timeout_s: float) -> tuple[str, str]:
        try:
            self.conn.send(job)
            self._wait(START_TIMEOUT_S, "the compile worker did not start")
            self.conn.recv()  # _STARTED: the backend is built, the clock starts now
            self._wait(timeout_s, f"compiling took longer than {timeout_s:g} s (KILN_GUIDED_COMPILE_TIMEOUT_S)")
            return self.conn.recv()
        except (EOFError, OSError):
            raise _WorkerLost("the compiler crashed on this constraint") from None

    def _wait(self, timeout_s: float, message: str) -> None:
        if not self.conn.poll(timeout_s):
            raise _WorkerLost(message)

    def stop(self, registry: set[_Worker]) -> None:
        registry.discard(self)
        self.proc.kill()
        self.proc.wait()
        self.conn.close()


def _stop_all(workers: set[_Worker]) -> None:
    for worker in list(workers):
        worker.stop(workers)


def _serve(conn: Connection) -> None:
    """The worker's loop: build backends on first use, compile, answer (outcome, message)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the server, which then stops us
    sys.path[:] = conn.recv()
    from kiln.registry import load_ref

    factories, tokenizer, vocab_size = pickle.loads(conn.recv_bytes())
    backends: dict[str, Any] = {}
    while True:
        try:
            name, params = conn.recv()
        except EOFError:
            return
        if name not in backends:
            backends[name] = load_ref(factories[name])(tokenizer, vocab_size)
        conn.send(_STARTED)
        try:
            check_admits_output(backends[name].compile(params), params, vocab_size)
            conn.send(("ok", ""))
        except UnsupportedConstraint as exc:
            conn.send(("unsupported", str(exc)))
        except Exception as exc:  # noqa: BLE001 - whatever a compiler raises on client input is a 400
            message = str(exc) if isinstance(exc, ValueError) else f"{field_name(params)}: {type(exc).__name__}: {exc}"
            conn.send(("invalid", message))


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
