"""The engine's side of guided decoding: backends by name, the bounded compile cache, fallback,
and matchers guarded so that one constraint cannot break the step it runs in."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from kiln.engine.guided_limits import GuidedLimits, allows_any, check_admits_output
from kiln.engine.guided_sandbox import CompileSandbox
from kiln.interfaces.guided import (
    CompiledGuide,
    GuidedBackend,
    GuidedDecodingParams,
    GuideMatcher,
    UnsupportedConstraint,
)
from kiln.interfaces.guided import apply_token_bitmask as torch_apply_token_bitmask
from kiln.registry import Registry, load_ref

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

logger = logging.getLogger("kiln.guided")

# Beside the byte budget: guides that cannot tell their size still cannot pile up without end.
MAX_CACHED_GUIDES = 1024


class GuidedManager:
    """The engine's side: backends by name, the compile cache, and fallback.

    ``default`` is the backend for requests that name none (``--guided-decoding-backend``,
    optionally ``name:no-fallback``); ``fallback`` is tried when the chosen backend
    raises ``UnsupportedConstraint``. ``limits`` (by default from the environment, see
    ``kiln.engine.guided_limits``) bound what a constraint may be and what compiling it may cost.
    """

    def __init__(
        self,
        registry: Registry,
        tokenizer,
        vocab_size: int,
        default: str = "xgrammar",
        fallback: str | None = None,
        limits: GuidedLimits | None = None,
    ):
        self.factories: dict[str, Any] = dict(registry.guided_backends)
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.default, self.default_fallback = _split_backend(default)
        self.fallback = fallback
        self.limits = limits or GuidedLimits.from_env()
        self.backends: dict[str, GuidedBackend] = {}
        self.cache = GuideCache(self.limits.cache_mb * 2**20)
        self.lock = threading.Lock()
        # Only backends a fresh interpreter can import by name can compile in a worker.
        importable = {name: ref for name, ref in self.factories.items() if isinstance(ref, str)}
        self.sandbox = (
            CompileSandbox(importable, tokenizer, vocab_size, self.limits.compile_timeout_s)
            if self.limits.compile_timeout_s > 0
            else None
        )

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
        if allow_fallback and not params.disable_fallback and fallback and fallback != name:
            candidates.append(fallback)
        key = self.limits.check(params)
        errors = []
        for backend_name in candidates:
            hit = self.cache.get((backend_name, *key))
            if hit is not None:
                return hit
            try:
                compiled = self._compile(backend_name, params)
            except UnsupportedConstraint as exc:
                errors.append(f"{backend_name}: {exc}")
                continue
            self.cache.put((backend_name, *key), compiled)
            return compiled
        raise ValueError(f"guided decoding: no backend can take this {params.kind} constraint: {'; '.join(errors)}")

    def _compile(self, name: str, params: GuidedDecodingParams) -> CompiledGuide:
        backend = self.backend(name)
        if self.sandbox is None or not isinstance(self.factories[name], str):
            compiled = backend.compile(params)
            check_admits_output(compiled, params, self.vocab_size)
            return compiled
        self.sandbox.check(name, params)  # it compiled, in time, to something that admits output
        return backend.compile(params)

    def matcher(self, guide: CompiledGuide, stop_token_ids: Sequence[int]) -> GuideMatcher:
        """A new sequence's matcher, guarded (see ``GuardedMatcher``)."""
        try:
            return GuardedMatcher(guide.matcher(), stop_token_ids, self.vocab_size)
        except Exception as exc:  # noqa: BLE001 - a backend failing on a client's constraint is a 400
            raise ValueError(f"guided decoding: the constraint failed to start: {type(exc).__name__}: {exc}") from None


class GuideCache:
    """Compiled guides by constraint, least recently used first out, within ``max_bytes`` (as the
    guides report their size) and ``MAX_CACHED_GUIDES``. A guide larger than the budget is not kept."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.entries: OrderedDict[tuple, tuple[CompiledGuide, int]] = OrderedDict()
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: tuple) -> CompiledGuide | None:
        with self.lock:
            entry = self.entries.get(key)
            if entry is None:
                return None
            self.entries.move_to_end(key)
            return entry[0]

    def put(self, key: tuple, guide: CompiledGuide) -> None:
        size = guide.memory_bytes()
        if size > self.max_bytes:
            return
        with self.lock:
            old = self.entries.pop(key, None)
            self.nbytes -= old[1] if old else 0
            while self.entries and (self.nbytes + size > self.max_bytes or len(self.entries) >= MAX_CACHED_GUIDES):
                self.nbytes -= self.entries.popitem(last=False)[1][1]
            self.entries[key] = (guide, size)
            self.nbytes += size


class GuardedMatcher(GuideMatcher):
    """Keeps one sequence's constraint from breaking the engine step it runs in.

    A backend that raises, or a constraint that reaches a state allowing no token (a rule that
    cannot end, reached after a valid prefix; a sampled token the matcher rejects), would leave the
    sampler with every logit at -inf and the step with an exception or garbage. Instead the matcher
    goes "dead": the scheduler then ends the sequence with the text it has (``finish_reason``
    "length", as for any constraint that cannot complete) and drops the token sampled meanwhile
    (its row allows only the stop tokens, so that the sampler has a finite row), and the other
    sequences in the batch never notice.
    """

    def __init__(self, inner: GuideMatcher, stop_token_ids: Sequence[int], vocab_size: int) -> None:
        self.inner, self.stop_token_ids, self.vocab_size = inner, list(stop_token_ids), vocab_size
        self.dead = False

    def _die(self, why: str) -> None:
        if not self.dead:
            logger.warning("guided decoding: %s; ending the sequence with the text it has", why)
        self.dead = True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if not self.dead:
            try:
                self.inner.fill_bitmask(bitmask, row)
                if allows_any(bitmask, row, self.vocab_size):
                    return
                self._die("the constraint allows no next token")
            except Exception as exc:  # noqa: BLE001 - contained to this sequence
                self._die(f"the constraint's matcher failed: {type(exc).__name__}: {exc}")
        bitmask[row] = 0
        for token in self.stop_token_ids:  # int32 words: bit 31 is the sign bit
            word, bit = divmod(token, 32)
            bitmask[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)

    def accept(self, token_id: int) -> bool:
        if self.dead:
            return True
        try:
            if self.inner.accept(token_id):
                return True
            self._die(f"the constraint rejects sampled token {token_id}")
        except Exception as exc:  # noqa: BLE001 - contained to this sequence
            self._die(f"the constraint's matcher failed: {type(exc).__name__}: {exc}")
        return False

    def is_terminated(self) -> bool:
        if self.dead:
            return not self.stop_token_ids  # without stop tokens to offer, end here
        try:
            return self.inner.is_terminated()
        except Exception as exc:  # noqa: BLE001 - contained to this sequence
            self._die(f"the constraint's matcher failed: {type(exc).__name__}: {exc}")
            return not self.stop_token_ids

    def rollback(self, num_tokens: int) -> None:
        if not self.dead:
            try:
                self.inner.rollback(num_tokens)
            except Exception as exc:  # noqa: BLE001 - contained to this sequence
                self._die(f"the constraint's matcher failed: {type(exc).__name__}: {exc}")

    def revive(self) -> None:
        """Undo ``dead`` set while checking a draft position (``kiln.worker.spec_verify``): the
        tokens before it stand, and the next step's decode finds the dead end again."""
        self.dead = False

    @property
    def supports_rollback(self) -> bool:
        return self.inner.supports_rollback


def _split_backend(value: str) -> tuple[str, bool]:
    name, _, option = value.partition(":")
    if option not in ("", "no-fallback"):
        raise ValueError(f"guided_decoding_backend: unknown option {option!r} (only 'no-fallback')")
    return name, option != "no-fallback"
