"""The CPU plugin's C kernels as one git revision builds them (A) against the work tree's (B), in
one process, on the same inputs.

End-to-end runs on this project's shared 2-core machines drift by 10-20 % from minute to minute,
more than most kernel changes gain, so old and new builds compared in separate runs say little.
Here both libraries are loaded side by side and each case is timed in rounds that alternate
A-then-B and B-then-A (whichever runs second was measured up to ~10 % slower), and every output
of B is compared with A's bit for bit.

Kernels (``--kernels``):

- ``linear``: the integer products (``csrc/int8_linear.c``) on the default model's own GGUF
  weights: layer 0's four projections (Q4_1) and the LM head (Q8_0), ``--rows`` rows of random
  activations each.
- ``wide``: the same on random Q4_1 weights of ``--wide`` shapes (outputs x inputs; by default a
  7B-class model's attention, up and down projections), for inputs wider than the default model's.
- ``attention``: decode attention (fp32 queries, bf16 cache, the default model's 9 query and 3
  K/V heads of 64) of ``--seqs`` requests of ~``--keys`` keys through 30 layers' caches, "cold"
  (a 100 MB sweep before each round, as a decode step's weights would leave the caches) and
  "hot" (one layer's cache 30 times).
- ``prefill``: fp32 prefill attention (``csrc/prefill_attention_f32.c``, the same heads) of 16
  fresh prompts of each of ``--prompt-lens`` tokens, one layer.
- ``bf16``: bf16 linear layers (``csrc/bf16_linear.c``: AMX tiles where the CPU has them, else
  vdpbf16ps or split bf16 words) on random weights of the default model's four projection shapes,
  30 layers of them (212 MB, from memory as a decode step reads them), ``--rows`` rows each.
- ``experts``: bf16 experts (``csrc/experts.c``) of ``bench/moe.py``'s model (8 experts of hidden
  512 and intermediate 1024, 2 a token), its 4 layers (96 MB), ``--rows`` tokens routed at random.

    python bench/kernel_ab.py [--rev HEAD] [--kernels linear,attention,prefill,wide,bf16,experts] [--rows 1,16,64,512]
        [--seqs 16,64] [--keys 192] [--prompt-lens 128,512] [--wide 4096x4096,14336x4096,4096x14336]
        [--repeats 8]

``KILN_CPU_MARCH`` builds both for another instruction set (``x86-64-v3``: AVX2 without VNNI).
Prints a table (median time per call of each build, B/A, equal) and writes
``bench/results/kernel_ab.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from serve_compare import machine

from kiln_cpu import native

ROOT = Path(__file__).resolve().parent.parent
CSRC = native.CSRC.relative_to(ROOT)
RESULTS = Path(__file__).parent / "results" / "kernel_ab.json"
LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 32  # the default model's, Kiln's CPU block size
PREFILL_PROMPTS = 16


def libraries(rev: str, tmp: Path):
    """(A, B): the kernels of ``rev`` and of the work tree, each built afresh."""
    subprocess.run(f"git -C {ROOT} archive {rev} {CSRC} | tar -x -C {tmp}", shell=True, check=True)
    return native.build_kernels(tmp / CSRC, tmp / "a.so"), native.build_kernels(native.CSRC, tmp / "b.so")


def alternate(
    run: Callable[[object], torch.Tensor], a, b, repeats: int, before: Callable[[], object] = lambda: None
) -> dict:
    """Median seconds of ``run(lib)`` for each build over ``repeats`` rounds, alternating which
    goes first (``before()`` untimed before each), and whether their last outputs are identical."""
    times: dict[str, list[float]] = {"A": [], "B": []}
    outputs = {}
    for i in range(repeats):
        for tag in "AB" if i % 2 == 0 else "BA":
            before()
            start = time.perf_counter()
            outputs[tag] = run(a if tag == "A" else b)
            times[tag].append(time.perf_counter() - start)
    a_s, b_s = statistics.median(times["A"]), statistics.median(times["B"])
    return {
        "a_ms": a_s * 1e3,
        "b_ms": b_s * 1e3,
        "b_over_a": b_s / a_s,
        "equal": torch.equal(outputs["A"], outputs["B"]),
    }


def model_weights() -> list[tuple[str, object]]:
    """The default model's layer 0 projections and LM head, as the CPU plugin tiles them."""
    from kiln import LLM
    from kiln.models.loader import default_model_path

    llm = LLM(default_model_path(), max_num_seqs=1, max_model_len=256)
    modules = dict(llm.engine.executor.runner.model.named_modules())
    names = [n for n in modules if n.startswith("layers.0.") and hasattr(modules[n], "weight")]
    return [
        (n, modules[n].weight) for n in [*[n for n in names if hasattr(modules[n].weight, "kernel_args")], "lm_head"]
    ]


def wide_weights(shapes: list[tuple[int, int]]) -> list[tuple[str, object]]:
    """Random Q4_1 weights of ``shapes`` (outputs, inputs), quantized by gguf-py and tiled."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize, quantize

    from kiln_cpu.tiled_weights import tiled_form

    q4_1, weights = GGMLQuantizationType.Q4_1, []
    for n_out, k_in in shapes:
        x = np.random.default_rng(0).standard_normal((n_out, k_in), dtype=np.float32)
        w = torch.from_numpy(dequantize(quantize(x, q4_1), q4_1).astype(np.float32).reshape(n_out, k_in))
        weights.append(("random Q4_1", tiled_form(w)))
    return weights


def linear_cases(weights: list[tuple[str, object]], rows_list: list[int], repeats: int, a, b) -> list[dict]:
    cases = []
    for name, weight in weights:
        n_out, k_in = weight.shape
        for rows in rows_list:
            x, out = torch.randn(rows, k_in), torch.empty(rows, n_out)
            calls = max(3, int(4e8 / (rows * n_out * k_in)))  # ~4e8 products a round: a few ms
            args = (out.data_ptr(), x.data_ptr(), rows, k_in, *weight.kernel_args, None, k_in, n_out, 0)

            def run(lib, args=args, out=out, calls=calls):
                for _ in range(calls):
                    lib.int8_linear(*args)
                return out.clone()

            case = {"kernel": "linear", "case": f"{name} {n_out}x{k_in} fmt {weight.fmt}", "rows": rows}
            case |= alternate(run, a, b, repeats)
            for side in ("a", "b"):
                case[f"{side}_ms"] /= calls
                case[f"{side}_gmacs"] = rows * n_out * k_in / case[f"{side}_ms"] / 1e6
            cases.append(case)
            print(row(case), flush=True)
    return cases


def bf16_cases(rows_list: list[int], repeats: int, a, b) -> list[dict]:
    """30 layers of the default model's bf16 projections (qkv, o, gate/up, down), a pass over all
    of them a round: 212 MB of weights, more than the caches hold."""
    torch.manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (outputs, inputs)
    weights = [[torch.randn(n, k).bfloat16() for n, k in shapes] for _ in range(LAYERS)]
    cases = []
    for rows in rows_list:
        xs = {k: torch.randn(rows, k).bfloat16() for _, k in shapes}
        outs = {n: torch.empty(rows, n, dtype=torch.bfloat16) for n, _ in shapes}

        def run(lib, xs=xs, outs=outs, rows=rows) -> torch.Tensor:
            for layer in weights:
                for w, (n, k) in zip(layer, shapes):
                    lib.linear_bf16(outs[n].data_ptr(), xs[k].data_ptr(), rows, k, w.data_ptr(), None, n)
            return torch.cat([outs[n] for n, _ in shapes], 1)

        case = {"kernel": "bf16", "case": f"{LAYERS} layers' 4 projections, 212 MB", "rows": rows}
        cases.append(case | alternate(run, a, b, repeats))
        print(row(cases[-1]), flush=True)
    return cases


def experts_cases(rows_list: list[int], repeats: int, a, b) -> list[dict]:
    """The 4 MoE layers of bench/moe.py's model (96 MB of bf16 experts), a pass over all a round."""
    torch.manual_seed(0)
    experts, hidden, inter, top_k = 8, 512, 1024, 2
    layers = [
        (torch.randn(experts, 2 * inter, hidden).bfloat16(), torch.randn(experts, hidden, inter).bfloat16())
        for _ in range(4)
    ]
    cases = []
    for rows in rows_list:
        x, outs = torch.randn(rows, hidden).bfloat16(), torch.empty(len(layers), rows, hidden, dtype=torch.bfloat16)
        weights, ids = torch.randn(rows, experts).softmax(-1).topk(top_k)

        def run(lib, x=x, outs=outs, weights=weights, ids=ids, rows=rows) -> torch.Tensor:
            for (w13, w2), out in zip(layers, outs):
                lib.fused_experts_bf16(out.data_ptr(), x.data_ptr(), rows, hidden, inter, ids.data_ptr(),
                                       weights.data_ptr(), top_k, experts, w13.data_ptr(), w2.data_ptr())  # fmt: skip
            return outs.clone()

        case = {"kernel": "experts", "case": "4 MoE layers, 96 MB", "rows": rows}
        cases.append(case | alternate(run, a, b, repeats))
        print(row(cases[-1]), flush=True)
    return cases


def decode_attention(seqs: int, keys: int, cold: bool) -> Callable[[object], torch.Tensor]:
    """A run of decode attention over 30 layers' caches (``cold``) or one layer's 30 times."""
    width = (keys + BLOCK - 1) // BLOCK
    blocks = 2 * seqs * width  # half the pool unused, so a request's blocks lie scattered
    layers = LAYERS if cold else 1
    planes = [torch.randn(2, blocks, KV_HEADS, BLOCK, HEAD_DIM).to(torch.bfloat16) for _ in range(layers)]
    tables = [torch.randperm(blocks)[: seqs * width].view(seqs, width).to(torch.int32) for _ in range(layers)]
    lens = torch.randint(keys - BLOCK, keys + 1, (seqs,), dtype=torch.int32)
    q, out = torch.randn(seqs, HEADS, HEAD_DIM), torch.empty(seqs, HEADS, HEAD_DIM)

    def run(lib) -> torch.Tensor:
        for layer in range(LAYERS):
            kv, table = planes[layer % layers], tables[layer % layers]
            lib.paged_decode_attention_f32_bf16(
                out.data_ptr(), q.data_ptr(), q.stride(0), kv[0].data_ptr(), kv[1].data_ptr(), table.data_ptr(),
                table.stride(0), lens.data_ptr(), seqs, HEADS, KV_HEADS, HEAD_DIM, BLOCK, 0.125, 0, 0.0,
            )  # fmt: skip  # no window, no soft cap (a build from before the cap ignores that argument)
        return out.clone()

    return run


def attention_cases(seqs_list: list[int], keys: int, repeats: int, a, b) -> list[dict]:
    torch.manual_seed(0)
    sweep = torch.empty(25_000_000)  # 100 MB, between the cold rounds
    cases = []
    for seqs in seqs_list:
        for cold in (True, False):
            run = decode_attention(seqs, keys, cold)
            case = {"kernel": "attention", "case": f"{LAYERS} layers, {'cold' if cold else 'hot'}", "rows": seqs}
            cases.append(case | alternate(run, a, b, repeats, (lambda: sweep.add_(1.0)) if cold else lambda: None))
            print(row(cases[-1]), flush=True)
    return cases


def prefill_cases(prompt_lens: list[int], repeats: int, a, b) -> list[dict]:
    torch.manual_seed(0)
    cases = []
    for length in prompt_lens:
        tokens = PREFILL_PROMPTS * length
        q = torch.randn(tokens, HEADS, HEAD_DIM)
        k, v = (torch.randn(tokens, KV_HEADS, HEAD_DIM) for _ in "kv")
        cache = torch.zeros(2, 1, KV_HEADS, BLOCK, HEAD_DIM)  # fresh prompts read no cached keys
        table = torch.zeros(PREFILL_PROMPTS, 1, dtype=torch.int32)
        seqs = torch.tensor([[i * length, length, 0, i] for i in range(PREFILL_PROMPTS)], dtype=torch.int64)
        out = torch.empty_like(q)

        def run(lib, q=q, k=k, v=v, cache=cache, table=table, seqs=seqs, out=out) -> torch.Tensor:
            lib.prefill_attention_f32(
                out.data_ptr(), out.stride(0), q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0),
                v.stride(0), cache[0].data_ptr(), cache[1].data_ptr(), 0, table.data_ptr(), table.stride(0),
                seqs.data_ptr(), PREFILL_PROMPTS, HEADS, KV_HEADS, HEAD_DIM, BLOCK, 0.125, 0, 0.0,
            )  # fmt: skip  # no window, no soft cap (a build from before the cap ignores that argument)
            return out.clone()

        case = {"kernel": "prefill", "case": f"{PREFILL_PROMPTS} prompts of {length} tokens, one layer", "rows": tokens}
        cases.append(case | alternate(run, a, b, repeats))
        print(row(cases[-1]), flush=True)
    return cases


def row(case: dict) -> str:
    rate = f" ({case['a_gmacs']:.0f} / {case['b_gmacs']:.0f} GMAC/s)" if "a_gmacs" in case else ""
    return (
        f"{case['kernel']:9} {case['case']:52} {case['rows']:5}  A {case['a_ms']:8.3f} ms  B {case['b_ms']:8.3f} ms"
        f"{rate}  B/A {case['b_over_a']:.3f}  {'equal' if case['equal'] else 'DIFFERENT'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default="HEAD", help="the revision built as A (B: the work tree)")
    parser.add_argument("--kernels", default="linear,attention")
    parser.add_argument("--rows", default="1,16,64,512", help="rows of the products")
    parser.add_argument("--seqs", default="16,64", help="requests of decode attention")
    parser.add_argument("--keys", type=int, default=192, help="keys a request has (up to a block fewer)")
    parser.add_argument("--prompt-lens", default="128,512", help="prompt lengths of prefill attention")
    parser.add_argument("--wide", default="4096x4096,14336x4096,4096x14336", help="shapes of the wide weights")
    parser.add_argument("--repeats", type=int, default=8, help="rounds per case (half of them B first)")
    args = parser.parse_args()
    kernels = args.kernels.split(",")
    known = ["linear", "attention", "prefill", "wide", "bf16", "experts"]
    if unknown := set(kernels) - set(known):
        parser.error(f"--kernels: unknown {sorted(unknown)}; choose from {', '.join(known)}")
    rows = [int(r) for r in args.rows.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        a, b = libraries(args.rev, Path(tmp))
        print(f"A: {args.rev}'s kernels, B: the work tree's; median of {args.repeats} rounds, alternating", flush=True)
        cases = []
        if "linear" in kernels:
            cases += linear_cases(model_weights(), rows, args.repeats, a, b)
        if "wide" in kernels:
            shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.wide.split(",")]
            cases += linear_cases(wide_weights(shapes), rows, args.repeats, a, b)
        if "attention" in kernels:
            cases += attention_cases([int(s) for s in args.seqs.split(",")], args.keys, args.repeats, a, b)
        if "prefill" in kernels:
            cases += prefill_cases([int(n) for n in args.prompt_lens.split(",")], args.repeats, a, b)
        if "bf16" in kernels:
            cases += bf16_cases(rows, args.repeats, a, b)
        if "experts" in kernels:
            cases += experts_cases(rows, args.repeats, a, b)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"rev": args.rev, "machine": machine(), "cases": cases}, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
