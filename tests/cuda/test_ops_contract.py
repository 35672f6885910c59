"""The CUDA plugin's Triton ops honour the ops contract: on GPU where one is present, else under
Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET before triton is
imported), as in test_triton_ops.py."""

from __future__ import annotations

import torch

from kiln.testing.lora_contract import LoRAOpsContract
from kiln.testing.ops_contract import OpsContract
from kiln_cuda import ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class TestTritonOpsContract(OpsContract):
    ops = ops.fused_ops()  # what CudaPlatform.custom_ops() returns, without initialising a GPU
    device = DEVICE
    # The interpreter's bf16 arithmetic is broken: bf16 on GPU only.
    dtypes = (torch.float32, torch.float16) + ((torch.bfloat16,) if DEVICE == "cuda" else ())
    # Documented in kiln_cuda.ops: results written into x/residual and q/k, as vLLM's kernels.
    in_place_ops = frozenset({"fused_add_rms_norm", "rotary_embedding"})
    if DEVICE == "cpu":  # the interpreter runs every kernel program in Python: fewer rows
        num_tokens = (1, 5, 17)


class TestTritonLoRAContract(LoRAOpsContract):
    ops = ops.fused_ops()
    device = DEVICE
    dtypes = TestTritonOpsContract.dtypes
