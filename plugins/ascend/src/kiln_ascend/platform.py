"""The ``npu`` platform: Huawei Ascend through torch_npu (imported when this platform is chosen)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kiln import EngineConfig
from kiln.interfaces.platform import GraphRunner, Platform, measure_peak_memory

if TYPE_CHECKING:
    from kiln.interfaces.quantization import LinearMethod, QuantScheme


def check_versions() -> None:
    """Import torch_npu, or fail with one actionable message naming what was found and what is needed."""
    torch_version = torch.__version__.split("+")[0]
    cann = os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH") or "not found"
    try:
        import torch_npu
    except Exception as exc:  # missing CANN libraries, a torch ABI mismatch...
        raise RuntimeError(
            f"torch_npu could not be imported ({type(exc).__name__}: {exc}). Found torch {torch_version}, "
            f"CANN toolkit: {cann}. Install the torch_npu build for torch {torch_version} and source CANN's "
            "set_env.sh (/usr/local/Ascend/ascend-toolkit/set_env.sh) before starting Kiln."
        ) from None
    npu_version = torch_npu.__version__.split("+")[0].split(".post")[0]
    if npu_version.split(".")[:2] != torch_version.split(".")[:2]:
        raise RuntimeError(
            f"torch {torch_version} and torch_npu {npu_version} do not match (CANN toolkit: {cann}): "
            f"install torch_npu {'.'.join(torch_version.split('.')[:2])}.x, or the torch its release needs."
        )


class NpuPlatform(Platform):
    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    supported_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    supported_block_sizes = (64, 128)  # what the deployment guide supports
    default_block_size = 128

    def __init__(self) -> None:
        check_versions()

    def device(self) -> torch.device:
        # ASCEND_RT_VISIBLE_DEVICES is applied by the runtime: index 0 is the first visible NPU.
        return torch.device("npu", torch.npu.current_device())

    def init_rank(self, rank: int, world_size: int) -> None:
        torch.npu.set_device(rank)  # one NPU per rank, in ASCEND_RT_VISIBLE_DEVICES order

    def mem_get_info(self) -> tuple[int, int]:
        return torch.npu.mem_get_info()

    def peak_memory_of(self, fn: Callable[[], object]) -> int | None:
        return measure_peak_memory(torch.npu, fn)

    def synchronize(self) -> None:
        torch.npu.synchronize()

    def dtype_for(self, model_dtype: torch.dtype | None) -> torch.dtype:
        return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16

    def update_config(self, config: EngineConfig) -> None:
        if config.block_size is not None and config.block_size not in self.supported_block_sizes:
            raise ValueError(
                f"--block-size: {config.block_size} is not supported on Ascend NPUs; use 64 or 128 "
                "(the sizes torch_npu's paged attention supports)"
            )
        super().update_config(config)

    def attention_backend(self) -> str:
        return "ascend"

    def custom_ops(self) -> dict[str, Callable]:
        from kiln_ascend.ops import fused_ops

        return fused_ops()

    def linear_method(self, scheme: QuantScheme) -> LinearMethod | None:
        from kiln_ascend.quant import linear_method

        return linear_method(scheme)

    def graph_runner(self, config: EngineConfig) -> GraphRunner | None:
        from kiln_ascend.graph import TorchairGraphRunner

        try:
            return TorchairGraphRunner(config)
        except ImportError as exc:
            raise RuntimeError(
                f"graph mode needs torchair, which ships with torch_npu ({exc}); "
                "start with --enforce-eager to run without it"
            ) from None

    def graph_sizes(self, config: EngineConfig) -> list[int]:
        from kiln_ascend.graph import decode_gears

        return decode_gears(config)
