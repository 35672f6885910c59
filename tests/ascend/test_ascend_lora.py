"""Multi-LoRA on the Ascend path (the emulation of torch_npu): ``kiln_ascend.lora.add_lora``
through ``npu_grouped_matmul`` matches the reference op, the grouped matmul's emulation keeps
the real op's rules, and an engine mixing adapters and the base model gives the CPU plugin's
tokens, eagerly and with torchair graphs for the steps without adapters."""

from __future__ import annotations

import pytest
import torch
from tests.ascend import fake_torch_npu, test_ascend

from kiln.interfaces.lora import LoRAMapping
from kiln.interfaces.lora import add_lora as reference
from kiln_ascend import ops
from kiln_ascend.lora import add_lora

# test_ascend.py's fixtures: the emulation installed as torch_npu and torchair (autouse), and the
# plugins with the "npu_emulated" platform (the Ascend platform with its device calls on the CPU).
emulated_torch_npu = test_ascend.emulated_torch_npu
npu_plugins = test_ascend.npu_plugins

TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-5),
    torch.float16: dict(atol=2e-2, rtol=2e-3),
    torch.bfloat16: dict(atol=1e-1, rtol=1.6e-2),
}


def random_case(dtype, slices, rank, inputs, bias, slots, query_lens, num_slots=3):
    """``num_slots`` slots of rank ``rank`` whose adapters use only half of it (the rest zero-padded)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(num_slots, len(slices) * rank, inputs, generator=gen)
    for i in range(len(slices)):
        a[:, i * rank + rank // 2 : (i + 1) * rank] = 0
    b = torch.randn(num_slots, sum(slices), rank, generator=gen)
    b[:, :, rank // 2 :] = 0
    lora_bias = torch.randn(num_slots, sum(slices), generator=gen) if bias else None
    x = torch.randn(sum(query_lens), inputs, generator=gen)
    y = torch.randn(sum(query_lens), sum(slices), generator=gen)
    tensors = [t.to(dtype) for t in (y, x, a, b)] + [None if lora_bias is None else lora_bias.to(dtype)]
    return tensors, LoRAMapping.of(slots, query_lens, torch.device("cpu"))


@pytest.mark.parametrize("slices", [(40,), (96, 32, 32)], ids=["one", "qkv"])
def test_one_grouped_matmul_for_the_shrink_and_one_per_slice(slices):
    """The op against the reference over many shapes: LoRAOpsContract (test_ascend_platform_contract.py)."""
    (y, x, a, b, lora_bias), mapping = random_case(torch.float32, slices, 8, 64, True, [2, -1, 0], [5, 17, 1])
    got = add_lora(y.clone(), x, a, b, lora_bias, mapping, slices)
    torch.testing.assert_close(got, reference(y.clone(), x, a, b, lora_bias, mapping, slices), **TOL[torch.float32])
    assert fake_torch_npu.calls == ["npu_grouped_matmul"] * (1 + len(slices))


def test_one_slot_of_one():
    """max_loras 1: a group_list of one cumulative end (allowed for group_list_type 0 only)."""
    (y, x, a, b, _), mapping = random_case(torch.float32, (24,), 4, 16, False, [0, -1], [3, 2], num_slots=1)
    torch.testing.assert_close(add_lora(y.clone(), x, a, b, None, mapping, (24,)), reference(y, x, a, b, None,
                                                                                              mapping, (24,)))  # fmt: skip


def test_registered_as_a_custom_op():
    assert ops.fused_ops()["add_lora"] is add_lora


# ---------------------------------------------------------------- the grouped matmul's emulation


def test_grouped_matmul_emulation_matches_matmuls_per_group():
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(9, 16, generator=gen), torch.randn(4, 16, 8, generator=gen)
    ends = [2, 2, 7, 9]  # group 1 is empty
    want = torch.cat([x[s:e] @ w[i] for i, (s, e) in enumerate(zip([0, *ends[:-1]], ends))])
    gmm = fake_torch_npu.npu_grouped_matmul
    single = gmm([x], [w], group_list=torch.tensor(ends), split_item=3, group_type=0, group_list_type=0)
    torch.testing.assert_close(single[0], want)
    sizes = torch.tensor([2, 0, 5, 2])
    transposed = w.transpose(1, 2).contiguous().transpose(1, 2)  # stored (E, N, K), read as (E, K, N)
    by_size = gmm([x], [transposed], group_list=sizes, split_item=2, group_type=0, group_list_type=1)
    torch.testing.assert_close(by_size[0], want)
    half = [t.half() for t in w]
    bias = [torch.randn(8, generator=gen).half() for _ in half]
    listed = gmm([x.half()], half, bias=bias, group_list=torch.tensor(ends), split_item=3, group_type=0)
    want_half = torch.cat([(x[s:e].half().float() @ half[i].float() + bias[i].float()).half()
                           for i, (s, e) in enumerate(zip([0, *ends[:-1]], ends))])  # fmt: skip
    torch.testing.assert_close(listed[0], want_half)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("sizes of one group", "group sizes"),
        ("fp32 weight list", "float32"),
        ("strided weight", "transpose of a contiguous"),
        ("bf16 bias in bf16", "bias must be"),
        ("ends short of m", "cumulative group ends"),
        ("x transposed", "contiguous only"),
    ],
)
def test_grouped_matmul_emulation_refuses_what_the_op_refuses(case, message):
    x, w = torch.randn(6, 16), torch.randn(2, 16, 8)
    ends, kw = torch.tensor([3, 6]), dict(split_item=3, group_type=0)
    args = {
        "sizes of one group": ([x], [w[:1]], dict(group_list=torch.tensor([6]), group_list_type=1)),
        "fp32 weight list": ([x], list(w), dict(group_list=ends)),
        "strided weight": ([x], [torch.randn(2, 16, 12)[:, :, :8]], dict(group_list=ends)),
        "bf16 bias in bf16": ([x.bfloat16()], list(w.bfloat16()), dict(group_list=ends,
                                                                        bias=[torch.zeros(8).bfloat16()] * 2)),
        "ends short of m": ([x], [w], dict(group_list=torch.tensor([3, 5]))),
        "x transposed": ([torch.randn(16, 6).T], [w], dict(group_list=ends)),
    }[case]  # fmt: skip
    with pytest.raises(AssertionError, match=message):
        fake_torch_npu.npu_grouped_matmul(args[0], args[1], **kw, **args[2])


# ---------------------------------------------------------------- the whole engine


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    from kiln import LoRARequest
    from kiln.testing.lora import build_lora_adapter

    base = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("ascend-loras")
    return base, [
        LoRARequest("r8", 1, build_lora_adapter(base, root / "r8", rank=8, seed=1)),
        LoRARequest("r4", 2, build_lora_adapter(base, root / "r4", rank=4, seed=2, targets=["q_proj", "v_proj",
                                                                                           "down_proj"])),
    ]  # fmt: skip


def mixed(prompts, loras):
    """Each prompt under each adapter and the base model: (prompts, per-prompt LoRARequest or None)."""
    batch = [(p, lora) for p in prompts for lora in (loras[0], None, loras[1])]
    return [p for p, _ in batch], [lora for _, lora in batch]


LORA = dict(dtype="float32", max_num_batched_tokens=64, enable_lora=True, max_loras=2, max_lora_rank=8)


def test_mixed_adapters_on_the_ascend_path_match_the_cpu_plugin(adapters, npu_plugins, varied_prompts):
    """Chunked prefills (64-token budget) and decodes, adapters and the base model in one batch."""
    from kiln.testing.engine import greedy_tokens

    base, loras = adapters
    prompts, per_prompt = mixed(varied_prompts[1:4], loras)
    npu_run = greedy_tokens(npu_plugins, prompts, 8, per_prompt, model=base, device="npu_emulated", block_size=64,
                            enforce_eager=True, **LORA)  # fmt: skip
    assert "npu_grouped_matmul" in fake_torch_npu.calls
    assert npu_run == greedy_tokens(npu_plugins, prompts, 8, per_prompt, model=base, device="cpu", block_size=16,
                                    **LORA)  # fmt: skip
    assert npu_run[0] != npu_run[1] != npu_run[2]  # each adapter changes the output


def test_steps_with_adapters_run_eagerly_beside_torchair_graphs(adapters, npu_plugins, varied_prompts):
    """Graph mode with --enable-lora: the gears are compiled for the base model; steps with an
    adapter run eagerly through the grouped matmul, steps without one replay the graphs."""
    from kiln.testing.engine import make_engine, run_greedy

    base, loras = adapters
    prompts, per_prompt = mixed(varied_prompts[:2], loras)
    common = dict(model=base, max_num_seqs=8, **LORA)
    engine = make_engine(npu_plugins, device="npu_emulated", block_size=64, **common)
    cpu = make_engine(npu_plugins, device="cpu", block_size=16, **common)
    assert engine.executor.runner.graph_sizes  # torchair gears
    assert run_greedy(engine, prompts, 8, per_prompt) == run_greedy(cpu, prompts, 8, per_prompt)
    assert engine.executor.runner.graph_steps == 0  # every step held an adapter
    base_only = varied_prompts[2:4]
    assert run_greedy(engine, base_only) == run_greedy(cpu, base_only)
    assert engine.executor.runner.graph_steps > 0
