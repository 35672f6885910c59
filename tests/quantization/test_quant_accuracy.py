"""Accuracy of each ``kiln quantize`` method on the default model's weights (its fp32 copy):
perplexity on a held-out text shipped with the tests, served by Kiln, against fp32."""

from pathlib import Path

import pytest

from kiln import LLM, SamplingParams
from kiln.cli import main
from kiln.quantization.evaluate import perplexity

HELDOUT = (Path(__file__).parent.parent / "data" / "heldout.txt").read_text()
CALIBRATION = ["--num-calibration-samples", "32", "--seq-len", "128"]
# method: (kiln quantize arguments, allowed perplexity increase over fp32)
# NOTE: the default model's 576-wide inputs fit groups of 32 or 64, not 128; and its weights
# are already 4-bit (GGUF Q4_1, whose offsets are not on an integer zero-point grid), so a
# second 4-bit rounding costs more than on a model trained in 16 bits. AWQ's scale search
# lands differently with each CPU's float kernels: +8.21 % on an AVX2-only EPYC, the same
# with the integer kernels of before and after that machine's rework.
METHODS = {
    "weight_only_int8": ([], 0.01),
    "smooth_quant": (CALIBRATION, 0.03),
    "awq": ([*CALIBRATION, "--group-size", "32"], 0.09),
    "gptq": ([*CALIBRATION, "--group-size", "32", "--act-order", "--static-groups", "--no-sym"], 0.08),
}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]


@pytest.fixture(scope="module")
def fp32_perplexity(default_model_dir):
    return perplexity(LLM(default_model_dir, max_model_len=512), HELDOUT)


@pytest.mark.parametrize("method", list(METHODS))
def test_perplexity_within_budget(default_model_dir, fp32_perplexity, tmp_path, method):
    args, budget = METHODS[method]
    out = str(tmp_path / method)
    assert main(["quantize", "-i", default_model_dir, "-o", out, "-quant_type", method, *args]) == 0
    llm = LLM(out, max_model_len=512)
    ppl = perplexity(llm, HELDOUT)
    continuations = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))
    report = [f"{method}: perplexity {ppl:.3f} vs fp32 {fp32_perplexity:.3f} ({ppl / fp32_perplexity - 1:+.2%})"]
    report += [f"  {prompt!r} -> {out.outputs[0].text!r}" for prompt, out in zip(PROMPTS, continuations)]
    print("\n".join(report))
    assert ppl <= fp32_perplexity * (1 + budget), "\n".join(report)
    assert ppl > fp32_perplexity * 0.95  # a different model would not land this close


def test_online_weight_only_int8(default_model_dir, fp32_perplexity):
    ppl = perplexity(LLM(default_model_dir, max_model_len=512, quantization="weight_only_int8"), HELDOUT)
    assert fp32_perplexity <= ppl * 1.002 and ppl <= fp32_perplexity * 1.01


def test_gguf_int8_activations(fp32_perplexity):
    """The default model's default path (Q4_1/Q8_0 blocks times int8 activations, llama.cpp's
    scheme) against the exact fp32 products of the same weights: issue 17's +2 % budget."""
    from kiln.models.loader import default_model_path

    ppl = perplexity(LLM(default_model_path(), max_model_len=512), HELDOUT)
    assert fp32_perplexity < ppl <= fp32_perplexity * 1.02
