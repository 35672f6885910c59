"""Weight formats a model folder may hold: one or several ``*.safetensors`` files with their index,
PyTorch ``*.bin`` files (``--load-format pt``, read with ``weights_only``), sharded or not. Each
gives the same tokens; a missing shard, a folder without weights and a pickle that is not a
state dict are start-up errors that say what is wrong."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": list(range(100, 130))}]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def source(tiny_model_dir):
    path = tiny_model_dir("llama")
    return path, [o.outputs[0].token_ids for o in LLM(path, dtype="float32").generate(PROMPTS, GREEDY)]


def without_weights(source_dir: str, target) -> dict[str, torch.Tensor]:
    """Copy the folder but its weights into ``target``; return the weights."""
    shutil.copytree(source_dir, target, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    state = {}
    for file in sorted(os.listdir(source_dir)):
        if file.endswith(".safetensors"):
            state.update(load_file(os.path.join(source_dir, file)))
    return state


# Per format: the file stem and extension, and the index file naming the shards.
LAYOUT = {
    "safetensors": ("model", ".safetensors", "model.safetensors.index.json"),
    "pt": ("pytorch_model", ".bin", "pytorch_model.bin.index.json"),
}


def write_shards(target, state: dict, fmt: str, num_shards: int) -> None:
    """``state`` in ``num_shards`` files of format ``fmt`` with Hugging Face's names and index."""
    stem, ext, index_name = LAYOUT[fmt]
    names = sorted(state)
    weight_map = {}
    for i in range(num_shards):
        part = {n: state[n].contiguous() for n in names[i::num_shards]}
        file = f"{stem}-{i + 1:05d}-of-{num_shards:05d}{ext}" if num_shards > 1 else f"{stem}{ext}"
        if fmt == "safetensors":
            save_file(part, str(target / file))
        else:
            torch.save(part, target / file)
        weight_map.update(dict.fromkeys(part, file))
    if num_shards > 1:
        (target / index_name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def tokens(path: str, **engine_args) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in LLM(path, dtype="float32", **engine_args).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("fmt,num_shards", [("safetensors", 3), ("pt", 1), ("pt", 3)])
def test_every_format_gives_the_same_tokens(source, tmp_path, capfd, fmt, num_shards):
    path, expected = source
    target = tmp_path / "model"
    write_shards(target, without_weights(path, target), fmt, num_shards)
    if fmt == "pt":
        torch.save({"not": "weights"}, target / "training_args.bin")  # a training leftover is skipped
    assert tokens(str(target)) == expected  # auto finds them
    # Several shards show a progress bar over them; one file none.
    assert (f"Loading {fmt} shards" in capfd.readouterr().err) == (num_shards > 1)
    assert tokens(str(target), load_format=fmt) == expected


def test_a_missing_shard_is_named(source, tmp_path):
    target = tmp_path / "model"
    write_shards(target, without_weights(source[0], target), "safetensors", 3)
    os.remove(target / "model-00002-of-00003.safetensors")
    with pytest.raises(ValueError, match="'model-00002-of-00003.safetensors', a shard model.safetensors.index.json"):
        LLM(str(target))


def test_a_folder_without_weights_says_what_was_looked_for(source, tmp_path):
    target = tmp_path / "model"
    without_weights(source[0], target)
    with pytest.raises(ValueError, match=r"no \*.safetensors or \*.bin weights .* --load-format dummy"):
        LLM(str(target))
    write_shards(target, without_weights(source[0], tmp_path / "other"), "pt", 1)
    with pytest.raises(ValueError, match=r"no \*.safetensors weights"):
        LLM(str(target), load_format="safetensors")


class NotATensor:
    pass


def test_bin_files_load_with_weights_only(source, tmp_path):
    target = tmp_path / "model"
    state = without_weights(source[0], target)
    torch.save({**state, "extra": NotATensor()}, target / "pytorch_model.bin")
    with pytest.raises(ValueError, match="is not a plain PyTorch state dict \\(loaded with weights_only\\)"):
        LLM(str(target), dtype="float32")


def test_legacy_bin_files_load_too(source, tmp_path):
    """Files saved before PyTorch's zip format cannot be memory-mapped: read whole."""
    path, expected = source
    target = tmp_path / "model"
    state = without_weights(path, target)
    torch.save(state, target / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    assert tokens(str(target)) == expected


def test_gguf_with_its_load_format(default_model_dir, source, tmp_path):
    from kiln.models.loader import default_model_path

    llm = LLM(default_model_path(), load_format="gguf", max_model_len=128)
    assert llm.generate("Hi", SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="--load-format gguf: reads a .gguf file, not the folder"):
        LLM(source[0], load_format="gguf")
    with pytest.raises(ValueError, match="--load-format safetensors: .* is a GGUF file .use auto or gguf"):
        LLM(default_model_path(), load_format="safetensors")


def test_an_index_may_not_name_files_outside_the_folder(source, tmp_path):
    target = tmp_path / "model"
    write_shards(target, without_weights(source[0], target), "safetensors", 2)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../elsewhere.safetensors"
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="names a shard outside"):
        LLM(str(target))
