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
* ``OpsContract`` (``kiln.testing.ops_contract``): a platform's fused ops against the reference ops of
  ``kiln.interfaces.model``.
"""

from __future__ import annotations

import random
import typing
from typing import ClassVar

import pytest
import torch

from kiln.attention.torch_ref import TorchRefAttentionBackend
from kiln.config import EngineConfig
from kiln.interfaces.attention import AttentionBackend, BatchLayout, DecodeGraphInputs
from kiln.interfaces.model import REFERENCE_OPS
from kiln.interfaces.platform import Platform
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


def forward_kwargs(scale: float, sliding_window: int | None, logit_softcap: float | None = None) -> dict:
    """``forward``'s keywords as a model passes them (a window or a soft cap only where there is one)."""
    kwargs: dict = dict(layer_idx=0, scale=scale)
    if sliding_window is not None:
        kwargs["sliding_window"] = sliding_window
    if logit_softcap is not None:
        kwargs["logit_softcap"] = logit_softcap
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
        self._check_batch(heads, head_dim, block_size, BATCHES[batch], seed=batch)

    @pytest.mark.parametrize("window", SLIDING_WINDOWS)
    @pytest.mark.parametrize("batch", range(len(BATCHES)))
    def test_sliding_window_matches_reference(self, batch, window):
        """Each query sees only the last ``window`` positions, in decodes, fresh prefills and
        chunks on a cached prefix alike (GQA 3, head size 64, the smallest block size it runs)."""
        self._check_batch((6, 2), 64, self._window_block_size(), BATCHES[batch], seed=batch, sliding_window=window)

    @pytest.mark.parametrize("window", [None, 7])
    @pytest.mark.parametrize("batch", range(len(BATCHES)))
    def test_logit_softcap_matches_reference(self, batch, window):
        """Gemma 2's soft cap (scores -> cap * tanh(score / cap)), low enough to bite on scores
        of unit spread, alone and under a sliding window (GQA 3, head size 64)."""
        if not self.backend_cls.supports_logit_softcap:
            pytest.skip("no soft-cap support")
        block_size = self._window_block_size() if window else self._smallest_block_size()
        self._check_batch((6, 2), 64, block_size, BATCHES[batch], seed=batch, sliding_window=window, logit_softcap=1.5)

    def _window_block_size(self) -> int:
        if not self.backend_cls.supports_sliding_window:
            pytest.skip("no sliding-window support")
        return self._smallest_block_size()

    def _smallest_block_size(self) -> int:
        sizes = [b for b in (16, 32, 64, 128) if self.backend_cls.supports(head_dim=64, dtype=self.dtype, block_size=b)]
        if not sizes:
            pytest.skip("unsupported shape")
        return sizes[0]

    def _check_batch(self, heads, head_dim, block_size, shapes, seed, sliding_window=None, logit_softcap=None):
        """Requests of (context_len, query_len) ``shapes``: the backend's output and cache against
        the reference's."""
        num_heads, num_kv_heads = heads
        rng = random.Random(seed * 1000 + head_dim + block_size)
        torch.manual_seed(seed)
        num_blocks = max(64, sum(-(-(c + n) // block_size) for c, n in shapes) + 8)
        layout, num_tokens = random_layout(rng, block_size, num_blocks, shapes, self.device)
        ref, backend, ref_cache, cache, (q, k, v) = self._setup(
            num_heads, num_kv_heads, head_dim, block_size, num_blocks, num_tokens
        )
        kwargs = forward_kwargs(head_dim**-0.5, sliding_window, logit_softcap)
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

    @pytest.mark.parametrize("window", [None, 4])
    def test_decode_graph_path_logit_softcap(self, window):
        """The decode-graph path with Gemma 2's soft cap, alone and under a window."""
        if not self.backend_cls.supports_logit_softcap:
            pytest.skip("no soft-cap support")
        block_size = self._window_block_size() if window else self._smallest_block_size()
        self._check_decode_graph(block_size, sliding_window=window, logit_softcap=1.5)

    def _check_decode_graph(self, block_size, sliding_window=None, logit_softcap=None):
        heads, kv_heads, head_dim = 6, 2, 64
        if not self.backend_cls.supports_decode_graphs:
            pytest.skip("no decode-graph path")
        if not self.backend_cls.supports(head_dim=head_dim, dtype=self.dtype, block_size=block_size):
            pytest.skip("unsupported shape")
        torch.manual_seed(block_size)
        num_blocks, size, max_blocks = 16, 5, 8
        layout, n = random_layout(random.Random(block_size), block_size, num_blocks, BATCHES[1], self.device)
        ref, backend, ref_cache, cache, (q, k, v) = self._setup(heads, kv_heads, head_dim, block_size, num_blocks, size)
        kwargs = forward_kwargs(0.125, sliding_window, logit_softcap)
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
            for resolve in (p.dtype_for, p.quantized_dtype_for):
                got = resolve(model_dtype)
                assert got in p.supported_dtypes, (
                    f"{resolve.__name__}({model_dtype}) = {got}, not in {p.supported_dtypes}"
                )

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
