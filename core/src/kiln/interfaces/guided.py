"""Guided (structured) decoding: the constraint a request carries and the backend interface.

A ``GuidedBackend`` (registered by a plugin under a name, e.g. ``xgrammar``)
compiles a request's constraint once into a ``CompiledGuide``; each sequence
gets its own ``GuideMatcher`` from it. Every step the engine asks each
constrained sequence's matcher to fill one row of a token bitmask (int32,
``ceil(vocab / 32)`` words per row, bit 1 = allowed, xgrammar's layout), applies
the mask to the logits before temperature / top-k / top-p, and feeds the sampled
token back with ``accept``. A matcher that reports ``is_terminated`` ends its
sequence with finish_reason ``"stop"``. The engine side (compile cache, fallback,
limits, matchers that cannot break a step) is ``kiln.engine.guided_manager``.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tensors only reach these functions at run time: importing this costs no torch
    import torch

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True, slots=True)
class GuidedDecodingParams:
    """One constraint (exactly one of the first six fields), as vLLM's ``GuidedDecodingParams``.

    ``json`` is a JSON schema (a dict or its text); ``grammar`` is EBNF as xgrammar
    reads it; ``structural_tag`` is xgrammar's structural-tag JSON (tool calling uses
    it); ``backend`` names a registered ``GuidedBackend`` (with ``:no-fallback`` to
    refuse falling back; ``disable_fallback`` refuses it whichever backend is used);
    ``whitespace_pattern`` is a regex for the whitespace allowed between JSON tokens;
    ``disable_any_whitespace`` asks for JSON without free whitespace between tokens.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    backend: str | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"guided decoding: give exactly one of {', '.join(KINDS)} (got {given or 'none'})")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("guided_choice: must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except json.JSONDecodeError as exc:
                raise ValueError(f"guided_json: not valid JSON: {exc}") from None
            except RecursionError:
                raise ValueError("guided_json: nested too deeply to read") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("guided_json: a JSON schema must be an object")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple:
        """Hashable identity of the constraint (the backend choice aside)."""
        spec = getattr(self, self.kind)
        if isinstance(spec, dict):
            spec = json.dumps(spec, sort_keys=True)
        return self.kind, spec, self.whitespace_pattern, self.disable_any_whitespace


class GuideMatcher(ABC):
    """The constraint's state for one sequence."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 words, bit 1 = allowed)."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the constraint does not allow it."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the constraint is complete (the sequence should stop)."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding); optional."""
        raise NotImplementedError

    @property
    def supports_rollback(self) -> bool:
        """Whether ``rollback`` is implemented: sequences whose matcher lacks it get no drafts."""
        return type(self).rollback is not GuideMatcher.rollback


class CompiledGuide(ABC):
    """A compiled constraint, shared by every sequence that uses it (and cached)."""

    @abstractmethod
    def matcher(self) -> GuideMatcher:
        """A fresh matcher at the start of the constraint."""

    def memory_bytes(self) -> int:
        """About how much memory the compiled form holds, for the compile cache's budget; 0 if unknown."""
        return 0


class GuidedBackend(ABC):
    """A guided-decoding backend, registered through ``register_guided_backends``.

    Built once per engine with the tokenizer and the model's logits width (which
    may exceed ``len(tokenizer)``). ``compile`` must raise ``ValueError`` with the
    compiler's message for an invalid constraint (the server returns it as a 400)
    and ``UnsupportedConstraint`` for a valid one it cannot handle (the engine then
    tries the fallback backend). It may be called from several threads. Each new
    constraint is first compiled in a worker process that is killed past a time limit
    (``kiln.engine.guided_sandbox``), there from a backend built by the same reference.
    """

    name: str = ""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    @abstractmethod
    def compile(self, params: GuidedDecodingParams) -> CompiledGuide:
        """Compile ``params`` (JSON schema, regex, choice, EBNF grammar, json_object, structural tag)."""

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Set disallowed logits of ``rows`` to -inf in place; backends may use a faster kernel.

        ``logits`` (float32) and ``bitmask`` (int32, one bit per token, rows in batch
        order; filled on the host) sit on the engine's device."""
        apply_token_bitmask(logits, bitmask, rows)


class UnsupportedConstraint(ValueError):
    """A valid constraint this backend cannot compile (another backend may)."""


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask: ``rows`` rows of ``ceil(vocab_size / 32)`` int32 words."""
    import torch

    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Torch fallback: for each ``i`` in ``rows``, unpack ``bitmask[i]`` and mask ``logits[i]``."""
    import torch

    vocab = logits.shape[-1]
    index = torch.tensor(rows, device=logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[index, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
