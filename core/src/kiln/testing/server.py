"""``RemoteServer``: run ``kiln serve`` in a subprocess for end-to-end tests and benchmarks."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """Starts ``kiln serve ARGS`` on a free local port; stops that process (by its id) on exit."""

    def __init__(
        self, args: list[str], env: dict[str, str] | None = None, timeout: float = 180.0, tls: dict | None = None
    ) -> None:
        """``tls``: httpx client arguments (``verify``, ``cert``) for a server started with ``--ssl-*``."""
        self.port = free_port()
        self.tls = tls
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.args = args
        self.env = {**os.environ, **(env or {})}
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None

    def __enter__(self) -> RemoteServer:
        cmd = [sys.executable, "-m", "kiln.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        started = time.monotonic()
        # A file, not a pipe: a chatty server must never block on a full pipe nobody reads.
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kiln-serve-", suffix=".log")
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0, **(self.tls or {})).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"kiln serve not healthy after {self.timeout} s")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def terminate(self) -> None:
        """Send SIGTERM (a graceful drain), leaving the process to exit."""
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.log.close()


def metric_value(text: str, name: str, default: float | None = None, **labels: str) -> float:
    """The sum of Prometheus sample ``name``'s values in ``text`` (``/metrics``) over its series
    that carry ``labels``; ``default`` when no series does (``KeyError`` without one)."""
    total, found = 0.0, False
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total, found = total + float(match.group(2)), True
    if found:
        return total
    if default is None:
        raise KeyError(name)
    return default
