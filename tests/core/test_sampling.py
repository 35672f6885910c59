"""Every SamplingParams field changes what the engine produces, in the way vLLM defines.

Each test is built so that it would fail if the engine ignored the field under
test: filters that must collapse to greedy are checked against a seed whose
unfiltered sample is *not* greedy, penalties are checked on an output that
repeats without them, stop conditions are chosen from what greedy really emits.

The tiny random-weight Llama has a flat next-token distribution (top logprob
about -5 over a 49k vocabulary), so unconstrained greedy text hardly repeats;
tests that need repetition restrict the vocabulary with ``allowed_token_ids``.
"""

from __future__ import annotations

import math

import pytest

from kiln import LLM, SamplingParams

PROMPT_TEXT = "The cat sat on the mat and"
GREEDY_LEN = 32
SEED = 0  # a seed whose plain temperature-1.0 sample differs from greedy (checked below)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    # fp32 explicitly: dtype "auto" picks bf16 on AMX CPUs, and exact greedy
    # comparisons between runs want the reference precision.
    return LLM(tiny_model_dir("llama"), max_model_len=256, dtype="float32")


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


@pytest.fixture(scope="module")
def prompt(tok) -> list[int]:
    ids = tok.encode(PROMPT_TEXT)
    assert len(ids) < 16  # shorter than a KV block: reruns never hit the prefix cache
    return ids


@pytest.fixture(scope="module")
def eos(llm) -> int:
    (eos,) = llm.engine.model_info.eos_token_ids
    return eos


def run(llm, prompt, **kwargs):
    """One request; returns its single CompletionOutput."""
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(**kwargs))
    assert len(out) == 1 and len(out[0].outputs) == 1
    return out[0].outputs[0]


@pytest.fixture(scope="module")
def greedy(llm, prompt):
    out = run(llm, prompt, temperature=0, max_tokens=GREEDY_LEN, ignore_eos=True)
    assert len(out.token_ids) == GREEDY_LEN
    return out


# ---------------------------------------------------------------- temperature


def test_temperature_zero_is_deterministic_argmax(llm, prompt, greedy):
    """temperature=0 must be argmax every step: rerunning gives the same tokens, and each
    sampled token is rank 1 of the model's distribution (breaks if greedy rows were sampled)."""
    again = run(llm, prompt, temperature=0, max_tokens=GREEDY_LEN, ignore_eos=True, logprobs=1)
    assert again.token_ids == greedy.token_ids
    for token, position in zip(again.token_ids, again.logprobs):
        assert position[token].rank == 1
        assert position[token].logprob == max(lp.logprob for lp in position.values())


def test_temperature_one_varies_with_the_seed(llm, prompt, greedy):
    """temperature=1.0 must sample: different seeds give different sequences, none of them
    greedy (breaks if temperature were ignored and every row took the argmax)."""
    outs = [
        tuple(run(llm, prompt, temperature=1.0, seed=s, max_tokens=GREEDY_LEN, ignore_eos=True).token_ids)
        for s in range(4)
    ]
    assert len(set(outs)) == 4
    assert tuple(greedy.token_ids) not in outs


# --------------------------------------------------------- top_k, top_p, min_p


def test_unfiltered_sample_at_the_test_seed_is_not_greedy(llm, prompt, greedy):
    """Precondition for the filter tests below: without a filter, SEED does not reproduce greedy."""
    plain = run(llm, prompt, temperature=1.0, seed=SEED, max_tokens=GREEDY_LEN, ignore_eos=True)
    assert plain.token_ids != greedy.token_ids
    assert plain.token_ids[0] != greedy.token_ids[0]


@pytest.mark.parametrize(
    "filt",
    [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)],
    ids=["top_k=1", "top_p=1e-6", "min_p=1.0"],
)
def test_filters_that_keep_only_the_top_token_equal_greedy(llm, prompt, greedy, filt):
    """top_k=1, a tiny top_p and min_p=1.0 each leave only the most likely token, so a
    temperature-1.0 sample must equal greedy (breaks if the filter were ignored)."""
    out = run(llm, prompt, temperature=1.0, seed=SEED, max_tokens=GREEDY_LEN, ignore_eos=True, **filt)
    assert out.token_ids == greedy.token_ids


def test_top_k_keeps_only_the_k_most_likely_tokens(llm, prompt):
    """With top_k=3 every sampled token is among the 3 most likely (rank <= 3 in the raw
    logprobs); breaks if top_k were ignored (a 49k-way flat sample lands outside the top 3)."""
    ranks = []
    for s in range(3):
        out = run(llm, prompt, temperature=1.0, top_k=3, seed=s, max_tokens=16, ignore_eos=True, logprobs=0)
        ranks += [pos[t].rank for t, pos in zip(out.token_ids, out.logprobs)]
    assert max(ranks) <= 3
    assert len(set(ranks)) > 1  # it does sample among them


# ------------------------------------------------------------------ penalties

# Twenty allowed tokens and 40 steps: greedy alone cycles over few of them.
PENALTY_VOCAB = list(range(1000, 1020))
PENALTY_STEPS = 40


def _restricted(llm, prompt, **kwargs):
    return run(
        llm, prompt, temperature=0, max_tokens=PENALTY_STEPS, ignore_eos=True, allowed_token_ids=PENALTY_VOCAB, **kwargs
    ).token_ids


@pytest.mark.parametrize(
    "penalty",
    [dict(presence_penalty=2.0), dict(frequency_penalty=2.0), dict(repetition_penalty=2.0)],
    ids=["presence", "frequency", "repetition"],
)
def test_penalties_reduce_repetition_in_greedy_output(llm, prompt, penalty):
    """A strong penalty changes the greedy output and makes it use more distinct tokens
    (breaks if the penalty were ignored: the output would equal the unpenalised one)."""
    plain = _restricted(llm, prompt)
    assert len(set(plain)) < len(PENALTY_VOCAB) - 2  # the baseline really repeats
    penalised = _restricted(llm, prompt, **penalty)
    assert penalised != plain
    assert len(set(penalised)) > len(set(plain))
    assert max(penalised.count(t) for t in penalised) < max(plain.count(t) for t in plain)


def test_neutral_penalties_change_nothing(llm, prompt):
    """repetition_penalty=1.0 and zero presence/frequency penalties are the identity."""
    neutral = _restricted(llm, prompt, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    assert neutral == _restricted(llm, prompt)


def test_frequency_penalty_is_not_presence_penalty(llm, prompt):
    """frequency_penalty scales with the count, presence_penalty does not, so once tokens
    repeat the two diverge (breaks if one were implemented as the other)."""
    assert _restricted(llm, prompt, frequency_penalty=2.0) != _restricted(llm, prompt, presence_penalty=2.0)


def test_repetition_penalty_counts_prompt_tokens_but_presence_does_not(llm, prompt):
    """vLLM: repetition_penalty covers prompt and output tokens, presence/frequency only the
    output. So for the first generated token, which has no output before it, a prompt that ends
    in the very token greedy would emit next is changed by repetition_penalty only."""
    prompts = [{"prompt_token_ids": prompt + [x]} for x in PENALTY_VOCAB]

    def first_tokens(**kwargs):
        params = SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=PENALTY_VOCAB, **kwargs)
        return [o.outputs[0].token_ids[0] for o in llm.generate(prompts, params)]

    plain = first_tokens()
    echoes = [i for i, x in enumerate(PENALTY_VOCAB) if plain[i] == x]  # greedy repeats the prompt's last token
    assert echoes
    assert first_tokens(presence_penalty=2.0, frequency_penalty=2.0) == plain
    penalised = first_tokens(repetition_penalty=2.0)
    assert any(penalised[i] != plain[i] for i in echoes)


# ------------------------------------------------------ logit_bias, allowed ids


def test_logit_bias_forces_a_token(llm, prompt):
    """+100 on one id makes it win every step, even when sampling at temperature 1.0."""
    forced = 1234
    out = run(llm, prompt, temperature=1.0, seed=SEED, max_tokens=12, ignore_eos=True, logit_bias={forced: 100.0})
    assert out.token_ids == [forced] * 12


def test_negative_logit_bias_bans_a_token(llm, prompt, greedy):
    """-100 on the first greedy token makes greedy pick something else there."""
    first = greedy.token_ids[0]
    out = run(llm, prompt, temperature=0, max_tokens=4, ignore_eos=True, logit_bias={first: -100.0})
    assert out.token_ids[0] != first


def test_allowed_token_ids_restrict_sampling(llm, prompt):
    """At temperature 1.0 only the allowed ids may appear (breaks if ignored: 49k choices)."""
    allowed = [1000, 1001]
    tokens = []
    for s in range(3):
        out = run(llm, prompt, temperature=1.0, seed=s, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed)
        tokens += out.token_ids
    assert set(tokens) == set(allowed)


# ------------------------------------------------------------------ bad_words


def _whole_word_positions(tok, token_ids):
    """Positions k >= 1 whose token is ' word' on its own: encode(' ' + word) == [token]."""
    found = []
    for k in range(1, len(token_ids)):
        text = tok.decode([token_ids[k]])
        word = text[1:]
        if text.startswith(" ") and word.isalpha() and tok.encode(text, add_special_tokens=False) == [token_ids[k]]:
            found.append((k, word))
    return found


def test_bad_word_is_never_generated(llm, tok, prompt, greedy):
    """A word greedy emits at step k, listed in bad_words, must not appear; the steps before
    it are unchanged (breaks if bad_words were ignored: greedy would emit it again)."""
    k, word = _whole_word_positions(tok, greedy.token_ids)[0]
    banned = tok.encode(" " + word, add_special_tokens=False)
    out = run(llm, prompt, temperature=0, max_tokens=GREEDY_LEN, ignore_eos=True, bad_words=[word])
    assert out.token_ids[:k] == greedy.token_ids[:k]
    assert banned[0] not in out.token_ids
    assert word not in out.text.split()


def test_bad_word_the(llm, tok, prompt):
    """The brief's example: bad_words=["the"] bans the token sequence of " the" (and "the"),
    checked on a run where logit_bias makes " the" the favourite."""
    the = tok.encode(" the", add_special_tokens=False)
    assert len(the) == 1
    base = dict(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={the[0]: 5.0})
    assert the[0] in run(llm, prompt, **base).token_ids  # it does appear without the ban
    out = run(llm, prompt, bad_words=["the"], **base)
    assert the[0] not in out.token_ids
    for variant in ("the", " the"):
        ids = tok.encode(variant, add_special_tokens=False)
        assert not any(out.token_ids[i : i + len(ids)] == ids for i in range(len(out.token_ids)))


def test_multi_token_bad_word_bans_only_its_last_token_after_the_prefix(llm, tok, prompt, greedy):
    """A two-token bad phrase that greedy emits: the first token still comes, the second is
    replaced (breaks if bad_words were ignored or if only single tokens were handled)."""
    words = dict(_whole_word_positions(tok, greedy.token_ids))
    k = next(k for k in sorted(words) if k + 1 in words)
    phrase = f"{words[k]} {words[k + 1]}"
    assert tok.encode(" " + phrase, add_special_tokens=False) == greedy.token_ids[k : k + 2]
    out = run(llm, prompt, temperature=0, max_tokens=GREEDY_LEN, ignore_eos=True, bad_words=[phrase])
    assert out.token_ids[: k + 1] == greedy.token_ids[: k + 1]
    assert out.token_ids[k + 1] != greedy.token_ids[k + 1]
    pair = greedy.token_ids[k : k + 2]
    assert not any(out.token_ids[i : i + 2] == pair for i in range(len(out.token_ids) - 1))


# ------------------------------------------------- stopping: eos, ids, lengths


def test_forced_eos_stops_after_one_token(llm, prompt, eos):
    """Baseline for the next tests: with EOS favoured, generation stops at once."""
    out = run(llm, prompt, temperature=0, max_tokens=8, logit_bias={eos: 100.0})
    assert out.token_ids == [eos]
    assert out.finish_reason == "stop" and out.stop_reason is None


def test_min_tokens_holds_back_eos(llm, prompt, eos):
    """min_tokens=5 with EOS forced: 5 non-EOS tokens, then EOS ends it (breaks if ignored:
    one token)."""
    out = run(llm, prompt, temperature=0, max_tokens=20, min_tokens=5, logit_bias={eos: 100.0})
    assert len(out.token_ids) == 6
    assert eos not in out.token_ids[:5] and out.token_ids[5] == eos
    assert out.finish_reason == "stop" and out.stop_reason is None


def test_min_tokens_holds_back_stop_token_ids(llm, prompt):
    """min_tokens also bans stop_token_ids until reached (vLLM)."""
    stop = 1234
    forced = dict(stop_token_ids=[stop], logit_bias={stop: 100.0}, ignore_eos=True)
    out = run(llm, prompt, temperature=0, max_tokens=20, min_tokens=4, **forced)
    assert len(out.token_ids) == 5
    assert stop not in out.token_ids[:4] and out.token_ids[4] == stop
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_min_tokens_holds_back_stop_strings(llm, tok, prompt, greedy):
    """A stop string completed before min_tokens must not end the request (vLLM)."""
    k, word = _whole_word_positions(tok, greedy.token_ids)[0]
    out = run(llm, prompt, temperature=0, max_tokens=GREEDY_LEN, ignore_eos=True, stop=[word], min_tokens=k + 8)
    assert len(out.token_ids) >= k + 8


def test_ignore_eos_runs_to_max_tokens(llm, prompt, eos):
    """With EOS forced, ignore_eos=True keeps going to max_tokens (breaks if ignored: 1 token)."""
    out = run(llm, prompt, temperature=0, max_tokens=8, ignore_eos=True, logit_bias={eos: 100.0})
    assert out.token_ids == [eos] * 8
    assert out.finish_reason == "length" and out.stop_reason is None


@pytest.mark.parametrize("max_tokens", [1, 7, 20])
def test_max_tokens_is_exact(llm, prompt, greedy, max_tokens):
    """max_tokens gives exactly that many tokens (a greedy prefix) with finish_reason length."""
    out = run(llm, prompt, temperature=0, max_tokens=max_tokens)
    assert out.token_ids == greedy.token_ids[:max_tokens]
    assert out.finish_reason == "length" and out.stop_reason is None


def test_stop_token_id_ends_generation_at_that_token(llm, prompt, greedy):
    """A token greedy emits at step k, given in stop_token_ids, ends the request right there:
    it is the last token and the stop_reason (breaks if ignored: runs to max_tokens)."""
    k = next(k for k in range(5, GREEDY_LEN) if greedy.token_ids[k] not in greedy.token_ids[:k])
    stop = greedy.token_ids[k]
    out = run(llm, prompt, temperature=0, max_tokens=GREEDY_LEN, stop_token_ids=[stop])
    assert out.token_ids == greedy.token_ids[: k + 1]
    assert out.token_ids[-1] == stop
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_token_text_is_not_in_the_output(llm, tok, prompt, greedy):
    """vLLM: the token that matched stop_token_ids is in token_ids but not in text."""
    k = next(k for k in range(5, GREEDY_LEN) if greedy.token_ids[k] not in greedy.token_ids[:k])
    out = run(llm, prompt, temperature=0, max_tokens=GREEDY_LEN, stop_token_ids=[greedy.token_ids[k]])
    assert out.text == tok.decode(greedy.token_ids[:k])


# --------------------------------------------------------------- stop strings


def _stop_string(greedy) -> tuple[str, int]:
    """A 5-character piece of the greedy text, starting mid-text, that occurs there first."""
    text = greedy.text
    for i in range(len(text) // 3, len(text) - 10):
        s = text[i : i + 5]
        if text.find(s) == i and s.strip() == s:
            return s, i
    raise AssertionError("no usable stop string in the greedy text")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text(llm, prompt, greedy, include):
    """The text ends right before the stop string (or right after it with
    include_stop_str_in_output); breaks if stop were ignored (runs to max_tokens)."""
    stop, at = _stop_string(greedy)
    out = run(
        llm,
        prompt,
        temperature=0,
        max_tokens=GREEDY_LEN,
        ignore_eos=True,
        stop=[stop],
        include_stop_str_in_output=include,
    )
    expected = greedy.text[: at + len(stop)] if include else greedy.text[:at]
    assert out.text == expected
    assert out.text.endswith(stop) == include
    assert out.finish_reason == "stop" and out.stop_reason == stop
    # Generation stopped at the token that completed the string, well before max_tokens.
    assert len(out.token_ids) < GREEDY_LEN
    assert out.token_ids == greedy.token_ids[: len(out.token_ids)]


def test_earliest_of_several_stop_strings_wins(llm, prompt, greedy):
    """With two stop strings the one that appears first ends the text."""
    stop, at = _stop_string(greedy)
    early = greedy.text[3:8]
    assert greedy.text.find(early) == 3
    out = run(llm, prompt, temperature=0, max_tokens=GREEDY_LEN, ignore_eos=True, stop=[stop, early])
    assert out.text == greedy.text[:3] and out.stop_reason == early


# ---------------------------------------------------------------- n, best_of


def test_n_returns_n_different_samples(llm, prompt):
    """n=3 at temperature 1.0: three outputs indexed 0, 1, 2 that are not all the same."""
    (res,) = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(n=3, temperature=1.0, max_tokens=16, ignore_eos=True)
    )
    assert [c.index for c in res.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 16 and c.finish_reason == "length" for c in res.outputs)
    assert len({tuple(c.token_ids) for c in res.outputs}) > 1


def test_best_of_keeps_the_n_most_likely_samples(llm, prompt):
    """best_of=4, n=2 returns the 2 sequences with the highest cumulative logprob out of 4,
    best first. The 4 candidates are reproduced by n=4 with the same seed (children use
    seed+i); breaks if best_of were ignored (we would get candidates 0 and 1)."""
    common = dict(temperature=1.0, seed=SEED, max_tokens=8, ignore_eos=True, logprobs=0)
    (four,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=4, **common))
    ranked = sorted(four.outputs, key=lambda c: c.cumulative_logprob, reverse=True)
    assert [c.index for c in ranked[:2]] != [0, 1]  # otherwise the test could not tell
    (best,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=2, best_of=4, **common))
    assert [c.index for c in best.outputs] == [0, 1]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    assert best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob
    for c in best.outputs:  # the reported cumulative logprob is the sum of the sampled ones
        total = sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs))
        assert math.isclose(c.cumulative_logprob, total, rel_tol=1e-5)


# ------------------------------------------------------------------- logprobs


def test_logprobs_report_the_sampled_token_and_the_top_k(llm, tok, prompt, greedy):
    """logprobs=5: every position holds the sampled token plus the top 5 (ranks 1..5,
    decreasing logprobs <= 0); greedy's token is the top-1 itself."""
    out = run(llm, prompt, temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    assert out.token_ids == greedy.token_ids[:8]
    assert len(out.logprobs) == 8
    total = 0.0
    for token, position in zip(out.token_ids, out.logprobs):
        assert token in position
        assert len(position) == 5  # the greedy token is one of the top 5
        by_rank = sorted(position.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in by_rank] == [1, 2, 3, 4, 5]
        values = [lp.logprob for lp in by_rank]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert position[token].rank == 1 and position[token].logprob == values[0]
        for tid, lp in position.items():
            assert lp.decoded_token == tok.decode([tid])
        total += position[token].logprob
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-5)


def test_logprobs_of_a_sampled_token_outside_the_top_k(llm, prompt):
    """When sampling picks a token outside the top k it is added with its true rank (> k)."""
    out = run(llm, prompt, temperature=1.0, seed=SEED, max_tokens=16, ignore_eos=True, logprobs=2)
    extra = 0
    for token, position in zip(out.token_ids, out.logprobs):
        rank = position[token].rank
        ranks = sorted(lp.rank for lp in position.values())
        assert ranks == ([1, 2] if rank <= 2 else [1, 2, rank])
        extra += rank > 2
    assert extra > 0  # a flat distribution: most samples are outside the top 2


def test_no_logprobs_unless_asked(llm, prompt):
    """logprobs=None: no per-token logprobs and no cumulative logprob (vLLM)."""
    out = run(llm, prompt, temperature=0, max_tokens=4)
    assert out.logprobs is None and out.cumulative_logprob is None


def test_prompt_logprobs(llm, prompt):
    """prompt_logprobs=2: one entry per prompt token, None first, then each entry holds the
    actual prompt token and the top 2 (breaks if ignored: None)."""
    (res,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))
    pl = res.prompt_logprobs
    assert pl is not None and len(pl) == len(prompt)
    assert pl[0] is None
    for token, position in zip(prompt[1:], pl[1:]):
        assert token in position
        assert len(position) in (2, 3)
        ranks = sorted(lp.rank for lp in position.values())
        assert ranks[:2] == [1, 2]
        assert all(lp.logprob <= 0 for lp in position.values())
        assert position[token].rank >= 1


def test_prompt_logprobs_of_a_one_token_prompt(llm):
    """vLLM: prompt_logprobs always has one entry per prompt token, so [None] here."""
    (res,) = llm.generate({"prompt_token_ids": [1000]}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))
    assert res.prompt_logprobs == [None]


# ----------------------------------------------------------------- detokenize


def test_skip_special_tokens_controls_special_token_text(llm, tok, prompt):
    """A forced special token (<|im_start|>, id 1) is dropped from the text by default and
    shown with skip_special_tokens=False (breaks if the flag were ignored: same text)."""
    special = 1
    assert special in tok.all_special_ids
    name = tok.convert_ids_to_tokens(special)
    common = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={special: 100.0})
    skipped = run(llm, prompt, **common)
    shown = run(llm, prompt, skip_special_tokens=False, **common)
    assert skipped.token_ids == shown.token_ids == [special] * 3
    assert skipped.text == ""
    assert shown.text == " ".join([name] * 3)
    joined = run(llm, prompt, skip_special_tokens=False, spaces_between_special_tokens=False, **common)
    assert joined.text == name * 3


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(n=0), "n"),
        (dict(n=3, best_of=2), "best_of"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-1.0), "temperature"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_p=2.0), "min_p"),
        (dict(top_k=-2), "top_k"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
    ],
)
def test_invalid_values_raise_naming_the_field(kwargs, field):
    """Out-of-range values are rejected at construction with the field's name in the message."""
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_top_k_minus_one_means_no_top_k():
    """top_k=-1 is vLLM's 'disabled' and is accepted (normalised to 0)."""
    assert SamplingParams(top_k=-1).top_k == 0
