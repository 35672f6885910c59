"""``POST /v1/chat/completions``: chat template, OpenAI logprobs shape, role-first streaming."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from kiln.engine.async_engine import EngineDeadError, RequestStream
from kiln.engine.detokenizer import detokenized
from kiln.engine.tokenizer import markup_token_ids
from kiln.entrypoints.openai.chat_utils import (
    detect_content_format,
    normalize_messages,
    render_chat,
    request_render_args,
)
from kiln.entrypoints.openai.protocol import APIError, ChatCompletionRequest, TokenizeRequest
from kiln.entrypoints.openai.serving import OpenAIServing, Prompt, new_id, now, sse
from kiln.entrypoints.openai.tool_calling import ChoiceOutput, ToolSetup, messages_for_template, tool_setup
from kiln.lora.request import LoRARequest
from kiln.outputs import PositionLogprobs
from kiln.sampling_params import SamplingParams


class ChatServing(OpenAIServing):
    def render(self, req: ChatCompletionRequest | TokenizeRequest, add_special_tokens: bool) -> Prompt:
        """The conversation's prompt as the chat template renders it, tokenized (shared with
        ``/tokenize`` and the pooling endpoints)."""
        args = request_render_args(req, self.options.trust_request_chat_template)
        template = args.pop("chat_template") or self.options.chat_template
        content_format = self.options.chat_template_content_format
        if content_format == "auto":
            content_format = detect_content_format(template or self.tokenizer.chat_template)
        messages = messages_for_template(normalize_messages(req.messages, content_format))
        return Prompt(*render_chat(self.tokenizer, messages, template, add_special_tokens=add_special_tokens, **args))

    async def create(self, req: ChatCompletionRequest, raw: HTTPRequest):
        prompt, params, setup, lora = await self.prepare(req)
        model_name = self.models.model_name(lora)
        request_id = new_id("chatcmpl", req.request_id)
        streams = self.start(request_id, [(prompt, params)], req.priority, lora)
        echo = self.echo_text(req)
        if req.stream:
            chunks = self.stream(req, params, request_id, prompt, streams[0], echo, setup, model_name)
            return StreamingResponse(chunks, media_type="text/event-stream")
        out = (await self.final_outputs(streams, raw, model_name))[0]
        choices = []
        for c in out.outputs:
            reasoning, content, calls = ChoiceOutput(setup).whole(c.text)
            text = echo + (content or "")
            message = {
                "role": self.options.response_role,
                # null only when the parsers took it all (reasoning, tool calls); an empty answer is ""
                "content": text if text or (content is not None and not calls) else None,
                "reasoning_content": reasoning,
                "tool_calls": [call.to_openai() for call in calls],
            }
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self.chat_logprobs(req, c.token_ids, c.logprobs),
                    "finish_reason": "tool_calls" if calls else c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        body = {
            "id": request_id,
            "object": "chat.completion",
            "created": now(),
            "model": model_name,
            "system_fingerprint": self.system_fingerprint,
            "choices": choices,
            "usage": self.usage(
                len(prompt.token_ids),
                sum(len(c.token_ids) for c in out.outputs),
                out.num_cached_tokens,
                self.reasoning_tokens(setup, [(c.text, c.token_ids) for c in out.outputs], params),
            ),
        }
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs_json(out)
        return JSONResponse(body)

    async def prepare(self, req: ChatCompletionRequest) -> tuple[Prompt, SamplingParams, ToolSetup, LoRARequest | None]:
        """Validate, render and tokenize the conversation; its sampling parameters, tool constraint
        included and compiled, and the LoRA adapter ``model`` names (shared with ``/v1/responses``)."""
        lora = await self.resolve_model(req.model)
        self.check_unsupported(req)
        options = self.options
        setup = tool_setup(
            req, self.tokenizer, options.tool_parser, options.enable_auto_tool_choice, options.reasoning_parser
        )
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs: needs logprobs=true", param="top_logprobs")
        # bounded (2 s), but off the event loop all the same
        prompt = self.truncate(await asyncio.to_thread(self.render, req, req.add_special_tokens), req)
        top = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(req, len(prompt.token_ids), max_tokens, top, req.prompt_logprobs)
        params._kept_special_ids = markup_token_ids(self.tokenizer, setup.markup)
        if setup.guided is not None:
            if params.guided_decoding is not None:
                raise APIError("tool_choice: cannot be combined with another constraint", param="tool_choice")
            params.guided_decoding = setup.guided
        await self.compile_guide(params)
        return prompt, params, setup, lora

    def reasoning_tokens(
        self, setup: ToolSetup, outputs: list[tuple[str, Sequence[int]]], params: SamplingParams
    ) -> int | None:
        """``completion_tokens_details.reasoning_tokens`` over the choices' (text, token ids); None
        without a reasoning parser. A choice's reasoning tokens are the fewest leading tokens whose text
        reaches its answer (the parsers' answer is the tail of the text), markers included; ``params``
        (the request's, from ``prepare``) say how special tokens were shown in that text."""
        if setup.make_reasoning_parser is None:
            return None
        total = 0
        for text, ids in outputs:
            _, answer = setup.make_reasoning_parser().extract_reasoning(text)
            reach = len(text) - len(answer or "")
            lo, hi = 0, len(ids)
            while lo < hi:  # decoded prefixes only grow: bisect for the first that reaches the answer
                mid = (lo + hi) // 2
                if len(detokenized(self.tokenizer, ids[:mid], params)) >= reach:
                    hi = mid
                else:
                    lo = mid + 1
            total += lo
        return total

    def echo_text(self, req: ChatCompletionRequest) -> str:
        """``echo``: the last message's content, when it is the role being answered (continued)."""
        last = req.messages[-1]
        if req.echo and last.role == self.options.response_role and isinstance(last.content, str):
            return last.content
        return ""

    def chat_logprobs(
        self, req: ChatCompletionRequest, ids: list[int], positions: list[PositionLogprobs] | None
    ) -> dict | None:
        if not req.logprobs or positions is None:
            return None
        as_ids = self.tokens_as_ids(req)

        def entry(tid, lp) -> dict:
            token = self.token_str(tid, lp.decoded_token, as_ids)
            return {"token": token, "logprob": self.clamp(lp.logprob), "bytes": list(token.encode("utf-8"))}

        content = []
        for tid, position in zip(ids, positions):
            item = entry(tid, position[tid])
            item["top_logprobs"] = [entry(t, lp) for t, lp in self.top_entries(position, req.top_logprobs or 0)]
            content.append(item)
        return {"content": content}

    async def stream(
        self,
        req: ChatCompletionRequest,
        params: SamplingParams,
        request_id: str,
        prompt: Prompt,
        stream: RequestStream,
        echo: str,
        setup: ToolSetup,
        model_name: str,
    ) -> AsyncIterator[str]:
        created, role = now(), self.options.response_role
        readers = [ChoiceOutput(setup) for _ in range(req.n)]
        counts = [0] * req.n
        # With a reasoning parser, the whole outputs are kept to count reasoning tokens for the final usage.
        thinking = setup.make_reasoning_parser is not None
        texts: list[list[str]] = [[] for _ in range(req.n)]
        token_ids: list[list[int]] = [[] for _ in range(req.n)]
        options = req.stream_options
        cached = 0

        def chunk(choices: list[dict], usage: bool, reasoning_tokens: int | None = None) -> str:
            body = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model_name,
                "system_fingerprint": self.system_fingerprint,
                "choices": choices,
            }
            if usage:
                body["usage"] = self.usage(len(prompt.token_ids), sum(counts), cached, reasoning_tokens)
            return sse(body)

        continuous = bool(options and options.continuous_usage_stats)
        try:
            for i in range(req.n):
                delta = {"role": role, "content": echo}
                yield chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}], continuous)
            async for out in stream:
                cached = out.num_cached_tokens
                for c in out.outputs:
                    counts[c.index] += len(c.token_ids)
                    if thinking:
                        texts[c.index].append(c.text)
                        token_ids[c.index].extend(c.token_ids)
                    reader = readers[c.index]
                    delta = reader.delta(c.text, final=c.finish_reason is not None)
                    if delta is None and c.finish_reason is None and not (c.token_ids and req.logprobs):
                        continue
                    body: dict = {}
                    if delta is not None:
                        if delta.reasoning_content:
                            body["reasoning_content"] = delta.reasoning_content
                        if delta.content:
                            body["content"] = delta.content
                        if delta.tool_calls:
                            body["tool_calls"] = [call.to_openai() for call in delta.tool_calls]
                    finish = c.finish_reason
                    if finish is not None and reader.num_calls:
                        finish = "tool_calls"
                    choice = {
                        "index": c.index,
                        "delta": body,
                        "logprobs": self.chat_logprobs(req, c.token_ids, c.logprobs),
                        "finish_reason": finish,
                    }
                    if c.finish_reason is not None:
                        choice["stop_reason"] = c.stop_reason
                    yield chunk([choice], continuous)
                if out.finished:
                    self.metrics.observe_finished(out, counts, model_name)
            if options and options.include_usage:
                outputs = [("".join(t), ids) for t, ids in zip(texts, token_ids)]
                yield chunk([], True, self.reasoning_tokens(setup, outputs, params))
        except EngineDeadError as exc:
            yield sse(APIError(str(exc), status=503).body())
        finally:
            if not stream.finished:
                self.metrics.observe_aborted(model_name=model_name)
            stream.close()
        yield "data: [DONE]\n\n"
