"""Embedding throughput: Kiln offline (``--task embed``) versus Hugging Face transformers on the same
model and machine, in one run.

Workload (issue 20): 256 inputs of 128 random tokens, embedded in batches of 32 (each system gets
the same batches, one call per batch), last-token pooling, L2-normalised: the default model served
with ``kiln serve --task embed``. Each system runs in its own process, one after the other (two torch
processes on the same cores slow each other down), and reports inputs/s, tokens/s and its peak RSS.
transformers runs in fp32 and bf16 and the faster is the baseline (target: Kiln >= 1.5x); Kiln's
first embeddings are checked against transformers fp32 (cosine).

    python bench/embeddings.py [--repeats 3] [--num-inputs 256] [--systems kiln,hf-float32,hf-bfloat16]

Prints a table and writes ``bench/results/embeddings.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from offline_throughput import make_prompts, peak_mb, save_results

RESULTS = Path(__file__).parent / "results" / "embeddings.json"
WORKER_FLAGS = ("num_inputs", "input_len", "batch_size", "max_num_batched_tokens", "kiln_dtype")
DEFAULT_SYSTEMS = "kiln,kiln-bfloat16,hf-float32,hf-bfloat16"  # kiln-DTYPE: Kiln with --dtype DTYPE
CHECKED = 4  # embeddings returned to the parent for the cosine check


def run_kiln(args: argparse.Namespace) -> dict:
    from kiln import LLM

    llm = LLM(
        args.model,
        task="embed",
        dtype=args.worker.removeprefix("kiln-") if args.worker.startswith("kiln-") else args.kiln_dtype,
        max_model_len=max(512, args.input_len),
        max_num_batched_tokens=args.max_num_batched_tokens,
        device="cpu",
    )
    tok = llm.get_tokenizer()
    prompts = make_prompts(args.num_inputs, args.input_len, len(tok), set(tok.all_special_ids))
    llm.embed([{"prompt_token_ids": p} for p in prompts[: args.batch_size]])  # warm-up: a whole batch's shapes
    embeddings = []
    start = time.perf_counter()
    for i in range(0, len(prompts), args.batch_size):
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts[i : i + args.batch_size]])
        embeddings.extend(o.outputs.embedding for o in outs)
    elapsed = time.perf_counter() - start
    assert len(embeddings) == len(prompts)
    return {"seconds": elapsed, "dtype": str(llm.engine.dtype).removeprefix("torch."), "first": embeddings[:CHECKED]}


def run_hf(args: argparse.Namespace, dtype: str) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel, AutoTokenizer

    from kiln.models.loader import transformers_model

    tok = AutoTokenizer.from_pretrained(args.model)
    model = transformers_model(AutoModel, args.model, dtype=getattr(torch, dtype)).eval()
    prompts = torch.tensor(make_prompts(args.num_inputs, args.input_len, len(tok), set(tok.all_special_ids)))
    embeddings = []
    with torch.inference_mode():
        model(prompts[: args.batch_size])  # warm-up: a whole batch's shapes
        start = time.perf_counter()
        for i in range(0, len(prompts), args.batch_size):
            hidden = model(prompts[i : i + args.batch_size]).last_hidden_state[:, -1]  # no padding: all 128 long
            embeddings.extend(F.normalize(hidden.float(), dim=-1).tolist())
        elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "dtype": dtype, "first": embeddings[:CHECKED]}


def worker(args: argparse.Namespace) -> None:
    load = os.getloadavg()[0]
    result = run_kiln(args) if args.worker.startswith("kiln") else run_hf(args, args.worker.removeprefix("hf-"))
    result.update(
        system=args.worker,
        inputs_per_s=args.num_inputs / result["seconds"],
        tokens_per_s=args.num_inputs * args.input_len / result["seconds"],
        peak_mb=peak_mb("cpu"),
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


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / ((sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded default model)")
    parser.add_argument("--num-inputs", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32, help="inputs per call, for both systems")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=4096, help="Kiln's step budget (default: one batch per step)"
    )
    parser.add_argument("--kiln-dtype", default="auto", help="Kiln's --dtype (auto: the platform's fastest)")
    parser.add_argument("--systems", default=DEFAULT_SYSTEMS, help="from kiln, kiln-DTYPE, hf-float32, hf-bfloat16")
    parser.add_argument("--repeats", type=int, default=1, help="best of N runs per system")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from kiln.models.loader import resolve_model

        args.model = resolve_model(None, "auto").path
    if args.worker:
        worker(args)
        return
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name in args.systems.split(","):
            result = run_system(name, args)
            if name not in best or result["inputs_per_s"] > best[name]["inputs_per_s"]:
                best[name] = result
    report(args, best)


def report(args: argparse.Namespace, best: dict[str, dict]) -> None:
    hf = [r for name, r in best.items() if name.startswith("hf")]
    base = max(hf, key=lambda r: r["inputs_per_s"]) if hf else None
    reference = best.get("hf-float32")
    summary = {}
    for name, r in best.items():
        if name.startswith("kiln") and base is not None:
            speedup = r["inputs_per_s"] / base["inputs_per_s"]
            summary[name] = {"speedup": speedup, "meets_target": speedup >= 1.5}
            if reference is not None:
                summary[name]["min_cosine_vs_hf_float32"] = min(map(cosine, r["first"], reference["first"]))
    print(f"\n{'system':<14}{'dtype':<10}{'inputs/s':>10}{'tokens/s':>11}{'seconds':>9}{'peak MB':>9}{'speedup':>9}")
    for name, r in best.items():
        ratio = f"{r['inputs_per_s'] / base['inputs_per_s']:>8.2f}x" if base is not None else ""
        print(
            f"{name:<14}{r['dtype']:<10}{r['inputs_per_s']:>10.1f}{r['tokens_per_s']:>11.0f}"
            f"{r['seconds']:>9.2f}{r['peak_mb']:>9.0f}{ratio}"
        )
    if summary:
        met = [name for name, s in summary.items() if s["meets_target"]] or ["none"]
        cosines = ", ".join(f"{n} {s['min_cosine_vs_hf_float32']:.6f}" for n, s in summary.items() if len(s) > 2)
        print(f"\nbaseline: {base['system']}; target (>= 1.5x its inputs/s) met by: {', '.join(met)}")
        if cosines:
            print(f"min cosine of the first embeddings vs transformers fp32: {cosines}")
        summary = {"baseline": base["system"], "kiln": summary}
    for r in best.values():
        r.pop("first")
    workload = {k: getattr(args, k) for k in (*WORKER_FLAGS, "repeats")}
    save_results(RESULTS, {"workload": workload, "results": best, "summary": summary})


if __name__ == "__main__":
    main()
