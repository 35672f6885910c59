"""Multi-LoRA: a batch mixing several PEFT adapters and the base model gives, per request,
transformers' greedy tokens with that adapter merged into the base weights by PEFT."""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch

from kiln import LLM, LoRARequest, SamplingParams
from kiln.config import EngineConfig
from kiln.interfaces.lora import LoRAMapping, add_lora
from kiln.testing.lora import build_lora_adapter, hf_lora_greedy

NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0)
# Four adapters of different shapes: ranks, targets, rsLoRA, per-module rank and alpha.
ADAPTERS = {
    "r8-all": dict(rank=8, seed=1),
    "r4-some-rslora": dict(rank=4, seed=2, targets=["q_proj", "v_proj", "down_proj"], use_rslora=True),
    "r16-patterns": dict(rank=16, seed=3, rank_pattern={"o_proj": 2}, alpha_pattern={"down_proj": 4}),
    "r8-mlp": dict(rank=8, seed=4, targets=["gate_proj", "up_proj"]),
}
VARIANTS = {
    "default": dict(max_loras=4),
    # Two slots for four adapters and one adapter kept on the host: slots are reused, adapters reread.
    "two-slots": dict(max_loras=2, max_cpu_loras=2),
    "chunked-prefill-tiny-budget": dict(max_loras=4, max_num_batched_tokens=16),
    "forced-preemption": dict(max_loras=4, block_size=16, num_gpu_blocks_override=13, max_model_len=160),
    "reference-attention": dict(max_loras=3, attention_backend="torch_ref"),
}


@pytest.fixture(scope="module")
def llama_loras(tiny_model_dir, tmp_path_factory, varied_prompts):
    """The base, its adapters, and the reference tokens per (adapter or None, prompt)."""
    base = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("loras")
    paths = {name: build_lora_adapter(base, root / name, **kw) for name, kw in ADAPTERS.items()}
    expected = {name: hf_lora_greedy(base, paths.get(name), varied_prompts, NEW_TOKENS) for name in [None, *paths]}
    return base, paths, expected


def mixed_requests(paths, prompts):
    """Every prompt under every adapter and the base, interleaved."""
    loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(paths.items())}
    return [(name, loras.get(name), i, p) for i, p in enumerate(prompts) for name in [None, *paths]]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mixed_adapters_match_peft(llama_loras, varied_prompts, variant):
    base, paths, expected = llama_loras
    flags = {"max_model_len": 256, **VARIANTS[variant]}
    llm = LLM(base, dtype="float32", enable_lora=True, max_lora_rank=16, **flags)
    batch = mixed_requests(paths, varied_prompts)
    outputs = llm.generate([{"prompt_token_ids": p} for *_, p in batch], GREEDY, lora_request=[r for _, r, *_ in batch])
    for (name, lora, i, _), out in zip(batch, outputs):
        assert out.outputs[0].token_ids == expected[name][i], (name, i)
        assert out.lora_request == lora
    assert all(expected[name] != expected[None] for name in paths)  # each adapter changes the output
    if variant == "forced-preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0
    if variant == "two-slots":  # four adapters went through two slots; two stay on the host
        slots = llm.engine.executor.runner.lora
        assert slots.loads >= 4 and len(slots.cache) == 2


def test_adapters_keep_apart_in_the_prefix_cache(llama_loras, varied_prompts):
    base, paths, expected = llama_loras
    llm = LLM(base, dtype="float32", enable_lora=True, max_lora_rank=16, block_size=16)
    prompt = {"prompt_token_ids": varied_prompts[3]}  # 77 tokens: 4 full blocks
    lora = LoRARequest("r8-all", 1, paths["r8-all"])
    first = llm.generate(prompt, GREEDY)[0]
    adapted = llm.generate(prompt, GREEDY, lora_request=lora)[0]
    again = llm.generate(prompt, GREEDY, lora_request=lora)[0]
    assert first.outputs[0].token_ids == expected[None][3]
    assert adapted.num_cached_tokens == 0  # the base model's blocks hold other K/V
    assert again.num_cached_tokens == 64 and again.outputs[0].token_ids == expected["r8-all"][3]


def test_at_most_max_loras_adapters_run_at_once(llama_loras, varied_prompts):
    base, paths, expected = llama_loras
    llm = LLM(base, dtype="float32", enable_lora=True, max_lora_rank=16, max_loras=1)
    batch = mixed_requests(paths, varied_prompts[:2])
    for j, (_, lora, _, p) in enumerate(batch):
        llm.engine.add_request(str(j), {"prompt_token_ids": p}, GREEDY, lora_request=lora)
    done, most = {}, 0
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        running = llm.engine.core.scheduler.running
        most = max(most, len({r.lora_request for r in running if r.lora_request is not None}))
    assert most == 1
    assert [done[str(j)] for j in range(len(batch))] == [expected[name][i] for name, _, i, _ in batch]


def test_a_stream_on_one_adapter_does_not_starve_another(llama_loras, varied_prompts):
    from kiln.engine.scheduler import LORA_PATIENCE

    base, paths, expected = llama_loras
    llm = LLM(base, dtype="float32", enable_lora=True, max_lora_rank=16, max_loras=1, max_num_seqs=8)
    a, b = LoRARequest("r8-all", 1, paths["r8-all"]), LoRARequest("r8-mlp", 2, paths["r8-mlp"])
    engine = llm.engine
    engine.add_request("a0", {"prompt_token_ids": varied_prompts[0]}, GREEDY, lora_request=a)
    engine.add_request("b", {"prompt_token_ids": varied_prompts[1]}, GREEDY, lora_request=b)
    finished_at = None
    for step in range(10 * LORA_PATIENCE):  # requests on adapter a, overlapping: one every 4 steps
        if step % 4 == 0:
            engine.add_request(f"a{step + 1}", {"prompt_token_ids": varied_prompts[0]}, GREEDY, lora_request=a)
        for out in engine.step():
            if out.request_id == "b" and out.finished:
                finished_at, tokens = step, out.outputs[0].token_ids
        if finished_at is not None:
            break
    assert finished_at is not None and tokens == expected["r8-mlp"][1]


def test_two_ranks_match_peft(llama_loras, varied_prompts, cpu_plugins):
    from kiln.testing.engine import make_engine, run_greedy

    base, paths, expected = llama_loras
    batch = mixed_requests(paths, varied_prompts[:3])
    engine = make_engine(
        cpu_plugins, model=base, device="cpu", dtype="float32", tensor_parallel_size=2, enable_lora=True,
        max_lora_rank=16, max_loras=4,
    )  # fmt: skip
    try:
        got = run_greedy(engine, [p for *_, p in batch], NEW_TOKENS, [r for _, r, *_ in batch])
    finally:
        engine.shutdown()
    assert got == [expected[name][i] for name, _, i, _ in batch]
    assert multiprocessing.active_children() == []


def test_lora_bias_matches_peft(tiny_model_dir, tmp_path, varied_prompts):
    base = tiny_model_dir("qwen2")  # q/k/v have biases, which PEFT's lora_bias needs
    path = build_lora_adapter(base, tmp_path / "bias", rank=8, seed=5, targets=["q_proj", "k_proj", "v_proj"],
                              lora_bias=True)  # fmt: skip
    lora = LoRARequest("bias", 1, path)
    with pytest.raises(ValueError, match="--enable-lora-bias"):
        LLM(base, dtype="float32", enable_lora=True).generate("hi", GREEDY, lora_request=lora)
    llm = LLM(base, dtype="float32", enable_lora=True, enable_lora_bias=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in varied_prompts], GREEDY, lora_request=lora)
    assert [o.outputs[0].token_ids for o in outputs] == hf_lora_greedy(base, path, varied_prompts, NEW_TOKENS)


DEFAULT_PROMPTS = [[1, 4093, 314, 260, 3575, 282, 4649, 30], [1, 504, 2226, 5248, 314], [1, 33, 34, 35, 36, 37, 38]]


@pytest.fixture(scope="module")
def default_model_loras(default_model_dir, tmp_path_factory):
    """Four random adapters of ranks 8 and 64 on the default model, and PEFT's tokens for each."""
    root = tmp_path_factory.mktemp("default-loras")
    specs = {"r8a": dict(rank=8, seed=1), "r64": dict(rank=64, seed=2), "r8b": dict(rank=8, seed=3),
             "r64-attn": dict(rank=64, seed=4, targets=["q_proj", "k_proj", "v_proj", "o_proj"])}  # fmt: skip
    paths = {
        n: build_lora_adapter(default_model_dir, root / n, std=0.05, alpha=2 * kw["rank"], **kw)
        for n, kw in specs.items()
    }
    expected = {name: hf_lora_greedy(default_model_dir, paths.get(name), DEFAULT_PROMPTS, 8) for name in [None, *paths]}
    assert all(expected[name] != expected[None] for name in paths)
    return paths, expected


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    [{}, dict(max_num_batched_tokens=16), dict(block_size=8, num_gpu_blocks_override=5, max_model_len=32)],
    ids=["default", "chunked-prefill", "forced-preemption"],
)  # fmt: skip
def test_default_model_mixed_ranks_match_peft(default_model_dir, default_model_loras, variant):
    """(Its 9 heads do not split over two ranks: tensor parallelism is checked on the tiny model.)"""
    paths, expected = default_model_loras
    batch = mixed_requests(paths, DEFAULT_PROMPTS)
    llm = LLM(default_model_dir, quantization="none", dtype="float32", enable_lora=True, max_lora_rank=64, max_loras=4,
              **variant)  # fmt: skip
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)
    try:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for *_, p in batch], params, lora_request=[r for _, r, *_ in batch]
        )
    finally:
        llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [expected[name][i] for name, _, i, _ in batch]
    if "num_gpu_blocks_override" in variant:
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_adapters_stay_read_while_their_requests_run(llama_loras, varied_prompts, tmp_path):
    """Requests queued on an adapter finish on it even when it is unloaded and its folder
    deleted meanwhile (it was read when they were checked); steps read no disk."""
    import shutil

    base, paths, expected = llama_loras
    llm = LLM(base, dtype="float32", enable_lora=True, max_lora_rank=16, max_loras=1, max_cpu_loras=1)
    gone = LoRARequest("gone", 50, shutil.copytree(paths["r8-all"], tmp_path / "gone"))
    kept = LoRARequest("r8-mlp", 2, paths["r8-mlp"])
    for j, lora in enumerate([gone, kept, gone, kept]):  # with one slot, `gone` waits for a turn
        llm.engine.add_request(str(j), {"prompt_token_ids": varied_prompts[j]}, GREEDY, lora_request=lora)
    llm.engine.remove_lora(gone.lora_int_id)
    shutil.rmtree(gone.lora_path)
    done = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    names = ["r8-all", "r8-mlp", "r8-all", "r8-mlp"]
    assert [done[str(j)] for j in range(4)] == [expected[n][j] for j, n in enumerate(names)]
    assert len(llm.engine.executor.runner.lora.cache) == 1  # released: one idle adapter kept
    with pytest.raises(ValueError, match="is not a folder"):  # unloaded and idle: read again, and gone
        llm.generate("Hello", GREEDY, lora_request=gone)


def test_an_unloaded_id_loaded_again_is_read_again(llama_loras, varied_prompts, tmp_path):
    """Its slot is refilled from disk. (Prefix-cache entries are kept by adapter, so an id must
    keep naming one adapter: ``LoRARequest``'s contract; the server never reuses one.)"""
    import shutil

    base, paths, expected = llama_loras
    llm = LLM(base, dtype="float32", enable_lora=True, max_lora_rank=16, enable_prefix_caching=False)
    folder = shutil.copytree(paths["r8-all"], tmp_path / "a")
    lora = LoRARequest("a", 1, str(folder))
    prompt = {"prompt_token_ids": varied_prompts[2]}
    assert llm.generate(prompt, GREEDY, lora_request=lora)[0].outputs[0].token_ids == expected["r8-all"][2]
    llm.engine.remove_lora(1)
    shutil.rmtree(folder)
    shutil.copytree(paths["r8-mlp"], folder)  # other weights under the same name, id and path
    assert llm.generate(prompt, GREEDY, lora_request=lora)[0].outputs[0].token_ids == expected["r8-mlp"][2]


# ------------------------------------------------------------------ bad adapters and flags
def bad_adapter(tmp_path, llama_loras, kind: str) -> str:
    """A copy of a good adapter, broken one way."""
    import shutil

    from safetensors.torch import load_file, save_file

    _, paths, _ = llama_loras
    path = tmp_path / kind
    shutil.copytree(paths["r8-all"], path)
    weights = path / "adapter_model.safetensors"
    config = json.loads((path / "adapter_config.json").read_text())
    if kind == "corrupt":
        weights.write_bytes(weights.read_bytes()[:100])
    elif kind == "no-weights":
        weights.unlink()
    elif kind == "no-config":
        (path / "adapter_config.json").unlink()
    elif kind == "unknown-target":
        config["target_modules"] = ["q_proj", "fc1"]
    elif kind == "unknown-tensor":
        tensors = load_file(weights)
        tensors["base_model.model.model.layers.0.mlp.fc1.lora_A.weight"] = torch.zeros(8, 64)
        save_file(tensors, weights)
    elif kind == "dora":
        config["use_dora"] = True
    elif kind == "bad-bias":
        tensors = load_file(weights)
        tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias"] = torch.zeros(3)
        save_file(tensors, weights)
        config["lora_bias"] = True
    elif kind == "alpha-not-a-number":
        config["lora_alpha"] = "sixteen"
    elif kind == "alora":
        config["alora_invocation_tokens"] = [5, 6]
    elif kind == "other-base":
        tensors = load_file(weights)
        key = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
        tensors[key] = torch.zeros(8, 96)
        save_file(tensors, weights)
    if kind != "no-config":
        (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


BAD = {
    "missing": r"is not a folder",
    "no-config": r"no adapter_config.json",
    "no-weights": r"no adapter_model.safetensors",
    "corrupt": r"cannot read its weights",
    "unknown-target": r"targets \['fc1'\], which the model lacks",
    "unknown-tensor": r"layers.0.mlp.fc1.lora_A.weight.*adapts a module the model lacks",
    "dora": r"DoRA adapters are not supported",
    "other-base": r"layers.1.mlp.down_proj has lora_A \(8, 96\).*trained for another base model",
    "bad-bias": r"layers.0.self_attn.q_proj has a lora_B bias of \(3,\), expected \(256,\)",
    "alpha-not-a-number": r"lora_alpha and alpha_pattern must hold numbers",
    "alora": r"aLoRA",
}


@pytest.fixture(scope="module")
def lora_llm(llama_loras):
    return LLM(llama_loras[0], dtype="float32", enable_lora=True, max_lora_rank=8, enable_lora_bias=True)


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_adapters_are_refused_with_the_reason(lora_llm, llama_loras, tmp_path, kind):
    path = str(tmp_path / "nothing") if kind == "missing" else bad_adapter(tmp_path, llama_loras, kind)
    with pytest.raises(ValueError, match=BAD[kind]):
        lora_llm.generate("Hello", GREEDY, lora_request=LoRARequest(kind, 99, path))
    assert not lora_llm.engine.has_unfinished_requests()
    assert lora_llm.generate("Hello", GREEDY)[0].outputs[0].token_ids  # still serving


def test_rank_over_the_maximum_is_refused(lora_llm, llama_loras):
    lora = LoRARequest("r16", 7, llama_loras[1]["r16-patterns"])
    with pytest.raises(ValueError, match=r"rank 16 .* over --max-lora-rank 8"):
        lora_llm.generate("Hello", GREEDY, lora_request=lora)


def test_adapters_need_enable_lora(tiny_model_dir, llama_loras):
    llm = LLM(tiny_model_dir("llama"), dtype="float32")
    with pytest.raises(ValueError, match="--enable-lora"):
        llm.generate("Hello", GREEDY, lora_request=LoRARequest("a", 1, llama_loras[1]["r8-all"]))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (dict(max_loras=4, max_cpu_loras=2), r"--max-cpu-loras \(2\) must be at least --max-loras \(4\)"),
        (dict(lora_extra_vocab_size=512), r"adapters that add tokens"),
        (dict(long_lora_scaling_factors=[4.0]), r"LongLoRA"),
        (dict(fully_sharded_loras=True, tensor_parallel_size=2), r"--fully-sharded-loras"),
        (dict(max_lora_rank=0), r"--max-lora-rank"),
    ],
)
def test_lora_flags_are_checked(flags, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.create(**flags)


def test_lora_flags_without_enable_lora_say_so(tiny_model_dir, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="kiln.engine"):
        LLM(tiny_model_dir("llama"), dtype="float32", max_loras=2, lora_dtype="bfloat16")
    assert "--max-loras, --lora-dtype change nothing without --enable-lora" in caplog.text


def test_kiln_generate_takes_an_adapter(llama_loras, varied_prompts):
    import subprocess
    import sys

    base, paths, expected = llama_loras
    tok = LLM(base, dtype="float32").get_tokenizer()
    prompt = tok.decode(varied_prompts[2])
    argv = [sys.executable, "-m", "kiln.cli", "generate", prompt, "--model", base, "--dtype", "float32"]
    common = ["--max-tokens", "6", "--max-lora-rank", "16"]
    run = [subprocess.run(argv + common + extra, capture_output=True, text=True, check=True).stdout
           for extra in ([], ["--lora", paths["r8-all"]])]  # fmt: skip
    assert run[0] != run[1]  # the adapter changes the completion


def test_pooling_requests_run_on_an_engine_with_lora(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), dtype="float32", task="embed", enable_lora=True)
    assert len(llm.embed(["hello", "world"])[1].outputs.embedding) == 64


def test_lora_request_ids_must_be_positive():
    with pytest.raises(ValueError, match="lora_int_id must be > 0"):
        LoRARequest("a", 0, "/x")


# ------------------------------------------------------------------ the reference op
def test_add_lora_equals_dense_updates():
    torch.manual_seed(0)
    slices, rank, inputs = (6, 4, 4), 3, 5
    a = torch.randn(2, len(slices) * rank, inputs)
    b = torch.randn(2, sum(slices), rank)
    bias = torch.randn(2, sum(slices))
    x, y = torch.randn(7, inputs), torch.randn(7, sum(slices))
    slots = [1, -1, 0]  # three requests of 3, 2 and 2 tokens
    mapping = LoRAMapping.of(slots, [3, 2, 2], torch.device("cpu"))
    assert mapping.segments == [(0, 3, 1), (5, 7, 0)]
    got = add_lora(y.clone(), x, a, b, bias, mapping, slices)
    want = y.clone()
    for t, slot in enumerate([1, 1, 1, -1, -1, 0, 0]):
        if slot < 0:
            continue
        offset = 0
        for i, size in enumerate(slices):
            a_i, b_i = a[slot, i * rank : (i + 1) * rank], b[slot, offset : offset + size]
            want[t, offset : offset + size] += b_i @ (a_i @ x[t]) + bias[slot, offset : offset + size]
            offset += size
    torch.testing.assert_close(got, want)
    assert LoRAMapping.of([-1, -1], [2, 1], torch.device("cpu")) is None


def check_matches_peft(base: str, adapter: str, prompts: list[list[int]]) -> None:
    """Kiln's greedy tokens with ``adapter`` are transformers' with PEFT's merged weights, and
    the adapter changes them."""
    expected = hf_lora_greedy(base, adapter, prompts, NEW_TOKENS)
    assert expected != hf_lora_greedy(base, None, prompts, NEW_TOKENS)
    llm = LLM(base, dtype="float32", enable_lora=True, max_model_len=256)
    lora = LoRARequest("a", 1, adapter)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=lora)
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("model_type", ["gemma", "gemma2", "gemma3_text"])
def test_gemma_adapters_match_peft(tiny_model_dir, tmp_path, varied_prompts, model_type):
    """Gemma's projections carry the Llama names: PEFT's adapters apply as on Llama (Gemma 2/3
    with their norms after each sublayer, soft caps and windows, Gemma 3 with q/k norms)."""
    base = tiny_model_dir(model_type)
    path = build_lora_adapter(base, tmp_path / "adapter", rank=8, seed=5)
    check_matches_peft(base, path, varied_prompts)


FUSED_FAMILIES = {  # model type: the PEFT targets of its checkpoint's projections
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],  # q/k/v and gate/up fused
    "glm4": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"],  # interleaved rotary
}


@pytest.mark.parametrize("model_type", FUSED_FAMILIES)
def test_adapters_of_fused_projections_match_peft(tiny_model_dir, tmp_path, varied_prompts, model_type):
    """Phi-3's adapters update its fused qkv_proj / gate_up_proj: Kiln gives each projection
    the shared A and its rows of B. GLM-4's query/key rows are reordered for its interleaved
    rotary, as its weights are; a partial rotary (Phi-4-mini's) the same way."""
    overrides = {"partial_rotary_factor": 0.5} if model_type == "phi3" else {}
    base = tiny_model_dir(model_type, **overrides)
    path = build_lora_adapter(base, tmp_path / "adapter", rank=8, seed=3, targets=FUSED_FAMILIES[model_type])
    check_matches_peft(base, path, varied_prompts)


def test_a_fused_projection_the_model_does_not_fuse_is_refused(tiny_model_dir, tmp_path):
    path = build_lora_adapter(tiny_model_dir("phi3"), tmp_path / "adapter", rank=8, targets=["qkv_proj"])
    llm = LLM(tiny_model_dir("llama"), dtype="float32", enable_lora=True, max_model_len=256)
    with pytest.raises(ValueError, match="qkv_proj adapts a module the model lacks"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, lora_request=LoRARequest("a", 1, path))


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_mixture_of_experts_attention_adapters_match_peft(tiny_model_dir, tmp_path, varied_prompts, model_type):
    """Adapters on a mixture of experts' attention projections apply as on Llama; one that also
    adapts an MLP projection (Qwen2-MoE's shared expert, or its dense first layer) is refused,
    naming the tensor's module, not run in part."""
    base = tiny_model_dir(model_type)
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    check_matches_peft(base, build_lora_adapter(base, tmp_path / "attention", rank=8, seed=7, targets=attention),
                       varied_prompts)  # fmt: skip
    if model_type == "qwen2_moe":
        llm = LLM(base, dtype="float32", enable_lora=True, max_model_len=256)
        supported = "supported: q_proj, k_proj, v_proj, o_proj of each layer"
        cases = ((["o_proj", "down_proj"], r"shared_expert\.down_proj"),  # matches both MLPs' down_proj
                 (["o_proj", "model.layers.0.mlp.down_proj"], r"layers\.0\.mlp\.down_proj"))  # fmt: skip
        for i, (targets, module) in enumerate(cases):
            path = build_lora_adapter(base, tmp_path / f"mlp{i}", rank=8, targets=targets)
            with pytest.raises(ValueError, match=rf"{module}.* adapts a module the model lacks .*{supported}"):
                llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, lora_request=LoRARequest("a", 1, path))
