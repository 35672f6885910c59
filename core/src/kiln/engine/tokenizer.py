"""The engine's tokenizer: Hugging Face's, or mistral_common's (``--tokenizer-mode mistral``).

Mistral's own releases ship their tokenizer as ``tekken.json`` (a byte-level BPE), the older
ones (Mistral 7B v0.3, Mixtral 8x22B, Codestral) as a SentencePiece ``tokenizer.model.v<N>``
beside Hugging Face tokenizer files, and encode conversations in code (``mistral_common``'s
instruct requests) rather than with a Jinja template. Kiln loads either through transformers'
``MistralCommonBackend``, which gives them the tokenizer methods the engine calls (``encode``,
``decode``, ``convert_ids_to_tokens``); what differs — chat prompts come out as token ids, and
there is no Rust ``tokenizers`` backend for streaming detokenization — is asked through
``is_mistral`` by the code that handles it.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache

from kiln.interfaces.tokenizer import is_mistral, is_mistral_sentencepiece, mistral_inner

MISTRAL_FILE = "tekken.json"
# mistral_common's SentencePiece files: tokenizer.model.v3, .v7m1 (a multimodal version), ...
MISTRAL_SPM = re.compile(r".*\.model\.v\d+(m\d+)?")
# Any of these makes a folder's tokenizer a Hugging Face one.
HF_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def mistral_files(path: str) -> list[str]:
    """The tokenizer files of folder ``path`` that mistral_common reads: ``tekken.json`` and
    SentencePiece ``*.model.v<N>`` files (of several, it takes ``tekken.json``, else the last by name)."""
    names = os.listdir(path) if os.path.isdir(path) else []
    return sorted(n for n in names if n == MISTRAL_FILE or MISTRAL_SPM.fullmatch(n))


def load_tokenizer(path: str, mode: str, trust_remote_code: bool = False):
    """The tokenizer in folder ``path``. ``mode`` ``auto``: Hugging Face's, or mistral_common's
    where the folder holds its files (``mistral_files``) and no Hugging Face tokenizer file;
    ``mistral``: mistral_common's, which needs ``pip install mistral-common[sentencepiece]``.
    ``ValueError`` names what is missing."""
    from transformers import AutoTokenizer

    mistral = mistral_files(path)
    has_hf = any(os.path.exists(os.path.join(path, f)) for f in HF_FILES)
    if mode == "mistral" or (mode == "auto" and mistral and not has_hf):
        if not mistral:
            raise ValueError(
                f"--tokenizer-mode mistral: {path} has no {MISTRAL_FILE} nor tokenizer.model.v<N> (mistral_common's "
                "tokenizer files); --tokenizer-mode auto loads its Hugging Face tokenizer"
            )
        return _mistral_common(path, mistral)
    # transformers would pick mistral_common itself for Mistral models with a tekken.json
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, mistral_format=False)


def _mistral_common(path: str, files: list[str]):
    needs = "mistral-common" if MISTRAL_FILE in files else "mistral-common[sentencepiece]"
    try:
        import mistral_common  # noqa: F401  (transformers' MistralCommonBackend imports it)
        from transformers import MistralCommonBackend

        if MISTRAL_FILE not in files:
            import sentencepiece  # noqa: F401  (mistral_common reads SentencePiece files through it)
    except ImportError:
        raise ValueError(
            f"--tokenizer-mode mistral: {path}'s {files[0]} needs `pip install {needs}` (or kiln-core[mistral])"
        ) from None
    # transformers' AutoTokenizer would take tekken.json alone; the backend itself reads both kinds
    tokenizer = MistralCommonBackend.from_pretrained(path)
    if is_mistral_sentencepiece(tokenizer):
        tokenizer.decode = _TextBetweenSpecialTokens(tokenizer)
    return tokenizer


class _TextBetweenSpecialTokens:
    """A ``decode`` for mistral_common's SentencePiece tokenizer that keeps special tokens as
    Hugging Face's does: the text between them decoded, each spliced in as its string. Its own
    keeps every token as its raw piece ("▁Hello"), in prompts echoed, /detokenize and streams.
    An object, not a closure: the guided-decoding sandbox pickles the tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_ids, skip_special_tokens: bool = False, **kwargs) -> str:
        tokenizer = self.tokenizer
        if skip_special_tokens:
            return type(tokenizer).decode(tokenizer, token_ids, skip_special_tokens=True, **kwargs)
        inner = mistral_inner(tokenizer)
        parts: list[str] = []
        run: list[int] = []
        for t in [token_ids] if isinstance(token_ids, int) else [int(t) for t in token_ids]:
            if inner.is_special(t):
                parts += [inner.decode(run)] if run else []
                parts.append(inner.id_to_piece(t))
                run = []
            else:
                run.append(t)
        return "".join(parts + ([inner.decode(run)] if run else []))


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
