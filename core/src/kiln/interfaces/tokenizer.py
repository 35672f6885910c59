"""What plugins may ask of the engine's tokenizer beyond Hugging Face's interface."""

from __future__ import annotations


def is_mistral(tokenizer) -> bool:
    """Whether ``tokenizer`` is mistral_common's (``--tokenizer-mode mistral``, through transformers'
    ``MistralCommonBackend``): it has no Rust ``tokenizers`` backend, and its inner tokenizer
    (``mistral_inner``) is tekken's byte-level BPE or a SentencePiece model."""
    return type(tokenizer).__name__ == "MistralCommonBackend"


def mistral_inner(tokenizer):
    """The tokenizer inside an ``is_mistral`` one: mistral_common's ``Tekkenizer`` (``tekken.json``)
    or ``SentencePieceTokenizer`` (``tokenizer.model.v<N>``)."""
    return tokenizer.tokenizer.instruct_tokenizer.tokenizer


def is_mistral_sentencepiece(tokenizer) -> bool:
    """Whether ``tokenizer`` is mistral_common's over a SentencePiece model, whose pieces spell a
    space as "▁" and bytes as "<0xNN>"."""
    return is_mistral(tokenizer) and type(mistral_inner(tokenizer)).__name__ == "SentencePieceTokenizer"
