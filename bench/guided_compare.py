"""Guided decoding cost: 16 concurrent JSON-schema requests versus 16 unconstrained ones on the
same ``kiln serve`` run (output tokens/s), and the first-request compile time of seed 001's
Character schema.

    python bench/guided_compare.py [--num-prompts 32]

Target (issue 4): the constrained run keeps at least 85% of the unconstrained throughput; the
Character schema compiles in under 1 s. Writes ``bench/results/guided_compare.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import httpx

from kiln.benchmarks.serve import BenchConfig, format_table, run_benchmark
from kiln.testing.schemas import CHARACTER_SCHEMA
from kiln.testing.server import RemoteServer

RESULTS = Path(__file__).parent / "results" / "guided_compare.json"
# About 100 tokens of output whatever the model prefers: twelve short strings.
LIST_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 12, "maxItems": 12}
    },
    "required": ["items"],
}


def first_request_seconds(url: str, extra: dict) -> float:
    body = {"prompt": "Describe a character.", "max_tokens": 1, **extra}
    start = time.perf_counter()
    httpx.post(url + "/v1/completions", json=body, timeout=120).raise_for_status()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    common = dict(num_prompts=args.num_prompts, max_concurrency=args.concurrency, input_len=256, output_len=128)
    runs = {}
    with RemoteServer(["--disable-log-requests", "--uvicorn-log-level", "warning"]) as server:
        plain = first_request_seconds(server.url, {})
        character = first_request_seconds(server.url, {"guided_json": CHARACTER_SCHEMA})
        cached = first_request_seconds(server.url, {"guided_json": CHARACTER_SCHEMA})
        runs["unconstrained"] = asyncio.run(run_benchmark(BenchConfig(base_url=server.url, ignore_eos=True, **common)))
        guided = BenchConfig(base_url=server.url, ignore_eos=False, extra_body={"guided_json": LIST_SCHEMA}, **common)
        runs["json-schema"] = asyncio.run(run_benchmark(guided))
    print(format_table(runs))
    ratio = runs["json-schema"]["output_throughput"] / runs["unconstrained"]["output_throughput"]
    compile_s = character - plain
    print(f"\nconstrained / unconstrained output throughput: {ratio:.2f} (target >= 0.85)")
    print(f"Character schema first request: {character:.3f} s vs {plain:.3f} s unconstrained, {cached:.3f} s cached")
    print(f"  -> compile about {compile_s:.3f} s (target < 1 s)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "runs": runs,
                "throughput_ratio": ratio,
                "character_first_request_s": character,
                "unconstrained_first_request_s": plain,
                "character_cached_request_s": cached,
                "loadavg_end": os.getloadavg(),
            },
            indent=2,
        )
    )
    print(f"saved {RESULTS}")


if __name__ == "__main__":
    main()
