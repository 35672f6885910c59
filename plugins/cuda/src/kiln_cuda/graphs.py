"""CUDA graphs for decode steps: one graph per capture size, all in one memory pool.

The engine builds the sizes largest first, so each smaller graph fits in the pool the
largest one allocated. Each graph reads its inputs from the example tensors it was
captured with; a step copies its padded inputs into them and replays.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.interfaces.attention import DecodeGraphInputs
from kiln.interfaces.platform import GraphRunner

WARMUP_RUNS = 2  # Triton compiles and caches its kernels on the first call; capture must not


class CudaGraphRunner(GraphRunner):
    def __init__(self) -> None:
        self.pool = None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, DecodeGraphInputs, torch.Tensor]] = {}

    def build(self, size: int, forward: Callable[..., torch.Tensor], inputs: DecodeGraphInputs) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up off the default stream, as capture requires
            for _ in range(WARMUP_RUNS):
                forward(*inputs.tensors())
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward(*inputs.tensors())
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[size] = (graph, inputs, out)

    def run(self, size: int, inputs: DecodeGraphInputs) -> torch.Tensor:
        graph, static, out = self.graphs[size]
        for dst, src in zip(static.tensors(), inputs.tensors()):
            dst.copy_(src)
        graph.replay()
        return out
