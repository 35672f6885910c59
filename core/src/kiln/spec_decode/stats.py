"""Counts of drafted and accepted tokens, named as vLLM's ``spec_decode`` metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    """Totals since start: verified drafts (one per sequence per step with drafts), their
    tokens, the tokens accepted, and accepted tokens by draft position (0 = first)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified draft: the accepted ones and the one sampled after them."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def since(self, before: SpecDecodeStats | None) -> SpecDecodeStats:
        """The counts added after ``before`` (a copy taken earlier; None: since start, a copy)."""
        before = before or SpecDecodeStats()
        per_pos = [n - (before.accepted_per_pos[i] if i < len(before.accepted_per_pos) else 0)
                   for i, n in enumerate(self.accepted_per_pos)]  # fmt: skip
        return SpecDecodeStats(
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            per_pos,
        )

    def plus(self, other: SpecDecodeStats) -> SpecDecodeStats:
        """The counts of both (e.g. of several runs)."""
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        per_pos = [sum(s.accepted_per_pos[i] for s in (self, other) if i < len(s.accepted_per_pos)) for i in range(n)]
        return SpecDecodeStats(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
            per_pos,
        )

    def summary(self) -> str:
        """One log line, as vLLM's periodic speculative-decoding line."""
        per_pos = ", ".join(f"{n / self.num_drafts:.2f}" for n in self.accepted_per_pos) if self.num_drafts else "-"
        return (
            f"speculative decoding: mean acceptance length {self.mean_acceptance_length:.2f}, accepted "
            f"{self.num_accepted_tokens} of {self.num_draft_tokens} draft tokens ({100 * self.acceptance_rate:.1f}%), "
            f"per-position acceptance rate {per_pos}"
        )
