"""Graph mode on Ascend: decode steps through torchair-compiled graphs, one per gear.

* Gears (seed 001): ``--graph-sizes``, else ``PTA_TORCHAIR_DECODE_GEAR_LIST`` ("2,4,8,16"),
  else 2, 4, 8... below ``max_num_seqs``. 1 is never a gear (torchair's gear rule), sizes
  above ``max_num_seqs`` are dropped and ``max_num_seqs`` is always the largest gear, so
  the scheduler, which never schedules more than ``max_num_seqs`` requests in a step, never
  forms a decode batch above it. (Under speculative decoding each request's drafts are decode
  rows too: the bound is ``max_num_seqs * (1 + num_speculative_tokens)``, ``max_decode_rows``.)
  The core pads each decode step to the smallest gear that holds it.
* Each gear compiles its own copy of the decode forward (a distinct code object, so
  dynamo's per-function cache holds one static graph each) through
  ``torchair.inference.cache_compile``, whose graphs persist under
  ``$TORCHAIR_CACHE_HOME/.torchair_cache`` (default: the working directory). The folder
  name hashes the whole engine config, the model's files and the library versions, so a
  changed parameter never loads a stale graph.
* Prefill stays eager; ``--enforce-eager`` turns graph mode off. Under tensor parallelism
  the graphs hold the HCCL all-reduces (``torchair.patch_for_hcom``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import types
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from kiln import EngineConfig
from kiln.interfaces.attention import DecodeGraphInputs
from kiln.interfaces.platform import GraphRunner

logger = logging.getLogger("kiln.ascend")

GEAR_LIST_ENV = "PTA_TORCHAIR_DECODE_GEAR_LIST"


def decode_gears(config: EngineConfig) -> list[int]:
    """The gear list, ascending, up to the most decode rows one step holds (``max_num_seqs``, each
    with its drafts under speculative decoding, and no more than ``max_num_batched_tokens``);
    empty when that is 1 (a lone decode runs eagerly)."""
    top = min(config.max_decode_rows, config.max_num_batched_tokens or config.max_decode_rows)
    if config.graph_sizes:
        requested = list(config.graph_sizes)
    elif os.environ.get(GEAR_LIST_ENV, "").strip():
        raw = os.environ[GEAR_LIST_ENV]
        try:
            requested = [int(g) for g in raw.replace(" ", "").split(",") if g]
        except ValueError:
            raise ValueError(f"{GEAR_LIST_ENV}={raw!r}: expected comma-separated batch sizes, e.g. 2,4,8,16") from None
    else:
        requested = [2**i for i in range(1, top.bit_length())]
    if 1 in requested:
        logger.warning("decode gear 1 dropped: 1 is never a gear (a lone decode pads to the smallest gear)")
    if top == 1:
        return []
    return sorted({g for g in requested if 1 < g < top} | {top})


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "none"


def _model_fingerprint(model: str) -> list:
    """What identifies a model's weights: its path (the target's is resolved by the engine
    before the platform builds graphs) and its files' sizes and times."""
    path = Path(model)
    if not path.exists():  # a draft's Hub id: its name is all there is here
        return [model]
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return [str(path.resolve())] + [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def graph_cache_dir(config: EngineConfig, gear: int) -> Path:
    """``.torchair_cache/<key>/gear_<n>``."""
    return graph_cache_root(config) / f"gear_{gear}"


def graph_cache_root(config: EngineConfig) -> Path:
    """``.torchair_cache/<key>``: the key changes with any engine parameter, the weights (a
    speculative draft's too: an EAGLE-3 head's config picks the layers the graphs return), the
    precision switches or a library version."""
    import torch_npu

    from kiln_ascend.precision import PrecisionModes

    identity = {
        "config": config.model_dump(mode="json"),
        "model": _model_fingerprint(config.model),
        "draft": _model_fingerprint(spec.model) if (spec := config.speculative_config) and spec.model else None,
        "precision": PrecisionModes.from_env().__dict__,
        "versions": [torch.__version__, torch_npu.__version__, _package_version("kiln-plugin-ascend")],
    }
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return Path(os.environ.get("TORCHAIR_CACHE_HOME", os.getcwd())) / ".torchair_cache" / key


def _forward_copy(forward: Callable, gear: int) -> Callable:
    """``forward`` (a bound ``nn.Module`` method) under a code object of its own, named after the gear."""
    func = forward.__func__
    code = func.__code__.replace(co_name=f"decode_forward_gear_{gear}")
    copy = types.FunctionType(code, func.__globals__, code.co_name, func.__defaults__, func.__closure__)
    return types.MethodType(copy, forward.__self__)


class TorchairGraphRunner(GraphRunner):
    """Compiles the decode forward once per gear with torchair; the graphs are static in shape."""

    def __init__(self, config: EngineConfig) -> None:
        import torchair

        self.torchair = torchair
        self.config = config
        if config.tensor_parallel_size > 1:
            torchair.patch_for_hcom()  # lets HCCL all-reduces sit inside compiled graphs
        self.compiler_config = torchair.CompilerConfig()
        # Weights keep their device addresses for the life of the engine.
        self.compiler_config.experimental_config.frozen_parameter = True
        self.graphs: dict[int, Callable] = {}
        self.cache_root = graph_cache_root(config)  # hashes the model's files: once, not per gear

    def build(self, size: int, forward: Callable[..., torch.Tensor], inputs: DecodeGraphInputs) -> None:
        cache_dir = self.cache_root / f"gear_{size}"
        cache_dir.mkdir(parents=True, exist_ok=True)
        compiled = self.torchair.inference.cache_compile(
            _forward_copy(forward, size), config=self.compiler_config, dynamic=False, cache_dir=str(cache_dir)
        )
        compiled(*inputs.tensors())  # compile (or load) now: the first request must not wait for it
        self.graphs[size] = compiled

    def run(self, size: int, inputs: DecodeGraphInputs) -> torch.Tensor:
        return self.graphs[size](*inputs.tensors())
