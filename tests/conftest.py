"""Shared fixtures beyond those of Kiln's own pytest plugin (kiln.testing.pytest_plugin)."""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from pathlib import Path

import psutil
import pytest
import torch

# Without a GPU, the CUDA plugin's Triton kernels run under Triton's interpreter on CPU
# tensors; the switch must be set before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (``make test`` runs a worker per core), each worker takes its share of the
# cores for torch, the CPU plugin's OpenMP kernels and the servers it starts: more threads than
# cores make OpenMP's waiting threads fight over them.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1  # as xdist's -n auto and the CPU plugin count
    share = str(max(1, cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ["KILN_CPU_THREADS"] = os.environ["OMP_NUM_THREADS"] = share
    torch.set_num_threads(int(share))


# Files that take minutes, collected first: `make test` hands whole files to the workers in
# collection order (`--dist loadfile --no-loadscope-reorder`; xdist's default order is by test
# count, which put the longest file, with 6 tests, last: it then ran alone for minutes).
LONG_FILES = (
    "tests/quantization/test_quant_accuracy.py",
    "tests/quantization/test_vllm_reads_checkpoints.py",  # where the vLLM-CPU peer is set up
    "tests/cuda/test_triton_ops.py",
    "tests/ascend/test_ascend.py",
    "tests/cpu/test_int8_linear.py",
    "tests/core/test_lora.py",
    "tests/core/test_spec_decode.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONG_FILES)))  # stable: the rest as they were


@pytest.fixture(scope="session", autouse=True)
def shared_tokenizers():
    """Engines built in one pytest process share each tokenizer, loaded by Kiln's own loader the
    first time: loading SmolLM2's (49k tokens, which the tiny test models copy) takes ~0.3 s, a
    fifth of a typical tiny-model test. The key is the folder's tokenizer files by content (each
    tiny model has a copy) and the model type, which picks the tokenizer class; the tests of the
    loader call it directly."""
    from kiln.engine import llm_engine
    from kiln.engine.tokenizer import load_tokenizer

    loaded: OrderedDict[tuple, object] = OrderedDict()

    def load(path: str, mode: str, trust_remote_code: bool = False):
        folder = Path(path)
        if not folder.is_dir():
            return load_tokenizer(path, mode, trust_remote_code)
        digest = hashlib.sha256()
        for f in sorted(folder.iterdir()):
            if f.is_file() and f.name != "config.json" and f.suffix not in (".safetensors", ".bin", ".gguf", ".pt"):
                digest.update(f.name.encode() + b"\0" + f.read_bytes())
        config = folder / "config.json"
        model_type = json.loads(config.read_text()).get("model_type") if config.exists() else None
        key = (digest.hexdigest(), model_type, mode, trust_remote_code)
        if key not in loaded:
            loaded[key] = load_tokenizer(path, mode, trust_remote_code)
            if len(loaded) > 8:
                loaded.popitem(last=False)
        loaded.move_to_end(key)
        return loaded[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llm_engine, "load_tokenizer", load)
        yield


@pytest.fixture(scope="session")
def varied_prompts() -> list[list[int]]:
    """Mixed lengths: shorter than a block, exactly blocks, several blocks plus a tail."""
    return [
        [1000],
        [5, 6, 7, 8, 9] * 3,
        list(range(100, 132)),
        list(range(2000, 2077)),
        [42] * 40 + list(range(300, 313)),
    ]


@pytest.fixture
def cpu_plugins(kiln_plugins):
    """The test plugin manager with the CPU plugin registered."""
    import kiln_cpu.plugin

    kiln_plugins.register(kiln_cpu.plugin, name="cpu")
    return kiln_plugins
