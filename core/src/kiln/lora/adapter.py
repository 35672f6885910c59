"""Reading a PEFT LoRA adapter and checking it against the base model.

PEFT saves ``adapter_config.json`` and ``adapter_model.safetensors`` (or ``.bin``) with
tensors named ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``
(A: (rank, in)) and ``...lora_B.weight`` (B: (out, rank)); the update is
``scaling * B @ A`` with ``scaling = lora_alpha / rank`` (``lora_alpha / sqrt(rank)``
under rsLoRA), per module after ``rank_pattern`` / ``alpha_pattern``. ``load_adapter``
returns each module's A and B with the scaling folded into B, in float32 on the host.
Everything wrong with an adapter is a ``ValueError`` that names the problem.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

# The projections Kiln applies LoRA to, as PEFT names them (Llama family), and those of
# families that fuse or name them otherwise (Phi-3: qkv_proj and gate_up_proj; GLM-4:
# gate_up_proj; InternLM2: wqkv, wo, w1, w3, w2), which the base model maps as it maps
# their weights (``BaseModelShape.split``).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_TARGETS = ("qkv_proj", "gate_up_proj", "wqkv", "wo", "w1", "w3", "w2")
# PEFT drops the adapter's name ("default") when saving; files saved otherwise keep it.
_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp|attention|feed_forward)\.(\w+)\.lora_(A|B)(?:\.\w+)?\.(weight|bias)$"
)


@dataclass(slots=True)
class ModuleLoRA:
    """One projection's update: ``b @ a`` (+ ``bias``), scaling folded into ``b``."""

    a: torch.Tensor  # (rank, in) float32
    b: torch.Tensor  # (out, rank) float32
    bias: torch.Tensor | None = None  # (out,) float32


@dataclass(slots=True)
class LoRAAdapter:
    name: str
    rank: int  # the largest of its modules'
    modules: dict[tuple[int, str], ModuleLoRA]  # (layer index, projection) -> update

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * 4 for m in self.modules.values() for t in (m.a, m.b, m.bias) if t is not None)


def _as_is(block: str, module: str, leaf: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(module, tensor)]


@dataclass(slots=True)
class BaseModelShape:
    """What an adapter must fit: layer count and each projection's full (in, out) sizes; and
    ``split``: (block, PEFT module, leaf, lora_B weight or bias) -> the projections it updates
    with their rows, as the base model maps its own weights (``LlamaForCausalLM.adapter_rows``)."""

    num_layers: int
    dims: dict[str, tuple[int, int]]
    split: Callable[[str, str, str, torch.Tensor], list[tuple[str, torch.Tensor]]] = _as_is

    @classmethod
    def of(cls, hf_config, model=None) -> BaseModelShape:
        from kiln.models.llama import head_dim_of

        hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
        q = hf_config.num_attention_heads * head_dim_of(hf_config)
        kv = getattr(hf_config, "num_key_value_heads", hf_config.num_attention_heads) * head_dim_of(hf_config)
        dims = {
            "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
        }  # fmt: skip
        targets = getattr(model, "lora_modules", None)
        if targets:  # only the projections the model wraps: an update for another is refused, not dropped
            dims = {p: dims[p] for projections in targets.values() for p in projections}
        return cls(hf_config.num_hidden_layers, dims, getattr(model, "adapter_rows", _as_is))


def _read_config(name: str, path: str) -> dict:
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {name!r}: {path} is not a folder")
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {name!r}: no adapter_config.json in {path}")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {config_path}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: {config_path} is not a JSON object")
    return config


def _check_config(name: str, config: dict, enable_bias: bool) -> None:
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not LoRA")
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "modules_to_save": "adapters that replace whole modules (modules_to_save) are not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D) adapters are not supported",
        "alora_invocation_tokens": "activated LoRA (aLoRA) adapters are not supported",
        "layer_replication": "adapters that replicate layers (layer_replication) are not supported",
        "use_bdlora": "block-diagonal LoRA adapters are not supported",
        "arrow_config": "Arrow routing adapters are not supported",
    }
    for key, reason in refused.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {reason} ({key}={config[key]!r})")
    if config.get("lora_bias") and not enable_bias:
        raise ValueError(f"LoRA adapter {name!r} has biases (lora_bias); start the server with --enable-lora-bias")
    targets = config.get("target_modules")
    if isinstance(targets, list):  # names or paths ("self_attn.q_proj"), matched by their last part
        known = (*TARGETS, *FUSED_TARGETS)
        unknown = sorted(t for t in targets if not isinstance(t, str) or t.rsplit(".", 1)[-1] not in known)
        if unknown:
            raise ValueError(
                f"LoRA adapter {name!r} targets {unknown}, which the model lacks or Kiln cannot adapt; "
                f"supported: {', '.join(TARGETS)}"
            )


def _read_tensors(name: str, path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    pt = os.path.join(path, "adapter_model.bin")
    try:
        if os.path.isfile(st):
            from safetensors.torch import load_file

            return load_file(st)
        if os.path.isfile(pt):
            tensors = torch.load(pt, map_location="cpu", weights_only=True)
            if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
                raise ValueError(f"LoRA adapter {name!r}: {pt} does not hold a dict of tensors")
            return tensors
    except ValueError:
        raise
    except Exception as exc:  # a truncated or corrupt file: the libraries raise various types
        raise ValueError(f"LoRA adapter {name!r}: cannot read its weights: {type(exc).__name__}: {exc}") from None
    raise ValueError(f"LoRA adapter {name!r}: no adapter_model.safetensors (or adapter_model.bin) in {path}")


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's per-module override: a key matches a module name it ends (after a dot)."""
    for key, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        except re.error as exc:
            raise ValueError(f"alpha_pattern key {key!r} is not a valid pattern: {exc}") from None
    return default


def _unadaptable(name: str, what: str, base: BaseModelShape) -> ValueError:
    return ValueError(
        f"LoRA adapter {name!r}: {what} adapts a module the model lacks or Kiln cannot adapt; "
        f"supported: {', '.join(base.dims)} of each layer"
    )


def load_adapter(name: str, path: str, base: BaseModelShape, max_rank: int, enable_bias: bool) -> LoRAAdapter:
    """The adapter at ``path``, checked against ``base`` and ``--max-lora-rank``."""
    config = _read_config(name, path)
    _check_config(name, config, enable_bias)
    tensors = _read_tensors(name, path)
    parts: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(3) not in (*TARGETS, *FUSED_TARGETS):
            raise _unadaptable(name, f"tensor {key!r}", base)
        layer, block, module, ab, leaf = int(match.group(1)), *match.group(2, 3, 4, 5)
        if layer >= base.num_layers:
            raise ValueError(f"LoRA adapter {name!r}: {key!r} is for layer {layer}; the model has {base.num_layers}")
        if leaf == "bias" and ab == "A":
            raise ValueError(f"LoRA adapter {name!r}: {key!r}: lora_A has no bias in PEFT's format")
        if leaf == "bias" and not enable_bias:
            raise ValueError(f"LoRA adapter {name!r} has biases ({key}); start the server with --enable-lora-bias")
        found = parts.setdefault((layer, block, module), {})
        if ab + leaf in found:  # e.g. a vision tower's layers beside the language model's
            raise ValueError(f"LoRA adapter {name!r}: two tensors for layers.{layer}.{module} lora_{ab}.{leaf}")
        found[ab + leaf] = tensor
    if not parts:
        raise ValueError(f"LoRA adapter {name!r}: its weights file holds no LoRA tensors")
    alpha = config.get("lora_alpha", 8)
    patterns = config.get("alpha_pattern") or {}
    numbers = [alpha, *patterns.values()] if isinstance(patterns, dict) else None
    if numbers is None or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
        raise ValueError(f"LoRA adapter {name!r}: lora_alpha and alpha_pattern must hold numbers")
    rslora = bool(config.get("use_rslora"))
    modules, top_rank = {}, 0
    for (layer, block, module), found in sorted(parts.items()):
        where = f"layers.{layer}.{block}.{module}"
        if "Aweight" not in found or "Bweight" not in found:
            raise ValueError(f"LoRA adapter {name!r}: {where} lacks its lora_A or lora_B weight")
        a, b = found["Aweight"].float(), found["Bweight"].float()
        rank = a.shape[0] if a.dim() == 2 else 0
        if rank > max_rank:
            raise ValueError(f"LoRA adapter {name!r} has rank {rank} ({where}), over --max-lora-rank {max_rank}")
        try:
            module_alpha = _pattern_value(patterns, f"model.layers.{layer}.{block}.{module}", alpha)
        except ValueError as exc:
            raise ValueError(f"LoRA adapter {name!r}: {exc}") from None
        scaling = module_alpha / (math.sqrt(rank) if rslora else rank)  # rank_pattern ranks are the tensors'
        bias = found.get("Bbias")
        # A fused projection's update is each part's: A shared, B's rows split (and reordered) as its weight's.
        try:
            rows = base.split(block, module, "weight", b) if b.dim() == 2 else [(module, b)]
            biases = dict(base.split(block, module, "bias", bias.float())) if bias is not None else {}
        except RuntimeError:  # rows that do not split as the base model's weight does
            raise ValueError(
                f"LoRA adapter {name!r}: {where} has lora_B {tuple(b.shape)}: it was trained for another base model"
            ) from None
        for part, b_part in rows:
            inputs, outputs = base.dims.get(part, (None, None))
            if inputs is None:
                raise _unadaptable(name, where, base)
            if rank < 1 or b_part.dim() != 2 or a.shape[1] != inputs or b_part.shape != (outputs, rank):
                raise ValueError(
                    f"LoRA adapter {name!r}: {where} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                    f"expected ({rank}, {inputs}) and ({outputs}, {rank}) for {part}: it was trained for another "
                    f"base model"
                )
            part_bias = biases.get(part)
            if bias is not None and (part_bias is None or tuple(part_bias.shape) != (outputs,)):
                raise ValueError(
                    f"LoRA adapter {name!r}: {where} has a lora_B bias of {tuple(bias.shape)}, expected ({outputs},)"
                )
            part_bias = None if part_bias is None else (part_bias * scaling).contiguous()
            if (layer, part) in modules:
                raise ValueError(f"LoRA adapter {name!r}: two updates for layers.{layer}.{part} ({where} and another)")
            modules[(layer, part)] = ModuleLoRA(a.contiguous(), (b_part * scaling).contiguous(), part_bias)
        top_rank = max(top_rank, rank)
    return LoRAAdapter(name, top_rank, modules)
