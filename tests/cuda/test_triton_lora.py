"""The CUDA plugin's LoRA kernels (kiln_cuda.lora): strided rows, split-K and the engine with a mix
of adapters and the base model through them matching the CPU plugin token for token (the op against
the reference over many shapes: LoRAOpsContract in test_ops_contract.py). On GPU
where one is present, else under Triton's interpreter on CPU tensors (tests/conftest.py)."""

from __future__ import annotations

import sys

import pytest
import torch

import kiln
from kiln.interfaces.lora import LoRAMapping
from kiln.interfaces.lora import add_lora as reference
from kiln_cuda import ops
from kiln_cuda.lora import add_lora, split_k

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_case(dtype, slices, rank, inputs, bias, slots, query_lens, seed=0):
    """Three slots of rank ``rank`` whose adapters use only half of it (the rest zero-padded)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(3, len(slices) * rank, inputs, generator=gen)
    for i in range(len(slices)):
        a[:, i * rank + rank // 2 : (i + 1) * rank] = 0
    b = torch.randn(3, sum(slices), rank, generator=gen)
    b[:, :, rank // 2 :] = 0
    lora_bias = torch.randn(3, sum(slices), generator=gen) if bias else None
    x = torch.randn(sum(query_lens), inputs, generator=gen)
    y = torch.randn(sum(query_lens), sum(slices), generator=gen)
    on = dict(dtype=dtype, device=DEVICE)
    tensors = [t.to(**on) for t in (y, x, a, b)] + [None if lora_bias is None else lora_bias.to(**on)]
    return tensors, LoRAMapping.of(slots, query_lens, torch.device(DEVICE))


def test_strided_rows_and_a_new_mapping_each_step():
    """y and x as column views of wider buffers (a fused projection's output), and one mapping
    after another: the cached token groups follow the mapping."""
    (y, x, a, b, _), first = random_case(torch.float32, (48, 16), 8, 32, False, [0, 1], [3, 2])
    wide_y = torch.randn(5, 80, device=DEVICE)
    wide_y[:, 8:72] = y
    want = reference(y.clone(), x, a, b, None, first, (48, 16))
    view = wide_y[:, 8:72]
    assert add_lora(view, x, a, b, None, first, (48, 16)) is view
    torch.testing.assert_close(wide_y[:, 8:72], want, atol=1e-4, rtol=1e-5)
    second = LoRAMapping.of([-1, 2], [3, 2], torch.device(DEVICE))
    torch.testing.assert_close(
        add_lora(y.clone(), x, a, b, None, second, (48, 16)), reference(y.clone(), x, a, b, None, second, (48, 16))
    )


def test_split_k_only_where_few_tiles_face_a_long_reduction():
    assert split_k(programs=2, inputs=1000, block_k=64) == 3  # the contract's 1000-input case: 384, 384, 232
    assert split_k(programs=2, inputs=4096, block_k=64) == 16
    assert split_k(programs=256, inputs=4096, block_k=64) == 1  # a prefill's tiles fill the GPU
    assert split_k(programs=1, inputs=64, block_k=64) == 1


def test_registered_as_a_custom_op():
    assert ops.fused_ops()["add_lora"] is add_lora


# ---------------------------------------------------------------- the whole engine

lora_calls: list[int] = []


def counted_add_lora(*args):
    lora_calls.append(1)
    return add_lora(*args)


def make_triton_on_cpu():
    """The CPU platform running the CUDA plugin's kernels and attention (under the interpreter)."""
    from kiln_cpu.platform import CpuPlatform

    class Platform(CpuPlatform):
        name = "cpu_triton_lora"

        def attention_backend(self) -> str:
            return "triton"

        def custom_ops(self):
            return {**ops.fused_ops(), "add_lora": counted_add_lora}

        def process_weights(self, model, config) -> None:
            pass

    return Platform()


@kiln.hookimpl
def register_platforms(register) -> None:
    from kiln.platforms.base import PlatformSpec

    register(PlatformSpec("cpu_triton_lora", make_triton_on_cpu, is_available=lambda: True))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the interpreter path on CPU")
def test_mixed_adapters_through_triton_match_the_cpu_plugin(tiny_model_dir, kiln_plugins, tmp_path):
    import kiln_cpu.plugin
    import kiln_cuda.plugin
    from kiln import LoRARequest
    from kiln.testing.engine import greedy_tokens
    from kiln.testing.lora import build_lora_adapter

    for module, name in ((kiln_cpu.plugin, "cpu"), (kiln_cuda.plugin, "cuda"), (sys.modules[__name__], "test")):
        kiln_plugins.register(module, name=name)
    base = tiny_model_dir("llama")
    adapters = [
        LoRARequest("r8", 1, build_lora_adapter(base, tmp_path / "r8", rank=8, seed=1)),
        LoRARequest("r4", 2, build_lora_adapter(base, tmp_path / "r4", rank=4, seed=2, targets=["q_proj", "v_proj",
                                                                                               "down_proj"])),
    ]  # fmt: skip
    # A prefill chunk under a block, one of a block and a tail; each prompt under each adapter and the base.
    prompts = [[1000, 7, 9], list(range(100, 119))]
    batch = [(p, lora) for p in prompts for lora in (adapters[0], None, adapters[1])]
    common = dict(model=base, dtype="float32", block_size=16, enable_lora=True, max_loras=2, max_lora_rank=8)
    args = ([p for p, _ in batch], 6, [lora for _, lora in batch])
    lora_calls.clear()
    triton_run = greedy_tokens(kiln_plugins, *args, device="cpu_triton_lora", **common)
    assert lora_calls  # the steps with adapters went through the Triton kernels
    assert triton_run == greedy_tokens(kiln_plugins, *args, device="cpu", **common)
    assert triton_run[0] != triton_run[1] != triton_run[2]  # each adapter changes the output


@pytest.mark.cuda
def test_mixed_adapters_on_the_gpu_match_the_cpu_plugin(tiny_model_dir, kiln_plugins, tmp_path):
    """On a GPU: steps with adapters run eagerly through the kernels, steps without one replay the
    CUDA graphs captured for the base model; both give the CPU plugin's tokens."""
    import kiln_cpu.plugin
    import kiln_cuda.plugin
    from kiln import LoRARequest
    from kiln.testing.engine import make_engine, run_greedy
    from kiln.testing.lora import build_lora_adapter

    kiln_plugins.register(kiln_cpu.plugin, name="cpu")
    kiln_plugins.register(kiln_cuda.plugin, name="cuda")
    base = tiny_model_dir("llama")
    lora = LoRARequest("r8", 1, build_lora_adapter(base, tmp_path / "r8", rank=8, seed=1))
    prompts, loras = [[1000, 7, 9], list(range(100, 119)), list(range(2000, 2077))], [lora, None, lora]
    common = dict(model=base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8)
    gpu, cpu = make_engine(kiln_plugins, device="cuda", **common), make_engine(kiln_plugins, device="cpu", **common)
    assert run_greedy(gpu, prompts, 8, loras) == run_greedy(cpu, prompts, 8, loras)
    assert gpu.executor.runner.graph_steps == 0  # every step held an adapter
    assert run_greedy(gpu, prompts[1:]) == run_greedy(cpu, prompts[1:])
    assert gpu.executor.runner.graph_steps > 0
