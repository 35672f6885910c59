"""``/v1/responses``: OpenAI's Responses API on the chat path, and the store of responses.

A request becomes a chat completion request (``instructions`` → a system
message, input items → chat messages, flat function tools → chat tools,
``text.format`` → ``response_format``) and goes through
``ChatServing.prepare``: the same template, sampling parameters, guided
decoding and tool/reasoning parsers, so greedy output equals the chat
completion's token for token. The parsed output becomes output items
(``reasoning``, ``message``, ``function_call``); streamed, every change is
a Responses event with a ``sequence_number``.

``store`` (default true, as OpenAI's) keeps the response and its conversation
in a bounded LRU: ``GET``/``DELETE /v1/responses/{id}`` read and drop it, and
``previous_response_id`` continues it (the previous ``instructions`` are not
carried over, as OpenAI documents). ``store: false`` is stateless.
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import TypeAdapter, ValidationError

from kiln.engine.async_engine import EngineDeadError, RequestStream
from kiln.entrypoints.openai.protocol import APIError, ChatCompletionRequest
from kiln.entrypoints.openai.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    ToolChoiceFunction,
)
from kiln.entrypoints.openai.serving import now
from kiln.entrypoints.openai.serving_chat import ChatServing
from kiln.entrypoints.openai.tool_calling import ChoiceOutput, ToolSetup
from kiln.interfaces.parsers import DeltaMessage, ToolCallDelta
from kiln.sampling_params import SamplingParams

DEFAULT_STORE_SIZE = 1000
DEFAULT_STORE_BYTES = 256 << 20  # a response can hold a whole conversation: bound the bytes too
INPUT_ITEMS = TypeAdapter(list[InputItem])  # validates output items as the input items they become
# Errors from the chat path name chat fields; a Responses client knows these names instead.
_PARAMS = {
    "messages": "input",
    "prompt": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
}


# ------------------------------------------------------------------ the store
@dataclass(slots=True)
class StoredResponse:
    body: dict
    conversation: list[dict]  # chat messages through this response's output, without its instructions


class ResponseStore:
    """Stored responses, least recently used dropped first past ``capacity`` responses or
    ``max_bytes`` of their JSON (one event loop: no lock)."""

    def __init__(self, capacity: int = DEFAULT_STORE_SIZE, max_bytes: int = DEFAULT_STORE_BYTES) -> None:
        self.capacity, self.max_bytes = capacity, max_bytes
        self._items: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if response_id in self._items:
            self.delete(response_id)
        size = len(json.dumps(stored.body)) + len(json.dumps(stored.conversation))
        self._items[response_id] = (stored, size)
        self.bytes += size
        while len(self._items) > self.capacity or (self.bytes > self.max_bytes and len(self._items) > 1):
            _, (_, dropped) = self._items.popitem(last=False)
            self.bytes -= dropped

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        entry = self._items.get(response_id)
        if entry is None:
            raise APIError(f"Response with id {response_id!r} not found.", status=404, param=param)
        self._items.move_to_end(response_id)
        return entry[0]

    def delete(self, response_id: str) -> None:
        entry = self._items.pop(response_id, None)
        if entry is None:
            raise APIError(f"Response with id {response_id!r} not found.", status=404, param="response_id")
        self.bytes -= entry[1]


# ------------------------------------------------------- input → chat request
def items_to_messages(items: list[Any]) -> list[dict]:
    """Chat messages for input items. Function calls join the assistant turn right before them
    (text and calls are one chat message); reasoning goes to the next assistant message as
    ``reasoning_content``, which templates that show past reasoning read."""
    messages: list[dict] = []
    reasoning = ""

    def assistant(message: dict) -> dict:
        nonlocal reasoning
        if reasoning:
            message["reasoning_content"], reasoning = reasoning, ""
        return message

    for item in items:
        if isinstance(item, MessageItem):
            content = item.content
            if not isinstance(content, str):
                content = [{"type": "text", "text": part.text} for part in content]
            role = "system" if item.role == "developer" else item.role
            message = {"role": role, "content": content}
            messages.append(assistant(message) if role == "assistant" else message)
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append(assistant({"role": "assistant", "content": None, "tool_calls": [call]}))
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        elif isinstance(item, ReasoningItem):
            parts = item.content or item.summary
            reasoning += "\n".join(part.text for part in parts)
    return messages


def chat_request(req: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The chat completion request that generates this response."""
    fmt = req.text.format if req.text is not None else None
    response_format = None
    if fmt is not None and fmt.type == "json_object":
        response_format = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)
        response_format = {"type": "json_schema", "json_schema": schema}
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceFunction):
        choice = {"type": "function", "function": {"name": choice.name}}
    effort = req.reasoning.effort if req.reasoning is not None else None
    fields = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "seed": req.seed,
        "user": req.user,
        "priority": req.priority,
        "stream": req.stream,
        "tools": [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in req.tools
        ]
        or None,
        "tool_choice": choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": response_format,
        "chat_template_kwargs": {"reasoning_effort": effort} if effort is not None else None,
    }
    try:
        return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [_PARAMS.get(str(p), str(p)) for p in first["loc"]] or ["input"]
        raise APIError(f"{'.'.join(loc)}: {first['msg']}", param=loc[0]) from None


# --------------------------------------------------------------- output items
class OutputItems:
    """A response's output items built from parsed deltas, and the stream events that tell it.

    At most one item is open: reasoning and message text grow by deltas, a function call
    arrives whole (tool parsers emit a call once it is complete). A change of kind closes the
    open item. Events wait in ``events`` (without ``sequence_number``) until taken.
    """

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.events: list[dict] = []
        self._open: dict | None = None
        self._text = ""

    def feed(self, delta: DeltaMessage) -> None:
        if delta.reasoning_content:
            self._grow("reasoning", delta.reasoning_content)
        if delta.content:
            self._grow("message", delta.content)
        for call in delta.tool_calls:
            self._call(call)

    def finish(self, incomplete: bool) -> None:
        """Close the open item; a response with nothing to say still has an (empty) message."""
        if self._open is None and not self.items:
            self._start("message")
        self._close("incomplete" if incomplete else "completed")

    def take_events(self) -> list[dict]:
        events, self.events = self.events, []
        return events

    def _emit(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, **fields})

    @staticmethod
    def _part(kind: str, text: str) -> dict:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _start(self, kind: str) -> None:
        if kind == "reasoning":
            item = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [], "content": []}
        else:
            item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "content": []}
        item["status"] = "in_progress"
        self._open, self._text = item, ""
        index = len(self.items)
        self._emit("response.output_item.added", output_index=index, item=dict(item))
        part = self._part(kind, "")
        self._emit("response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part)

    def _grow(self, kind: str, text: str) -> None:
        if self._open is None or self._open["type"] != kind:
            self._close("completed")
            self._start(kind)
        self._text += text
        where = {"item_id": self._open["id"], "output_index": len(self.items), "content_index": 0}
        if kind == "reasoning":
            self._emit("response.reasoning_text.delta", **where, delta=text)
        else:
            self._emit("response.output_text.delta", **where, delta=text, logprobs=[])

    def _close(self, status: str) -> None:
        item = self._open
        if item is None:
            return
        kind, text = item["type"], self._text
        where = {"item_id": item["id"], "output_index": len(self.items), "content_index": 0}
        if kind == "reasoning":
            self._emit("response.reasoning_text.done", **where, text=text)
        else:
            self._emit("response.output_text.done", **where, text=text, logprobs=[])
        part = self._part(kind, text)
        self._emit("response.content_part.done", **where, part=part)
        done = {**item, "content": [part], "status": status}
        self._emit("response.output_item.done", output_index=len(self.items), item=done)
        self.items.append(done)
        self._open = None

    def _call(self, call: ToolCallDelta) -> None:
        self._close("completed")
        index = len(self.items)
        item = {
            "id": f"fc_{uuid.uuid4().hex}",
            "type": "function_call",
            "call_id": call.id,
            "name": call.name,
            "arguments": "",
            "status": "in_progress",
        }
        self._emit("response.output_item.added", output_index=index, item=item)
        where = {"item_id": item["id"], "output_index": index}
        self._emit("response.function_call_arguments.delta", **where, delta=call.arguments)
        self._emit("response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments)
        done = {**item, "arguments": call.arguments, "status": "completed"}
        self._emit("response.output_item.done", output_index=index, item=done)
        self.items.append(done)


# -------------------------------------------------------------------- serving
@dataclass
class _Turn:
    """One request in flight: what its Response object echoes, and the conversation it extends."""

    req: ResponsesRequest
    response_id: str
    params: SamplingParams
    setup: ToolSetup
    prompt_len: int
    conversation: list[dict]  # without instructions
    model_name: str  # the served name or the LoRA adapter the request named
    created_at: int = field(default_factory=now)


class ResponsesServing:
    def __init__(self, chat: ChatServing, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store if store is not None else ResponseStore()

    async def create(self, req: ResponsesRequest, raw: HTTPRequest):
        history = []
        if req.previous_response_id is not None:
            history = self.store.get(req.previous_response_id, param="previous_response_id").conversation
        items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
        conversation = history + items_to_messages(items)
        system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
        try:
            prompt, params, setup, lora = await self.chat.prepare(chat_request(req, system + conversation))
        except APIError as exc:
            exc.param = _PARAMS.get(exc.param, exc.param)
            raise
        response_id = req.request_id or f"resp_{uuid.uuid4().hex}"
        stream = self.chat.start(response_id, [(prompt, params)], req.priority, lora)[0]
        model_name = self.chat.models.model_name(lora)
        turn = _Turn(req, response_id, params, setup, len(prompt.token_ids), conversation, model_name)
        if req.stream:
            return StreamingResponse(self.stream(turn, stream), media_type="text/event-stream")
        out = (await self.chat.final_outputs([stream], raw, model_name))[0]
        c = out.outputs[0]
        reasoning, content, calls = ChoiceOutput(setup).whole(c.text)
        output = OutputItems()
        deltas = [ToolCallDelta(i, call.id, call.name, call.arguments) for i, call in enumerate(calls)]
        output.feed(DeltaMessage(content, reasoning, deltas))
        output.finish(incomplete=c.finish_reason == "length")
        return JSONResponse(self.complete(turn, output, c.finish_reason, c.text, c.token_ids, out.num_cached_tokens))

    async def stream(self, turn: _Turn, stream: RequestStream) -> AsyncIterator[str]:
        numbers = itertools.count()

        def event(payload: dict) -> str:
            payload["sequence_number"] = next(numbers)
            return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

        reader, output = ChoiceOutput(turn.setup), OutputItems()
        started = self.body(turn, "in_progress", [], None)
        yield event({"type": "response.created", "response": started})
        yield event({"type": "response.in_progress", "response": started})
        text, ids, cached, finish = "", [], 0, None
        try:
            async for out in stream:
                cached = out.num_cached_tokens
                for c in out.outputs:
                    text += c.text
                    ids += c.token_ids
                    finish = c.finish_reason
                    delta = reader.delta(c.text, final=finish is not None)
                    if delta is not None:
                        output.feed(delta)
                if out.finished:
                    output.finish(incomplete=finish == "length")
                    self.chat.metrics.observe_finished(out, [len(ids)], turn.model_name)
                for payload in output.take_events():
                    yield event(payload)
            body = self.complete(turn, output, finish, text, ids, cached)
            yield event({"type": f"response.{body['status']}", "response": body})
        except EngineDeadError as exc:
            yield event({"type": "error", "code": "engine_dead", "message": str(exc), "param": None})
        finally:
            if not stream.finished:
                self.chat.metrics.observe_aborted(model_name=turn.model_name)
            stream.close()

    def complete(
        self, turn: _Turn, output: OutputItems, finish: str | None, text: str, ids: Sequence[int], cached: int
    ) -> dict:
        """The finished Response object (``text``, ``ids``: the whole output); stored with its
        conversation when the request asks."""
        count = len(ids)
        reasoning_tokens = self.chat.reasoning_tokens(turn.setup, [(text, ids)], turn.params)
        usage = {
            "input_tokens": turn.prompt_len,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": count,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens or 0},
            "total_tokens": turn.prompt_len + count,
        }
        body = self.body(turn, "incomplete" if finish == "length" else "completed", output.items, usage)
        if turn.req.store:
            replies = items_to_messages(INPUT_ITEMS.validate_python(output.items))
            self.store.put(turn.response_id, StoredResponse(body, turn.conversation + replies))
        return body

    def body(self, turn: _Turn, status: str, output: list[dict], usage: dict | None) -> dict:
        req = turn.req
        choice = req.tool_choice
        if isinstance(choice, ToolChoiceFunction):
            choice = choice.model_dump()
        elif choice is None:  # the chat path's default: auto when a tool parser reads the output
            choice = "auto" if turn.setup.make_tool_parser is not None else "none"
        text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text else {"format": {"type": "text"}}
        return {
            "id": turn.response_id,
            "object": "response",
            "created_at": turn.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": turn.model_name,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning.model_dump() if req.reasoning else {"effort": None, "summary": None},
            "store": req.store,
            "temperature": turn.params.temperature,
            "text": text,
            "tool_choice": choice,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools],
            "top_p": turn.params.top_p,
            "truncation": req.truncation,
            "usage": usage,
            "user": req.user,
        }


def add_routes(app: FastAPI, chat: ChatServing, store: ResponseStore | None = None) -> ResponsesServing:
    """``POST /v1/responses`` and ``GET``/``DELETE /v1/responses/{id}`` on ``app``."""
    responses = ResponsesServing(chat, store)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: HTTPRequest):
        return await responses.create(body, raw)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses.store.get(response_id).body)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        responses.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return responses
