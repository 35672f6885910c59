"""A Hugging Face Hub repo id as the model, resolved through ``huggingface_hub`` against a local
cache laid out as the Hub lays it out (this machine reaches no Hub): revisions, the tokenizer's
own revision, and offline errors that say what was looked for."""

from __future__ import annotations

import fnmatch
import json
import shutil

import pytest
from transformers import AutoTokenizer

from kiln import LLM, SamplingParams
from kiln.config import EngineConfig

REPO = "kiln-test/tiny-llama"
MAIN, V1 = "a" * 40, "b" * 40  # commit hashes of two snapshots
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": list(range(100, 130))}]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_model_dir):
    """A cache holding REPO at "main" (the tiny llama) and at tag "v1" (another seed's weights)."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / f"models--{REPO.replace('/', '--')}"
    for commit, model in ((MAIN, tiny_model_dir("llama")), (V1, tiny_model_dir("llama", seed=1))):
        shutil.copytree(model, repo / "snapshots" / commit)
    v1_tokenizer = AutoTokenizer.from_pretrained(repo / "snapshots" / V1)
    v1_tokenizer.add_tokens(["<only-in-v1>"])  # so a test can tell which revision's tokenizer loaded
    v1_tokenizer.save_pretrained(repo / "snapshots" / V1)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v1").write_text(V1)
    return str(cache)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_repo_id_serves_its_cached_snapshot(hub, tiny_model_dir):
    llm = LLM(REPO, download_dir=hub, dtype="float32")
    assert llm.engine.model_info.name == REPO  # the served model name
    assert llm.engine.model_info.path.endswith(MAIN)
    assert tokens(llm) == tokens(LLM(tiny_model_dir("llama"), dtype="float32"))


def test_revision_picks_the_snapshot(hub, tiny_model_dir):
    llm = LLM(REPO, revision="v1", download_dir=hub, dtype="float32")
    assert llm.engine.model_info.path.endswith(V1)
    assert tokens(llm) == tokens(LLM(tiny_model_dir("llama", seed=1), dtype="float32"))
    assert tokens(llm) != tokens(LLM(REPO, download_dir=hub, dtype="float32"))


def test_offline_errors_say_what_was_looked_for(hub):
    with pytest.raises(
        ValueError, match=r"'kiln-test/tiny-llama' .* no snapshot of it at revision 'v9'.*HF_HUB_OFFLINE"
    ):
        LLM(REPO, revision="v9", download_dir=hub)
    with pytest.raises(ValueError, match=rf"model: 'nobody/nothing' .* cache '{hub}' has no snapshot"):
        LLM("nobody/nothing", download_dir=hub)
    with pytest.raises(ValueError, match=r"--tokenizer: 'nobody/tok' .* no snapshot"):
        LLM(REPO, tokenizer="nobody/tok", download_dir=hub)


def test_tokenizer_revision_and_code_revision(hub, tiny_model_dir):
    llm = LLM(REPO, tokenizer_revision="v1", download_dir=hub, dtype="float32")  # the model's repo at v1
    assert llm.engine.model_info.path.endswith(MAIN)
    assert "<only-in-v1>" in llm.get_tokenizer().get_vocab()
    assert "<only-in-v1>" not in LLM(REPO, download_dir=hub).get_tokenizer().get_vocab()
    with pytest.raises(ValueError, match="--tokenizer-revision: applies to a Hub repo id, not the local"):
        LLM(tiny_model_dir("llama"), tokenizer_revision="v1")
    with pytest.raises(ValueError, match="--code-revision: remote code runs from the model's --revision snapshot"):
        EngineConfig.create(model=REPO, revision="v1", code_revision="main")
    EngineConfig.create(model=REPO, revision="v1", code_revision="v1")  # the same one: fine


@pytest.fixture(scope="module")
def modelscope_cache(tmp_path_factory, tiny_model_dir):
    """A cache laid out as ModelScope's client lays it out: REPO at "master" and at "v1"."""
    cache = tmp_path_factory.mktemp("modelscope")
    repo = cache / "models" / REPO.replace("/", "--")
    shutil.copytree(tiny_model_dir("llama"), repo / "snapshots" / "master")
    shutil.copytree(tiny_model_dir("llama", seed=1), repo / "snapshots" / "v1")
    return str(cache)


def test_modelscope_serves_its_cached_snapshot(monkeypatch, modelscope_cache, tiny_model_dir):
    """KILN_USE_MODELSCOPE=true: repo ids resolve through ModelScope's client and cache instead."""
    monkeypatch.setenv("KILN_USE_MODELSCOPE", "true")
    monkeypatch.setenv("MODELSCOPE_CACHE", modelscope_cache)
    llm = LLM(REPO, dtype="float32")
    assert llm.engine.model_info.path.endswith("master")
    assert tokens(llm) == tokens(LLM(tiny_model_dir("llama"), dtype="float32"))
    assert LLM(REPO, revision="v1", download_dir=modelscope_cache).engine.model_info.path.endswith("v1")
    with pytest.raises(
        ValueError, match=r"'kiln-test/tiny-llama' .* ModelScope cache .* revision 'v9'.*HF_HUB_OFFLINE"
    ):
        LLM(REPO, revision="v9")


# A Mistral repo's listing (as Mistral-7B-Instruct-v0.3 lays it out): the weights twice, as
# Hugging Face shards with their index and in Mistral's own consolidated file.
MISTRAL_REPO = [
    "config.json", "generation_config.json", "params.json", "tokenizer.json", "tokenizer.model.v3",
    "tokenizer_config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors", "consolidated.safetensors",
]  # fmt: skip


def test_a_download_fetches_one_copy_of_the_weights(tmp_path, monkeypatch):
    import huggingface_hub

    from kiln.models import loader

    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    shards = {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
    assert loader.hub_weights(MISTRAL_REPO, str(snapshot)) == sorted(shards.values())
    assert loader.hub_weights(MISTRAL_REPO, str(snapshot), "mistral") == ["consolidated.safetensors"]
    no_index = [f for f in MISTRAL_REPO if "index" not in f and not f.startswith("model-")]
    assert loader.hub_weights([*no_index, "model.safetensors"], str(tmp_path)) == ["model.safetensors"]
    assert loader.hub_weights(no_index, str(tmp_path)) == ["consolidated.safetensors"]  # the only copy
    meta = ["config.json", "pytorch_model.bin", "training_args.bin", "original/consolidated.00.pth"]
    assert loader.hub_weights(meta, str(tmp_path)) == ["pytorch_model.bin"]

    # The download itself: the small files first, then the shards the index names, nothing else.
    calls = []

    def snapshot_download(repo_id, revision=None, cache_dir=None, allow_patterns=()):
        calls.append(list(allow_patterns))
        return str(snapshot)

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda self, repo_id, revision=None: MISTRAL_REPO)
    assert loader.hub_snapshot("mistralai/Mistral-7B-Instruct-v0.3", None, None) == str(snapshot)
    small = [f for f in MISTRAL_REPO if not f.endswith(".safetensors")]
    assert calls == [small, [*small, *sorted(shards.values())]]


def test_a_download_skips_the_copies_in_subfolders():
    from kiln.models.loader import hub_small_files

    # Meta's Llama 3 layout: its own params.json and tokenizer under original/, beside the weights.
    listing = [
        "config.json", "tokenizer.json", "original/params.json", "original/tokenizer.model", "LICENSE.txt",
        "additional_chat_templates/tool_use.jinja", "onnx/config.json", "chat[v2].jinja", "model.safetensors",
    ]  # fmt: skip
    wanted = [
        "config.json",
        "tokenizer.json",
        "LICENSE.txt",
        "additional_chat_templates/tool_use.jinja",
        "chat[v2].jinja",
    ]
    # Patterns, as the hub's clients match them: each matches its own file and no other.
    assert [[f for f in listing if fnmatch.fnmatch(f, p)] for p in hub_small_files(listing)] == [[f] for f in wanted]


def test_a_folder_with_both_layouts_loads_the_hugging_face_one(tmp_path, tiny_model_dir):
    from kiln.models.loader import weight_files

    folder = tmp_path / "both"
    shutil.copytree(tiny_model_dir("llama"), folder)
    shutil.copy(folder / "model.safetensors", folder / "consolidated.safetensors")
    assert weight_files(str(folder)) == ("safetensors", [str(folder / "model.safetensors")])
