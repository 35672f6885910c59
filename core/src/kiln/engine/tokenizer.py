"""The engine's tokenizer: Hugging Face's, or mistral_common's (``--tokenizer-mode mistral``).

Mistral's own releases ship their tokenizer as ``tekken.json`` (a byte-level BPE; the older
SentencePiece ``tokenizer.model.v<N>`` files came with Hugging Face tokenizer files too), and
encode conversations in code (``mistral_common``'s instruct requests) rather than with a Jinja
template. Kiln loads them through transformers' ``MistralCommonBackend`` (which reads
``tekken.json`` only), which gives them the tokenizer methods the
engine calls (``encode``, ``decode``, ``convert_ids_to_tokens``); what differs — chat
prompts come out as token ids, and there is no Rust ``tokenizers`` backend for streaming
detokenization — is asked through ``is_mistral`` by the code that handles it.
"""

from __future__ import annotations

import os
from functools import lru_cache

from kiln.interfaces.tokenizer import is_mistral

MISTRAL_FILE = "tekken.json"
# Any of these makes a folder's tokenizer a Hugging Face one.
HF_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str, mode: str, trust_remote_code: bool = False):
    """The tokenizer in folder ``path``. ``mode`` ``auto``: Hugging Face's, or mistral_common's
    where the folder holds ``tekken.json`` and no Hugging Face tokenizer file; ``mistral``:
    mistral_common's, which needs ``pip install mistral-common`` and ``tekken.json``.
    ``ValueError`` names what is missing."""
    from transformers import AutoTokenizer

    tekken = os.path.isfile(os.path.join(path, MISTRAL_FILE))
    has_hf = any(os.path.exists(os.path.join(path, f)) for f in HF_FILES)
    if mode == "mistral" or (mode == "auto" and tekken and not has_hf):
        if not tekken:
            raise ValueError(
                f"--tokenizer-mode mistral: {path} has no {MISTRAL_FILE} (mistral_common's tokenizer file); "
                "--tokenizer-mode auto loads its Hugging Face tokenizer"
            )
        try:
            import mistral_common  # noqa: F401  (transformers' MistralCommonBackend imports it)
        except ImportError:
            raise ValueError(
                f"--tokenizer-mode mistral: {path}'s {MISTRAL_FILE} needs `pip install mistral-common` "
                "(or kiln-core[mistral])"
            ) from None
        return AutoTokenizer.from_pretrained(path, mistral_format=True)
    # transformers would pick mistral_common itself for Mistral models with a tekken.json
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, mistral_format=False)


def special_ids(tokenizer) -> set[int]:
    """The ids of ``tokenizer``'s special and control tokens (which detokenization handles apart)."""
    if is_mistral(tokenizer):
        return set(tokenizer.all_special_ids)
    return set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}


@lru_cache(maxsize=32)  # a server asks for the same few (its parsers') on every request
def markup_token_ids(tokenizer, markup: tuple[str, ...]) -> frozenset[int]:
    """The special tokens of ``tokenizer`` that spell part of a parser's ``markup`` strings
    (``ToolParser.markup``): the ones detokenization keeps in the text the parser reads."""
    if not markup:
        return frozenset()
    ids = sorted(special_ids(tokenizer))
    return frozenset(i for i, t in zip(ids, tokenizer.convert_ids_to_tokens(ids)) if t and any(t in m for m in markup))
