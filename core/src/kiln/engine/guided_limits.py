"""Bounds on guided-decoding constraints: what a client may send, and what a compile may cost.

Environment (read when an engine starts):

- ``KILN_GUIDED_COMPILE_TIMEOUT_S`` (10): a new constraint compiles first in a worker process that
  is killed past this many seconds (the request gets a 400); 0 compiles in-process, unbounded.
- ``KILN_GUIDED_MAX_BYTES`` (262144): the largest constraint (schema as JSON, regex, grammar,
  choices) in UTF-8 bytes. Compile time and the compiled mask grow with it (measured with
  xgrammar: about 8 us and 160 bytes of mask per byte of a large enum or alternation).
- ``KILN_GUIDED_MAX_DEPTH`` (64): the deepest nesting of objects and arrays in a JSON schema
  (xgrammar's schema conversion grows superlinearly with depth: 200 levels take seconds).
- ``KILN_GUIDED_CACHE_MB`` (512, as vLLM's ``VLLM_XGRAMMAR_CACHE_MB``): the compile cache's budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.envs import env_number
from kiln.interfaces.guided import allocate_bitmask

if TYPE_CHECKING:
    import torch

    from kiln.interfaces.guided import CompiledGuide, GuidedDecodingParams


@dataclass(frozen=True)
class GuidedLimits:
    compile_timeout_s: float = 10.0
    max_bytes: int = 256 * 1024
    max_depth: int = 64
    cache_mb: int = 512

    @classmethod
    def from_env(cls) -> GuidedLimits:
        return cls(
            env_number("KILN_GUIDED_COMPILE_TIMEOUT_S", cls.compile_timeout_s, float),
            env_number("KILN_GUIDED_MAX_BYTES", cls.max_bytes, int),
            env_number("KILN_GUIDED_MAX_DEPTH", cls.max_depth, int),
            env_number("KILN_GUIDED_CACHE_MB", cls.cache_mb, int),
        )

    def check(self, params: GuidedDecodingParams) -> tuple:
        """``ValueError`` for a constraint nested or sized past the limits, else its ``cache_key()``.
        Runs before anything recursive (``json.dumps``, pickling, the compilers) touches the schema."""
        field = field_name(params)
        if isinstance(params.json, dict):
            depth = json_depth(params.json, self.max_depth)
            if depth > self.max_depth:
                raise ValueError(
                    f"{field}: the schema nests objects and arrays more than {self.max_depth} deep "
                    "(KILN_GUIDED_MAX_DEPTH)"
                )
        key = params.cache_key()
        spec = key[1]
        size = sum(len(s.encode()) + 1 for s in spec) if isinstance(spec, tuple) else len(str(spec).encode())
        if size > self.max_bytes:
            raise ValueError(f"{field}: {size} bytes, more than the limit of {self.max_bytes} (KILN_GUIDED_MAX_BYTES)")
        return key


def field_name(params: GuidedDecodingParams) -> str:
    """The request field errors about ``params`` name (``guided_json``, ...)."""
    return "guided_decoding" if params.kind == "structural_tag" else f"guided_{params.kind}"


def json_depth(value, limit: int) -> int:
    """How deep objects and arrays nest in ``value``, counted level by level (no recursion, so any
    depth is safe) and given up just past ``limit``."""
    depth, level = 0, [value]
    while depth <= limit:
        level = [v for v in level if isinstance(v, (dict, list))]
        if not level:
            break
        depth += 1
        level = [child for v in level for child in (v.values() if isinstance(v, dict) else v)]
    return depth


def allows_any(bitmask: torch.Tensor, row: int, vocab_size: int) -> bool:
    """Whether row ``row`` of a token bitmask allows any of the first ``vocab_size`` tokens."""
    full, rest = divmod(vocab_size, 32)
    words = bitmask[row]
    return bool(words[:full].any()) or bool(rest and int(words[full]) & ((1 << rest) - 1))


def check_admits_output(guide: CompiledGuide, params: GuidedDecodingParams, vocab_size: int) -> None:
    """``ValueError`` for a constraint that allows no first token: it admits no output at all, like
    a schema that is only a reference to itself (``{"$ref": "#"}``). xgrammar compiles those without
    complaint, into a matcher that masks every token."""
    bitmask = allocate_bitmask(1, vocab_size)
    guide.matcher().fill_bitmask(bitmask, 0)
    if not allows_any(bitmask, 0, vocab_size):
        raise ValueError(
            f"{field_name(params)}: the constraint admits no output (a schema or rule that only refers to "
            "itself, with no alternative that ends, has no valid value)"
        )
