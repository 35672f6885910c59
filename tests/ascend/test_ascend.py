"""The Ascend plugin through a CPU emulation of the torch_npu ops it calls: the attention backend
honours the contract, the fused ops match the reference, version problems read as one message,
and the whole engine on the Ascend code path matches the CPU plugin token for token."""

from __future__ import annotations

import sys

import pytest
import torch
from tests.ascend import fake_torch_npu, fake_torchair  # noqa: I001

import kiln
from kiln import ops as reference


@pytest.fixture(autouse=True)
def emulated_torch_npu(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu)
    monkeypatch.setitem(sys.modules, "torchair", fake_torchair)
    monkeypatch.setenv("TORCHAIR_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("PTA_TORCHAIR_DECODE_GEAR_LIST", raising=False)
    fake_torch_npu.calls.clear()
    fake_torchair.events.clear()


from kiln.testing.contracts import AttentionBackendContract  # noqa: E402
from kiln_ascend import ops  # noqa: E402
from kiln_ascend.attention import AscendAttentionBackend  # noqa: E402  (imports no torch_npu)


@pytest.mark.parametrize("window", [None, 9, 100], ids=["full", "window9", "window100"])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=["mha", "gqa3", "mqa8"])
@pytest.mark.parametrize("block_size", [64, 128])
def test_attention_matches_the_reference(block_size, heads, window):
    """The contract's checks at the block sizes the NPU supports (the shared suite uses 16 and 32),
    with and without a sliding window (9: the long chunk's keys start in its second block)."""
    import random

    from kiln.attention.torch_ref import TorchRefAttentionBackend
    from kiln.testing.contracts import random_layout

    n, kvn = heads
    rng = random.Random(block_size)
    layout, tokens = random_layout(rng, block_size, 16, [(70, 1), (3, 1), (0, 40), (130, 9), (64, 64)])
    ref, npu = TorchRefAttentionBackend(n, kvn, 64, torch.float32), AscendAttentionBackend(n, kvn, 64, torch.float32)
    cache = torch.randn(ref.kv_cache_shape(16, block_size))
    mine = cache.clone()
    q, k, v = torch.randn(tokens, n, 64), torch.randn(tokens, kvn, 64), torch.randn(tokens, kvn, 64)
    expected = ref.forward(q, k, v, cache, ref.build_metadata(layout), layer_idx=0, scale=0.125, sliding_window=window)
    got = npu.forward(q, k, v, mine, npu.build_metadata(layout), layer_idx=0, scale=0.125, sliding_window=window)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine, cache)
    assert any(c.startswith("npu_incre_flash_attention") for c in fake_torch_npu.calls)


class TestAscendAttentionContract(AttentionBackendContract):
    """The shared contract's decode-graph checks (at 64 and 128) and sliding-window batches (at 64).
    Its other mixed batches use block sizes 16/32, which the NPU refuses; the test above runs them
    at 64/128."""

    backend_cls = AscendAttentionBackend
    test_matches_reference = None


def test_precision_switches_reach_the_ops(monkeypatch):
    from kiln_ascend.precision import PrecisionModes

    monkeypatch.setenv("USE_IFA_HIGH_PRECISION_MODE", "1")
    monkeypatch.setenv("USE_PFA_HIGH_PRECISION_MODE", "0")
    modes = PrecisionModes.from_env()
    assert (modes.decode(), modes.prefill(on_cached_prefix=False), modes.prefill(on_cached_prefix=True)) == (0, 1, 1)
    monkeypatch.setenv("USE_PREFIX_HIGH_PRECISION_MODE", "1")
    assert PrecisionModes.from_env().prefill(on_cached_prefix=True) == 0


def test_fused_ops_match_the_reference():
    torch.manual_seed(0)
    x, r, w = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    for got, want in zip(ops.fused_add_rms_norm(x, r, w, 1e-6), reference.fused_add_rms_norm(x, r, w, 1e-6)):
        torch.testing.assert_close(got, want)
    gu = torch.randn(3, 128)
    torch.testing.assert_close(ops.silu_and_mul(gu), reference.silu_and_mul(gu))
    t = torch.arange(64, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(0, 32, 2) / 32)
    cache = torch.cat((t.cos(), t.sin()), dim=-1).float()
    pos, q, k = torch.tensor([0, 3, 63]), torch.randn(3, 4, 32), torch.randn(3, 2, 32)
    for got, want in zip(ops.rotary_embedding(pos, q, k, cache), reference.rotary_embedding(pos, q, k, cache)):
        torch.testing.assert_close(got, want)


def test_version_mismatch_is_one_actionable_message(monkeypatch):
    from kiln_ascend.platform import check_versions

    monkeypatch.setattr(fake_torch_npu, "__version__", "2.1.0.post3")
    with pytest.raises(RuntimeError, match=r"torch \S+ and torch_npu 2\.1\.0 do not match"):
        check_versions()
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails, as without CANN
    with pytest.raises(RuntimeError, match="could not be imported.*set_env.sh"):
        check_versions()


def test_block_sizes_other_than_64_and_128_are_refused():
    from kiln.config import EngineConfig
    from kiln_ascend.platform import NpuPlatform

    with pytest.raises(ValueError, match="--block-size: 16 is not supported on Ascend"):
        NpuPlatform().update_config(EngineConfig.create(block_size=16))


def make_cpu_npu_platform():
    """The Ascend platform with its device calls on the CPU (everything else unchanged)."""
    from kiln_ascend.platform import NpuPlatform
    from kiln_cpu.platform import CpuPlatform

    class EmulatedNpu(NpuPlatform):
        name = "npu_emulated"
        device = CpuPlatform.device
        mem_get_info = CpuPlatform.mem_get_info
        peak_memory_of = CpuPlatform.peak_memory_of

        def synchronize(self) -> None:
            pass

    return EmulatedNpu()


@kiln.hookimpl
def register_platforms(register) -> None:
    from kiln.platforms.base import PlatformSpec

    register(PlatformSpec("npu_emulated", make_cpu_npu_platform, is_available=lambda: True))


@kiln.hookimpl
def register_attention_backends(register) -> None:
    """The Ascend backend as the plugin registers it, but for the emulated platform (the plugin's
    own spec runs it on "npu" only). Registered after the plugin, so called first: this one wins."""
    from kiln.registry import AttentionBackendSpec

    register(AttentionBackendSpec("ascend", "kiln_ascend.attention:AscendAttentionBackend", ("npu_emulated",)))


@pytest.fixture
def npu_plugins(kiln_plugins):
    import kiln_ascend.plugin
    import kiln_cpu.plugin

    for module, name in ((kiln_cpu.plugin, "cpu"), (kiln_ascend.plugin, "ascend"), (sys.modules[__name__], "test")):
        kiln_plugins.register(module, name=name)
    return kiln_plugins


@pytest.mark.parametrize("block_size", [64, 128])
def test_engine_on_the_ascend_path_matches_the_cpu_plugin(tiny_model_dir, npu_plugins, varied_prompts, block_size):
    from kiln.testing.engine import greedy_tokens

    kiln_plugins = npu_plugins
    common = dict(model=tiny_model_dir("llama"), dtype="float32", max_num_batched_tokens=64)
    npu_run = greedy_tokens(
        kiln_plugins, varied_prompts, device="npu_emulated", block_size=block_size, enforce_eager=True, **common
    )
    assert npu_run == greedy_tokens(kiln_plugins, varied_prompts, device="cpu", block_size=16, **common)
    used = {c.split(":")[0] for c in fake_torch_npu.calls}
    assert {"npu_incre_flash_attention", "npu_fused_infer_attention_score", "_npu_reshape_and_cache",
            "npu_add_rms_norm", "npu_rotary_mul", "npu_swiglu"} <= used  # fmt: skip


def test_paged_attention_emulation_matches_plain_attention():
    """The ATB decode op's emulation against attention written out by hand."""
    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 4, 2, 16, 64
    key_cache, value_cache = torch.randn(6, bs, kv_heads, dim), torch.randn(6, bs, kv_heads, dim)
    table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    lens = torch.tensor([70, 130], dtype=torch.int32)
    q = torch.randn(2, heads, dim)
    out = torch.empty_like(q)
    fake_torch_npu._npu_paged_attention(q, key_cache, value_cache, kv_heads, heads, 0.25, table, lens, out)
    for b in range(2):
        rows = [table[b, p // bs] * bs + p % bs for p in range(int(lens[b]))]
        k = key_cache.flatten(0, 1)[rows].repeat_interleave(2, dim=1)
        v = value_cache.flatten(0, 1)[rows].repeat_interleave(2, dim=1)
        weights = torch.softmax(torch.einsum("nd,knd->nk", q[b], k) * 0.25, dim=-1)
        torch.testing.assert_close(out[b], torch.einsum("nk,knd->nd", weights, v))


@pytest.mark.parametrize(
    ("graph_sizes", "env", "max_num_seqs", "gears"),
    [
        (None, None, 16, [2, 4, 8, 16]),
        (None, None, 12, [2, 4, 8, 12]),
        (None, "2,4,6,8,16,32", 8, [2, 4, 6, 8]),  # the seed's list: sizes above max_num_seqs dropped
        (None, "1, 3", 8, [3, 8]),  # 1 is never a gear; max_num_seqs always is
        ([4, 2], "2,4,6", 6, [2, 4, 6]),  # the flag wins over the environment
        (None, None, 1, []),  # max_num_seqs 1: no gear, a lone decode runs eagerly
    ],
)
def test_decode_gears(monkeypatch, graph_sizes, env, max_num_seqs, gears):
    from kiln.config import EngineConfig
    from kiln_ascend.graph import decode_gears

    if env is not None:
        monkeypatch.setenv("PTA_TORCHAIR_DECODE_GEAR_LIST", env)
    assert decode_gears(EngineConfig.create(graph_sizes=graph_sizes, max_num_seqs=max_num_seqs)) == gears


def test_a_bad_gear_list_names_the_variable(monkeypatch):
    from kiln.config import EngineConfig
    from kiln_ascend.graph import decode_gears

    monkeypatch.setenv("PTA_TORCHAIR_DECODE_GEAR_LIST", "2,four")
    with pytest.raises(ValueError, match="PTA_TORCHAIR_DECODE_GEAR_LIST='2,four'"):
        decode_gears(EngineConfig.create())


def test_graph_cache_is_keyed_by_model_and_parameters(tiny_model_dir, monkeypatch):
    from kiln.config import EngineConfig
    from kiln_ascend.graph import graph_cache_dir

    model = tiny_model_dir("llama")
    base = graph_cache_dir(EngineConfig.create(model=model, block_size=128), 4)
    assert base == graph_cache_dir(EngineConfig.create(model=model, block_size=128), 4)
    assert base.name == "gear_4" and base.parent.parent.name == ".torchair_cache"
    changed = [
        EngineConfig.create(model=model, block_size=64),
        EngineConfig.create(model=model, block_size=128, max_model_len=64),
        EngineConfig.create(model=tiny_model_dir("qwen2"), block_size=128),
    ]
    assert all(graph_cache_dir(c, 4).parent != base.parent for c in changed)
    monkeypatch.setenv("USE_IFA_HIGH_PRECISION_MODE", "1")
    assert graph_cache_dir(EngineConfig.create(model=model, block_size=128), 4).parent != base.parent


@pytest.mark.parametrize("block_size", [64, 128])
def test_graph_mode_matches_the_cpu_plugin(tiny_model_dir, npu_plugins, varied_prompts, block_size):
    """Decode steps through per-gear torchair graphs (padded rows and all) give the CPU plugin's
    tokens; with 5 prompts and max_num_seqs 4, steps of 4 decodes use gear 4 and the last
    request alone pads to gear 2. A second engine loads the cached graphs."""
    from kiln.testing.engine import greedy_tokens, make_engine, run_greedy

    common = dict(model=tiny_model_dir("llama"), dtype="float32", max_num_batched_tokens=64, max_num_seqs=4)
    engine = make_engine(npu_plugins, device="npu_emulated", block_size=block_size, **common)
    assert engine.executor.runner.graph_sizes == [2, 4]
    assert [e[0] for e in fake_torchair.events] == ["compiled", "compiled"]  # at start, before any request
    fake_torch_npu.calls.clear()
    npu_run = run_greedy(engine, varied_prompts)
    assert npu_run == greedy_tokens(npu_plugins, varied_prompts, device="cpu", block_size=16, **common)
    assert engine.executor.runner.graph_steps > 0 and "_npu_paged_attention" in fake_torch_npu.calls
    assert all(
        len(g.graph.find_nodes(op="call_function", target=torch.ops.npu._npu_paged_attention.default)) == 2
        for g in fake_torchair.graphs
    )  # fmt: skip  (one graph per gear, both layers inside)
    make_engine(npu_plugins, device="npu_emulated", block_size=block_size, **common)
    assert [e[0] for e in fake_torchair.events[2:]] == ["loaded", "loaded"]


def test_enforce_eager_turns_graph_mode_off(tiny_model_dir, npu_plugins):
    from kiln.testing.engine import make_engine

    engine = make_engine(npu_plugins, model=tiny_model_dir("llama"), device="npu_emulated", enforce_eager=True)
    assert engine.executor.runner.graphs is None and fake_torchair.events == []


def test_the_scheduler_never_forms_a_decode_batch_above_the_largest_gear(tiny_model_dir, npu_plugins):
    from kiln.testing.engine import make_engine, run_greedy

    engine = make_engine(
        npu_plugins, model=tiny_model_dir("llama"), device="npu_emulated", max_num_seqs=3, graph_sizes=[2, 16]
    )
    assert engine.executor.runner.graph_sizes == [2, 3]
    sizes = []
    execute = engine.executor.runner.execute
    engine.executor.runner.execute = lambda out: sizes.append(len(out.scheduled)) or execute(out)
    run_greedy(engine, [[7, 8, 9]] * 7, max_tokens=4)
    assert max(sizes) == 3


def run_tracking(engine, prompts, max_tokens=8):
    """Greedy tokens, the most times any request was preempted, and each request's cached tokens."""
    from kiln.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    tokens, cached, preempted = {}, {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id], cached[out.request_id] = out.outputs[0].token_ids, out.num_cached_tokens
        preempted = max(preempted, max((r.num_preemptions for r in engine.core.scheduler.running), default=0))
    order = [str(i) for i in range(len(prompts))]
    return [tokens[i] for i in order], preempted, [cached[i] for i in order]


# 5 usable blocks of 64 tokens; four 60-token prompts each cross into a second block while
# decoding: preemption is forced. The last prompt shares its first full block with the one
# before it: a prefix-cache hit.
TIGHT = dict(block_size=64, num_gpu_blocks_override=6, max_model_len=192, max_num_batched_tokens=64)
PROMPTS = [list(range(100 + 70 * i, 160 + 70 * i)) for i in range(4)] + [
    list(range(2000, 2077)),
    list(range(2000, 2070)) + [5, 6, 7],
]


@pytest.mark.parametrize("eager", [False, True], ids=["graph", "eager"])
def test_ascend_path_under_preemption_and_prefix_hits(tiny_model_dir, npu_plugins, eager):
    from kiln.testing.engine import make_engine

    prompts = PROMPTS
    common = dict(model=tiny_model_dir("llama"), dtype="float32", max_num_seqs=4, **TIGHT)
    tokens, preempted, cached = run_tracking(
        make_engine(npu_plugins, device="npu_emulated", enforce_eager=eager, **common), prompts
    )
    assert preempted > 0 and cached[-1] >= 64
    assert tokens == run_tracking(make_engine(npu_plugins, device="cpu", **common), prompts)[0]


@pytest.mark.slow
def test_default_model_on_the_ascend_path(default_model_dir, npu_plugins):
    """The embedded default model (9 heads over 3 KV heads, tied embeddings) in graph mode."""
    from kiln.testing.engine import make_engine

    prompts = PROMPTS
    common = dict(model=default_model_dir, dtype="float32", max_num_seqs=4, **TIGHT)
    engine = make_engine(npu_plugins, device="npu_emulated", **common)
    tokens, preempted, cached = run_tracking(engine, prompts)
    assert preempted > 0 and cached[-1] >= 64 and engine.executor.runner.graph_steps > 0
    assert tokens == run_tracking(make_engine(npu_plugins, device="cpu", **common), prompts)[0]


@pytest.mark.parametrize("eager", [False, True], ids=["graph", "eager"])
def test_sliding_window_on_the_ascend_path(tiny_model_dir, npu_plugins, eager):
    """Mistral with an 8-token window (tests/core/test_sliding_window.py matches it to transformers
    on the CPU plugin): decodes in torchair graphs or eagerly, prefills in 64-token chunks, and a
    prefix-cache hit of a whole 64-token block, all give the CPU plugin's tokens."""
    from kiln.testing.engine import make_engine

    prompts = PROMPTS[3:]
    common = dict(model=tiny_model_dir("mistral", sliding_window=8), dtype="float32", max_num_seqs=4,
                  block_size=64, max_num_batched_tokens=64)  # fmt: skip
    engine = make_engine(npu_plugins, device="npu_emulated", enforce_eager=eager, **common)
    tokens, _, cached = run_tracking(engine, prompts, max_tokens=16)
    assert cached[-1] >= 64 and (engine.executor.runner.graph_steps > 0) != eager
    assert tokens == run_tracking(make_engine(npu_plugins, device="cpu", **common), prompts, max_tokens=16)[0]


@pytest.mark.parametrize("eager", [False, True], ids=["graph", "eager"])
@pytest.mark.parametrize("model_type", ["phi3", "glm", "glm4", "gemma", "gemma3_text", "ministral"])
def test_dense_families_on_the_ascend_path(tiny_model_dir, npu_plugins, model_type, eager):
    """GLM-4 (half of each head rotating in adjacent pairs, reordered at load for the rotary op;
    q/k/v biases; norms after each sublayer) and Gemma 3 (GeGLU, q/k norms, an 8-token window on
    its first layer, two ropes) in torchair graphs or eagerly give the CPU plugin's tokens
    (tests/core/test_dense_families.py matches those to transformers)."""
    from kiln.testing.engine import make_engine

    prompts = PROMPTS[3:]
    common = dict(model=tiny_model_dir(model_type), dtype="float32", max_num_seqs=4, block_size=64,
                  max_num_batched_tokens=64)  # fmt: skip
    engine = make_engine(npu_plugins, device="npu_emulated", enforce_eager=eager, **common)
    tokens, _, _ = run_tracking(engine, prompts, max_tokens=16)
    assert (engine.executor.runner.graph_steps > 0) != eager
    assert tokens == run_tracking(make_engine(npu_plugins, device="cpu", **common), prompts, max_tokens=16)[0]


@pytest.mark.parametrize("eager", [False, True], ids=["graph", "eager"])
def test_gemma2_on_the_ascend_path(tiny_model_dir, npu_plugins, eager):
    """Gemma 2's soft-capped scores (no torch_npu attention op takes a cap: torch ops on the same
    cache, eagerly per request or as one padded batch in torchair graphs), with its 8-token
    window on every other layer and a prefix-cache hit, give the CPU plugin's tokens (which
    tests/core/test_dense_families.py matches to transformers)."""
    from kiln.testing.engine import make_engine

    prompts = PROMPTS[3:]
    model = tiny_model_dir("gemma2", attn_logit_softcapping=3.0, final_logit_softcapping=5.0)
    common = dict(model=model, dtype="float32", max_num_seqs=4, block_size=64, max_num_batched_tokens=64)
    engine = make_engine(npu_plugins, device="npu_emulated", enforce_eager=eager, **common)
    tokens, _, cached = run_tracking(engine, prompts, max_tokens=16)
    assert cached[-1] >= 64 and (engine.executor.runner.graph_steps > 0) != eager
    assert tokens == run_tracking(make_engine(npu_plugins, device="cpu", **common), prompts, max_tokens=16)[0]


def test_gemma2_refuses_a_backend_without_soft_caps(tiny_model_dir, npu_plugins, monkeypatch):
    """A backend that does not declare soft caps (as a third party's may not): Gemma 2 says so at
    start-up, naming a backend that can."""
    from kiln.testing.engine import make_engine
    from kiln_ascend.attention import AscendAttentionBackend

    monkeypatch.setattr(AscendAttentionBackend, "supports_logit_softcap", False)
    model = tiny_model_dir("gemma2", attn_logit_softcapping=3.0, final_logit_softcapping=5.0)
    with pytest.raises(ValueError, match=r"soft-caps its attention scores at 3.0.*--attention-backend torch_ref"):
        make_engine(npu_plugins, model=model, device="npu_emulated", dtype="float32")


@pytest.mark.parametrize("eager", [False, True], ids=["graph", "eager"])
@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"])
def test_moe_on_the_ascend_path(tiny_model_dir, npu_plugins, model_type, eager):
    """Mixtures of experts through torch_npu's routing and grouped-matmul ops (one fixed-shape
    chain, so decode graphs hold it) give the CPU plugin's tokens (which tests/core/test_moe.py and
    test_deepseek.py match to transformers); DeepSeek-V3's latent attention runs as one latent
    head through the Ascend attention ops."""
    from kiln.testing.engine import make_engine

    prompts = PROMPTS[3:]
    common = dict(model=tiny_model_dir(model_type), dtype="float32", max_num_seqs=4, block_size=64,
                  max_num_batched_tokens=64)  # fmt: skip
    fake_torch_npu.calls.clear()
    engine = make_engine(npu_plugins, device="npu_emulated", enforce_eager=eager, **common)
    tokens, _, _ = run_tracking(engine, prompts, max_tokens=16)
    assert (engine.executor.runner.graph_steps > 0) != eager
    ops = {"npu_moe_init_routing", "npu_moe_compute_expert_tokens", "npu_grouped_matmul", "npu_moe_finalize_routing"}
    ops |= set() if model_type.startswith("deepseek") else {"npu_moe_gating_top_k_softmax"}  # its own routing rule
    assert ops <= set(fake_torch_npu.calls)
    assert tokens == run_tracking(make_engine(npu_plugins, device="cpu", **common), prompts, max_tokens=16)[0]


@pytest.mark.parametrize("eager", [False, True], ids=["graph", "eager"])
def test_drafts_verify_on_the_ascend_path(tiny_model_dir, npu_plugins, eager):
    """Speculative decoding: a step's drafts run as decode rows through the Ascend backend (in
    graph mode through the gear that holds them: 2 requests with 3 drafts each need gear 8, so
    the gears reach max_num_seqs * 4) and give the CPU plugin's greedy tokens."""
    from kiln.testing.engine import greedy_tokens
    from kiln.testing.spec_decode import replayed_greedy

    prompts = [[1000, 7, 9], list(range(100, 119))]
    common = dict(model=tiny_model_dir("llama"), dtype="float32", max_num_seqs=2, block_size=64)
    reference, got, engine = replayed_greedy(npu_plugins, prompts, 12, device="npu_emulated", enforce_eager=eager,
                                             **common)  # fmt: skip
    assert got == reference == greedy_tokens(npu_plugins, prompts, 12, device="cpu", **common)
    stats = engine.core.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert engine.executor.runner.graph_sizes == ([] if eager else [2, 4, 8])
    # every step with drafts (at most 8 rows: the top gear) ran as a graph
    assert engine.executor.runner.graph_steps >= (stats.num_drafts // 2 if not eager else 0)
    assert (engine.executor.runner.graph_steps > 0) is not eager


def test_a_draft_model_on_the_ascend_path(tiny_model_dir, npu_plugins, tmp_path):
    """A draft model, an EAGLE and an EAGLE-3 head (eager, their own caches over the same blocks) proposing for
    a target in graph mode: the CPU plugin's greedy tokens, with drafts accepted and rejected."""
    from kiln.testing.engine import greedy_tokens, make_engine, run_greedy
    from kiln.testing.spec_decode import build_eagle3_head, build_eagle_head, greedy_with_proposals, record_proposals

    prompts = [[1000, 7, 9], list(range(100, 119))]
    draft = {"method": "draft_model", "model": tiny_model_dir("llama", rope_theta=300.0), "num_speculative_tokens": 3}
    common = dict(model=tiny_model_dir("llama"), dtype="float32", max_num_seqs=2, block_size=64)
    engine = make_engine(npu_plugins, device="npu_emulated", speculative_config=draft, **common)
    want = greedy_tokens(npu_plugins, prompts, 12, device="cpu", **common)
    assert run_greedy(engine, prompts, 12) == want
    stats = engine.core.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens and engine.executor.runner.graph_steps > 0
    # An EAGLE head reading the hidden states of the target's graph steps.
    head, _ = build_eagle_head(common["model"], tmp_path / "eagle")
    eagle = {"method": "eagle", "model": head, "num_speculative_tokens": 3}
    engine = make_engine(npu_plugins, device="npu_emulated", speculative_config=eagle, **common)
    assert run_greedy(engine, prompts, 12) == want
    assert engine.core.scheduler.spec_stats.num_draft_tokens > 0 and engine.executor.runner.graph_steps > 0
    # An EAGLE-3 head reading three layers' inputs, returned by the graph steps beside their output:
    # the CPU plugin's drafts too.
    deeper = dict(common, model=tiny_model_dir("llama", num_hidden_layers=3))
    head, _ = build_eagle3_head(deeper["model"], tmp_path / "eagle3", draft_vocab_size=500, layer_ids=[0, 1, 2])
    eagle3 = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    engine = make_engine(npu_plugins, device="npu_emulated", speculative_config=eagle3, **deeper)
    proposed = record_proposals(engine.executor.draft)
    on_npu = (run_greedy(engine, prompts, 12), proposed)
    assert on_npu == greedy_with_proposals(npu_plugins, prompts, 12, device="cpu", speculative_config=eagle3, **deeper)
    assert len(proposed) > len(prompts) and engine.executor.runner.graph_steps > 0
