"""Offline throughput: Kiln versus Hugging Face ``generate`` on the same machine, in one run.

Workload (issue 2): 64 prompts of 256 random tokens, 128 new tokens each,
``ignore_eos``, greedy. Kiln gets all prompts at once (continuous batching);
transformers runs static batches of 16. Each system runs in its own process,
one after the other (two torch processes on the same cores slow each other
down), and reports output tokens/s and its peak RSS. transformers runs in fp32
and bf16 and the faster is the baseline; Kiln runs with ``dtype=auto``, with its
defaults ("kiln", or the flags given here) and in the presets of ``KILN_PRESETS``
(lower concurrency: less memory).

    python bench/offline_throughput.py [--repeats 3] [--systems kiln,kiln-16seqs,hf-float32,hf-bfloat16]
    python bench/offline_throughput.py --device cuda --load-format dummy --systems kiln,hf-bfloat16

On an accelerator both systems run there and "peak MB" is the device's peak
allocation instead of RSS. ``--load-format dummy`` gives both random weights
(throughput with ``ignore_eos`` does not depend on them), for a model folder
that holds only its config and tokenizer.

Prints a table and writes ``bench/results/offline_throughput[_DEVICE].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "offline_throughput.json"
# The options a worker process gets from the parent: the workload and Kiln's engine flags.
WORKER_FLAGS = (
    "num_prompts", "input_len", "output_len", "batch_size",
    "max_num_seqs", "max_num_batched_tokens", "device", "kiln_dtype", "kv_cache_dtype", "load_format",
)  # fmt: skip


# Kiln runs besides "kiln" and the engine flags each sets (over the command line's).
KILN_PRESETS = {
    # Lower concurrency, fp32 K/V (outputs exact). On this project's 2-core CPU a decode
    # step is compute-bound from ~16 rows on, so these run about as fast as all 64 at once
    # in 60-65% of the memory. 16 is transformers' batch.
    "kiln-16seqs": {"max_num_seqs": 16},
    "kiln-24seqs": {"max_num_seqs": 24},
    # bf16 weights and activations, where the CPU's dtype "auto" picks fp32 (no AMX).
    "kiln-16seqs-bf16": {"max_num_seqs": 16, "kiln_dtype": "bfloat16"},
}
DEFAULT_SYSTEMS = ",".join(["kiln", "kiln-16seqs", "kiln-24seqs", "hf-float32", "hf-bfloat16"])


def make_prompts(num: int, length: int, vocab: int, special: set[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    allowed = [t for t in range(vocab) if t not in special]
    return [[rng.choice(allowed) for _ in range(length)] for _ in range(num)]


def save_results(path: Path, fields: dict) -> None:
    """Write a benchmark's JSON: when and on what it ran, then ``fields``."""
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine, **fields}, indent=2)
    )
    print(f"saved {path}")


def peak_mb(device: str) -> float:
    """Peak RSS on the CPU, the device's peak allocation on an accelerator."""
    if device in ("auto", "cpu"):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    import torch

    return getattr(torch, device).max_memory_allocated() / 2**20


def synchronize(device: str) -> None:
    if device not in ("auto", "cpu"):
        import torch

        getattr(torch, device).synchronize()


def run_kiln(args: argparse.Namespace) -> dict:
    from kiln import LLM, SamplingParams

    args = argparse.Namespace(**{**vars(args), **KILN_PRESETS.get(args.worker, {})})
    llm = LLM(
        args.model,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        device=args.device,
        dtype=args.kiln_dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        load_format=args.load_format,
    )
    tok = llm.get_tokenizer()
    prompts = make_prompts(args.num_prompts, args.input_len, len(tok), set(tok.all_special_ids))
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=8, ignore_eos=True))
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == args.output_len for o in outputs)
    flags = {k: getattr(args, k) for k in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_dtype")}
    return {"seconds": elapsed, "dtype": str(llm.engine.dtype).removeprefix("torch."), "flags": flags}


def run_hf(args: argparse.Namespace, dtype: str) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kiln.models.loader import transformers_model

    tok = AutoTokenizer.from_pretrained(args.model)
    if args.load_format == "dummy":
        config = AutoConfig.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    else:
        model = transformers_model(AutoModelForCausalLM, args.model, dtype=getattr(torch, dtype))
    device = "cpu" if args.device == "auto" else args.device
    model = model.to(device).eval()
    prompts = make_prompts(args.num_prompts, args.input_len, len(tok), set(tok.all_special_ids))
    prompts = torch.tensor(prompts, device=device)
    kwargs = dict(do_sample=False, pad_token_id=tok.pad_token_id or 0)
    with torch.inference_mode():
        model.generate(prompts[:2], attention_mask=torch.ones_like(prompts[:2]), max_new_tokens=8, **kwargs)
        start = time.perf_counter()
        for i in range(0, len(prompts), args.batch_size):
            batch = prompts[i : i + args.batch_size]
            out = model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                **kwargs,
            )
            assert out.shape[1] == args.input_len + args.output_len
        synchronize(args.device)
        elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "dtype": dtype}


def worker(args: argparse.Namespace) -> None:
    load = os.getloadavg()[0]
    if args.worker.startswith("kiln"):
        result = run_kiln(args)
    else:
        result = run_hf(args, args.worker.removeprefix("hf-"))
    result.update(
        system=args.worker,
        output_tokens_per_s=args.num_prompts * args.output_len / result["seconds"],
        peak_mb=peak_mb(args.device),
        loadavg_at_start=load,
    )
    print("RESULT " + json.dumps(result), flush=True)


def run_system(name: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", name, "--model", args.model]
    for flag in WORKER_FLAGS:
        if getattr(args, flag) is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded default model)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="transformers' static batch size")
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="Kiln's concurrency cap (the engine default, 256, runs all 64)"
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="Kiln's step token budget")
    parser.add_argument("--device", default="auto", help="Kiln's --device; transformers runs there too")
    parser.add_argument("--kiln-dtype", default="auto", help="Kiln's --dtype (auto: the platform's fastest)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="Kiln's --kv-cache-dtype")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"], help="dummy: random weights")
    parser.add_argument(
        "--systems", default=DEFAULT_SYSTEMS, help=f"from kiln, hf-float32, hf-bfloat16, {', '.join(KILN_PRESETS)}"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds of every system, in turn; each system's best counts"
    )
    parser.add_argument("--target", type=float, default=2.0, help="Kiln's target speedup over the baseline")
    parser.add_argument(
        "--no-memory-target", action="store_true", help="the target is speed alone, not also peak memory"
    )
    parser.add_argument("--results", type=Path, default=None, help="where the JSON goes (default: by device)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.model is None:
        from kiln.models.loader import resolve_model

        args.model = resolve_model(None, "auto").path
    if args.worker:
        worker(args)
        return

    rounds: dict[str, list[dict]] = {}
    for _ in range(args.repeats):  # a round runs every system once, so its ratios share an hour
        for name in dict.fromkeys(args.systems.split(",")):  # each system once a round
            rounds.setdefault(name, []).append(run_system(name, args))
    report(args, rounds)


def report(args: argparse.Namespace, rounds: dict[str, list[dict]]) -> None:
    """The best round of each system against the baseline's best, and with more than one round
    each round's own ratio (the machine's speed drifts between rounds, less within one)."""
    best = {name: max(runs, key=lambda r: r["output_tokens_per_s"]) for name, runs in rounds.items()}
    hf = [name for name in best if name.startswith("hf")]
    base = max(hf, key=lambda name: best[name]["output_tokens_per_s"]) if hf else None
    summary = {}
    for name, r in best.items():
        if name.startswith("kiln") and base is not None:
            base_r = best[base]
            speedup, peak_ratio = (
                r["output_tokens_per_s"] / base_r["output_tokens_per_s"],
                r["peak_mb"] / base_r["peak_mb"],
            )
            summary[name] = {
                "speedup": speedup,
                "round_speedups": [
                    k["output_tokens_per_s"] / h["output_tokens_per_s"] for k, h in zip(rounds[name], rounds[base])
                ],
                "peak_ratio": peak_ratio,
                "meets_target": speedup >= args.target and (args.no_memory_target or peak_ratio <= 1),
            }
    print(
        f"\n{'system':<20}{'dtype':<10}{'out tok/s':>11}{'seconds':>10}{'peak MB':>10}{'speedup':>9}{'peak ratio':>12}"
    )
    for name, r in best.items():
        ratios = f"{summary[name]['speedup']:>8.2f}x{summary[name]['peak_ratio']:>11.2f}x" if name in summary else ""
        print(
            f"{name:<20}{r['dtype']:<10}{r['output_tokens_per_s']:>11.1f}{r['seconds']:>10.1f}{r['peak_mb']:>10.0f}{ratios}"
        )
    if summary:
        if args.repeats > 1:
            print(f"\neach round against its own {base} run:")
            for name, s in summary.items():
                ratios = s["round_speedups"]
                met = sum(x >= args.target for x in ratios)
                print(
                    f"{name:<20}{', '.join(f'{x:.2f}x' for x in ratios)}  (at {args.target:g}x or more: {met} of {len(ratios)})"
                )
        met = [name for name, s in summary.items() if s["meets_target"]] or ["none"]
        memory = "" if args.no_memory_target else " at no more peak memory"
        print(f"\nbaseline: {base}; target (>= {args.target:g}x its tokens/s{memory}) met by: {', '.join(met)}")
        summary = {"baseline": base, "kiln": summary}
    results = RESULTS if args.device in ("auto", "cpu") else RESULTS.with_stem(f"{RESULTS.stem}_{args.device}")
    results = args.results or results
    workload = {k: getattr(args, k) for k in (*WORKER_FLAGS, "repeats")}
    save_results(results, {"workload": workload, "results": best, "rounds": rounds, "summary": summary})


if __name__ == "__main__":
    main()
