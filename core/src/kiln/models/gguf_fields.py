"""A GGUF file's metadata fields, as the conversion reads them (``gguf``'s ``GGUFReader.fields``)."""

from __future__ import annotations

from typing import Any


def field(reader, key: str, default: Any = None) -> Any:
    """The value of ``reader``'s metadata field ``key`` (a ``GGUFReader``, or an object with its
    ``fields``), or ``default`` where the file has none."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()
