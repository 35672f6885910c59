"""``kiln bench serve``: load an OpenAI-compatible server the way ``vllm bench serve`` does.

Synthetic prompts are sent as token ids (exact input lengths, no tokenizer on
the client), either all random or sharing a common prefix. Requests stream;
time to first token (TTFT), time per output token after the first (TPOT) and
inter-token latency (ITL) come from the stream's chunk arrival times, and the
output token count from the final usage. Works against any server that takes
token-id prompts on ``/v1/completions`` (Kiln, vLLM, llama.cpp's ``llama-server``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np


@dataclass
class BenchConfig:
    base_url: str
    model: str | None = None
    num_prompts: int = 64
    input_len: int = 256
    output_len: int = 128
    prefix_len: int = 0  # tokens shared by every prompt (the "prefix" dataset)
    max_concurrency: int | None = None
    request_rate: float = float("inf")  # requests/s, Poisson arrivals; inf: all at once
    ignore_eos: bool = True
    seed: int = 0
    token_range: tuple[int, int] = (1000, 20000)
    api_key: str | None = None
    extra_body: dict = field(default_factory=dict)  # merged into every request (e.g. guided_json)


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def make_prompts(cfg: BenchConfig) -> list[list[int]]:
    rng = random.Random(cfg.seed)
    lo, hi = cfg.token_range
    prefix = [rng.randrange(lo, hi) for _ in range(cfg.prefix_len)]
    rest = cfg.input_len - cfg.prefix_len
    return [prefix + [rng.randrange(lo, hi) for _ in range(rest)] for _ in range(cfg.num_prompts)]


async def _one(client: httpx.AsyncClient, cfg: BenchConfig, model: str, prompt: list[int]) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": cfg.output_len,
        "temperature": 0.0,
        "ignore_eos": cfg.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
        **cfg.extra_body,
    }
    result = RequestResult(ok=False, prompt_len=len(prompt))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
        result.latency = time.perf_counter() - start
        result.ok = result.ttft > 0
    except httpx.HTTPError as exc:
        result.error = repr(exc)
    return result


async def run_benchmark(cfg: BenchConfig) -> dict:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # A stalled stream fails its request after 5 min instead of hanging the run.
    timeout = httpx.Timeout(None, read=300.0)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=timeout, limits=limits) as client:
        model = cfg.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        prompts = make_prompts(cfg)
        gate = asyncio.Semaphore(cfg.max_concurrency or len(prompts))
        rng = np.random.default_rng(cfg.seed)

        async def limited(prompt):
            async with gate:
                return await _one(client, cfg, model, prompt)

        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if cfg.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / cfg.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(cfg, model, results, duration)


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    arr = np.asarray(values) * scale
    return {"mean": float(arr.mean()), "median": float(np.median(arr)), "p99": float(np.percentile(arr, 99))}


def summarize(cfg: BenchConfig, model: str, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "model": model,
        "base_url": cfg.base_url,
        "config": {k: v for k, v in asdict(cfg).items() if k != "api_key"},
        "completed": len(ok),
        "failed": len(results) - len(ok),
        # With ignore_eos every completion should be exactly output_len tokens; a server that stops
        # early (or ignores the field) would otherwise look faster than it is.
        "length_mismatches": sum(r.output_tokens != cfg.output_len for r in ok) if cfg.ignore_eos else 0,
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(ok) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "loadavg": os.getloadavg(),
    }


def format_table(runs: dict[str, dict]) -> str:
    """Runs side by side (one column per label)."""
    rows = [
        ("completed / failed", lambda r: f"{r['completed']} / {r['failed']}"),
        ("duration (s)", lambda r: f"{r['duration_s']:.2f}"),
        ("request throughput (req/s)", lambda r: f"{r['request_throughput']:.2f}"),
        ("output throughput (tok/s)", lambda r: f"{r['output_throughput']:.1f}"),
        ("total throughput (tok/s)", lambda r: f"{r['total_token_throughput']:.1f}"),
    ]
    for metric in ("ttft_ms", "tpot_ms", "itl_ms"):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{metric[:-3].upper()} {stat} (ms)", lambda r, m=metric, s=stat: f"{r[m][s]:.1f}"))
    labels = list(runs)
    width = max(len(name) for name, _ in rows)
    cols = [max(12, len(label)) for label in labels]
    lines = [" " * width + "  " + "  ".join(label.rjust(c) for label, c in zip(labels, cols))]
    for name, fmt in rows:
        lines.append(name.ljust(width) + "  " + "  ".join(fmt(runs[label]).rjust(c) for label, c in zip(labels, cols)))
    return "\n".join(lines)


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--dataset-name", choices=["random", "prefix"], default="random")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--random-input-len", type=int, default=256)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--prefix-len", type=int, default=128, help="shared prefix tokens (prefix dataset)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (inf)")
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=os.environ.get("KILN_API_KEY"))
    parser.add_argument(
        "--extra-body",
        type=json.loads,
        default={},
        help="JSON merged into every request, e.g. '{\"guided_json\": {...}}'",
    )
    parser.add_argument("--label", default="server", help="column name in the table")
    parser.add_argument("--result-file", default=None, help="save the results as JSON here")


def config_from_args(ns: argparse.Namespace) -> BenchConfig:
    if ns.dataset_name == "prefix" and not 0 < ns.prefix_len <= ns.random_input_len:
        raise ValueError("--prefix-len: must be in [1, --random-input-len]")
    return BenchConfig(
        base_url=ns.base_url or f"http://{ns.host}:{ns.port}",
        model=ns.model,
        num_prompts=ns.num_prompts,
        input_len=ns.random_input_len,
        output_len=ns.random_output_len,
        prefix_len=ns.prefix_len if ns.dataset_name == "prefix" else 0,
        max_concurrency=ns.max_concurrency,
        request_rate=ns.request_rate,
        ignore_eos=ns.ignore_eos,
        seed=ns.seed,
        api_key=ns.api_key,
        extra_body=ns.extra_body,
    )


def cmd_bench_serve(ns: argparse.Namespace) -> int:
    result = asyncio.run(run_benchmark(config_from_args(ns)))
    print(format_table({ns.label: result}))
    if ns.result_file:
        with open(ns.result_file, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["failed"] == 0 else 1
