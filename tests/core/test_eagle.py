"""EAGLE-1 heads (``--speculative-config '{"method": "eagle", ...}'``) in the published layout: a
random head over a tiny Llama proposes what the head computes (checked against transformers'
decoder layer fed as the paper feeds it), and greedy and seeded outputs stay the target's."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from kiln import LLM, BeamSearchParams, SamplingParams
from kiln.testing.spec_decode import build_eagle_head, check_exact_under_preemption, record_proposals
from kiln.worker.eagle import EagleDraft

ENGINE = dict(dtype="float32", max_model_len=128, block_size=16)
PROMPTS = [[1000, 7, 9], list(range(100, 119)), [5, 6, 7, 8, 9] * 3]


def eagle_config(path: str, k: int = 3) -> dict:
    return {"method": "eagle", "model": path, "num_speculative_tokens": k}


def reference_drafts(target: str, head: dict[str, torch.Tensor], prompt: list[int], k: int) -> list[int]:
    """What the paper's head proposes after the target's greedy token following ``prompt``: row i
    reads (embedding of token i + 1, the target's last hidden state at i); each draft appends a
    row of itself and the head's previous output."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    cfg = LlamaConfig(**{**model.config.to_dict(), "num_hidden_layers": 1})
    layer = LlamaDecoderLayer(cfg, 0)
    layer.load_state_dict({k[9:]: v for k, v in head.items() if k.startswith("layers.0.")}, strict=False)
    layer.input_layernorm = torch.nn.Identity()
    rope = LlamaRotaryEmbedding(cfg)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        features = model.model(ids).last_hidden_state[0]
        tokens = prompt[1:] + [int(model(ids).logits[0, -1].argmax())]
        drafts = []
        for _ in range(k):
            n = len(tokens)
            x = torch.cat([model.model.embed_tokens(torch.tensor(tokens)), features[:n]], dim=-1)
            x = (x @ head["fc.weight"].T + head["fc.bias"])[None]
            positions = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rope(x, positions))
            out = out[0] if isinstance(out, tuple) else out
            last = out[0, -1]
            drafts.append(int(model.lm_head(last).argmax()))
            tokens.append(drafts[-1])
            features = torch.cat([features[:n], last[None]])
    return drafts


def test_eagle_proposes_what_the_head_computes(tiny_model_dir, tmp_path):
    target = tiny_model_dir("llama")
    path, head = build_eagle_head(target, tmp_path / "eagle")
    llm = LLM(target, speculative_config=eagle_config(path), **ENGINE)
    draft = llm.engine.executor.draft
    assert isinstance(draft, EagleDraft) and llm.engine.executor.runner.keep_features
    proposed = record_proposals(draft)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params)
    assert len(proposed) >= 2 * len(PROMPTS)
    for tokens, drafts in proposed:  # every step's drafts, given the tokens so far
        assert drafts == reference_drafts(target, head, tokens[:-1], 3)[: len(drafts)]


def test_eagle_keeps_greedy_and_seeded_outputs(tiny_model_dir, tmp_path):
    """Exact whatever the head proposes: greedy and seeded outputs equal decoding without drafts,
    also when the head catches up in passes of 16 tokens and sequences are preempted."""
    target = tiny_model_dir("llama")
    path, _ = build_eagle_head(target, tmp_path / "eagle", seed=1)
    plain, spec = LLM(target, **ENGINE), LLM(target, speculative_config=eagle_config(path, 4), **ENGINE)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=24, ignore_eos=True, logprobs=2)
    wanted = []
    for params in (greedy, seeded):
        want = plain.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        got = spec.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        wanted.append(want)
    assert spec.engine.core.scheduler.spec_stats.num_draft_tokens > 0
    draft = spec.engine.executor.draft
    assert draft.features == {} and draft.seen == {}  # freed with their requests
    spec.beam_search([{"prompt_token_ids": PROMPTS[1]}], BeamSearchParams(beam_width=3, max_tokens=6))
    assert draft.features == {}  # beams never draft: their hidden states are not kept
    # Hidden states lost (never expected): the request drafts its last token, outputs stay the same.
    fill = draft.fill

    def forgetful(scheduled):
        draft.features.clear()
        fill(scheduled)

    draft.fill = forgetful
    got = spec.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in wanted[0]]
    check_exact_under_preemption(target, eagle_config(path), **ENGINE)


def test_eagle_settings_are_checked(tiny_model_dir, tmp_path):
    target = tiny_model_dir("llama")
    other = tmp_path / "wide"
    shutil.copytree(tiny_model_dir("llama", hidden_size=96, head_dim=16), other)
    with pytest.raises(ValueError, match=r"the EAGLE head reads hidden states of size 96, the target's are 64"):
        LLM(target, speculative_config=eagle_config(str(other)), **ENGINE)
    headless = tmp_path / "headless"
    shutil.copytree(target, headless)
    config = (headless / "config.json").read_text().replace('"LlamaForCausalLM"', '"LlamaModel"')
    (headless / "config.json").write_text(config)
    draft = {"method": "draft_model", "model": str(headless), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="is not a causal language model"):
        LLM(target, speculative_config=draft, **ENGINE)
    with pytest.raises(ValueError, match="eagle: the draft's folder"):
        LLM(target, speculative_config={"method": "eagle", "num_speculative_tokens": 2}, **ENGINE)
    with pytest.raises(ValueError, match="'medusa' is not implemented yet"):
        LLM(target, speculative_config={"method": "medusa", "model": "x", "num_speculative_tokens": 2}, **ENGINE)
