"""GGUF's K-quants (Q4_K, Q5_K, Q6_K) written in ggml's byte layout, for tests: gguf-py reads
these types but quantizes none of them. The quantizer is the plain form of ggml's (each
sub-block's range mapped onto its codes, the sub-block scales and mins rounded to 6 or 8 bits
of the super-block's fp16 scales), without llama.cpp's search for lower error; the bytes are
what a llama.cpp file holds, so gguf-py's ``dequantize`` reads them as it reads any file."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

QK_K = 256  # values per super-block
KQUANTS = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _pack_scales_mins(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per super-block -> ggml's 12 bytes (``get_scale_min_k4``)."""
    lo = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mid = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return np.concatenate([lo, mid, hi], axis=1).astype(np.uint8)


def _affine(blocks: np.ndarray, top: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K's parts of (n, 256) values: value ~ d sc_j q - dmin m_j per 32, q in 0..top."""
    sub = blocks.reshape(len(blocks), 8, 32)
    mins = np.maximum(-sub.min(-1), 0.0)  # a min above zero is stored as zero
    scales = (sub.max(-1) + mins) / top
    d, dmin = _fp16(scales.max(-1) / 63), _fp16(mins.max(-1) / 63)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scales, df, out=np.zeros_like(scales), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(mins, dminf, out=np.zeros_like(mins), where=dminf > 0)), 0, 63).astype(np.uint8)
    step, offset = (df * sc)[..., None], (dminf * mn)[..., None]
    q = np.round(np.divide(sub + offset, step, out=np.zeros_like(sub), where=step > 0))
    return d, dmin, _pack_scales_mins(sc, mn), np.clip(q, 0, top).astype(np.uint8).reshape(len(blocks), QK_K)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _affine(blocks, 15)
    q = q.reshape(len(blocks), 4, 2, 32)  # 64-value chunks: the first 32 low nibbles, the next high
    qs = q[:, :, 0] | (q[:, :, 1] << 4)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales,
                           qs.reshape(len(blocks), 128)], axis=1)  # fmt: skip


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _affine(blocks, 31)
    q = q.reshape(len(blocks), 8, 32)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)  # bit j: sub-block j
    low = (q & 15).reshape(len(blocks), 4, 2, 32)
    qs = low[:, :, 0] | (low[:, :, 1] << 4)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qh,
                           qs.reshape(len(blocks), 128)], axis=1)  # fmt: skip


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    sub = blocks.reshape(len(blocks), 16, 16)
    # as ggml: the value of largest magnitude takes code -32, the sub-block scales 8 bits of d
    top = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]
    scales = top / -32
    big = np.take_along_axis(scales, np.abs(scales).argmax(-1)[:, None], -1)
    d = _fp16(big[:, 0] / -128)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scales, df, out=np.zeros_like(scales), where=df != 0)), -128, 127)
    step = (df * sc)[..., None]
    q = np.round(np.divide(sub, step, out=np.zeros_like(sub), where=step != 0))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(len(blocks), 2, 4, 32)  # 128-value halves
    ql = (q[:, :, :2] & 15) | ((q[:, :, 2:] & 15) << 4)  # quarters 0, 1 low nibbles; 2, 3 high
    qh = (q >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    qh = qh.sum(2, dtype=np.uint8)
    return np.concatenate([ql.reshape(len(blocks), 128), qh.reshape(len(blocks), 64),
                           sc.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)  # fmt: skip


_WRITERS = {GGMLQuantizationType.Q4_K: _q4_k, GGMLQuantizationType.Q5_K: _q5_k, GGMLQuantizationType.Q6_K: _q6_k}


def quantize_kquant(x: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """fp32 ``x`` (..., K), K a multiple of 256, as ``kind``'s bytes (..., K / 256 * block bytes),
    the array gguf-py's ``quantize`` returns for the types it writes."""
    if x.shape[-1] % QK_K:
        raise ValueError(f"{kind.name}: rows of {x.shape[-1]} values are not whole super-blocks of {QK_K}")
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, QK_K)
    return _WRITERS[kind](blocks).reshape(*x.shape[:-1], -1)
