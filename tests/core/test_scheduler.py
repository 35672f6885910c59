"""Scheduling: token budget, chunked prefill, max_num_seqs, preemption, policies, abort."""

from __future__ import annotations

from kiln.config import EngineConfig
from kiln.engine.kv_cache import KVCacheManager
from kiln.engine.request import Request, RequestStatus
from kiln.engine.scheduler import SampledToken, Scheduler
from kiln.sampling_params import SamplingParams


def make_sched(num_blocks=64, block_size=4, **cfg) -> Scheduler:
    config = EngineConfig.create(
        **{"max_model_len": 256, "max_num_batched_tokens": 16, "block_size": block_size, "kv_cache_ratio": 1.0, **cfg}
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size, config.enable_prefix_caching))


def make_req(n, rid, arrival=0.0, priority=0, max_tokens=8) -> Request:
    base = 1000 * (1 + sum(map(ord, rid)))  # distinct prompts: no accidental prefix hits
    return Request(
        rid,
        list(range(base, base + n)),
        SamplingParams(max_tokens=max_tokens),
        frozenset({0}),
        arrival,
        priority=priority,
    )


def run_step(s: Scheduler, token=7):
    out = s.schedule()
    sampled = {r: [SampledToken(token)] for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens}
    s.update_from_output(out, sampled, {})
    return out


def test_budget_chunks_prefill_and_mixes_decodes():
    s = make_sched()
    a, b = make_req(10, "a"), make_req(30, "b", arrival=1)
    s.add_request(a)
    s.add_request(b)
    out = run_step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 10), ("b", 6)]
    assert out.total_num_scheduled_tokens == 16
    out = run_step(s)  # a decodes (1 token) while b's prefill continues in the same batch
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 15)]
    assert a.num_output_tokens == 2 and b.num_output_tokens == 0


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    s = make_sched(enable_chunked_prefill=False, max_num_batched_tokens=256)
    s.token_budget = 16
    s.add_request(make_req(10, "a"))
    s.add_request(make_req(12, "b", arrival=1))
    out = run_step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 10)]


def test_max_num_seqs_caps_running():
    s = make_sched(max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        s.add_request(make_req(3, str(i), arrival=i))
    run_step(s)
    assert len(s.running) == 2 and len(s.waiting) == 2


def test_preemption_by_recompute_frees_blocks_and_requeues_first():
    # 6 usable blocks of 4 tokens; max_model_len fits the pool, as the engine enforces.
    s = make_sched(num_blocks=7, max_num_batched_tokens=64, max_model_len=24)
    a, b = make_req(11, "a", arrival=0, max_tokens=20), make_req(11, "b", arrival=1, max_tokens=20)
    s.add_request(a)
    s.add_request(b)
    run_step(s)  # 3 blocks each
    preempted = []
    for _ in range(3):
        preempted += run_step(s).preempted
    assert preempted == [b]  # the later arrival goes
    assert b.status is RequestStatus.PREEMPTED and b.blocks == [] and b.num_computed_tokens == 0
    assert s.waiting[0] is b and b.num_output_tokens >= 1
    outputs_before = b.num_output_tokens
    while a in s.running:
        run_step(s)
    run_step(s)  # b re-prefills prompt + outputs, then samples its next token
    assert b.status is RequestStatus.RUNNING and b.num_computed_tokens == b.num_tokens - 1
    assert b.num_output_tokens == outputs_before + 1


def test_priority_policy_admits_lower_value_first():
    s = make_sched(scheduling_policy="priority", max_num_seqs=1, max_num_batched_tokens=100)
    s.add_request(make_req(3, "late-urgent", arrival=5, priority=-1))
    s.add_request(make_req(3, "early", arrival=0, priority=0))
    out = run_step(s)
    assert [r.request_id for r, _ in out.scheduled] == ["late-urgent"]


def test_fcfs_policy_admits_by_arrival():
    s = make_sched(max_num_seqs=1, max_num_batched_tokens=100)
    s.add_request(make_req(3, "first", arrival=0, priority=5))
    s.add_request(make_req(3, "second", arrival=1, priority=-5))
    assert [r.request_id for r, _ in run_step(s).scheduled] == ["first"]


def test_abort_anywhere_frees_blocks():
    s = make_sched()
    a, b = make_req(10, "a"), make_req(30, "b", arrival=1)
    s.add_request(a)
    s.add_request(b)
    run_step(s)
    s.finish_requests([b.request_id], RequestStatus.FINISHED_ABORTED)  # mid-prefill
    s.finish_requests([a.request_id], RequestStatus.FINISHED_ABORTED)  # decoding
    assert not s.has_unfinished() and s.kv.usage == 0.0
    c = make_req(5, "c")
    s.add_request(c)
    s.finish_requests([c.request_id], RequestStatus.FINISHED_ABORTED)  # still waiting
    assert not s.has_unfinished()


def test_stops_at_max_tokens_and_eos():
    s = make_sched(max_num_batched_tokens=100)
    a = make_req(3, "a", max_tokens=2)
    s.add_request(a)
    run_step(s)
    run_step(s)
    assert a.status is RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 2
    b = make_req(3, "b")
    s.add_request(b)
    run_step(s, token=0)  # 0 is this request's EOS
    assert b.status is RequestStatus.FINISHED_STOPPED


def test_kv_cache_ratio_holds_back_admission_while_others_run():
    s = make_sched(num_blocks=11, kv_cache_ratio=0.5, max_num_batched_tokens=100)  # reserve 5 of 10 blocks
    s.add_request(make_req(16, "a"))  # 4 blocks, admitted: nothing else runs
    s.add_request(make_req(8, "b", arrival=1))  # would leave 4 < 5 free
    run_step(s)
    assert [r.request_id for r in s.running] == ["a"] and len(s.waiting) == 1


def test_prefix_cache_stats_count_admissions_not_lookups():
    """A request that waits several steps for free blocks is counted once, when admitted
    (counting every lookup inflated the stats under load)."""
    s = make_sched(num_blocks=5, enable_chunked_prefill=False)  # 4 blocks of 4 tokens: b fits once a is done
    a, b = make_req(12, "a", max_tokens=4), make_req(8, "b", arrival=1, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    steps = 0
    while s.has_unfinished():
        run_step(s)
        steps += 1
    assert steps > 4 and b.num_preemptions == 0  # b waited while a decoded
    assert s.kv.prefix_queries == a.num_prompt_tokens + b.num_prompt_tokens


def test_drafts_take_only_what_the_running_requests_leave():
    """Drafts are optional: they get blocks only after every running request has its token, so
    they never preempt anyone (a's drafts would have taken the block b's token needs)."""
    from kiln.testing.spec_decode import NGRAM, ReplayProposer

    s = make_sched(num_blocks=4, block_size=4, speculative_config=NGRAM)  # 3 usable blocks
    a, b = make_req(3, "a", max_tokens=20), make_req(4, "b", arrival=1, max_tokens=20)
    s.proposer = ReplayProposer.of([a.prompt_token_ids, b.prompt_token_ids], [[7] * 20, [7] * 20], wrong_every=1000)
    s.add_request(a)
    s.add_request(b)
    run_step(s)  # both prefills: a holds 1 block, b 1 block (its 4 tokens), 1 block free
    out = run_step(s)  # a's token fills its block (drafts need another); b's token takes the free block
    assert s.num_preemptions == 0
    assert {r.request_id: n for r, n in out.scheduled} == {"a": 1, "b": 4}  # b's drafts fit in its new block
