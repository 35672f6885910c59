"""GGUF files as the fp32 Hugging Face folders Kiln reads: dequantized once through
``transformers`` and cached, so that later starts read safetensors directly.

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
import os
import re
import shutil
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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = os.path.split(gguf_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    except ImportError as exc:
        raise ValueError(f"model: reading GGUF needs `pip install gguf accelerate` ({exc})") from None
    # transformers refuses to save a model it loaded from GGUF; the weights are plain fp32 now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=target.parent)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").exists():
            raise
