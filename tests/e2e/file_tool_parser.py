"""A tool parser loaded from a file with ``--tool-parser-plugin`` (not an installed package):
calls are written ``>>> name {json}``, one per line, after any content."""

from __future__ import annotations

import json

import kiln
from kiln.parsers import ToolParse, ToolParser, partial_marker_suffix

MARK = ">>> "


class ArrowCallParser(ToolParser):
    def parse(self, text: str, final: bool) -> ToolParse:
        head, sep, tail = text.partition(MARK)
        if not sep:  # hold back what may be the start of a marker
            return ToolParse(text if final else text[: len(text) - partial_marker_suffix(text, MARK)], [])
        if not final:
            return ToolParse(head, [])
        calls = []
        for line in (MARK + tail).splitlines():
            name, _, args = line.removeprefix(MARK).partition(" ")
            try:
                calls.append((name, json.dumps(json.loads(args))))
            except json.JSONDecodeError:
                return ToolParse(text, [])
        return ToolParse(head, calls)


@kiln.hookimpl
def register_tool_parsers(register) -> None:
    register("arrow_call", lambda: ArrowCallParser)
