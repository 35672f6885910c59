"""What only a real GPU can check (skipped elsewhere, with the reason shown): CUDA graphs for
decode (the newer model families' too), the engine on CUDA against the CPU plugin, fp8 KV
caches, the profiled KV sizing."""

import pytest
import torch

pytestmark = pytest.mark.cuda


@pytest.fixture
def cuda_plugins(kiln_plugins):
    import kiln_cpu.plugin
    import kiln_cuda.plugin

    kiln_plugins.register(kiln_cpu.plugin, name="cpu")
    kiln_plugins.register(kiln_cuda.plugin, name="cuda")
    return kiln_plugins


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_matches_eager(tiny_model_dir, cuda_plugins, varied_prompts, dtype):
    """Decode steps replayed from graphs (5 prompts: sizes 8 with 3 padded rows, down to 1)
    give exactly the eager run's tokens."""
    from kiln.testing.engine import greedy_tokens, make_engine, run_greedy

    common = dict(model=tiny_model_dir("llama"), device="cuda", dtype=dtype, max_num_seqs=8)
    engine = make_engine(cuda_plugins, **common)
    assert engine.executor.runner.graph_sizes == [1, 2, 4, 8]
    graphed = run_greedy(engine, varied_prompts, max_tokens=16)
    assert engine.executor.runner.graph_steps > 0
    assert graphed == greedy_tokens(cuda_plugins, varied_prompts, max_tokens=16, enforce_eager=True, **common)


def test_cuda_matches_the_cpu_plugin(tiny_model_dir, cuda_plugins, varied_prompts):
    from kiln.testing.engine import greedy_tokens

    common = dict(model=tiny_model_dir("llama"), dtype="float32", block_size=16)
    assert greedy_tokens(cuda_plugins, varied_prompts, device="cuda", **common) == greedy_tokens(
        cuda_plugins, varied_prompts, device="cpu", **common
    )


@pytest.mark.parametrize("model_type", ["glm4", "gemma3_text", "mixtral", "qwen2_moe", "deepseek_v3"])
def test_model_families_in_cuda_graphs_match_the_cpu_plugin(tiny_model_dir, cuda_plugins, varied_prompts, model_type):
    """The newer families (reordered rotaries, windows, the Triton grouped-GEMM experts, latent
    attention) decode through CUDA graphs (no host sync on their path) with the CPU plugin's tokens."""
    from kiln.testing.engine import greedy_tokens, make_engine, run_greedy

    common = dict(model=tiny_model_dir(model_type), dtype="float32", block_size=16, max_num_seqs=8)
    engine = make_engine(cuda_plugins, device="cuda", **common)
    assert run_greedy(engine, varied_prompts, 12) == greedy_tokens(
        cuda_plugins, varied_prompts, 12, device="cpu", **common
    )
    assert engine.executor.runner.graph_steps > 0


def test_drafts_verify_through_cuda_graphs(tiny_model_dir, cuda_plugins):
    """Speculative decoding: steps of two requests with three drafts each (8 decode rows) replay
    the size-8 graph (graph sizes reach max_num_seqs * 4) and give the CPU plugin's greedy tokens."""
    from kiln.testing.engine import greedy_tokens
    from kiln.testing.spec_decode import replayed_greedy

    prompts = [[1000, 7, 9], list(range(100, 119))]
    common = dict(model=tiny_model_dir("llama"), dtype="float32", block_size=16, max_num_seqs=2)
    reference, got, engine = replayed_greedy(cuda_plugins, prompts, 12, device="cuda", **common)
    assert engine.executor.runner.graph_sizes == [1, 2, 4, 8]
    assert got == reference == greedy_tokens(cuda_plugins, prompts, 12, device="cpu", **common)
    assert engine.executor.runner.graph_steps >= engine.core.scheduler.spec_stats.num_drafts // 2


def test_long_sequences_run_eagerly(tiny_model_dir, cuda_plugins):
    """Past --max-seq-len-to-capture a decode step is not replayed."""
    from kiln.testing.engine import make_engine, run_greedy

    engine = make_engine(
        cuda_plugins, model=tiny_model_dir("llama"), device="cuda", max_num_seqs=4, max_seq_len_to_capture=8
    )
    run_greedy(engine, [[5] * 20], max_tokens=4)
    assert engine.executor.runner.graph_steps == 0


def test_fp8_kv_cache_halves_the_block_and_serves(tiny_model_dir, cuda_plugins, varied_prompts):
    from kiln.testing.engine import make_engine, run_greedy

    common = dict(model=tiny_model_dir("llama"), device="cuda", dtype="bfloat16")
    fp8 = make_engine(cuda_plugins, kv_cache_dtype="fp8", **common)
    auto = make_engine(cuda_plugins, **common)
    assert fp8.executor.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    assert 2 * fp8.executor.runner.kv_block_bytes() == auto.executor.runner.kv_block_bytes()
    assert [len(t) for t in run_greedy(fp8, varied_prompts)] == [8] * len(varied_prompts)


def test_kv_cache_leaves_room_for_the_profiled_step(tiny_model_dir, cuda_plugins):
    from kiln.testing.engine import make_engine

    engine = make_engine(cuda_plugins, model=tiny_model_dir("llama"), device="cuda", gpu_memory_utilization=0.5)
    peak = engine.executor.runner.profile_peak()
    assert peak is not None and peak > 0


def test_sampling_runs_on_the_device(tiny_model_dir, varied_prompts):
    """Logits are sampled where they are computed (only token ids come back to the host), and
    every sampling parameter still applies there: a seeded request with penalties, bias and
    top-k/p/min-p gives the same tokens alone and in a batch, and allowed_token_ids holds."""
    from kiln import LLM, SamplingParams

    llm = LLM(tiny_model_dir("llama"), device="cuda", dtype="float32")
    sampler, devices = llm.engine.executor.sampler, set()

    class Spy:  # records where the logits are; the rest (freeing seeded generators) goes to the sampler
        def __call__(self, logits, reqs, bitmask=None):
            devices.add(logits.device.type)
            return sampler(logits, reqs, bitmask)

        def __getattr__(self, name):
            return getattr(sampler, name)

    llm.engine.executor.sampler = Spy()
    seeded = SamplingParams(
        seed=7, temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.2,
        presence_penalty=0.5, frequency_penalty=0.5, logit_bias={5: 3.0}, logprobs=2, max_tokens=16,
        ignore_eos=True,
    )  # fmt: skip
    (alone,) = llm.generate({"prompt_token_ids": varied_prompts[2]}, seeded)
    others = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True) for m in (4, 20, 9, 12)]
    allowed = SamplingParams(allowed_token_ids=[11, 12, 13], temperature=1.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in varied_prompts], [*others[:2], seeded, allowed, others[2]])
    assert devices == {"cuda"}
    assert outs[2].outputs[0].token_ids == alone.outputs[0].token_ids
    assert all(len(position) >= 2 for position in alone.outputs[0].logprobs)
    assert set(outs[3].outputs[0].token_ids) <= {11, 12, 13}
