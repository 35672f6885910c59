"""Beam search cost: width 4 versus a greedy request of the same length, on the default model.

Workload (issue 20): one prompt of 64 random tokens, 128 new tokens, ``ignore_eos`` (so every
request runs to its full length); greedy decoding, then beam search of width 4 on the same
engine, alternately, ``--repeats`` times. Target: beam search takes <= 2x the greedy request's
time (its beams share the prompt's KV blocks and decode as one batch of 4).

    python bench/beam_search.py [--repeats 3] [--width 4] [--output-len 128]

Prints a table (median and spread over the repeats) and writes ``bench/results/beam_search.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from offline_throughput import make_prompts, save_results

RESULTS = Path(__file__).parent / "results" / "beam_search.json"


def timed(llm, prompt: list[int], params) -> float:
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == params.max_tokens for o in out.outputs)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded default model)")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from kiln import LLM, SamplingParams

    llm = LLM(args.model)
    tok = llm.get_tokenizer()
    prompt = make_prompts(1, args.input_len, len(tok), set(tok.all_special_ids))[0]
    n = args.output_len
    greedy = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    beam = SamplingParams(n=args.width, use_beam_search=True, max_tokens=n, ignore_eos=True)
    timed(llm, prompt, SamplingParams(max_tokens=8, temperature=0))  # warm-up
    runs: dict[str, list[float]] = {"greedy": [], f"beam-{args.width}": []}
    for _ in range(args.repeats):
        runs["greedy"].append(timed(llm, prompt, greedy))
        runs[f"beam-{args.width}"].append(timed(llm, prompt, beam))

    medians = {name: statistics.median(times) for name, times in runs.items()}
    ratio = medians[f"beam-{args.width}"] / medians["greedy"]
    print(f"\n{'request':<10}{'median s':>10}{'min s':>8}{'max s':>8}{'tok/s':>8}")
    for name, times in runs.items():
        print(f"{name:<10}{medians[name]:>10.2f}{min(times):>8.2f}{max(times):>8.2f}{n / medians[name]:>8.1f}")
    print(f"\nbeam width {args.width} / greedy: {ratio:.2f}x (target <= 2x: {'met' if ratio <= 2 else 'not met'})")
    save_results(
        RESULTS,
        {
            "workload": vars(args),
            "dtype": str(llm.engine.dtype).removeprefix("torch."),
            "seconds": runs,
            "ratio": ratio,
            "meets_target": ratio <= 2,
        },
    )


if __name__ == "__main__":
    main()
