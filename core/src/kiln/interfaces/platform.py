"""The ``Platform`` interface: everything the core needs to know about a device.

A plugin registers a ``kiln.registry.PlatformSpec`` (cheap: a probe and a lazy
factory); the ``Platform`` object itself is built only when chosen. Core code
never branches on ``platform.name``: whatever differs between devices is a member
here. ``kiln.testing.contracts.PlatformContract`` checks an implementation.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from kiln.config import EngineConfig
    from kiln.interfaces.attention import DecodeGraphInputs
    from kiln.interfaces.quantization import LinearMethod, QuantScheme


class GraphRunner(ABC):
    """Runs pure-decode steps as graphs built once per padded batch size (CUDA graphs,
    torchair-compiled graphs...).

    ``forward(input_ids, positions, block_table, seq_lens, slot_mapping)`` is the bound
    ``forward`` of an ``nn.Module`` (the model plus its KV cache) and returns the hidden
    states; its arguments are the tensors of ``DecodeGraphInputs``, with the same shapes
    at every call for one size. The engine calls ``build`` for every size, largest first,
    before it serves, then ``run`` for each pure-decode step padded to a built size.
    """

    @abstractmethod
    def build(self, size: int, forward: Callable[..., torch.Tensor], inputs: DecodeGraphInputs) -> None:
        """Capture or compile ``forward`` for batches of exactly ``size`` rows; ``inputs`` is an example."""

    @abstractmethod
    def run(self, size: int, inputs: DecodeGraphInputs) -> torch.Tensor:
        """The hidden states ``(size, hidden)`` of ``forward`` on ``inputs`` through the built graph."""


class Platform(ABC):
    """A device the engine can run on.

    Members, in the order the engine uses them:
      1. ``update_config``: clamp or fill config values (block size, dtype...).
      2. ``device``/``dtype_for``: where tensors live and which dtype ``auto`` means.
      3. ``mem_get_info`` (and ``peak_memory_of`` a profiling step): sizes the paged KV
         cache together with ``--gpu-memory-utilization`` / ``--num-gpu-blocks-override``;
         ``allocate_kv_cache`` allocates it.
      4. ``attention_backend``: the registered backend name to use.
      5. ``custom_ops``: fused kernels overriding the core's torch reference ops.
      6. ``graph_runner``/``graph_sizes``: decode steps as captured graphs (None: eager only).
    """

    name: ClassVar[str]  # "cpu" | "cuda" | "npu"
    device_type: ClassVar[str]  # torch device type
    dist_backend: ClassVar[str]  # collective backend for tensor parallelism: gloo | nccl | hccl
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    supported_block_sizes: ClassVar[tuple[int, ...]] = (8, 16, 32, 64, 128)
    default_block_size: ClassVar[int] = 16
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)  # --kv-cache-dtype values
    # The KV cache's memory becomes resident only where first written (lazily committed host
    # memory): the block pool then reuses freed blocks before touching never-used ones.
    kv_memory_on_first_write: ClassVar[bool] = False

    @abstractmethod
    def device(self) -> torch.device:
        """The torch device to place weights and the KV cache on (initialises it)."""

    @abstractmethod
    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory, measured now."""

    def init_rank(self, rank: int, world_size: int) -> None:
        """Bind this process to its device as tensor-parallel rank ``rank`` of ``world_size``
        (one device per rank, in visible-device order); called before the collective group forms."""

    def peak_memory_of(self, fn: Callable[[], object]) -> int | None:
        """Run ``fn`` and return the most device memory it held at once beyond what was allocated
        before it, in bytes; None (without running ``fn``) where the platform cannot measure
        it. The engine runs a full-budget profiling step through it to size the KV cache,
        and estimates the activations where it gets None."""
        return None

    def synchronize(self) -> None:
        """Wait for queued device work (no-op where execution is synchronous)."""

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """One layer's KV cache, zero-filled: masked attention multiplies unused slots by 0,
        so they must never hold NaN/inf garbage."""
        return torch.zeros(shape, dtype=dtype, device=self.device())

    def dtype_for(self, model_dtype: torch.dtype | None) -> torch.dtype:
        """What ``--dtype auto`` resolves to for a model stored in ``model_dtype``."""
        if model_dtype in self.supported_dtypes and model_dtype is not torch.float32:
            return model_dtype
        return torch.float16 if torch.float16 in self.supported_dtypes else torch.float32

    def quantized_dtype_for(self, model_dtype: torch.dtype | None) -> torch.dtype:
        """What ``--dtype auto`` resolves to for a quantized model (a checkpoint's
        ``quantization_config``, ``--quantization``, a GGUF file) whose other tensors are stored in
        ``model_dtype``: the activations' dtype. By default ``dtype_for``'s."""
        return self.dtype_for(model_dtype)

    def update_config(self, config: EngineConfig) -> None:
        """Fill platform defaults and reject what the device cannot do (raise ``ValueError``).
        Called once per engine, before the model is read, with ``quantization`` resolved
        (``gguf`` for a GGUF file)."""
        if config.block_size is None:
            config.block_size = self.default_block_size
        if config.block_size not in self.supported_block_sizes:
            raise ValueError(
                f"--block-size: {config.block_size} is not supported on {self.name}; "
                f"choose one of {list(self.supported_block_sizes)}"
            )
        if config.kv_cache_dtype not in self.supported_kv_cache_dtypes:
            raise ValueError(
                f"--kv-cache-dtype: {config.kv_cache_dtype} is not supported on {self.name}; "
                f"choose one of {list(self.supported_kv_cache_dtypes)}"
            )

    def attention_backend(self) -> str:
        """Name of the registered attention backend this platform uses by default."""
        return "torch_ref"

    def custom_ops(self) -> dict[str, Callable]:
        """Fused ops by name (``rms_norm``, ``fused_add_rms_norm``, ``rotary_embedding``,
        ``silu_and_mul``, ``moe_route``, ``fused_experts``, the sampler's ``argmax``...) that
        replace the torch reference ops of ``kiln.interfaces.model`` (checked by
        ``kiln.testing.ops_contract.OpsContract``)."""
        return {}

    def process_weights(self, model: torch.nn.Module, config: EngineConfig) -> None:
        """Called once after the weights are loaded: repack them into the layout the device's
        matmul kernels prefer (replacing ``nn.Linear`` or ``nn.Embedding`` modules in place,
        e.g. with ones over a compressed copy of the weight). ``config.quantization`` is
        resolved: ``gguf`` for a model read from a GGUF file, whose weights arrive widened to
        floats and may be kept in the file's blocks. Default: nothing."""

    def process_layer_weights(self, layer: torch.nn.Module, config: EngineConfig) -> None:
        """Called on each decoder layer as soon as the checkpoint has filled its weights, before
        later layers load, where the model's loader can tell (Kiln's decoder families), after
        the quantization method has processed the layer's quantized linear layers and experts;
        ``process_weights`` still runs on the whole model after.
        A platform whose repacked weights are smaller than the loaded ones (the CPU's GGUF
        blocks: fp32 in, 4-8 bits kept) repacks here, so that peak memory at load stays near the
        final size instead of the whole model in floats. It must leave the layer in a state that
        ``process_weights`` accepts again. A subclass that overrides ``process_weights`` but not
        this method does not get it called (it belongs with its class's ``process_weights``).
        Default: nothing."""

    def linear_method(self, scheme: QuantScheme) -> LinearMethod | None:
        """How this device computes quantized linear layers of ``scheme`` (``w8a8``: int8
        weights per channel and int8 activations per token; ``w8a16``/``w4a16``: integer
        weights widened to the activations' dtype; ``fp8a16``: float8 weights, the same), or
        None if it cannot: serving such a checkpoint is then a start-up error, except fp8,
        whose weights are then widened at load. Default: ``ReferenceLinearMethod`` (plain
        torch), and None for fp8 (widening once beats widening per call)."""
        from kiln.interfaces.quantization import ReferenceLinearMethod

        return None if scheme.float_weights else ReferenceLinearMethod()

    def graph_runner(self, config: EngineConfig) -> GraphRunner | None:
        """A graph runner for decode steps, or None for eager execution (the default).
        Not called under ``--enforce-eager``."""
        return None

    def graph_sizes(self, config: EngineConfig) -> list[int]:
        """Decode batch sizes to build graphs for, ascending; larger batches run eagerly.
        ``--graph-sizes`` when given, else vLLM's 1, 2, 4, 8, 16, 24... up to the most decode rows
        a step holds (``max_decode_rows``: ``max_num_seqs`` with their drafts; at most 512); never
        above ``max_num_batched_tokens``."""
        limit = min(config.max_decode_rows, config.max_num_batched_tokens or config.max_decode_rows)
        if config.graph_sizes:
            return sorted({s for s in config.graph_sizes if s <= limit})
        top = min(limit, 512)
        return sorted({s for s in [1, 2, 4, *range(8, top + 1, 8), top] if s <= top})


def measure_peak_memory(device_module, fn: Callable[[], object]) -> int:
    """``Platform.peak_memory_of`` for torch device modules with the caching allocator's API
    (``memory_allocated``, ``max_memory_allocated``...), passed in by the platform."""
    device_module.synchronize()
    device_module.empty_cache()
    before = device_module.memory_allocated()
    device_module.reset_peak_memory_stats()
    fn()
    device_module.synchronize()
    peak = device_module.max_memory_allocated() - before
    device_module.empty_cache()  # hand the step's blocks back before free memory is measured
    return peak


def cache_dir() -> Path:
    """Kiln's cache folder (``$KILN_CACHE_DIR``, else ``~/.cache/kiln``): converted models
    live under ``models/``; a platform keeps what it builds or derives in a subfolder of
    its own."""
    return Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln")
