"""BERT and XLM-RoBERTa encoders (the bge, MiniLM and e5 families) and their
sequence-classification heads (cross-encoders, for score and rerank).

The step is one flattened token stream, as for the decoders (``BatchLayout``); attention
goes through ``AttentionBackend.forward_encoder``: bidirectional within each sequence, no
KV cache, so ``layers`` is empty and every prompt is computed whole in one step.
Post-LayerNorm blocks:

    x = LN(word[id] + token_type[type] + position[pos + offset])
    each layer:  x = LN(x + attn_out(attention(qkv(x))))
                 x = LN(x + down(act(up(x))))

XLM-RoBERTa (and RoBERTa) are the same network with positions counted from
``pad_token_id + 1`` (Hugging Face numbers non-padding tokens from there; Kiln's prompts hold
no padding). Under tensor parallelism each rank holds its heads and its slice of the MLP:
q/k/v and up are column-parallel, attn_out and down row-parallel, their bias loaded on rank 0
only so that the all-reduce adds it once. LayerNorm and GELU are plain torch: no platform op
(``kiln.interfaces.model``) covers them.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from kiln.distributed import TensorParallel
from kiln.interfaces.attention import AttentionBackend
from kiln.interfaces.model import StepContext
from kiln.quantization.config import QuantConfig
from kiln.quantization.layers import load_linear_tensor

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}
# Hugging Face's names inside ``encoder.layer.{i}`` -> this module's.
QKV = ("attention.self.query", "attention.self.key", "attention.self.value")
LAYER_NAMES = {
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "up_proj",
    "output.dense": "down_proj",
    "output.LayerNorm": "mlp_norm",
}
ROW_PARALLEL = ("attn_out", "down_proj")


def position_offset(cfg) -> int:
    """Index of the position embedding of a sequence's first token: 0 for BERT, ``pad_token_id + 1``
    for (XLM-)RoBERTa. A model takes ``max_position_embeddings - position_offset`` tokens at most."""
    return cfg.pad_token_id + 1 if cfg.model_type in ("roberta", "xlm-roberta") else 0


class BertEmbeddings(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.offset = position_offset(cfg)

    def forward(self, input_ids, positions, token_type_ids):
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        # Hugging Face's order of additions, so fp32 results match to the last bits.
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x + self.position_embeddings(positions + self.offset))


class BertLayer(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend, tp: TensorParallel) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.num_heads = tp.shard(cfg.num_attention_heads, "attention heads")
        self.head_dim = hidden // cfg.num_attention_heads
        size = self.num_heads * self.head_dim
        intermediate = tp.shard(cfg.intermediate_size, "intermediate size")
        self.qkv_proj = nn.Linear(hidden, 3 * size)
        self.attn_out = nn.Linear(size, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.up_proj = nn.Linear(hidden, intermediate)
        self.down_proj = nn.Linear(intermediate, hidden)
        self.mlp_norm = nn.LayerNorm(hidden, eps=eps)
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.scale = self.head_dim**-0.5
        self.backend = backend
        self.tp = tp

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        o = self.backend.forward_encoder(q, k, v, ctx.layout, scale=self.scale)
        x = self.attn_norm(x + self.tp.all_reduce(self.attn_out(o.reshape(x.shape[0], -1))))
        return self.mlp_norm(x + self.tp.all_reduce(self.down_proj(self.act(self.up_proj(x)))))


class BertModel(nn.Module):
    """The encoder: ``forward`` gives the last layer's hidden states (no pooler)."""

    is_encoder = True
    layers: tuple = ()  # no KV cache
    checkpoint_prefix = "bert."  # Hugging Face's task models nest the encoder under it

    def __init__(
        self,
        cfg,
        ops: SimpleNamespace,
        backend: AttentionBackend,
        max_positions: int,
        tp: TensorParallel = TensorParallel(),
        quant_config: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        check_config(cfg, backend, max_positions, quant_config)
        self.config = cfg
        self.tp = tp
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = nn.ModuleList(BertLayer(cfg, backend, tp) for _ in range(cfg.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = self.embeddings(input_ids, positions, ctx.token_type_ids)
        for layer in self.encoder:
            x = layer(x, ctx)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, with or without the task models' ``bert.``/``roberta.``
        prefix (sentence-transformers saves the bare encoder), merging q/k/v into one matmul and
        keeping this tensor-parallel rank's slice. A pooler the model does not use is skipped."""
        params = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix(self.checkpoint_prefix)
            if name.endswith("position_ids") or (name.startswith("pooler.") and name not in params):
                continue  # a buffer older checkpoints saved; the embedding models' unused pooler
            parts = name.split(".")
            if parts[:2] == ["encoder", "layer"] and len(parts) > 4:
                index, middle, leaf = parts[2], ".".join(parts[3:-1]), parts[-1]
                if middle in QKV:
                    name = f"encoder.{index}.qkv_proj.{leaf}"
                    group = pending.setdefault(name, {})
                    group[middle] = self.tp.slice(tensor, 0)
                    if len(group) < len(QKV):
                        continue
                    tensor = torch.cat([group[m] for m in QKV])
                    del pending[name]
                elif middle in LAYER_NAMES:
                    name = f"encoder.{index}.{LAYER_NAMES[middle]}.{leaf}"
                    tensor = self._shard(LAYER_NAMES[middle], leaf, tensor)
            loaded.update(load_linear_tensor(params, name, tensor))
        missing = set(params) - loaded
        if pending or missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing | set(pending))[:8]}")

    def _shard(self, module: str, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
        if module == "up_proj":
            return self.tp.slice(tensor, 0)
        if module in ROW_PARALLEL:
            if leaf == "weight":
                return self.tp.slice(tensor, 1)
            return tensor if self.tp.rank == 0 else torch.zeros_like(tensor)
        return tensor


class XLMRobertaModel(BertModel):
    checkpoint_prefix = "roberta."


class BertForSequenceClassification(BertModel):
    """A cross-encoder: the encoder, then Hugging Face's head on the CLS token (pooler dense and
    tanh, then the classifier)."""

    def __init__(self, cfg, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        self.num_labels = cfg.num_labels
        self.pooler = nn.ModuleDict({"dense": nn.Linear(cfg.hidden_size, cfg.hidden_size)})
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """(num_seqs, hidden) final CLS states -> (num_seqs, num_labels) float32 logits."""
        return self.classifier(torch.tanh(self.pooler["dense"](cls_hidden))).float()


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """A cross-encoder (bge-reranker): the encoder, then ``classifier.dense``, tanh and
    ``classifier.out_proj`` on the CLS (``<s>``) token."""

    def __init__(self, cfg, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        self.num_labels = cfg.num_labels
        self.classifier = nn.ModuleDict(
            {
                "dense": nn.Linear(cfg.hidden_size, cfg.hidden_size),
                "out_proj": nn.Linear(cfg.hidden_size, cfg.num_labels),
            }
        )

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """(num_seqs, hidden) final CLS states -> (num_seqs, num_labels) float32 logits."""
        return self.classifier["out_proj"](torch.tanh(self.classifier["dense"](cls_hidden))).float()


def check_config(cfg, backend: AttentionBackend, max_positions: int, quant_config: QuantConfig | None) -> None:
    """Refuse, before any weight is read, what this implementation does not run."""
    kind = getattr(cfg, "position_embedding_type", None) or "absolute"
    if kind != "absolute":
        raise ValueError(f"model: position_embedding_type {kind!r} is not supported (absolute only)")
    if cfg.hidden_act not in ACTIVATIONS:
        raise ValueError(f"model: hidden_act {cfg.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
    if not backend.supports_encoder:
        raise ValueError(f"attention backend {backend.name!r} cannot run encoder models (no forward_encoder)")
    if quant_config is not None:
        raise ValueError(f"quantization: {quant_config.label} is not supported for encoder models")
    usable = cfg.max_position_embeddings - position_offset(cfg)
    if max_positions > usable:
        raise ValueError(f"--max-model-len: {max_positions} exceeds the {usable} positions this model embeds")
