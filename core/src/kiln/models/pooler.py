"""Pooling models: which task a model serves, how its hidden states are pooled, and the pooling itself.

``resolve_task`` turns ``--task`` (or vLLM's newer ``--runner`` / ``--convert``) into one of
``generate``, ``embed``, ``score``, ``classify`` or ``reward``. ``load_pooler_config`` gives the
model's ``PoolerConfig``, from (later wins):

  1. the architecture: decoders pool the last token, encoders (``is_encoder``) the first (CLS);
     embeddings are L2-normalised, classes go through softmax (sigmoid for one label);
  2. the model folder's sentence-transformers files, for embeddings: ``modules.json`` names the
     pooling module's folder (``1_Pooling/config.json``: cls / mean / last token), the ``Dense``
     projections after it (``load_dense_layers``) and whether a ``Normalize`` module follows;
     ``config_sentence_transformers.json`` its similarity function;
  3. ``--override-pooler-config``.

``pool`` runs on the model runner's hidden states of a step's pooling requests.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.engine.pooling import PoolingModelInfo
from kiln.pooling_params import HEADS, PoolerConfig
from kiln.registry import load_ref

if TYPE_CHECKING:
    from kiln.config import EngineConfig
    from kiln.engine.request import Request
    from kiln.registry import Registry

logger = logging.getLogger("kiln.pooler")

# sentence-transformers' pooling modes (those Kiln runs), and the older config's booleans for each mode.
_ST_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
_ST_LEGACY_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


def resolve_task(config: EngineConfig, arch: str, model_cls: type, hf_config: Any) -> str:
    """The task the flags ask for, checked against what ``model_cls`` can do."""
    task, runner, convert = config.task, config.runner, config.convert
    if task != "auto" and (runner != "auto" or convert != "auto"):
        raise ValueError("--task: give either --task or --runner/--convert, not both")
    encoder = bool(getattr(model_cls, "is_encoder", False))
    classifier = hasattr(model_cls, "classify")
    headless = bool(getattr(model_cls, "pooling_only", False))  # a decoder without its LM head
    native = ("score" if getattr(hf_config, "num_labels", 2) == 1 else "classify") if classifier else None
    if task == "auto":
        if runner == "generate" and convert not in ("auto", "none"):
            raise ValueError(f"--convert {convert}: needs --runner pooling (or auto), not --runner generate")
        if convert in ("embed", "classify", "reward"):
            task = convert
        elif runner == "generate":
            task = "generate"
        elif runner == "pooling" or encoder or classifier or headless:
            task = native or "embed"  # vLLM's --runner pooling turns a causal LM into an embedding model
        else:
            task = "generate"
    if task == "generate" and (encoder or classifier or headless):
        why = "has no LM head" if headless else "is not a generation model"
        raise ValueError(f"--task generate: {arch} {why}; serve it with --task {native or 'embed'}")
    if task in ("score", "classify") and not classifier:
        raise ValueError(
            f"--task {task}: {arch} has no classification head; serve a *ForSequenceClassification model "
            "(a cross-encoder) for it, or --task embed for scores by embedding similarity"
        )
    return task


def setup_pooling(config: EngineConfig, hf_config: Any, registry: Registry, model_path: str) -> PoolingModelInfo | None:
    """Resolve ``config.task`` in place; for a pooling task, what the engine's pooling side needs
    (None: the model generates).

    NOTE(pooling): a pooling prompt is computed whole in one step, so chunked prefill is turned
    off (``max_num_batched_tokens`` then holds a whole ``max_model_len`` prompt). Prefix-cache
    hits skip the first positions, so only last-token pooling on a decoder keeps the cache.
    """
    archs = list(getattr(hf_config, "architectures", None) or [])
    arch = next((a for a in archs if a in registry.models), None)
    if config.model_impl == "transformers":
        from kiln.models.transformers_backend import TransformersForCausalLM as model_cls

        arch = archs[0] if archs else hf_config.model_type
    elif arch is None:
        return None  # building the model says which architectures are supported
    else:
        model_cls = load_ref(registry.models[arch])
    config.task = resolve_task(config, arch, model_cls, hf_config)
    if config.task == "generate":
        return None
    encoder = bool(getattr(model_cls, "is_encoder", False))
    pooler = load_pooler_config(config.task, model_path, encoder, config.override_pooler_config)
    config.enable_chunked_prefill = False
    config.enable_prefix_caching = config.enable_prefix_caching and not encoder and pooler.pooling_type == "LAST"
    matryoshka = tuple(getattr(hf_config, "matryoshka_dimensions", None) or ()) or None
    id2label = getattr(hf_config, "id2label", None) or {}
    labels = tuple(str(id2label[i]) for i in sorted(id2label, key=int)) if HEADS[config.task] == "classify" else ()
    logger.info("serving %s for --task %s: %s", arch, config.task, pooler)
    width = (dense_output_size(model_path) if config.task == "embed" else None) or hf_config.hidden_size
    return PoolingModelInfo(pooler, width, getattr(hf_config, "type_vocab_size", 0), matryoshka, labels)


def load_pooler_config(task: str, model_path: str, is_encoder: bool, overrides: dict | None) -> PoolerConfig:
    """The served model's pooling, from its architecture, its sentence-transformers files and the flag."""
    config = PoolerConfig(pooling_type="CLS" if is_encoder else "LAST")
    if task == "reward":
        config = replace(config, pooling_type="ALL", normalize=False, use_activation=False)
    elif task == "embed":
        config = _sentence_transformers_config(model_path, config, "pooling_type" in (overrides or {}))
    return replace(config, **(overrides or {}))  # checked by EngineConfig (parse_pooler_overrides)


def _read_json(path: str) -> Any:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _sentence_transformers_config(model_path: str, config: PoolerConfig, pooling_given: bool) -> PoolerConfig:
    modules = _read_json(os.path.join(model_path, "modules.json"))
    if not modules:
        return config
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    pooling = _read_json(os.path.join(model_path, kinds.get("Pooling", "1_Pooling"), "config.json")) or {}
    modes = _st_pooling_modes(pooling)
    if (len(modes) > 1 or any(m not in _ST_MODES for m in modes)) and not pooling_given:
        raise ValueError(
            f"model: its sentence-transformers pooling ({', '.join(modes)}) is not supported; "
            'choose one with --override-pooler-config \'{"pooling_type": "MEAN"}\' (LAST, MEAN or CLS)'
        )
    if len(modes) == 1 and modes[0] in _ST_MODES:
        config = replace(config, pooling_type=_ST_MODES[modes[0]])
    config = replace(config, normalize="Normalize" in kinds)
    st = _read_json(os.path.join(model_path, "config_sentence_transformers.json")) or {}
    similarity = st.get("similarity_fn_name") or "cosine"
    if similarity not in ("cosine", "dot"):
        logger.warning("similarity %r is not supported; scores use cosine similarity", similarity)
        similarity = "cosine"
    return replace(config, similarity=similarity)


def _st_pooling_modes(pooling: dict) -> list[str]:
    """The modes of a sentence-transformers ``Pooling`` config: ``pooling_mode``, one name or a list
    (version 6 on), or the older ``pooling_mode_*`` booleans."""
    mode = pooling.get("pooling_mode")
    if mode is not None:
        return [mode] if isinstance(mode, str) else list(mode)
    given = [k for k in pooling if k.startswith("pooling_mode_")]
    on = [k for k in given if pooling[k]]
    return [_ST_LEGACY_KEYS.get(k, k) for k in on] if on or not given else ["mean"]  # none on: its default


def load_dense_layers(model_path: str) -> list[nn.Module]:
    """The sentence-transformers ``Dense`` modules of an embedding model, in ``modules.json``'s order
    (each a linear layer and its activation, in float32 on the host): they project the pooled
    vector before it is normalised. Empty when the model has none."""
    layers = []
    for folder, config in _dense_modules(model_path):
        try:
            linear = nn.Linear(config["in_features"], config["out_features"], bias=config.get("bias", True))
        except KeyError as exc:
            raise ValueError(f"model: the Dense module in {folder} has no {exc} in its config.json") from None
        linear.load_state_dict({k.removeprefix("linear."): v.float() for k, v in _dense_weights(folder).items()})
        layers.append(nn.Sequential(linear, _activation(config.get("activation_function"))))
    return layers


def dense_output_size(model_path: str) -> int | None:
    """The width of the last ``Dense`` module's output (None: the model has none)."""
    modules = _dense_modules(model_path)
    return modules[-1][1].get("out_features") if modules else None


def _dense_modules(model_path: str) -> list[tuple[str, dict]]:
    """(folder, config.json) of each ``Dense`` module ``modules.json`` lists."""
    out = []
    for module in _read_json(os.path.join(model_path, "modules.json")) or []:
        if str(module.get("type", "")).rsplit(".", 1)[-1] == "Dense":
            folder = os.path.join(model_path, module.get("path", ""))
            out.append((folder, _read_json(os.path.join(folder, "config.json")) or {}))
    return out


def _dense_weights(folder: str) -> dict[str, torch.Tensor]:
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        from safetensors.torch import load_file

        return load_file(os.path.join(folder, "model.safetensors"))
    path = os.path.join(folder, "pytorch_model.bin")
    if not os.path.exists(path):
        raise ValueError(f"model: the Dense module in {folder} has no model.safetensors or pytorch_model.bin")
    return torch.load(path, map_location="cpu", weights_only=True)


def _activation(name: str | None) -> nn.Module:
    """A Dense module's activation, named by its class path: only ``torch.nn``'s own classes."""
    module, _, cls = (name or "torch.nn.modules.linear.Identity").rpartition(".")
    if not module.startswith("torch.nn") or not isinstance(getattr(nn, cls, None), type):
        raise ValueError(f"model: unsupported Dense activation_function {name!r} (a torch.nn class is expected)")
    return getattr(nn, cls)()


# --------------------------------------------------------------------------- pooling
def pool(
    model: torch.nn.Module,
    hidden: torch.Tensor,
    spans: list[tuple[Request, int, int]],
    dense: list[nn.Module] = (),
) -> dict:
    """Each pooling request's output from the step's hidden states, as a float32 CPU tensor.

    ``spans``: (request, first row, rows) of each request in ``hidden``; a pooling prompt is
    computed whole in one step, so its rows are all of its tokens. Embeddings go through the
    ``dense`` projections (``load_dense_layers``), are cut to ``dimensions`` and then normalised
    (matryoshka); classes go through ``model.classify``.
    """
    out: dict = {}
    vectors, vector_reqs = [], []
    for req, first, n in spans:
        p = req.pooling_params
        if p.pooling_type == "ALL":
            out[req] = hidden[first : first + n].float().cpu()
            continue
        if p.pooling_type == "MEAN":
            vectors.append(hidden[first : first + n].float().mean(0))
        else:
            vectors.append(hidden[first if p.pooling_type == "CLS" else first + n - 1].float())
        vector_reqs.append(req)
    if not vectors:
        return out
    stacked = torch.stack(vectors)
    if vector_reqs[0].pooling_params.head == "classify":  # the head is the model's: all of them classify
        stacked = model.classify(stacked.to(hidden.dtype)).float()
    else:
        for layer in dense:
            stacked = layer(stacked.cpu())
    for req, vector in zip(vector_reqs, stacked.cpu()):
        out[req] = _finish(vector, req.pooling_params)
    return out


def _finish(vector: torch.Tensor, params) -> torch.Tensor:
    if params.head == "classify":
        if not params.use_activation:
            return vector
        return torch.sigmoid(vector) if vector.numel() == 1 else torch.softmax(vector, dim=-1)
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    return F.normalize(vector, dim=-1) if params.normalize else vector
