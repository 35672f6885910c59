"""The cache of converted GGUF files (``kiln.models.gguf_cache``): a conversion is found by the
file's content wherever the file lies, so reinstalling a GGUF (a new path or mtime) reuses its
folder instead of adding another; a conversion removes the older folders of files of the same
name that nothing maps to any more; the folder holds no copy of the weights, which are read
from the file one tensor at a time and are transformers' conversion of the whole model bit for
bit; a folder whose file is gone says so."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.models import gguf_cache
from kiln.models.gguf_cache import INDEX, convert_gguf
from kiln.models.gguf_reader import FastGGUFReader
from kiln.models.loader import default_model_path, iter_weights


@pytest.mark.slow
def test_a_conversion_is_found_by_content_and_replaces_older_ones(tmp_path):
    cache = tmp_path / "cache"
    copies = [tmp_path / d / "model.gguf" for d in ("a", "b")]
    for copy in copies:
        copy.parent.mkdir()
        shutil.copy(default_model_path(), copy)  # a new mtime each, as a reinstall gives
    # Folders an older Kiln named by path, size and mtime, for this file name and another.
    for name in ("model-0123456789abcdef", "other-0123456789abcdef"):
        (cache / name).mkdir(parents=True)
        (cache / name / "config.json").write_text("{}")

    folder = convert_gguf(str(copies[0]), cache)  # the one conversion (~15 s)
    digest = hashlib.sha256(copies[0].read_bytes()).hexdigest()
    assert os.path.basename(folder) == f"model-{digest[:16]}"
    assert os.path.exists(os.path.join(folder, gguf_cache.RECIPE))
    assert not glob.glob(os.path.join(folder, "*.safetensors"))  # no copy of the weights
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == [f"model-{digest[:16]}", "other-0123456789abcdef"]
    weights = os.stat(os.path.join(folder, gguf_cache.RECIPE))

    assert convert_gguf(str(copies[1]), cache) == folder  # the same content elsewhere
    os.utime(copies[0], ns=(weights.st_mtime_ns, weights.st_mtime_ns + 10**9))  # touched: hashed again
    assert convert_gguf(str(copies[0]), cache) == folder
    assert os.stat(os.path.join(folder, gguf_cache.RECIPE)).st_mtime_ns == weights.st_mtime_ns  # not rewritten
    index = json.loads((cache / INDEX).read_text())
    assert {e["sha256"] for e in index.values()} == {digest}
    assert set(index) == {os.path.realpath(c) for c in copies}

    copies[1].unlink()  # a path whose file is gone is forgotten at the next hash
    os.utime(copies[0], ns=(weights.st_mtime_ns, weights.st_mtime_ns + 2 * 10**9))
    assert convert_gguf(str(copies[0]), cache) == folder
    assert set(json.loads((cache / INDEX).read_text())) == {os.path.realpath(copies[0])}


def test_a_damaged_file_is_a_clear_error(tmp_path):
    cache, gguf = tmp_path / "cache", tmp_path / "model.gguf"
    with open(default_model_path(), "rb") as f:
        gguf.write_bytes(f.read(5_000_000))  # cut short, as an interrupted download leaves it
    with pytest.raises(ValueError, match="could not be converted from GGUF .is the file complete"):
        convert_gguf(str(gguf), cache)
    assert [p.name for p in cache.iterdir()] == [INDEX]  # no folder left half written


def test_an_unreadable_index_is_rebuilt(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / INDEX).write_text("not json")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    converted = cache / f"model-{digest[:16]}"
    converted.mkdir()
    (converted / gguf_cache.MARKER).write_text(
        json.dumps({"conversion": gguf_cache.CONVERSION})
    )  # found by content: no conversion is tried
    assert convert_gguf(str(gguf), cache) == str(converted)
    assert json.loads((cache / INDEX).read_text()) == {
        os.path.realpath(gguf): {
            "size": 104,
            "mtime_ns": os.stat(gguf).st_mtime_ns,
            "sha256": digest,
            "files": [str(gguf)],
        }
    }


@pytest.mark.slow
def test_weights_read_from_the_file_are_transformers_conversion(tmp_path):
    cache, whole = tmp_path / "cache", tmp_path / "whole"
    whole.mkdir()
    gguf = tmp_path / "model.gguf"
    shutil.copy(default_model_path(), gguf)
    folder = convert_gguf(str(gguf), cache)  # the default model: Llama, converted tensor by tensor
    with gguf_cache._parsed_once(str(gguf), FastGGUFReader(str(gguf))):  # as the conversion calls it
        gguf_cache._write_whole(str(gguf), str(whole))
    ours = dict(iter_weights(folder))
    theirs = load_file(whole / "model.safetensors")
    assert ours.keys() == theirs.keys() and len(ours) == 272
    assert all(ours[k].dtype == torch.float32 and torch.equal(ours[k].view(torch.int32), theirs[k].view(torch.int32))
               for k in ours)  # fmt: skip
    for name in ("config.json", "generation_config.json"):
        ours, theirs = (json.loads((Path(f) / name).read_text()) for f in (folder, whole))
        assert {k: v for k, v in ours.items() if k != "_name_or_path"} == {
            k: v for k, v in theirs.items() if k != "_name_or_path"
        }

    gguf.unlink()  # the folder's weights are the file's: gone, the folder says where it looked
    with pytest.raises(ValueError, match=f"reads its weights from the GGUF file.*{gguf}.*pass the .gguf file"):
        next(iter_weights(folder))


def test_a_folder_an_older_kiln_converted_is_converted_again(tiny_model_dir, tmp_path):
    """Conversions changed (the tokenizers, 2026-11-27): a folder without this Kiln's mark is
    replaced, in place, by a new conversion."""
    from kiln.testing.models import hf_as_gguf

    cache, gguf = tmp_path / "cache", hf_as_gguf(tiny_model_dir("llama"), str(tmp_path / "model.gguf"), "llama")
    digest = hashlib.sha256(open(gguf, "rb").read()).hexdigest()
    older = cache / f"model-{digest[:16]}"
    older.mkdir(parents=True)
    (older / "config.json").write_text("{}")  # as an older Kiln left it: no mark
    (older / "tokenizer.json").write_text("{}")
    assert convert_gguf(gguf, cache) == str(older)
    assert json.loads((older / gguf_cache.MARKER).read_text()) == {"conversion": gguf_cache.CONVERSION}
    assert json.loads((older / "config.json").read_text())["model_type"] == "llama"
    assert json.loads((older / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    assert sorted(p.name for p in cache.iterdir()) == [".lock", older.name, INDEX]  # the temporary folders are gone


def test_a_qwen3_gguf_of_another_head_size_serves_the_values_it_holds(tiny_model_dir, tmp_path, monkeypatch):
    """transformers maps ``qwen3``'s GGUF metadata without its head size, keeping Qwen3's default
    of 128: the conversion takes it from ``attention.key_length`` (64 here)."""
    from kiln import LLM, SamplingParams
    from kiln.testing.models import hf_as_gguf, hf_greedy

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    reference = str(tmp_path / "reference")
    gguf = hf_as_gguf(tiny_model_dir("qwen3"), str(tmp_path / "model.gguf"), "qwen3", "Q8_0", reference=reference)
    llm = LLM(gguf, max_model_len=128, quantization="none", dtype="float32")  # the exact products of the file's values
    assert llm.engine.executor.runner.model.layers[0].self_attn.head_dim == 64
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42, 100, 7]]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=12, min_tokens=12, temperature=0)
    )
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(reference, prompts, 12)
