"""The CPU platform."""

from __future__ import annotations

import os

import numpy as np
import psutil
import torch

from kiln.platforms.base import Platform


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    default_block_size = 32

    def __init__(self) -> None:
        # One OpenMP thread per physical core: hyper-threads only add contention.
        threads = int(os.environ.get("KILN_CPU_THREADS", 0)) or psutil.cpu_count(logical=False) or os.cpu_count()
        torch.set_num_threads(threads)

    def device(self) -> torch.device:
        return torch.device("cpu")

    def mem_get_info(self) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return vm.available, vm.total

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # NOTE: numpy's zeros come from calloc, i.e. fresh zero pages from the kernel:
        # blocks never written cost no resident memory, unlike torch.zeros, which
        # writes every byte. So a large KV pool is cheap until it is used.
        nbytes = int(np.prod(shape)) * torch.finfo(dtype).bits // 8
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)

    def dtype_for(self, model_dtype: torch.dtype | None) -> torch.dtype:
        # NOTE: without AMX, bf16/fp16 matmuls are no faster than fp32 on x86 CPUs
        # (measured), and fp32 keeps outputs identical to a fp32 reference.
        return torch.float32

    def attention_backend(self) -> str:
        return "cpu"
