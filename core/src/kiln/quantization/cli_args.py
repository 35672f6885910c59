"""``kiln quantize``'s flags (no torch: ``kiln --help`` stays fast)."""

from __future__ import annotations

import argparse

QUANT_TYPES = ("weight_only_int8", "smooth_quant", "awq", "gptq")
HELP = (
    "Quantize a model's linear layers (weight-only int8, SmoothQuant W8A8, AWQ or GPTQ 4-bit) and write a "
    "checkpoint that Kiln and vLLM serve (compressed-tensors, AutoAWQ or AutoGPTQ layout)."
)


def add_quantize_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input", required=True, help="the model: a Hugging Face folder or a .gguf file")
    parser.add_argument("-o", "--output", required=True, help="folder to write the quantized model to")
    parser.add_argument("-quant_type", "--quant-type", dest="quant_type", required=True, choices=QUANT_TYPES)
    parser.add_argument(
        "-tp",
        "--tp",
        type=int,
        default=1,
        help="devices the model will be served on: checked to divide its heads and groups (Kiln splits weights at load, so nothing is pre-sharded)",
    )
    parser.add_argument("-t", "--dtype", dest="dtype", choices=("fp16", "bf16", "fp32"), default="bf16",
                        help="storage dtype of the parts left unquantized (default bf16)")  # fmt: skip
    parser.add_argument("-sq", "--smoothquant-alpha", dest="alpha", type=float, default=0.8,
                        help="SmoothQuant migration strength in [0, 1] (Llama: 0.8)")  # fmt: skip
    parser.add_argument("-token", "--tokenids-path", dest="token_file", default=None,
                        help="calibration token ids: one sample per line, ids separated by spaces or commas")  # fmt: skip
    parser.add_argument("--multi-query-mode", action="store_true",
                        help="the model shares key/value heads (checked against its config)")  # fmt: skip
    parser.add_argument("--group-size", type=int, default=128, help="inputs per scale for awq/gptq (default 128)")
    parser.add_argument("--act-order", action="store_true", help="gptq: quantize columns by Hessian order (g_idx)")
    parser.add_argument("--static-groups", action="store_true",
                        help="gptq: each group's grid fixed from the unquantized weights before any column is "
                        "quantized (AutoGPTQ's static_groups); with --act-order the groups keep column order, "
                        "so the checkpoint serves at any -tp and on kernels without act-order")  # fmt: skip
    parser.add_argument("--sym", action=argparse.BooleanOptionalAction, default=True,
                        help="gptq: symmetric grid (AutoGPTQ's default; vLLM's Marlin kernels need it); "
                        "--no-sym adds zero points")  # fmt: skip
    parser.add_argument("--num-calibration-samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per calibration sample")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    parser.add_argument("--seed", type=int, default=0)
