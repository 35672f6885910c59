"""Tiled GGUF forms kept on disk (``kiln_cpu.form_cache``): a weight's second tiling takes its
form from there, a kept form that does not widen to the weight is never used, and the folder
stays within its limit."""

import os

import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file
from test_tiled_weights import gguf_weight

from kiln_cpu import form_cache, native, tiled_weights
from kiln_cpu.tiled_weights import find_gguf_form

pytestmark = pytest.mark.skipif(native.load_kernels() is None, reason="no C compiler for the CPU kernels")

ROWS, COLS = 1024, 256  # form_cache.MIN_VALUES: the smallest weight kept


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    return tmp_path / "cpu-forms"


def _no_recovery(*args):
    raise AssertionError("recovered the blocks again")


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q4_1])  # fp32 and fp16 scales
def test_a_kept_form_is_taken_instead_of_recovering(folder, monkeypatch, kind):
    w = gguf_weight(ROWS, COLS, kind)
    first = find_gguf_form(w)
    stored = load_file(str(next(folder.iterdir())))
    assert (
        stored["scale"].dtype
        == first.scale.dtype
        == (torch.float16 if kind == GGMLQuantizationType.Q4_1 else torch.float32)
    )
    assert first is not None and len(list(folder.iterdir())) == 1
    monkeypatch.setattr(tiled_weights, "recover_blocks", _no_recovery)
    again = find_gguf_form(w.clone())
    assert (again.fmt, again.shape) == (first.fmt, first.shape)
    assert torch.equal(again.q, first.q) and torch.equal(again.scale, first.scale) and torch.equal(again.min, first.min)
    assert torch.equal(again.unpack(), w)


def test_small_weights_and_a_zero_limit_keep_nothing(folder, monkeypatch):
    assert find_gguf_form(gguf_weight(ROWS - 16, COLS, GGMLQuantizationType.Q8_0)) is not None
    monkeypatch.setenv("KILN_CPU_FORM_CACHE_GB", "0")
    assert find_gguf_form(gguf_weight(ROWS, COLS, GGMLQuantizationType.Q8_0)) is not None
    assert not folder.exists()


def test_a_kept_form_of_other_values_is_not_used(folder):
    """A file under a weight's name holding another weight's form (as a fingerprint shared by
    weights that differ outside its sample would give): recovered again, and the file replaced."""
    w = gguf_weight(ROWS, COLS, GGMLQuantizationType.Q8_0)
    other = find_gguf_form(gguf_weight(ROWS, COLS, GGMLQuantizationType.Q8_0, seed=1))
    name = form_cache.fingerprint(w)
    form_cache.store(name, other.fmt, other.scale, other.min, other.q)
    form = find_gguf_form(w)
    assert torch.equal(form.unpack(), w)
    assert torch.equal(form_cache.load(name)[3], form.q)


def test_a_damaged_file_is_a_miss(folder):
    from safetensors.torch import save_file

    w = gguf_weight(ROWS, COLS, GGMLQuantizationType.Q8_0)
    path = folder / f"{form_cache.fingerprint(w)}.safetensors"
    folder.mkdir(parents=True)
    path.write_bytes(b"not a safetensors file")
    assert torch.equal(find_gguf_form(w).unpack(), w)
    save_file({"scale": torch.zeros(1)}, str(path), metadata={"fmt": "8"})  # no codes
    assert form_cache.load(path.stem) is None


def test_the_least_recently_used_go_first(folder, monkeypatch):
    weights = [gguf_weight(ROWS, COLS, GGMLQuantizationType.Q8_0, seed=s) for s in range(3)]
    for i, w in enumerate(weights):
        find_gguf_form(w)
        os.utime(folder / f"{form_cache.fingerprint(w)}.safetensors", (1000 + i, 1000 + i))
    form_cache.load(form_cache.fingerprint(weights[0]))  # used again: now the most recent
    size = max(f.stat().st_size for f in folder.iterdir())
    monkeypatch.setenv("KILN_CPU_FORM_CACHE_GB", str(2.5 * size / (1 << 30)))
    form_cache.trim()
    kept = {f.name for f in folder.iterdir()}
    assert kept == {f"{form_cache.fingerprint(w)}.safetensors" for w in (weights[0], weights[2])}


@pytest.mark.parametrize("part", ["scale", "q"])
def test_a_kept_form_of_another_layout_is_not_used(folder, monkeypatch, part):
    """Tensors of the wrong shape (the kernels would read past their end) are a miss, never unpacked."""
    w = gguf_weight(ROWS, COLS, GGMLQuantizationType.Q4_1)
    form = find_gguf_form(w)
    name = form_cache.fingerprint(w)
    parts = {"scale": form.scale, "min": form.min, "q": form.q}
    parts[part] = parts[part][:-1].clone()
    form_cache.store(name, form.fmt, parts["scale"], parts["min"], parts["q"])
    unpacked = []
    monkeypatch.setattr(tiled_weights.TiledWeight, "unpack", lambda self, rows=None: unpacked.append(self) or w)
    monkeypatch.setattr(tiled_weights, "recover_blocks", lambda *a: None)
    assert find_gguf_form(w) is None and not unpacked  # the file's form refused; recovery (stubbed) asked
