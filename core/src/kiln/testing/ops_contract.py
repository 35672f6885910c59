"""The contract of a platform's fused ops (``Platform.custom_ops()``): each against the torch
reference op of ``kiln.interfaces.model`` on random inputs.

Plugin authors subclass it in their own tests::

    class TestMyOps(OpsContract):
        ops = MyPlatform().custom_ops()
        device = "mine"
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from kiln.interfaces.model import REFERENCE_OPS
from kiln.models import rope
from kiln.testing.contracts import _ids

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
    "argmax": ("logits",),
}


class OpsContract:
    """Compares a platform's fused ops (``Platform.custom_ops()``) with the torch reference
    ops of ``kiln.interfaces.model`` on random inputs, for every dtype and shape below: same
    output shapes and dtypes, values within ``atol``/``rtol``, inputs left alone. Ops the
    platform does not override are skipped.

    Plugin authors subclass it in their own tests::

        from kiln.testing.ops_contract import OpsContract
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
            if not isinstance(arg, torch.Tensor) or _unchanged(arg, old):
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

    @pytest.mark.parametrize("vocab", [37, 1000, 49152, 50257])
    def test_argmax(self, num_tokens, vocab):
        """fp32 rows, as the sampler gives them: ties (the first wins), then, where there are
        rows enough, +inf (the first wins), a NaN after the largest value (the first NaN wins),
        a row of -inf (0) and a NaN before the largest value."""
        logits = self._random(torch.Generator().manual_seed(7), num_tokens, vocab, dtype=torch.float32)
        logits[0, vocab // 3] = logits[0, vocab - 2] = logits[0].max() + 1
        special = [(3, 9, "inf"), (vocab - 1, vocab, "nan"), (0, vocab, "-inf"), (1, 2, "nan")]
        for row, (start, end, value) in zip(range(1, num_tokens), special):
            logits[row, start:end] = float(value)
        self._check("argmax", (logits,), torch.float32)


def _unchanged(now: torch.Tensor, before: torch.Tensor) -> bool:
    """Equal, a NaN where there was one included (``torch.equal`` says a NaN differs from itself)."""
    return now.shape == before.shape and bool(((now == before) | (now.isnan() & before.isnan())).all())


def _argnames(names) -> list[str]:
    return [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)


def _clone(arg):
    return arg.clone() if isinstance(arg, torch.Tensor) else arg


def _as_tuple(result) -> tuple:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)
