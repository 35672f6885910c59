"""The engine's side of guided decoding: backends by name, the compile cache, and fallback."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from kiln.interfaces.guided import CompiledGuide, GuidedBackend, GuidedDecodingParams, UnsupportedConstraint
from kiln.interfaces.guided import apply_token_bitmask as torch_apply_token_bitmask
from kiln.registry import Registry, load_ref

if TYPE_CHECKING:
    import torch


class GuidedManager:
    """The engine's side: backends by name, the compile cache, and fallback.

    ``default`` is the backend for requests that name none (``--guided-decoding-backend``,
    optionally ``name:no-fallback``); ``fallback`` is tried when the chosen backend
    raises ``UnsupportedConstraint``.
    """

    def __init__(
        self, registry: Registry, tokenizer, vocab_size: int, default: str = "xgrammar", fallback: str | None = None
    ):
        self.factories: dict[str, Any] = dict(registry.guided_backends)
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.default, self.default_fallback = _split_backend(default)
        self.fallback = fallback
        self.backends: dict[str, GuidedBackend] = {}
        self.cache: dict[tuple, CompiledGuide] = {}
        self.lock = threading.Lock()

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Through the loaded backend's kernel (every constrained request went through one)."""
        backend = next(iter(self.backends.values()), None)
        (backend.apply_bitmask if backend else torch_apply_token_bitmask)(logits, bitmask, rows)

    def backend(self, name: str) -> GuidedBackend:
        with self.lock:
            if name not in self.backends:
                if name not in self.factories:
                    known = ", ".join(sorted(self.factories)) or "none (pip install kiln-plugin-guided)"
                    raise ValueError(f"guided_decoding_backend: {name!r} is not installed; installed: {known}")
                cls = load_ref(self.factories[name])
                self.backends[name] = cls(self.tokenizer, self.vocab_size)
            return self.backends[name]

    def compile(self, params: GuidedDecodingParams) -> CompiledGuide:
        """Compile (or fetch from the cache); ``ValueError`` says what is wrong with the constraint."""
        if not self.factories:
            raise ValueError(
                f"guided decoding ({params.kind}) needs a guided-decoding backend and none is installed "
                "(pip install kiln-plugin-guided)"
            )
        name, allow_fallback = (
            _split_backend(params.backend) if params.backend else (self.default, self.default_fallback)
        )
        candidates = [name]
        fallback = self.fallback or next((n for n in sorted(self.factories) if n != name), None)
        if allow_fallback and fallback and fallback != name:
            candidates.append(fallback)
        errors = []
        for backend_name in candidates:
            key = (backend_name, *params.cache_key())
            with self.lock:
                hit = self.cache.get(key)
            if hit is not None:
                return hit
            try:
                compiled = self.backend(backend_name).compile(params)
            except UnsupportedConstraint as exc:
                errors.append(f"{backend_name}: {exc}")
                continue
            with self.lock:
                self.cache[key] = compiled
            return compiled
        raise ValueError(f"guided decoding: no backend can take this {params.kind} constraint: {'; '.join(errors)}")


def _split_backend(value: str) -> tuple[str, bool]:
    name, _, option = value.partition(":")
    if option not in ("", "no-fallback"):
        raise ValueError(f"guided_decoding_backend: unknown option {option!r} (only 'no-fallback')")
    return name, option != "no-fallback"
