"""Helpers for tests of speculative decoding, on any platform.

Tiny random-weight models seldom repeat themselves, so n-gram lookup would rarely propose
a token they accept. ``ReplayProposer`` stands in for the proposer: it offers what a
run without speculation produced, with every ``wrong_every``-th draft changed, so steps
accept all, some or none of their drafts and the verification path is driven through each
case on the model under test. ``build_eagle_head`` and ``build_eagle3_head`` write random
EAGLE-1 and EAGLE-3 heads for a model.
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


def record_proposals(draft) -> list[tuple[list[int], list[int]]]:
    """Have a draft model (an engine's ``executor.draft``) record, at every fill, each drafting
    request's tokens so far and the drafts it proposed after them, in the returned list."""
    proposed, fill = [], draft.fill

    def record(scheduled):
        fill(scheduled)
        proposed.extend(
            (list(req.all_token_ids), list(req.spec_token_ids)) for req, _ in scheduled.scheduled if req.spec_token_ids
        )

    draft.fill = record
    return proposed


def greedy_with_proposals(plugins, prompts: list[list[int]], max_tokens: int = 8, **engine_args: Any):
    """Greedy outputs of ``prompts`` on an engine with a draft model or head, and every step's
    proposals (``record_proposals``); the engine is shut down afterwards."""
    from kiln.testing.engine import make_engine, run_greedy

    engine = make_engine(plugins, **engine_args)
    try:
        proposed = record_proposals(engine.executor.draft)
        return run_greedy(engine, prompts, max_tokens), proposed
    finally:
        engine.shutdown()


def check_exact_under_preemption(target: str, speculative_config: dict, **engine_args: Any) -> None:
    """Four 30-token prompts, 40 greedy tokens each, on a cache of 12 blocks and a 16-token budget:
    requests are preempted (asserted) and the outputs equal decoding without drafts."""
    from kiln import LLM, SamplingParams

    tight = dict(engine_args, num_gpu_blocks_override=12, max_num_batched_tokens=16)
    prompts = [{"prompt_token_ids": list(range(100 + 10 * i, 130 + 10 * i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    spec = LLM(target, speculative_config=speculative_config, **tight)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert got == [o.outputs[0].token_ids for o in LLM(target, **tight).generate(prompts, params)]
    assert spec.engine.core.scheduler.num_preemptions > 0


def build_eagle_head(target: str, folder: str | os.PathLike, seed: int = 0) -> tuple[str, dict]:
    """A random EAGLE-1 head for the model in ``target``, written as its authors publish heads
    (a one-layer ``LlamaForCausalLM`` config; ``pytorch_model.bin`` with ``fc.*``, ``layers.0.*``
    without an input norm, and a copy of the target's embeddings) into ``folder``; returns the
    folder and the weights."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from kiln.models.loader import transformers_model

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
    embeddings = transformers_model(AutoModelForCausalLM, target).get_input_embeddings().weight
    weights["embed_tokens.weight"] = embeddings.detach().clone()
    torch.save(weights, folder / "pytorch_model.bin")
    return str(folder), weights


def build_eagle3_head(
    target: str,
    folder: str | os.PathLike,
    seed: int = 0,
    draft_vocab_size: int | None = None,
    layer_ids: list[int] | None = None,
    embeddings: bool = False,
) -> tuple[str, dict]:
    """A random EAGLE-3 head for the model in ``target``, written as its authors publish heads
    (a one-layer ``LlamaForCausalLMEagle3`` config with ``draft_vocab_size``; ``midlayer.*``
    whose q/k/v read twice the hidden size, ``hidden_norm``, ``fc`` over three layers' states,
    ``norm``, an LM head over the draft vocabulary and its maps ``d2t`` / ``t2d``) into
    ``folder``, as safetensors. The draft vocabulary is a random subset of the target's (all of
    it when ``draft_vocab_size`` is None); ``layer_ids`` go into the config as
    ``eagle_aux_hidden_state_layer_ids``; ``embeddings`` adds a copy of the target's. Returns the
    folder and the weights."""
    import torch
    from safetensors.torch import save_file

    folder = Path(folder)
    config = json.loads((Path(target) / "config.json").read_text())
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    draft_vocab = draft_vocab_size or vocab
    config.update(num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab)
    if layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = layer_ids
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {
        "self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
        "self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "self_attn.o_proj.weight": (hidden, heads * head_dim),
        "mlp.gate_proj.weight": (config["intermediate_size"], hidden),
        "mlp.up_proj.weight": (config["intermediate_size"], hidden),
        "mlp.down_proj.weight": (hidden, config["intermediate_size"]),
    }
    weights = {f"midlayer.{name}": torch.randn(shape, generator=gen) * 0.2 for name, shape in shapes.items()}
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        weights[f"{norm}.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
    weights["fc.weight"] = torch.randn(hidden, 3 * hidden, generator=gen) * 0.1
    weights["lm_head.weight"] = torch.randn(draft_vocab, hidden, generator=gen) * 0.5
    kept = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    weights["d2t"] = kept - torch.arange(draft_vocab)
    weights["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill(0, kept, True)
    if embeddings:
        weights["embed_tokens.weight"] = torch.randn(vocab, hidden, generator=gen)
    save_file(weights, folder / "model.safetensors")
    return str(folder), weights
