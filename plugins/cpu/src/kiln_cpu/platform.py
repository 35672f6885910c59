"""The CPU platform."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import numpy as np
import psutil
import torch

from kiln.interfaces.platform import Platform
from kiln_cpu import form_cache, huge_pages
from kiln_cpu.module_swap import replace_linears
from kiln_cpu.native import bf16_dots_outrun_fma, fma_outruns_bf16_dots, has_amx_bf16
from kiln_cpu.packed_linear import kernel_works

logger = logging.getLogger("kiln.cpu")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def _integer_activations(model: torch.nn.Module, gguf: bool) -> int:
    """How experts held in integer blocks multiply (``tiled_matmul``'s modes): as a GGUF file's
    linear layers do (int8 per block), or as the checkpoint's quantized linear layers do (W8A8 per
    row; weight-only per block unless ``KILN_CPU_INT8_ACTIVATIONS=0``); fp32 products otherwise."""
    from kiln_cpu.tiled_weights import INT8_PER_BLOCK, TiledLinear

    if gguf:
        return INT8_PER_BLOCK
    return max((m.int8_activations for m in model.modules() if isinstance(m, TiledLinear)), default=0)


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    default_block_size = 32
    kv_memory_on_first_write = True  # see allocate_kv_cache
    # bf16 K/V under an fp32 model: half the memory; fp8 a quarter (e5m2 decodes in C, the rest through torch)
    supported_kv_cache_dtypes = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")

    def __init__(self) -> None:
        # One OpenMP thread per physical core: hyper-threads only add contention.
        threads = int(os.environ.get("KILN_CPU_THREADS", 0)) or psutil.cpu_count(logical=False) or os.cpu_count()
        torch.set_num_threads(threads)
        self.libc = huge_pages.GLIBC
        self._malloc_tuned = False
        self._repacked = [0, 0]  # weights tiled, of them in GGUF blocks

    def device(self) -> torch.device:
        return torch.device("cpu")

    def init_rank(self, rank: int, world_size: int) -> None:
        # Ranks share the cores: each takes its part instead of all of them.
        torch.set_num_threads(max(1, torch.get_num_threads() // world_size))

    def mem_get_info(self) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return vm.available, vm.total

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # NOTE: numpy's zeros come from calloc, i.e. fresh zero pages from the kernel:
        # blocks never written cost no resident memory, unlike torch.zeros, which
        # writes every byte. So a large KV pool is cheap until it is used.
        self._tune_malloc()
        # on 2 MiB pages: 512x fewer page faults when blocks are first written, and fewer TLB misses
        buffer = huge_pages.zeroed(int(np.prod(shape)) * torch.finfo(dtype).bits // 8)
        return torch.from_numpy(buffer).view(dtype).view(shape)

    def _tune_malloc(self) -> None:
        """Switch glibc malloc from load-time to step-time behaviour (once the weights are in).

        NOTE: glibc serves every allocation over 128 KiB with a fresh mmap and unmaps it
        on free, so each step's activations page-fault (and are zeroed) all over again:
        elementwise ops in a 2048-token prefill ran 4-5x slower (measured). We first
        return load-time garbage to the kernel, then keep blocks up to 32 MiB (glibc's
        cap) in the heap for reuse and never trim it. Off with KILN_CPU_MALLOC_TUNING=0.
        """
        if self.libc is None or self._malloc_tuned or os.environ.get("KILN_CPU_MALLOC_TUNING", "1") == "0":
            return
        self.libc.malloc_trim(0)
        self.libc.mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024)
        self.libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
        self._malloc_tuned = True

    def update_config(self, config) -> None:
        # NOTE: a GGUF model keeps its K/V in bf16 on this plugin's attention backend (exact
        # path: --quantization none), as llama.cpp keeps them in f16: its products are
        # approximate already (int8 activations), and decode attention, bound by reading the
        # cache, ran 23 % faster at 16 sequences. Perplexity on the held-out text, prefilled in
        # chunks that read the cache, over exact fp32: +0.45 % with bf16 K/V, +0.52 % with fp32
        # K/V (int8 activations in both).
        gguf = config.quantization == "gguf"
        if config.kv_cache_dtype == "auto" and gguf and config.attention_backend in (None, self.attention_backend()):
            config.kv_cache_dtype = "bfloat16"
        # NOTE: and its LoRA adapters in bf16 (products still in fp32): each step reads every
        # running adapter's weights, and four rank-16 adapters in fp32 are about as many bytes
        # as the 4-bit model. bench/lora.py (four adapters, concurrency 16): 0.87x the base
        # model's tok/s with bf16 adapters, 0.81x with fp32 ones.
        if config.enable_lora and config.lora_dtype == "auto" and gguf:
            config.lora_dtype = "bfloat16"
        super().update_config(config)

    def dtype_for(self, model_dtype: torch.dtype | None) -> torch.dtype:
        # NOTE: with AVX512-BF16 but no AMX (AMD Zen 4 and 5), vdpbf16ps multiplies twice as
        # many values a cycle as fp32 FMAs: a checkpoint stored in bf16 runs in bf16 (a random
        # 16-layer Llama of hidden 1024 on a 2-core Zen 5: 91 against 52 output tok/s at one
        # sequence, 380 against 143 at 16). Where it multiplies fewer (a Xeon whose AMX the VM
        # hides: half as many), fp32 on the bf16 tiles ran that Llama faster: 34-36 against
        # 29-33 tok/s at one sequence, 142-143 against 120-131 at 16 (2026-11-29).
        # With AMX (Xeon Sapphire Rapids and later) bf16 matmuls ran 8x faster than fp32 (2.7
        # against 0.34 TFLOPS at 2048x576x3072): every unquantized model runs in bf16 there.
        if has_amx_bf16() or (model_dtype is torch.bfloat16 and kernel_works() and bf16_dots_outrun_fma()):
            return torch.bfloat16
        return torch.float32

    def quantized_dtype_for(self, model_dtype: torch.dtype | None) -> torch.dtype:
        # NOTE: fp32 everywhere, AMX too. Quantized layers multiply fp32 activations in integers
        # (the tiles), and decode steps run in one C call per layer only in fp32: an AWQ Llama in
        # bf16 gave 151 output tok/s at one sequence against 185. With AMX, bf16 had been the
        # default, and a GGUF model then ran dequantized bf16 weights on oneDNN's AMX GEMMs: the
        # default model on a 2-core AMX Xeon (2026-11-30), served, fp32 against bf16: one
        # sequence 95-100 against 32-38 output tok/s (TPOT 8.5-8.9 against 26-30 ms), 16
        # sequences level (292-296 against 274-299), 64 sequences 432-553 against 518-588.
        return torch.float32

    def attention_backend(self) -> str:
        return "cpu"

    def process_layer_weights(self, layer: torch.nn.Module, config) -> None:
        # NOTE: a GGUF model arrives in fp32, four to eight times its blocks' size: repacked
        # whole after the load, all of it was resident at once (the default model: peak RSS
        # 1.0 GB at start against 0.47 GB once serving).
        self._repack(layer, config)
        if self.libc is not None:
            self.libc.malloc_trim(0)  # the heap's freed originals and temporaries back to the kernel

    def process_weights(self, model: torch.nn.Module, config) -> None:
        from kiln_cpu.experts import PackedExperts
        from kiln_cpu.fused_decode import use_fused_decode

        self._repack(model, config)
        form_cache.trim()  # once a load: the forms it kept may have taken the folder past its limit
        swapped, gguf = self._repacked
        self._repacked = [0, 0]
        # counted here: a quantized checkpoint's experts are packed by its linear method
        experts = sum(isinstance(getattr(m, "w13", None), PackedExperts) for m in model.modules())
        if swapped:
            int8 = config.quantization == "gguf"
            logger.info(
                "%d weights tiled for the CPU matmul kernel, %d of them in GGUF blocks%s",
                swapped, gguf, " (int8 activations)" if int8 and gguf else "",
            )  # fmt: skip
        if experts:
            logger.info("the experts of %d mixture-of-experts layers packed for the CPU matmul kernels", experts)
        gathered = huge_pages.gather_weights(model)  # before use_fused_decode, which keeps their pointers
        if gathered:
            logger.info("%d MB of tiled weights gathered onto 2 MiB pages", gathered >> 20)
        fused = use_fused_decode(model)
        if fused:
            together = getattr(model, "decode_stack", None) is not None
            logger.info(
                "%d decoder layers run decode steps in %s", fused, "one C call" if together else "a C call each"
            )

    def _repack(self, module: torch.nn.Module, config) -> None:
        """The weights of ``module`` (a layer, or the model: what is left) into the kernels' layouts;
        counts what changed into ``_repacked`` for ``process_weights``'s log."""
        from kiln_cpu.experts import use_packed_experts
        from kiln_cpu.packed_linear import bf16_linear, prepacking_works
        from kiln_cpu.tiled_weights import use_tiled_weights

        # fp32: tiled for the C matmul kernel; GGUF models' weights back in their 4/8-bit
        # blocks, multiplied in integers with int8 activations (llama.cpp's scheme) unless
        # --quantization none asks for the exact fp32 products. The fp32 originals are freed.
        int8 = config.quantization == "gguf"
        swapped, gguf = use_tiled_weights(module, int8_activations=int8)
        if "fused_experts" in self.custom_ops():  # packed experts need it (absent without the C kernels)
            use_packed_experts(module, _integer_activations(module, int8))
        # bf16: each in the layout its matmul prefers (where oneDNN has no bf16, AVX2: the C kernel or tiles).
        # NOTE: prepacking_works first, as at every start before: its oneDNN reorder left the
        # default model's fp32 decode steps faster after it (a C decoder layer at 16 rows: 1.15-1.19
        # against 1.29-1.37 ms, 2-core Xeon, 2026-11-30; a bf16 F.linear did not; why, not found).
        if prepacking_works() or fma_outruns_bf16_dots():
            replace_linears(module, {torch.bfloat16: bf16_linear})
        self._repacked[0] += swapped
        self._repacked[1] += gguf

    def linear_method(self, scheme):
        from kiln_cpu.quant_methods import linear_method

        return linear_method(scheme)

    def custom_ops(self) -> dict[str, Callable]:
        from kiln_cpu.fused_ops import fused_ops

        return fused_ops()
