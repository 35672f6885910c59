"""N-gram prompt lookup: propose what followed the last time the sequence said what it just said.

For each sequence the proposer keeps a table from every n-gram (``prompt_lookup_min`` ..
``prompt_lookup_max`` tokens) to the position where it last ended, extended by the tokens
added since the previous call, so each call costs a few dict lookups rather than a scan of
the context. The longest n with an earlier occurrence wins; the proposal is the tokens that
followed that occurrence. Pure Python, no tensors: it runs in the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class _Lookup:
    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> index of its last token
    indexed: int = 0  # n-grams ending before this index are in the table


class NgramProposer:
    """Prompt-lookup drafts for sequences known by id (``free`` forgets one)."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self.tables: dict[str, _Lookup] = {}

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` drafts to follow ``token_ids`` (empty: no earlier occurrence)."""
        table = self.tables.setdefault(request_id, _Lookup())
        last = len(token_ids) - 1
        # Index the n-grams ending before the last token: an occurrence must be earlier than the suffix.
        for end in range(table.indexed, last):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                table.last_end[tuple(token_ids[end - n + 1 : end + 1])] = end
        table.indexed = max(table.indexed, last)
        for n in range(min(self.max_n, last), self.min_n - 1, -1):
            end = table.last_end.get(tuple(token_ids[last - n + 1 :]))
            if end is not None:
                return token_ids[end + 1 : end + 1 + max_tokens]
        return []

    def free(self, request_id: str) -> None:
        self.tables.pop(request_id, None)
