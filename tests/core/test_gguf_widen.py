"""GGUF tensors widened with torch (``kiln.models.gguf_widen``) are ``gguf.dequantize``'s values bit
for bit, shapes included, for every block type it widens and for those it passes to gguf."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

from kiln.models.gguf_widen import TYPES, widen

# Where each type keeps its fp16 scale fields (byte offsets in a block): set to finite values,
# since random bytes there would be NaNs, which compare unequal even where both sides agree.
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
              "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,), "IQ4_NL": (0,), "IQ4_XS": (0,),
              "IQ2_XXS": (0,), "IQ3_S": (0,)}  # fmt: skip


def _blocks(name: str, shape: tuple[int, ...], blocks_per_row: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    size = GGML_QUANT_SIZES[GGMLQuantizationType[name]][1]
    data = rng.integers(0, 256, (*shape, blocks_per_row, size), dtype=np.uint8)
    for offset in F16_FIELDS[name]:
        scales = rng.standard_normal((*shape, blocks_per_row)).astype(np.float16)
        data[..., offset : offset + 2] = scales[..., None].view(np.uint8)
    return data.reshape(*shape, blocks_per_row * size)


@pytest.mark.parametrize("name", [*TYPES, "IQ2_XXS", "IQ3_S"])  # the last two through gguf itself
@pytest.mark.parametrize("shape", [(7,), (3, 5)], ids=["rows", "experts"])
def test_widened_values_are_gguf_dequantize_bit_for_bit(name, shape):
    qtype = GGMLQuantizationType[name]
    data = _blocks(name, shape, 3, seed=len(shape))
    ours, theirs = widen(data, qtype), dequantize(data, qtype)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    assert ours.shape[-1] == 3 * GGML_QUANT_SIZES[qtype][0]
    assert np.array_equal(ours.view(np.int32), theirs.view(np.int32))  # signs of zeros too
    assert np.isfinite(ours).all() and np.unique(ours).size > 16  # the fields were read, not zeros


def test_plain_floats_pass_through():
    values = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float16)
    assert np.array_equal(widen(values, GGMLQuantizationType.F16), values.astype(np.float32))
