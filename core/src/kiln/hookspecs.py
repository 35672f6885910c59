"""Hook specifications: every way a plugin can extend Kiln.

All hooks are called once at start-up (never per step or per token). The
registration hooks receive a ``register`` callback; plugins pass it a spec whose
factory is a lazy ``"module:attr"`` qualname or a function that imports inside,
so an installed plugin costs nothing until it is chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from kiln.config import EngineConfig

hookspec = pluggy.HookspecMarker("kiln")
hookimpl = pluggy.HookimplMarker("kiln")

Register = Callable[..., None]


@hookspec
def register_platforms(register: Register) -> None:
    """Register device platforms: ``register(PlatformSpec(...))``."""


@hookspec
def register_attention_backends(register: Register) -> None:
    """Register attention backends: ``register(AttentionBackendSpec(...))``."""


@hookspec
def register_models(register: Register) -> None:
    """Register model architectures: ``register("LlamaForCausalLM", "pkg.mod:Class")``.

    The class is built as ``Class(hf_config, ops, backend, max_positions=..., tp=...)`` in the
    target dtype and device, then given ``load_weights(iter of (name, tensor))``; ``tp``
    (``kiln.distributed.TensorParallel``) says which shard this rank holds. See
    ``kiln.models.llama`` for the forward and ``compute_logits`` it must provide."""


@hookspec
def register_guided_backends(register: Register) -> None:
    """Register guided-decoding backends: ``register(name, factory)``."""


@hookspec
def register_tool_parsers(register: Register) -> None:
    """Register tool-call parsers: ``register(name, factory)``."""


@hookspec
def register_reasoning_parsers(register: Register) -> None:
    """Register reasoning parsers: ``register(name, factory)``."""


@hookspec
def register_chat_templates(register: Register) -> None:
    """Register named chat templates: ``register(name, jinja_source_or_loader)``."""


@hookspec
def register_commands(cli: Any) -> None:
    """Add sub-commands to the ``kiln`` CLI; ``cli`` is the argparse sub-parsers object."""


@hookspec
def update_engine_config(config: EngineConfig) -> None:
    """Adjust the engine configuration after it is validated, before the engine starts."""
