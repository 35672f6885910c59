"""Tensor parallelism across processes: ranks 1..N-1 of an engine, one process each.

Rank 0 is the engine's own process: it schedules, samples and detokenizes. Every step it
sends the step's ``StepBatch`` down a pipe to each worker before running the same forward
itself; the ranks meet in the model's all-reduces over the platform's collective backend
(gloo, nccl, hccl). Workers are spawned, not forked: CUDA and NPU runtimes do not survive
a fork.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import socket

import torch

from kiln.config import EngineConfig
from kiln.worker.builder import worker_main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelWorkers:
    def __init__(self, config: EngineConfig, model_path: str, dtype: torch.dtype, world_size: int) -> None:
        self.init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self.procs: list[mp.process.BaseProcess] = []
        self.conns = []
        args = (config.model_dump_json(), str(dtype).removeprefix("torch."), model_path)
        for rank in range(1, world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(*args, rank, world_size, self.init_method, child),
                name=f"kiln-tp-rank{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        atexit.register(self.shutdown)

    def expect(self, state: str) -> None:
        """Wait until every worker reports ``state``; a worker's error or exit raises here."""
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(1.0):
                if not proc.is_alive():
                    raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.exitcode}) while starting")
            try:
                kind, detail = conn.recv()
            except EOFError:
                raise RuntimeError(f"tensor-parallel rank {rank} exited while starting") from None
            if kind == "error":
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {detail}")
            if kind != state:
                raise RuntimeError(f"tensor-parallel rank {rank} reported {kind!r}, expected {state!r}")

    def send(self, message: object) -> None:
        for conn in self.conns:
            conn.send(message)

    def shutdown(self) -> None:
        """Stop every worker (idempotent)."""
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self.procs, self.conns = [], []
