"""``kiln convert-eagle``: an EAGLE-1 head as its authors publish it made whole, in the layout
vLLM 0.6 reads (seed 001's ``convert_eagle_ckpt_to_vllm_compatible.py``, same flags).

A published head (SafeAILab's layout) is a one-layer ``LlamaForCausalLM`` config and a weight
file of ``fc.*`` and ``layers.0.*``, often with the embeddings, never with the LM head: the
engine takes that from the target. The converted folder holds an ``EAGLEModel`` config (the
head's own config as ``model``, ``model_type`` ``eagle``) and one safetensors file of ``fc.*``,
``model.*`` and the base model's ``lm_head.weight``. Kiln serves both layouts
(``kiln.models.eagle.read_eagle_config`` reads the second).
"""

from __future__ import annotations

import argparse
import json
import sys
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
        help="the base model's weight file holding lm_head.weight (default: found through the index, else searched)",
    )
    parser.add_argument(
        "--draft-weight-name", default=None, help="the head's weight file (default: all of --draft-path's)"
    )
    parser.add_argument(
        "--output-path", "-o", default=None, help="where to write the converted head (default: DRAFT-vllm)"
    )


def cmd_convert_eagle(ns: argparse.Namespace) -> int:
    try:
        out = convert(ns.base_path, ns.draft_path, ns.base_weight_name, ns.draft_weight_name, ns.output_path)
    except (OSError, ValueError) as exc:
        print(f"kiln convert-eagle: error: {exc}", file=sys.stderr)
        return 2
    print(f"converted EAGLE head written to {out}")
    return 0


def convert(base: str, draft: str, base_file: str | None, draft_file: str | None, output: str | None) -> str:
    """Write the converted head (see the module docstring) into a new or empty folder; returns it."""
    from safetensors.torch import save_file

    from kiln.models.loader import read_weight_file, weight_files

    base_dir, draft_dir = _local_folder(base, "--base-path"), _local_folder(draft, "--draft-path")
    config = json.loads((draft_dir / "config.json").read_text())
    if config.get("model_type") == "eagle":
        raise ValueError(f"{draft} is converted already (model_type eagle)")
    out = Path(output) if output else draft_dir.parent / f"{draft_dir.name}-vllm"
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not empty; give a new folder (--output-path)")
    files = [str(draft_dir / draft_file)] if draft_file else weight_files(str(draft_dir))[1]
    tensors = {}
    for file in files:
        for name, tensor in read_weight_file(file):
            name = name.removeprefix("model.")
            if not name.startswith("lm_head."):  # replaced by the base model's
                tensors[name if name.startswith("fc.") else f"model.{name}"] = tensor.contiguous()
    if "fc.weight" not in tensors:
        raise ValueError(f"{draft} holds no fc.weight: not an EAGLE-1 head")
    tensors["lm_head.weight"] = _base_lm_head(base_dir, base_file).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors")
    converted = {"architectures": ["EAGLEModel"], "model_type": "eagle", "model": config}
    converted["eagle_fc_bias"] = "fc.bias" in tensors  # vLLM builds fc with a bias only when told
    (out / "config.json").write_text(json.dumps(converted, indent=2))
    return str(out)


def _local_folder(path: str, flag: str) -> Path:
    folder = Path(path).resolve()
    if not (folder / "config.json").is_file():
        raise ValueError(f"{flag} {path}: not a local model folder (no config.json there)")
    return folder


def _base_lm_head(folder: Path, name: str | None) -> torch.Tensor:
    """The base model's ``lm_head.weight``, or its embeddings when it has no LM head of its own
    (tied); read from ``name``, else from the file the index names, else from each weight file."""
    from kiln.models.loader import WEIGHT_FORMATS, read_weight_file, weight_files

    wanted = ("lm_head.weight", "model.embed_tokens.weight")
    if name is not None:
        files = [str(folder / name)]
    else:
        fmt, files = weight_files(str(folder))
        index = folder / WEIGHT_FORMATS[fmt][0]
        if index.is_file():  # read only the shard that holds it
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            named = [weight_map[key] for key in wanted if key in weight_map]
            files = [str(folder / named[0])] if named else files
    found = {}
    for file in files:
        for key, tensor in read_weight_file(file):
            if key in wanted:
                found[key] = tensor
        if wanted[0] in found:
            return found[wanted[0]]
    if wanted[1] in found:
        return found[wanted[1]]
    where = name or "its weight files"
    raise ValueError(f"{folder}: {where} hold neither lm_head.weight nor model.embed_tokens.weight")
