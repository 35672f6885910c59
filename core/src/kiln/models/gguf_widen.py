"""GGUF tensors widened to fp32 with torch: the values ``gguf.dequantize`` gives, bit for bit, sooner
for the common types.

A converted GGUF folder reads its weights from the file at every start (``gguf_cache``), so
widening is start-up time. gguf-py's numpy code took ~0.9 s for the default model's 135M
values (one thread, and a Python loop over groups of rows); these are whole-tensor torch ops
on all threads, in place where they can be (a fresh fp32 tensor per step cost more in page
faults than the arithmetic): ~0.35 s for the default model. On one 4096x4096 tensor (2 cores,
torch against gguf-py) Q4_1 took 51 against 432 ms, Q4_0 50/153, Q8_0 25/43, the K-quants
1.2-1.7x sooner, IQ4_NL/XS 1.5x, Q5_0/Q5_1 level to 1.2x. Each follows gguf-py's arithmetic
step for step (the scale products, then the codes times the scale, then the min), with no
fused multiply-add, so every rounding is the same. Other types go through ``gguf.dequantize``
itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch

Unpack = Callable[[torch.Tensor], torch.Tensor]


def _shifts(*bits: int) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.uint8)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """An fp16 field of each block (its two bytes) as fp32, one column."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """4-bit codes: each run of ``width`` bytes gives its low nibbles, then its high ones."""
    n = qs.shape[0]
    return ((qs.reshape(n, -1, 1, width) >> _shifts(0, 4).reshape(1, 1, 2, 1)) & 15).reshape(n, -1)


def _bits(qh: torch.Tensor, count: int, shift_step: int, mask: int) -> torch.Tensor:
    """``count`` fields of ``mask`` bits from each byte of 32-byte runs (the K-quants' packed low and high bits)."""
    n = qh.shape[0]
    shifts = _shifts(*range(0, count * shift_step, shift_step)).reshape(1, 1, count, 1)
    return ((qh.reshape(n, -1, 1, 32) >> shifts) & mask).reshape(n, -1, 32)


def _high_bit(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's fifth bits: bit j of the little-endian 32-bit field for value j."""
    return ((qh.unsqueeze(-1) >> _shifts(*range(8))) & 1).reshape(qh.shape[0], 32)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return (_nibbles(b[:, 2:], 16).to(torch.int8) - 8).float().mul_(_f16(b[:, :2]))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 4:], 16).float().mul_(_f16(b[:, :2])).add_(_f16(b[:, 2:4]))


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(b[:, 6:], 16) | (_high_bit(b[:, 2:6]) << 4)).to(torch.int8) - 16
    return q.float().mul_(_f16(b[:, :2]))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:], 16) | (_high_bit(b[:, 4:8]) << 4)
    return q.float().mul_(_f16(b[:, :2])).add_(_f16(b[:, 2:4]))


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].view(torch.int8).float().mul_(_f16(b[:, :2]))


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight 6-bit scales and mins per block, packed in the 12 bytes after d and dmin,
    each times its fp16 super-scale: (n, 8, 1) each."""
    s = b[:, 4:16].reshape(-1, 3, 4)
    low, mid, top = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([low & 63, (top & 15) | ((low >> 2) & 48)], dim=1)
    mn = torch.cat([mid & 63, (top >> 4) | ((mid >> 2) & 48)], dim=1)
    return (_f16(b[:, :2]) * sc.float()).unsqueeze(-1), (_f16(b[:, 2:4]) * mn.float()).unsqueeze(-1)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dm = _k_scales(b)
    return _nibbles(b[:, 16:], 32).reshape(-1, 8, 32).float().mul_(d).sub_(dm).reshape(b.shape[0], 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    d, dm = _k_scales(b)
    q = _nibbles(b[:, 48:], 32).reshape(-1, 8, 32) | (_bits(b[:, 16:48], 8, 1, 1) << 4)
    return q.float().mul_(d).sub_(dm).reshape(b.shape[0], 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = (_f16(b[:, 208:210]) * b[:, 192:208].view(torch.int8).float()).reshape(n, 16, 1)
    q = _nibbles(b[:, :128], 64).reshape(n, 8, 32) | (_bits(b[:, 128:192], 4, 2, 3) << 4)
    return (q.to(torch.int8) - 32).reshape(n, 16, 16).float().mul_(d).reshape(n, 256)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n, scales = b.shape[0], b[:, :16]
    d = (_f16(b[:, 80:82]) * (scales & 15).float()).unsqueeze(-1)
    dm = (_f16(b[:, 82:84]) * (scales >> 4).float()).unsqueeze(-1)
    return _bits(b[:, 16:80], 4, 2, 3).reshape(n, 16, 16).float().mul_(d).sub_(dm).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    high = ((b[:, 104:108].reshape(n, 1, 4) >> _shifts(0, 2, 4, 6).reshape(1, 4, 1)) & 3).reshape(n, 16)
    scales = (_nibbles(b[:, 96:104], 8) | (high << 4)).to(torch.int8) - 32
    d = (_f16(b[:, 108:110]) * scales.float()).reshape(n, 16, 1)
    low = _bits(b[:, 32:96], 4, 2, 3).reshape(n, 16, 16).to(torch.int8)
    cleared = (_bits(b[:, :32], 8, 1, 1).reshape(n, 16, 16) ^ 1) << 2  # a set mask bit: no offset
    return (low - cleared.to(torch.int8)).float().mul_(d).reshape(n, 256)


def _iq4_values(codes: torch.Tensor) -> torch.Tensor:
    """IQ4_NL/IQ4_XS's 4-bit codes looked up in their table of 16 non-uniform values, as fp32."""
    from gguf.quants import IQ4_NL

    return torch.tensor(IQ4_NL.kvalues, dtype=torch.int8)[codes.long()].float()


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return _iq4_values(_nibbles(b[:, 2:], 16)).mul_(_f16(b[:, :2]))


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    low = ((b[:, 4:8].unsqueeze(-1) >> _shifts(0, 4)) & 15).reshape(n, 8)  # a byte's low, then high nibble
    packed = b[:, 2].int() | (b[:, 3].int() << 8)  # the high bits of the eight scales: a little-endian uint16
    high = (packed.unsqueeze(-1) >> torch.arange(0, 16, 2, dtype=torch.int32)) & 3
    scales = (low | (high.to(torch.uint8) << 4)).to(torch.int8) - 32
    d = (_f16(b[:, :2]) * scales.float()).unsqueeze(-1)
    return _iq4_values(_nibbles(b[:, 8:], 16)).reshape(n, 8, 32).mul_(d).reshape(n, 256)


# GGML type name -> unpacking of its (blocks, bytes per block) uint8; the sizes are gguf's
TYPES: dict[str, Unpack] = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
}


def widen(data: np.ndarray, qtype) -> np.ndarray:
    """The fp32 values of a GGUF tensor's ``data`` (as ``gguf.GGUFReader`` gives it) of type
    ``qtype``, shaped as ``gguf.dequantize`` shapes them."""
    from gguf import GGML_QUANT_SIZES, dequantize

    unpack = TYPES.get(qtype.name)
    if unpack is None:
        return dequantize(data, qtype)
    values, size = GGML_QUANT_SIZES[qtype]
    with warnings.catch_warnings():  # the file's mapping is read-only; nothing here writes to it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(data.view(np.uint8))
    out = unpack(raw.reshape(-1, size))
    return out.reshape(*data.shape[:-1], data.shape[-1] // size * values).numpy()
