"""Contract suites that every implementation of a core interface must pass.

Plugin authors subclass a contract in their own tests, setting its knobs as class variables::

    class TestMyBackend(AttentionBackendContract):
        backend_cls = MyBackend
        dtype, atol = torch.float16, 2e-3

    class TestMyPlatform(PlatformContract):
        platform_cls = MyPlatform

    class TestMyOps(OpsContract):
        ops = MyPlatform().custom_ops()
        device = "mine"

* ``AttentionBackendContract``: an ``AttentionBackend`` against the torch reference on mixed paged batches,
  with and without a sliding window, and its encoder (bidirectional) attention.
* ``PlatformContract``: a ``Platform``'s members (config checks, memory, KV cache, graph sizes...).
* ``OpsContract``: a platform's fused ops against the reference ops of ``kiln.interfaces.model``.
"""

from __future__ import annotations

import random
import typing
from collections.abc import Callable
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from kiln.attention.torch_ref import TorchRefAttentionBackend
from kiln.config import EngineConfig
from kiln.interfaces.attention import AttentionBackend, BatchLayout, DecodeGraphInputs
from kiln.interfaces.model import REFERENCE_OPS
from kiln.interfaces.platform import Platform
from kiln.models import rope
from kiln.registry import PlatformSpec, load_ref

# Every value ``--kv-cache-dtype`` accepts.
KV_CACHE_DTYPE_FLAGS: tuple[str, ...] = typing.get_args(EngineConfig.model_fields["kv_cache_dtype"].annotation)


def random_layout(
    rng: random.Random, block_size: int, num_blocks: int, shapes: list[tuple[int, int]], device: str = "cpu"
) -> tuple[BatchLayout, int]:
    """A layout for requests given as (context_len, query_len), decodes (query 1) first,
    with blocks drawn at random from ``1..num_blocks-1`` (block 0 is the null block)."""
    shapes = sorted(shapes, key=lambda s: s[1] != 1)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + q) // block_size))] for c, q in shapes]
    layout = BatchLayout.build(tables, [c for c, _ in shapes], [q for _, q in shapes], block_size, device)
    return layout, layout.num_tokens


# (context_len, query_len) per request: decodes, fresh prefills, chunks on a cached
# prefix, lengths that do not fill a block, single-token prefills.
BATCHES = [
    [(0, 7)],
    [(5, 1), (33, 1), (0, 1)],
    [(16, 1), (0, 19), (31, 2)],
    [(40, 1), (3, 1), (0, 33), (17, 16), (64, 5)],
]
# Sliding windows for those batches: the query alone, narrower than a block, a block wide and
# a little more, wider than most requests.
SLIDING_WINDOWS = [1, 7, 17, 48]


def forward_kwargs(scale: float, sliding_window: int | None) -> dict:
    """``forward``'s keywords as a model passes them (a window only where there is one)."""
    kwargs: dict = dict(layer_idx=0, scale=scale)
    if sliding_window is not None:
        kwargs["sliding_window"] = sliding_window
    return kwargs


class AttentionBackendContract:
    """Compares ``backend_cls`` with the torch reference on mixed paged batches."""

    backend_cls: ClassVar[type[AttentionBackend]]
    dtype: ClassVar[torch.dtype] = torch.float32
    atol: ClassVar[float] = 1e-5
    device: ClassVar[str] = "cpu"
    # A quantized KV cache (``--kv-cache-dtype``): the backend stores K/V in ``cache_dtype``
    # with these scales. The test draws values the cache holds exactly, so the reference
    # (in ``dtype``) must match as closely as without quantization.
    cache_dtype: ClassVar[torch.dtype | None] = None
    k_scale: ClassVar[float] = 1.0  # powers of two

    v_scale: ClassVar[float] = 1.0

    def _setup(self, heads, kv_heads, head_dim, block_size, num_blocks, num_tokens):
        """The reference and the backend under test, their caches holding the same random history,
        and random q/k/v for ``num_tokens`` tokens."""
        ref = TorchRefAttentionBackend(heads, kv_heads, head_dim, self.dtype)
        backend = self.backend_cls(
            heads, kv_heads, head_dim, self.dtype, *([self.cache_dtype] if self.cache_dtype else [])
        )
        backend.k_scale, backend.v_scale = self.k_scale, self.v_scale
        ref_cache = torch.randn(ref.kv_cache_shape(num_blocks, block_size), device=self.device)
        ref_cache = torch.stack(
            [self._representable(ref_cache[0], self.k_scale), self._representable(ref_cache[1], self.v_scale)]
        )
        cache = torch.empty(
            backend.kv_cache_shape(num_blocks, block_size), dtype=backend.cache_dtype, device=self.device
        )
        view = backend.reference_view(cache)
        view[0].copy_(ref_cache[0] / self.k_scale)
        view[1].copy_(ref_cache[1] / self.v_scale)
        q = torch.randn(num_tokens, heads, head_dim, dtype=self.dtype, device=self.device)
        k, v = (
            self._representable(torch.randn(num_tokens, kv_heads, head_dim, device=self.device), scale)
            for scale in (self.k_scale, self.v_scale)
        )
        return ref, backend, ref_cache, cache, (q, k, v)

    def _representable(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """``x`` in ``dtype``, rounded so that ``x / scale`` is exact in ``cache_dtype`` when the cache
        is quantized (with power-of-two scales, the backend's divide and multiply are then exact)."""
        if self.cache_dtype is not None:
            x = (x / scale).to(self.cache_dtype).to(torch.float32) * scale
        return x.to(self.dtype)

    def _assert_same_cache(self, backend: AttentionBackend, cache: torch.Tensor, ref_cache: torch.Tensor) -> None:
        """New K/V landed in the same slots, with the same values."""
        view = backend.reference_view(cache).float()
        torch.testing.assert_close(view[0] * self.k_scale, ref_cache[0].float(), atol=0, rtol=0)
        torch.testing.assert_close(view[1] * self.v_scale, ref_cache[1].float(), atol=0, rtol=0)

    @pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=["mha", "gqa3", "mqa8"])
    @pytest.mark.parametrize("head_dim", [64, 128])
    @pytest.mark.parametrize("block_size", [16, 32])
    @pytest.mark.parametrize("batch", range(len(BATCHES)))
    def test_matches_reference(self, heads, head_dim, block_size, batch):
        if not self.backend_cls.supports(head_dim=head_dim, dtype=self.dtype, block_size=block_size):
            pytest.skip("unsupported shape")
        self._check_batch(heads, head_dim, block_size, batch)

    @pytest.mark.parametrize("window", SLIDING_WINDOWS)
    @pytest.mark.parametrize("batch", range(len(BATCHES)))
    def test_sliding_window_matches_reference(self, batch, window):
        """Each query sees only the last ``window`` positions, in decodes, fresh prefills and
        chunks on a cached prefix alike (GQA 3, head size 64, the smallest block size it runs)."""
        self._check_batch((6, 2), 64, self._window_block_size(), batch, sliding_window=window)

    def _window_block_size(self) -> int:
        if not self.backend_cls.supports_sliding_window:
            pytest.skip("no sliding-window support")
        return self._smallest_block_size()

    def _smallest_block_size(self) -> int:
        sizes = [b for b in (16, 32, 64, 128) if self.backend_cls.supports(head_dim=64, dtype=self.dtype, block_size=b)]
        if not sizes:
            pytest.skip("unsupported shape")
        return sizes[0]

    def _check_batch(self, heads, head_dim, block_size, batch, sliding_window=None):
        """``BATCHES[batch]``: the backend's output and cache against the reference's."""
        num_heads, num_kv_heads = heads
        rng = random.Random(batch * 1000 + head_dim + block_size)
        torch.manual_seed(batch)
        num_blocks = 64
        layout, num_tokens = random_layout(rng, block_size, num_blocks, BATCHES[batch], self.device)
        ref, backend, ref_cache, cache, (q, k, v) = self._setup(
            num_heads, num_kv_heads, head_dim, block_size, num_blocks, num_tokens
        )
        kwargs = forward_kwargs(head_dim**-0.5, sliding_window)
        expected = ref.forward(q, k, v, ref_cache, ref.build_metadata(layout), **kwargs)
        got = backend.forward(q, k, v, cache, backend.build_metadata(layout), **kwargs)
        torch.testing.assert_close(got.float(), expected.float(), atol=self.atol, rtol=self.atol)
        self._assert_same_cache(backend, cache, ref_cache)

    @pytest.mark.parametrize("lengths", [(5, 1, 40, 16), (32, 30, 32), (24, 24)], ids=["mixed", "close", "equal"])
    @pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa3"])
    def test_encoder_matches_reference(self, heads, lengths):
        """``forward_encoder``: each query attends to every key of its own sequence and to no other
        one's (lengths 1, under a block, over two; close or equal ones, which a backend may pad and
        batch), on q/k/v viewed out of one fused qkv tensor, against softmax attention written out
        here; no cache is involved."""
        if not self.backend_cls.supports_encoder:
            pytest.skip("no encoder support")
        (num_heads, num_kv_heads), dim, scale = heads, 64, 0.125
        shapes = [(0, n) for n in lengths]
        layout, n = random_layout(random.Random(7), self._smallest_block_size(), 64, shapes, self.device)
        torch.manual_seed(7)
        qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * dim, dtype=self.dtype, device=self.device)
        q, k, v = qkv.split([num_heads * dim, num_kv_heads * dim, num_kv_heads * dim], dim=-1)
        q, k, v = q.view(n, num_heads, dim), k.view(n, num_kv_heads, dim), v.view(n, num_kv_heads, dim)
        backend = self.backend_cls(num_heads, num_kv_heads, dim, self.dtype)
        got = backend.forward_encoder(q, k, v, layout, scale=scale)
        expected, start = torch.empty(n, num_heads, dim), 0
        for length in layout.query_lens_cpu:
            qi, ki, vi = (t[start : start + length].float().cpu() for t in (q, k, v))
            ki, vi = (t.repeat_interleave(num_heads // num_kv_heads, dim=1) for t in (ki, vi))
            weights = torch.softmax(torch.einsum("qhd,khd->hqk", qi, ki) * scale, dim=-1)
            expected[start : start + length] = torch.einsum("hqk,khd->qhd", weights, vi)
            start += length
        assert got.shape == q.shape and got.dtype == q.dtype
        torch.testing.assert_close(got.float().cpu(), expected, atol=self.atol, rtol=self.atol)

    @pytest.mark.parametrize("block_size", [16, 32, 64, 128])
    def test_decode_graph_path(self, block_size):
        """``graph_metadata`` on a decode step padded with empty rows gives the reference's
        output for the real rows and writes no padding row's K/V."""
        self._check_decode_graph(block_size)

    @pytest.mark.parametrize("window", [4, 20])
    def test_decode_graph_path_sliding_window(self, window):
        """The decode-graph path with a window narrower than some of the requests."""
        self._check_decode_graph(self._window_block_size(), sliding_window=window)

    def _check_decode_graph(self, block_size, sliding_window=None):
        heads, kv_heads, head_dim = 6, 2, 64
        if not self.backend_cls.supports_decode_graphs:
            pytest.skip("no decode-graph path")
        if not self.backend_cls.supports(head_dim=head_dim, dtype=self.dtype, block_size=block_size):
            pytest.skip("unsupported shape")
        torch.manual_seed(block_size)
        num_blocks, size, max_blocks = 16, 5, 8
        layout, n = random_layout(random.Random(block_size), block_size, num_blocks, BATCHES[1], self.device)
        ref, backend, ref_cache, cache, (q, k, v) = self._setup(heads, kv_heads, head_dim, block_size, num_blocks, size)
        kwargs = forward_kwargs(0.125, sliding_window)
        expected = ref.forward(q[:n], k[:n], v[:n], ref_cache, ref.build_metadata(layout), **kwargs)
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        padded = DecodeGraphInputs.pad(ids, ids, layout, size, max_blocks)
        metadata = backend.graph_metadata(padded.block_table, padded.seq_lens, padded.slot_mapping, block_size)
        got = backend.forward(q, k, v, cache, metadata, **kwargs)
        torch.testing.assert_close(got[:n].float(), expected.float(), atol=self.atol, rtol=self.atol)
        self._assert_same_cache(backend, cache, ref_cache)


# ---------------------------------------------------------------- platforms


def _ids(values) -> list[str]:
    return [str(v).removeprefix("torch.") for v in values]


def _fresh_config(**kwargs: object) -> EngineConfig:
    """A config as ``Platform.update_config`` receives it; ``max_num_batched_tokens`` resolved
    as the engine does before ``graph_sizes`` is called."""
    config = EngineConfig.create(**kwargs)
    if config.max_num_batched_tokens is None:
        config.max_num_batched_tokens = 2048
    return config


class PlatformContract:
    """Checks a ``kiln.interfaces.platform.Platform`` against what the engine relies on.

    Plugin authors subclass it in their own tests::

        from kiln.registry import PlatformSpec
        from kiln.testing.contracts import PlatformContract
        from my_plugin.platform import MyPlatform

        class TestMyPlatform(PlatformContract):
            platform_cls = MyPlatform
            spec = PlatformSpec("mine", "my_plugin.platform:MyPlatform", is_available=lambda: True)

    Override ``make_platform`` where the platform needs more than ``platform_cls()``.
    Every knob defaults to what the platform declares (``supported_block_sizes``...).
    """

    platform_cls: ClassVar[type[Platform]]
    # Block sizes ``update_config`` must accept unchanged (None: ``supported_block_sizes``) and
    # ones it must refuse (None: every other power of two up to 1024).
    block_sizes: ClassVar[tuple[int, ...] | None] = None
    rejected_block_sizes: ClassVar[tuple[int, ...] | None] = None
    dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None  # None: ``supported_dtypes``
    # Small: freed memory is reused for it (a large one would get fresh, zeroed pages either way).
    kv_cache_shape: ClassVar[tuple[int, ...]] = (2, 4, 16, 2, 32)
    # The torch device type ``device()`` and ``allocate_kv_cache`` give (None: ``device_type``).
    # Only for emulations whose device calls run on another device.
    expected_device_type: ClassVar[str | None] = None
    # The plugin's registration (``register_platforms``); None skips its check.
    spec: ClassVar[PlatformSpec | None] = None
    # ``graph_sizes`` is asked for each of these configs (``EngineConfig.create`` arguments).
    graph_size_configs: ClassVar[tuple[dict, ...]] = (
        {},
        {"max_num_seqs": 12},
        {"max_num_seqs": 1},
        {"max_num_seqs": 1024, "max_num_batched_tokens": 8192},
        {"max_num_seqs": 256, "max_num_batched_tokens": 64},  # fewer tokens than sequences
        {"max_num_seqs": 16, "graph_sizes": [8, 1, 4, 2, 64, 4]},
        {"max_num_seqs": 64, "max_num_batched_tokens": 16, "graph_sizes": [32, 2, 8, 16]},
        {"max_num_seqs": 4, "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    )

    def make_platform(self) -> Platform:
        return self.platform_cls()

    def _device_type(self, platform: Platform) -> str:
        return self.expected_device_type or platform.device_type

    def test_declared_attributes(self):
        p = self.make_platform()
        for attr in ("name", "device_type", "dist_backend"):
            value = getattr(p, attr, None)
            assert isinstance(value, str) and value, f"{attr} must be a non-empty string, got {value!r}"
        assert p.supported_dtypes and all(isinstance(d, torch.dtype) for d in p.supported_dtypes)
        sizes = p.supported_block_sizes
        assert sizes and all(isinstance(s, int) and s > 0 and s & (s - 1) == 0 for s in sizes), sizes
        assert p.default_block_size in sizes, f"default_block_size {p.default_block_size} not in {sizes}"
        # "auto" is the default of --kv-cache-dtype: without it every default config is refused.
        assert "auto" in p.supported_kv_cache_dtypes
        unknown = set(p.supported_kv_cache_dtypes) - set(KV_CACHE_DTYPE_FLAGS)
        assert not unknown, f"--kv-cache-dtype cannot express {sorted(unknown)}"

    def test_spec(self):
        if self.spec is None:
            pytest.skip("no spec given")
        target = load_ref(self.spec.factory)
        cls = target if isinstance(target, type) else type(target)
        assert issubclass(cls, Platform), f"factory {self.spec.factory!r} gives {target!r}, not a Platform"
        assert cls.name == self.spec.name, f"spec {self.spec.name!r} builds platform {cls.name!r}"
        assert isinstance(self.spec.is_available(), bool)

    def test_device(self):
        p = self.make_platform()
        device = p.device()
        assert isinstance(device, torch.device) and device.type == self._device_type(p), device

    def test_mem_get_info(self):
        info = self.make_platform().mem_get_info()
        assert len(info) == 2, info
        free, total = info
        assert all(isinstance(v, int) and not isinstance(v, bool) for v in info), info
        assert 0 <= free <= total and total > 0, info

    def test_allocate_kv_cache_is_zeroed(self):
        p = self.make_platform()
        shape = self.kv_cache_shape
        for dtype in self.dtypes or p.supported_dtypes:
            # Freed NaNs first: a cache taken uninitialised from an allocator would hold them.
            junk = torch.full(shape, float("nan"), dtype=dtype, device=p.device())
            del junk
            cache = p.allocate_kv_cache(shape, dtype)
            assert isinstance(cache, torch.Tensor)
            assert (tuple(cache.shape), cache.dtype) == (shape, dtype), (cache.shape, cache.dtype)
            assert cache.device.type == self._device_type(p), cache.device
            assert bool((cache == 0).all()), f"{dtype} KV cache is not zero-filled"

    def test_dtype_for(self):
        p = self.make_platform()
        for model_dtype in (None, *(self.dtypes or p.supported_dtypes)):
            got = p.dtype_for(model_dtype)
            assert got in p.supported_dtypes, f"dtype_for({model_dtype}) = {got}, not in {p.supported_dtypes}"

    def test_update_config_fills_the_default_block_size(self):
        p = self.make_platform()
        config = EngineConfig.create()
        p.update_config(config)
        assert config.block_size == p.default_block_size

    def test_update_config_accepts_supported_values(self):
        p = self.make_platform()
        for size in self.block_sizes or p.supported_block_sizes:
            config = EngineConfig.create(block_size=size)
            p.update_config(config)
            assert config.block_size == size, f"block size {size} became {config.block_size}"
        for kv_dtype in p.supported_kv_cache_dtypes:
            p.update_config(EngineConfig.create(kv_cache_dtype=kv_dtype))

    def test_update_config_refuses_unsupported_block_sizes(self):
        p = self.make_platform()
        accepted = set(self.block_sizes or p.supported_block_sizes)
        rejected = self.rejected_block_sizes or [s for s in (2**i for i in range(11)) if s not in accepted]
        if not rejected:
            pytest.skip("every block size is supported")
        for size in rejected:
            with pytest.raises(ValueError, match="--block-size") as info:
                p.update_config(EngineConfig.create(block_size=size))
            assert str(size) in str(info.value), f"the error does not name block size {size}: {info.value}"

    def test_update_config_refuses_unsupported_kv_cache_dtypes(self):
        p = self.make_platform()
        rejected = [d for d in KV_CACHE_DTYPE_FLAGS if d not in p.supported_kv_cache_dtypes]
        if not rejected:
            pytest.skip("every --kv-cache-dtype is supported")
        for kv_dtype in rejected:
            with pytest.raises(ValueError, match="--kv-cache-dtype") as info:
                p.update_config(EngineConfig.create(kv_cache_dtype=kv_dtype))
            assert kv_dtype in str(info.value), f"the error does not name {kv_dtype}: {info.value}"

    def test_graph_sizes(self):
        """Ascending, and never above ``max_num_seqs`` or ``max_num_batched_tokens``: a step
        never holds more decodes, so a larger graph would only cost build time and memory."""
        p = self.make_platform()
        for kwargs in self.graph_size_configs:
            config = _fresh_config(**kwargs)
            p.update_config(config)
            sizes = p.graph_sizes(config)
            where = f"graph_sizes({kwargs}) = {sizes}"
            assert all(isinstance(s, int) and s >= 1 for s in sizes), where
            assert list(sizes) == sorted(set(sizes)), f"{where}: not strictly ascending"
            assert all(s <= config.max_decode_rows for s in sizes), f"{where}: above max_num_seqs (with drafts)"
            assert all(s <= config.max_num_batched_tokens for s in sizes), f"{where}: above max_num_batched_tokens"
            if sizes and "speculative_config" in kwargs:  # each sequence's drafts are decode rows too
                assert max(sizes) > config.max_num_seqs, f"{where}: stops at max_num_seqs, not max_decode_rows"

    def test_custom_ops(self):
        ops = self.make_platform().custom_ops()
        assert set(ops) <= set(REFERENCE_OPS), f"unknown ops: {sorted(set(ops) - set(REFERENCE_OPS))}"
        assert all(callable(op) for op in ops.values())

    def test_attention_backend(self):
        name = self.make_platform().attention_backend()
        assert isinstance(name, str) and name, name

    def test_peak_memory_of(self):
        p = self.make_platform()
        device, nbytes, calls = p.device(), 1 << 20, []

        def step() -> None:
            calls.append(1)
            held = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
            held.add_(1)

        peak = p.peak_memory_of(step)
        if peak is None:
            assert calls == [], "peak_memory_of returned None after running fn"
            return
        assert isinstance(peak, int) and not isinstance(peak, bool), peak
        assert calls == [1], f"fn ran {len(calls)} times"
        assert peak >= nbytes, f"fn held {nbytes} bytes at once; peak_memory_of says {peak}"

    def test_synchronize(self):
        p = self.make_platform()
        x = torch.ones(64, 64, device=p.device())
        y = x @ x
        assert p.synchronize() is None
        assert float(y[0, 0]) == 64.0


# ---------------------------------------------------------------- fused ops

# Which arguments of each reference op an in-place kernel may overwrite, and with which of its results.
WRITABLE: dict[str, dict[int, int]] = {"fused_add_rms_norm": {0: 0, 1: 1}, "rotary_embedding": {1: 0, 2: 1}}
ARG_NAMES = {
    "rms_norm": ("x", "weight", "eps"),
    "fused_add_rms_norm": ("x", "residual", "weight", "eps"),
    "rotary_embedding": ("positions", "q", "k", "cos_sin_cache"),
    "silu_and_mul": ("x",),
    "gelu_and_mul": ("x",),
    "gelu_tanh_and_mul": ("x",),
    "moe_route": ("router_logits", "top_k", "renormalize"),
    "fused_experts": ("x", "w13", "w2", "weights", "ids"),
}


class OpsContract:
    """Compares a platform's fused ops (``Platform.custom_ops()``) with the torch reference
    ops of ``kiln.interfaces.model`` on random inputs, for every dtype and shape below: same
    output shapes and dtypes, values within ``atol``/``rtol``, inputs left alone. Ops the
    platform does not override are skipped.

    Plugin authors subclass it in their own tests::

        from kiln.testing.contracts import OpsContract
        from my_plugin.platform import MyPlatform

        class TestMyOps(OpsContract):
            ops = MyPlatform().custom_ops()
            device = "mine"
            dtypes = (torch.float16, torch.bfloat16)
            in_place_ops = frozenset({"rotary_embedding"})  # writes q and k, as vLLM's kernel

    Each knob is a class variable; narrow the shapes where the kernels are slow to run.
    """

    ops: ClassVar[dict[str, Callable]]
    device: ClassVar[str] = "cpu"
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    atol: ClassVar[dict[torch.dtype, float]] = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
    rtol: ClassVar[dict[torch.dtype, float]] = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
    num_tokens: ClassVar[tuple[int, ...]] = (1, 5, 33)
    hidden_sizes: ClassVar[tuple[int, ...]] = (64, 100, 2048)  # rms_norm, fused_add_rms_norm
    intermediate_sizes: ClassVar[tuple[int, ...]] = (21, 128, 1500)  # the gated activations' input is twice this
    # (heads, kv_heads, head_dim) for rotary_embedding and rms_norm on per-head views (Qwen3's q/k norm).
    head_shapes: ClassVar[tuple[tuple[int, int, int], ...]] = ((4, 4, 64), (6, 2, 128), (8, 1, 32), (2, 1, 80))
    # (experts, top_k, hidden, intermediate) for moe_route and fused_experts.
    moe_shapes: ClassVar[tuple[tuple[int, int, int, int], ...]] = ((8, 2, 64, 96), (16, 4, 128, 64))
    max_positions: ClassVar[int] = 1024
    rope_theta: ClassVar[float] = 10000.0
    eps: ClassVar[float] = 1e-6
    # Ops allowed to overwrite their tensor inputs with their results (see ``WRITABLE``), as
    # vLLM's kernels do; any other change to an input fails.
    in_place_ops: ClassVar[frozenset[str]] = frozenset()

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """Parametrizes the tests below from the class variables (of the subclass)."""
        knobs = {
            "dtype": (self.dtypes, _ids(self.dtypes)),
            "num_tokens": (self.num_tokens, None),
            "hidden_size": (self.hidden_sizes, None),
            "intermediate_size": (self.intermediate_sizes, None),
            "head_shape": (self.head_shapes, [f"h{h}kv{kv}d{d}" for h, kv, d in self.head_shapes]),
            "moe_shape": (self.moe_shapes, [f"e{e}k{k}h{h}i{i}" for e, k, h, i in self.moe_shapes]),
        }
        taken = {n for m in metafunc.definition.iter_markers("parametrize") for n in _argnames(m.args[0])}
        for name, (values, ids) in knobs.items():
            if name in metafunc.fixturenames and name not in taken:
                metafunc.parametrize(name, values, ids=ids)

    def _random(self, gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * scale).to(dtype).to(self.device)

    def _check(self, name: str, args: tuple, dtype: torch.dtype, untouched: tuple[torch.Tensor, ...] = ()) -> None:
        """Runs the reference on clones and the platform's op on ``args``, then compares the results
        and checks that no input (nor any tensor in ``untouched``) changed unexpectedly."""
        op = self.ops.get(name)
        if op is None:
            pytest.skip(f"the platform does not override {name}: the reference runs")
        expected = REFERENCE_OPS[name](*map(_clone, args))
        before, untouched_before = [_clone(a) for a in args], [t.clone() for t in untouched]
        got = op(*args)
        expected, got = _as_tuple(expected), _as_tuple(got)
        assert len(got) == len(expected), f"{name} returned {len(got)} results, the reference {len(expected)}"
        for i, (g, e) in enumerate(zip(got, expected)):
            where = f"{name} result {i} ({dtype})"
            assert isinstance(g, torch.Tensor), f"{where}: {type(g).__name__}, not a tensor"
            assert (g.shape, g.dtype) == (e.shape, e.dtype), (
                f"{where}: {g.shape} {g.dtype}, expected {e.shape} {e.dtype}"
            )
            assert g.device.type == e.device.type, f"{where}: on {g.device}, expected {e.device}"
            torch.testing.assert_close(
                g.float(),
                e.float(),
                atol=self.atol[dtype],
                rtol=self.rtol[dtype],
                msg=lambda m, where=where: f"{where}: {m}",
            )
        writable = WRITABLE.get(name, {}) if name in self.in_place_ops else {}
        for i, (arg, old) in enumerate(zip(args, before)):
            if not isinstance(arg, torch.Tensor) or torch.equal(arg, old):
                continue
            arg_name = ARG_NAMES[name][i]
            assert i in writable, f"{name} modified its input {arg_name} (the reference does not)"
            assert torch.equal(arg, got[writable[i]]), (
                f"{name} overwrote {arg_name} with something else than its result"
            )
        for t, old in zip(untouched, untouched_before):
            assert torch.equal(t, old), f"{name} wrote outside its inputs (into the rest of their buffer)"

    def test_rms_norm(self, dtype, num_tokens, hidden_size):
        gen = torch.Generator().manual_seed(0)
        x, weight = self._random(gen, num_tokens, hidden_size, dtype=dtype), self._random(gen, hidden_size, dtype=dtype)
        self._check("rms_norm", (x, weight, self.eps), dtype)

    def test_rms_norm_on_head_views(self, dtype, num_tokens, head_shape):
        """Per-head norms (Qwen3's q/k norm) on the strided q view of a fused qkv projection."""
        heads, kv_heads, head_dim = head_shape
        gen = torch.Generator().manual_seed(1)
        qkv = self._random(gen, num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
        q, rest = qkv.split([heads * head_dim, 2 * kv_heads * head_dim], dim=-1)
        weight = self._random(gen, head_dim, dtype=dtype)
        self._check("rms_norm", (q.view(num_tokens, heads, head_dim), weight, self.eps), dtype, untouched=(rest,))

    def test_fused_add_rms_norm(self, dtype, num_tokens, hidden_size):
        gen = torch.Generator().manual_seed(2)
        x, residual = (self._random(gen, num_tokens, hidden_size, dtype=dtype) for _ in range(2))
        weight = self._random(gen, hidden_size, dtype=dtype)
        self._check("fused_add_rms_norm", (x, residual, weight, self.eps), dtype)

    @pytest.mark.parametrize("layout", ["qkv_views", "contiguous"])
    def test_rotary_embedding(self, dtype, num_tokens, head_shape, layout):
        """NeoX rotary on the model's own cache (``kiln.models.rope``) at random positions (first and
        last included), on q/k split from one qkv tensor as the model passes them, or on fresh ones."""
        heads, kv_heads, head_dim = head_shape
        gen = torch.Generator().manual_seed(3)
        positions = torch.randint(0, self.max_positions, (num_tokens,), generator=gen)
        positions[0], positions[-1] = self.max_positions - 1, 0
        cache = rope.cos_sin_cache(head_dim, self.max_positions, SimpleNamespace(rope_theta=self.rope_theta))
        qkv = self._random(gen, num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k = q.view(num_tokens, heads, head_dim), k.view(num_tokens, kv_heads, head_dim)
        if layout == "contiguous":
            q, k = q.contiguous(), k.contiguous()
        args = (positions.to(self.device), q, k, cache.to(self.device))
        self._check("rotary_embedding", args, dtype, untouched=(v,))

    @pytest.mark.parametrize("name", ["silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"])
    def test_gated_activation(self, name, dtype, num_tokens, intermediate_size):
        gen = torch.Generator().manual_seed(4)
        x = self._random(gen, num_tokens, 2 * intermediate_size, dtype=dtype, scale=4.0)
        self._check(name, (x,), dtype)

    @pytest.mark.parametrize("renormalize", [True, False])
    def test_moe_route(self, dtype, num_tokens, moe_shape, renormalize):
        experts, top_k, _, _ = moe_shape
        logits = self._random(torch.Generator().manual_seed(5), num_tokens, experts, dtype=dtype, scale=3.0)
        self._check("moe_route", (logits, top_k, renormalize), dtype)

    def test_fused_experts(self, dtype, num_tokens, moe_shape):
        experts, top_k, hidden, inter = moe_shape
        gen = torch.Generator().manual_seed(6)
        x = self._random(gen, num_tokens, hidden, dtype=dtype)
        w13 = self._random(gen, experts, 2 * inter, hidden, dtype=dtype, scale=hidden**-0.5)
        w2 = self._random(gen, experts, hidden, inter, dtype=dtype, scale=inter**-0.5)
        weights, ids = REFERENCE_OPS["moe_route"](torch.randn(num_tokens, experts, generator=gen), top_k, True)
        ids[0, -1] = -1  # an expert another rank holds (expert parallelism): adds nothing
        self._check("fused_experts", (x, w13, w2, weights.to(self.device), ids.to(self.device)), dtype)


def _argnames(names) -> list[str]:
    return [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)


def _clone(arg):
    return arg.clone() if isinstance(arg, torch.Tensor) else arg


def _as_tuple(result) -> tuple:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)
