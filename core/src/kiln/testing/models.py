"""Tiny random-weight Hugging Face models built on the fly, for fast exact-match tests."""

from __future__ import annotations

import os
from pathlib import Path

# Small shapes that still exercise GQA, qkv bias and q/k norm. Head size 64 is what
# real models use (and what fast kernels specialise on); qwen2 keeps 16 so the
# generic code paths run too.
TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=64),
    "mistral": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=64),
}


def build_tiny_model(
    model_type: str, path: str | os.PathLike, tokenizer_dir: str, *, seed: int = 0, **overrides: object
) -> str:
    """Save a 2-layer, hidden-64 ``model_type`` model with random fp32 weights and the
    tokenizer from ``tokenizer_dir`` into ``path``; returns the folder. ``overrides`` replace
    config entries (e.g. ``sliding_window=8``); those that add no parameters leave the
    weights as they are without them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if (path / "config.json").exists():
        return str(path)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        # Wide weights give peaked logits, so greedy ties cannot flip on rounding.
        initializer_range=0.2,
        tie_word_embeddings=model_type in ("qwen2", "qwen3"),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **{**TINY_CONFIGS[model_type], **overrides},
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def hf_greedy(
    model_dir: str, prompts: list[list[int]], max_new_tokens: int, stop_at_eos: bool = False
) -> list[list[int]]:
    """Reference: Hugging Face ``generate`` greedy, one prompt at a time, fp32.

    Unless ``stop_at_eos``, EOS is suppressed so every output is ``max_new_tokens`` long."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            gen = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                min_new_tokens=0 if stop_at_eos else max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(gen[0, len(ids) :].tolist())
    return out
