"""``kiln quantize``: make a quantized checkpoint (seed 002's tool, its flags spelled as there).

The model runs in fp32 through ``transformers``, one decoder layer at a time over the
calibration samples; each algorithm rewrites the layer and rounds its linear layers,
and the layer's outputs become the next layer's inputs. The result is written to a
temporary folder beside ``-o`` and renamed into place only when complete.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from kiln.interfaces.quantization import widen
from kiln.models.gguf_cache import RECIPE
from kiln.quantization import awq, gptq, rtn, smoothquant
from kiln.quantization.calibration import calibration_samples, read_token_file
from kiln.quantization.checkpoint import checkpoint_tensors
from kiln.quantization.config import from_hf

logger = logging.getLogger("kiln.quantize")

# Architectures whose decoder layers have Llama's module names (those Kiln serves).
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# The same module names, but norms that multiply by (1 + weight) (and, from Gemma 2, sit around each
# sublayer): the tool folds AWQ's and SmoothQuant's scales into Llama-style norms only.
WEIGHT_ONLY_ARCHITECTURES = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}  # -t
CHUNK = 8  # calibration samples per forward pass


def hf_quantization_config(
    quant_type: str, group: int, act_order: bool, sym: bool = True, static_groups: bool = False
) -> dict:
    """The ``quantization_config`` written to config.json, in the format vLLM's and Kiln's loaders read.
    ``desc_act`` says whether g_idx reorders the groups: not with static groups, whatever the
    order the columns were quantized in (kiln_quantize.json records that)."""
    if quant_type in ("smooth_quant", "weight_only_int8"):
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None,
                   "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}, "block_structure": None}  # fmt: skip
        tokens = {**weights, "strategy": "token", "dynamic": True, "observer": None}
        w8a8 = quant_type == "smooth_quant"
        fmt = "int-quantized" if w8a8 else "pack-quantized"
        group_0 = {"targets": ["Linear"], "weights": weights, "input_activations": tokens if w8a8 else None,
                   "output_activations": None, "format": fmt}  # fmt: skip
        return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group_0},
                "ignore": ["lm_head"], "quantization_status": "compressed", "kv_cache_scheme": None,
                "global_compression_ratio": None, "sparsity_config": {}}  # fmt: skip
    if quant_type == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}  # fmt: skip
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order and not static_groups,
            "sym": sym, "damp_percent": gptq.DAMP, "static_groups": static_groups, "true_sequential": True, "checkpoint_format": "gptq"}  # fmt: skip


def check_args(ns: argparse.Namespace, hf_config) -> None:
    """Refuse what cannot work, before any heavy step."""
    out = Path(ns.output)
    if out.exists() and not ns.overwrite:
        raise ValueError(f"-o: {ns.output!r} exists; pass --overwrite to replace it")
    archs = list(getattr(hf_config, "architectures", None) or [])
    gemma = sorted(set(archs) & set(WEIGHT_ONLY_ARCHITECTURES))
    if gemma and ns.quant_type in ("awq", "smooth_quant"):
        raise ValueError(
            f"-quant_type {ns.quant_type}: Kiln folds its scales into the norm before each projection as Llama's "
            f"norms are, not into {gemma[0]}'s (1 + weight) norms; gptq and weight_only_int8 apply"
        )
    if not set(archs) & set(ARCHITECTURES + WEIGHT_ONLY_ARCHITECTURES):
        raise ValueError(
            f"-i: architecture {archs or hf_config.model_type} is not supported; supported: "
            f"{', '.join(ARCHITECTURES)}, and for gptq and weight_only_int8 {', '.join(WEIGHT_ONLY_ARCHITECTURES)}"
        )
    if getattr(hf_config, "quantization_config", None):
        raise ValueError("-i: the model is already quantized")
    if not 0 <= ns.alpha <= 1:
        raise ValueError(f"-sq: {ns.alpha} is outside [0, 1]")
    if ns.tp < 1:
        raise ValueError(f"-tp: {ns.tp} must be at least 1")
    heads, kv_heads = (
        hf_config.num_attention_heads,
        getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
    )
    for what, total in (
        ("attention heads", heads),
        ("key/value heads", kv_heads),
        ("intermediate size", hf_config.intermediate_size),
    ):
        if total % ns.tp:
            raise ValueError(f"-tp: {ns.tp} does not divide the model's {what} ({total})")
    if ns.multi_query_mode and kv_heads == heads:
        raise ValueError("--multi-query-mode: the model has as many key/value heads as attention heads")
    if ns.quant_type in ("awq", "gptq"):
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        for what, inputs in (("hidden size", hf_config.hidden_size), ("attention output", heads * head_dim // ns.tp),
                             ("intermediate size", hf_config.intermediate_size // ns.tp)):  # fmt: skip
            if ns.group_size <= 0 or inputs % ns.group_size:
                fits = max(g for g in (32, 64, 128) if inputs % g == 0) if inputs % 32 == 0 else None
                hint = f"; --group-size {fits} fits" if fits else ""
                raise ValueError(
                    f"--group-size: {ns.group_size} does not divide the {what} per rank ({inputs}) at -tp {ns.tp}{hint}"
                )
    if (ns.act_order or not ns.sym or ns.static_groups) and ns.quant_type != "gptq":
        raise ValueError("--act-order, --static-groups and --no-sym apply to -quant_type gptq only")
    if ns.num_calibration_samples < 1 or ns.seq_len < 1:
        raise ValueError("--num-calibration-samples and --seq-len must be at least 1")


@torch.no_grad()
def first_layer_inputs(model, samples: torch.Tensor) -> tuple[list[torch.Tensor], list[list[dict]]]:
    """The hidden states entering decoder layer 0 (a chunk of samples each), and the keyword
    arguments each decoder layer is called with for each chunk (masks and ropes are per chunk, and
    Gemma 3's differ by layer type), from one pass of the model over the samples in which every
    decoder layer records its call and hands its input on: the masks and ropes come from the
    token ids alone, so computing the layers would be wasted."""
    layers = model.model.layers
    captured: list[torch.Tensor] = []
    kwargs: list[list[dict]] = [[] for _ in layers]

    def record(i):
        def forward(*args, **kw):
            hidden = args[0] if args else kw["hidden_states"]
            if i == 0:
                captured.append(hidden)
            kwargs[i].append({k: v for k, v in kw.items() if k != "hidden_states"})
            return hidden

        return forward

    for i, layer in enumerate(layers):
        layer.forward = record(i)  # an instance attribute over the class's forward, deleted below
    try:
        for chunk in samples.split(CHUNK):
            model.model(chunk, use_cache=False)  # the decoder only: no logits over the vocabulary
    finally:
        for layer in layers:
            del layer.forward
    return captured, kwargs


@torch.no_grad()
def run_layer(layer: nn.Module, hidden: list[torch.Tensor], kwargs: list[dict]) -> list[torch.Tensor]:
    """The layer's outputs for each chunk (``kwargs``: its keyword arguments for each)."""
    outs = []
    for h, kw in zip(hidden, kwargs, strict=True):
        out = layer(h, **kw)
        outs.append(out[0] if isinstance(out, tuple) else out)
    return outs


def _modules(layer: nn.Module) -> dict[str, nn.Module]:
    return {name.split(".")[-1]: layer.get_submodule(name) for name in LINEARS}


class _Seen(Exception):
    """Raised when every linear a collection needs has seen its chunk: the rest of the layer's
    forward would be wasted (GPTQ's first collection stops at q_proj, before attention)."""


@torch.no_grad()
def _collect(layer, hidden, kwargs, linears: list[nn.Linear], reduce) -> list:
    """Per linear: its input rows over all chunks, folded with ``reduce(acc, rows)``."""
    acc: dict[nn.Linear, object] = {}
    seen: set[nn.Linear] = set()

    def before(lin, args):
        acc[lin] = reduce(acc.get(lin), args[0].reshape(-1, args[0].shape[-1]).float())
        seen.add(lin)
        if len(seen) == len(linears):
            raise _Seen

    handles = [lin.register_forward_pre_hook(before) for lin in linears]
    try:
        for h, kw in zip(hidden, kwargs, strict=True):
            seen.clear()
            try:
                layer(h, **kw)
            except _Seen:
                pass
    finally:
        for handle in handles:
            handle.remove()
    return [acc[lin] for lin in linears]


def _absmax(acc, x):
    m = x.abs().amax(0)
    return m if acc is None else torch.maximum(acc, m)


def _rows(acc, x):
    return x if acc is None else torch.cat([acc, x])


@torch.no_grad()
def quantize_layer(ns, layer, hidden, kwargs) -> dict[str, tuple]:
    """Rewrite and round one decoder layer; returns {linear name: (codes, scale, zero, g_idx)}."""
    m = _modules(layer)
    attn_in, mlp_in = layer.input_layernorm, layer.post_attention_layernorm
    qkv, gate_up = [m["q_proj"], m["k_proj"], m["v_proj"]], [m["gate_proj"], m["up_proj"]]
    if ns.quant_type == "smooth_quant":
        amax = _collect(layer, hidden, kwargs, [m["q_proj"], m["gate_proj"], m["down_proj"]], _absmax)
        smoothquant.smooth_layer(
            [(attn_in, qkv, amax[0]), (mlp_in, gate_up, amax[1]), (m["up_proj"], [m["down_proj"]], amax[2])], ns.alpha
        )
    if ns.quant_type == "awq":
        xq, xo, xg, xd = _collect(
            layer, hidden, kwargs, [m["q_proj"], m["o_proj"], m["gate_proj"], m["down_proj"]], _rows
        )
        groups = [(attn_in, qkv, xq)]
        if m["v_proj"].weight.shape == m["o_proj"].weight.shape:  # v's outputs are o's inputs one to one
            groups.append((m["v_proj"], [m["o_proj"]], xo))
        groups += [(mlp_in, gate_up, xg), (m["up_proj"], [m["down_proj"]], xd)]
        awq.scale_and_clip(groups, ns.group_size, no_clip={m["q_proj"], m["k_proj"]})
    names = {lin: name for name, lin in zip(LINEARS, m.values())}
    result = {}
    if ns.quant_type == "gptq":
        for sub in (qkv, [m["o_proj"]], gate_up, [m["down_proj"]]):  # each sees the ones before it quantized
            (hessian,) = _collect(layer, hidden, kwargs, [sub[0]], _hessian)
            # GPTQ treats each output row on its own: the linears sharing these inputs go as one.
            codes, scale, zero, g_idx = gptq.gptq_quantize(
                torch.cat([lin.weight for lin in sub]), hessian, ns.group_size, ns.act_order, ns.sym, ns.static_groups
            )
            rows = [lin.weight.shape[0] for lin in sub]
            zero_parts = zero.split(rows) if zero is not None else [None] * len(sub)
            for lin, *parts in zip(sub, codes.split(rows), scale.split(rows), zero_parts, strict=True):
                # Each its own storage: safetensors refuses to save tensors that share one.
                c, s, z, g = (None if t is None else t.clone() for t in (*parts, g_idx))
                lin.weight.copy_(widen(c, s, z, g))
                result[names[lin]] = (c, s, z, g)
    else:
        for lin, name in names.items():
            if ns.quant_type == "awq":
                result[name] = (*rtn.int4_asymmetric(lin.weight, ns.group_size), None)
            else:
                result[name] = (*rtn.int8_per_channel(lin.weight), None, None)
    return result


def _hessian(acc, x):
    acc = acc or gptq.Hessian(x.shape[1])
    acc.add(x)
    return acc


def write_checkpoint(ns, model, tokenizer_dir: str, quantized: dict[str, tuple], qc: dict) -> None:
    """The quantized model as safetensors + config.json, into a temporary folder renamed to ``-o``."""
    from safetensors.torch import save_file

    quant, dtype = from_hf(qc), DTYPES[ns.dtype]
    tensors = {}
    for name, tensor in model.state_dict().items():
        module = name.rpartition(".")[0]
        if module in quantized:
            if name.endswith(".weight"):
                tensors.update(
                    {f"{module}.{k}": v for k, v in checkpoint_tensors(quant, *quantized[module], dtype).items()}
                )
            else:
                tensors[name] = tensor.to(dtype)
        elif name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        else:
            tensors[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    out = Path(ns.output).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        for f in Path(tokenizer_dir).iterdir():  # tokenizer, chat template, generation config...
            if (
                f.is_file()
                and f.suffix not in (".safetensors", ".bin", ".gguf", ".pt")
                and not f.name.endswith(".index.json")
                and f.name != RECIPE  # a converted GGUF's list of the file's weights
            ):
                shutil.copy2(f, tmp / f.name)
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"}
        )
        config = json.loads((Path(tokenizer_dir) / "config.json").read_text())
        config.update(
            quantization_config=qc, torch_dtype={"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[ns.dtype]
        )
        config.pop("dtype", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        record = {"quant_type": ns.quant_type, "group_size": ns.group_size, "alpha": ns.alpha, "tp": ns.tp,
                  "act_order": ns.act_order, "static_groups": ns.static_groups, "sym": ns.sym,
                  "calibration": ns.token_file or "kiln default text", "samples": ns.num_calibration_samples,
                  "seq_len": ns.seq_len, "dtype": ns.dtype,
                  "tp_note": "not pre-sharded: Kiln and vLLM split each weight at load, so this folder serves any -tp "
                             "the checks above passed for"}  # fmt: skip
        (tmp / "kiln_quantize.json").write_text(json.dumps(record, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def quantize(ns: argparse.Namespace) -> None:
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kiln.models.loader import resolve_model, transformers_model

    if not os.path.exists(ns.input):
        raise ValueError(f"-i: {ns.input!r} does not exist")
    path = resolve_model(ns.input, "auto").path
    hf_config = AutoConfig.from_pretrained(path)
    check_args(ns, hf_config)
    tokenizer = AutoTokenizer.from_pretrained(path)
    token_rows = read_token_file(ns.token_file, hf_config.vocab_size) if ns.token_file else None
    torch.manual_seed(ns.seed)
    model = transformers_model(AutoModelForCausalLM, path, dtype=torch.float32).eval()
    layers = model.model.layers
    hidden, kwargs = [], [[] for _ in layers]
    if ns.quant_type != "weight_only_int8":
        samples = calibration_samples(tokenizer, ns.num_calibration_samples, ns.seq_len, token_rows, ns.seed)
        hidden, kwargs = first_layer_inputs(model, samples)
    quantized = {}
    for i, layer in enumerate(tqdm(layers, desc=f"{ns.quant_type} layers", unit="layer")):
        for name, value in quantize_layer(ns, layer, hidden, kwargs[i]).items():
            quantized[f"model.layers.{i}.{name}"] = value
        if hidden:
            hidden = run_layer(layer, hidden, kwargs[i])
    qc = hf_quantization_config(ns.quant_type, ns.group_size, ns.act_order, ns.sym, ns.static_groups)
    write_checkpoint(ns, model, path, quantized, qc)


def cmd_quantize(ns: argparse.Namespace) -> int:
    quantize(ns)
    print(f"wrote {ns.output}")
    return 0
