"""``POST /v1/chat/completions``: chat template, OpenAI logprobs shape, role-first streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from kiln.engine.async_engine import EngineDeadError, RequestStream
from kiln.entrypoints.openai.chat_utils import detect_content_format, normalize_messages, render_chat
from kiln.entrypoints.openai.protocol import APIError, ChatCompletionRequest, TokenizeRequest
from kiln.entrypoints.openai.serving import OpenAIServing, Prompt, new_id, now, sse
from kiln.entrypoints.openai.tool_calling import ChoiceOutput, ToolSetup, messages_for_template, tool_setup
from kiln.outputs import PositionLogprobs


class ChatServing(OpenAIServing):
    def render(self, req: ChatCompletionRequest | TokenizeRequest) -> str:
        """The conversation as the chat template renders it (shared with ``/tokenize``)."""
        template = req.chat_template or self.options.chat_template
        content_format = self.options.chat_template_content_format
        if content_format == "auto":
            content_format = detect_content_format(template or self.tokenizer.chat_template)
        return render_chat(
            self.tokenizer,
            messages_for_template(normalize_messages(req.messages, content_format)),
            template,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tools=req.tools,
            documents=getattr(req, "documents", None),
            kwargs=req.chat_template_kwargs,
        )

    async def create(self, req: ChatCompletionRequest, raw: HTTPRequest):
        self.check_model(req.model)
        self.check_unsupported(req)
        options = self.options
        setup = tool_setup(
            req, self.tokenizer, options.tool_parser, options.enable_auto_tool_choice, options.reasoning_parser
        )
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs: needs logprobs=true", param="top_logprobs")
        text = self.render(req)
        prompt = self.truncate(Prompt(text, self.tokenize(text, req.add_special_tokens)), req)
        top = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(req, len(prompt.token_ids), max_tokens, top, req.prompt_logprobs)
        if setup.guided is not None:
            if params.guided_decoding is not None:
                raise APIError("tool_choice: cannot be combined with another constraint", param="tool_choice")
            params.guided_decoding = setup.guided
        await self.compile_guide(params)
        request_id = new_id("chatcmpl", req.request_id)
        streams = self.start(request_id, [(prompt, params)], req.priority)
        echo = self.echo_text(req)
        if req.stream:
            return StreamingResponse(
                self.stream(req, request_id, prompt, streams[0], echo, setup), media_type="text/event-stream"
            )
        out = (await self.final_outputs(streams, raw))[0]
        choices = []
        for c in out.outputs:
            reasoning, content, calls = ChoiceOutput(setup).whole(c.text)
            message = {
                "role": self.options.response_role,
                "content": echo + (content or "") if echo or content else None,
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
            "model": self.model_name,
            "choices": choices,
            "usage": self.usage(
                len(prompt.token_ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens
            ),
        }
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs_json(out)
        return JSONResponse(body)

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
        request_id: str,
        prompt: Prompt,
        stream: RequestStream,
        echo: str,
        setup: ToolSetup,
    ) -> AsyncIterator[str]:
        created, role = now(), self.options.response_role
        readers = [ChoiceOutput(setup) for _ in range(req.n)]
        counts = [0] * req.n
        options = req.stream_options
        cached = 0

        def chunk(choices: list[dict], usage: bool) -> str:
            body = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }
            if usage:
                body["usage"] = self.usage(len(prompt.token_ids), sum(counts), cached)
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
                    self.metrics.observe_finished(out, counts)
            if options and options.include_usage:
                yield chunk([], True)
        except EngineDeadError as exc:
            yield sse(APIError(str(exc), status=503).body())
        finally:
            if not stream.finished:
                self.metrics.observe_aborted()
            stream.close()
        yield "data: [DONE]\n\n"
