"""Tiled GGUF forms kept on disk, so a model's second start skips recovering its blocks.

Recovering the blocks a GGUF model's fp32 weights were widened from (``gguf_blocks``) and
tiling them took ~1.3 s of the default model's ~7 s load on a 2-core AVX2 EPYC, and it grows
with the model and its types (K-quants try several codes per block). The forms are stored
under ``$KILN_CACHE_DIR/cpu-forms`` (default ``~/.cache/kiln``), one safetensors file per
weight, named by a fingerprint of the weight (its shape and an even sample of its values)
and of the code that made the form. A fingerprint may be shared by weights that differ
outside the sample: the caller checks a cached form against every value before using it,
as it checks a recovered one. The least recently used files go once the folder exceeds
``KILN_CPU_FORM_CACHE_GB`` (default 8; 0 turns the cache off).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from functools import cache
from pathlib import Path

import torch

from kiln.interfaces.platform import cache_dir

logger = logging.getLogger("kiln.cpu")

MIN_VALUES = 1 << 18  # smaller weights recover in milliseconds: not worth a file each
SAMPLE = 1 << 16  # values of a weight the fingerprint reads, evenly spaced, besides its first and last rows


def _limit_bytes() -> int:
    return int(float(os.environ.get("KILN_CPU_FORM_CACHE_GB", "8")) * (1 << 30))


def _folder() -> Path:
    return cache_dir() / "cpu-forms"


@cache
def _code_version() -> bytes:
    """The sources that decide a form (recovery, tiling): a change there makes new names."""
    here = Path(__file__).parent
    return hashlib.sha256(b"".join((here / n).read_bytes() for n in ("gguf_blocks.py", "tiled_weights.py"))).digest()


def fingerprint(weight: torch.Tensor) -> str | None:
    """The file name ``weight``'s (fp32, 2-D, contiguous) form is kept under, or None when it is
    too small to keep or the cache is off."""
    if weight.numel() < MIN_VALUES or _limit_bytes() <= 0:
        return None
    flat = weight.reshape(-1)
    sample = torch.cat([weight[0], flat[:: max(1, flat.numel() // SAMPLE)], weight[-1]])
    key = hashlib.sha256(_code_version())
    key.update(repr(tuple(weight.shape)).encode())
    key.update(sample.contiguous().numpy().tobytes())
    return key.hexdigest()[:32]


def load(name: str) -> tuple[int, torch.Tensor | None, torch.Tensor | None, torch.Tensor] | None:
    """(fmt, scale, min, q) stored under ``name``, or None."""
    from safetensors import SafetensorError, safe_open

    path = _folder() / f"{name}.safetensors"
    try:
        with safe_open(str(path), "pt") as f:
            fmt = int(f.metadata()["fmt"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no mapping)
        form = fmt, tensors.get("scale"), tensors.get("min"), tensors["q"]
        os.utime(path)  # recently used: the last to be trimmed
    except (OSError, KeyError, ValueError, SafetensorError) as e:  # absent, or trimmed or cut short by another process
        if not isinstance(e, FileNotFoundError):
            logger.debug("cached form %s unreadable: %s", name, e)
        return None
    return form


def store(name: str, fmt: int, scale: torch.Tensor | None, low: torch.Tensor | None, q: torch.Tensor) -> None:
    """Keep a form under ``name``: written aside and renamed, so readers see all of it or none.
    A full disk or a read-only cache costs only the next start's time."""
    from safetensors.torch import save_file

    tensors = {k: t for k, t in (("scale", scale), ("min", low), ("q", q)) if t is not None}
    folder = _folder()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=folder)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"fmt": str(fmt)})
            os.replace(tmp, folder / f"{name}.safetensors")
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        logger.warning("could not keep a tiled weight in %s: %s", folder, e)


def trim() -> None:
    """Delete the least recently used forms until the folder fits its limit."""
    try:
        entries = [(e.stat().st_mtime, e.stat().st_size, e.path) for e in os.scandir(_folder()) if e.is_file()]
    except OSError:  # no folder yet
        return
    excess = sum(size for _, size, _ in entries) - _limit_bytes()
    for _, size, path in sorted(entries):
        if excess <= 0:
            break
        try:
            os.unlink(path)
        except OSError:  # another process took it first
            pass
        excess -= size
