"""The Ascend plugin through a CPU emulation of the torch_npu ops it calls: the attention backend
honours the contract, the fused ops match the reference, version problems read as one message,
and the whole engine on the Ascend code path matches the CPU plugin token for token."""

from __future__ import annotations

import sys

import pytest
import torch
from tests.ascend import fake_torch_npu  # noqa: I001

import kiln
from kiln import ops as reference


@pytest.fixture(autouse=True)
def emulated_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu)
    fake_torch_npu.calls.clear()


from kiln_ascend import ops  # noqa: E402
from kiln_ascend.attention import AscendAttentionBackend  # noqa: E402  (imports no torch_npu)


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=["mha", "gqa3", "mqa8"])
@pytest.mark.parametrize("block_size", [64, 128])
def test_attention_matches_the_reference(block_size, heads):
    """The contract's checks at the block sizes the NPU supports (the shared suite uses 16 and 32)."""
    import random

    from kiln.attention.torch_ref import TorchRefAttentionBackend
    from kiln.testing.contracts import random_layout

    n, kvn = heads
    rng = random.Random(block_size)
    layout, tokens = random_layout(rng, block_size, 16, [(70, 1), (3, 1), (0, 40), (130, 9), (64, 64)])
    ref, npu = TorchRefAttentionBackend(n, kvn, 64, torch.float32), AscendAttentionBackend(n, kvn, 64, torch.float32)
    cache = torch.randn(ref.kv_cache_shape(16, block_size))
    mine = cache.clone()
    q, k, v = torch.randn(tokens, n, 64), torch.randn(tokens, kvn, 64), torch.randn(tokens, kvn, 64)
    expected = ref.forward(q, k, v, cache, ref.build_metadata(layout), layer_idx=0, scale=0.125)
    got = npu.forward(q, k, v, mine, npu.build_metadata(layout), layer_idx=0, scale=0.125)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine, cache)
    assert any(c.startswith("npu_incre_flash_attention") for c in fake_torch_npu.calls)


def test_precision_switches_reach_the_ops(monkeypatch):
    from kiln_ascend.precision import PrecisionModes

    monkeypatch.setenv("USE_IFA_HIGH_PRECISION_MODE", "1")
    monkeypatch.setenv("USE_PFA_HIGH_PRECISION_MODE", "0")
    modes = PrecisionModes.from_env()
    assert (modes.decode(), modes.prefill(on_cached_prefix=False), modes.prefill(on_cached_prefix=True)) == (0, 1, 1)
    monkeypatch.setenv("USE_PREFIX_HIGH_PRECISION_MODE", "1")
    assert PrecisionModes.from_env().prefill(on_cached_prefix=True) == 0


def test_fused_ops_match_the_reference():
    torch.manual_seed(0)
    x, r, w = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    for got, want in zip(ops.fused_add_rms_norm(x, r, w, 1e-6), reference.fused_add_rms_norm(x, r, w, 1e-6)):
        torch.testing.assert_close(got, want)
    gu = torch.randn(3, 128)
    torch.testing.assert_close(ops.silu_and_mul(gu), reference.silu_and_mul(gu))
    t = torch.arange(64, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(0, 32, 2) / 32)
    cache = torch.cat((t.cos(), t.sin()), dim=-1).float()
    pos, q, k = torch.tensor([0, 3, 63]), torch.randn(3, 4, 32), torch.randn(3, 2, 32)
    for got, want in zip(ops.rotary_embedding(pos, q, k, cache), reference.rotary_embedding(pos, q, k, cache)):
        torch.testing.assert_close(got, want)


def test_version_mismatch_is_one_actionable_message(monkeypatch):
    from kiln_ascend.platform import check_versions

    monkeypatch.setattr(fake_torch_npu, "__version__", "2.1.0.post3")
    with pytest.raises(RuntimeError, match=r"torch \S+ and torch_npu 2\.1\.0 do not match"):
        check_versions()
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails, as without CANN
    with pytest.raises(RuntimeError, match="could not be imported.*set_env.sh"):
        check_versions()


def test_block_sizes_other_than_64_and_128_are_refused():
    from kiln.config import EngineConfig
    from kiln_ascend.platform import NpuPlatform

    with pytest.raises(ValueError, match="--block-size: 16 is not supported on Ascend"):
        NpuPlatform().update_config(EngineConfig.create(block_size=16))


def make_cpu_npu_platform():
    """The Ascend platform with its device calls on the CPU (everything else unchanged)."""
    from kiln_ascend.platform import NpuPlatform
    from kiln_cpu.platform import CpuPlatform

    class EmulatedNpu(NpuPlatform):
        name = "npu_emulated"
        device = CpuPlatform.device
        mem_get_info = CpuPlatform.mem_get_info

        def synchronize(self) -> None:
            pass

    return EmulatedNpu()


@kiln.hookimpl
def register_platforms(register) -> None:
    from kiln.platforms.base import PlatformSpec

    register(PlatformSpec("npu_emulated", make_cpu_npu_platform, is_available=lambda: True))


@pytest.mark.parametrize("block_size", [64, 128])
def test_engine_on_the_ascend_path_matches_the_cpu_plugin(tiny_model_dir, kiln_plugins, varied_prompts, block_size):
    import kiln_ascend.plugin
    import kiln_cpu.plugin
    from kiln.testing.engine import greedy_tokens

    for module, name in ((kiln_cpu.plugin, "cpu"), (kiln_ascend.plugin, "ascend"), (sys.modules[__name__], "test")):
        kiln_plugins.register(module, name=name)
    common = dict(model=tiny_model_dir("llama"), dtype="float32", max_num_batched_tokens=64)
    npu_run = greedy_tokens(kiln_plugins, varied_prompts, device="npu_emulated", block_size=block_size, **common)
    assert npu_run == greedy_tokens(kiln_plugins, varied_prompts, device="cpu", block_size=16, **common)
    used = {c.split(":")[0] for c in fake_torch_npu.calls}
    assert {"npu_incre_flash_attention", "npu_fused_infer_attention_score", "_npu_reshape_and_cache",
            "npu_add_rms_norm", "npu_rotary_mul", "npu_swiglu"} <= used  # fmt: skip
