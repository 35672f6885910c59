"""Reasoning formats: ``<think>...</think>`` (DeepSeek-R1, Qwen3), ``[THINK]...[/THINK]`` (Magistral)
and Granite's plain-text markers."""

from __future__ import annotations

from kiln.interfaces.parsers import ReasoningParser, partial_marker_suffix


class ThinkReasoningParser(ReasoningParser):
    """Reasoning between ``<think>`` and ``</think>``, the answer after.

    The opening tag may be missing from the output when the chat template already
    emitted it. ``implicit_start``: without any tag, the output counts as reasoning
    until ``</think>`` (DeepSeek-R1, whose template opens the block); otherwise an
    output without tags is all answer (Qwen3 with thinking off).
    """

    start, end = "<think>", "</think>"
    implicit_start = False

    @classmethod
    def markup(cls) -> tuple[str, ...]:
        return cls.start, cls.end

    def parse(self, text: str, final: bool) -> tuple[str, str]:
        body = text.lstrip()
        if not final and self.start.startswith(body):
            return "", ""  # nothing yet, or a partial opening tag
        opened = body.startswith(self.start)
        if opened:
            body = body[len(self.start) :]
        j = body.find(self.end)
        if j >= 0:
            return body[:j], body[j + len(self.end) :]
        if opened or self.implicit_start:
            return (body, "") if final else (body[: len(body) - partial_marker_suffix(body, self.end)], "")
        if final:
            return "", text
        # No tag yet: this may still be reasoning whose opening tag the template emitted.
        return "", ""


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    implicit_start = True


class Qwen3ReasoningParser(ThinkReasoningParser):
    implicit_start = False


class MistralReasoningParser(ThinkReasoningParser):
    """Magistral: ``[THINK]`` and ``[/THINK]``, control tokens of its tekken tokenizer; an output
    without them is all answer."""

    start, end = "[THINK]", "[/THINK]"
    implicit_start = False


class GraniteReasoningParser(ReasoningParser):
    """Granite 3.2: the output opens with ``Here is my thought process:``, then the reasoning,
    then ``Here is my response:`` and the answer. Any other output is all answer."""

    start, end = "Here is my thought process:", "Here is my response:"

    def parse(self, text: str, final: bool) -> tuple[str, str]:
        head = text.lstrip()
        if not head.startswith(self.start):
            could_start = self.start.startswith(head)
            return ("", "") if could_start and not final else ("", text)
        body = head[len(self.start) :]
        j = body.find(self.end)
        if j >= 0:
            return body[:j].lstrip(), body[j + len(self.end) :].lstrip()
        held = 0 if final else partial_marker_suffix(body, self.end)
        return body[: len(body) - held].lstrip(), ""
