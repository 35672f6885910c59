"""Speculative decoding by n-gram prompt lookup against plain decoding, on the default model.

Two workloads (issue 19), each run by a plain engine and an n-gram engine alternately,
``--repeats`` times, greedy:

* grounded, at concurrency 1: 8 chat requests that ask to repeat or edit a paragraph of
  ``tests/data/heldout.txt`` (so the answer copies from the prompt), up to 256 new tokens.
  Target: n-gram output tok/s >= 1.8x plain.
* random, at concurrency 16: 64 prompts of 256 random tokens, 128 new tokens each
  (``ignore_eos``). Target: never below 0.95x plain (drafts only where the text repeats).

Output tok/s counts every token over the whole run (prefills included). Also checks that both
engines produce the same tokens, and prints the acceptance rates.

    python bench/spec_decode.py [--repeats 3] [--num-speculative-tokens 4]

Prints a table (median and spread) and writes ``bench/results/spec_decode.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from offline_throughput import make_prompts, save_results

RESULTS = Path(__file__).parent / "results" / "spec_decode.json"
HELDOUT = Path(__file__).parent.parent / "tests" / "data" / "heldout.txt"
TASKS = (
    "Repeat the following text exactly, word for word.",
    "Rewrite the following text, replacing every full stop with an exclamation mark.",
    "Copy the following paragraph verbatim.",
)


def grounded_requests() -> list[list[dict]]:
    paragraphs = [p.strip() for p in HELDOUT.read_text().split("\n\n") if len(p.split()) > 40][:8]
    return [[{"role": "user", "content": f"{TASKS[i % len(TASKS)]}\n\n{p}"}] for i, p in enumerate(paragraphs)]


def timed(run) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = run()
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    args = parser.parse_args()

    from kiln import LLM, SamplingParams

    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": args.prompt_lookup_max,
        "prompt_lookup_min": args.prompt_lookup_min,
    }
    chats = grounded_requests()
    greedy = SamplingParams(temperature=0, max_tokens=256)
    fixed = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    workloads = {"grounded (concurrency 1)": 1, "random (concurrency 16)": 16}
    results = {}
    for name, concurrency in workloads.items():
        engines = {
            "plain": LLM(max_num_seqs=concurrency),
            "ngram": LLM(max_num_seqs=concurrency, speculative_config=spec),
        }
        if concurrency == 1:
            runs = {k: (lambda llm=llm: llm.chat(chats, greedy)) for k, llm in engines.items()}
        else:
            tok = engines["plain"].get_tokenizer()
            prompts = [{"prompt_token_ids": p} for p in make_prompts(64, 256, len(tok), set(tok.all_special_ids))]
            runs = {k: (lambda llm=llm, prompts=prompts: llm.generate(prompts, fixed)) for k, llm in engines.items()}
        for llm in engines.values():  # warm up
            llm.generate("Hello", SamplingParams(max_tokens=8))
        rates: dict[str, list[float]] = {"plain": [], "ngram": []}
        tokens: dict[str, list[list[int]]] = {}
        stats = engines["ngram"].engine.core.scheduler.spec_stats
        before = stats.since(None)
        for _ in range(args.repeats):
            for key, run in runs.items():
                elapsed, tokens[key] = timed(run)
                rates[key].append(sum(map(len, tokens[key])) / elapsed)
        ratios = [s / p for s, p in zip(rates["ngram"], rates["plain"])]
        run_stats = stats.since(before)
        results[name] = {
            "plain_tok_s": rates["plain"],
            "ngram_tok_s": rates["ngram"],
            "speedup": ratios,
            "identical_tokens": tokens["plain"] == tokens["ngram"],
            "acceptance_rate": run_stats.acceptance_rate,
            "mean_acceptance_length": run_stats.mean_acceptance_length,
            "accepted_per_pos": [n / max(run_stats.num_drafts, 1) for n in run_stats.accepted_per_pos],
        }
        print(f"\n{name}: {run_stats.summary()}; same tokens as plain: {results[name]['identical_tokens']}")

    print(f"\n{'workload':28} {'plain tok/s':>12} {'ngram tok/s':>12} {'speedup':>8} {'spread':>14}")
    for name, r in results.items():
        spread = f"{min(r['speedup']):.2f}-{max(r['speedup']):.2f}"
        print(
            f"{name:28} {statistics.median(r['plain_tok_s']):12.1f} {statistics.median(r['ngram_tok_s']):12.1f} "
            f"{statistics.median(r['speedup']):7.2f}x {spread:>14}"
        )
    save_results(RESULTS, {"speculative_config": spec, "repeats": args.repeats, "workloads": results})


if __name__ == "__main__":
    main()
