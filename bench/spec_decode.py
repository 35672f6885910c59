"""Speculative decoding by n-gram prompt lookup against plain decoding, on the default model.

Two workloads (issue 19), each run by a plain engine and an n-gram engine alternately,
``--repeats`` times, greedy:

* grounded, at concurrency 1: 8 chat requests that ask to repeat or edit a paragraph of
  ``tests/data/heldout.txt`` (so the answer copies from the prompt), up to 256 new tokens.
  Target: n-gram output tok/s >= 1.8x plain.
* random, at concurrency 16: 64 prompts of 256 random tokens, 128 new tokens each
  (``ignore_eos``). Target: never below 0.95x plain (drafts only where the text repeats).

Output tok/s counts every token over the whole run (prefills included). Every run is an engine
in a fresh process (``in_fresh_process``), plain and n-gram alternating; the speedup is the ratio
of the medians, the spread that of each round's pair. Also checks that both engines produce
the same tokens, and prints the acceptance rates.

    python bench/spec_decode.py [--repeats 3] [--num-speculative-tokens 4]

Prints a table (median and spread) and writes ``bench/results/spec_decode.json``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from offline_throughput import make_prompts, save_results

from kiln.spec_decode.stats import SpecDecodeStats

RESULTS = Path(__file__).parent / "results" / "spec_decode.json"
HELDOUT = Path(__file__).parent.parent / "tests" / "data" / "heldout.txt"
TASKS = (
    "Repeat the following text exactly, word for word.",
    "Rewrite the following text, replacing every full stop with an exclamation mark.",
    "Copy the following paragraph verbatim.",
)
WORKLOADS = {"grounded (concurrency 1)": 1, "random (concurrency 16)": 16}  # name -> concurrency


def grounded_requests() -> list[list[dict]]:
    paragraphs = [p.strip() for p in HELDOUT.read_text().split("\n\n") if len(p.split()) > 40][:8]
    return [[{"role": "user", "content": f"{TASKS[i % len(TASKS)]}\n\n{p}"}] for i, p in enumerate(paragraphs)]


def timed(run) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = run()
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def one_run(workload: str, spec: dict | None) -> dict:
    """In a fresh process: one engine (plain with ``spec`` None), warmed up, over ``workload``
    once; its output tok/s, token ids and speculative counts."""
    from kiln import LLM, SamplingParams

    concurrency = WORKLOADS[workload]
    llm = LLM(max_num_seqs=concurrency, speculative_config=spec)
    llm.generate("Hello", SamplingParams(max_tokens=8))  # warm up
    stats = llm.engine.core.scheduler.spec_stats
    before = stats.since(None)
    if concurrency == 1:
        elapsed, tokens = timed(lambda: llm.chat(grounded_requests(), SamplingParams(temperature=0, max_tokens=256)))
    else:
        tok = llm.get_tokenizer()
        prompts = [{"prompt_token_ids": p} for p in make_prompts(64, 256, len(tok), set(tok.all_special_ids))]
        fixed = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        elapsed, tokens = timed(lambda: llm.generate(prompts, fixed))
    return {"tok_s": sum(map(len, tokens)) / elapsed, "tokens": tokens, "stats": stats.since(before)}


def in_fresh_process(fn, *args):
    """``fn(*args)`` in a new process. Engines built one after the other in one process ran
    up to 15 % apart for the same work depending on which came first (where their memory
    landed), which decided the ratio more than speculation did."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    args = parser.parse_args()

    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": args.prompt_lookup_max,
        "prompt_lookup_min": args.prompt_lookup_min,
    }
    results = {}
    for name in WORKLOADS:
        rates: dict[str, list[float]] = {"plain": [], "ngram": []}
        tokens: dict[str, list[list[int]]] = {}
        run_stats = SpecDecodeStats()
        for _ in range(args.repeats):  # the two alternate, each run in a process of its own
            for key in rates:
                run = in_fresh_process(one_run, name, spec if key == "ngram" else None)
                rates[key].append(run["tok_s"])
                tokens[key] = run["tokens"]
                if key == "ngram":
                    run_stats = run_stats.plus(run["stats"])
        ratios = [s / p for s, p in zip(rates["ngram"], rates["plain"])]
        results[name] = {
            "plain_tok_s": rates["plain"],
            "ngram_tok_s": rates["ngram"],
            "speedup": ratios,
            "speedup_of_medians": statistics.median(rates["ngram"]) / statistics.median(rates["plain"]),
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
            f"{r['speedup_of_medians']:7.2f}x {spread:>14}"
        )
    save_results(RESULTS, {"speculative_config": spec, "repeats": args.repeats, "workloads": results})


if __name__ == "__main__":
    main()
