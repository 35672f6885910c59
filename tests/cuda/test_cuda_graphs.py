"""CUDA graphs for decode, on a real GPU only (skipped elsewhere, with the reason shown)."""

import pytest

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
    assert engine.runner.graph_sizes == [1, 2, 4, 8]
    graphed = run_greedy(engine, varied_prompts, max_tokens=16)
    assert engine.runner.graph_steps > 0
    assert graphed == greedy_tokens(cuda_plugins, varied_prompts, max_tokens=16, enforce_eager=True, **common)


def test_cuda_matches_the_cpu_plugin(tiny_model_dir, cuda_plugins, varied_prompts):
    from kiln.testing.engine import greedy_tokens

    common = dict(model=tiny_model_dir("llama"), dtype="float32", block_size=16)
    assert greedy_tokens(cuda_plugins, varied_prompts, device="cuda", **common) == greedy_tokens(
        cuda_plugins, varied_prompts, device="cpu", **common
    )


def test_long_sequences_run_eagerly(tiny_model_dir, cuda_plugins):
    """Past --max-seq-len-to-capture a decode step is not replayed."""
    from kiln.testing.engine import make_engine, run_greedy

    engine = make_engine(
        cuda_plugins, model=tiny_model_dir("llama"), device="cuda", max_num_seqs=4, max_seq_len_to_capture=8
    )
    run_greedy(engine, [[5] * 20], max_tokens=4)
    assert engine.runner.graph_steps == 0
