"""Quantized serving on the default model: fp32 against each ``kiln quantize`` method, in one run.

Each method's checkpoint is made once from the default model's fp32 copy (cached under
``$KILN_CACHE_DIR/bench-quant``). Every system runs in its own process, one after the
other: offline generation of 256-token prompts, 128 new tokens each (``ignore_eos``,
greedy), at concurrency 1 (4 prompts, ``max_num_seqs=1``) and 16 (32 prompts,
``max_num_seqs=16``). Reported: output tok/s for both, the weights' memory as the
model holds them after loading, peak RSS, and perplexity on the tests' held-out text.

"fp32" is the default model's fp32 copy as Kiln serves it: its values came from GGUF
Q4_1/Q8_0 blocks, which the CPU plugin recovers and computes on (``find_gguf_form``).
"fp32-dense" turns that off (``KILN_CPU_GGUF_BLOCKS=0``): fp32 tiles, the true fp32 baseline.

    python bench/quantization.py [--systems fp32-dense,fp32,weight_only_int8,smooth_quant,awq,gptq]

Prints a table and writes ``bench/results/quantization.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "quantization.json"
HELDOUT = ROOT / "tests" / "data" / "heldout.txt"
CALIBRATION = ["--num-calibration-samples", "32", "--seq-len", "128"]
METHODS = {  # kiln quantize arguments per method (the default model's 576 inputs take groups of 64 at most)
    "weight_only_int8": [],
    "smooth_quant": CALIBRATION,
    "awq": [*CALIBRATION, "--group-size", "32"],
    "gptq": [*CALIBRATION, "--group-size", "32", "--act-order", "--static-groups", "--no-sym"],
}
SYSTEMS = ["fp32-dense", "fp32", *METHODS]


def checkpoint(name: str, fp32_path: str) -> str:
    """The model folder a system serves, quantizing it on first use."""
    if name.startswith("fp32"):
        return fp32_path
    from kiln.interfaces.platform import cache_dir

    args = METHODS[name]
    # keyed by what made it: the source model, the arguments and the quantization code
    key = hashlib.sha1(" ".join([fp32_path, *args]).encode())
    for source in sorted((ROOT / "core" / "src" / "kiln" / "quantization").glob("*.py")):
        key.update(source.read_bytes())
    out = cache_dir() / "bench-quant" / f"{name}-{key.hexdigest()[:8]}"
    if not (out / "config.json").exists():
        cmd = [sys.executable, "-m", "kiln.cli", "quantize", "-i", fp32_path, "-o", str(out), "-quant_type", name]
        subprocess.run([*cmd, *args, "--overwrite"], check=True, stdout=subprocess.DEVNULL)
    return str(out)


def weight_bytes(model) -> int:
    """Bytes of every distinct tensor the model's modules hold (parameters and repacked forms),
    less the rotary cos/sin table, which is not a weight."""
    import torch

    seen, total = {model.rope_cache.data_ptr()}, 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        elif dataclasses.is_dataclass(t) and not isinstance(t, type):
            for f in dataclasses.fields(t):
                add(getattr(t, f.name))

    for module in model.modules():
        for value in [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]:
            add(value)
    return total


def worker(path: str, concurrency: int) -> dict:
    """Generation at ``concurrency`` (4 prompts at 1, else 2 per slot); at 16 also the weights'
    memory and perplexity."""
    import random

    from kiln import LLM, SamplingParams
    from kiln.quantization.evaluate import perplexity

    llm = LLM(path, max_model_len=512, max_num_seqs=concurrency)
    tok = llm.get_tokenizer()
    rng = random.Random(0)
    special = set(tok.all_special_ids)
    allowed = [t for t in range(len(tok)) if t not in special]
    count = 4 if concurrency == 1 else 2 * concurrency
    prompts = [{"prompt_token_ids": [rng.choice(allowed) for _ in range(256)]} for _ in range(count)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, ignore_eos=True))
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=128, ignore_eos=True, temperature=0))
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == 128 for o in outs)
    result = {f"tok_s_c{concurrency}": count * 128 / elapsed}
    if concurrency > 1:
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        result["weight_mb"] = weight_bytes(llm.engine.executor.runner.model) / 2**20
        result["perplexity"] = perplexity(llm, HELDOUT.read_text())
    return result


def run_system(name: str, path: str) -> dict:
    env = {**os.environ, **({"KILN_CPU_GGUF_BLOCKS": "0"} if name == "fp32-dense" else {})}
    result = {"system": name}
    for concurrency in (1, 16):
        cmd = [sys.executable, __file__, "--worker", path, "--concurrency", str(concurrency)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        result.update(json.loads(lines[-1].removeprefix("RESULT ")))
    return result


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"from {', '.join(SYSTEMS)}")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--concurrency", type=int, default=16, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.concurrency)), flush=True)
        return
    from kiln.models.loader import resolve_model

    fp32_path = resolve_model(None, "auto").path
    rows = [run_system(name, checkpoint(name, fp32_path)) for name in args.systems.split(",")]
    base = next((r for r in rows if r["system"] == "fp32-dense"), rows[0])
    header = f"{'system':<18}{'tok/s c1':>10}{'x':>7}{'tok/s c16':>11}{'x':>7}{'weights MB':>12}{'x':>7}{'peak RSS MB':>13}{'ppl':>9}"
    print(header)
    for r in rows:
        print(
            f"{r['system']:<18}{r['tok_s_c1']:>10.1f}{r['tok_s_c1'] / base['tok_s_c1']:>7.2f}"
            f"{r['tok_s_c16']:>11.1f}{r['tok_s_c16'] / base['tok_s_c16']:>7.2f}"
            f"{r['weight_mb']:>12.1f}{r['weight_mb'] / base['weight_mb']:>7.2f}{r['peak_rss_mb']:>13.0f}"
            f"{r['perplexity']:>9.3f}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    machine = {"cpu": platform.processor() or platform.machine(), "flags": cpu_flags(), "cores": os.cpu_count()}
    RESULTS.write_text(json.dumps({"machine": machine, "baseline": base["system"], "rows": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
