"""The ``lm-format-enforcer`` backend: JSON schemas and regexes, walked character by character
over a prefix tree of the vocabulary. Slower than xgrammar; it is the fallback for schemas
xgrammar refuses."""

from __future__ import annotations

import torch
from lmformatenforcer import JsonSchemaParser, RegexParser, TokenEnforcer, TokenEnforcerTokenizerData

from kiln.interfaces.guided import (
    CompiledGuide,
    GuidedBackend,
    GuidedDecodingParams,
    GuideMatcher,
    UnsupportedConstraint,
)


def tokenizer_data(tokenizer, vocab_size: int) -> TokenEnforcerTokenizerData:
    """Every regular token's text as it reads mid-sequence, and whether it starts a word."""
    special = set(tokenizer.all_special_ids)
    anchor = tokenizer.encode("0", add_special_tokens=False)[-1]  # decoded after a neutral token keeps spaces
    anchor_text = tokenizer.decode([anchor])
    tokens = []
    for token_id in range(len(tokenizer)):
        if token_id in special or token_id >= vocab_size:
            continue
        text = tokenizer.decode([anchor, token_id])[len(anchor_text) :]
        tokens.append((token_id, text, len(text) > len(tokenizer.decode([token_id]))))
    eos = tokenizer.eos_token_id

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids).rstrip("\ufffd")  # an incomplete UTF-8 tail is not text yet

    return TokenEnforcerTokenizerData(tokens, decode, eos, use_bitmask=True, vocab_size=vocab_size)


class LMFEMatcher(GuideMatcher):
    def __init__(self, enforcer: TokenEnforcer, eos: int) -> None:
        self.enforcer, self.eos = enforcer, eos
        self.tokens: list[int] = []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self.enforcer.get_allowed_tokens(self.tokens).allowed_tokens

    def accept(self, token_id: int) -> bool:
        allowed = self.enforcer.get_allowed_tokens(self.tokens).is_token_allowed(token_id)
        self.tokens.append(token_id)
        return bool(allowed)

    def is_terminated(self) -> bool:
        return bool(self.tokens) and self.tokens[-1] == self.eos

    def rollback(self, num_tokens: int) -> None:
        del self.tokens[len(self.tokens) - num_tokens :]


class LMFEGuide(CompiledGuide):
    def __init__(self, backend: LMFormatEnforcerBackend, parser) -> None:
        self.backend, self.parser = backend, parser

    def matcher(self) -> GuideMatcher:
        return LMFEMatcher(TokenEnforcer(self.backend.data, self.parser), self.backend.tokenizer.eos_token_id)


class LMFormatEnforcerBackend(GuidedBackend):
    name = "lm-format-enforcer"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        super().__init__(tokenizer, vocab_size)
        self.data = tokenizer_data(tokenizer, vocab_size)

    def compile(self, params: GuidedDecodingParams) -> CompiledGuide:
        if params.whitespace_pattern is not None:
            raise UnsupportedConstraint("guided_whitespace_pattern is not supported by lm-format-enforcer")
        if params.disable_any_whitespace:
            raise UnsupportedConstraint("disable_any_whitespace is not supported by lm-format-enforcer")
        try:
            if params.kind == "json":
                return LMFEGuide(self, JsonSchemaParser(params.json))
            if params.kind == "json_object":
                return LMFEGuide(self, JsonSchemaParser({"type": "object"}))
            if params.kind == "regex":
                return LMFEGuide(self, RegexParser(params.regex))
        except Exception as exc:  # its parsers raise their own types (interegular's Unsupported, ...)
            raise ValueError(f"guided_{params.kind}: {type(exc).__name__}: {exc}") from None
        raise UnsupportedConstraint(f"{params.kind} constraints are not supported by lm-format-enforcer")
