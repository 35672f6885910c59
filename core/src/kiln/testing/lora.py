"""Random PEFT LoRA adapters for tests, and the transformers + PEFT reference output."""

from __future__ import annotations

import os
from pathlib import Path

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_lora_adapter(
    base_dir: str,
    path: str | os.PathLike,
    *,
    rank: int = 8,
    alpha: float = 16,
    targets: list[str] | None = None,
    seed: int = 0,
    std: float = 0.2,
    **lora_config: object,
) -> str:
    """Save a PEFT LoRA adapter for the model at ``base_dir`` into ``path`` (returned), with
    random A and B (PEFT starts B at zero, which would change nothing). ``lora_config`` adds
    ``LoraConfig`` fields (``use_rslora``, ``lora_bias``, ``rank_pattern``...)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from kiln.models.loader import transformers_model

    path = Path(path)
    if (path / "adapter_config.json").exists():
        return str(path)
    base = transformers_model(AutoModelForCausalLM, base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, lora_dropout=0.0, **lora_config
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(path)
    return str(path)


def hf_lora_greedy(
    base_dir: str, adapter_dir: str | None, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Reference: transformers greedy (EOS suppressed) with the adapter merged into the base
    weights by PEFT (``merge_and_unload``); the base model alone for ``adapter_dir`` None."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from kiln.models.loader import transformers_model
    from kiln.testing.models import greedy_with

    model = transformers_model(AutoModelForCausalLM, base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    return greedy_with(model.eval(), prompts, max_new_tokens)
