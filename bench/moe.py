"""Mixture-of-experts throughput: Kiln versus Hugging Face ``generate`` on a random MoE, in one run.

Workload (issue 22): a Mixtral-style model with random weights (8 experts, 2 per token, hidden
512, 4 layers, the default model's tokenizer), 64 prompts of 128 random tokens, 128 new tokens
each, greedy: Kiln at concurrency 16 (``--max-num-seqs 16``) against transformers in static
batches of 16, each system in its own process (``offline_throughput.py`` runs them), Kiln in
the CPU's default dtype and in bf16, transformers in fp32 and bf16. Target: Kiln >= 3x the
faster transformers dtype's output tokens/s.

    python bench/moe.py [--repeats 3] [--systems kiln-16seqs,kiln-16seqs-bf16,hf-float32,hf-bfloat16]

Prints a table and writes ``bench/results/moe.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import offline_throughput

MODEL = Path.home() / ".cache" / "kiln" / "bench-models" / "mixtral-8x2-h512"
CONFIG = dict(
    hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
    head_dim=64, num_local_experts=8, num_experts_per_tok=2, initializer_range=0.02,
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1, help="best of N runs per system")
    parser.add_argument("--systems", default="kiln-16seqs,kiln-16seqs-bf16,hf-float32,hf-bfloat16")
    args = parser.parse_args()
    from kiln.models.loader import resolve_model
    from kiln.testing.models import build_tiny_model

    model = build_tiny_model("mixtral", MODEL, resolve_model(None, "auto").path, **CONFIG)
    offline_throughput.main([
        "--model", model, "--input-len", "128", "--systems", args.systems, "--repeats", str(args.repeats),
        "--target", "3", "--no-memory-target", "--results", str(Path(__file__).parent / "results" / "moe.json"),
    ])  # fmt: skip


if __name__ == "__main__":
    main()
