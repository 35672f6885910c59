"""The CPU plugin's attention backend honours the AttentionBackend contract, with and
without its native decode and prefill kernels."""

import os
import platform
import random
import subprocess
import sys

import pytest
import torch

from kiln.attention.torch_ref import TorchRefAttentionBackend
from kiln.testing.contracts import BATCHES, AttentionBackendContract, forward_kwargs, random_layout
from kiln_cpu import fused_ops, native
from kiln_cpu.attention import CpuAttentionBackend


class TorchOnlyBackend(CpuAttentionBackend):
    """The fallback used where no C compiler is available."""

    def __init__(self, *args):
        super().__init__(*args)
        self.native = None
        self.native_prefill = False


# Decodes, a prefill and a chunk on a cached prefix across the native prefill kernels' edges:
# work items of 128 query positions, tiles of 32 (bf16, fp32 with AVX-512) or 16 (fp32 on
# AVX2), online-softmax steps of 64 keys. Two decodes are too few items for the threads, so the
# decode kernel splits the 300-key one's keys (19 blocks of 16) into two runs of 8 blocks or more.
LONG_BATCH = [(40, 1), (300, 1), (0, 300), (150, 170)]


class LongPrefills:
    @pytest.mark.parametrize("window", [None, 50, 200])
    @pytest.mark.parametrize(
        ("heads", "head_dim"), [((6, 2), 64), ((8, 1), 128), ((4, 4), 64), ((4, 2), 256), ((4, 2), 96)]
    )
    def test_long_prefills_match_reference(self, heads, head_dim, window):
        self._check_batch(heads, head_dim, 16, LONG_BATCH, seed=5, sliding_window=window)


class TestCpuAttentionNative(LongPrefills, AttentionBackendContract):
    backend_cls = CpuAttentionBackend


class TestCpuAttentionTorchFallback(AttentionBackendContract):
    backend_cls = TorchOnlyBackend


class TestCpuAttentionBfloat16(LongPrefills, AttentionBackendContract):
    backend_cls = CpuAttentionBackend
    dtype = torch.bfloat16
    atol = 2e-2


def test_prefills_take_the_native_kernels():
    """So that the contracts above test the kernels: fp32 ones (fp32 or bf16 cache) wherever the
    kernels build; bf16 ones where the CPU has AVX512-BF16 (the fallback on others, and on AMX,
    where torch's kernel is kept)."""
    flags, lib = native._cpu_flags(), native.load_kernels()
    built = lib is not None
    # (the build's target too: KILN_CPU_MARCH may name one without AVX512-BF16)
    expected = " avx512_bf16" in flags and " amx_bf16" not in flags and built and lib.prefill_attention_bf16_available()
    assert CpuAttentionBackend(6, 2, 64, torch.bfloat16).native_prefill == expected
    assert CpuAttentionBackend(6, 2, 64, torch.float32).native_prefill == built
    assert CpuAttentionBackend(6, 2, 64, torch.float32, cache_dtype=torch.bfloat16).native_prefill == built
    # Phi-3's head size 96 and Gemma's 256 too
    for head_dim in (96, 256):
        assert CpuAttentionBackend(4, 2, head_dim, torch.float32).native_prefill == built
        assert CpuAttentionBackend(4, 2, head_dim, torch.bfloat16).native_prefill == expected
        assert all((CpuAttentionBackend(4, 2, head_dim, dtype, cache).native is not None) == built
                   for dtype, cache in [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.bfloat16)])  # fmt: skip


@pytest.mark.parametrize("window", [None, 20])
def test_fp32_prefills_read_fused_qkv_rows_and_attend_their_own_keys_unrounded(window):
    """As models call it: q, k and v views into one fused projection's rows (k normed apart,
    as Qwen3's, so k and v rows have different strides), under a bf16 cache. Prompts attend
    their own K/V as computed (fp32) and a cached prefix as the cache holds it (bf16): the
    reference is an fp32 cache holding that same prefix."""
    heads, kv_heads, dim, block_size = 6, 2, 64, 16
    layout, tokens = random_layout(random.Random(3), block_size, 64, [(0, 40), (37, 150)])
    torch.manual_seed(3)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim).contiguous()
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    backend = CpuAttentionBackend(heads, kv_heads, dim, torch.float32, torch.bfloat16)
    ref = TorchRefAttentionBackend(heads, kv_heads, dim, torch.float32)
    assert backend.native_prefill and k.stride(0) != v.stride(0)
    cache = torch.randn(backend.kv_cache_shape(64, block_size)).to(torch.bfloat16)
    ref_cache = backend.reference_view(cache).float().contiguous()
    kwargs = forward_kwargs(dim**-0.5, window)
    got = backend.forward(q, k, v, cache, backend.build_metadata(layout), **kwargs)
    expected = ref.forward(q, k, v, ref_cache, ref.build_metadata(layout), **kwargs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set levels")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])  # AVX2; SSE through the portable build
def test_kernels_built_for_older_instruction_sets_match_the_reference(march, march_cache_dir):
    """Their fp32 products on 8-float vectors, where an AVX-512 machine's build has 16."""
    env = {**os.environ, "KILN_CPU_MARCH": march, "KILN_CACHE_DIR": str(march_cache_dir)}
    select = "(TestCpuAttentionNative or TestCpuAttentionBfloat16Cache or Fp8E5m2 or fused_qkv or gemmas_head) and not Fallback"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", select],
                         env=env, capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:]
    assert list(march_cache_dir.glob("cpu-kernels/*.so"))  # built for that level, not this machine's cached library


class TestCpuAttentionBfloat16TorchFallback(TestCpuAttentionBfloat16):
    backend_cls = TorchOnlyBackend


class TestCpuAttentionBfloat16Cache(LongPrefills, AttentionBackendContract):
    """``--kv-cache-dtype bfloat16`` under an fp32 model: K/V stored in bf16, attention in fp32."""

    backend_cls = CpuAttentionBackend
    cache_dtype = torch.bfloat16


class TestCpuAttentionBfloat16CacheTorchFallback(TestCpuAttentionBfloat16Cache):
    backend_cls = TorchOnlyBackend


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize(
    "contract", [TestCpuAttentionNative, TestCpuAttentionBfloat16, TestCpuAttentionBfloat16Cache],
    ids=["fp32", "bf16", "bf16-cache"],
)  # fmt: skip
def test_soft_caps_at_gemmas_head_size(contract, window):
    """Gemma 2's head size (8 query and 4 KV heads of 256; the contract checks caps at 64) through the
    kernels that cap the scores (where the CPU runs them: see test_prefills_take_the_native_kernels):
    decodes, fresh prefills and chunks on a cached prefix in one step."""
    contract()._check_batch((8, 4), 256, 16, BATCHES[3], seed=7, sliding_window=window, logit_softcap=1.5)


class TestCpuAttentionFp8E4m3Cache(AttentionBackendContract):
    """``--kv-cache-dtype fp8`` (and ``fp8_e4m3``): K/V in a byte each, read through torch."""

    backend_cls = CpuAttentionBackend
    cache_dtype = torch.float8_e4m3fn


class TestCpuAttentionFp8E5m2Cache(AttentionBackendContract):
    backend_cls = CpuAttentionBackend
    cache_dtype = torch.float8_e5m2


def test_bfloat16_cache_halves_the_kv_memory_and_keeps_the_first_token(tiny_model_dir, varied_prompts):
    """The first token of each prompt comes from the prefill, which attends to the unrounded
    K/V: it matches the fp32 cache's; later ones read the bf16 cache through the C kernel."""
    from kiln import LLM, SamplingParams

    common = dict(model=tiny_model_dir("llama"), dtype="float32", max_model_len=256)
    half, full = LLM(kv_cache_dtype="bfloat16", **common), LLM(**common)
    assert (
        half.engine.executor.runner.kv_caches[0].dtype == torch.bfloat16
        and half.engine.executor.runner.backend.native is not None
    )
    assert 2 * half.engine.executor.runner.kv_block_bytes() == full.engine.executor.runner.kv_block_bytes()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in varied_prompts]
    got, expected = half.generate(prompts, params), full.generate(prompts, params)
    assert [o.outputs[0].token_ids[0] for o in got] == [o.outputs[0].token_ids[0] for o in expected]
    assert all(len(o.outputs[0].token_ids) == 6 for o in got)


@pytest.mark.parametrize(("flag", "dtype"), [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_cache_quarters_the_kv_memory_and_keeps_the_first_token(tiny_model_dir, varied_prompts, flag, dtype):
    """As with bf16 above, the prefill attends to unrounded K/V; later tokens read the fp8 cache:
    e5m2 through the C decode kernel, e4m3 through torch."""
    from kiln import LLM, SamplingParams

    common = dict(model=tiny_model_dir("llama"), dtype="float32", max_model_len=256)
    quarter, full = LLM(kv_cache_dtype=flag, **common), LLM(**common)
    runner = quarter.engine.executor.runner
    assert runner.kv_caches[0].dtype == dtype
    assert (runner.backend.native is not None) == (dtype == torch.float8_e5m2 and native.load_kernels() is not None)
    assert 4 * runner.kv_block_bytes() == full.engine.executor.runner.kv_block_bytes()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in varied_prompts]
    got, expected = quarter.generate(prompts, params), full.generate(prompts, params)
    assert [o.outputs[0].token_ids[0] for o in got] == [o.outputs[0].token_ids[0] for o in expected]
    assert all(len(o.outputs[0].token_ids) == 6 for o in got)


def test_native_kernel_builds_here():
    assert native.load_kernels() is not None


def test_engine_on_cpu_uses_the_plugin_backend(tiny_model_dir):
    from kiln import LLM

    engine = LLM(tiny_model_dir("llama"), max_model_len=64).engine
    assert engine.platform.name == "cpu"
    assert (
        isinstance(engine.executor.runner.backend, CpuAttentionBackend)
        and engine.executor.runner.backend.native is not None
    )
    assert engine.executor.sampler.argmax is fused_ops.argmax  # greedy picks through the C kernel
