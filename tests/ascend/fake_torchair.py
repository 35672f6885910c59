"""A CPU emulation of the torchair APIs kiln_ascend calls (``CompilerConfig``,
``get_npu_backend``, ``inference.cache_compile``). The compiler front end is the real one,
dynamo with ``fullgraph=True``, so a decode forward that would not trace as one graph fails
here as on the NPU; the emulated GE back end runs the captured FX graph as it is. A compiled
graph is "saved" as a file per function under ``cache_dir``, and ``events`` records whether
each compile produced the cache or found it."""

from __future__ import annotations

import types
from pathlib import Path

import torch

graphs: list[torch.fx.GraphModule] = []  # every graph handed to the back end
events: list[tuple[str, str]] = []  # ("compiled" | "loaded", cache_dir)


def patch_for_hcom() -> None:
    """Real torchair makes HCCL collectives traceable; gloo's already are to dynamo here."""


class _ExperimentalConfig:
    def __init__(self) -> None:
        self.frozen_parameter = False
        self.tiling_schedule_optimize = False
        self.enable_view_optimize = True


class CompilerConfig:
    def __init__(self) -> None:
        self.mode = "max-autotune"
        self.experimental_config = _ExperimentalConfig()


def get_npu_backend(*, compiler_config: CompilerConfig | None = None):
    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


def _cache_compile(
    func, *, config=None, dynamic=True, cache_dir=None, global_rank=None, tp_rank=None, pp_rank=None, **kwargs
):
    """As torchair's: ``func`` must be a method of an ``nn.Module``; returns the compiled callable."""
    if not isinstance(getattr(func, "__self__", None), torch.nn.Module):
        raise ValueError("cache_compile only supports methods of torch.nn.Module")
    compiled = torch.compile(func, backend=get_npu_backend(compiler_config=config), dynamic=dynamic, fullgraph=True)
    saved = Path(cache_dir) / f"{func.__name__}.graph"
    first = True

    def run(*args):
        nonlocal first
        if first:
            events.append(("loaded" if saved.exists() else "compiled", str(cache_dir)))
            saved.write_text(func.__name__)
            first = False
        return compiled(*args)

    return run


inference = types.SimpleNamespace(cache_compile=_cache_compile)
