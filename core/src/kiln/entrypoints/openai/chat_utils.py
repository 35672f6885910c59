"""Chat templates: choosing one (``--chat-template``), the content format, and rendering messages."""

from __future__ import annotations

import os
from typing import Any, Literal

import jinja2.nodes

from kiln.entrypoints.chat_rendering import chat_prompt
from kiln.entrypoints.chat_template_sandbox import ChatTemplateError, parse_template
from kiln.entrypoints.openai.protocol import APIError
from kiln.registry import Registry, load_ref

ContentFormat = Literal["string", "openai"]
# Renderer arguments chat_template_kwargs may override (vLLM lets them), given --trust-request-chat-template.
REQUEST_OVERRIDABLE = ("chat_template", "add_generation_prompt", "continue_final_message", "tools", "documents")


def resolve_chat_template(value: str | None, registry: Registry) -> str | None:
    """``--chat-template``: a name registered by a plugin, a file, or the template itself."""
    if value is None:
        return None
    named = registry.chat_templates.get(value)
    if named is not None:
        return _template_source(named)
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    names = sorted(registry.chat_templates)
    raise ValueError(
        f"--chat-template: {value!r} is neither a file, a registered template ({', '.join(names) or 'none'}) "
        "nor a Jinja template"
    )


def _template_source(registered: Any) -> str:
    # Plugins register the Jinja source, a loader function, or a lazy "module:attr" to either.
    if isinstance(registered, str) and "{" in registered:
        return registered
    loaded = load_ref(registered)
    return loaded() if callable(loaded) else loaded


def detect_content_format(template: str | None) -> ContentFormat:
    """``openai`` when the template loops over a message's ``content`` (a list of parts), else ``string``."""
    if not isinstance(template, str) or not template:
        return "string"
    try:
        ast = parse_template(template)
    except Exception:  # not parseable (syntax, nesting): rendering reports it
        return "string"
    for loop in ast.find_all(jinja2.nodes.For):
        for node in loop.iter.find_all((jinja2.nodes.Getattr, jinja2.nodes.Getitem)):
            key = node.attr if isinstance(node, jinja2.nodes.Getattr) else getattr(node.arg, "value", None)
            if key == "content":
                return "openai"
        if isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name == "content":
            return "openai"
    return "string"


def normalize_messages(messages: list[Any], content_format: ContentFormat) -> list[dict[str, Any]]:
    """Plain dicts for the template; list content is checked (text only) and joined for ``string``."""
    out = []
    for i, message in enumerate(messages):
        msg = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type")
                if kind not in ("text", "input_text") or not isinstance(part.get("text"), str):
                    raise APIError(
                        f"messages[{i}].content: content part type {kind!r} is not supported (text parts only)",
                        param="messages",
                    )
                texts.append(part["text"])
            msg["content"] = (
                "\n".join(texts) if content_format == "string" else [{"type": "text", "text": t} for t in texts]
            )
        elif content is None and content_format == "string" and "tool_calls" not in msg:
            msg["content"] = ""
        out.append(msg)
    return out


def request_render_args(req: Any, trusted: bool) -> dict[str, Any]:
    """What a chat (or ``/tokenize``) request asks the renderer for: its fields, overridden by
    ``chat_template_kwargs`` as in vLLM, plus the rest of those kwargs as template variables.

    A per-request template, or kwargs that override the template or the renderer's arguments,
    is code and settings from the client: refused (400) unless the server runs with
    ``--trust-request-chat-template``.
    """
    variables = dict(req.chat_template_kwargs or {})
    overrides = {name: variables.pop(name) for name in REQUEST_OVERRIDABLE if name in variables}
    if "messages" in variables:
        raise APIError("chat_template_kwargs: 'messages' cannot be set here", param="chat_template_kwargs")
    if not trusted:
        if req.chat_template is not None:
            raise APIError(
                "chat_template: this server does not accept chat templates in requests "
                "(start it with --trust-request-chat-template to allow them)",
                param="chat_template",
            )
        if overrides:
            raise APIError(
                f"chat_template_kwargs: {', '.join(sorted(overrides))} would override the chat template or its "
                "arguments; this server does not allow that (start it with --trust-request-chat-template)",
                param="chat_template_kwargs",
            )
    if not isinstance(overrides.get("chat_template", ""), str):
        raise APIError("chat_template_kwargs: chat_template must be a string", param="chat_template_kwargs")
    args = {
        "chat_template": req.chat_template,
        "add_generation_prompt": req.add_generation_prompt,
        "continue_final_message": req.continue_final_message,
        "tools": req.tools,
        "documents": getattr(req, "documents", None),
    }
    return {**args, **overrides, "kwargs": variables}


def render_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    template: str | None,
    *,
    add_special_tokens: bool,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> tuple[str, list[int]]:
    """The conversation's prompt (text, token ids), rendered in the bounded sandbox (or encoded by
    a mistral_common tokenizer); any template failure is a 400."""
    try:
        return chat_prompt(
            tokenizer,
            messages,
            template,
            add_special_tokens=add_special_tokens,
            tools=tools,
            documents=documents,
            add_generation_prompt=bool(add_generation_prompt),
            continue_final_message=bool(continue_final_message),
            variables=kwargs,
        )
    except ChatTemplateError as exc:
        raise APIError(str(exc), param=exc.param) from None
