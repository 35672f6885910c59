"""EAGLE-3 heads (``--speculative-config '{"method": "eagle3", ...}'``) in the published layout:
a random head over a tiny Llama proposes what the head computes from three of the target's
layers (checked against transformers' attention, MLP and norms wired as the paper wires
them, on transformers' own hidden states), and greedy and seeded outputs stay the target's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from kiln import LLM, SamplingParams
from kiln.testing.spec_decode import build_eagle3_head, check_exact_under_preemption, record_proposals
from kiln.worker.eagle import CATCH_UP_ROWS, EagleDraft

ENGINE = dict(dtype="float32", max_model_len=128, block_size=16)
PROMPTS = [[1000, 7, 9], list(range(100, 119)), [5, 6, 7, 8, 9] * 3]


def eagle3_config(path: str, k: int = 3) -> dict:
    return {"method": "eagle3", "model": path, "num_speculative_tokens": k}


class ReferenceHead(torch.nn.Module):
    """The head's one layer from transformers' parts: attention over [normed embedding; normed
    feature] (q/k/v twice as wide), the feature as the residual, then the MLP."""

    def __init__(self, cfg: LlamaConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attn = LlamaAttention(cfg, 0)
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self.attn, name, torch.nn.Linear(2 * hidden, getattr(self.attn, name).out_features, bias=False))
        self.mlp = LlamaMLP(cfg)
        self.input_norm, self.hidden_norm = LlamaRMSNorm(hidden, eps), LlamaRMSNorm(hidden, eps)
        self.post_norm, self.norm = LlamaRMSNorm(hidden, eps), LlamaRMSNorm(hidden, eps)
        self.fc = torch.nn.Linear(3 * hidden, hidden, bias=False)
        self.lm_head = torch.nn.Linear(hidden, len(weights["d2t"]), bias=False)
        renamed = {"midlayer.input_layernorm": "input_norm", "midlayer.hidden_norm": "hidden_norm",
                   "midlayer.post_attention_layernorm": "post_norm", "midlayer.self_attn": "attn",
                   "midlayer.mlp": "mlp"}  # fmt: skip
        state = {}
        for name, value in weights.items():
            for old, new in renamed.items():
                name = name.replace(old, new)
            state[name] = value
        self.load_state_dict({k: v for k, v in state.items() if k in self.state_dict()})
        self.to_target = torch.arange(len(weights["d2t"])) + weights["d2t"]
        self.rope = LlamaRotaryEmbedding(cfg)
        self.residual_normed = False  # the config's norm_before_residual

    def forward(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        n = len(embeds)
        x = torch.cat([self.input_norm(embeds), self.hidden_norm(features)], dim=-1)[None]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.attn(x, position_embeddings=self.rope(x, positions), attention_mask=mask)[0][0]
        residual = (self.hidden_norm(features) if self.residual_normed else features) + out
        return residual + self.mlp(self.post_norm(residual))


def reference_drafts(
    target: str, weights: dict, prompt: list[int], k: int, layers: list[int], own_embed: bool, residual_normed: bool
) -> list[int]:
    """The drafts after the target's greedy token following ``prompt``. Row i reads (embedding
    of token i + 1, fc of the target's inputs to ``layers`` at i); each draft appends a row of
    itself and the head's previous output before its final norm."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    head = ReferenceHead(LlamaConfig(**{**model.config.to_dict(), "num_hidden_layers": 1}), weights)
    head.residual_normed = residual_normed
    embed = weights["embed_tokens.weight"] if own_embed else model.model.embed_tokens.weight
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_hidden_states=True)
        features = head.fc(torch.cat([out.hidden_states[i][0] for i in layers], dim=-1))  # inputs of those layers
        tokens = prompt[1:] + [int(out.logits[0, -1].argmax())]
        drafts = []
        for _ in range(k):
            n = len(tokens)
            last = head(embed[torch.tensor(tokens)], features[:n])[-1]
            drafts.append(int(head.to_target[head.lm_head(head.norm(last)).argmax()]))
            tokens.append(drafts[-1])
            features = torch.cat([features[:n], last[None]])
    return drafts


@pytest.mark.parametrize(
    "layers, own_embed, draft_vocab, residual_normed",
    [(None, False, 300, False), ([4, 0, 6], True, None, True)],
    ids=["authors-layers-small-vocab", "config-layers-own-embeddings-normed-residual"],
)
def test_eagle3_proposes_what_the_head_computes(
    tiny_model_dir, tmp_path, layers, own_embed, draft_vocab, residual_normed
):
    """Every step's drafts, given the tokens so far, equal the reference's."""
    target = tiny_model_dir("llama", num_hidden_layers=7)
    path, weights = build_eagle3_head(target, tmp_path / "eagle3", 0, draft_vocab, layers, own_embed)
    if residual_normed:
        config = json.loads((Path(path) / "config.json").read_text())
        (Path(path) / "config.json").write_text(json.dumps({**config, "norm_before_residual": True}))
    llm = LLM(target, speculative_config=eagle3_config(path), **ENGINE)
    assert isinstance(llm.engine.executor.draft, EagleDraft)
    read = sorted(layers or [2, 3, 4])  # the authors' choice for 7 layers: 2, L // 2, L - 3; gathered in layer order
    assert llm.engine.executor.runner.model.aux_layers == tuple(read)
    proposed = record_proposals(llm.engine.executor.draft)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params)
    assert len(proposed) >= 2 * len(PROMPTS)
    for tokens, drafts in proposed:
        want = reference_drafts(target, weights, tokens[:-1], 3, read, own_embed, residual_normed)
        assert drafts == want[: len(drafts)]
    if draft_vocab:
        allowed = set((torch.arange(draft_vocab) + weights["d2t"]).tolist())
        assert all(token in allowed for _, drafts in proposed for token in drafts)


def test_eagle3_keeps_greedy_and_seeded_outputs(tiny_model_dir, tmp_path):
    """Exact whatever the head proposes, with catch-up in passes of 16 tokens and preemption."""
    target = tiny_model_dir("llama", num_hidden_layers=3)
    path, weights = build_eagle3_head(target, tmp_path / "eagle3", seed=1, draft_vocab_size=500, layer_ids=[2, 0, 1])
    plain, spec = LLM(target, **ENGINE), LLM(target, speculative_config=eagle3_config(path, 4), **ENGINE)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=24, ignore_eos=True, logprobs=2)
    for params in (greedy, seeded):
        want = plain.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        got = spec.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert spec.engine.core.scheduler.spec_stats.num_draft_tokens > 0
    draft = spec.engine.executor.draft
    assert draft.features == {} and draft.seen == {}
    check_exact_under_preemption(target, eagle3_config(path), **ENGINE)
    # Drafts off while more than 2 requests run: the states kept for them are caught up on every
    # CATCH_UP_ROWS tokens instead of piling up, and once two have finished the others' drafts
    # are the head's over everything it caught up on.
    busy = LLM(target, speculative_config={**eagle3_config(path), "disable_by_batch_size": 2}, **ENGINE)
    draft, kept = busy.engine.executor.draft, []
    proposed = record_proposals(draft)
    fill = draft.fill

    def check(scheduled):
        fill(scheduled)
        kept.append(max(draft._kept(req) for req, _ in scheduled.scheduled))

    draft.fill = check
    prompts = [{"prompt_token_ids": list(range(100 + 10 * i, 110 + 10 * i))} for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 45, 100, 100)]
    got = [o.outputs[0].token_ids for o in busy.generate(prompts, params)]
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert len(kept) > 2 * CATCH_UP_ROWS and max(kept) < CATCH_UP_ROWS
    assert len(proposed) > 10 and all(len(tokens) > 50 for tokens, _ in proposed)  # only after the first two ended
    for tokens, drafts in proposed:
        assert drafts == reference_drafts(target, weights, tokens[:-1], 3, [0, 1, 2], False, False)[: len(drafts)]


def test_eagle3_settings_are_checked(tiny_model_dir, tmp_path):
    target = tiny_model_dir("llama")  # two layers: the authors' choice (2, 1, -1) does not exist
    path, _ = build_eagle3_head(target, tmp_path / "default")
    with pytest.raises(ValueError, match=r"reads target layers \[2, 1, -1\]; it needs three different ones"):
        LLM(target, speculative_config=eagle3_config(path), **ENGINE)
    deeper = tiny_model_dir("llama", num_hidden_layers=3)
    path, _ = build_eagle3_head(deeper, tmp_path / "ok", layer_ids=[0, 1, 2])
    with pytest.raises(ValueError, match="does not expose; use --model-impl kiln"):
        LLM(deeper, speculative_config=eagle3_config(path), model_impl="transformers", **ENGINE)
    wide = tiny_model_dir("llama", hidden_size=96, head_dim=16)
    with pytest.raises(ValueError, match="reads hidden states of size 64, the target's are 96"):
        LLM(wide, speculative_config=eagle3_config(path), **ENGINE)
    # A head alone, or as a draft model: refused at once (it reads a target's layers).
    for arch in ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"):
        config = json.loads((Path(path) / "config.json").read_text())
        (Path(path) / "config.json").write_text(json.dumps({**config, "architectures": [arch]}))
        with pytest.raises(ValueError, match=f"model: {arch} is an EAGLE head, which only drafts for its target"):
            LLM(path, **ENGINE)
        draft = {"method": "draft_model", "model": path, "num_speculative_tokens": 2}
        with pytest.raises(ValueError, match=f"--speculative-config: {arch} is an EAGLE head"):
            LLM(deeper, speculative_config=draft, **ENGINE)
    with pytest.raises(ValueError, match="Eagle3LlamaForCausalLM is an EAGLE-3 head; use method eagle3"):
        LLM(deeper, speculative_config={**eagle3_config(path), "method": "eagle"}, **ENGINE)
    # A draft vocabulary smaller than the target's, without the map saying which tokens.
    path, weights = build_eagle3_head(deeper, tmp_path / "no-map", draft_vocab_size=300, layer_ids=[0, 1, 2])
    del weights["d2t"]
    save_file(weights, Path(path) / "model.safetensors")
    with pytest.raises(ValueError, match="drafts over 300 of .* tokens but its checkpoint has no d2t"):
        LLM(deeper, speculative_config=eagle3_config(path), **ENGINE)
