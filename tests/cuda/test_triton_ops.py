"""The CUDA plugin's Triton ops against the core's torch reference ops, and the whole engine on a
tiny model through the plugin's kernels matching the CPU plugin token for token."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import kiln
from kiln import ops as reference
from kiln_cuda import ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
DTYPES = [torch.float32, torch.float16]  # the interpreter's bf16 arithmetic is broken


def close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 64), (5, 100), (1, 576)])
def test_rms_norm_and_fused_add(dtype, shape):
    torch.manual_seed(0)
    x, r, w = (torch.randn(s, device=DEVICE).to(dtype) for s in (shape, shape, shape[-1:]))
    close(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), dtype)
    want_x, want_r = reference.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    got_x, got_r = ops.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    close(got_r, want_r, dtype)
    close(got_x, want_x, dtype)


def gptj_reference(positions, x, cache):
    """GPT-J style: pairs (2i, 2i+1), i.e. NeoX applied to the de-interleaved head."""
    d = x.shape[-1]
    perm = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))
    rotated, _ = reference.rotary_embedding(positions, x[..., perm], x[..., perm][:, :1], cache)
    out = torch.empty_like(x)
    out[..., perm] = rotated
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 64), (6, 2, 128), (8, 1, 32)])
def test_rotary_neox_and_gptj_on_strided_views(dtype, heads, kv_heads, dim):
    torch.manual_seed(1)
    tokens = 7
    positions = torch.tensor([0, 1, 5, 9, 100, 3, 511], device=DEVICE)
    t = torch.arange(512, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(0, dim, 2) / dim)
    cache = torch.cat((t.cos(), t.sin()), dim=-1).float().to(DEVICE)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=DEVICE).to(dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    want_q, want_k = reference.rotary_embedding(positions, q.clone(), k.clone(), cache)
    got_q, got_k = ops.rotary_embedding(positions, q.clone(), k.clone(), cache)
    close(got_q, want_q, dtype)
    close(got_k, want_k, dtype)
    gq, _ = ops.rotary_embedding(positions, q.clone(), k.clone(), cache, neox=False)
    close(gq, gptj_reference(positions, q.clone(), cache), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 128), (3, 3000)])
def test_silu_and_mul(dtype, shape):
    torch.manual_seed(2)
    x = (torch.randn(shape, device=DEVICE) * 3).to(dtype)
    close(ops.silu_and_mul(x), reference.silu_and_mul(x), dtype)


class TritonOnCpuPlatform:
    """The CPU platform running the CUDA plugin's kernels (under the interpreter)."""

    @staticmethod
    def make():
        from kiln_cpu.platform import CpuPlatform

        class Platform(CpuPlatform):
            name = "cpu_triton"

            def attention_backend(self) -> str:
                return "triton_interpreted"

            def custom_ops(self):
                return ops.fused_ops()

            def process_weights(self, model, config) -> None:
                pass

            def linear_method(self, scheme):
                from kiln_cuda.quant import linear_method

                return linear_method(scheme)

        return Platform()


@kiln.hookimpl
def register_platforms(register) -> None:
    from kiln.platforms.base import PlatformSpec

    register(PlatformSpec("cpu_triton", TritonOnCpuPlatform.make, is_available=lambda: True))


@kiln.hookimpl
def register_attention_backends(register) -> None:
    """The Triton attention backend on that platform: the CUDA plugin registers it for ``cuda`` only."""
    from kiln.registry import AttentionBackendSpec

    register(AttentionBackendSpec("triton_interpreted", "kiln_cuda.attention:TritonAttentionBackend", ("cpu_triton",)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the interpreter path on CPU")
def test_engine_through_triton_kernels_matches_the_cpu_plugin(tiny_model_dir, kiln_plugins, varied_prompts):
    import kiln_cpu.plugin
    import kiln_cuda.plugin
    from kiln.testing.engine import greedy_tokens

    for module, name in ((kiln_cpu.plugin, "cpu"), (kiln_cuda.plugin, "cuda"), (sys.modules[__name__], "test")):
        kiln_plugins.register(module, name=name)
    # Three of the varied prompts (under a block, a block and a tail, exactly two blocks):
    # the interpreter runs every kernel program in Python, so each token costs seconds.
    prompts = varied_prompts[:3]
    common = dict(model=tiny_model_dir("llama"), dtype="float32", block_size=16)
    triton_run = greedy_tokens(kiln_plugins, prompts, device="cpu_triton", **common)
    assert triton_run == greedy_tokens(kiln_plugins, prompts, device="cpu", **common)


FP8_CHANNELS = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}}},
}  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the interpreter path on CPU")
@pytest.mark.parametrize(
    ("config", "kept"),
    [
        ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 32]}, True),
        (FP8_CHANNELS, True),
        ({"quant_method": "fp8", "activation_scheme": "static"}, True),  # a scale per tensor: q, k, v their own
        ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [48, 48]}, False),
    ],
    ids=["blocks", "channels", "tensors", "blocks-off-the-layers"],
)  # fmt: skip
def test_fp8_checkpoints_through_triton_kernels_match_the_cpu_plugin(tiny_model_dir, kiln_plugins, tmp_path, config,
                                                                     kept):  # fmt: skip
    """An fp8 checkpoint's weights stay fp8 on the Triton platform (its dequantizing GEMM reads them;
    blocks of 48 inputs, which do not tile the 64-input layers, are widened at load) and give the
    tokens the CPU plugin gives from them widened at load (tests/quantization/test_fp8_checkpoints.py
    matches those to transformers)."""
    import kiln_cpu.plugin
    import kiln_cuda.plugin
    from kiln.interfaces.quantization import QuantLinear
    from kiln.testing.engine import make_engine, run_greedy
    from kiln.testing.quantization import fp8_copy

    for module, name in ((kiln_cpu.plugin, "cpu"), (kiln_cuda.plugin, "cuda"), (sys.modules[__name__], "test")):
        kiln_plugins.register(module, name=name)
    folder, _ = fp8_copy(tiny_model_dir("llama"), tmp_path / "fp8", config)
    prompts, common = [[1000, 7, 9], list(range(100, 119))], dict(model=str(folder), dtype="float32", block_size=16)
    engines = {device: make_engine(kiln_plugins, device=device, **common) for device in ("cpu_triton", "cpu")}
    layers = {
        d: [m for m in e.executor.runner.model.modules() if isinstance(m, QuantLinear)] for d, e in engines.items()
    }
    assert not layers["cpu"] and bool(layers["cpu_triton"]) == kept
    assert all(layer.qweight.dtype == torch.float8_e4m3fn for layer in layers["cpu_triton"])
    assert run_greedy(engines["cpu_triton"], prompts) == run_greedy(engines["cpu"], prompts)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the interpreter path on CPU")
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "deepseek_v2"])
@pytest.mark.parametrize(
    "config", [{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 32]}, FP8_CHANNELS],
    ids=["blocks", "channels"],
)  # fmt: skip
def test_fp8_mixtures_keep_fp8_experts_and_match_the_cpu_plugin(tiny_model_dir, kiln_plugins, tmp_path, model_type,
                                                                config):  # fmt: skip
    """An fp8 mixture of experts on the Triton platform: its experts stay float8 in the grouped
    GEMM (``QuantizedExperts``), its other projections in the dequantizing GEMM, and it serves
    the tokens the CPU plugin serves from the checkpoint widened at load."""
    import kiln_cpu.plugin
    import kiln_cuda.plugin
    from kiln.testing.engine import make_engine, run_greedy
    from kiln.testing.quantization import fp8_copy
    from kiln_cuda.moe import QuantizedExperts

    for module, name in ((kiln_cpu.plugin, "cpu"), (kiln_cuda.plugin, "cuda"), (sys.modules[__name__], "test")):
        kiln_plugins.register(module, name=name)
    folder, _ = fp8_copy(tiny_model_dir(model_type), tmp_path / "fp8", config)
    prompts, common = [[1000, 7, 9], list(range(100, 119))], dict(model=str(folder), dtype="float32", block_size=16)
    engine = make_engine(kiln_plugins, device="cpu_triton", **common)
    mixtures = [m for m in engine.executor.runner.model.modules() if hasattr(m, "load_expert")]
    assert mixtures and all(isinstance(m.w13, QuantizedExperts) and m.w13.float8 for m in mixtures)
    assert all(m.w2.qweight.dtype == torch.float8_e4m3fn for m in mixtures)
    assert run_greedy(engine, prompts) == run_greedy(make_engine(kiln_plugins, device="cpu", **common), prompts)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the interpreter path on CPU")
def test_a_16_bit_part_of_a_fused_fp8_layer_is_rounded_to_fp8(tiny_model_dir, kiln_plugins, tmp_path, caplog):
    """An fp8 checkpoint that left k_proj in 16 bits without listing it: on the Triton platform the
    merged q/k/v still loads in fp8, k's rows rounded per row (with a warning), q's and v's as stored."""
    from safetensors.torch import load_file, save_file

    import kiln_cpu.plugin
    import kiln_cuda.plugin
    from kiln.testing.engine import make_engine, run_greedy
    from kiln.testing.quantization import fp8_copy

    for module, name in ((kiln_cpu.plugin, "cpu"), (kiln_cuda.plugin, "cuda"), (sys.modules[__name__], "test")):
        kiln_plugins.register(module, name=name)
    source = tiny_model_dir("llama")
    folder, widened = fp8_copy(source, tmp_path / "fp8", FP8_CHANNELS)
    tensors, original = load_file(str(folder / "model.safetensors")), load_file(str(Path(source) / "model.safetensors"))
    k = "model.layers.0.self_attn.k_proj"
    tensors[f"{k}.weight"] = original[f"{k}.weight"].bfloat16()
    del tensors[f"{k}.weight_scale"]
    save_file(tensors, str(folder / "model.safetensors"))
    engine = make_engine(kiln_plugins, device="cpu_triton", model=str(folder), dtype="float32", block_size=16)
    assert "k_proj.weight: torch.bfloat16 in an fp8 checkpoint" in caplog.text
    qkv = engine.executor.runner.model.layers[0].self_attn.qkv_proj
    assert qkv.qweight.dtype == torch.float8_e4m3fn
    rows = load_file(str(widened / "model.safetensors"))
    weight = qkv.qweight.T.float() * qkv.qscale.T  # the Triton method's (in, out) fp8, (1, out) scales
    q_rows = rows["model.layers.0.self_attn.q_proj.weight"].shape[0]
    torch.testing.assert_close(weight[:q_rows], rows["model.layers.0.self_attn.q_proj.weight"], rtol=0, atol=0)
    k_bf16 = original[f"{k}.weight"].bfloat16().float()
    k_rows = weight[q_rows : q_rows + k_bf16.shape[0]]
    assert not torch.equal(k_rows, k_bf16)  # rounded to fp8 ...
    torch.testing.assert_close(k_rows, k_bf16, rtol=0.07, atol=1e-3)  # ... per row (e4m3: 3 mantissa bits)
    v_rows = rows["model.layers.0.self_attn.v_proj.weight"]
    torch.testing.assert_close(weight[q_rows + k_bf16.shape[0] :], v_rows, rtol=0, atol=0)
    assert len(run_greedy(engine, [[1000, 7, 9]])[0]) == 8


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the interpreter path on CPU")
@pytest.mark.parametrize(
    "model_type",
    ["phi3", "glm", "glm4", "gemma", "gemma2", "gemma3_text", "ministral", "mixtral", "qwen2_moe", "qwen3_moe",
     "deepseek_v2"],
)  # fmt: skip
def test_model_families_through_triton_kernels_match_the_cpu_plugin(tiny_model_dir, kiln_plugins, model_type):
    """GLM-4's reordered partial rotary, Gemma 2's soft caps (low enough to bite on tiny logits),
    Gemma 3's windowed layer, q/k norms and two ropes,
    Qwen2-MoE's experts through the grouped-GEMM kernel and DeepSeek-V2's latent attention, on the
    Triton kernels
    (tests/core/test_dense_families.py and test_moe.py match the CPU plugin to transformers)."""
    import kiln_cpu.plugin
    import kiln_cuda.plugin
    from kiln.testing.engine import greedy_tokens

    for module, name in ((kiln_cpu.plugin, "cpu"), (kiln_cuda.plugin, "cuda"), (sys.modules[__name__], "test")):
        kiln_plugins.register(module, name=name)
    prompts = [[1000, 7, 9], list(range(100, 119))]
    caps = dict(attn_logit_softcapping=0.5, final_logit_softcapping=5.0) if model_type == "gemma2" else {}
    common = dict(model=tiny_model_dir(model_type, **caps), dtype="float32", block_size=16)
    assert greedy_tokens(kiln_plugins, prompts, 8, device="cpu_triton", **common) == greedy_tokens(
        kiln_plugins, prompts, 8, device="cpu", **common
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the interpreter path on CPU")
def test_drafts_verify_through_triton_kernels_as_on_the_cpu_plugin(tiny_model_dir, kiln_plugins, tmp_path):
    """Speculative decoding: each step's drafts run as decode rows through the Triton attention
    kernels and are accepted or rejected as on the CPU plugin."""
    import kiln_cpu.plugin
    import kiln_cuda.plugin
    from kiln.testing.engine import greedy_tokens
    from kiln.testing.spec_decode import build_eagle3_head, build_eagle_head, greedy_with_proposals, replayed_greedy

    for module, name in ((kiln_cpu.plugin, "cpu"), (kiln_cuda.plugin, "cuda"), (sys.modules[__name__], "test")):
        kiln_plugins.register(module, name=name)
    prompts = [[1000, 7, 9], list(range(100, 119))]
    common = dict(model=tiny_model_dir("llama"), dtype="float32", block_size=16)
    reference, got, engine = replayed_greedy(kiln_plugins, prompts, 8, device="cpu_triton", **common)
    assert got == reference == greedy_tokens(kiln_plugins, prompts, 8, device="cpu", **common)
    stats = engine.core.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    # A draft model (its own cache over the same blocks) on the same kernels.
    draft = {"method": "draft_model", "model": tiny_model_dir("llama", rope_theta=300.0), "num_speculative_tokens": 3}
    assert greedy_tokens(kiln_plugins, prompts, 8, device="cpu_triton", speculative_config=draft, **common) == got
    # An EAGLE head (reading the target's hidden states) on the same kernels.
    head, _ = build_eagle_head(common["model"], tmp_path / "eagle")
    eagle = {"method": "eagle", "model": head, "num_speculative_tokens": 3}
    assert greedy_tokens(kiln_plugins, prompts, 8, device="cpu_triton", speculative_config=eagle, **common) == got
    # An EAGLE-3 head (reading three layers' inputs) on the same kernels: the CPU plugin's drafts too.
    deeper = dict(common, model=tiny_model_dir("llama", num_hidden_layers=3))
    head, _ = build_eagle3_head(deeper["model"], tmp_path / "eagle3", draft_vocab_size=500, layer_ids=[0, 1, 2])
    eagle3 = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    on_cpu = greedy_with_proposals(kiln_plugins, prompts, 8, device="cpu", speculative_config=eagle3, **deeper)
    on_triton = greedy_with_proposals(
        kiln_plugins, prompts, 8, device="cpu_triton", speculative_config=eagle3, **deeper
    )
    assert on_triton == on_cpu and on_cpu[0] == greedy_tokens(kiln_plugins, prompts, 8, device="cpu", **deeper)
    assert len(on_cpu[1]) > len(prompts)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the interpreter path on CPU")
def test_beam_search_through_triton_kernels_matches_the_cpu_plugin(tiny_model_dir, kiln_plugins):
    """Forked beams decode on shared blocks, and their partial blocks are copied, in the
    Triton backend's cache as in the CPU plugin's."""
    import kiln_cpu.plugin
    import kiln_cuda.plugin
    from kiln.testing.engine import make_engine, run_beam_search

    for module, name in ((kiln_cpu.plugin, "cpu"), (kiln_cuda.plugin, "cuda"), (sys.modules[__name__], "test")):
        kiln_plugins.register(module, name=name)
    prompts = [list(range(100, 119))]  # a block and a tail: every fork copies the partial block
    common = dict(model=tiny_model_dir("llama"), dtype="float32", block_size=16)
    beams = {
        device: run_beam_search(make_engine(kiln_plugins, device=device, **common), prompts, 2, 4, ignore_eos=True)
        for device in ("cpu_triton", "cpu")
    }
    assert [[t for t, _ in b] for b in beams["cpu_triton"]] == [[t for t, _ in b] for b in beams["cpu"]]
    assert [lp for _, lp in beams["cpu_triton"][0]] == pytest.approx([lp for _, lp in beams["cpu"][0]], abs=1e-3)
