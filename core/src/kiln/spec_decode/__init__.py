"""Speculative decoding: guess a few tokens ahead, check them all in one forward pass.

- ``config``: ``SpeculativeConfig`` (vLLM's ``--speculative-config`` JSON) and the older
  separate flags of seeds 001/003, folded into it;
- ``ngram``: prompt lookup, the proposer that needs no second model;
- ``stats``: drafted and accepted token counts, for ``/metrics`` and the log.

How a step runs with drafts: the scheduler asks the proposer for up to
``num_speculative_tokens`` drafts of each decoding request and schedules them after its
last token; the model runner returns logits for every one of those positions; the
executor verifies them (``kiln.worker.spec_verify``), and the scheduler appends the
accepted drafts and one more token, then rewinds ``num_computed_tokens`` past the
rejected ones (their K/V slots are overwritten by the next step).
"""
