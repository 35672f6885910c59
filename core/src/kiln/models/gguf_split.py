"""llama.cpp's split GGUF models: one model in files ``<name>-00001-of-0000N.gguf`` ..
``<name>-0000N-of-0000N.gguf`` (``gguf-split``, or the converters' ``--split-max-tensors`` /
``--split-max-size``), as large models ship on the Hub. The first file holds every metadata
field and some tensors; the others hold the rest of the tensors, with only the ``split.*``
fields. As with llama.cpp, the model is named by its first file and the others are found
beside it by name; ``split.count`` and ``split.no`` in each file must agree with the names.
"""

from __future__ import annotations

import os
import re

from kiln.models.gguf_fields import field as gguf_field

SPLIT_NAME = re.compile(r"(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")
NAME_FORMAT = "{}-{:05d}-of-{:05d}.gguf"  # llama.cpp's llama_split_path


class SplitModelError(ValueError):
    """A split model's files that do not make a whole model, or a model Kiln cannot read split."""


def model_files(path: str) -> list[str]:
    """The files of the GGUF model whose (first) file is ``path``, in order: ``[path]`` unless its
    name is a split's. A later part, or a part missing beside the first, is an error naming the
    file to pass or the file missing."""
    folder, name = os.path.split(path)
    match = SPLIT_NAME.fullmatch(name)
    if match is None:
        return [path]
    count = int(match["count"])
    if not 1 <= int(match["no"]) <= count:
        raise SplitModelError(
            f"model: {path}: a split GGUF file's name gives its part and the count, 1 <= part <= count"
        )
    if int(match["no"]) != 1:
        first = NAME_FORMAT.format(match["prefix"], 1, count)
        raise SplitModelError(
            f"model: {path} is part {int(match['no'])} of {count} of a split GGUF model; pass its first file, {first}"
        )
    files = [os.path.join(folder, NAME_FORMAT.format(match["prefix"], i, count)) for i in range(1, count + 1)]
    if missing := [f for f in files if not os.path.isfile(f)]:
        raise SplitModelError(
            f"model: {path} is split into {count} files, and {len(missing)} of them are missing: {', '.join(missing)}"
        )
    return files


def model_stem(path: str) -> str:
    """The model's name: a split model's without the part numbers."""
    name = os.path.basename(path)
    match = SPLIT_NAME.fullmatch(name)
    return match["prefix"] if match else os.path.splitext(name)[0]


class SplitReader:
    """The parts of a split model read as one ``GGUFReader``: the first file's fields and every
    file's tensors, in order (what the conversion reads of a reader)."""

    def __init__(self, readers: list) -> None:
        self.fields = readers[0].fields
        self.tensors = [t for r in readers for t in r.tensors]
        self.readers = readers

    def release_pages(self) -> None:
        for reader in self.readers:
            reader.release_pages()


def read_model(files: list[str], tensors_only: bool = False):
    """A ``GGUFReader`` of the model in ``files`` (``model_files``'s list), checked against the
    ``split.*`` fields: a first file that says it is one of several whose others are not named
    as its parts, parts out of order, or tensors missing, are errors. ``tensors_only``: without
    the elements of string arrays (``TensorsGGUFReader``)."""
    from kiln.models.gguf_reader import FastGGUFReader, TensorsGGUFReader

    readers = []
    for i, path in enumerate(files):
        try:
            readers.append((TensorsGGUFReader if tensors_only else FastGGUFReader)(path))
        except Exception as exc:  # a part cut short or damaged: name the part, not the model
            if len(files) == 1:
                raise
            raise SplitModelError(
                f"model: {path}, part {i + 1} of {len(files)}, could not be read (is the file complete?): {exc}"
            ) from exc

    def field(reader, key: str, default: int | None = None) -> int | None:
        value = gguf_field(reader, f"split.{key}", default)
        return None if value is None else int(value)

    count = field(readers[0], "count", 1)
    if count != len(files):
        if len(files) > 1:
            raise SplitModelError(
                f"model: {files[0]} is named as part 1 of {len(files)}, but says it is one of {count}"
            )
        raise SplitModelError(
            f"model: {files[0]} is part 1 of a GGUF model split into {count} files; they must lie beside it, "
            f"named as llama.cpp names them ({NAME_FORMAT.format('<name>', 1, count)} and on)"
        )
    if count == 1:
        return readers[0]
    for i, (path, reader) in enumerate(zip(files, readers)):
        if field(reader, "no") != i or field(reader, "count") != count:
            raise SplitModelError(
                f"model: {path} is not part {i + 1} of {count} of {files[0]}'s model (its split.* fields differ)"
            )
    model = SplitReader(readers)
    expected = field(readers[0], "tensors.count")
    if expected is not None and len(model.tensors) != expected:
        raise SplitModelError(
            f"model: {files[0]}'s {count} files hold {len(model.tensors)} tensors, not the {expected} it lists"
        )
    return model
