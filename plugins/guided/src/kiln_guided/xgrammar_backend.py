"""The ``xgrammar`` backend: grammars compiled by xgrammar's compiler (cached by Kiln, within a
budget), one ``GrammarMatcher`` per sequence, and xgrammar's CPU kernel to apply the mask."""

from __future__ import annotations

import json
import re

import torch
import xgrammar as xgr

from kiln.interfaces.guided import (
    CompiledGuide,
    GuidedBackend,
    GuidedDecodingParams,
    GuideMatcher,
    UnsupportedConstraint,
)
from kiln.interfaces.tokenizer import is_mistral, is_mistral_sentencepiece, mistral_inner

# xgrammar prefixes its messages with "[time] file.cc:line: ".
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# Whitespace between JSON tokens is free (as in vLLM) but bounded: a small model sampling at
# temperature 1 must not wander into an endless run of newlines.
MAX_WHITESPACE = 4


def mistral_info(tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar's view of a mistral_common tokenizer, which its ``from_huggingface`` does not read,
    control tokens empty (xgrammar takes empty tokens for special ones and never lets a grammar
    choose them). Tekken: every token's bytes as they are (a raw vocabulary). SentencePiece: its
    pieces ("▁" for a space, "<0xNN>" for a byte), which xgrammar reads as byte-fallback ones."""
    inner = mistral_inner(tokenizer)
    stop = [tokenizer.eos_token_id]
    if is_mistral_sentencepiece(tokenizer):
        vocab = ["" if inner.is_special(i) else inner.id_to_piece(i) for i in range(inner.n_words)]
        return xgr.TokenizerInfo(
            vocab, xgr.VocabType.BYTE_FALLBACK, vocab_size=vocab_size, stop_token_ids=stop, add_prefix_space=True
        )
    vocab = [b"" if inner.is_special(i) else inner.id_to_byte_piece(i, "keep") for i in range(inner.n_words)]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """``guided_choice`` as EBNF alternation (xgrammar has no choice API)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class XGrammarMatcher(GuideMatcher):
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)


class XGrammarGuide(CompiledGuide):
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.compiled = compiled

    def matcher(self) -> GuideMatcher:
        return XGrammarMatcher(self.compiled)

    def memory_bytes(self) -> int:
        return self.compiled.memory_size_bytes


class XGrammarBackend(GuidedBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        super().__init__(tokenizer, vocab_size)
        info = (
            mistral_info(tokenizer, vocab_size)
            if is_mistral(tokenizer)
            else xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        )
        # Kiln's compile cache (bounded) sits above this one, which would only grow without bound.
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, params: GuidedDecodingParams) -> CompiledGuide:
        if params.whitespace_pattern is not None:
            raise UnsupportedConstraint("guided_whitespace_pattern is not supported by xgrammar")
        kind = params.kind
        try:
            if kind in ("json", "json_object"):  # json_object: any object, as OpenAI and vLLM mean it
                schema = params.json if kind == "json" else {"type": "object"}
                if params.disable_any_whitespace:  # compact JSON: no whitespace at all between tokens
                    layout = {"any_whitespace": False, "separators": (",", ":")}
                else:
                    layout = {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE}
                compiled = self.compiler.compile_json_schema(json.dumps(schema), **layout)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(params.regex)
            elif kind == "choice":
                compiled = self.compiler.compile_grammar(choice_grammar(params.choice))
            elif kind == "grammar":
                compiled = self.compiler.compile_grammar(params.grammar)
            else:
                compiled = self.compiler.compile_structural_tag(params.structural_tag)
        except RuntimeError as exc:
            message = _LOCATION.sub("", str(exc).strip())
            if message.startswith("Unsupported") or "not supported" in message:
                raise UnsupportedConstraint(f"xgrammar: {message}") from None  # lookaheads, (?i)...
            raise ValueError(f"guided_{'decoding' if kind == 'structural_tag' else kind}: {message}") from None
        return XGrammarGuide(compiled)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        # xgrammar's CPU kernel wants fp32 logits; the engine's are.
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
