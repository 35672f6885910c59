"""The CPU plugin's fused C ops against the core's torch reference ops (kiln.ops)."""

from __future__ import annotations

import pytest
import torch

from kiln import ops as reference
from kiln_cpu import fused_ops, native

pytestmark = pytest.mark.skipif(native.load_kernels() is None, reason="no C compiler: fused ops not built")

# fp32: only the summation order differs. bf16: at most one bf16 ulp where a rounding flips.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=8e-3)}
DTYPES = [torch.float32, torch.bfloat16]


def close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (16, 576), (7, 100), (300, 64)])
def test_rms_norm(dtype, shape):
    torch.manual_seed(0)
    x, w = torch.randn(shape).to(dtype), torch.randn(shape[-1]).to(dtype)
    close(fused_ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (16, 576), (5, 36)])
def test_fused_add_rms_norm_in_place(dtype, shape):
    torch.manual_seed(1)
    x, r, w = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype), torch.randn(shape[-1]).to(dtype)
    want_x, want_r = reference.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    got_x, got_r = fused_ops.fused_add_rms_norm(x, r, w, 1e-6)
    assert got_x.data_ptr() == x.data_ptr() and got_r.data_ptr() == r.data_ptr()
    torch.testing.assert_close(got_r, want_r, atol=0, rtol=0)  # the sum rounds exactly as torch's
    close(got_x, want_x, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 128), (2, 1, 20)])
def test_rotary_on_strided_qkv_views(dtype, heads, kv_heads, dim):
    torch.manual_seed(2)
    tokens = 11
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    positions = torch.tensor([0, 1, 2, 5, 9, 100, 3, 4, 7, 8, 1023])
    t = torch.arange(1024, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(0, dim, 2) / dim)
    cache = torch.cat((t.cos(), t.sin()), dim=-1).float()
    want_q, want_k = reference.rotary_embedding(positions, q.clone(), k.clone(), cache)
    got_q, got_k = fused_ops.rotary_embedding(positions, q, k, cache)
    close(got_q, want_q, dtype)
    close(got_k, want_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 3072), (16, 3072), (3, 42)])
def test_silu_and_mul(dtype, shape):
    torch.manual_seed(3)
    x = (torch.randn(shape) * 4).to(dtype)
    close(fused_ops.silu_and_mul(x), reference.silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache_skips_padding(dtype):
    torch.manual_seed(4)
    blocks, heads, bs, dim, tokens = 6, 3, 16, 64, 9
    cache = torch.zeros(2, blocks, heads, bs, dim, dtype=dtype)
    expected = torch.zeros_like(cache)
    kv = torch.randn(tokens, 3 * heads * dim).to(dtype)
    k = kv[:, : heads * dim].view(tokens, heads, dim)  # strided rows, as split from qkv
    v = kv[:, heads * dim : 2 * heads * dim].view(tokens, heads, dim)
    slots = torch.tensor([0, 1, 17, -1, 40, 95, -1, 33, 16])
    native.write_kv_cache(cache, k, v, slots, bs)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[0, slot // bs, :, slot % bs] = k[t]
            expected[1, slot // bs, :, slot % bs] = v[t]
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


def test_the_platform_uses_them():
    from kiln_cpu.platform import CpuPlatform

    assert CpuPlatform().custom_ops()["silu_and_mul"] is fused_ops.silu_and_mul
