"""Engine flags: defaults, and errors that name the flag."""

from __future__ import annotations

import pytest

from kiln import LLM
from kiln.config import EngineConfig


def test_defaults_follow_vllm():
    c = EngineConfig.create()
    assert (c.max_num_seqs, c.gpu_memory_utilization, c.kv_cache_ratio, c.max_logprobs) == (256, 0.9, 0.75, 20)
    assert c.scheduling_policy == "fcfs" and c.enable_prefix_caching and c.dtype == "auto"


@pytest.mark.parametrize(
    "kwargs,flag",
    [
        (dict(block_size=48), "--block-size"),
        (dict(dtype="int8"), "--dtype"),
        (dict(gpu_memory_utilization=1.5), "--gpu-memory-utilization"),
        (dict(max_num_seqs=0), "--max-num-seqs"),
        (dict(scheduling_policy="lifo"), "--scheduling-policy"),
        (dict(load_format="npcache"), "--load-format"),
        (dict(kv_cache_ratio=0), "--kv-cache-ratio"),
        (dict(num_gpu_blocks_override=0), "--num-gpu-blocks-override"),
        (dict(no_such_flag=1), "--no-such-flag"),
    ],
)
def test_bad_values_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        EngineConfig.create(**kwargs)


def test_block_size_the_platform_does_not_support(tiny_model_dir):
    with pytest.raises(ValueError, match="--block-size: 256 is not supported on cpu"):
        LLM(tiny_model_dir("llama"), block_size=256)


def test_max_model_len_beyond_the_model(tiny_model_dir):
    with pytest.raises(ValueError, match="--max-model-len"):
        LLM(tiny_model_dir("llama"), max_model_len=10**6)


def test_kv_cache_too_small_for_one_sequence(tiny_model_dir):
    with pytest.raises(ValueError, match="--max-model-len"):
        LLM(tiny_model_dir("llama"), max_model_len=512, num_gpu_blocks_override=4, block_size=16)


def test_dtype_and_derived_values(tiny_model_dir):
    import torch

    llm = LLM(tiny_model_dir("llama"), dtype="bfloat16", max_model_len=128)
    assert llm.engine.dtype is torch.bfloat16
    assert llm.engine.config.block_size == 32 and llm.engine.config.max_num_batched_tokens == 2048
    out = llm.generate("Hello", None)[0]
    assert out.outputs[0].token_ids
    from kiln_cpu.native import has_amx_bf16

    auto = LLM(tiny_model_dir("llama"), max_model_len=128).engine.dtype
    assert auto is (torch.bfloat16 if has_amx_bf16() else torch.float32)


@pytest.mark.parametrize("quantization", [None, "weight_only_int8"])
def test_auto_dtype_keeps_a_bf16_checkpoint_in_bf16_where_the_cpu_multiplies_bf16(
    quantization, tiny_model_dir, tmp_path
):
    """With AMX, or AVX512-BF16 whose bf16 products outrun fp32 FMAs, ``auto`` serves a bf16
    checkpoint in bf16, but a quantized model in fp32, as everywhere (its layers' products take
    fp32 activations)."""
    import json
    import shutil

    import torch

    from kiln_cpu.native import bf16_dots_outrun_fma, has_amx_bf16
    from kiln_cpu.packed_linear import kernel_works

    folder = tmp_path / "bf16"
    shutil.copytree(tiny_model_dir("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    llm = LLM(str(folder), max_model_len=128, quantization=quantization)
    bf16 = quantization is None and (has_amx_bf16() or (kernel_works() and bf16_dots_outrun_fma()))
    assert llm.engine.dtype is (torch.bfloat16 if bf16 else torch.float32)
    assert llm.generate("Hello", None)[0].outputs[0].token_ids


def test_dummy_weights_need_no_checkpoint(tiny_model_dir, tmp_path):
    import shutil

    folder = tmp_path / "config-only"
    shutil.copytree(tiny_model_dir("qwen3"), folder, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(folder))
    llm = LLM(str(folder), load_format="dummy", max_model_len=128)
    assert len(llm.generate("Hi")[0].outputs[0].token_ids) > 0


@pytest.mark.parametrize(
    "value, limits",
    [('{"image": 0, "video": 0}', {"image": 0, "video": 0}), ("image=0", {"image": 0}),
     ({"video": {"count": 0, "num_frames": 8}}, {"video": 0})],
)  # fmt: skip
def test_media_limits_of_zero_are_text_only(value, limits):
    """``--limit-mm-per-prompt`` as vLLM users pass it to serve a multimodal release as text."""
    assert EngineConfig.create(limit_mm_per_prompt=value).limit_mm_per_prompt == limits


def test_a_text_model_serves_with_media_limits_of_zero(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), dtype="float32", limit_mm_per_prompt='{"image": 0}')
    assert len(llm.generate([[5, 6, 7]])[0].outputs[0].token_ids) > 0


@pytest.mark.parametrize(
    "value, message",
    [('{"image": 2}', "Kiln serves text only \\('image' inputs"), ("image=1,video=0", "'image' inputs"),
     ({"video": {"count": 1}}, "'video' inputs"), ("images", "give a JSON object")],
)  # fmt: skip
def test_media_limits_above_zero_are_refused(value, message):
    with pytest.raises(ValueError, match=f"--limit-mm-per-prompt: .*{message}"):
        EngineConfig.create(limit_mm_per_prompt=value)
