"""Split GGUF models (``kiln.models.gguf_split``): llama.cpp's ``<name>-00001-of-0000N.gguf``
files, named by the first, convert to what the same model in one file converts to, and serve
it; a later part, a missing part or a renamed first part is a clear error."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from kiln.models.gguf_cache import INDEX, convert_gguf
from kiln.models.gguf_split import SplitModelError, model_files
from kiln.models.loader import iter_weights
from kiln.testing.models import hf_as_gguf, hf_greedy

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42, 100, 7]]


def _folder(folder: str) -> tuple[dict, dict]:
    config = json.loads(open(os.path.join(folder, "config.json")).read())
    return config, dict(iter_weights(folder))


@pytest.mark.parametrize(("model_type", "arch"), [("llama", "llama"), ("qwen3_moe", "qwen3moe")])
def test_a_split_model_converts_as_the_whole_file_does(tiny_model_dir, tmp_path, model_type, arch):
    source = tiny_model_dir(model_type)
    for folder in ("whole", "split"):
        (tmp_path / folder).mkdir()
    whole = hf_as_gguf(source, str(tmp_path / "whole" / "model.gguf"), arch, "Q8_0")
    first = hf_as_gguf(source, str(tmp_path / "split" / "model.gguf"), arch, "Q8_0", split_max_tensors=5)
    files = model_files(first)
    assert os.path.basename(first) == f"model-00001-of-{len(files):05d}.gguf" and len(files) >= 3
    cache = tmp_path / "cache"
    split_folder = convert_gguf(first, cache)
    assert os.path.basename(split_folder).startswith("model-")  # named for the model, not its first part
    (want_config, want), (got_config, got) = _folder(convert_gguf(whole, cache)), _folder(split_folder)
    assert got_config == want_config
    assert got.keys() == want.keys()
    assert all(got[n].equal(want[n]) for n in want)
    entry = json.loads((cache / INDEX).read_text())[os.path.realpath(first)]
    assert entry["size"] == [os.path.getsize(f) for f in files]  # every part's, so a changed part is seen


def test_a_split_model_serves_the_values_it_holds(tiny_model_dir, tmp_path, monkeypatch):
    from kiln import LLM, SamplingParams

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    reference = str(tmp_path / "reference")
    first = hf_as_gguf(tiny_model_dir("llama"), str(tmp_path / "model.gguf"), "llama", "Q8_0",
                       reference=reference, split_max_tensors=4)  # fmt: skip
    llm = LLM(first, max_model_len=256, quantization="none", dtype="float32")  # the exact products of the file's values
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(reference, PROMPTS, 12)


@pytest.fixture
def split_model(tiny_model_dir, tmp_path) -> list[str]:
    return model_files(hf_as_gguf(tiny_model_dir("llama"), str(tmp_path / "model.gguf"), "llama", split_max_tensors=8))


def test_a_later_part_names_the_first(split_model, tmp_path):
    with pytest.raises(SplitModelError, match=f"part 2 of {len(split_model)}.*pass its first file, .*model-00001-of"):
        convert_gguf(split_model[1], tmp_path / "cache")


def test_a_missing_part_is_named(split_model, tmp_path):
    os.unlink(split_model[-1])
    with pytest.raises(SplitModelError, match=f"1 of them are missing: {split_model[-1]}"):
        convert_gguf(split_model[0], tmp_path / "cache")


def test_a_damaged_part_is_named(split_model, tmp_path):
    with open(split_model[-1], "r+b") as f:
        f.truncate(os.path.getsize(split_model[-1]) // 2)  # an interrupted download of one part
    with pytest.raises(SplitModelError, match=f"{split_model[-1]}, part {len(split_model)} of .*is the file complete"):
        convert_gguf(split_model[0], tmp_path / "cache")


def test_a_count_of_no_parts_is_refused(tmp_path):
    path = tmp_path / "model-00001-of-00000.gguf"
    path.write_bytes(b"")
    with pytest.raises(SplitModelError, match="1 <= part <= count"):
        convert_gguf(str(path), tmp_path / "cache")


def test_a_renamed_first_part_says_how_its_parts_are_named(split_model, tmp_path):
    renamed = str(tmp_path / "renamed.gguf")
    shutil.copy(split_model[0], renamed)
    with pytest.raises(SplitModelError, match=f"split into {len(split_model)} files; they must lie beside it"):
        convert_gguf(renamed, tmp_path / "cache")


def test_parts_of_another_model_are_refused(split_model, tiny_model_dir, tmp_path):
    """A part swapped for another split's (the same names, other content) is not read as this model's."""
    (tmp_path / "other").mkdir()
    other = hf_as_gguf(tiny_model_dir("llama"), str(tmp_path / "other" / "model.gguf"), "llama", split_max_tensors=4)
    shutil.copy(model_files(other)[1], split_model[1])  # a part 2 of more parts than this model has
    with pytest.raises(SplitModelError, match="is not part 2 of"):
        convert_gguf(split_model[0], tmp_path / "cache")
