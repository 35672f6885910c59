"""The CUDA plugin's mixture-of-experts kernels at Mixtral-8x7B's layer size, on a GPU.

One mixture layer (8 experts, 2 per token, hidden 4096, intermediate 14336), random weights, as
``kiln_cuda.ops.fused_experts`` runs it: the grouped GEMM over stacked bf16 experts, over AWQ
experts kept packed (4-bit codes, zero points, groups of 128), over weight-only int8 experts (per
channel), over fp8 experts (float8 values, a scale per row and 128 inputs, as DeepSeek-V3's blocks
give) and over W8A8 experts (int8 rows per token), for batches of 1 to 512 tokens; and, as the
baseline, the core's reference ``fused_experts`` (a torch matmul per expert, cuBLAS). Each is timed
by ``triton.testing.do_bench`` (median of its repeats, after warm-up) with the tile shape the
plugin picks ("auto"), that tile without splitting K ("no-split": ``kiln_cuda.moe.gemm_split``
splits it where a GEMM has few tiles) and each tile shape given.

Reported: microseconds per layer, and the weights' bytes of the experts the batch routes to over
that time (GB/s; an H100/H200 reads 3-4.8 TB/s at best), so a format that reads fewer bytes should
show it at small batches, where the layer is bound by memory.

    python bench/moe_kernels.py [--tokens 1,16,64,512] [--tiles 16x64x64,32x64x128,...]

Prints a table and writes ``bench/results/moe_kernels_cuda.json``.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
import triton.testing

from kiln.interfaces import model as REFERENCE
from kiln_cuda import moe, ops

EXPERTS, TOP_K, HIDDEN, INTER, GROUP = 8, 2, 4096, 14336, 128


def bf16_experts(n: int, k: int) -> torch.Tensor:
    return torch.randn(EXPERTS, n, k, device="cuda", dtype=torch.bfloat16) * 0.02


def packed_experts(n: int, k: int, bits: int, group: int, zero: bool) -> moe.QuantizedExperts:
    words = k // (32 // bits)
    groups = k // group
    qweight = torch.randint(-(2**31), 2**31 - 1, (EXPERTS, words, n), device="cuda", dtype=torch.int32)
    scale = torch.rand(EXPERTS, groups, n, device="cuda") * 1e-3
    zeros = torch.randint(0, 2**bits, (EXPERTS, groups, n), device="cuda").float() if zero else None
    offset = float(2 ** (bits - 1))
    return moe.QuantizedExperts(qweight, scale, zeros, bits, group, offset, (EXPERTS, n, k))


def fp8_experts(n: int, k: int) -> moe.QuantizedExperts:
    values = (torch.randn(EXPERTS, k, n, device="cuda") * 64).to(torch.float8_e4m3fn)
    scale = torch.rand(EXPERTS, k // GROUP, n, device="cuda") * 1e-3
    return moe.QuantizedExperts(values, scale, None, 8, GROUP, 0.0, (EXPERTS, n, k), float8=True)


def int8_experts(n: int, k: int) -> moe.Int8Experts:
    weight = torch.randint(-127, 128, (EXPERTS, n, k), device="cuda", dtype=torch.int8)
    return moe.Int8Experts(weight, torch.rand(EXPERTS, n, device="cuda") * 1e-3, (EXPERTS, n, k))


def nbytes(w) -> int:
    parts = [w] if isinstance(w, torch.Tensor) else [getattr(w, f) for f in ("qweight", "weight", "scale", "zero")
                                                     if getattr(w, f, None) is not None]  # fmt: skip
    return sum(p.numel() * p.element_size() for p in parts)


FORMATS = {
    "bf16": lambda n, k: bf16_experts(n, k),
    "awq-4bit-g128": lambda n, k: packed_experts(n, k, 4, GROUP, zero=True),
    "int8-weight-only": lambda n, k: packed_experts(n, k, 8, k, zero=False),
    "fp8-block128": lambda n, k: fp8_experts(n, k),
    "w8a8": lambda n, k: int8_experts(n, k),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,16,64,512")
    parser.add_argument("--tiles", default="16x64x64,32x64x128,64x128x64",
                        help="BLOCK_MxBLOCK_NxBLOCK_K shapes of the grouped GEMM to time beside "
                             "kiln_cuda.moe.gemm_tile's choice ('auto'); BLOCK_K within a group")  # fmt: skip
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results" / "moe_kernels_cuda.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",") if t != "auto"]
    chosen, max_split = moe.gemm_tile, moe.MAX_SPLIT
    rows = []
    print(f"{torch.cuda.get_device_name()}, experts {EXPERTS} top-{TOP_K}, hidden {HIDDEN}, inter {INTER}")
    print(f"{'format':<18}{'tile':>12}{'tokens':>8}{'us':>10}{'GB/s':>8}")
    for name, make in FORMATS.items():
        w13, w2 = make(2 * INTER, HIDDEN), make(HIDDEN, INTER)
        per_expert = (nbytes(w13) + nbytes(w2)) / EXPERTS
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
            ids = torch.stack([torch.randperm(EXPERTS, device="cuda")[:TOP_K] for _ in range(tokens)])
            weights = torch.rand(tokens, TOP_K, device="cuda", dtype=torch.bfloat16)
            touched = per_expert * ids.unique().numel()
            layer = (x, w13, w2, weights, ids)
            forced = [("x".join(map(str, t)), lambda w, slots, t=t: (*t[:2], moe.group_k(w, t[2]))) for t in tiles]
            runs = [("auto", chosen), ("no-split", chosen), *forced]
            for label, tile in runs + ([("torch-loop", None)] if name == "bf16" else []):
                moe.gemm_tile = tile
                moe.MAX_SPLIT = 1 if label == "no-split" else max_split
                fn = partial(REFERENCE.fused_experts if tile is None else ops.fused_experts, *layer)
                try:
                    ms = triton.testing.do_bench(fn, warmup=25, rep=100)
                except Exception as err:  # a tile too large for the chip's shared memory
                    print(f"{name:<18}{label:>12}{tokens:>8}  failed: {type(err).__name__}: {str(err)[:80]}")
                    continue
                gbs = touched / (ms * 1e-3) / 1e9
                rows.append(dict(format=name, tile=label, tokens=tokens, us=ms * 1e3, gb_per_s=gbs))
                print(f"{name:<18}{label:>12}{tokens:>8}{ms * 1e3:>10.1f}{gbs:>8.0f}")
        del w13, w2
        torch.cuda.empty_cache()
    moe.gemm_tile, moe.MAX_SPLIT = chosen, max_split
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
