"""Rendering a conversation with a chat template: the one path for the server, ``/tokenize`` and ``LLM.chat``.

It gives the template what transformers' ``apply_chat_template`` gives it (``messages``,
``tools``, ``documents``, ``add_generation_prompt``, the tokenizer's special tokens, extra
variables; ``raise_exception``, ``strftime_now``, ``tojson``...), prepared the same way, so the
text is the same; but the template always renders in Kiln's bounded sandbox
(:mod:`kiln.entrypoints.chat_template_sandbox`). That covers every template's origin: a
tokenizer config, a GGUF file's ``tokenizer.chat_template`` metadata (transformers reads it
into the tokenizer when Kiln converts the file, see ``kiln.models.gguf_cache``), the
``--chat-template`` flag, or a trusted request. A mistral_common tokenizer
(``--tokenizer-mode mistral``) has no template: it encodes the conversation itself, straight
to token ids (``mistral_chat_ids``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kiln.entrypoints.chat_template_sandbox import DEFAULT_LIMITS, ChatTemplateError, RenderLimits, render_template
from kiln.interfaces.tokenizer import is_mistral

# The names messages' reasoning goes by; templates read the first.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
RENDERER_ARGUMENTS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"})
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def select_template(model_template: str | dict | None, template: str | None, tools: list | None) -> str:
    """The template to render: ``template`` (or, for a model with named templates, its name), else the model's."""
    if isinstance(model_template, dict):
        if template in model_template:
            return model_template[template]
        if template is None:
            if tools is not None and "tool_use" in model_template:
                return model_template["tool_use"]
            if "default" in model_template:
                return model_template["default"]
            raise ChatTemplateError(
                f"the model has several chat templates and no default; name one of {sorted(model_template)}"
            )
    if template is not None:
        return template
    if model_template is None:
        raise ChatTemplateError("the model's tokenizer has no chat template; give one (--chat-template)")
    return model_template


def render_chat_template(
    tokenizer: Any,
    messages: list[Mapping[str, Any]],
    template: str | None = None,
    *,
    tools: list[Any] | None = None,
    documents: list[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    variables: Mapping[str, Any] | None = None,
    limits: RenderLimits = DEFAULT_LIMITS,
) -> str:
    """The conversation as ``tokenizer.apply_chat_template(..., tokenize=False)`` renders it, in the sandbox.

    ``template`` overrides the tokenizer's; ``variables`` are extra template variables (they
    override the tokenizer's special tokens, as in transformers). Raises :class:`ChatTemplateError`.
    """
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("cannot be combined with add_generation_prompt=true", "continue_final_message")
    if not messages:
        raise ChatTemplateError("the conversation is empty", param="messages")
    if not all(isinstance(m, Mapping) for m in messages):
        raise ChatTemplateError("each message must be a dict", param="messages")
    if continue_final_message and messages[-1].get("role") != "assistant":
        raise ChatTemplateError("continue_final_message needs an assistant message last", param="messages")
    source = select_template(tokenizer.chat_template, template, tools)
    clashing = RENDERER_ARGUMENTS.intersection(variables or {})
    if clashing:
        raise ChatTemplateError(f"{sorted(clashing)} are renderer arguments, not extra template variables")
    conversation = _alias_reasoning([_plain({k: v for k, v in m.items() if v is not None}) for m in messages])
    final_text = _tag_final_message(conversation, source) if continue_final_message else None
    rendered = render_template(
        source,
        {
            **tokenizer.special_tokens_map,
            **_plain(dict(variables or {})),
            "messages": conversation,
            "tools": _plain(_tool_schemas(tools)),
            "documents": _plain(_documents(documents)),
            "add_generation_prompt": add_generation_prompt,
        },
        limits,
    )
    return rendered if final_text is None else _cut_after_final_message(rendered, final_text)


def chat_prompt(
    tokenizer: Any,
    messages: list[Mapping[str, Any]],
    template: str | None = None,
    *,
    add_special_tokens: bool = False,
    **options: Any,
) -> tuple[str, list[int]]:
    """The conversation's prompt as (text, token ids): rendered by ``render_chat_template`` (its
    ``options``) and tokenized, or encoded by a mistral_common tokenizer (``mistral_chat_ids``),
    its text then the ids decoded. Raises :class:`ChatTemplateError`."""
    if is_mistral(tokenizer):
        ids = mistral_chat_ids(tokenizer, messages, template, **options)
        return tokenizer.decode(ids), ids
    text = render_chat_template(tokenizer, messages, template, **options)
    return text, tokenizer.encode(text, add_special_tokens=add_special_tokens)


def mistral_chat_ids(
    tokenizer: Any,
    messages: list[Mapping[str, Any]],
    template: str | None = None,
    *,
    tools: list[Any] | None = None,
    continue_final_message: bool = False,
    documents: list[Mapping[str, Any]] | None = None,
    variables: Mapping[str, Any] | None = None,
    **template_only: Any,
) -> list[int]:
    """The conversation's token ids as mistral_common's instruct request encodes it (through
    transformers' ``MistralCommonBackend``). ``render_chat_template``'s other options do nothing
    here (``template_only``): a last user or tool message always ends in the turn's closing
    ``[/INST]`` (``add_generation_prompt``), and no template renders (``limits``); a template,
    extra template variables and documents have nowhere to go and are refused. Raises
    :class:`ChatTemplateError` with mistral_common's reason for a conversation it refuses."""
    for given, param in ((template, "chat_template"), (variables, "chat_template_kwargs"), (documents, "documents")):
        if given:
            raise ChatTemplateError(
                "the model's mistral_common tokenizer (--tokenizer-mode mistral) encodes conversations itself; "
                f"{param} does not apply",
                param,
            )
    if not messages:
        raise ChatTemplateError("the conversation is empty", param="messages")
    from mistral_common.exceptions import MistralCommonException

    conversation = [_plain({k: v for k, v in m.items() if v is not None}) for m in messages]
    try:
        ids = tokenizer.apply_chat_template(
            conversation,
            tools=_plain(_tool_schemas(tools)),
            continue_final_message=continue_final_message,
            tokenize=True,
            return_dict=False,
        )
        return list(ids)
    except (MistralCommonException, ValueError, TypeError, KeyError, AssertionError, NotImplementedError) as exc:
        # its validation (pydantic's too), and its encoders' asserts
        raise ChatTemplateError(f"mistral_common refused the conversation: {exc}", param="messages") from None


def _plain(value: Any) -> Any:
    """Plain JSON-like data: rich objects (enums, numpy scalars, dataclasses, pydantic models)
    carry methods the sandbox does not know to be dangerous, so templates see copies of plain types."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind, to_base in ((str, str.__str__), (int, int.__int__), (float, float.__float__)):
        if isinstance(value, kind):  # a subclass (an enum, a numpy float): its plain value
            return to_base(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _tool_schemas(tools: list[Any] | None) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ChatTemplateError("tools must be a list", param="tools")
    schemas = []
    for tool in tools:
        if isinstance(tool, Mapping):
            schemas.append(tool)
        elif callable(tool):  # a Python function, described from its signature and docstring as transformers does
            from transformers.utils import get_json_schema

            schemas.append(get_json_schema(tool))
        else:
            raise ChatTemplateError("each tool must be a JSON schema or a function", param="tools")
    return schemas


def _documents(documents: list[Any] | None) -> list | None:
    if documents is not None and not (
        isinstance(documents, (list, tuple)) and all(isinstance(d, Mapping) for d in documents)
    ):
        raise ChatTemplateError("documents must be a list of dicts (with 'title' and 'text')", param="documents")
    return documents


def _alias_reasoning(conversation: list[dict]) -> list[dict]:
    # Older names of a message's reasoning fill `reasoning_content`, and `thinking` for templates reading that.
    out = []
    for message in conversation:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        out.append(message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning})
    return out


def _tag_final_message(conversation: list[dict], source: str) -> str:
    """Mark the end of the final message's text, to cut the render there; returns that text."""
    final = conversation[-1]
    content = final.get("content")
    if content is None:
        raise ChatTemplateError('continue_final_message: the final message has no "content" to continue', "messages")
    if "content" not in source:
        raise ChatTemplateError("continue_final_message: the chat template does not render message content")
    if isinstance(content, list):
        for part in reversed(content):
            if "text" in part:
                text, part["text"] = part["text"], part["text"] + _CONTINUE_TAG
                return text
        raise ChatTemplateError("continue_final_message: the final message has no text to continue", "messages")
    final["content"] = content + _CONTINUE_TAG
    return content


def _cut_after_final_message(rendered: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError(
            "continue_final_message: the chat template does not render the final message as given", "messages"
        )
    at = rendered.rindex(tag)
    # A template that keeps the text's trailing spaces ends it at the tag; one that trims them, before.
    return rendered[:at] if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else rendered[:at].rstrip()
