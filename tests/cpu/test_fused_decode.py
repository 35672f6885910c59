"""Decode steps through one C call per layer (``kiln_cpu.fused_decode``): the same tokens and
log-probs, bit for bit, as the layers' Python forward, which still runs every other step."""

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.models.llama import LlamaDecoderLayer
from kiln.models.moe import MoEDecoderLayer
from kiln_cpu import native, packed_linear
from kiln_cpu.fused_decode import FusedDecodeLayer, FusedDecodeStack, FusedMoEDecodeLayer

pytestmark = pytest.mark.skipif(native.load_kernels() is None, reason="no C compiler for the CPU kernels")


def run(model: str, prompts: list[list[int]], loras=None, **engine_args) -> list[tuple[list[int], list[float]]]:
    llm = LLM(model, max_model_len=256, **engine_args)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]  # fmt: skip


def layer_types(model: str, **engine_args) -> set[type]:
    layers = LLM(model, max_model_len=256, **engine_args).engine.executor.runner.model.layers
    return {type(layer) for layer in layers}


CASES = {
    "llama": ("llama", {}, {}),
    "llama, bf16 K/V, chunked prefills": ("llama", {}, {"kv_cache_dtype": "bfloat16", "max_num_batched_tokens": 16}),
    "mistral, sliding window": ("mistral", {"sliding_window": 8}, {}),
    "qwen3, q/k norms": ("qwen3", {}, {}),
    "qwen3, q/k norms, bf16 K/V": ("qwen3", {}, {"kv_cache_dtype": "bfloat16"}),
}


def check_fused_equals_python(
    model: str, prompts, monkeypatch, fused_type=FusedDecodeLayer, python_type=LlamaDecoderLayer, **engine_args
) -> None:
    python_calls = []
    forward = LlamaDecoderLayer.forward

    def counted(self, *args):
        python_calls.append(args[-1].attn_metadata.prefills != [])  # args: positions, x, residual, rope, ctx
        return forward(self, *args)

    with monkeypatch.context() as patch:
        patch.setattr(LlamaDecoderLayer, "forward", counted)
        assert layer_types(model, **engine_args) == {fused_type}
        fused = run(model, prompts, **engine_args)
        assert python_calls and all(python_calls)  # the Python forward ran the steps with prefills only
        patch.setenv("KILN_CPU_FUSED_DECODE", "0")
        assert layer_types(model, **engine_args) == {python_type}
        assert run(model, prompts, **engine_args) == fused


@pytest.mark.parametrize("case", CASES)
def test_fused_steps_match_the_python_forward(case, tiny_model_dir, varied_prompts, monkeypatch):
    model_type, overrides, engine_args = CASES[case]
    model = tiny_model_dir(model_type, **overrides)  # fp32: with AMX, auto would be bf16
    check_fused_equals_python(model, varied_prompts, monkeypatch, dtype="float32", **engine_args)


def test_one_call_for_every_layer_matches_a_call_a_layer(tiny_model_dir, varied_prompts, monkeypatch):
    """With every layer fused, a decode step runs them all in one C call (``FusedDecodeStack``):
    the same tokens and log-probs, bit for bit, as a C call a layer. Steps with prefills go layer
    by layer, and a model of fused MoE layers has no stack."""
    # no prefix caching: the second run's prefills must compute what the first run's did
    llm = LLM(tiny_model_dir("llama"), max_model_len=256, dtype="float32", enable_prefix_caching=False)
    model = llm.engine.executor.runner.model
    assert isinstance(model.decode_stack, FusedDecodeStack)
    layer_calls, stack_calls = [], []
    run_in_c, stack_call = FusedDecodeLayer._run_in_c, FusedDecodeStack.__call__
    monkeypatch.setattr(FusedDecodeLayer, "_run_in_c", lambda self, *a: layer_calls.append(1) or run_in_c(self, *a))
    monkeypatch.setattr(
        FusedDecodeStack, "__call__", lambda self, *a: stack_calls.append(stack_call(self, *a)) or stack_calls[-1]
    )
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in varied_prompts]

    def outputs() -> list:
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]

    stacked = outputs()
    assert not layer_calls and any(out is not None for out in stack_calls)  # decode steps: the stack alone
    assert any(out is None for out in stack_calls)  # steps with prefills: layer by layer, in Python
    model.decode_stack = None
    assert outputs() == stacked
    assert layer_calls
    if packed_linear.kernel_works():  # else its layers keep the Python forward
        moe = LLM(tiny_model_dir("mixtral", hidden_size=256, intermediate_size=96), max_model_len=256, dtype="bfloat16")
        moe_model = moe.engine.executor.runner.model
        assert {type(layer) for layer in moe_model.layers} == {FusedMoEDecodeLayer}
        assert moe_model.decode_stack is None


QUANTIZED = {  # kiln quantize arguments, environment
    "awq": (("awq",), {}),
    "gptq, act-order": (("gptq", "--act-order", "--no-sym"), {}),
    "smooth_quant": (("smooth_quant", "-sq", "0.5"), {}),
    "weight_only_int8, fp32 activations": (("weight_only_int8",), {"KILN_CPU_INT8_ACTIVATIONS": "0"}),
}


@pytest.mark.parametrize("case", QUANTIZED)
def test_quantized_layers_fuse_too(case, tiny_model_dir, tmp_path, varied_prompts, monkeypatch):
    """Checkpoints of ``kiln quantize`` run their tiled layers in the C layer too (act-order
    reads its inputs permuted)."""
    from tests.quantization.test_quantize_tool import quantize

    args, env = QUANTIZED[case]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    model = quantize(tiny_model_dir("llama"), str(tmp_path / "q"), *args)
    check_fused_equals_python(model, varied_prompts, monkeypatch)


def test_default_model_int8_path(varied_prompts, monkeypatch):
    from kiln.models.loader import default_model_path

    fused = run(default_model_path(), varied_prompts[:4])
    monkeypatch.setenv("KILN_CPU_FUSED_DECODE", "0")
    assert run(default_model_path(), varied_prompts[:4]) == fused


@pytest.mark.skipif(not packed_linear.kernel_works(), reason="the bf16 linear kernel does not run on this CPU")
@pytest.mark.parametrize(
    ("model_type", "overrides", "engine_args"),
    [
        ("mixtral", {}, {}),
        ("mixtral", {}, {"max_num_batched_tokens": 16}),
        ("mixtral", {"sliding_window": 8}, {}),
        ("qwen3_moe", {"head_dim": 64}, {}),
        # every layer sparse, and a shared expert whose width the bf16 kernel steps through
        ("qwen2_moe", {"mlp_only_layers": [], "shared_expert_intermediate_size": 64}, {}),
    ],
    ids=["", "chunked prefills", "sliding window", "qwen3_moe, q/k norms", "qwen2_moe, shared expert"],
)
def test_bf16_moe_steps_match_the_python_forward(
    model_type, overrides, engine_args, tiny_model_dir, varied_prompts, monkeypatch
):
    """bf16 Mixtral, Qwen3-MoE and Qwen2-MoE layers (Bf16Linear projections, router and shared
    expert, the C route and experts, a bf16 cache) run decode steps in one C call each, bit for bit."""
    # head size 64: the C attention's
    model = tiny_model_dir(model_type, hidden_size=256, intermediate_size=96, **overrides)
    check_fused_equals_python(
        model, varied_prompts, monkeypatch, FusedMoEDecodeLayer, MoEDecoderLayer, dtype="bfloat16", **engine_args
    )


def test_layers_it_cannot_run_keep_their_python_forward(tiny_model_dir):
    assert layer_types(tiny_model_dir("llama"), dtype="bfloat16") == {LlamaDecoderLayer}  # bf16 dense layers
    assert layer_types(tiny_model_dir("gemma3_text")).isdisjoint({FusedDecodeLayer})  # its own forward
    wide = dict(hidden_size=256, intermediate_size=96)  # else the C attention's head sizes: as in the test above
    # a shared expert 40 wide, which the bf16 linear kernel cannot step through (16 or 32 values a step)
    narrow = tiny_model_dir("qwen2_moe", **wide, shared_expert_intermediate_size=40)
    assert FusedMoEDecodeLayer not in layer_types(narrow, dtype="bfloat16")
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize("lora_dtype", ["float32", "bfloat16"])
def test_lora_decode_steps_match_the_python_forward(tiny_model_dir, tmp_path, varied_prompts, monkeypatch, lora_dtype):
    from kiln import LoRARequest
    from kiln.testing.lora import build_lora_adapter

    model = tiny_model_dir("llama")
    adapters = [LoRARequest(f"a{i}", i + 1, build_lora_adapter(model, tmp_path / f"a{i}", seed=i)) for i in range(2)]
    loras = [adapters[0], None, adapters[1], adapters[0], None]  # one per prompt
    flags = dict(enable_lora=True, max_loras=2, max_lora_rank=8, lora_dtype=lora_dtype, dtype="float32")
    python_calls = []
    forward = LlamaDecoderLayer.forward

    def counted(self, *args):
        python_calls.append(args[-1].attn_metadata.prefills != [])
        return forward(self, *args)

    monkeypatch.setattr(LlamaDecoderLayer, "forward", counted)
    fused = run(model, varied_prompts, loras, **flags)
    assert python_calls and all(python_calls)  # decode steps with adapters ran in C
    monkeypatch.setenv("KILN_CPU_FUSED_DECODE", "0")
    assert run(model, varied_prompts, loras, **flags) == fused
    assert run(model, varied_prompts, **flags) != fused  # the adapters change the output
