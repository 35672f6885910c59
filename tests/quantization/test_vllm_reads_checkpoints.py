"""Checkpoints written by ``kiln quantize`` served by vLLM (the CPU build, a peer outside the repo:
``../shared/peers/vllm_cpu.sh setup``): vLLM picks the matching scheme and its greedy text equals
Kiln's on the same checkpoint. Skipped, saying why, where the peer is not set up."""

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from kiln import LLM, SamplingParams
from kiln.cli import main

VLLM = Path(os.environ.get("PEERS", Path.home() / ".cache" / "kiln-peers")) / "vllm-venv" / "bin" / "vllm"
pytestmark = pytest.mark.skipif(not VLLM.exists(), reason=f"vLLM-CPU peer not set up ({VLLM} missing)")
PROMPT = "The capital of France is"
CALIBRATION = ["--num-calibration-samples", "8", "--seq-len", "128", "-t", "bf16"]


def vllm_greedy(model: str, dtype: str, port: int) -> tuple[str, str]:
    """vLLM's greedy text for PROMPT and its log; the server is stopped by its id."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1"}  # fmt: skip
    cmd = [str(VLLM), "serve", model, "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--max-model-len", "512"]  # fmt: skip
    log = Path(model) / "vllm.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        for _ in range(300):
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(1)
        body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {"content-type": "application/json"}
        )
        text = json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]["text"]
        return text, log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.parametrize(
    "quant_type,args,dtype,scheme",
    [
        ("smooth_quant", [], "float32", "CompressedTensorsW8A8Int8"),
        ("awq", ["--group-size", "32"], "bfloat16", "awq"),
        ("gptq", ["--group-size", "32"], "bfloat16", "gptq"),  # vLLM 0.32 refuses act-order and zero points
        ("gptq", ["--group-size", "32", "--act-order", "--static-groups"], "bfloat16", "gptq"),  # groups in order
    ],
)
def test_vllm_serves_the_checkpoint_like_kiln(default_model_dir, tmp_path, quant_type, args, dtype, scheme):
    out = str(tmp_path / quant_type)
    assert main(["quantize", "-i", default_model_dir, "-o", out, "-quant_type", quant_type, *CALIBRATION, *args]) == 0
    kiln = LLM(out, max_model_len=512, dtype=dtype).generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))
    text, log = vllm_greedy(out, dtype, 8190)
    assert scheme in log
    assert text == kiln[0].outputs[0].text
