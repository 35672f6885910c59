"""Kiln's own defaults, registered through the same hooks as any plugin."""

from __future__ import annotations

from kiln.hookspecs import hookimpl
from kiln.registry import AttentionBackendSpec

LLAMA = "kiln.models.llama:LlamaForCausalLM"
# Architecture -> the module of kiln.models that holds its class (of the same name).
DECODERS = {
    "Phi3ForCausalLM": "phi3",
    "GlmForCausalLM": "glm",
    "Glm4ForCausalLM": "glm",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "InternLM2ForCausalLM": "internlm2",
    "DeepseekV2ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLM": "deepseek",
    "MixtralForCausalLM": "moe",
    "Qwen2MoeForCausalLM": "moe",
    "Qwen3MoeForCausalLM": "moe",
}
# Architecture -> class in kiln.models.bert (RoBERTa is XLM-RoBERTa's network).
ENCODERS = {
    "BertModel": "BertModel",
    "BertForSequenceClassification": "BertForSequenceClassification",
    "XLMRobertaModel": "XLMRobertaModel",
    "XLMRobertaForSequenceClassification": "XLMRobertaForSequenceClassification",
    "RobertaModel": "XLMRobertaModel",
    "RobertaForSequenceClassification": "XLMRobertaForSequenceClassification",
}


@hookimpl
def register_attention_backends(register):
    register(AttentionBackendSpec("torch_ref", "kiln.attention.torch_ref:TorchRefAttentionBackend", ("*",)))


@hookimpl
def register_models(register):
    for family in ("Llama", "Mistral", "Ministral", "Qwen2", "Qwen3"):
        register(f"{family}ForCausalLM", LLAMA)
        register(f"{family}Model", "kiln.models.llama:LlamaModel")
    register("EagleLlamaForCausalLM", "kiln.models.eagle:EagleLlamaForCausalLM")  # --speculative-config eagle
    register("Eagle3LlamaForCausalLM", "kiln.models.eagle:Eagle3LlamaForCausalLM")  # eagle3
    for arch, module in DECODERS.items():
        register(arch, f"kiln.models.{module}:{arch}")
    for arch, cls in ENCODERS.items():
        register(arch, f"kiln.models.bert:{cls}")
