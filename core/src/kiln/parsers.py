"""Old import path, kept for plugins written before ``kiln.interfaces``: the parser
interfaces now live in ``kiln.interfaces.parsers``."""

from kiln.interfaces.parsers import (
    DeltaMessage,
    ExtractedToolCalls,
    ReasoningParser,
    ToolCall,
    ToolCallDelta,
    ToolParse,
    ToolParser,
    new_call_id,
    partial_marker_suffix,
)

__all__ = [
    "DeltaMessage",
    "ExtractedToolCalls",
    "ReasoningParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParse",
    "ToolParser",
    "new_call_id",
    "partial_marker_suffix",
]
