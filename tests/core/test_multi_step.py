"""Multi-step scheduling (``--num-scheduler-steps``, ``--multi-step-stream-outputs``): a step of
decodes opens a window of N steps that admits no waiting request; without streaming, a request's
tokens are reported once a window."""

from __future__ import annotations

import logging

import pytest
from tests.core.test_scheduler import make_req, make_sched, run_step

from kiln import LLM, SamplingParams
from kiln.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.sampling_params import RequestOutputKind


def test_a_window_of_decodes_admits_nobody_until_it_closes():
    s = make_sched(num_scheduler_steps=4, max_num_batched_tokens=64)
    a = make_req(5, "a", max_tokens=20)
    s.add_request(a)
    run_step(s)  # a's prefill: no window
    assert s.window_left == 0
    run_step(s)  # a decode alone: opens a window of 4 steps (this one and 3 more)
    assert s.window_left == 3
    b = make_req(5, "b", arrival=1)
    s.add_request(b)
    for left in (2, 1, 0):
        out = run_step(s)
        assert [r.request_id for r, _ in out.scheduled] == ["a"] and s.window_left == left
    out = run_step(s)  # the next decision admits b
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 5)]
    assert s.window_left == 0  # a prefill in the batch: no window


def test_one_step_per_decision_admits_at_once():
    s = make_sched(max_num_batched_tokens=64)
    a = make_req(5, "a", max_tokens=20)
    s.add_request(a)
    run_step(s)
    run_step(s)
    s.add_request(make_req(5, "b", arrival=1))
    assert [r.request_id for r, _ in run_step(s).scheduled] == ["a", "b"]


def test_a_window_closes_once_its_requests_are_done():
    s = make_sched(num_scheduler_steps=8, max_num_batched_tokens=64)
    a = make_req(5, "a", max_tokens=3)
    s.add_request(a)
    run_step(s)  # prefill, first token
    run_step(s)  # second token: a window opens
    assert s.window_left == 7
    b = make_req(5, "b", arrival=1)
    s.add_request(b)
    run_step(s)  # a's last token: it finishes inside the window
    assert a.is_finished
    out = run_step(s)  # nothing left to decode: b is admitted at once
    assert [r.request_id for r, _ in out.scheduled] == ["b"]


def test_speculative_decoding_and_multi_step_are_refused_together():
    with pytest.raises(ValueError, match="--num-scheduler-steps: multi-step scheduling runs one token a step"):
        EngineConfig.create(num_scheduler_steps=8, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


@pytest.mark.parametrize("stream", [True, False])
def test_multi_step_generates_the_same_tokens(tiny_model_dir, varied_prompts, stream):
    # More prompts than sequences, ending at different steps: windows hold some back, then admit them.
    params = [SamplingParams(max_tokens=21 - 4 * i, ignore_eos=True, temperature=0) for i in range(5)]
    common = dict(max_model_len=256, dtype="float32", max_num_seqs=3, max_num_batched_tokens=64)
    one = LLM(tiny_model_dir("llama"), **common).generate(varied_prompts, params)
    multi = LLM(tiny_model_dir("llama"), num_scheduler_steps=8, multi_step_stream_outputs=stream, **common).generate(
        varied_prompts, params
    )
    assert [o.outputs[0].token_ids for o in multi] == [o.outputs[0].token_ids for o in one]
    assert [o.outputs[0].text for o in multi] == [o.outputs[0].text for o in one]


def _pieces(llm: LLM, max_tokens: int) -> list[list[int]]:
    """The token ids of each output one request streams, step by step."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0, output_kind=RequestOutputKind.DELTA)
    llm.engine.add_request("r", "Stream in windows", params)
    pieces = []
    while llm.engine.has_unfinished_requests():
        pieces += [out.outputs[0].token_ids for out in llm.engine.step()]
    return pieces


def test_without_streaming_a_window_reports_its_tokens_at_once(tiny_model_dir):
    common = dict(max_model_len=256, dtype="float32")
    streamed = _pieces(LLM(tiny_model_dir("llama"), num_scheduler_steps=4, **common), 14)
    held = _pieces(LLM(tiny_model_dir("llama"), num_scheduler_steps=4, multi_step_stream_outputs=False, **common), 14)
    assert [len(p) for p in streamed] == [1] * 14
    # The prefill's token, then windows of 4 decodes; the last one ends early with the request.
    assert [len(p) for p in held] == [1, 4, 4, 4, 1]
    assert sum(held, []) == sum(streamed, [])


def test_an_abort_drops_the_tokens_held_for_it(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), max_model_len=256, num_scheduler_steps=8, multi_step_stream_outputs=False)
    llm.engine.add_request("a", "abort me", SamplingParams(max_tokens=50, ignore_eos=True))
    llm.engine.add_request("b", "keep me", SamplingParams(max_tokens=6, ignore_eos=True))
    for _ in range(4):
        llm.engine.step()
    assert "a" in llm.engine.core.held
    llm.engine.abort_request("a")
    assert "a" not in llm.engine.core.held
    finished = []
    while llm.engine.has_unfinished_requests():
        finished += llm.engine.step()
    assert [o.request_id for o in finished if o.finished] == ["b"]
    assert {o.request_id for o in finished} == {"b"}
    assert llm.engine.kv.usage == 0.0


def test_holding_outputs_without_multi_step_warns(tiny_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="kiln.engine"):
        LLMEngine(EngineConfig.create(model=tiny_model_dir("llama"), device="cpu", multi_step_stream_outputs=False))
    assert "--multi-step-stream-outputs false changes nothing without --num-scheduler-steps" in caplog.text
