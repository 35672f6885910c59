"""Per-request seeds: a seeded request samples the same tokens whatever else is batched.

The sampler draws a seeded request's noise from its own generator and everyone
else's from the engine's shared one. These tests would fail if the seed were
ignored (outputs would follow the shared generator and change with the batch and
with every earlier call) or if unseeded requests shared one noise row.
"""

from __future__ import annotations

import pytest

from kiln import LLM, SamplingParams

TARGET = [504, 2644, 2643, 335, 260, 1171, 284]  # "The cat sat on the mat and": under one KV block
SEEDED = SamplingParams(seed=1234, temperature=1.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), max_model_len=256, dtype="float32")


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def batch_with(target_at: int, others: list[list[int]]):
    """The seeded TARGET at index target_at among unseeded temperature-1.0 requests of
    different prompt lengths and lengths of output (so the batch changes shape as they end)."""
    prompts = [{"prompt_token_ids": p} for p in others]
    params = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True) for m in (5, 40, 12, 32, 20)]
    prompts.insert(target_at, {"prompt_token_ids": TARGET})
    params.insert(target_at, SEEDED)
    return prompts, params


@pytest.fixture(scope="module")
def alone(llm) -> list[int]:
    (out,) = llm.generate({"prompt_token_ids": TARGET}, SEEDED)
    assert len(out.outputs[0].token_ids) == 32
    return out.outputs[0].token_ids


def test_seeded_request_is_reproducible_across_calls(llm, alone):
    """Running the same seeded request again gives the same tokens, although the engine's
    shared generator has moved on (breaks if the seed were ignored)."""
    llm.generate({"prompt_token_ids": TARGET}, SamplingParams(temperature=1.0, max_tokens=8))  # advance it
    (again,) = llm.generate({"prompt_token_ids": TARGET}, SEEDED)
    assert again.outputs[0].token_ids == alone


@pytest.mark.parametrize("target_at", [0, 3, 5])
def test_seeded_request_is_batch_invariant(llm, alone, varied_prompts, target_at):
    """Alone or in a batch with 5 unseeded requests, first, in the middle or last, the seeded
    request samples the same tokens (breaks if its noise came from the shared generator)."""
    assert len(varied_prompts) == 5 and len({len(p) for p in varied_prompts}) == 5
    prompts, params = batch_with(target_at, varied_prompts)
    outs = tokens(llm.generate(prompts, params))
    assert outs[target_at] == alone


def test_seeded_request_is_invariant_to_greedy_neighbours(llm, alone, varied_prompts):
    """Greedy neighbours (which draw no noise) don't disturb a seeded request either."""
    prompts = [{"prompt_token_ids": p} for p in varied_prompts[:3]] + [{"prompt_token_ids": TARGET}]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 3 + [SEEDED]
    assert tokens(llm.generate(prompts, params))[-1] == alone


def test_different_seeds_give_different_samples(llm, alone):
    """Seed 1235 must not reproduce seed 1234 (breaks if the seed value were ignored)."""
    other = SamplingParams(seed=1235, temperature=1.0, max_tokens=32, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": TARGET}, other)
    assert out.outputs[0].token_ids != alone


def test_unseeded_requests_in_one_batch_differ(llm):
    """Four unseeded copies of one prompt in one batch draw independent noise, so they differ
    (breaks if the sampler reused one noise row or one generator state for all of them)."""
    outs = tokens(llm.generate([{"prompt_token_ids": TARGET}] * 4, SamplingParams(temperature=1.0, max_tokens=32)))
    assert len({tuple(o) for o in outs}) == 4


def test_unseeded_request_differs_from_call_to_call(llm):
    """Without a seed, running the same request twice samples afresh."""
    params = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True)
    first = tokens(llm.generate({"prompt_token_ids": TARGET}, params))
    second = tokens(llm.generate({"prompt_token_ids": TARGET}, params))
    assert first != second


def test_seeded_n2_gives_two_different_reproducible_sequences(llm):
    """n=2 with a seed: the two sequences differ from each other (each child has its own
    stream) and the pair is identical on a second run and inside a batch."""
    params = SamplingParams(n=2, seed=1234, temperature=1.0, max_tokens=32, ignore_eos=True)
    (first,) = llm.generate({"prompt_token_ids": TARGET}, params)
    pair = [c.token_ids for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1]
    assert pair[0] != pair[1]
    (second,) = llm.generate({"prompt_token_ids": TARGET}, params)
    assert [c.token_ids for c in second.outputs] == pair
    batched = llm.generate(
        [{"prompt_token_ids": [5, 6, 7] * 5}, {"prompt_token_ids": TARGET}],
        [SamplingParams(temperature=1.0, max_tokens=20), params],
    )
    assert [c.token_ids for c in batched[1].outputs] == pair
