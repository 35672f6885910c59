"""The sampler on synthetic logits: every parameter, the bitmask, seeds and logprobs.

No model and no engine: each test builds a few rows of logits over a small vocabulary
and ``Request`` objects by hand, calls ``Sampler`` (or a module function) and checks
either the tokens it picks or, since the sampler modifies the logits in place, the
processed logits themselves. Sampled (non-greedy) checks draw hundreds of rows from a
fixed-seed sampler, so they are deterministic, and each pairs the parameter with a
contrast run without it so that ignoring the parameter would fail the test.
"""

from __future__ import annotations

import math

import pytest
import torch

from kiln.engine.guided_manager import GuardedMatcher
from kiln.engine.request import Request, TopLogprobs
from kiln.interfaces.guided import GuideMatcher, allocate_bitmask, apply_token_bitmask
from kiln.sampling_params import SamplingParams
from kiln.worker.sampler import GrammarBitmask, Sampler, grammar_bitmask, prompt_top_logprobs, top_logprobs
from kiln.worker.spec_verify import sample_with_drafts

VOCAB = 16
EOS = 15
NEG_INF = float("-inf")


def make_req(rid="r", prompt=(1,), output=(), seed=None, eos=(EOS,), matcher=None, **params) -> Request:
    req = Request(
        rid, list(prompt), SamplingParams(**params), eos_token_ids=frozenset(eos), arrival_time=0.0, seed=seed
    )
    req.matcher = matcher
    for t in output:
        req.append_output_token(t)
    return req


def rows(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def peaked(vocab=VOCAB, top=0, second=None) -> list[float]:
    """A row with logit 3.0 at ``top``, 2.0 at ``second`` (if given), 0 elsewhere."""
    row = [0.0] * vocab
    row[top] = 3.0
    if second is not None:
        row[second] = 2.0
    return row


def greedy_one(row, **kwargs) -> tuple[int, torch.Tensor]:
    """One greedy request over ``row`` (``kwargs`` as ``make_req``'s): its token and the processed logits."""
    req = make_req(**{"temperature": 0.0, **kwargs})
    logits = rows(row)
    out = Sampler()(logits, [req])
    return out.token_ids[0], logits[0]


def sample_many(row, n=400, seed=0, bitmask=None, **params) -> list[int]:
    """``n`` unseeded requests over the same logits row, sampled in one batch."""
    reqs = [make_req(f"r{i}", **params) for i in range(n)]
    return Sampler(seed)(rows(*[row] * n), reqs, bitmask).token_ids


def sample_mixed(row, param_sets: list[dict], n=300) -> list[set[int]]:
    """``n`` rows per parameter set, interleaved in one batch: the tokens each set sampled."""
    reqs = [make_req(f"r{i}", **param_sets[i % len(param_sets)]) for i in range(n * len(param_sets))]
    tokens = Sampler(0)(rows(*[row] * len(reqs)), reqs).token_ids
    return [set(tokens[k :: len(param_sets)]) for k in range(len(param_sets))]


def probs_row(probs: list[float], vocab=8) -> list[float]:
    """Logits whose softmax is ``probs`` (padded with equal small probabilities)."""
    rest = (1.0 - sum(probs)) / (vocab - len(probs))
    return [math.log(p) for p in probs] + [math.log(rest)] * (vocab - len(probs))


def softmax(row) -> list[float]:
    return torch.tensor(row).softmax(-1).tolist()


def bitmask_rows(allowed_per_row: list[set[int]], vocab: int) -> torch.Tensor:
    """xgrammar's layout: bit j of word w allows token 32 * w + j (bit 31 is the sign bit)."""
    words = (vocab + 31) // 32
    mask = torch.zeros(len(allowed_per_row), words, dtype=torch.int32)
    for r, allowed in enumerate(allowed_per_row):
        for w in range(words):
            value = sum(1 << (t - 32 * w) for t in allowed if 32 * w <= t < 32 * (w + 1))
            mask[r, w] = value - (1 << 32) if value >= 1 << 31 else value
    return mask


# ---------------------------------------------------------------- greedy and temperature


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    """temperature=0 rows take each row's argmax, even batched with a hot sampled row
    (breaks if greedy rows were sampled or rows were mixed up)."""
    logits = rows(peaked(top=3), [0.0] * VOCAB, peaked(top=9), peaked(top=0))
    reqs = [make_req(rid, temperature=t) for rid, t in (("a", 0.0), ("b", 1.0), ("c", 0.0), ("d", 0.0))]
    out = Sampler()(logits, reqs)
    assert [out.token_ids[i] for i in (0, 2, 3)] == [3, 9, 0]
    assert out.logprobs == [None] * 4


def test_temperature_below_epsilon_is_greedy():
    """temperature 1e-6 counts as greedy (vLLM's epsilon): on a tie every row takes the same
    (first) maximum instead of sampling between the tied tokens."""
    row = [0.0] * VOCAB
    row[2] = row[5] = 3.0
    assert set(sample_many(row, n=100, temperature=1e-6)) == {2}
    assert set(sample_many(row, n=100, temperature=1e-3)) == {2, 5}  # sampled: the tie splits


def test_near_zero_temperature_picks_the_argmax_where_temperature_one_does_not():
    """A tiny (but non-greedy) temperature sharpens the distribution to its argmax; at 1.0 the
    same logits sample other tokens (breaks if temperature were not divided in)."""
    row = peaked(top=5)  # p(argmax) = e^3 / (e^3 + 15) ~ 0.57 at temperature 1
    assert set(sample_many(row, n=200, temperature=1e-3)) == {5}
    assert len(set(sample_many(row, n=200, temperature=1.0))) > 5


def test_high_temperature_spreads_over_the_vocabulary():
    """Temperature 100 flattens a strongly peaked row to nearly uniform (breaks if ignored)."""
    row = [5.0] + [0.0] * (VOCAB - 1)  # p(0) ~ 0.91 at temperature 1
    cold = sample_many(row, temperature=1.0)
    hot = sample_many(row, temperature=100.0)
    assert cold.count(0) > 0.8 * len(cold)
    assert hot.count(0) < 0.2 * len(hot)
    assert len(set(hot)) == VOCAB


# ---------------------------------------------------------------- top_k, top_p, min_p


def test_top_k_keeps_only_the_k_most_likely_tokens_per_row():
    """top_k=3 samples only the 3 highest logits (all 3 of them), while top_k=0 rows in the same
    batch range wider (breaks if top_k were ignored or applied to every row)."""
    row = torch.randn(32, generator=torch.Generator().manual_seed(0)).tolist()
    top3 = set(torch.tensor(row).topk(3).indices.tolist())
    n = 200
    reqs = [make_req(f"k{i}", temperature=5.0, top_k=3) for i in range(n)]
    reqs += [make_req(f"u{i}", temperature=5.0, top_k=0) for i in range(n)]
    tokens = Sampler(0)(rows(*[row] * (2 * n)), reqs).token_ids
    assert set(tokens[:n]) == top3
    assert len(set(tokens[n:]) - top3) > 5


def test_rows_of_several_top_ks_each_keep_their_own():
    """top_k 2, 5 and one past the vocabulary in one batch: each row samples its own k most likely
    tokens, all of them (the k-th largest logit is taken per row from one top-k of the largest k)."""
    row = torch.randn(32, generator=torch.Generator().manual_seed(1)).tolist()
    n = 300
    reqs = [make_req(f"k{k}-{i}", temperature=10.0, top_k=k) for k in (2, 5, 40) for i in range(n)]
    tokens = Sampler(0)(rows(*[row] * (3 * n)), reqs).token_ids
    best = torch.tensor(row).argsort(descending=True).tolist()
    assert set(tokens[:n]) == set(best[:2])
    assert set(tokens[n : 2 * n]) == set(best[:5])
    assert len(set(tokens[2 * n :])) > 15  # no cut: the whole vocabulary of 32


def test_top_k_one_is_greedy():
    """top_k=1 leaves only the argmax, whatever the temperature."""
    assert set(sample_many(peaked(top=7), n=100, temperature=2.0, top_k=1)) == {7}


def test_top_p_samples_only_the_nucleus():
    """With probabilities 0.4, 0.3, 0.2, 0.05, ...: top_p=0.8 keeps tokens 0-2 (token 2 is needed to
    reach 0.8), top_p=0.35 keeps the argmax alone, top_p=1.0 samples the tail too; all in one batch
    (breaks if top_p were ignored or a row took another row's value)."""
    row = probs_row([0.4, 0.3, 0.2, 0.05])
    nucleus, alone, full = sample_mixed(row, [{"top_p": 0.8}, {"top_p": 0.35}, {"top_p": 1.0}])
    assert nucleus == {0, 1, 2}
    assert alone == {0}
    assert full - {0, 1, 2}


def test_a_nucleus_past_the_candidates_sorts_its_row_whole(monkeypatch):
    """With 2 candidate tokens per row: top_p=0.8 needs 3 tokens, so its row is sorted whole, while
    the top_p=0.5 rows in the same batch find their 2 tokens among the candidates."""
    import kiln.worker.sampler as sampler

    monkeypatch.setattr(sampler, "NUCLEUS_CANDIDATES", 2)
    row = probs_row([0.4, 0.3, 0.2, 0.05])
    wide, narrow, full = sample_mixed(row, [{"top_p": 0.8}, {"top_p": 0.5}, {"top_p": 1.0}])
    assert (wide, narrow) == ({0, 1, 2}, {0, 1})
    assert full - {0, 1, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    """With p_max=0.4: min_p=0.4 drops tokens under 0.16 (keeps 0-2), min_p=0.6 drops under 0.24
    (keeps 0-1), min_p=0 keeps the tail; all in one batch."""
    row = probs_row([0.4, 0.3, 0.2, 0.05])
    wide, narrow, none = sample_mixed(row, [{"min_p": 0.4}, {"min_p": 0.6}, {"min_p": 0.0}])
    assert wide == {0, 1, 2}
    assert narrow == {0, 1}
    assert none - {0, 1, 2}


# ---------------------------------------------------------------- token rules


def test_logit_bias_adds_to_the_logits():
    """logit_bias adds its values to those tokens: +3 on token 5 overtakes the argmax, -100 on the
    argmax hands it to the runner-up (breaks if the bias were ignored or misplaced)."""
    token, logits = greedy_one(peaked(top=0, second=4), logit_bias={5: 3.5})
    assert token == 5
    assert logits[5].item() == 3.5 and logits[0].item() == 3.0
    token, logits = greedy_one(peaked(top=0, second=4), logit_bias={0: -100.0})
    assert token == 4
    assert logits[0].item() == -97.0


def test_allowed_token_ids_masks_every_other_token():
    """Only allowed_token_ids keep their logits (the rest become -inf), greedy or sampled."""
    row = peaked(top=0, second=4)
    row[3], row[7] = 1.0, 1.5
    token, logits = greedy_one(row, allowed_token_ids=[3, 7])
    assert token == 7
    assert logits[3].item() == 1.0 and logits[7].item() == 1.5
    assert all(logits[t].item() == NEG_INF for t in range(VOCAB) if t not in (3, 7))
    assert set(sample_many(row, n=200, temperature=1.0, allowed_token_ids=[3, 7, 11])) == {3, 7, 11}


def test_single_token_bad_words_are_always_banned():
    """A one-token bad word can never be sampled, before or after any output."""
    for output in ((), (2,), (0, 0)):
        req = make_req(temperature=0.0, output=output)
        req.sampling_params._bad_words_token_ids = [[0]]
        logits = rows(peaked(top=0, second=4))
        assert Sampler()(logits, [req]).token_ids == [4]
        assert logits[0, 0].item() == NEG_INF


@pytest.mark.parametrize(
    ("output", "banned"),
    [
        ((), False),
        ((9,), False),
        ((3,), False),  # only part of the prefix
        ((4,), False),
        ((4, 3), False),  # the prefix in the wrong order
        ((3, 4), True),
        ((0, 5, 3, 4), True),
        ((3, 4, 9), False),  # the prefix, but not just before
    ],
)
def test_multi_token_bad_words_are_banned_only_after_their_prefix(output, banned):
    """Bad word [3, 4, 0] bans token 0 only when the output ends with 3, 4 (breaks if the prefix
    were ignored, matched anywhere, or matched on a partial prefix)."""
    req = make_req(temperature=0.0, output=output)
    req.sampling_params._bad_words_token_ids = [[3, 4, 0]]
    logits = rows(peaked(top=0, second=6))
    assert Sampler()(logits, [req]).token_ids == [6 if banned else 0]


def test_bad_word_prefix_in_the_prompt_does_not_ban():
    """The prefix is matched against the generated output, not the prompt."""
    req = make_req(temperature=0.0, prompt=(3, 4))
    req.sampling_params._bad_words_token_ids = [[3, 4, 0]]
    assert Sampler()(rows(peaked(top=0, second=6)), [req]).token_ids == [0]


@pytest.mark.parametrize(("num_output", "expected"), [(0, 1), (1, 1), (2, EOS), (3, EOS)])
def test_min_tokens_bans_eos_and_stop_token_ids_until_reached(num_output, expected):
    """Below min_tokens=2 outputs, EOS (the argmax) and the stop token (runner-up) are banned and
    token 1 wins; from 2 outputs on, EOS wins again."""
    row = peaked(top=EOS, second=12)
    row[1] = 1.0
    token, logits = greedy_one(row, output=[5] * num_output, min_tokens=2, stop_token_ids=[12])
    assert token == expected
    if num_output < 2:
        assert logits[EOS].item() == NEG_INF and logits[12].item() == NEG_INF


def test_min_tokens_with_ignore_eos_still_bans_stop_token_ids():
    """ignore_eos leaves EOS allowed, but stop_token_ids stay banned below min_tokens."""
    token, logits = greedy_one(peaked(top=12, second=EOS), min_tokens=2, stop_token_ids=[12], ignore_eos=True)
    assert token == EOS
    assert logits[12].item() == NEG_INF


def test_min_tokens_bans_every_eos_id():
    """A model with several EOS ids has them all banned."""
    row = peaked(top=EOS, second=14)
    row[2] = 1.0
    token, logits = greedy_one(row, eos=(14, EOS), min_tokens=1)
    assert token == 2
    assert logits[14].item() == NEG_INF and logits[EOS].item() == NEG_INF


# ---------------------------------------------------------------- penalties


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    """repetition_penalty=2 on prompt token 0 and output token 1: 2.0 -> 1.0 and -1.0 -> -2.0;
    unseen tokens keep their logits, so token 2 (1.5) now wins over token 0."""
    row = [2.0, -1.0, 1.5, -2.0, 0.5, 0.0, 0.0, 0.0]
    token, logits = greedy_one(row, prompt=(0,), output=(1,), repetition_penalty=2.0)
    assert token == 2
    assert logits.tolist() == [1.0, -2.0, 1.5, -2.0, 0.5, 0.0, 0.0, 0.0]


def test_repetition_penalty_below_one_favours_seen_tokens():
    """repetition_penalty=0.5 doubles a seen positive logit: prompt token 2 (1.5 -> 3.0) beats 0 (2.0)."""
    row = [2.0, -1.0, 1.5, -2.0, 0.0, 0.0, 0.0, 0.0]
    token, logits = greedy_one(row, prompt=(2, 3), repetition_penalty=0.5)
    assert token == 2
    assert logits.tolist() == [2.0, -1.0, 3.0, -1.0, 0.0, 0.0, 0.0, 0.0]


def test_presence_and_frequency_penalties_subtract_per_output_token():
    """Output [1, 1, 1, 2]: token 1 loses 3 * 0.25 + 0.5, token 2 loses 0.25 + 0.5; the prompt
    token 3 and unseen tokens are untouched, so token 0 overtakes token 1."""
    row = [1.0, 2.0, 0.5, 0.25, 0.0, 0.0, 0.0, 0.0]
    token, logits = greedy_one(row, prompt=(3,), output=(1, 1, 1, 2), presence_penalty=0.5, frequency_penalty=0.25)
    assert token == 0
    assert logits.tolist() == [1.0, 0.75, -0.25, 0.25, 0.0, 0.0, 0.0, 0.0]


def test_presence_penalty_counts_a_token_once_and_frequency_penalty_every_time():
    """Each penalty alone: presence subtracts 1.0 per distinct token, frequency 1.0 per occurrence."""
    row = [0.0] * 8
    _, logits = greedy_one(row, output=(1, 1, 1, 2), presence_penalty=1.0)
    assert logits.tolist()[:4] == [0.0, -1.0, -1.0, 0.0]
    _, logits = greedy_one(row, output=(1, 1, 1, 2), frequency_penalty=1.0)
    assert logits.tolist()[:4] == [0.0, -3.0, -1.0, 0.0]


def test_negative_presence_penalty_favours_output_tokens():
    """presence_penalty=-2 lifts output token 4 (1.0 -> 3.0) over the argmax 0 (2.5)."""
    row = [2.5, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert greedy_one(row, output=(4,), presence_penalty=-2.0)[0] == 4


def test_repetition_then_presence_and_frequency_penalties_combine():
    """Repetition scales first (2.0 / 2 = 1.0), then presence and frequency subtract (1.0 - 0.5 - 0.5)."""
    row = [2.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    token, logits = greedy_one(row, output=(0,), repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.5)
    assert logits[0].item() == 0.0
    assert token == 1


def test_penalties_apply_only_to_their_own_row():
    """A penalised row beside an unpenalised one: the other row's logits are left as they were."""
    row = [2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    logits = rows(row, row)
    reqs = [make_req("a", temperature=0.0, output=(0,), frequency_penalty=2.0), make_req("b", temperature=0.0)]
    assert Sampler()(logits, reqs).token_ids == [1, 0]
    assert logits[1].tolist() == row


# ---------------------------------------------------------------- guided-decoding bitmask


def test_bitmask_masks_only_its_listed_rows():
    """Row 0 (listed) may take only 3 or 33 (the second word) and picks 33; row 1, not listed,
    keeps its argmax although its bitmask row allows nothing (breaks if the rows were ignored)."""
    vocab = 40
    row = [0.0] * vocab
    row[0], row[3], row[33] = 5.0, 1.0, 2.0
    mask = bitmask_rows([{3, 33}, set()], vocab)
    logits = rows(row, row)
    reqs = [make_req("a", temperature=0.0), make_req("b", temperature=0.0)]
    out = Sampler()(logits, reqs, GrammarBitmask(mask, [0]))
    assert out.token_ids == [33, 0]
    assert [t for t in range(vocab) if logits[0, t] > NEG_INF] == [3, 33]
    assert logits[1].tolist() == row


def test_sampled_rows_only_take_bitmask_allowed_tokens():
    """Hot sampling under a bitmask draws only allowed tokens, including token 31 (the sign bit)."""
    vocab, n = 40, 300
    allowed = {2, 31, 32, 39}
    mask = bitmask_rows([allowed] * n, vocab)
    tokens = sample_many([0.0] * vocab, n=n, temperature=1.0, bitmask=GrammarBitmask(mask, list(range(n))))
    assert set(tokens) == allowed


def test_the_constructor_bitmask_kernel_is_the_one_called():
    """A backend's kernel passed to the constructor is called with (logits, bitmask, rows), and its
    effect is what the sampler sees; without a bitmask it is not called."""
    calls = []

    def kernel(logits, bitmask, rows_):
        calls.append((logits.shape, bitmask.tolist(), list(rows_)))
        logits[rows_, 0] = NEG_INF  # bans token 0 whatever the bitmask says

    sampler = Sampler(bitmask_kernel=kernel)
    mask = allocate_bitmask(2, VOCAB)
    reqs = [make_req("a", temperature=0.0), make_req("b", temperature=0.0)]
    out = sampler(rows(peaked(top=0, second=4), peaked(top=0, second=5)), reqs, GrammarBitmask(mask, [1]))
    assert out.token_ids == [0, 5]
    assert calls == [((2, VOCAB), mask.tolist(), [1])]
    sampler(rows(peaked(top=0)), reqs[:1])
    assert len(calls) == 1


# ---------------------------------------------------------------- seeds


def seeded_stream(sampler, req, row, steps, others=0, at=0) -> list[int]:
    """``req``'s tokens over ``steps`` calls, batched with ``others`` unseeded hot rows."""
    tokens = []
    for _ in range(steps):
        batch = [make_req(f"o{i}", temperature=1.0) for i in range(others)]
        batch.insert(at, req)
        other_rows = [[float(i % 3)] * len(row) for i in range(others)]
        other_rows.insert(at, row)
        token = sampler(rows(*other_rows), batch).token_ids[at]
        tokens.append(token)
    return tokens


FLAT = [0.0] * 32


def test_a_seeded_row_samples_the_same_alone_or_batched():
    """Same seed, same tokens: alone, first or last among 5 unseeded rows, and under another
    engine seed (breaks if its noise came from the engine-wide generator)."""
    alone = seeded_stream(Sampler(0), make_req(seed=1234, temperature=1.0), FLAT, 8)
    assert len(set(alone)) > 1
    for engine_seed, at in ((0, 0), (0, 5), (99, 2)):
        req = make_req(seed=1234, temperature=1.0)
        assert seeded_stream(Sampler(engine_seed), req, FLAT, 8, others=5, at=at) == alone


def test_different_seeds_give_different_tokens():
    """Seeds 1, 2 and 3 give three different streams (breaks if the seed were not used)."""
    streams = {seed: seeded_stream(Sampler(0), make_req(seed=seed, temperature=1.0), FLAT, 8) for seed in (1, 2, 3)}
    assert len({tuple(s) for s in streams.values()}) == 3


def test_a_seeded_generator_continues_across_calls_and_free_restarts_it():
    """Successive calls continue the request's stream (a restart would repeat the first token on
    identical logits); ``free`` drops it, so the same id then starts over; other ids keep theirs."""
    sampler = Sampler(0)
    a, b = make_req("a", seed=7, temperature=1.0), make_req("b", seed=7, temperature=1.0)
    first = seeded_stream(sampler, a, FLAT, 6)
    assert len(set(first)) > 1
    assert seeded_stream(sampler, b, FLAT, 3) == first[:3]  # its own generator, same seed
    sampler.free(["a", "unknown"])
    assert "a" not in sampler.seeded and "b" in sampler.seeded
    assert seeded_stream(sampler, a, FLAT, 6) == first
    assert seeded_stream(sampler, b, FLAT, 3) == first[3:6]


def test_unseeded_rows_follow_the_engine_seed():
    """Two samplers with the same seed agree over several calls; another seed differs; rows of one
    batch draw independent noise (breaks if they shared one noise row)."""

    def run(seed):
        sampler = Sampler(seed)
        return [
            sampler(rows(*[FLAT] * 16), [make_req(f"r{i}", temperature=1.0) for i in range(16)]).token_ids
            for _ in range(3)
        ]

    same = run(5)
    assert run(5) == same
    assert run(6) != same
    assert len(set(same[0])) > 5
    assert same[0] != same[1]  # the generator moves on between calls


# ---------------------------------------------------------------- logprobs


def test_logprobs_report_the_raw_logprob_rank_and_top_k():
    """logprobs=2 with a bias forcing the third-ranked token: the chosen token's logprob and rank
    are those of the raw logits (before bias and penalties), the top-2 are the raw top-2."""
    row = [3.0, 2.0, 1.0, 0.0, -1.0, 0.0, 0.0, 0.0]
    raw = torch.tensor(row).log_softmax(-1)
    req = make_req(temperature=0.0, logprobs=2, logit_bias={2: 10.0}, output=(0,), repetition_penalty=3.0)
    out = Sampler()(rows(row), [req])
    assert out.token_ids == [2]
    (lp,) = out.logprobs
    assert isinstance(lp, TopLogprobs)
    assert lp.token_id == 2 and lp.rank == 3
    assert lp.logprob == pytest.approx(raw[2].item())
    assert lp.top_ids == [0, 1]
    assert lp.top_logprobs == pytest.approx(raw[:2].tolist())


def test_logprobs_of_a_sampled_token_and_rows_without_logprobs():
    """Sampled rows report their chosen token's raw logprob; rows with logprobs=None get None;
    logprobs=0 gives the chosen token with no top list."""
    row = probs_row([0.4, 0.3, 0.2, 0.05])
    reqs = [make_req("a", seed=3, temperature=1.0, logprobs=1), make_req("b", temperature=1.0)]
    reqs.append(make_req("c", temperature=0.0, logprobs=0))
    out = Sampler()(rows(row, row, row), reqs)
    a, b, c = out.logprobs
    assert b is None
    assert a.token_id == out.token_ids[0] and a.logprob == pytest.approx(math.log(softmax(row)[a.token_id]))
    assert a.top_ids == [0] and a.top_logprobs == pytest.approx([math.log(0.4)])
    assert (c.token_id, c.rank, c.top_ids, c.top_logprobs) == (0, 1, [], [])
    assert c.logprob == pytest.approx(math.log(0.4))


def test_best_of_returns_logprobs_without_being_asked():
    """best_of > 1 needs each sequence's logprob to rank them, so it gets one even with logprobs=None."""
    row = probs_row([0.4, 0.3, 0.2, 0.05])
    reqs = [make_req("a", temperature=0.0, n=1, best_of=3), make_req("b", temperature=0.0)]
    out = Sampler()(rows(row, row), reqs)
    lp, none = out.logprobs
    assert none is None
    assert (lp.token_id, lp.rank, lp.top_ids) == (0, 1, [])
    assert lp.logprob == pytest.approx(math.log(0.4))


def test_top_logprobs_function():
    """Rank counts the tokens strictly more likely, plus one; top-k is sorted by logprob."""
    lps = torch.tensor([3.0, 1.0, 2.0, 0.0]).log_softmax(-1)
    lp = top_logprobs(lps, 2, 2)
    assert (lp.token_id, lp.rank, lp.top_ids) == (2, 2, [0, 2])
    assert lp.logprob == pytest.approx(lps[2].item())
    assert lp.top_logprobs == pytest.approx([lps[0].item(), lps[2].item()])
    last = top_logprobs(lps, 3, 0)
    assert (last.rank, last.top_ids, last.top_logprobs) == (4, [], [])


def test_prompt_top_logprobs_scores_each_next_prompt_token():
    """Row i scores next_tokens[i] under log-softmax; a last row with no next token gives nothing."""
    logits = rows([0.0, 2.0, 1.0, 0.0], [5.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 9.0])
    out = prompt_top_logprobs(logits, [2, 0], 1)
    assert len(out) == 2
    lps = logits.log_softmax(-1)
    assert (out[0].token_id, out[0].rank, out[0].top_ids) == (2, 2, [1])
    assert out[0].logprob == pytest.approx(lps[0, 2].item())
    assert (out[1].token_id, out[1].rank, out[1].top_ids) == (0, 1, [0])
    assert out[1].top_logprobs == pytest.approx([lps[1, 0].item()])


# ---------------------------------------------------------------- grammar_bitmask


class FakeMatcher:
    """Allows a fixed set of tokens until terminated; records the rows it was asked to fill."""

    def __init__(self, allowed: set[int], terminated: bool = False) -> None:
        self.allowed, self.terminated, self.filled, self.accepted = allowed, terminated, [], []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.filled.append(row)
        bitmask[row] = bitmask_rows([self.allowed], bitmask.shape[1] * 32)[0]

    def is_terminated(self) -> bool:
        return self.terminated

    def accept(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return token_id in self.allowed


def test_grammar_bitmask_is_none_without_an_active_matcher():
    assert grammar_bitmask([make_req("a"), make_req("b")], VOCAB) is None
    assert grammar_bitmask([make_req("a", matcher=FakeMatcher({1}, terminated=True))], VOCAB) is None


def test_grammar_bitmask_fills_the_active_rows_and_the_sampler_obeys_it():
    """Rows with a live matcher are listed and filled at their own index; others stay all-allowed
    and unconstrained when sampled (breaks if rows shifted or terminated matchers were applied)."""
    vocab = 40
    live1, done, live3 = FakeMatcher({5, 34}), FakeMatcher({1}, terminated=True), FakeMatcher({7})
    reqs = [make_req("a", temperature=0.0), make_req("b", temperature=0.0, matcher=live1)]
    reqs += [make_req("c", temperature=0.0, matcher=done), make_req("d", temperature=0.0, matcher=live3)]
    mask = grammar_bitmask(reqs, vocab)
    assert mask.rows == [1, 3]
    assert mask.bitmask.shape == (4, 2) and mask.bitmask.dtype == torch.int32
    assert (live1.filled, done.filled, live3.filled) == ([1], [], [3])
    assert mask.bitmask[0].tolist() == [-1, -1] and mask.bitmask[2].tolist() == [-1, -1]
    row = [0.0] * vocab
    row[0], row[5], row[7], row[34] = 9.0, 1.0, 1.0, 2.0
    out = Sampler(bitmask_kernel=apply_token_bitmask)(rows(*[row] * 4), reqs, mask)
    assert out.token_ids == [0, 34, 0, 7]
    for req, token in zip(reqs, out.token_ids):
        if req.matcher is not None and not req.matcher.is_terminated():
            assert req.matcher.accept(token)


# ---------------------------------------------------------------- drafts (speculative decoding)


class ScriptedMatcher(GuideMatcher):
    """Allows ``script[i]`` as the i-th token (nothing once the script runs out); rolls back."""

    def __init__(self, script: list[set[int]]) -> None:
        self.script, self.pos = script, 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        allowed = self.script[self.pos] if self.pos < len(self.script) else set()
        bitmask[row] = bitmask_rows([allowed], bitmask.shape[1] * 32)[0]

    def accept(self, token_id: int) -> bool:
        self.pos += 1
        return True

    def is_terminated(self) -> bool:
        return False

    def rollback(self, num_tokens: int) -> None:
        self.pos -= num_tokens


def test_drafts_are_accepted_while_the_sampled_token_equals_them():
    req = make_req("a", temperature=0)
    req.spec_token_ids = [2, 3, 4]
    logits = rows(*[[0, 0, 0, 0, 0, 0]] * 4)
    for row, best in enumerate((2, 3, 1, 5)):  # positions 0, 1 agree with the drafts; 2 does not
        logits[row, best] = 5.0
    (tokens,) = sample_with_drafts(Sampler(), logits, [req]).values()
    assert [t.token_id for t in tokens] == [2, 3, 1]


def test_a_constraint_that_dies_after_accepted_drafts_keeps_them():
    """Without drafts, token 2 would be emitted and the next step would find the dead end: so it
    is here, and the matcher is alive, rolled back, for the scheduler to advance."""
    matcher = GuardedMatcher(ScriptedMatcher([{2}]), stop_token_ids=[EOS], vocab_size=VOCAB)
    req = make_req("a", temperature=0, matcher=matcher)
    req.spec_token_ids = [2, 3]
    logits = torch.zeros(3, VOCAB)
    logits[:, 2] = 1.0
    (tokens,) = sample_with_drafts(Sampler(), logits, [req]).values()
    assert [t.token_id for t in tokens] == [2] and not matcher.dead and matcher.inner.pos == 0


def test_matchers_without_rollback_report_it():
    assert ScriptedMatcher([]).supports_rollback
    assert not FakeMatcherNoRollback([]).supports_rollback
    assert not GuardedMatcher(FakeMatcherNoRollback([]), [EOS], VOCAB).supports_rollback


class FakeMatcherNoRollback(ScriptedMatcher):
    rollback = GuideMatcher.rollback


def test_greedy_rows_take_the_platforms_argmax():
    """The argmax op handed to the sampler (a platform's, ``kiln.interfaces.model``) picks the
    greedy rows' tokens, after the logits processors; sampled rows do not use it."""
    seen = []

    def last_largest(logits):
        seen.append(logits.clone())
        return logits.shape[1] - 1 - logits.flip(-1).argmax(-1)

    sampler = Sampler(argmax=last_largest)
    row = peaked(top=2)
    row[9] = 3.0  # a tie: the reference picks 2, this op 9
    greedy, banned, sampled = make_req("a", temperature=0.0), make_req("b", temperature=0.0, logit_bias={9: -100}), \
        make_req("c", temperature=1.0, top_k=1)  # fmt: skip
    out = sampler(rows(row, row, peaked(top=4)), [greedy, banned, sampled])
    assert out.token_ids == [9, 2, 4]
    assert len(seen) == 1 and seen[0][1, 9] < 0  # called once, on the processed logits
    assert Sampler()(rows(row), [make_req(temperature=0.0)]).token_ids == [2]
