"""GGUF files as the fp32 Hugging Face folders Kiln reads: dequantized once and cached, so
that later starts read safetensors directly. The weights are written one tensor at a time,
each named and reordered as transformers' GGUF loading does (the file then holds the same
values as transformers' own conversion, bit for bit), so the whole model in floats is never
in memory; architectures whose tensors transformers rearranges across tensors (its mixtures of
experts) go through transformers' loading of the whole model instead.

A conversion is named for the file's content (its SHA-256), not for where the file lies: the
same file installed again, or in another environment, finds its folder already there. Each
conversion is about four times the GGUF's size (fp32), and folders named by path, size and
mtime, as before, piled up one per reinstall of the same file.

Hashing a file of several GB takes seconds, so ``sources.json`` beside the folders remembers
each path's digest under its size and mtime, and a file unchanged since is not read again.
After a conversion, the folders of files of the same name that no remembered path maps to
any more (the file's earlier content, or a folder of an older Kiln) are removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger("kiln.loader")

INDEX = "sources.json"  # {real path: {"size", "mtime_ns", "sha256"}}
FOLDER_KEY = re.compile(r"[0-9a-f]{16}")  # what follows "<file stem>-" in a folder's name


def convert_gguf(gguf_path: str, cache: Path) -> str:
    """The folder under ``cache`` holding ``gguf_path`` as an fp32 Hugging Face model,
    converted first if no file of the same content has been."""
    stem = Path(gguf_path).stem
    target = cache / f"{stem}-{_digest(gguf_path, cache)[:16]}"
    if not (target / "config.json").exists():
        _convert(gguf_path, target)
        _prune(cache, stem)
    return str(target)


def _read_index(cache: Path) -> dict[str, dict]:
    """The remembered paths (none where the index is missing or not Kiln's)."""
    try:
        index = json.loads((cache / INDEX).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(index, dict):
        return {}
    return {p: e for p, e in index.items() if isinstance(e, dict) and isinstance(e.get("sha256"), str)}


def _digest(path: str, cache: Path) -> str:
    """The file's SHA-256 (hex): remembered in the index while its size and mtime hold."""
    real, stat = os.path.realpath(path), os.stat(path)
    index = _read_index(cache)
    known = index.get(real)
    if known is not None and (known.get("size"), known.get("mtime_ns")) == (stat.st_size, stat.st_mtime_ns):
        return known["sha256"]
    logger.info("hashing %s (%.2f GB) to find its converted folder", path, stat.st_size / 1e9)
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            sha.update(chunk)
    # Remembered before the folder exists, so that a concurrent prune keeps it.
    index = {p: e for p, e in index.items() if os.path.exists(p)}
    index[real] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha.hexdigest()}
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(index, f, indent=1)
    os.replace(tmp, cache / INDEX)  # whole or not at all; of two racing writers, one wins
    return index[real]["sha256"]


def _prune(cache: Path, stem: str) -> None:
    """Remove the conversions of files named ``stem`` that no existing remembered path maps to."""
    kept = {e["sha256"][:16] for p, e in _read_index(cache).items() if os.path.exists(p)}
    for folder in cache.iterdir():
        key = folder.name.removeprefix(f"{stem}-")
        if key != folder.name and FOLDER_KEY.fullmatch(key) and key not in kept and folder.is_dir():
            logger.info("removing %s: no GGUF file maps to it any more", folder)
            shutil.rmtree(folder, ignore_errors=True)


def _convert(gguf_path: str, target: Path) -> None:
    logger.info("converting %s to a cached fp32 folder at %s (first start only)", gguf_path, target)
    from transformers import AutoTokenizer

    folder, fname = os.path.split(gguf_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=target.parent)
    try:
        try:
            AutoTokenizer.from_pretrained(folder, gguf_file=fname).save_pretrained(tmp)
            if not _write_by_tensor(gguf_path, tmp):
                _write_whole(gguf_path, tmp)
        except ImportError as exc:
            raise ValueError(f"model: reading GGUF needs `pip install gguf accelerate` ({exc})") from None
        except (ValueError, KeyError, IndexError, struct.error) as exc:  # what a damaged file raises
            raise ValueError(
                f"model: {gguf_path} could not be converted from GGUF (is the file complete?): {exc}"
            ) from exc
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").exists():  # else another process's conversion won the race
            raise


def _write_by_tensor(gguf_path: str, out: str) -> bool:
    """Write the model's fp32 folder (but the tokenizer) one tensor at a time, as transformers'
    GGUF loading names and reorders each: the whole model in floats is never in memory (for an
    8B model, 32 GB). False, having written nothing, for an architecture whose tensors
    transformers rearranges across tensors (its mixtures of experts) or does not map whole:
    ``_write_whole`` converts those."""
    import numpy as np
    from gguf import GGUFReader, dequantize
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        Gemma2TensorProcessor,
        LlamaTensorProcessor,
        TensorProcessor,
        get_gguf_hf_weights_map,
        read_field,
    )

    folder, fname = os.path.split(gguf_path)
    config = AutoConfig.from_pretrained(folder, gguf_file=fname)
    reader = GGUFReader(gguf_path)
    per_tensor = TENSOR_PROCESSORS.get(read_field(reader, "general.architecture")[0], TensorProcessor)
    if per_tensor not in (TensorProcessor, LlamaTensorProcessor, Gemma2TensorProcessor):  # each tensor alone
        return False
    processor = per_tensor(config=config.to_dict())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = get_gguf_hf_weights_map(model, processor)
    tensors = [(names[t.name], t) for t in reader.tensors if t.name in names]  # others transformers skips too
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(model.state_dict()) - tied - {name for name, _ in tensors}:
        return False
    # safetensors: a JSON header of every tensor's place, then the data; GGUF lists dimensions
    # innermost first.
    header, offset = {}, 0
    for name, t in tensors:
        shape = [int(d) for d in reversed(t.shape.tolist())]
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + 4 * math.prod(shape)]}
        offset = header[name]["data_offsets"][1]
    raw = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, t in tensors:
            values = processor.process(
                weights=dequantize(t.data, t.tensor_type), name=t.name, tensor_key_mapping=names,
                parsed_parameters={"tensors": {}},
            ).weights  # fmt: skip
            values = np.ascontiguousarray(values, dtype=np.float32)
            if list(values.shape) != header[name]["shape"]:
                raise ValueError(f"model: GGUF tensor {t.name} came out {values.shape}, not {header[name]['shape']}")
            f.write(memoryview(values).cast("B"))
    config.architectures = [type(model).__name__]
    setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", torch.float32)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    return True


def _write_whole(gguf_path: str, out: str) -> None:
    """The model's fp32 folder (but the tokenizer) through transformers' own loading of the
    whole file: every weight in fp32 in memory at once."""
    from transformers import AutoModelForCausalLM

    folder, fname = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    # transformers refuses to save a model it loaded from GGUF; the weights are plain fp32 now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(out)
    model.generation_config.save_pretrained(out)
