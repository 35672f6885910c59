"""Building one rank's model: attention backend, weights (its tensor-parallel shard) and
``ModelRunner``. The engine builds rank 0 in its own process; ``worker_main`` is the entry
point of ranks 1..N-1 (see ``kiln.worker.tp_workers``)."""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection

import torch

from kiln.config import EngineConfig
from kiln.distributed import TensorParallel
from kiln.interfaces.attention import AttentionBackend
from kiln.interfaces.model import resolve_ops
from kiln.interfaces.platform import Platform
from kiln.interfaces.quantization import LinearMethod, QuantLinear
from kiln.lora.slots import build_lora_slots
from kiln.models.loader import iter_weights, load_hf_config
from kiln.quantization import config as quant_config
from kiln.quantization.checkpoint import canonical_weights, widen_quantized
from kiln.quantization.config import QuantConfig, QuantScheme
from kiln.quantization.fp8 import fp8_weights, widen_fp8
from kiln.registry import Registry, load_ref
from kiln.worker.model_runner import ModelRunner

logger = logging.getLogger("kiln.worker")

KV_CACHE_DTYPES = {
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
DTYPES = {
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}


def resolve_dtype(config: EngineConfig, platform: Platform, hf_config) -> torch.dtype:
    """``--dtype``, with ``auto`` resolved by the platform from the checkpoint's dtype (and
    whether the model is quantized)."""
    stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    quantized = config.quantization not in (None, "none") or getattr(hf_config, "quantization_config", None)
    auto = platform.quantized_dtype_for if quantized else platform.dtype_for
    dtype = auto(stored) if config.dtype == "auto" else DTYPES[config.dtype]
    if dtype not in platform.supported_dtypes:
        raise ValueError(f"--dtype: {dtype} is not supported on {platform.name}")
    return dtype


def build_backend(
    config: EngineConfig, registry: Registry, platform: Platform, hf_config, dtype: torch.dtype, tp: TensorParallel
) -> AttentionBackend:
    """The chosen (or the platform's) attention backend for this rank's heads, else ``torch_ref``."""
    from kiln.models.deepseek import latent_dims
    from kiln.models.llama import head_dim_of

    if getattr(hf_config, "kv_lora_rank", None):  # multi-head latent attention: one latent K/V head
        heads, kv_heads, head_dim = latent_dims(hf_config, tp)
    else:
        head_dim = head_dim_of(hf_config)
        heads = tp.shard(hf_config.num_attention_heads, "attention heads")
        # Encoder configs (BERT) have no num_key_value_heads: every head has its own K/V.
        kv_heads = tp.shard(getattr(hf_config, "num_key_value_heads", hf_config.num_attention_heads), "key/value heads")
    cache_dtype = KV_CACHE_DTYPES.get(config.kv_cache_dtype, dtype)
    backends = registry.attention_backends
    chosen = config.attention_backend
    if chosen is not None:
        if chosen not in backends:
            raise ValueError(f"--attention-backend: {chosen!r} is not registered; registered: {sorted(backends)}")
        if not backends[chosen].runs_on(platform.name):
            raise ValueError(
                f"--attention-backend: {chosen!r} runs on {', '.join(backends[chosen].platforms)}, "
                f"not on {platform.name}"
            )
    for name in (chosen or platform.attention_backend(), "torch_ref"):
        spec = backends.get(name)
        if spec is None or not spec.runs_on(platform.name):
            if name != "torch_ref":
                logger.warning(
                    "attention backend %s is not registered for platform %s; falling back", name, platform.name
                )
            continue
        cls = load_ref(spec.factory)
        if cache_dtype != dtype and cache_dtype not in cls.cache_dtypes:
            logger.warning("attention backend %s cannot store a %s KV cache; falling back", name, cache_dtype)
        elif cls.supports(head_dim=head_dim, dtype=dtype, block_size=config.block_size):
            return cls(heads, kv_heads, head_dim, dtype, cache_dtype)
        else:
            logger.warning("attention backend %s does not support this model; falling back", name)
    raise ValueError(
        f"no registered attention backend supports this model with --dtype {dtype} "
        f"and --kv-cache-dtype {config.kv_cache_dtype}"
    )


def in_turn(workers: int | None, tp: TensorParallel, load: Callable[[], None]) -> None:
    """Run ``load`` on this rank in its turn: ranks go in waves of ``workers``
    (``--max-parallel-loading-workers``), each wave after the one before has finished."""
    if not workers or tp.size <= workers:
        load()
        return
    for wave in range(-(-tp.size // workers)):
        if wave == tp.rank // workers:
            load()
        torch.distributed.barrier()


def build_model(
    config: EngineConfig,
    registry: Registry,
    platform: Platform,
    hf_config,
    dtype: torch.dtype,
    model_path: str,
    backend: AttentionBackend,
    tp: TensorParallel,
) -> torch.nn.Module:
    archs = list(getattr(hf_config, "architectures", None) or [])
    models = registry.models
    arch = next((a for a in archs if a in models), None)
    if config.model_impl == "transformers":
        from kiln.models.transformers_backend import TransformersForCausalLM as cls
    elif arch is None:
        raise ValueError(
            f"model: architecture {archs or hf_config.model_type!r} is not supported; "
            f"supported: {', '.join(sorted(models))}. --model-impl transformers serves any decoder that "
            "transformers runs (slower)"
        )
    else:
        cls = load_ref(models[arch])
    quant, method = resolve_quantization(config, platform, hf_config, tp, cls)
    ops = resolve_ops(platform.custom_ops())
    torch.manual_seed(config.seed)  # dummy weights: the same on every rank and every run
    # Build straight in the target dtype: no full-size fp32 copy on the way.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        random = config.load_format == "dummy"
        with torch.device(platform.device()), contextlib.nullcontext() if random else _no_random_init():
            extra = {"quant_config": quant} if method is not None else {}
            model = cls(hf_config, ops, backend, max_positions=config.max_model_len, tp=tp, **extra)
    finally:
        torch.set_default_dtype(default_dtype)
    if config.load_format != "dummy":
        fmt = "auto" if config.load_format == "gguf" else config.load_format  # a GGUF file was converted
        weights = iter_weights(model_path, fmt, progress=tp.rank == 0)
        fp8 = quant_config.fp8_layout(getattr(hf_config, "quantization_config", None))
        if fp8 is not None and quant is None:
            weights = widen_fp8(weights, fp8)
        elif fp8 is not None:
            weights = fp8_weights(weights, fp8)
        elif quant is not None:
            weights = canonical_weights(weights, quant) if method is not None else widen_quantized(weights, quant)
        # Layer by layer as they fill, where the model's loader offers it: the layer's quantized
        # linear layers processed first, so that the platform finds them as they will serve.
        per_layer = {}
        if _repacks_by_layer(platform) and "layer_loaded" in inspect.signature(model.load_weights).parameters:

            def layer_loaded(layer: torch.nn.Module) -> None:
                _process_quantized(layer, method)
                platform.process_layer_weights(layer, config)

            per_layer["layer_loaded"] = layer_loaded
        in_turn(config.max_parallel_loading_workers, tp, lambda: model.load_weights(weights, **per_layer))
    model.eval()
    if config.enable_expert_parallel and not any(hasattr(m, "load_expert") for m in model.modules()):
        logger.warning("--enable-expert-parallel changes nothing: the model has no experts")
    if method is not None:
        _process_quantized(model, method)
        layers = sum(isinstance(m, QuantLinear) for m in model.modules())
        logger.info("%d linear layers quantized (%s) via %s", layers, quant.label, type(method).__name__)
    _process_weights(platform, model, config)
    return model


def _process_quantized(module: torch.nn.Module, method: LinearMethod | None) -> None:
    """Hand ``module``'s quantized linear layers not yet processed, and its mixtures' quantized
    experts, to ``method``."""
    if method is None:
        return
    for layer in module.modules():
        if isinstance(layer, QuantLinear) and layer.method is not method:
            layer.method = method
            method.process(layer)
        elif hasattr(layer, "take_quantized"):
            layer.take_quantized(method)


def _repacks_by_layer(platform: Platform) -> bool:
    """Whether ``process_layer_weights`` belongs with the platform's ``process_weights``: a subclass
    that replaces ``process_weights`` (a test platform that keeps weights as loaded, say) but
    inherits its parent's per-layer hook would else get the parent's repacking after all."""
    mro = type(platform).__mro__
    owner = {name: next(c for c in mro if name in vars(c)) for name in ("process_layer_weights", "process_weights")}
    return issubclass(owner["process_layer_weights"], owner["process_weights"])


# torch.nn.init's random fills, which nn.Linear and nn.Embedding run as they are built.
RANDOM_INITS = (
    "uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
    "xavier_uniform_", "xavier_normal_", "orthogonal_",
)  # fmt: skip


@contextlib.contextmanager
def _no_random_init() -> Iterator[None]:
    """Build without the random fills of ``RANDOM_INITS``: writing every weight made the whole
    model resident in its dtype before the checkpoint overwrote it (so a platform repacking
    layers as they load, ``process_layer_weights``, still peaked at the full size: 1.0 GB for
    the default model). A checkpoint fills every weight it does not mark optional."""
    saved = {name: getattr(torch.nn.init, name) for name in RANDOM_INITS}
    for name in RANDOM_INITS:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fill in saved.items():
            setattr(torch.nn.init, name, fill)


def _process_weights(platform: Platform, model: torch.nn.Module, config: EngineConfig) -> None:
    """``Platform.process_weights``; a plugin written before it took the config gets the model only."""
    if len(inspect.signature(platform.process_weights).parameters) == 1:
        logger.warning("%s.process_weights(model) is deprecated: take (model, config)", type(platform).__name__)
        platform.process_weights(model)
    else:
        platform.process_weights(model, config)


def resolve_quantization(
    config: EngineConfig, platform: Platform, hf_config, tp: TensorParallel, model_cls: type
) -> tuple[QuantConfig | None, LinearMethod | None]:
    """The model's ``QuantConfig`` and the platform's method for it (None, None: unquantized; a
    config and no method: a model without quantized layers, whose checkpoint is widened at load);
    a method the device cannot run, or a split it cannot take, is refused here, before any weight is
    read. fp8 weights without a kernel on the platform, in a model without quantized layers, or in
    blocks that do not tile its layers on a rank, are widened at load instead."""
    quant = quant_config.resolve(config.quantization, getattr(hf_config, "quantization_config", None))
    if quant is None:
        return None, None
    online = quant.method == "online"  # --quantization weight_only_int8 on an unquantized checkpoint
    if not getattr(model_cls, "supports_quantization", False) and not quant.scheme.float_weights:
        if online:
            raise ValueError(f"--quantization {config.quantization}: {model_cls.__name__} has no quantized layers")
        logger.info("%s has no quantized layers: the %s checkpoint's weights are widened at load", model_cls.__name__,
                    quant.label)  # fmt: skip
        return quant, None
    if online and getattr(model_cls, "widens_quantized_experts", False):
        logger.warning("--quantization %s: the routed experts stay in the model's dtype (no quantized experts kernel)",
                       config.quantization)  # fmt: skip
    method = platform.linear_method(quant.scheme)
    if quant.scheme.float_weights:
        why = _fp8_widened(quant.scheme, method, model_cls, hf_config, tp)
        if why:
            logger.info("fp8 checkpoint: weights widened at load (%s)", why)
            return None, None
    if method is None:
        raise ValueError(f"quantization: {quant.label} cannot run on {platform.name}")
    if quant.desc_act and tp.size > 1:
        raise ValueError("--tensor-parallel-size: GPTQ act-order (desc_act) checkpoints are served on one rank")
    return quant, method


def _fp8_widened(scheme: QuantScheme, method: LinearMethod | None, model_cls: type, hf_config, tp) -> str | None:
    """Why an fp8 checkpoint's weights are widened at load rather than kept, or None."""
    if method is None or not method.takes_float_weights:
        return "the platform has no fp8 kernel"
    if not getattr(model_cls, "supports_quantization", False):
        return f"{model_cls.__name__} has no quantized layers"
    hidden, heads = getattr(hf_config, "hidden_size", 0), getattr(hf_config, "num_attention_heads", 1)
    head = getattr(hf_config, "v_head_dim", None) or getattr(hf_config, "head_dim", None) or hidden // heads
    # Inputs on a rank of q/k/v (and the experts' gate/up), of DeepSeek's q_b/kv_b projections,
    # of o, and of the dense, shared and routed MLPs' down projections (a rank holds whole
    # experts under expert parallelism). A mixture's experts stay fp8 where the platform takes
    # them (``process_experts``), else its FusedMoE widens them as they load.
    latent = [getattr(hf_config, k, None) or 0 for k in ("q_lora_rank", "kv_lora_rank")]
    dense = [getattr(hf_config, k, None) or 0 for k in ("intermediate_size", "shared_expert_intermediate_size")]
    experts = getattr(hf_config, "moe_intermediate_size", None) or 0
    experts //= 1 if getattr(tp, "expert_parallel", False) else tp.size
    inputs = [hidden, *latent, heads * head // tp.size, *(n // tp.size for n in dense), experts]
    if scheme.group_size and any(n % scheme.group_size for n in inputs if n):
        return f"blocks of {scheme.group_size} inputs do not tile layers of {inputs} inputs on a rank"
    return None


def build_runner(
    config: EngineConfig,
    registry: Registry,
    platform: Platform,
    hf_config,
    dtype: torch.dtype,
    model_path: str,
    tp: TensorParallel,
) -> ModelRunner:
    backend = build_backend(config, registry, platform, hf_config, dtype, tp)
    model = build_model(config, registry, platform, hf_config, dtype, model_path, backend, tp)
    lora = build_lora_slots(model, config, hf_config, tp, dtype) if config.enable_lora else None
    return ModelRunner(config, platform, model, backend, lora)


def worker_main(
    config_json: str, dtype_name: str, model_path: str, rank: int, world_size: int, init_method: str, conn: Connection
) -> None:
    """Tensor-parallel rank ``rank`` (>= 1): build this rank's shard and KV cache, then run every
    ``StepBatch`` rank 0 sends until it sends None or goes away. ``config`` is rank 0's,
    fully resolved, with ``device`` naming the platform it chose."""
    from kiln.platforms.select import select_platform
    from kiln.plugins import get_plugin_manager

    try:
        config = EngineConfig.model_validate_json(config_json)
        registry = get_plugin_manager().registry
        platform = select_platform(config.device, registry)
        platform.init_rank(rank, world_size)
        conn.send(("joining", None))
        torch.distributed.init_process_group(
            platform.dist_backend, init_method=init_method, rank=rank, world_size=world_size
        )
        hf_config = load_hf_config(model_path, config)
        tp = TensorParallel(rank, world_size, config.enable_expert_parallel)
        runner = build_runner(config, registry, platform, hf_config, getattr(torch, dtype_name), model_path, tp)
        runner.profile_peak()  # in step with rank 0's profiling run
        conn.send(("built", None))
        num_blocks = conn.recv()
        if num_blocks is None:  # rank 0 failed to start
            return
        runner.allocate_kv_cache(num_blocks)
        runner.build_graphs()
        conn.send(("ready", None))
    except Exception as exc:  # reported to rank 0, which fails its start with it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    with torch.inference_mode():
        while True:
            try:
                batch = conn.recv()
            except EOFError:  # rank 0 is gone
                break
            if batch is None:
                break
            runner.run_batch(batch)
    torch.distributed.destroy_process_group()
