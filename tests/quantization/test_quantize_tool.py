"""``kiln quantize`` on tiny random models: what it writes loads in Kiln and computes exactly
the dequantized weights, and bad input is a clear error with a non-zero exit."""

import json
import os

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.cli import main
from kiln.interfaces.quantization import ReferenceLinearMethod
from kiln.testing.models import hf_greedy
from kiln.testing.quantization import dequantized_copy

FAST = ["--num-calibration-samples", "4", "--seq-len", "32", "--group-size", "32", "-t", "fp32"]
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [400, 17, 9000, 23], [30, 31, 32]]


def quantize(src: str, out: str, quant_type: str, *extra: str) -> str:
    assert main(["quantize", "-i", src, "-o", out, "-quant_type", quant_type, *FAST, *extra]) == 0
    return out


def kiln_greedy(path: str, **kwargs) -> list[list[int]]:
    llm = LLM(path, max_model_len=128, **kwargs)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


@pytest.mark.parametrize(
    "model_type,quant_type,extra",
    [
        ("llama", "weight_only_int8", ()),
        ("llama", "awq", ()),
        ("qwen2", "awq", ()),  # qkv bias, tied embeddings
        ("llama", "gptq", ()),
        ("mistral", "gptq", ("--act-order", "--no-sym")),
        ("llama", "gptq", ("--act-order", "--static-groups", "--no-sym")),
        ("gemma2", "weight_only_int8", ()),  # (1 + weight) norms around each sublayer, GeGLU, tied head
        ("gemma3_text", "gptq", ("--act-order", "--static-groups", "--no-sym")),  # a rope per layer type
    ],
)
def test_weight_only_checkpoint_matches_its_dequantized_weights(
    tiny_model_dir, tmp_path, monkeypatch, model_type, quant_type, extra
):
    """On the CPU plugin's exact path (fp32 activations; its default rounds them to int8, which
    tests/cpu/test_quant_methods.py and the accuracy tests check)."""
    monkeypatch.setenv("KILN_CPU_INT8_ACTIVATIONS", "0")
    src = tiny_model_dir(model_type)
    out = quantize(src, str(tmp_path / "q"), quant_type, *extra)
    config = json.loads(open(os.path.join(out, "config.json")).read())
    assert config["quantization_config"]["quant_method"] == (
        "compressed-tensors" if quant_type.startswith("w") else quant_type
    )
    if quant_type == "gptq":  # static groups keep g_idx in column order, whatever order quantized them
        qc = config["quantization_config"]
        assert (qc["desc_act"], qc["static_groups"]) == ("--static-groups" not in extra and "--act-order" in extra,
                                                         "--static-groups" in extra)  # fmt: skip
    reference = hf_greedy(dequantized_copy(out, src, str(tmp_path / "deq")), PROMPTS, 12)
    assert kiln_greedy(out) == reference


def test_smoothquant_w8a8_runs_the_cpu_int8_gemm_like_the_reference(tiny_model_dir, tmp_path, monkeypatch):
    """W8A8 quantizes activations, so it is checked against the reference method on the same checkpoint."""
    out = quantize(tiny_model_dir("llama"), str(tmp_path / "sq"), "smooth_quant", "-sq", "0.5")
    fast = kiln_greedy(out)
    from kiln_cpu.platform import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "linear_method", lambda self, scheme: ReferenceLinearMethod())
    assert kiln_greedy(out) == fast
    assert len(fast) == 3 and all(len(t) == 12 for t in fast)


def test_online_weight_only_int8_equals_the_tools_checkpoint(tiny_model_dir, tmp_path):
    """``--quantization weight_only_int8`` on an unquantized model rounds as the tool does."""
    src = tiny_model_dir("llama")
    out = quantize(src, str(tmp_path / "w8"), "weight_only_int8")
    assert kiln_greedy(src, quantization="weight_only_int8") == kiln_greedy(out)


def test_token_file_calibration(tiny_model_dir, tmp_path):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("\n".join(" ".join(str(t) for t in range(i, i + 40)) for i in range(1, 300, 40)))
    out = quantize(tiny_model_dir("llama"), str(tmp_path / "q"), "gptq", "-token", str(tokens))
    record = json.loads(open(os.path.join(out, "kiln_quantize.json")).read())
    assert record["calibration"] == str(tokens) and record["group_size"] == 32


@pytest.mark.parametrize(
    "args,message",
    [
        (["-tp", "3"], "-tp: 3 does not divide the model's attention heads"),
        (["-sq", "1.5"], "-sq: 1.5 is outside"),
        (["-token", "/nonexistent/tokens.txt"], "-token: cannot read"),
        (["--group-size", "48"], "--group-size: 48 does not divide"),
        (
            ["--act-order", "--group-size", "32"],
            "--act-order, --static-groups and --no-sym apply to -quant_type gptq only",
        ),
        (["--static-groups", "--group-size", "32"], "--static-groups and --no-sym apply to -quant_type gptq only"),
    ],
)
def test_bad_arguments_exit_non_zero_and_write_nothing(tiny_model_dir, tmp_path, capsys, args, message):
    quant_type = "awq" if "--group-size" in args else "smooth_quant"
    out = tmp_path / "out"
    assert main(["quantize", "-i", tiny_model_dir("llama"), "-o", str(out), "-quant_type", quant_type, *args]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and os.listdir(tmp_path) == []


def test_awq_and_smoothquant_refuse_gemma(tiny_model_dir, tmp_path, capsys):
    for quant_type in ("awq", "smooth_quant"):
        out = tmp_path / quant_type
        assert main(["quantize", "-i", tiny_model_dir("gemma2"), "-o", str(out), "-quant_type", quant_type, *FAST]) == 2
        assert "not into Gemma2ForCausalLM's (1 + weight) norms; gptq and weight_only_int8 apply" in (
            capsys.readouterr().err
        )
        assert not out.exists()


def test_calibration_runs_each_layer_as_the_model_does(tiny_model_dir):
    """Layer by layer, with each layer's own keyword arguments, the calibration passes reproduce the
    model's own forward: Gemma 3's sliding and full layers take different ropes and masks."""
    from transformers import AutoModelForCausalLM

    from kiln.quantization.tool import first_layer_inputs, run_layer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("gemma3_text"), dtype=torch.float32).eval()
    samples = torch.randint(0, 1000, (10, 24), generator=torch.Generator().manual_seed(0))  # two chunks
    outputs: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    handles = [
        layer.register_forward_hook(lambda m, a, out, i=i: outputs[i].append(out[0] if isinstance(out, tuple) else out))
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        for chunk in samples.split(8):
            model(chunk, use_cache=False)
    for handle in handles:
        handle.remove()
    hidden, kwargs = first_layer_inputs(model, samples)
    assert [len(h) for h in hidden] == [8, 2] and [len(k) for k in kwargs] == [2, 2]
    assert not torch.equal(kwargs[0][0]["position_embeddings"][0], kwargs[1][0]["position_embeddings"][0])
    for i, layer in enumerate(model.model.layers):
        hidden = run_layer(layer, hidden, kwargs[i])
        for got, expected in zip(hidden, outputs[i], strict=True):
            torch.testing.assert_close(got, expected)


def test_existing_output_needs_overwrite(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    assert main(["quantize", "-i", tiny_model_dir("llama"), "-o", str(out), "-quant_type", "weight_only_int8"]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert main(["quantize", "-i", tiny_model_dir("llama"), "-o", str(out), "-quant_type", "weight_only_int8",
                 "--overwrite"]) == 0  # fmt: skip
    assert (out / "model.safetensors").exists()


def test_bad_token_ids_and_unknown_architecture(tiny_model_dir, tmp_path, capsys):
    tokens = tmp_path / "t.txt"
    tokens.write_text("1 2 three\n")
    assert main(["quantize", "-i", tiny_model_dir("llama"), "-o", str(tmp_path / "o"), "-quant_type",
                 "smooth_quant", "-token", str(tokens)]) == 2  # fmt: skip
    assert "line 1 of" in capsys.readouterr().err
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    (other / "model.safetensors").write_bytes(b"")
    assert main(["quantize", "-i", str(other), "-o", str(tmp_path / "o"), "-quant_type", "awq"]) == 2
    assert "architecture ['GPT2LMHeadModel'] is not supported" in capsys.readouterr().err


def test_serving_a_method_the_device_cannot_run_is_a_startup_error(tiny_model_dir, tmp_path, monkeypatch):
    out = quantize(tiny_model_dir("llama"), str(tmp_path / "q"), "awq")
    from kiln_cpu.platform import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "linear_method", lambda self, scheme: None)
    with pytest.raises(ValueError, match="awq w4a16 .group 32, with zero points. cannot run on cpu"):
        LLM(out, max_model_len=128)
