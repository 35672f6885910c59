"""Mixture-of-experts throughput: Kiln versus Hugging Face ``generate`` on a random MoE, in one run.

Workload (issue 22): a Mixtral-style model with random weights (8 experts, 2 per token, hidden
512, 4 layers, the default model's tokenizer), 64 prompts of 128 random tokens, 128 new tokens
each, greedy: Kiln at concurrency 16 (``--max-num-seqs 16``) against transformers in static
batches of 16, each system in its own process (``offline_throughput.py`` runs them), Kiln in
the CPU's default dtype and in bf16, transformers in fp32 and bf16. Target: Kiln >= 3x the
faster transformers dtype's output tokens/s.

Then Kiln alone (transformers reads neither format without extra packages) on copies of the
model with every projection rounded to nearest (``--quantized``: int8 per channel as
compressed-tensors, AWQ 4-bit in groups of 128, or a GGUF file as llama.cpp lays Mixtral out,
``gguf-q4_0`` / ``gguf-q8_0``), in the CPU's default dtype: the experts held as integer tiles and
multiplied with int8 activations.

    python bench/moe.py [--repeats 3] [--systems kiln-16seqs,kiln-16seqs-bf16,hf-float32,hf-bfloat16]
                        [--quantized weight_only_int8,awq,gguf-q4_0]

Prints a table each and writes ``bench/results/moe.json`` (and ``moe_<method>.json``).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import offline_throughput

MODEL = Path.home() / ".cache" / "kiln" / "bench-models" / "mixtral-8x2-h512"
CONFIG = dict(
    hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
    head_dim=64, num_local_experts=8, num_experts_per_tok=2, initializer_range=0.02,
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every system (offline_throughput.py)")
    parser.add_argument("--systems", default="kiln-16seqs,kiln-16seqs-bf16,hf-float32,hf-bfloat16")
    parser.add_argument(
        "--quantized", default="weight_only_int8,awq,gguf-q4_0", help="quantized copies to serve ('' for none)"
    )
    args = parser.parse_args()
    from kiln.models.loader import resolve_model
    from kiln.testing.models import build_tiny_model, hf_as_gguf
    from kiln.testing.quantization import rounded_copy

    model = build_tiny_model("mixtral", MODEL, resolve_model(None, "auto").path, **CONFIG)
    results = Path(__file__).parent / "results"
    offline_throughput.main([
        "--model", model, "--input-len", "128", "--systems", args.systems, "--repeats", str(args.repeats),
        "--target", "3", "--no-memory-target", "--results", str(results / "moe.json"),
    ])  # fmt: skip
    for method in filter(None, args.quantized.split(",")):
        folder = MODEL.parent / f"{MODEL.name}-{method}"
        gguf = method.startswith("gguf-")
        quantized = folder / (f"model.{method[5:].upper()}.gguf" if gguf else "q")
        if not (quantized if gguf else quantized / "config.json").exists():
            shutil.rmtree(folder, ignore_errors=True)  # a copy cut short
            if gguf:
                folder.mkdir(parents=True)
                hf_as_gguf(model, str(folder / "partial.gguf"), "llama", method[5:].upper())
                (folder / "partial.gguf").rename(quantized)
            else:
                rounded_copy(model, folder, method, group=128)
        print(f"\n{method} copy: {quantized}")
        offline_throughput.main([
            "--model", str(quantized), "--input-len", "128", "--systems", "kiln-16seqs", "--repeats",
            str(args.repeats), "--no-memory-target", "--results", str(results / f"moe_{method}.json"),
        ])  # fmt: skip


if __name__ == "__main__":
    main()
