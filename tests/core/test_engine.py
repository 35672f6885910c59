"""Engine behaviour beyond single-request greedy: outputs, metrics, caching, streaming, abort."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kiln
from kiln import LLM, RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), max_model_len=256, block_size=16, dtype="float32")


def test_request_output_has_every_field(llm):
    out = llm.generate("Tell me a story", SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert out.finished and out.prompt == "Tell me a story"
    assert out.prompt_token_ids == llm.get_tokenizer().encode("Tell me a story")
    comp = out.outputs[0]
    assert comp.index == 0 and len(comp.token_ids) == 5 and comp.finish_reason == "length"
    assert comp.text == llm.get_tokenizer().decode(comp.token_ids, skip_special_tokens=True)
    m = out.metrics
    assert m.arrival_time <= m.request_start_time <= m.inference_start_time
    assert m.time_in_queue >= 0 and m.first_token_time > 0 and m.preprocess_cost_time >= 0
    assert 0 < m.model_forward_time <= m.model_execute_time
    assert m.finished_time >= m.last_token_time >= m.arrival_time


def test_prefix_cache_hits_are_reported(llm):
    shared = list(range(500, 548))  # three full blocks of 16
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0)
    first = llm.generate({"prompt_token_ids": shared + [7]}, params)[0]
    second = llm.generate({"prompt_token_ids": shared + [8, 9]}, params)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 48


def test_n_sequences_share_the_prompt_blocks(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), max_model_len=256, block_size=16, enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request("x", {"prompt_token_ids": list(range(600, 650))}, SamplingParams(n=3, max_tokens=4))
    engine.step()
    children = [engine.core.scheduler.requests[f"{i}_x"] for i in range(3)]
    assert len(children) == 3
    first_blocks = [[b.block_id for b in c.blocks[:3]] for c in children]
    assert first_blocks[0] == first_blocks[1] == first_blocks[2]
    assert children[0].blocks[0].ref_cnt == 3
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.usage == 0.0


def test_delta_outputs_reassemble_to_the_final_text(llm):
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0, output_kind=RequestOutputKind.DELTA)
    final = llm.generate("Streaming", SamplingParams(max_tokens=12, ignore_eos=True, temperature=0))[0]
    llm.engine.add_request("s", "Streaming", params)
    pieces, tokens = [], []
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            pieces.append(out.outputs[0].text)
            tokens += out.outputs[0].token_ids
    assert len(pieces) > 1
    assert "".join(pieces) == final.outputs[0].text and tokens == final.outputs[0].token_ids


def test_abort_mid_generation_frees_everything(llm):
    llm.engine.add_request("a", "abort me", SamplingParams(max_tokens=50, ignore_eos=True))
    llm.engine.add_request("b", "keep me", SamplingParams(max_tokens=6, ignore_eos=True))
    llm.engine.step()
    llm.engine.step()
    llm.engine.abort_request("a")
    finished = []
    while llm.engine.has_unfinished_requests():
        finished += [o for o in llm.engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["b"] and len(finished[0].outputs[0].token_ids) == 6
    assert llm.engine.kv.usage == 0.0 and not llm.engine.core.scheduler.has_unfinished()


def test_prompt_logprobs_survive_chunked_prefill(tiny_model_dir):
    prompt = list(range(700, 760))
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    whole = LLM(tiny_model_dir("llama"), max_model_len=256, dtype="float32").generate(
        {"prompt_token_ids": prompt}, params
    )[0]
    chunked = LLM(tiny_model_dir("llama"), max_model_len=256, dtype="float32", max_num_batched_tokens=16).generate(
        {"prompt_token_ids": prompt}, params
    )[0]
    assert len(whole.prompt_logprobs) == len(prompt) and whole.prompt_logprobs[0] is None
    for a, b, token in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:], prompt[1:]):
        assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)


def test_chat_applies_the_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Hi there"}]
    ids = llm.apply_chat_template(messages)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    out = llm.chat(messages, SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert out.prompt_token_ids == ids
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(messages, continue_final_message=True)


def test_priority_scheduling_serves_urgent_requests_first(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), max_model_len=256, scheduling_policy="priority", max_num_seqs=1)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    llm.engine.add_request("relaxed", "one", params, priority=5)
    llm.engine.add_request("urgent", "two", params, priority=-5)
    order = []
    while llm.engine.has_unfinished_requests():
        order += [o.request_id for o in llm.engine.step() if o.finished]
    assert order == ["urgent", "relaxed"]


@pytest.mark.slow
def test_kiln_generate_cli_prints_a_completion(default_model_dir):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kiln.cli",
            "generate",
            "What is the capital of France?",
            "--chat",
            "--max-tokens",
            "16",
            # The exact fp32 products: with int8 activations (the default for a GGUF file) this
            # 135M model answers "L'Étoile, la Marseillaise, ..." token for token as llama.cpp does.
            "--quantization",
            "none",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "Paris" in out.stdout


def test_kv_cache_is_sized_after_a_profiling_step(tiny_model_dir, kiln_plugins, varied_prompts):
    """Where the platform measures a step's peak memory, the engine profiles a full-budget
    step first (on a throwaway cache), leaves that much room, and then serves unchanged."""
    import kiln_cpu.plugin
    from kiln.platforms.base import PlatformSpec
    from kiln.testing.engine import greedy_tokens, make_engine, run_greedy
    from kiln_cpu.platform import CpuPlatform

    steps = []

    class ProfiledCpu(CpuPlatform):
        name = "cpu_profiled"

        def mem_get_info(self):
            return 1 << 30, 1 << 30  # 1 GiB, all free

        def peak_memory_of(self, fn):
            steps.append(fn())
            return (1 << 30) - (1 << 20)  # the step needs all but 1 MiB

    class Plugin:
        @kiln.hookimpl
        def register_platforms(self, register):
            register(PlatformSpec("cpu_profiled", ProfiledCpu, is_available=lambda: True))

    kiln_plugins.register(kiln_cpu.plugin, name="cpu")
    kiln_plugins.register(Plugin(), name="profiled")
    common = dict(model=tiny_model_dir("llama"), dtype="float32", max_num_batched_tokens=64, max_model_len=256)
    engine = make_engine(kiln_plugins, device="cpu_profiled", gpu_memory_utilization=1.0, max_num_seqs=4, **common)
    assert len(steps) == 1
    useful = 4 * -(-256 // engine.config.block_size) + 1  # the cap: max_num_seqs full-length sequences
    assert (
        len(engine.kv.pool.blocks) == (1 << 20) // engine.executor.runner.kv_block_bytes() < useful
    )  # 1 MiB of blocks
    assert run_greedy(engine, varied_prompts) == greedy_tokens(kiln_plugins, varied_prompts, device="cpu", **common)


def test_cpu_kv_footprint_follows_concurrency_not_traffic(tiny_model_dir):
    """On the CPU the pool reuses freed blocks before touching new memory: 8 requests of 3
    blocks each, 2 at a time, touch no more blocks than 2 requests hold at once."""
    llm = LLM(tiny_model_dir("llama"), max_model_len=256, block_size=16, dtype="float32", max_num_seqs=2)
    prompts = [{"prompt_token_ids": list(range(100 * i, 100 * i + 40))} for i in range(1, 9)]
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    pool = llm.engine.kv.pool
    touched = len(pool.blocks) - 1 - len(pool.unused)
    assert touched == 2 * 3
