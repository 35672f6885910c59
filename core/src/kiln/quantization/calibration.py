"""Calibration samples for ``kiln quantize``: token-id rows of one length.

The default set is ``data/calibration.txt`` (shipped with Kiln, so nothing is
downloaded). ``-token FILE`` gives the samples as token ids instead: one sample per
line, ids separated by spaces or commas (a JSON list of lists is read too).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

DEFAULT_TEXT = Path(__file__).parent / "data" / "calibration.txt"


def read_token_file(path: str, vocab_size: int) -> list[list[int]]:
    """The samples in a ``-token`` file; a clear ``ValueError`` for anything else."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"-token: cannot read {path!r}: {exc}") from None
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"-token: {path!r} is not valid JSON: {exc}") from None
        if not all(isinstance(r, list) and all(isinstance(t, int) for t in r) for r in rows):
            raise ValueError(f"-token: {path!r} must hold a list of lists of token ids")
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            fields = line.replace(",", " ").split()
            if not fields:
                continue
            try:
                rows.append([int(f) for f in fields])
            except ValueError:
                raise ValueError(f"-token: line {number} of {path!r} is not a list of integer token ids") from None
    rows = [r for r in rows if r]
    if not rows:
        raise ValueError(f"-token: {path!r} holds no token ids")
    bad = next((t for r in rows for t in r if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"-token: token id {bad} is outside the model's vocabulary (0..{vocab_size - 1})")
    return rows


def calibration_samples(tokenizer, num_samples: int, seq_len: int, token_rows: list[list[int]] | None, seed: int = 0):
    """(num_samples, seq_len) token ids cut from one stream of the calibration data:
    consecutive windows while the stream lasts, then windows at seeded random offsets."""
    if token_rows is None:
        stream = tokenizer(DEFAULT_TEXT.read_text(), add_special_tokens=False)["input_ids"]
    else:
        stream = [t for row in token_rows for t in row]
    if len(stream) < seq_len:
        raise ValueError(f"calibration data has {len(stream)} tokens, fewer than --seq-len {seq_len}")
    stream = torch.tensor(stream, dtype=torch.long)
    starts = list(range(0, len(stream) - seq_len + 1, seq_len))[:num_samples]
    gen = torch.Generator().manual_seed(seed)
    extra = torch.randint(0, len(stream) - seq_len + 1, (num_samples - len(starts),), generator=gen)
    return torch.stack([stream[s : s + seq_len] for s in [*starts, *extra.tolist()]])
