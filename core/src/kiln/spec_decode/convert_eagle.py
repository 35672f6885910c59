"""``kiln convert-eagle``: an EAGLE-1 head as its authors publish it made whole, in the layout
vLLM 0.6 reads (seed 001's ``convert_eagle_ckpt_to_vllm_compatible.py``, same flags).

A published head (SafeAILab's layout) is a one-layer ``LlamaForCausalLM`` config and a weight
file of ``fc.*`` and ``layers.0.*``, often with the embeddings, never with the LM head: the
engine takes that from the target. The converted folder holds an ``EAGLEModel`` config (the
head's own config as ``model``, ``model_type`` ``eagle``) and one safetensors file of ``fc.*``,
``model.*`` and the base model's ``lm_head.weight``. Kiln serves both layouts
(``read_eagle_config`` reads the second).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command line parses without importing torch
    import torch

HELP = (
    "Make an EAGLE-1 head in its authors' layout whole, in the layout vLLM 0.6 reads: an EAGLEModel config and "
    "one safetensors file with the base model's LM head. Kiln serves either; the flags are those of seed 001's "
    "convert_eagle_ckpt_to_vllm_compatible.py."
)


def add_convert_eagle_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-path", required=True, help="the target (base) model's folder")
    parser.add_argument("--draft-path", required=True, help="the EAGLE head's folder, as its authors publish it")
    parser.add_argument(
        "--base-weight-name",
        default=None,
        help="the base model's weight file holding lm_head.weight (default: found through the index, or the only file)",
    )
    parser.add_argument(
        "--draft-weight-name", default=None, help="the head's weight file (default: the only one in --draft-path)"
    )
    parser.add_argument(
        "--output-path", "-o", default=None, help="where to write the converted head (default: DRAFT-vllm)"
    )


def cmd_convert_eagle(ns: argparse.Namespace) -> int:
    try:
        out = convert(ns.base_path, ns.draft_path, ns.base_weight_name, ns.draft_weight_name, ns.output_path)
    except (OSError, ValueError) as exc:
        print(f"kiln convert-eagle: {exc}")
        return 2
    print(f"converted EAGLE head written to {out}")
    return 0


def convert(base: str, draft: str, base_file: str | None, draft_file: str | None, output: str | None) -> str:
    """Write the converted head (see the module docstring); returns its folder."""
    from kiln.models.loader import read_weight_file

    base_dir, draft_dir = Path(base), Path(draft)
    config = json.loads((draft_dir / "config.json").read_text())
    if config.get("model_type") == "eagle":
        raise ValueError(f"{draft} is converted already (model_type eagle)")
    tensors = {}
    for name, tensor in read_weight_file(str(draft_dir / (draft_file or _only_weight_file(draft_dir)))):
        name = name.removeprefix("model.")
        if name.startswith("lm_head."):
            continue  # replaced by the base model's
        tensors[name if name.startswith("fc.") else f"model.{name}"] = tensor.contiguous()
    if not any(name.startswith("fc.") for name in tensors):
        raise ValueError(f"{draft} holds no fc.* tensors: not an EAGLE-1 head")
    tensors["lm_head.weight"] = _base_lm_head(base_dir, base_file).contiguous()
    out = Path(output or f"{str(draft_dir).rstrip('/')}-vllm")
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text(
        json.dumps({"architectures": ["EAGLEModel"], "model_type": "eagle", "model": config}, indent=2)
    )
    return str(out)


def read_eagle_config(path: str):
    """The head's own config of a folder in the converted layout (None for any other folder)."""
    file = Path(path) / "config.json"
    raw = json.loads(file.read_text()) if file.is_file() else {}
    if raw.get("model_type") != "eagle":
        return None
    from transformers import AutoConfig

    inner = dict(raw.get("model") or {})
    truncated = raw.get("truncated_vocab_size")
    if truncated is not None and truncated != inner.get("vocab_size"):
        raise ValueError(
            f"--speculative-config: {path} truncates the head's vocabulary to {truncated} tokens, "
            "which Kiln does not run (its drafts use the target's whole LM head)"
        )
    return AutoConfig.for_model(**inner)


def _only_weight_file(folder: Path) -> str:
    files = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".safetensors"))
    if len(files) != 1:
        raise ValueError(f"{folder} holds {len(files)} weight files ({', '.join(files)}); name one")
    return files[0]


def _base_lm_head(folder: Path, name: str | None) -> torch.Tensor:
    """The base model's ``lm_head.weight`` (its embeddings when they are tied)."""
    from kiln.models.loader import read_weight_file

    config = json.loads((folder / "config.json").read_text())
    wanted = "model.embed_tokens.weight" if config.get("tie_word_embeddings") else "lm_head.weight"
    if name is None:
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            if (folder / index).is_file():
                name = json.loads((folder / index).read_text())["weight_map"].get(wanted)
                break
        name = name or _only_weight_file(folder)
    for key, tensor in read_weight_file(str(folder / name)):
        if key == wanted:
            return tensor
    raise ValueError(f"{folder / name} has no {wanted}; give the file that does (--base-weight-name)")
