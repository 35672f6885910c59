"""Helpers for tests of speculative decoding, on any platform.

Tiny random-weight models seldom repeat themselves, so n-gram lookup would rarely propose
a token they accept. ``ReplayProposer`` stands in for the proposer: it offers what a
run without speculation produced, with every ``wrong_every``-th draft changed, so steps
accept all, some or none of their drafts and the verification path is driven through each
case on the model under test. ``build_eagle_head`` writes a random EAGLE-1 head for a model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class ReplayProposer:
    """Drafts taken from reference outputs (prompt tokens -> output tokens), some made wrong."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], wrong_every: int = 7) -> None:
        self.references = references
        self.wrong_every = wrong_every

    @classmethod
    def of(cls, prompts: list[list[int]], outputs: list[list[int]], wrong_every: int = 7) -> ReplayProposer:
        """Replaying ``outputs[i]`` after ``prompts[i]``."""
        return cls({tuple(p): list(out) for p, out in zip(prompts, outputs)}, wrong_every)

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        for prompt, output in self.references.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                drafts = output[done : done + max_tokens]
                return [t + 1 if (done + i) % self.wrong_every in (0, 3) else t for i, t in enumerate(drafts)]
        return []

    def free(self, request_id: str) -> None:
        pass


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def replayed_greedy(plugins, prompts: list[list[int]], max_tokens: int = 8, **engine_args: Any):
    """Greedy outputs of ``prompts`` without speculation, then with ``ReplayProposer`` drafts
    verified on an engine built from ``engine_args``: (reference, speculative, that engine)."""
    from kiln.testing.engine import greedy_tokens, make_engine, run_greedy

    reference = greedy_tokens(plugins, prompts, max_tokens, **engine_args)
    engine = make_engine(plugins, speculative_config=NGRAM, **engine_args)
    engine.core.scheduler.proposer = ReplayProposer.of(prompts, reference)
    return reference, run_greedy(engine, prompts, max_tokens), engine


def build_eagle_head(target: str, folder: str | os.PathLike, seed: int = 0) -> tuple[str, dict]:
    """A random EAGLE-1 head for the model in ``target``, written as its authors publish heads
    (a one-layer ``LlamaForCausalLM`` config; ``pytorch_model.bin`` with ``fc.*``, ``layers.0.*``
    without an input norm, and a copy of the target's embeddings) into ``folder``; returns the
    folder and the weights."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    folder = Path(folder)
    config = json.loads((Path(target) / "config.json").read_text())
    config.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"])
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(seed)
    layer = LlamaDecoderLayer(LlamaConfig(**config), 0)
    weights = {f"layers.0.{k}": v for k, v in layer.state_dict().items() if not k.startswith("input_layernorm")}
    for name, value in weights.items():  # norms near 1, projections small
        weights[name] = torch.randn_like(value) * (0.2 if "proj" in name else 0.1) + (1.0 if "norm" in name else 0.0)
    hidden = config["hidden_size"]
    weights["fc.weight"] = torch.randn(hidden, 2 * hidden) * 0.1
    weights["fc.bias"] = torch.randn(hidden) * 0.1
    embeddings = AutoModelForCausalLM.from_pretrained(target).get_input_embeddings().weight
    weights["embed_tokens.weight"] = embeddings.detach().clone()
    torch.save(weights, folder / "pytorch_model.bin")
    return str(folder), weights
