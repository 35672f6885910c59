"""``POST /v1/completions`` (legacy logprobs shape, echo, fill-in-the-middle, several prompts per request)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from kiln.engine.async_engine import EngineDeadError, RequestStream
from kiln.entrypoints.openai.protocol import APIError, CompletionRequest
from kiln.entrypoints.openai.serving import OpenAIServing, Prompt, new_id, now, sse
from kiln.outputs import PositionLogprobs, RequestOutput

# Fill-in-the-middle marker tokens (prefix, suffix, middle) of the tokenizer families that have them.
FIM_MARKERS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder, SmolLM (v1)
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3
    ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"),  # DeepSeek-Coder
)


class CompletionServing(OpenAIServing):
    async def create(self, req: CompletionRequest, raw: HTTPRequest):
        lora = await self.resolve_model(req.model)
        model_name = self.models.model_name(lora)
        self.check_unsupported(req)
        prompts = self.prompts(req)
        if req.suffix is not None:
            prompts = self.fill_in_the_middle(req, prompts)
        prompts = [self.truncate(p, req) for p in prompts]
        prompt_logprobs = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)
        items = [
            (p, self.sampling_params(req, len(p.token_ids), req.max_tokens, req.logprobs, prompt_logprobs))
            for p in prompts
        ]
        await self.compile_guide(items[0][1])  # every prompt shares the constraint
        request_id = new_id("cmpl", req.request_id)
        streams = self.start(request_id, items, req.priority, lora)
        if req.stream:
            chunks = self.stream(req, request_id, prompts, streams, model_name)
            return StreamingResponse(chunks, media_type="text/event-stream")
        outputs = await self.final_outputs(streams, raw, model_name)
        choices = []
        for p, (prompt, out) in enumerate(zip(prompts, outputs)):
            for c in out.outputs:
                text, ids, positions = self.with_echo(req, prompt, out, c.text, c.token_ids, c.logprobs)
                choices.append(
                    {
                        "index": p * req.n + c.index,
                        "text": text,
                        "logprobs": self.legacy_logprobs(req, ids, positions, 0)[0],
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                        "prompt_logprobs": self.prompt_logprobs_json(out) if req.prompt_logprobs is not None else None,
                    }
                )
        usage = self.usage(
            sum(len(p.token_ids) for p in prompts),
            sum(len(c.token_ids) for o in outputs for c in o.outputs),
            sum(o.num_cached_tokens for o in outputs),
        )
        return JSONResponse(
            {
                "id": request_id,
                "object": "text_completion",
                "created": now(),
                "model": model_name,
                "system_fingerprint": self.system_fingerprint,
                "choices": choices,
                "usage": usage,
            }
        )

    def prompts(self, req: CompletionRequest) -> list[Prompt]:
        raw = req.prompt
        if isinstance(raw, str):
            raw = [raw]
        elif raw and isinstance(raw[0], int):
            raw = [raw]
        if not raw:
            raise APIError("prompt: must not be empty", param="prompt")
        add_special_tokens = req.add_special_tokens and req.suffix is None  # FIM places them itself
        prompts = []
        for item in raw:
            if isinstance(item, str):
                prompts.append(Prompt(item, self.tokenize(item, add_special_tokens)))
            else:
                prompts.append(Prompt(None, list(item)))
        return prompts

    @functools.cached_property
    def fim_token_ids(self) -> tuple[int, int, int] | None:
        """The tokenizer's (prefix, suffix, middle) FIM token ids; None if it has no FIM markers."""
        vocab = self.tokenizer.get_vocab()
        for markers in FIM_MARKERS:
            if all(m in vocab for m in markers):
                return vocab[markers[0]], vocab[markers[1]], vocab[markers[2]]
        return None

    def fill_in_the_middle(self, req: CompletionRequest, prompts: list[Prompt]) -> list[Prompt]:
        """``suffix``: each prompt becomes ``<prefix>{prompt}<suffix>{suffix}<middle>`` (PSM order), after
        the tokenizer's leading special tokens for a text prompt; the completion is the middle."""
        if self.fim_token_ids is None:
            raise APIError("suffix: this model's tokenizer has no fill-in-the-middle tokens", param="suffix")
        if req.echo:
            raise APIError("suffix: cannot be combined with echo", param="suffix")
        if req.truncate_prompt_tokens is not None:  # cutting the left would drop the prefix marker
            raise APIError("suffix: cannot be combined with truncate_prompt_tokens", param="suffix")
        prefix, suffix, middle = self.fim_token_ids
        lead = self.tokenize("", req.add_special_tokens)  # what the tokenizer puts before any text (BOS)
        tail = [suffix, *self.tokenize(req.suffix, False), middle]
        return [Prompt(None, [*(lead if p.text is not None else []), prefix, *p.token_ids, *tail]) for p in prompts]

    def with_echo(self, req, prompt: Prompt, out: RequestOutput, text, ids, positions):
        """With ``echo``, the prompt (and its logprobs) come first."""
        if not req.echo:
            return text, ids, positions
        prompt_text = prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)
        if req.logprobs is None:
            return prompt_text + text, ids, positions
        return prompt_text + text, prompt.token_ids + list(ids), list(out.prompt_logprobs or []) + list(positions or [])

    def legacy_logprobs(
        self, req: CompletionRequest, ids: list[int], positions: list[PositionLogprobs | None] | None, offset: int
    ) -> tuple[dict | None, int]:
        """OpenAI's legacy ``{tokens, token_logprobs, top_logprobs, text_offset}``; returns the next offset."""
        if req.logprobs is None:
            return None, offset
        as_ids = self.tokens_as_ids(req)
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for tid, position in zip(ids, positions or []):
            chosen = position.get(tid) if position else None
            token = self.token_str(tid, chosen.decoded_token if chosen else None, as_ids)
            tokens.append(token)
            offsets.append(offset)
            offset += len(token)
            if chosen is None:  # the first prompt token has no logprob
                token_logprobs.append(None)
                tops.append(None)
                continue
            token_logprobs.append(self.clamp(chosen.logprob))
            top = {
                self.token_str(t, lp.decoded_token, as_ids): self.clamp(lp.logprob)
                for t, lp in self.top_entries(position, req.logprobs)
            }
            top.setdefault(token, self.clamp(chosen.logprob))
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }, offset

    async def stream(
        self,
        req: CompletionRequest,
        request_id: str,
        prompts: list[Prompt],
        streams: list[RequestStream],
        model_name: str,
    ) -> AsyncIterator[str]:
        created, n = now(), req.n
        counts = [[0] * n for _ in prompts]
        offsets = [0] * (len(prompts) * n)
        echoed: set[int] = set()
        cached = [0] * len(prompts)
        options = req.stream_options

        def usage() -> dict:
            return self.usage(sum(len(p.token_ids) for p in prompts), sum(map(sum, counts)), sum(cached))

        try:
            async for p, out in self.merged(streams):
                cached[p] = out.num_cached_tokens
                for c in out.outputs:
                    i = p * n + c.index
                    text, ids, positions = c.text, c.token_ids, c.logprobs
                    if i not in echoed:
                        echoed.add(i)
                        text, ids, positions = self.with_echo(req, prompts[p], out, text, ids, positions)
                    counts[p][c.index] += len(c.token_ids)
                    if not text and not ids and c.finish_reason is None:
                        continue
                    logprobs, offsets[i] = self.legacy_logprobs(req, ids, positions, offsets[i])
                    choice = {
                        "index": i,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                    chunk = {
                        "id": request_id,
                        "object": "text_completion",
                        "created": created,
                        "model": model_name,
                        "system_fingerprint": self.system_fingerprint,
                        "choices": [choice],
                    }
                    if options and options.continuous_usage_stats:
                        chunk["usage"] = usage()
                    yield sse(chunk)
                if out.finished:
                    self.metrics.observe_finished(out, counts[p], model_name)
            if options and options.include_usage:
                yield sse(
                    {
                        "id": request_id,
                        "object": "text_completion",
                        "created": created,
                        "model": model_name,
                        "system_fingerprint": self.system_fingerprint,
                        "choices": [],
                        "usage": usage(),
                    }
                )
        except EngineDeadError as exc:
            yield sse(APIError(str(exc), status=503).body())
        finally:
            for stream in streams:
                if not stream.finished:
                    self.metrics.observe_aborted(model_name=model_name)
                stream.close()
        yield "data: [DONE]\n\n"
