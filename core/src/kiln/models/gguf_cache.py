"""GGUF files as the Hugging Face folders Kiln reads: config, generation config and tokenizer
converted once and cached, and ``RECIPE`` in place of weights. The recipe names each weight as
transformers' GGUF loading does and says which tensor of the file it comes from;
``read_recipe`` widens them to fp32 one at a time at each start and reorders them as
transformers does, so the values are transformers' own conversion, bit for bit, the whole
model in floats is never in memory, and the folder holds no copy of the weights. (Until
2026-11-30 the folder held them in fp32, about four times the file: 28 GB for a 7B Q4_K_M.)
Mixtures of experts (llama.cpp's Mixtral, Qwen2-MoE, Qwen3-MoE) are listed one expert at a
time, with the config transformers' GGUF reading leaves incomplete for them; DeepSeek's
``deepseek2``, which transformers does not read, through ``gguf_deepseek``; the tokenizer
through ``gguf_tokenizer``, which tokenizes as llama.cpp does. Other architectures, whose
tensors transformers rearranges across tensors, go through its loading of the whole model,
which must then give every weight a tensor of the file, and are written in fp32.

A conversion is named for the file's content (its SHA-256), not for where the file lies: the
same file installed again, or in another environment, finds its folder already there.
Hashing a file of several GB takes seconds, so ``sources.json`` beside the folders remembers
each path's digest under its size and mtime, and a file unchanged since is not read again;
the recipe reads the weights from a remembered path of the folder's content. After a
conversion, the folders of files of the same name that no remembered path maps to any more
(the file's earlier content, or a folder of an older Kiln) are removed. A folder that an older
Kiln's conversion made (``MARKER`` says which made it) is converted again in place.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from kiln.models import gguf_deepseek, gguf_split
from kiln.models.gguf_fields import field as gguf_field
from kiln.models.gguf_tokenizer import gguf_tokenizer
from kiln.models.gguf_widen import widen

logger = logging.getLogger("kiln.loader")

INDEX = "sources.json"  # {real path: {"size", "mtime_ns", "sha256", "files"}}
# In each folder: {"conversion": CONVERSION}. Raised when conversions change, so that folders an
# older Kiln converted are converted again (2: tokenizers tokenize as llama.cpp does; 3: weights
# read from the GGUF file, ``RECIPE``, not written in fp32).
MARKER, CONVERSION = "kiln-conversion.json", 3
RECIPE = "gguf-weights.json"  # in a folder converted tensor by tensor: where each weight is read from
FOLDER_KEY = re.compile(r"[0-9a-f]{16}")  # what follows "<file stem>-" in a folder's name


class UnmappedGGUF(ValueError):
    """A GGUF file whose tensors do not give every weight of the model its config describes, or
    of a type Kiln cannot widen."""


def convert_gguf(gguf_path: str, cache: Path) -> str:
    """The folder under ``cache`` holding ``gguf_path`` as a Hugging Face model (its weights read
    from the file: ``RECIPE``), converted first if no file of the same content has been. A split model
    (``<name>-00001-of-0000N.gguf``) is named by its first file and read whole."""
    gguf_path = os.path.abspath(gguf_path)  # transformers takes a bare file name for a Hub repo's
    files = gguf_split.model_files(gguf_path)
    stem = gguf_split.model_stem(gguf_path)
    target = cache / f"{stem}-{_digest(files, cache)[:16]}"
    if not _current(target):
        _convert(files, target)
        _prune(cache, stem)
    return str(target)


def _current(target: Path) -> bool:
    """Whether ``target`` holds a conversion as this Kiln makes them."""
    try:
        return json.loads((target / MARKER).read_text()).get("conversion") == CONVERSION
    except (OSError, ValueError, AttributeError):
        return False


def _read_index(cache: Path) -> dict[str, dict]:
    """The remembered paths (none where the index is missing or not Kiln's)."""
    try:
        index = json.loads((cache / INDEX).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(index, dict):
        return {}
    return {p: e for p, e in index.items() if isinstance(e, dict) and isinstance(e.get("sha256"), str)}


def _digest(files: list[str], cache: Path) -> str:
    """The SHA-256 (hex) of the files' bytes one after another: remembered in the index under
    the first file while their sizes and mtimes hold (one of each for a file alone, lists for
    a split model's files)."""
    real, (size, mtime) = os.path.realpath(files[0]), _stamp(files)
    index = _read_index(cache)
    known = index.get(real)
    if known is not None and (known.get("size"), known.get("mtime_ns")) == (size, mtime):
        return known["sha256"]
    logger.info("hashing %s (%.2f GB) to find its converted folder", files[0], sum(map(os.path.getsize, files)) / 1e9)
    sha = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                sha.update(chunk)
    # Remembered before the folder exists, so that a concurrent prune keeps it.
    index = {p: e for p, e in index.items() if os.path.exists(p)}
    index[real] = {"size": size, "mtime_ns": mtime, "sha256": sha.hexdigest(), "files": files}
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(index, f, indent=1)
    os.replace(tmp, cache / INDEX)  # whole or not at all; of two racing writers, one wins
    return index[real]["sha256"]


def _stamp(files: list[str]) -> tuple:
    """(size, mtime_ns) of a file alone, or lists of them for a split model's files."""
    stats = [os.stat(f) for f in files]
    size, mtime = [s.st_size for s in stats], [s.st_mtime_ns for s in stats]
    return (size[0], mtime[0]) if len(files) == 1 else (size, mtime)


def _prune(cache: Path, stem: str) -> None:
    """Remove the conversions of files named ``stem`` that no existing remembered path maps to."""
    kept = {e["sha256"][:16] for p, e in _read_index(cache).items() if os.path.exists(p)}
    for folder in cache.iterdir():
        key = folder.name.removeprefix(f"{stem}-")
        if key != folder.name and FOLDER_KEY.fullmatch(key) and key not in kept and folder.is_dir():
            logger.info("removing %s: no GGUF file maps to it any more", folder)
            shutil.rmtree(folder, ignore_errors=True)


def _convert(files: list[str], target: Path) -> None:
    gguf_path = files[0]
    logger.info("converting %s to a cached folder at %s (first start only)", gguf_path, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=target.parent)
    try:
        try:
            reader = gguf_split.read_model(files)
            # transformers cannot read a deepseek2 file's config, which AutoTokenizer would read first.
            fast_only = reader.fields["general.architecture"].contents() == gguf_deepseek.ARCH
            with _parsed_once(gguf_path, reader):
                gguf_tokenizer(gguf_path, fast_only=fast_only, reader=reader).save_pretrained(tmp)
                if not _write_by_tensor(gguf_path, tmp, reader):
                    if len(files) > 1:  # transformers reads one file
                        raise gguf_split.SplitModelError(
                            f"model: {gguf_path}: a split GGUF model of this architecture is not read (Kiln "
                            "converts split files tensor by tensor, which this architecture's conversion through "
                            "transformers does not allow); join its files with llama.cpp's `llama-gguf-split --merge`"
                        )
                    _write_whole(gguf_path, tmp)
        except (UnmappedGGUF, gguf_split.SplitModelError):
            raise
        except ImportError as exc:
            raise ValueError(f"model: reading GGUF needs `pip install gguf accelerate` ({exc})") from None
        except ValueError as exc:
            if "is not supported yet" not in str(exc):  # transformers' word for an architecture it cannot read
                raise _damaged(gguf_path, exc) from exc
            raise ValueError(f"model: {gguf_path}: {exc} (Kiln reads GGUF files through transformers)") from exc
        except (KeyError, IndexError, struct.error) as exc:  # what a damaged file raises
            raise _damaged(gguf_path, exc) from exc
        (Path(tmp) / MARKER).write_text(json.dumps({"conversion": CONVERSION}))
        _install(Path(tmp), target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not _current(target):  # else another process's conversion won the race
            raise


@contextlib.contextmanager
def _parsed_once(gguf_path: str, reader) -> Iterator[None]:
    """What transformers would redo during one conversion, done once. It parses the file again for
    each of its config, its tokenizer and its weights (``load_gguf_checkpoint`` opens its own
    ``gguf.GGUFReader``), so a reader asked for this file is the one parsed already, and any other
    (a split model's parts) is a ``FastGGUFReader`` (gguf-py's took ~5 s for the default model's
    49k tokens and merges). Its weight-name mapping builds gguf's name table for every module of
    the model, recursively (~10 s for the default model), so that table is kept per architecture
    and depth."""
    import gguf

    from kiln.models.gguf_reader import FastGGUFReader

    opened, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    path = os.path.realpath(gguf_path)

    def reader_for(p, *args, **kwargs):
        if isinstance(reader, opened) and not args and not kwargs and os.path.realpath(p) == path:
            return reader
        return FastGGUFReader(p, *args, **kwargs)

    gguf.GGUFReader, gguf.get_tensor_name_map = reader_for, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = opened, name_map


def _install(tmp: Path, target: Path) -> None:
    """Move the finished conversion ``tmp`` to ``target``, in place of an older Kiln's conversion
    there; if another process installed a current one first, ``tmp`` is dropped. Under a lock on
    the cache, so that no process removes a folder another has just installed."""
    import fcntl

    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _current(target):
            shutil.rmtree(tmp)
            return
        if target.exists():  # moved aside whole first: a removal that fails partway leaves nothing behind
            stale = Path(tempfile.mkdtemp(dir=target.parent))
            os.replace(target, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, target)


def _write_by_tensor(gguf_path: str, out: str, reader) -> bool:
    """Write the model's folder (but the tokenizer) with ``RECIPE`` in place of weights: each
    weight's name and shape as transformers' GGUF loading gives them, and the tensor of the
    file it is read from (``read_recipe``), so the folder holds no copy of the weights. A
    mixture of experts' stacked expert tensors are listed one expert at a time, under the
    per-expert names of Hugging Face checkpoints. False, having written nothing, for an
    architecture whose tensors transformers rearranges across tensors in other ways, or a file
    it does not map whole: ``_write_whole`` converts those."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        Gemma2TensorProcessor,
        LlamaTensorProcessor,
        Qwen2MoeTensorProcessor,
        TensorProcessor,
        get_gguf_hf_weights_map,
        read_field,
    )

    folder, fname = os.path.split(gguf_path)
    arch = read_field(reader, "general.architecture")[0]
    if arch == gguf_deepseek.ARCH:  # transformers reads neither its config nor two of its tensors
        config = gguf_deepseek.deepseek_config(reader)
    else:
        config = _head_dim(
            _experts_config(AutoConfig.from_pretrained(folder, gguf_file=fname), reader, arch), reader, arch
        )
    per_tensor = TENSOR_PROCESSORS.get(arch, TensorProcessor)
    if per_tensor not in (TensorProcessor, LlamaTensorProcessor, Gemma2TensorProcessor, Qwen2MoeTensorProcessor):
        return False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = get_gguf_hf_weights_map(model, per_tensor(config=config.to_dict()), model_type=arch)  # GGUF -> HF
    shapes = {n: list(p.shape) for n, p in model.state_dict().items()}

    def dims(t) -> list[int]:  # a GGUF tensor's shape as torch lists it
        return [int(d) for d in reversed(t.shape.tolist())]

    # (name, shape as the model holds it, source): the tensors transformers reads, experts one
    # by one (an expert as GGUF lists its dimensions, less the stack's).
    parts = []
    for t in reader.tensors:
        if m := STACKED_EXPERTS.fullmatch(t.name):
            parts += [(expert_weight_name(m["layer"], e, m["proj"]), dims(t)[1:], {"tensor": t.name, "expert": e})
                      for e in range(int(t.shape[-1]))]  # fmt: skip
        elif m := ONE_EXPERT.fullmatch(t.name):
            parts.append((expert_weight_name(m["layer"], m["expert"], m["proj"]), dims(t), {"tensor": t.name}))
        elif t.name in names:  # transformers skips the others too
            parts.append((names[t.name], shapes[names[t.name]], {"tensor": t.name, "processed": True}))
            if math.prod(dims(t)) != math.prod(parts[-1][1]):
                raise ValueError(f"model: GGUF tensor {t.name} has shape {dims(t)}, not {parts[-1][1]}")
    if arch == gguf_deepseek.ARCH:
        parts += gguf_deepseek.deepseek_parts(reader)
    expected = {n for n in shapes if not FUSED_EXPERTS.search(n)}
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    for layer in {int(m[1]) for n in shapes if (m := FUSED_EXPERTS.search(n))}:
        expected |= {expert_weight_name(layer, e, p) for e in range(experts) for p in ("gate", "up", "down")}
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if missing := expected - tied - {name for name, _, _ in parts}:
        if experts or arch == gguf_deepseek.ARCH:  # transformers' whole-model loading would not map these either
            raise UnmappedGGUF(_unmapped(gguf_path, missing))
        return False
    for t in {t.tensor_type: t for t in reader.tensors}.values():  # a row of each type, widened as loads will
        try:
            widen(t.data.reshape(-1, t.data.shape[-1])[:1], t.tensor_type)
        except NotImplementedError as exc:
            raise UnmappedGGUF(f"model: {gguf_path}: {t.name} is of a GGUF type Kiln cannot widen: {exc}") from None
    processor = {"name": per_tensor.__name__, "config": json.loads(config.to_json_string(use_diff=False))}
    with open(os.path.join(out, RECIPE), "w") as f:
        json.dump({"processor": processor, "parts": parts}, f)
    config.architectures = [type(model).__name__]
    setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", torch.float32)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    return True


def read_recipe(recipe: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, fp32 tensor) of each weight a folder's ``RECIPE`` lists, one at a time, widened from
    the GGUF file the folder was converted from (found through the cache's index) and reordered
    as transformers' GGUF loading does: its conversion bit for bit."""
    import numpy as np
    from transformers import modeling_gguf_pytorch_utils

    folder = Path(recipe).parent
    with open(recipe) as f:
        spec = json.load(f)
    reader = gguf_split.read_model(_source_files(folder), tensors_only=True)
    tensors = {t.name: t for t in reader.tensors}
    processor = getattr(modeling_gguf_pytorch_utils, spec["processor"]["name"])(config=spec["processor"]["config"])

    def values(name: str, expert: int | None = None) -> np.ndarray:
        t = tensors[name]
        return widen(t.data if expert is None else t.data[expert], t.tensor_type)

    for name, shape, source in spec["parts"]:
        if "kv_b" in source:
            out = gguf_deepseek.kv_b_values(*map(values, source["kv_b"]), source["heads"], source["latent"])
        elif source.get("processed"):
            out = processor.process(
                weights=values(source["tensor"]), name=source["tensor"], tensor_key_mapping={}, parsed_parameters={}
            ).weights
        else:
            out = values(source["tensor"], source.get("expert"))
        if [d for d in out.shape if d != 1] != [d for d in shape if d != 1]:  # (1, n) and (n,) are alike
            raise ValueError(f"model: GGUF tensor for {name} came out {out.shape}, not {shape}")
        out = np.ascontiguousarray(out, dtype=np.float32)
        out = torch.from_numpy(out if out.flags.writeable else out.copy())  # not a view of the file's mapping
        reader.release_pages()
        yield name, out.reshape(shape)


def _source_files(folder: Path) -> list[str]:
    """The GGUF files ``folder`` was converted from: a path the cache's index remembers for the
    folder's content, still there unchanged."""
    key, remembered = folder.name.rsplit("-", 1)[-1], []
    for path, entry in _read_index(folder.parent).items():
        if entry["sha256"][:16] != key:
            continue
        remembered.append(path)
        try:
            files = entry.get("files") or gguf_split.model_files(path)  # as named: a Hub cache links to blobs
            if (entry.get("size"), entry.get("mtime_ns")) == _stamp(files):
                return files
        except (OSError, ValueError):  # gone, or no longer a whole split model
            continue
    raise ValueError(
        f"model: {folder} reads its weights from the GGUF file it was converted from, which is gone or changed "
        f"(remembered: {remembered or 'none'}); pass the .gguf file as the model"
    )


# llama.cpp's expert tensors: each layer's experts stacked per projection (the outermost
# dimension), or, in older Mixtral files, one tensor per expert.
STACKED_EXPERTS = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<proj>gate|up|down)_exps\.weight")
ONE_EXPERT = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<proj>gate|up|down)\.(?P<expert>\d+)\.weight")
# transformers' stacked experts parameters, which its GGUF loading fills from those.
FUSED_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def expert_weight_name(layer: int | str, expert: int | str, proj: str) -> str:
    """An expert's projection (``gate``, ``up``, ``down``) under the per-expert name of Hugging Face
    checkpoints, which Kiln's models read (conversions from other layouts write it)."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"


def _head_dim(config, reader, arch: str):
    """``config`` with the head size the GGUF's metadata gives (``attention.key_length``), which
    transformers maps for some architectures only: for ``qwen3`` it kept Qwen3's default of 128,
    for any other size the k/q norms' tensors did not fit."""
    key, value = (gguf_field(reader, f"{arch}.attention.{k}_length") for k in ("key", "value"))
    if key and value in (None, key) and getattr(config, "head_dim", key) != key:
        config.head_dim = key
    return config


def _experts_config(config, reader, arch: str):
    """``config`` (transformers' reading of the GGUF's metadata) with what it leaves out of a
    mixture of experts: llama.cpp writes Mixtral as ``llama`` with an expert count, which
    transformers reads as a dense Llama, and the Qwen MoEs' expert sizes are not mapped (the
    defaults of their configs were taken instead): taken from the metadata, else, as llama.cpp
    does without it, from the tensors."""

    def field(key: str, default=None):
        return gguf_field(reader, f"{arch}.{key}", default)

    def rows(tensor: str) -> int | None:  # the output features of a layer's tensor ``blk.N.<tensor>``
        t = next((t for t in reader.tensors if t.name.endswith(f".{tensor}.weight")), None)
        return None if t is None else int(t.shape[1])

    experts = field("expert_count", 0)
    if not experts:
        return config
    if field("expert_used_count") is None:
        raise UnmappedGGUF(f"model: the GGUF file has {experts} experts but no {arch}.expert_used_count")
    if arch == "llama":
        from transformers import MixtralConfig

        keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
                "rope_theta", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")  # fmt: skip
        dense = config.to_dict()
        config = MixtralConfig(**{k: dense[k] for k in keep if dense.get(k) is not None}, sliding_window=None)
        config.num_local_experts, config.num_experts_per_tok = experts, field("expert_used_count")
    elif arch in ("qwen2moe", "qwen3moe"):
        if size := field("expert_feed_forward_length") or rows("ffn_gate_exps"):
            config.moe_intermediate_size = size
        if size := field("expert_shared_feed_forward_length") or rows("ffn_gate_shexp"):
            config.shared_expert_intermediate_size = size
    return config


def _damaged(gguf_path: str, exc: Exception) -> ValueError:
    return ValueError(f"model: {gguf_path} could not be converted from GGUF (is the file complete?): {exc}")


def _unmapped(gguf_path: str, missing) -> str:
    return f"model: {gguf_path} has no tensor for {len(missing)} of the model's weights, e.g. {sorted(missing)[:6]}"


def _write_whole(gguf_path: str, out: str) -> None:
    """The model's fp32 folder (but the tokenizer) through transformers' own loading of the
    whole file: every weight in fp32 in memory at once."""
    from transformers import AutoModelForCausalLM

    folder, fname = os.path.split(gguf_path)
    model, info = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=fname, dtype=torch.float32, output_loading_info=True
    )
    if info["missing_keys"]:  # transformers would fill them with random values
        raise UnmappedGGUF(_unmapped(gguf_path, info["missing_keys"]))
    # transformers refuses to save a model it loaded from GGUF; the weights are plain fp32 now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(out)
    model.generation_config.save_pretrained(out)
