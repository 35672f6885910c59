"""The offline API: ``LLM(model).generate(...)`` and ``.chat(...)`` on the same engine as the server."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kiln.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine, PromptInput
from kiln.entrypoints.chat_rendering import chat_prompt
from kiln.entrypoints.llm_pooling import PoolingMixin
from kiln.lora.request import LoRARequest
from kiln.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from kiln.sampling_params import BeamSearchParams, SamplingParams

Messages = list[dict[str, Any]]


class LLM(PoolingMixin):
    """Generate text offline (and embed, classify and score: ``PoolingMixin``).

    >>> llm = LLM()  # the embedded SmolLM2-135M-Instruct on the best device
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=32))[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig.create(model=model, **engine_args))

    def get_tokenizer(self):
        return self.engine.model_info.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (strings, token-id lists, or ``{"prompt_token_ids": [...]}``) to completion, in order;
        ``lora_request``: one adapter for all prompts, or one (or None) per prompt (needs ``enable_lora``)."""
        if sampling_params is None:
            sampling_params = self.engine.default_sampling_params()
        return self._run(self._submit(prompts, sampling_params, "sampling_params", priority, lora_request))

    def _submit(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: Any,
        name: str,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[str]:
        """Queue each prompt with its params (one object for all, or a list with one each); a bad
        prompt rejects the whole call, leaving the engine clean. The request ids, in order."""
        prompts = _as_batch(prompts)
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{name}: got {len(params)} for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority: got {len(priority)} values for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                ids.append(
                    self.engine.add_request(
                        None, prompt, p, priority=priority[i] if priority else 0, lora_request=loras[i]
                    )
                )
        except ValueError:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return ids

    def beam_search(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search over each prompt, on the engine (beams share their KV blocks); the
        same hypotheses and scores as transformers' ``generate(num_beams=...)``."""
        decode = self.engine.model_info.tokenizer.decode
        results = []
        for out in self.generate(_as_batch(prompts), params.to_sampling_params(), lora_request=lora_request):
            sequences = []
            for c in out.outputs:
                tokens = out.prompt_token_ids + c.token_ids
                text = decode(tokens, skip_special_tokens=True)
                sequences.append(
                    BeamSearchSequence(tokens, [], c.cumulative_logprob, text, c.finish_reason, c.stop_reason)
                )
            results.append(BeamSearchOutput(sequences))
        return results

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template (or ``chat_template``) to each conversation and generate."""
        batch = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            {
                "prompt_token_ids": self.apply_chat_template(
                    conv, chat_template, add_generation_prompt, continue_final_message, chat_template_kwargs, tools
                )
            }
            for conv in batch
        ]
        return self.generate(prompts, sampling_params, lora_request=lora_request)

    def apply_chat_template(
        self,
        messages: Messages,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """The conversation's prompt tokens: rendered as the server renders it (in the bounded sandbox).

        Raises ``ChatTemplateError`` (a ``ValueError``) when the template fails or exceeds a bound.
        """
        tok = self.engine.model_info.tokenizer
        return chat_prompt(
            tok,
            messages,
            chat_template,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            variables=chat_template_kwargs,
        )[1]

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        while pending:
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
                    pending.discard(out.request_id)
        return [final[rid] for rid in request_ids]


def _as_batch(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [list(prompts)]
    return list(prompts)
