"""The scheduler's side of a draft model: it reserves draft positions, the executor fills them."""

from __future__ import annotations

PENDING = -1  # a reserved draft position the draft model has not filled yet


class DraftSlots:
    """Reserves ``max_tokens`` draft positions per decoding sequence (``PENDING`` ids) that
    ``kiln.worker.draft_model.DraftModel`` fills with the draft model's tokens before the step's
    forward pass. The same interface as ``NgramProposer``."""

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        return [PENDING] * max_tokens

    def free(self, request_id: str) -> None:
        pass
