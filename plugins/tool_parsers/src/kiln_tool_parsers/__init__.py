"""Tool-call parsers, reasoning parsers and tool-aware chat templates for Kiln."""
