"""Engine flags on the command line: one ``--flag`` per ``EngineConfig`` field (shared by
``kiln generate`` and ``kiln serve``)."""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any

from kiln.config import EngineConfig

# vLLM's short spellings (seed 002 lists -tp and -q, seed 003 -spec-draft-tp).
SHORT_FLAGS = {
    "tensor_parallel_size": "-tp",
    "quantization": "-q",
    "speculative_draft_tensor_parallel_size": "-spec-draft-tp",
}
# Switches that vLLM also takes with a value (seed 003: ``--enable-chunked-prefill [ENABLE_CHUNKED_PREFILL]``).
VALUED_SWITCHES = {"enable_chunked_prefill", "multi_step_stream_outputs"}


class ValuedSwitch(argparse.BooleanOptionalAction):
    """``--flag``, ``--flag false`` / ``--flag=true`` (vLLM's spelling), or ``--no-flag``."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.nargs = "?"

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values is None:
            value = not option_string.startswith("--no-")
        elif option_string.startswith("--no-") or values.lower() not in ("true", "false"):
            parser.error(f"{option_string}: expected true or false, got {values!r}")
        else:
            value = values.lower() == "true"
        setattr(namespace, self.dest, value)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per ``EngineConfig`` field, with its type, choices and default."""
    group = parser.add_argument_group("engine")
    for name, field in EngineConfig.model_fields.items():
        if name == "model":
            continue
        flag = "--" + name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
        ann = field.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        help_text = field.description or ""
        if ann is bool:
            kwargs["action"] = ValuedSwitch if name in VALUED_SWITCHES else argparse.BooleanOptionalAction
        elif typing.get_origin(ann) is typing.Literal or (args and typing.get_origin(args[0]) is typing.Literal):
            literal = ann if typing.get_origin(ann) is typing.Literal else args[0]
            kwargs["choices"] = list(typing.get_args(literal))
        else:
            base = args[0] if typing.get_origin(ann) in (typing.Union, types.UnionType) else ann
            if typing.get_origin(base) is list:  # --graph-sizes 2 4 8
                kwargs["nargs"] = "+"
                base = typing.get_args(base)[0]
            kwargs["type"] = base if base in (int, float) else str
        kwargs["help"] = f"{help_text} (default: {field.default})".strip()
        group.add_argument(*[f for f in (flag, SHORT_FLAGS.get(name)) if f], **kwargs)


def engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(ns, k) for k in EngineConfig.model_fields if k != "model" and hasattr(ns, k)}
