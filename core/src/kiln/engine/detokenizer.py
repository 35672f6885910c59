"""Incremental detokenization and stop strings.

Text grows by ``tokenizers``' ``DecodeStream`` (which holds back incomplete UTF-8
byte sequences), seeded with the tail of the prompt so the first output token
keeps its leading space; a tokenizer without a ``tokenizers`` backend (mistral_common's)
decodes a short window of ids instead (``DecodeWindow``). With ``skip_special_tokens=False``,
special tokens are spliced in whole, separated by spaces when ``spaces_between_special_tokens``;
those a tool or reasoning parser reads as markup (``SamplingParams._kept_special_ids``) are
spliced in whole always.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from kiln.engine.tokenizer import special_ids
from kiln.sampling_params import SamplingParams

PROMPT_CONTEXT_TOKENS = 6


class DecodeWindow:
    """``DecodeStream``'s steps through ``tokenizer.decode`` alone, as vLLM detokenizes with
    slow tokenizers: the window is the ids emitted by the last emission (at first, the
    prompt's tail) and those since; a step returns what its id added to the window's text, or
    "" while that text ends in an incomplete UTF-8 sequence (U+FFFD) and the id waits."""

    def __init__(self, tokenizer, context: list[int]) -> None:
        # No special id enters the window; skip_special_tokens would also let mistral_common
        # strip a leading "lang:xx" from the text.
        self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
        self.ids = list(context)  # the window
        self.read = len(self.ids)  # the window's ids before this are emitted
        self.before = self.decode(self.ids)  # their text

    def step(self, _backend, token_id: int) -> str:
        self.ids.append(token_id)
        after = self.decode(self.ids)
        if after.endswith("\ufffd") or len(after) <= len(self.before):
            return ""
        new = after[len(self.before) :]
        del self.ids[: self.read]
        self.read = len(self.ids)
        self.before = self.decode(self.ids)
        return new


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.special_ids = special_ids(tokenizer)
        self.skip_special = params.skip_special_tokens
        self.kept = params._kept_special_ids
        self.spaces = params.spaces_between_special_tokens and not params.skip_special_tokens
        self.convert = tokenizer.convert_ids_to_tokens
        context = [t for t in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:] if t not in self.special_ids]
        self.stream = (
            DecodeWindow(tokenizer, context)
            if self.backend is None
            else DecodeStream(ids=context, skip_special_tokens=self.skip_special)
        )
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self._after_special = False

    def update(self, token_ids: list[int], check_stop: bool = True) -> str | None:
        """Append tokens; return the stop string if one now appears (the text is cut there).

        ``check_stop=False`` (before ``min_tokens``) only appends."""
        start = len(self.text)
        for tid in token_ids:
            if tid in self.special_ids:
                if not self.skip_special or tid in self.kept:
                    sep = " " if self.spaces and self.text else ""
                    self.text += sep + self.convert(tid)
                    self._after_special = True
                continue
            chunk = self.stream.step(self.backend, tid)
            if chunk:
                if self._after_special and self.spaces and not chunk.startswith(" "):
                    chunk = " " + chunk
                self.text += chunk
                self._after_special = False
        return self._check_stop(start) if self.stop and check_stop else None

    def _check_stop(self, new_from: int) -> str | None:
        search_from = max(0, new_from - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, search_from)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
        return s

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: while running, hold back what could start a stop string."""
        if finished or self.include_stop or not self.max_stop_len:
            return self.text
        return self.text[: max(0, len(self.text) - self.max_stop_len + 1)]


def detokenized(tokenizer, token_ids: list[int], params: SamplingParams) -> str:
    """The text ``IncrementalDetokenizer`` makes of output ``token_ids`` (no prompt before them)."""
    detokenizer = IncrementalDetokenizer(tokenizer, [], params)
    detokenizer.update(token_ids, check_stop=False)
    return detokenizer.text
