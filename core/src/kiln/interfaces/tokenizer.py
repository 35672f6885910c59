"""What plugins may ask of the engine's tokenizer beyond Hugging Face's interface."""

from __future__ import annotations


def is_mistral(tokenizer) -> bool:
    """Whether ``tokenizer`` is mistral_common's (``--tokenizer-mode mistral``, through transformers'
    ``MistralCommonBackend``): it has no Rust ``tokenizers`` backend, and its inner tekken
    tokenizer is ``tokenizer.tokenizer.instruct_tokenizer.tokenizer``."""
    return type(tokenizer).__name__ == "MistralCommonBackend"
