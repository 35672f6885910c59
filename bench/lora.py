"""Multi-LoRA throughput: requests spread over four adapters against the base model alone.

Workload (issue 18): 64 prompts of 256 random tokens, 128 new tokens each (``ignore_eos``), at
most 16 running at once (``max_num_seqs``, the offline form of concurrency 16), on the default
model. The base engine runs them without LoRA; the LoRA engine (``enable_lora``, four slots)
runs request ``i`` with random rank-16 adapter ``i % 4`` (all seven projections). Alternately,
``--repeats`` times. Target: LoRA output tok/s >= 0.8x the base's. Also prints how long reading
and checking one adapter takes (``LLMEngine.add_lora``, from disk, cold).

    python bench/lora.py [--repeats 3] [--num-prompts 64] [--rank 16]

Prints a table (median and spread) and writes ``bench/results/lora.json``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from offline_throughput import make_prompts, save_results

RESULTS = Path(__file__).parent / "results" / "lora.json"
ADAPTERS = 4


def timed(llm, prompts, params, loras) -> float:
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outs)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--lora-dtype", default="auto", help="the adapters' dtype (auto: bf16 for a GGUF model on the CPU)"
    )
    args = parser.parse_args()

    from kiln import LLM, LoRARequest, SamplingParams
    from kiln.models.loader import resolve_model
    from kiln.testing.lora import build_lora_adapter

    base_dir = resolve_model(None, "auto").path  # the default model's converted folder, for PEFT
    work = Path(tempfile.mkdtemp(prefix="kiln-lora-bench-"))
    paths = [build_lora_adapter(base_dir, work / f"a{i}", rank=args.rank, seed=i, std=0.05) for i in range(ADAPTERS)]
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]

    base = LLM(max_num_seqs=args.concurrency)
    lora = LLM(
        max_num_seqs=args.concurrency, enable_lora=True, max_loras=ADAPTERS, max_lora_rank=args.rank,
        lora_dtype=args.lora_dtype,
    )  # fmt: skip
    load_ms = []
    for req in loras:
        start = time.perf_counter()
        lora.engine.add_lora(req)
        load_ms.append((time.perf_counter() - start) * 1000)
    tok = base.get_tokenizer()
    prompts = make_prompts(args.num_prompts, args.input_len, len(tok), set(tok.all_special_ids))
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    spread = [loras[i % ADAPTERS] for i in range(len(prompts))]
    warm = SamplingParams(max_tokens=4, temperature=0)
    timed(base, prompts[:2], warm, None)
    timed(lora, prompts[:2], warm, spread[:2])
    runs: dict[str, list[float]] = {"base": [], f"{ADAPTERS} adapters": []}
    for _ in range(args.repeats):
        runs["base"].append(timed(base, prompts, params, None))
        runs[f"{ADAPTERS} adapters"].append(timed(lora, prompts, params, spread))

    tokens = len(prompts) * args.output_len
    rates = {name: [tokens / t for t in times] for name, times in runs.items()}
    medians = {name: statistics.median(r) for name, r in rates.items()}
    ratio = medians[f"{ADAPTERS} adapters"] / medians["base"]
    print(f"\n{'engine':<12}{'tok/s median':>14}{'min':>8}{'max':>8}")
    for name, r in rates.items():
        print(f"{name:<12}{medians[name]:>14.1f}{min(r):>8.1f}{max(r):>8.1f}")
    print(f"\nadapter read + check (rank {args.rank}, cold): " + ", ".join(f"{ms:.0f} ms" for ms in load_ms))
    print(f"LoRA / base: {ratio:.2f}x (target >= 0.8x: {'met' if ratio >= 0.8 else 'not met'})")
    save_results(
        RESULTS,
        {
            "workload": vars(args),
            "lora_dtype": lora.engine.config.lora_dtype,
            "output_tok_per_s": rates,
            "adapter_load_ms": load_ms,
            "ratio": ratio,
            "meets_target": ratio >= 0.8,
        },
    )


if __name__ == "__main__":
    main()
