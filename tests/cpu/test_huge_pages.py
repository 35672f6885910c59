"""``kiln_cpu.huge_pages``: buffers asked onto 2 MiB pages, and a model's tiled weights gathered
into one such buffer with the same outputs, tied weights still shared and the originals freed."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from test_cpu_experts import Experts, routed
from test_tiled_weights import gguf_weight
from torch import nn

from kiln_cpu import native
from kiln_cpu.experts import PackedExperts, use_packed_experts
from kiln_cpu.fused_ops import fused_experts
from kiln_cpu.huge_pages import ALIGN, gather_weights, zeroed
from kiln_cpu.tiled_weights import TiledEmbedding, TiledLinear, use_tiled_weights

pytestmark = pytest.mark.skipif(native.load_kernels() is None, reason="no C compiler for the CPU kernels")


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(a, 16) for a in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_zeroed_is_zeros_asked_onto_huge_pages():
    from numpy._core import multiarray

    was = multiarray._set_madvise_hugepage(False)  # numpy asks for large arrays itself: not this time
    try:
        buffer = zeroed(64 << 20)  # past glibc's mmap threshold, also as Kiln tunes it: a mapping of its own
    finally:
        multiarray._set_madvise_hugepage(was)
    assert buffer.nbytes == 64 << 20 and not buffer[:: 1 << 16].any()
    assert "hg" in vm_flags(buffer.ctypes.data + (32 << 20))  # MADV_HUGEPAGE took
    assert zeroed(0).nbytes == 0 and not zeroed(100).any()  # smaller than a page: nothing to ask


def model_of_tiles() -> nn.Module:
    model = nn.ModuleDict(
        {
            "embed": nn.Embedding(64, 32),
            "head": nn.Linear(32, 64, bias=False),
            "proj": nn.Linear(32, 48),
            "random": nn.Linear(32, 32),
            "experts": Experts(4, 32, 48, torch.float32),
        }
    )
    with torch.no_grad():
        model["embed"].weight.copy_(gguf_weight(64, 32, GGMLQuantizationType.Q8_0))
        model["proj"].weight.copy_(gguf_weight(48, 32, GGMLQuantizationType.Q4_1))
    model["head"].weight = model["embed"].weight
    use_tiled_weights(model)
    use_packed_experts(model["experts"])
    return model


def outputs(model: nn.Module) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 32, generator=gen)
    experts = model["experts"]
    _, weights, ids = routed(5, 4, 2, 32, torch.float32)
    return [
        model["embed"](torch.tensor([[3, 63], [0, 3]])),
        model["head"](x),
        model["proj"](x),
        model["random"](x),
        fused_experts(x, experts.w13, experts.w2, weights, ids),
    ]


def test_gathered_weights_compute_the_same_in_one_buffer():
    model = model_of_tiles()
    before = outputs(model)
    forms = [model[n].weight for n in ("embed", "proj", "random")] + model["experts"].w13.experts
    originals = [weakref.ref(t) for w in forms for t in (w.scale, w.min, w.q) if t is not None]
    del forms
    gathered = gather_weights(model)
    gc.collect()
    assert all(ref() is None for ref in originals)  # every original freed, none held by the gathering
    assert isinstance(model["embed"], TiledEmbedding) and isinstance(model["head"], TiledLinear)
    assert model["head"].weight is model["embed"].weight  # tied: still one form
    assert isinstance(model["experts"].w13, PackedExperts)
    tensors = [
        t
        for w in [model[n].weight for n in ("embed", "proj", "random")]
        + model["experts"].w13.experts
        + model["experts"].w2.experts
        for t in (w.scale, w.min, w.q)
        if t is not None
    ]
    starts = sorted(t.data_ptr() for t in tensors)
    assert all(s % ALIGN == 0 for s in starts)
    assert gathered == sum(-(-t.nbytes // ALIGN) * ALIGN for t in tensors)
    assert starts[-1] - starts[0] < gathered  # one buffer, no tensor twice
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    for got, expected in zip(outputs(model), before, strict=True):
        assert torch.equal(got, expected)
    x = torch.randn(3, 32)
    torch.testing.assert_close(model["random"](x), F.linear(x, model["random"].weight.unpack(), model["random"].bias))


def test_gathering_is_off_with_the_flag(monkeypatch):
    monkeypatch.setenv("KILN_CPU_HUGE_PAGES", "0")
    model = model_of_tiles()
    q = model["proj"].weight.q
    assert gather_weights(model) == 0 and model["proj"].weight.q is q


def test_a_model_without_tiles_gathers_nothing():
    model = nn.Linear(8, 8).bfloat16()
    weight = model.weight
    assert gather_weights(model) == 0 and model.weight is weight


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status and glibc's malloc_trim")
def test_gathering_frees_the_originals_as_it_goes():
    # 320 weights of 1 MiB in glibc's heap (under the mmap threshold Kiln sets), in a fresh process:
    # its peak RSS grows by far less than the 320 MiB gathered
    script = textwrap.dedent(
        """
        import ctypes, torch
        from torch import nn
        from kiln_cpu.huge_pages import gather_weights
        from kiln_cpu.tiled_weights import TiledLinear, TiledWeight
        ctypes.CDLL(None).mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD, as the platform tunes it
        def status(key):
            return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) << 10
        layers = nn.ModuleList(
            TiledLinear(TiledWeight(4, None, None, torch.full((32, 128, 4, 16, 4), 7, dtype=torch.uint8)), None)
            for _ in range(320)
        )
        before = status("VmRSS:")
        gathered = gather_weights(layers)
        print(gathered, status("VmHWM:") - before)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    gathered, growth = (int(v) for v in out.split())
    assert gathered == 320 << 20 and growth < gathered / 2
