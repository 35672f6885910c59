"""The ``cuda`` platform: NVIDIA GPUs through Triton kernels."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kiln import EngineConfig
from kiln.interfaces.platform import GraphRunner, Platform, measure_peak_memory

if TYPE_CHECKING:
    from kiln.interfaces.quantization import LinearMethod, QuantScheme


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    supported_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    supported_block_sizes = (16, 32, 64, 128)
    supported_kv_cache_dtypes = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    default_block_size = 16

    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def init_rank(self, rank: int, world_size: int) -> None:
        torch.cuda.set_device(rank)  # one GPU per rank, in CUDA_VISIBLE_DEVICES order

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info()

    def peak_memory_of(self, fn: Callable[[], object]) -> int | None:
        return measure_peak_memory(torch.cuda, fn)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def dtype_for(self, model_dtype: torch.dtype | None) -> torch.dtype:
        if model_dtype in (torch.float16, torch.bfloat16):
            return model_dtype
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def attention_backend(self) -> str:
        return "triton"

    def custom_ops(self) -> dict[str, Callable]:
        from kiln_cuda.ops import fused_ops

        return fused_ops()

    def linear_method(self, scheme: QuantScheme) -> LinearMethod | None:
        from kiln_cuda.quant import linear_method

        return linear_method(scheme)

    def graph_runner(self, config: EngineConfig) -> GraphRunner | None:
        from kiln_cuda.graphs import CudaGraphRunner

        return CudaGraphRunner()
