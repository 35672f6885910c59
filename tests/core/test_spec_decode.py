"""Speculative decoding: its flags, n-gram lookup, and that outputs are exactly those of
decoding one token at a time (greedy and seeded tokens, logprobs, stops, guided JSON,
preemption), with drafts accepted and rejected along the way."""

from __future__ import annotations

import argparse
import json
import math
import random

import pytest

from kiln import LLM, SamplingParams
from kiln.config import EngineConfig
from kiln.engine_args import add_engine_args, engine_kwargs
from kiln.spec_decode.ngram import NgramProposer
from kiln.spec_decode.stats import SpecDecodeStats
from kiln.testing.spec_decode import NGRAM, ReplayProposer, replayed_greedy

# ---------------------------------------------------------------- flags


def test_the_json_config_takes_vllms_defaults():
    spec = EngineConfig.create(speculative_config='{"method": "ngram", "num_speculative_tokens": 4}').speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (
        "ngram", 4, 5, 5,
    )  # fmt: skip
    spec = EngineConfig.create(speculative_config={"model": "[ngram]", "num_speculative_tokens": 2,
                                                   "prompt_lookup_max": 3}).speculative_config  # fmt: skip
    assert (spec.method, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 3, 3)


def test_the_older_separate_flags_fold_into_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    argv = ["--speculative-model", "[ngram]", "--num-speculative-tokens", "3", "--ngram-prompt-lookup-max", "4",
            "--ngram-prompt-lookup-min", "2", "--speculative-disable-by-batch-size", "8", "-spec-draft-tp", "1"]  # fmt: skip
    config = EngineConfig.create(**engine_kwargs(parser.parse_args(argv)))
    spec = config.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (
        "ngram", 3, 2, 4,
    )  # fmt: skip
    assert spec.disable_by_batch_size == 8
    config.max_num_seqs = 4  # a later assignment re-validates without folding twice
    assert config.speculative_config == spec


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"speculative_config": '{"method": "ngram"}'}, "num_speculative_tokens is required"),
        ({"speculative_config": "{not json"}, "not valid JSON"),
        ({"speculative_config": {"method": "medusa", "model": "x", "num_speculative_tokens": 2}}, "not implemented"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "typo": 1}}, "typo"),
        ({"speculative_config": {**NGRAM, "prompt_lookup_min": 4}}, "exceeds prompt_lookup_max"),
        ({"num_speculative_tokens": 3}, "need --speculative-model"),
        ({"speculative_model": "[ngram]", "num_speculative_tokens": 2, "speculative_config": NGRAM}, "not both"),
        (
            {
                "speculative_model": "[ngram]",
                "num_speculative_tokens": 2,
                "spec_decoding_acceptance_method": "typical_acceptance_sampler",
            },
            "typical acceptance",
        ),  # fmt: skip
        (
            {"speculative_model": "[ngram]", "num_speculative_tokens": 2, "speculative_draft_tensor_parallel_size": 2},
            "no draft model",
        ),  # fmt: skip
        (
            {"speculative_model": "[ngram]", "num_speculative_tokens": 2, "speculative_disable_mqa_scorer": True},
            "one multi-query pass",
        ),  # fmt: skip
        (
            {
                "speculative_model": "[ngram]",
                "num_speculative_tokens": 2,
                "disable_logprobs_during_spec_decoding": True,
            },
            "always returned",
        ),  # fmt: skip
    ],
)
def test_settings_kiln_does_not_run_are_refused_with_the_reason(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.create(**kwargs)


# ---------------------------------------------------------------- n-gram lookup


def test_ngram_lookup_prefers_the_longest_then_the_latest_match():
    proposer = NgramProposer(1, 3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 2, 3, 8, 7, 2, 3]
    # "2 3" ended at 2 and 5 (latest: 5, followed by 8 7 ...); "1 2 3"... the 3-gram "3 2 3"? absent; "7 2 3" absent.
    assert proposer.propose("a", tokens, 3) == [8, 7, 2]
    tokens2 = [5, 1, 2, 3, 6, 0, 2, 3, 4, 1, 2, 3]  # "1 2 3" (longest) ended at 3, followed by 6
    assert NgramProposer(1, 3).propose("b", tokens2, 2) == [6, 0]
    assert NgramProposer(1, 3).propose("c", [1, 2, 3, 4], 2) == []  # 4 never came before
    assert NgramProposer(2, 3).propose("d", [1, 2, 9, 2], 2) == []  # "9 2" is new; 1-grams are below the minimum


def test_ngram_tables_grow_incrementally_as_a_fresh_lookup_would_find():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(200)]
    incremental = NgramProposer(1, 4)
    for end in range(1, 200, 3):
        assert incremental.propose("r", tokens[:end], 4) == NgramProposer(1, 4).propose("r", tokens[:end], 4)
    incremental.free("r")
    assert incremental.tables == {}


def test_stats_count_drafts_by_position():
    stats = SpecDecodeStats()
    stats.observe(3, 2)
    stats.observe(2, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 2)
    assert stats.accepted_per_pos == [1, 1, 0]
    assert stats.acceptance_rate == pytest.approx(0.4) and stats.mean_acceptance_length == pytest.approx(2.0)
    later = SpecDecodeStats()
    later.observe(4, 4)
    total = stats.plus(later)  # several runs' counts together (the benchmark's rounds)
    assert (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens) == (3, 9, 6)
    assert total.accepted_per_pos == [2, 2, 1, 1] and stats.accepted_per_pos == [1, 1, 0]


# ---------------------------------------------------------------- exactness on a tiny model


@pytest.mark.parametrize("budget", [16, 2048])
def test_greedy_equals_decoding_without_speculation(tiny_model_dir, cpu_plugins, varied_prompts, budget):
    """Drafts accepted whole, in part and not at all, with chunked prefill (a 16-token budget also
    cuts drafts short) and prefix caching (the prompts repeat): the same tokens as without drafts."""
    prompts = varied_prompts + varied_prompts[1:3]
    common = dict(model=tiny_model_dir("llama"), device="cpu", dtype="float32", block_size=16)
    reference, got, engine = replayed_greedy(cpu_plugins, prompts, 12, max_num_batched_tokens=budget, **common)
    assert got == reference
    stats = engine.core.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_pos[2] > 0  # some steps accepted all three drafts


@pytest.fixture(scope="module")
def tiny_llms(tiny_model_dir):
    common = dict(dtype="float32", max_model_len=256, block_size=16)
    return LLM(tiny_model_dir("llama"), **common), LLM(tiny_model_dir("llama"), speculative_config=NGRAM, **common)


def replay(spec_llm: LLM, prompts: list[list[int]], references: list[list[int]], wrong_every: int = 7) -> None:
    spec_llm.engine.core.scheduler.proposer = ReplayProposer.of(prompts, references, wrong_every)


PROMPTS = [[1000, 7, 9], list(range(100, 119)), [5, 6, 7, 8, 9] * 3]
SAMPLED = [
    SamplingParams(temperature=0.8, seed=1, max_tokens=24, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=1.2, top_k=20, top_p=0.9, min_p=0.01, seed=2, max_tokens=24, ignore_eos=True),
    SamplingParams(
        temperature=0.7,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.4,
        seed=3,
        max_tokens=24,
        ignore_eos=True,
        logit_bias={42: 5.0},
    ),  # fmt: skip
]


def generate(llm: LLM, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def test_seeded_sampling_gives_the_same_tokens_and_logprobs(tiny_llms):
    """A seeded request draws once per emitted token from its own generator, so with any sampling
    parameters it samples what it samples without drafts; logprobs are those of the same positions."""
    plain, spec = tiny_llms
    want = generate(plain, PROMPTS, SAMPLED)
    replay(spec, PROMPTS, [o.outputs[0].token_ids for o in want])
    before = spec.engine.core.scheduler.spec_stats.num_accepted_tokens
    got = generate(spec, PROMPTS, SAMPLED)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert spec.engine.core.scheduler.spec_stats.num_accepted_tokens - before > 20
    for g, w in zip(got[0].outputs[0].logprobs, want[0].outputs[0].logprobs):
        assert g.keys() == w.keys()
        assert [g[t].logprob for t in g] == pytest.approx([w[t].logprob for t in w], abs=1e-4)


def test_stops_end_the_sequence_where_decoding_without_drafts_would(tiny_llms):
    """Stop strings, stop token ids, min_tokens, max_tokens and EOS inside a step's accepted drafts."""
    plain, spec = tiny_llms
    tokenizer = plain.get_tokenizer()
    free = generate(plain, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    ids = free.token_ids
    stop_text = tokenizer.decode(ids[9:11]).strip()
    cases = [
        SamplingParams(temperature=0, max_tokens=24, stop=[stop_text]),
        SamplingParams(temperature=0, max_tokens=24, stop=[stop_text], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ids[7]], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ids[2]], min_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
    ]
    prompts = PROMPTS[:1] * len(cases)
    want = generate(plain, prompts, cases)
    replay(spec, PROMPTS[:1], [ids], wrong_every=10)
    got = generate(spec, prompts, cases)
    for g, w in zip(got, want):
        g, w = g.outputs[0], w.outputs[0]
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (w.token_ids, w.text, w.finish_reason,
                                                                          w.stop_reason)  # fmt: skip
    assert [len(o.outputs[0].token_ids) for o in want] != [24] * len(cases)  # the stops did stop early
    # EOS: a draft list that runs through the end-of-sequence token ends there.
    eos = tokenizer.eos_token_id
    replay(spec, PROMPTS[:1], [ids[:5] + [eos] + ids[5:]], wrong_every=100)
    plain_eos = SamplingParams(temperature=0, max_tokens=24, logit_bias={eos: 100.0}, min_tokens=6)
    (g,), (w,) = generate(spec, PROMPTS[:1], plain_eos), generate(plain, PROMPTS[:1], plain_eos)
    assert (g.outputs[0].token_ids, g.outputs[0].finish_reason) == (w.outputs[0].token_ids, "stop")


def test_unseeded_sampling_keeps_the_target_distribution(tiny_llms):
    """Statistically: 800 samples of three tokens at temperature 1 (top-3; the last two from a
    step with a draft, often right and often wrong), against 800 without drafts: a chi-squared
    test of homogeneity does not tell them apart (p > 0.001)."""
    plain, spec = tiny_llms
    prompt = PROMPTS[0]
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, n=200, ignore_eos=True)
    greedy = generate(plain, [prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    replay(spec, [prompt], [greedy[0].outputs[0].token_ids], wrong_every=100)
    before = spec.engine.core.scheduler.spec_stats.num_accepted_tokens
    counts = [
        _pair_counts(o for out in generate(llm, [prompt] * 4, params) for o in out.outputs) for llm in (plain, spec)
    ]
    assert spec.engine.core.scheduler.spec_stats.num_accepted_tokens - before > 50
    assert _chi2_homogeneity_p(*counts) > 1e-3


def _pair_counts(outputs) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for out in outputs:
        key = tuple(out.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _chi2_homogeneity_p(a: dict, b: dict) -> float:
    """p-value of the chi-squared test that two samples come from one distribution (cells with
    fewer than 5 expected counts pooled), via the Wilson-Hilferty normal approximation."""
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    cells, pooled = [], [0, 0]
    for k in keys:
        ca, cb = a.get(k, 0), b.get(k, 0)
        if (ca + cb) * min(na, nb) / (na + nb) < 5:
            pooled[0] += ca
            pooled[1] += cb
        else:
            cells.append((ca, cb))
    if sum(pooled):
        cells.append(tuple(pooled))
    stat = 0.0
    for ca, cb in cells:
        total = ca + cb
        for observed, n in ((ca, na), (cb, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    dof = len(cells) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_guided_json_with_drafts_is_valid_and_unchanged(tiny_llms):
    """The matcher follows accepted drafts within a step (each position's bitmask), then rolls
    back so the scheduler advances it: the JSON is valid and the same as without drafts."""
    plain, spec = tiny_llms
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"enum": ["x", "yy"]}},
              "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
    from kiln.sampling_params import GuidedDecodingParams

    params = SamplingParams(temperature=0, max_tokens=80, guided_decoding=GuidedDecodingParams(json=schema))
    prompts = ["Give me JSON", "Another one", "And a third"]
    want = plain.generate(prompts, params)
    replay(spec, [o.prompt_token_ids for o in want], [o.outputs[0].token_ids for o in want])
    before = spec.engine.core.scheduler.spec_stats.num_accepted_tokens
    got = spec.generate(prompts, params)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert spec.engine.core.scheduler.spec_stats.num_accepted_tokens - before > 10
    for out in got:
        assert out.outputs[0].finish_reason == "stop"
        assert set(json.loads(out.outputs[0].text)) == {"a", "b"}


def test_preemption_and_n_greater_than_one(tiny_model_dir):
    """With too few KV blocks for every sequence, drafts are dropped first and requests are
    preempted and recomputed; n=3 seeded children all sample as without drafts."""
    common = dict(dtype="float32", max_model_len=128, block_size=16, num_gpu_blocks_override=12)
    plain = LLM(tiny_model_dir("llama"), **common)
    spec = LLM(tiny_model_dir("llama"), speculative_config=NGRAM, **common)
    prompts = [list(range(100 + 10 * i, 130 + 10 * i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in generate(plain, prompts, params)]
    replay(spec, prompts, want)
    assert [o.outputs[0].token_ids for o in generate(spec, prompts, params)] == want
    assert spec.engine.core.scheduler.num_preemptions > 0
    fanned = SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=12, ignore_eos=True)
    want_n = [o.token_ids for o in generate(plain, prompts[:1], fanned)[0].outputs]
    got_n = [o.token_ids for o in generate(spec, prompts[:1], fanned)[0].outputs]
    assert got_n == want_n


def test_drafts_under_lora_adapters(tiny_model_dir, tmp_path):
    """Each draft row carries its request's adapter slot: requests with and without an adapter
    in one batch give their tokens without drafts."""
    from kiln import LoRARequest
    from kiln.testing.lora import build_lora_adapter

    base = tiny_model_dir("llama")
    lora = LoRARequest("a", 1, build_lora_adapter(base, tmp_path / "a", rank=8, seed=1))
    common = dict(dtype="float32", max_model_len=256, block_size=16, enable_lora=True, max_lora_rank=8)
    plain, spec = LLM(base, **common), LLM(base, speculative_config=NGRAM, **common)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    loras = [lora, None, lora]
    inputs = [{"prompt_token_ids": p} for p in PROMPTS]
    want = [o.outputs[0].token_ids for o in plain.generate(inputs, params, lora_request=loras)]
    assert want[0] != plain.generate(inputs[:1], params)[0].outputs[0].token_ids  # the adapter changes the output
    replay(spec, PROMPTS, want)
    got = [o.outputs[0].token_ids for o in spec.generate(inputs, params, lora_request=loras)]
    assert got == want
    assert spec.engine.core.scheduler.spec_stats.num_accepted_tokens > 0


# ---------------------------------------------------------------- the default model, real n-gram lookup


def test_default_model_copies_through_ngram_drafts_unchanged(default_model_dir):
    """The default model repeating a text from its prompt: n-gram drafts are mostly accepted and
    the greedy text is what decoding without them gives."""
    text = "The quick brown fox jumps over the lazy dog. Kiln batches requests and keeps a paged KV cache."
    prompt = f"Repeat the following text exactly.\n\n{text}\n\nRepeated text:"
    params = SamplingParams(temperature=0, max_tokens=48)
    common = dict(dtype="float32", max_model_len=512)
    want = LLM(default_model_dir, **common).generate(prompt, params)[0].outputs[0].token_ids
    spec = LLM(default_model_dir, speculative_config={**NGRAM, "num_speculative_tokens": 4}, **common)
    assert spec.generate(prompt, params)[0].outputs[0].token_ids == want
    stats = spec.engine.core.scheduler.spec_stats
    assert stats.acceptance_rate > 0.5 and stats.mean_acceptance_length > 2.5


def test_server_streams_the_same_text_and_reports_spec_metrics(default_model_dir, caplog):
    """Over the API (streaming and not), with the older flags: the text of decoding without
    drafts; ``/metrics`` has vLLM's spec_decode counters and the stats log has its line."""
    import argparse as _argparse

    from fastapi.testclient import TestClient

    from kiln.engine.async_engine import AsyncEngine
    from kiln.engine.llm_engine import LLMEngine
    from kiln.entrypoints.openai.api_server import build_app
    from kiln.entrypoints.openai.cli_args import add_serve_args
    from kiln.entrypoints.openai.serving import ServerOptions
    from kiln.testing.server import metric_value

    prompt = "Repeat the following text exactly.\n\nOne two three four five six seven eight.\n\nRepeated text:"
    common = dict(model=default_model_dir, dtype="float32", max_model_len=512)
    want = (
        LLM(default_model_dir, dtype="float32", max_model_len=512)
        .generate(prompt, SamplingParams(temperature=0, max_tokens=24))[0]
        .outputs[0]
        .text
    )
    config = EngineConfig.create(speculative_model="[ngram]", num_speculative_tokens=3, **common)
    engine = AsyncEngine(LLMEngine(config), log_stats_interval=0.0)
    parser = _argparse.ArgumentParser()
    add_serve_args(parser)
    body = {"model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0}
    app = build_app(engine, ServerOptions(served_model_names=["m"]), parser.parse_args([]))
    with caplog.at_level("INFO", logger="kiln.engine"), TestClient(app) as client:
        assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == want
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == want
        metrics = client.get("/metrics").text
    accepted = metric_value(metrics, "kiln:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= metric_value(metrics, "kiln:spec_decode_num_draft_tokens_total")
    assert metric_value(metrics, "kiln:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    assert "speculative decoding: mean acceptance length" in caplog.text  # the engine loop's stats line


def test_graph_sizes_cover_every_request_with_its_drafts():
    """A draft is a decode row of its own: graphs reach max_num_seqs * (1 + drafts)."""
    from kiln.interfaces.platform import Platform

    config = EngineConfig.create(max_num_seqs=4, max_num_batched_tokens=2048, speculative_config=NGRAM)
    assert config.max_decode_rows == 16
    assert Platform.graph_sizes(object(), config) == [1, 2, 4, 8, 16]
    assert EngineConfig.create(max_num_seqs=4).max_decode_rows == 4


def test_a_pooling_task_refuses_speculation(tiny_model_dir):
    with pytest.raises(ValueError, match="--task embed generates nothing"):
        LLM(tiny_model_dir("llama"), task="embed", speculative_config=NGRAM)


def test_older_flags_cannot_be_assigned_after_construction():
    config = EngineConfig.create()
    with pytest.raises(ValueError, match="frozen"):
        config.speculative_model = "[ngram]"
    assert config.speculative_config is None


def test_zero_and_missing_lookup_bounds_follow_vllm():
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        EngineConfig.create(speculative_model="[ngram]", num_speculative_tokens=2, ngram_prompt_lookup_min=0)
    spec = EngineConfig.create(speculative_config={**NGRAM, "prompt_lookup_min": None, "prompt_lookup_max": 8})
    assert (spec.speculative_config.prompt_lookup_min, spec.speculative_config.prompt_lookup_max) == (8, 8)
    with pytest.raises(ValueError, match="uses no draft model"):
        EngineConfig.create(speculative_config={**NGRAM, "model": "/models/draft"})
    with pytest.raises(ValueError, match="'medusa' is not implemented"):
        EngineConfig.create(speculative_config={"method": "medusa", "num_speculative_tokens": 2})


# ---------------------------------------------------------------- a draft model


def draft_config(path: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


def test_a_draft_model_equal_to_the_target_has_every_draft_accepted(tiny_model_dir, tiny_llms):
    """The target as its own draft: greedy drafts are what the target emits, so all are accepted."""
    plain, _ = tiny_llms
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    path = tiny_model_dir("llama")
    spec = LLM(path, dtype="float32", max_model_len=256, block_size=16, speculative_config=draft_config(path))
    want = [o.outputs[0].token_ids for o in generate(plain, PROMPTS, params)]
    assert [o.outputs[0].token_ids for o in generate(spec, PROMPTS, params)] == want
    stats = spec.engine.core.scheduler.spec_stats
    assert stats.num_draft_tokens > 30 and stats.acceptance_rate == 1.0


def test_a_draft_model_keeps_greedy_and_seeded_outputs(tiny_model_dir, tiny_llms):
    """The target with another rope base as the draft: some drafts accepted, some not; greedy and
    seeded outputs are the target's, also when sequences are preempted and recomputed and the
    draft catches up on 30-token prompts in passes of 16 tokens."""
    plain, _ = tiny_llms
    draft = tiny_model_dir("llama", rope_theta=300.0)
    common = dict(dtype="float32", max_model_len=128, block_size=16)
    spec = LLM(tiny_model_dir("llama"), speculative_config=draft_config(draft, 4), **common)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in generate(spec, PROMPTS, greedy)] == [
        o.outputs[0].token_ids for o in generate(plain, PROMPTS, greedy)
    ]
    assert [o.outputs[0].token_ids for o in generate(spec, PROMPTS, SAMPLED)] == [
        o.outputs[0].token_ids for o in generate(plain, PROMPTS, SAMPLED)
    ]
    stats = spec.engine.core.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    tight = LLM(tiny_model_dir("llama"), speculative_config=draft_config(draft), num_gpu_blocks_override=12,
                max_num_batched_tokens=16, **common)  # fmt: skip
    prompts = [list(range(100 + 10 * i, 130 + 10 * i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain_tight = LLM(tiny_model_dir("llama"), num_gpu_blocks_override=12, max_num_batched_tokens=16, **common)
    assert [o.outputs[0].token_ids for o in generate(tight, prompts, params)] == [
        o.outputs[0].token_ids for o in generate(plain_tight, prompts, params)
    ]
    assert tight.engine.core.scheduler.num_preemptions > 0


def test_draft_model_settings_are_checked(tiny_model_dir):
    path = tiny_model_dir("llama")
    for extra, message in (
        ({"prompt_lookup_max": 3}, "n-gram lookup only"),
        ({"draft_tensor_parallel_size": 2}, "runs whole on the first rank"),
        ({"quantization": "awq"}, "drop the setting"),
    ):
        with pytest.raises(ValueError, match=message):
            EngineConfig.create(speculative_config={**draft_config(path), **extra})
    older = EngineConfig.create(speculative_model=path, num_speculative_tokens=2).speculative_config
    assert (older.method, older.model) == ("draft_model", path)  # seed 001's --speculative-model PATH
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        LLM(path, dtype="float32", speculative_config=draft_config(tiny_model_dir("bert")))


def test_seed_001_environment_switches(tiny_model_dir, monkeypatch):
    """``EAGLE_USE_SAFE_AI_LAB_STYLE``: on (the default) is how Kiln runs EAGLE heads, 0 is
    refused for EAGLE only; ``ENABLE_SPEC_METRIC=0`` leaves the counts out of the stats."""
    eagle = {"method": "eagle", "model": "x", "num_speculative_tokens": 2}
    monkeypatch.setenv("EAGLE_USE_SAFE_AI_LAB_STYLE", "0")
    with pytest.raises(ValueError, match="EAGLE_USE_SAFE_AI_LAB_STYLE: Kiln runs EAGLE heads only as their authors"):
        EngineConfig.create(speculative_config=eagle)
    draft = EngineConfig.create(speculative_config={**eagle, "method": "draft_model"})
    assert draft.speculative_config.method == "draft_model"
    monkeypatch.setenv("EAGLE_USE_SAFE_AI_LAB_STYLE", "perhaps")
    with pytest.raises(ValueError, match="EAGLE_USE_SAFE_AI_LAB_STYLE: expected true or false, got 'perhaps'"):
        EngineConfig.create(speculative_config=eagle)
    assert EngineConfig.create(speculative_config={**eagle, "method": "draft_model"}).speculative_config  # not read
    monkeypatch.setenv("EAGLE_USE_SAFE_AI_LAB_STYLE", "1")
    assert EngineConfig.create(speculative_config=eagle).speculative_config.method == "eagle"
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for value, reported in (("1", True), ("0", False)):
        monkeypatch.setenv("ENABLE_SPEC_METRIC", value)
        llm = LLM(tiny_model_dir("llama"), dtype="float32", speculative_config=NGRAM)
        llm.generate([{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}], params)
        assert isinstance(llm.engine.get_stats()["spec_decode"], SpecDecodeStats) is reported
