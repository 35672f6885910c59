"""Beam search equals transformers' ``generate(num_beams=...)`` (sequences and scores), shares
KV blocks between beams, and mixes with ordinary requests in one batch."""

from __future__ import annotations

import pytest

from kiln import LLM, BeamSearchParams, SamplingParams
from kiln.testing.models import hf_beam_search

WIDTH, NEW_TOKENS = 4, 10
PROMPTS = [[1000], list(range(100, 119)), list(range(2000, 2040))]
# (length_penalty, early_stopping): transformers' defaults, its "canonical" setting, and both signs.
SETTINGS = [(1.0, False), (0.0, "never"), (2.0, True), (-1.0, False), (1.5, "never")]
ENGINE_VARIANTS = {
    "default": {},
    "block-size-16": dict(block_size=16),
    "chunked-prefill-tiny-budget": dict(max_num_batched_tokens=16),
    "no-prefix-caching": dict(enable_prefix_caching=False),
    # 6 usable blocks of 16 tokens for beams of up to 50 tokens: forks find no block to copy
    # the partial one into (so they recompute it) and beams are preempted.
    "starved-kv-cache": dict(block_size=16, num_gpu_blocks_override=9, max_model_len=64),
    # Fewer sequences a step than beams: groups wait for one another's beams.
    "four-seqs-a-step": dict(block_size=16, num_gpu_blocks_override=9, max_model_len=64, max_num_seqs=4),
}


def assert_same_beams(got: list[list], expected: list[list]) -> None:
    """Same tokens; log-probabilities equal up to how prefill and decode kernels round."""
    assert [[tokens for tokens, _ in beams] for beams in got] == [[tokens for tokens, _ in beams] for beams in expected]
    for beams, ref in zip(got, expected):
        assert [lp for _, lp in beams] == pytest.approx([lp for _, lp in ref], abs=1e-3)


def score(tokens: list[int], cumulative: float, length_penalty: float) -> float:
    return cumulative / len(tokens) ** length_penalty


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tiny_model_dir):
    path = tiny_model_dir(request.param)
    llm = LLM(path, dtype="float32", max_model_len=256)
    # A token greedy decoding emits third acts as a second stop token, so some beams end early.
    greedy = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=4, temperature=0))
    stops = [out.outputs[0].token_ids[2] for out in greedy]
    return path, llm, stops


def reference(path, llm, prompt, stop, length_penalty, early_stopping):
    eos = sorted(llm.engine.model_info.eos_token_ids) + [stop]
    return hf_beam_search(
        path, prompt, WIDTH, NEW_TOKENS, length_penalty=length_penalty, early_stopping=early_stopping, eos_token_ids=eos
    )


@pytest.mark.parametrize("length_penalty,early_stopping", SETTINGS)
def test_beams_match_transformers(tiny, length_penalty, early_stopping):
    path, llm, stops = tiny
    for prompt, stop in zip(PROMPTS, stops):
        expected = reference(path, llm, prompt, stop, length_penalty, early_stopping)
        params = SamplingParams(
            n=WIDTH,
            use_beam_search=True,
            max_tokens=NEW_TOKENS,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            stop_token_ids=[stop],
        )
        out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs
        assert [o.token_ids for o in out] == [tokens for tokens, _ in expected]
        for o, (_, ref_score) in zip(out, expected):
            assert score(o.token_ids, o.cumulative_logprob, length_penalty) == pytest.approx(ref_score, rel=1e-4)
        assert [o.finish_reason for o in out] == ["stop" if o.token_ids[-1] == stop else "length" for o in out]
        assert all(o.stop_reason == (stop if o.finish_reason == "stop" else None) for o in out)
    assert llm.engine.kv.usage == 0.0


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_engine_variants_give_the_same_beams(tiny_model_dir, variant):
    path = tiny_model_dir("llama")
    from kiln.testing.engine import run_beam_search

    baseline = LLM(path, dtype="float32", max_model_len=64)
    expected = run_beam_search(baseline.engine, PROMPTS, WIDTH, NEW_TOKENS, ignore_eos=True)
    llm = LLM(path, dtype="float32", **{"max_model_len": 64, **ENGINE_VARIANTS[variant]})
    assert_same_beams(run_beam_search(llm.engine, PROMPTS, WIDTH, NEW_TOKENS, ignore_eos=True), expected)
    assert llm.engine.kv.usage == 0.0
    if variant == "starved-kv-cache":
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_beams_share_blocks_and_copy_only_the_partial_one(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=256, block_size=16)
    engine = llm.engine
    prompt = list(range(100, 137))  # two full blocks and 5 tokens of a third
    engine.add_request("b", {"prompt_token_ids": prompt}, SamplingParams(n=WIDTH, use_beam_search=True, max_tokens=6))
    copies = []
    original_take = engine.kv.take_copies

    def recording_take():
        taken = original_take()
        copies.extend(taken)
        return taken

    engine.kv.take_copies = recording_take
    engine.step()  # the prompt; its one beam offers candidates and is forked
    beams = engine.core.scheduler.beam_groups["b"].live
    assert len(beams) == WIDTH
    prompt_blocks = beams[0].blocks[:2]
    assert all(b.blocks[:2] == prompt_blocks for b in beams)  # the full blocks are shared
    assert all(blk.ref_cnt == WIDTH for blk in prompt_blocks)
    assert len({b.blocks[2].block_id for b in beams}) == WIDTH  # each has its own partial block
    engine.step()
    assert len(copies) == WIDTH - 1 and all(src == beams[0].blocks[2].block_id for src, _ in copies)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.usage == 0.0


def test_beam_search_beside_ordinary_requests(tiny_model_dir):
    from kiln.testing.engine import run_beam_search, run_greedy

    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=256)
    alone_beams = run_beam_search(llm.engine, PROMPTS[:1], WIDTH, NEW_TOKENS, ignore_eos=True)
    alone_greedy = run_greedy(llm.engine, PROMPTS[1:])
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    beam = SamplingParams(n=WIDTH, use_beam_search=True, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [beam, greedy, greedy])
    assert_same_beams([[(o.token_ids, o.cumulative_logprob) for o in outs[0].outputs]], alone_beams)
    assert [o.outputs[0].token_ids for o in outs[1:]] == alone_greedy


def test_n_below_the_width_returns_the_best_n(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=256)
    wide = SamplingParams(n=WIDTH, use_beam_search=True, max_tokens=NEW_TOKENS, ignore_eos=True)
    narrow = SamplingParams(n=2, best_of=WIDTH, use_beam_search=True, max_tokens=NEW_TOKENS, ignore_eos=True)
    all_beams, best_two = (llm.generate([{"prompt_token_ids": PROMPTS[1]}], p)[0].outputs for p in (wide, narrow))
    assert [o.token_ids for o in best_two] == [o.token_ids for o in all_beams[:2]]
    assert [o.index for o in best_two] == [0, 1]


def test_offline_beam_search_api(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=256)
    tok = llm.get_tokenizer()
    out = llm.beam_search(
        ["Hello there", {"prompt_token_ids": PROMPTS[1]}], BeamSearchParams(beam_width=3, max_tokens=5)
    )
    assert [len(o.sequences) for o in out] == [3, 3]
    first = out[0].sequences[0]
    prompt_ids = tok.encode("Hello there")
    assert first.tokens[: len(prompt_ids)] == prompt_ids and len(first.tokens) <= len(prompt_ids) + 5
    assert first.text == tok.decode(first.tokens, skip_special_tokens=True)
    scores = [s.cum_logprob / (len(s.tokens) - len(prompt_ids)) for s in out[0].sequences]
    assert scores == sorted(scores, reverse=True)


def test_abort_mid_search_frees_every_beam(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=256)
    engine = llm.engine
    engine.add_request(
        "b", {"prompt_token_ids": PROMPTS[2]}, SamplingParams(n=WIDTH, use_beam_search=True, max_tokens=50)
    )
    for _ in range(3):
        engine.step()
    assert len(engine.core.scheduler.running) == WIDTH
    engine.abort_request("b")
    assert not engine.has_unfinished_requests() and not engine.core.scheduler.has_unfinished()
    assert engine.kv.usage == 0.0


@pytest.mark.parametrize(
    "field,value",
    [
        ("stop", ["x"]),
        ("logprobs", 2),
        ("top_p", 0.5),
        ("repetition_penalty", 1.2),
        ("logit_bias", {5: 1.0}),
        ("bad_words", ["x"]),
    ],
)
def test_parameters_beam_search_cannot_honour_are_refused(field, value):
    with pytest.raises(ValueError, match=f"{field} is not supported with beam search"):
        SamplingParams(use_beam_search=True, n=2, **{field: value})


def test_beam_only_parameters_need_beam_search():
    with pytest.raises(ValueError, match="length_penalty applies to beam search only"):
        SamplingParams(length_penalty=2.0)
    with pytest.raises(ValueError, match="early_stopping must be true, false or 'never'"):
        SamplingParams(use_beam_search=True, early_stopping="sometimes")


def test_a_width_over_max_num_seqs_is_refused(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=256, max_num_seqs=2)
    with pytest.raises(ValueError, match=r"n: at most 2 sequences per request \(--max-num-seqs\)"):
        llm.generate("hi", SamplingParams(n=3, use_beam_search=True))


@pytest.mark.slow
def test_default_model_beams_match_transformers(default_model_dir):
    llm = LLM(default_model_dir, dtype="float32")
    tok = llm.get_tokenizer()
    prompt = tok.encode("The best way to learn a language is")
    eos = sorted(llm.engine.model_info.eos_token_ids)
    expected = hf_beam_search(default_model_dir, prompt, WIDTH, 16, eos_token_ids=eos)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(n=WIDTH, use_beam_search=True, max_tokens=16))
    assert [o.token_ids for o in out[0].outputs] == [tokens for tokens, _ in expected]
    for o, (_, ref_score) in zip(out[0].outputs, expected):
        assert score(o.token_ids, o.cumulative_logprob, 1.0) == pytest.approx(ref_score, rel=1e-4)


def test_prompt_logprobs_come_with_the_beams(tiny_model_dir):
    """The prompt's logprobs do not depend on the decoding: beam search reports those greedy does,
    also when the prompt is computed in chunks (the last chunk is the one a beam samples from)."""
    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=256, max_num_batched_tokens=16)
    prompt = {"prompt_token_ids": PROMPTS[2]}
    greedy = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))[0]
    beams = llm.generate(prompt, SamplingParams(n=2, use_beam_search=True, max_tokens=2, prompt_logprobs=2))[0]
    assert len(beams.prompt_logprobs) == len(PROMPTS[2])
    assert beams.prompt_logprobs[0] is None
    for got, ref in zip(beams.prompt_logprobs[1:], greedy.prompt_logprobs[1:]):
        assert got.keys() == ref.keys()
        assert [v.logprob for v in got.values()] == pytest.approx([v.logprob for v in ref.values()], abs=1e-5)
