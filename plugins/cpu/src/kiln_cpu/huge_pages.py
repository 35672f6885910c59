"""What the kernels stream through every step, on 2 MiB pages: the KV pool and the tiled weights.

On 4 KiB pages a stream misses the TLB every 4 KiB (a page walk each), and a decode step streams
all of the weights (the default model's 96 MB: ~24,000 pages) and every request's K/V. Linux
backs a range with 2 MiB pages where its transparent huge pages are ``always``, or ``madvise``
and the range asks for them: ``zeroed`` asks. 1-row Q4_1 products over 1 GB of weights (more
than the L3 holds) read 28.3 GB/s from 2 MiB pages against 25.1 from 4 KiB ones (2-core AMX Xeon).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import numpy as np
import torch
from torch import nn

MADV_HUGEPAGE = 14  # Linux's
PAGE = 4096
ALIGN = 64  # each weight tensor's start in the gathered buffer: a cache line, as torch's allocator aligns


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return libc if libc is not None and hasattr(libc, "mallopt") else None


GLIBC = _glibc()  # the process's glibc (madvise, malloc_trim, mallopt), or None: another C library
TRIM_EVERY = 64 << 20  # bytes gathered between giving the originals' freed heap pages back


def zeroed(nbytes: int) -> np.ndarray:
    """``nbytes`` zero bytes from fresh pages (calloc's: each resident only once written), asked
    onto 2 MiB pages (the range's 2 MiB-aligned part gets them, as the kernel can)."""
    buffer = np.zeros(nbytes, dtype=np.uint8)
    if GLIBC is not None:
        start = -(-buffer.ctypes.data // PAGE) * PAGE
        length = max(0, nbytes - (start - buffer.ctypes.data))
        GLIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_HUGEPAGE)
    return buffer


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def gather_weights(model: nn.Module) -> int:
    """Copy the tiled weights of ``model`` (its modules' ``TiledWeight`` and ``PackedExperts``
    attributes) into one ``zeroed`` buffer, in module order (a decode step's reading order), and
    point their modules at the copies; returns the bytes gathered. Each holder switches as soon as
    its weights are copied, so an original is freed once its last holder has switched (a tied
    weight has two), and freed heap pages go back every ``TRIM_EVERY`` bytes: the load's peak grows
    by about that and one weight, not the model. Kernel arguments
    built from the originals' pointers (``use_fused_decode``'s) must be built after this.
    ``KILN_CPU_HUGE_PAGES=0`` leaves the weights where they are."""
    from kiln_cpu.experts import PackedExperts
    from kiln_cpu.tiled_weights import TiledWeight

    if os.environ.get("KILN_CPU_HUGE_PAGES", "1") == "0":
        return 0
    slots = [
        (m, name) for m in model.modules() for name, v in vars(m).items() if isinstance(v, (TiledWeight, PackedExperts))
    ]

    def forms(value) -> list[TiledWeight]:
        return value.experts if isinstance(value, PackedExperts) else [value]

    sizes = {}  # id -> bytes, each form once (a tied weight's two holders share it)
    for m, name in slots:
        for w in forms(getattr(m, name)):
            sizes[id(w)] = sum(_aligned(t.nbytes) for t in (w.scale, w.min, w.q) if t is not None)
    total = sum(sizes.values())
    if total == 0:
        return 0
    buffer = torch.from_numpy(zeroed(total + ALIGN))  # the views below keep it alive
    at = -buffer.data_ptr() % ALIGN

    def copy(t: torch.Tensor | None) -> torch.Tensor | None:
        nonlocal at
        if t is None:
            return None
        view = buffer[at : at + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        at += _aligned(t.nbytes)
        return view

    # NOTE: keyed by the id of an original that is alive when looked up: the originals were all
    # alive together, so no two share an id (a freed one's id may go to a new object, never looked up).
    moved: dict[int, TiledWeight] = {}

    def copied(w: TiledWeight) -> TiledWeight:
        if id(w) not in moved:
            moved[id(w)] = TiledWeight(w.fmt, copy(w.scale), copy(w.min), copy(w.q))
        return moved[id(w)]

    def switch(m: nn.Module, name: str) -> None:  # a function: its locals go with it, and the original with them
        old = getattr(m, name)
        if isinstance(old, PackedExperts):
            setattr(m, name, PackedExperts([copied(w) for w in old.experts], old.shape, old.int8_activations))
        else:
            setattr(m, name, copied(old))

    trimmed = 0
    for m, name in slots:
        switch(m, name)
        # NOTE: originals under glibc's mmap threshold (32 MiB once Kiln tunes malloc) lie in its
        # heap, which keeps freed pages resident: 640 MB of 1 MiB weights gathered with one trim at
        # the end peaked 640 MB higher, trimmed every 64 MiB 68 MB higher.
        if GLIBC is not None and at - trimmed >= TRIM_EVERY:
            GLIBC.malloc_trim(0)
            trimmed = at
    if GLIBC is not None:
        GLIBC.malloc_trim(0)
    return total
