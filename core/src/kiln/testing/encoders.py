"""Tiny random-weight encoders (BERT, XLM-RoBERTa and their sequence-classification heads) with a
real WordPiece tokenizer, their Hugging Face reference outputs, and one encoder step through
Kiln's model runner: what the encoder and pooling tests of every platform share.

``tiny_model_dir("bert")`` gives a ``BertModel``; ``tiny_model_dir("xlm-roberta",
architectures="XLMRobertaForSequenceClassification", num_labels=1)`` a cross-encoder (one class
name, not a list: the fixture names the folder after the overrides, and ``[`` would be a glob).
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kiln.worker.model_runner import ModelRunner

# Special tokens in the families' own order (BERT: [PAD] 0; XLM-R: <s> 0, <pad> 1) and the
# tokenizer's templates: XLM-R marks no segments.
ENCODER_TYPES: dict[str, dict] = {
    "bert": dict(
        specials=dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]"),
        order=("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"),
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        inputs=["input_ids", "token_type_ids", "attention_mask"],
        config=dict(num_attention_heads=2, max_position_embeddings=512),  # head size 32, as MiniLM's
        architecture="BertModel",
    ),
    "xlm-roberta": dict(
        specials=dict(cls_token="<s>", pad_token="<pad>", sep_token="</s>", unk_token="<unk>", mask_token="<mask>"),
        order=("cls_token", "pad_token", "sep_token", "unk_token", "mask_token"),
        single="<s> $A </s>",
        pair="<s> $A </s> </s> $B </s>",
        inputs=["input_ids", "attention_mask"],
        config=dict(num_attention_heads=4, max_position_embeddings=514),  # positions from pad_token_id + 1
        architecture="XLMRobertaModel",
    ),
}
ENCODER_TYPES["roberta"] = {**ENCODER_TYPES["xlm-roberta"], "architecture": "RobertaModel"}  # the same network
NUM_WORDS = 2000  # whole words taken from the default model's vocabulary
# One step's prompts for the encoder tests: lengths 1, shorter than a block, several blocks; no
# token id 1 (XLM-R's padding id, which Hugging Face would not number as a position).
PROMPTS = [[7], [2, 300, 301, 302, 3], list(range(100, 140)), [42] * 17 + list(range(500, 520))]
# Their segment ids, as BERT tokenizers give them for (query, document) pairs.
TOKEN_TYPES = [[0], [0, 0, 0, 1, 1], [0] * 12 + [1] * 28, [0] * 37]


def build_tokenizer(model_type: str, words_from: str):
    """A lowercasing WordPiece tokenizer: the family's special tokens, the default model's
    commonest ``NUM_WORDS`` English words, and single characters (``##`` ones too) so that any
    ASCII text tokenizes."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    kind = ENCODER_TYPES[model_type]
    source = AutoTokenizer.from_pretrained(words_from).get_vocab()
    words = [w[1:] for w, _ in sorted(source.items(), key=lambda item: item[1]) if _is_word(w)][:NUM_WORDS]
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    vocab = [kind["specials"][k] for k in kind["order"]] + chars + ["##" + c for c in chars]
    vocab += [w for w in words if w not in set(vocab)]
    specials = kind["specials"]
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token=specials["unk_token"]))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    marks = [(specials[k], vocab.index(specials[k])) for k in ("cls_token", "sep_token")]
    tok.post_processor = processors.TemplateProcessing(single=kind["single"], pair=kind["pair"], special_tokens=marks)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, model_max_length=512, model_input_names=kind["inputs"], **specials
    )


def _is_word(token: str) -> bool:
    return token.startswith("Ġ") and token[1:].isascii() and token[1:].isalpha() and token[1:].islower()


def build_tiny_encoder(model_type: str, path: Path, words_from: str, *, seed: int, **overrides: object) -> str:
    """Save a 2-layer, hidden-64 encoder of ``model_type`` (``ENCODER_TYPES``) with random fp32
    weights and its tokenizer into ``path``; ``architectures=name`` picks the Hugging Face
    class (default: the bare encoder), other ``overrides`` replace config entries."""
    import torch
    import transformers
    from transformers import AutoConfig

    kind = ENCODER_TYPES[model_type]
    tokenizer = build_tokenizer(model_type, words_from)
    architecture = str(overrides.pop("architectures", kind["architecture"]))
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.2,
        **{**kind["config"], **overrides},
    )
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def hf_encoder_outputs(
    model_dir: str, prompts: list[list[int]], token_type_ids: list[list[int]] | None = None
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Reference: per prompt, Hugging Face's last hidden state (tokens, hidden) and, for a
    sequence-classification model, its logits (num_labels,); fp32, one prompt at a time."""
    import torch
    import transformers
    from transformers import AutoConfig

    from kiln.models.loader import transformers_model

    (architecture,) = AutoConfig.from_pretrained(model_dir).architectures
    model = transformers_model(getattr(transformers, architecture), model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for i, ids in enumerate(prompts):
            types = None if token_type_ids is None else torch.tensor([token_type_ids[i]])
            out = model(torch.tensor([ids]), token_type_ids=types, output_hidden_states=True)
            logits = out.logits[0] if hasattr(out, "logits") else None
            outputs.append((out.hidden_states[-1][0], logits))
    return outputs


def encoder_runner(plugins, model: str, **engine_args: object) -> ModelRunner:
    """The model runner the engine builds for encoder ``model`` on one rank, without the engine:
    ``plugins`` a ``PluginManager``, ``engine_args`` as ``EngineConfig.create`` takes them
    (``max_model_len`` 512 unless given)."""
    from transformers import AutoConfig

    from kiln.config import EngineConfig
    from kiln.distributed import TensorParallel
    from kiln.platforms.select import select_platform
    from kiln.worker.builder import build_runner, resolve_dtype

    config = EngineConfig.create(model=model, **{"max_model_len": 512, **engine_args})
    platform = select_platform(config.device, plugins.registry)
    platform.update_config(config)
    hf_config = AutoConfig.from_pretrained(model)
    dtype = resolve_dtype(config, platform, hf_config)
    return build_runner(config, plugins.registry, platform, hf_config, dtype, model, TensorParallel())


def run_encoder_step(
    runner: ModelRunner, prompts: list[list[int]], token_type_ids: list[list[int]] | None = None
) -> torch.Tensor:
    """One encoder step over ``prompts`` (each whole, flattened) through ``runner``'s model and
    backend, as the engine runs it; returns the (tokens, hidden) final hidden states."""
    import torch

    from kiln.interfaces.attention import BatchLayout
    from kiln.interfaces.model import StepContext

    bs, lens = runner.block_size, [len(p) for p in prompts]
    rows, first = [], 1  # block 0 is the null block
    for n in lens:
        rows.append(list(range(first, first + -(-n // bs))))
        first += len(rows[-1])
    layout = BatchLayout.build(rows, [0] * len(prompts), lens, bs, runner.device)
    ids = torch.tensor([t for p in prompts for t in p], device=runner.device)
    positions = torch.tensor([i for n in lens for i in range(n)], device=runner.device)
    types = None if token_type_ids is None else torch.tensor(sum(token_type_ids, []), device=runner.device)
    ctx = StepContext(runner.backend.build_metadata(layout), runner.kv_caches, layout, types)
    with torch.inference_mode():
        return runner.model(ids, positions, ctx)


def assert_matches_transformers(
    runner: ModelRunner,
    model_dir: str,
    prompts: list[list[int]],
    token_type_ids: list[list[int]] | None = None,
    *,
    atol: float = 1e-5,
    rtol: float = 1e-5,
) -> None:
    """Kiln's final hidden states for ``prompts``, all in one step, against Hugging Face's, one
    prompt at a time; for a cross-encoder, ``classify`` on each first (CLS) row against its logits."""
    import itertools

    import torch

    hidden = run_encoder_step(runner, prompts, token_type_ids)
    starts = [0, *itertools.accumulate(len(p) for p in prompts)]
    reference = hf_encoder_outputs(model_dir, prompts, token_type_ids)
    for i, (expected, _) in enumerate(reference):
        got = hidden[starts[i] : starts[i + 1]].float().cpu()
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol, msg=lambda m, i=i: f"prompt {i}: {m}")
    if reference[0][1] is not None:
        with torch.inference_mode():
            logits = runner.model.classify(hidden[starts[:-1]])
        assert logits.dtype == torch.float32 and logits.shape == (len(prompts), runner.model.num_labels)
        torch.testing.assert_close(logits.cpu(), torch.stack([lg for _, lg in reference]), atol=atol, rtol=rtol)
