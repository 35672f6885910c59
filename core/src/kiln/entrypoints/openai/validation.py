"""The one check every JSON request body passes before an endpoint reads it, and the start-up
check of ``--override-generation-config``.

Python's JSON parser accepts what JSON forbids (``NaN``, ``Infinity``, ``1e999`` read as
infinity) and what no tokenizer or response encoder can take (lone UTF-16 surrogates written as
``"\\ud800"``). Refusing both here, with a 400 naming where, keeps every endpoint (and every one
added later: routes take ``ValidatedJSONRoute`` from the app's router) away from them. Numbers
given as strings (``"NaN"``) are refused by the request models (``allow_inf_nan=False``) and by
``SamplingParams``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

from kiln.entrypoints.openai.protocol import APIError
from kiln.sampling_params import REQUEST_FIELDS, SamplingParams

MAX_DEPTH = 128  # nesting of arrays and objects (serde_json's default limit)
_SURROGATE = re.compile("[\ud800-\udfff]")  # a valid pair is one code point after json.loads


def parse_body(raw: bytes) -> Any:
    """The body as JSON, or an ``APIError`` saying what is wrong with it and where."""
    try:
        text = raw.decode("utf-8")  # strict: also refuses surrogates encoded as bytes
    except UnicodeDecodeError as exc:
        raise APIError(f"body: not valid UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise APIError(f"body: JSON nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # malformed JSON, or an integer past Python's digit limit
        raise APIError(f"body: not valid JSON: {exc}") from None
    check_json(value)
    return value


def check_json(value: Any) -> None:
    """Refuse non-finite numbers, lone surrogates (in keys too) and nesting past ``MAX_DEPTH``."""
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise _refused(path, "invalid Unicode (a lone surrogate)")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise _refused(path, f"must be a finite number, got {item}")
        elif isinstance(item, (dict, list)):
            if len(path) >= MAX_DEPTH:
                raise _refused(path, f"nested deeper than {MAX_DEPTH} levels")
            for key, child in item.items() if isinstance(item, dict) else enumerate(item):
                if isinstance(key, str) and _SURROGATE.search(key):
                    raise _refused(path, f"a key with invalid Unicode (a lone surrogate): {key!r}")
                if not isinstance(child, (int, type(None))):  # ints, bools and null are always fine
                    stack.append((child, (*path, key)))


def _refused(path: tuple, why: str) -> APIError:
    where = ".".join(map(str, path)) or "body"
    return APIError(f"{where}: {why}", param=str(path[0]) if path else None)


class _ValidatedRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_validated_json"):
            self._validated_json = parse_body(await self.body())
        return self._validated_json


class ValidatedJSONRoute(APIRoute):
    """A route whose non-empty body must pass ``parse_body`` (FastAPI then reuses the parse)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def validated(request: Request) -> Response:
            request = _ValidatedRequest(request.scope, request.receive)
            try:
                body = await request.body()
            except ClientDisconnect:  # gone mid-body: nobody to answer, nothing to log as a server error
                raise APIError("body: the client disconnected while sending it") from None
            if body:
                await request.json()  # raises here, outside FastAPI's body parsing, so the 400 keeps its message
            return await handler(request)

        return validated


def check_generation_overrides(overrides: dict[str, Any]) -> None:
    """``--override-generation-config`` holds only ``SamplingParams`` fields with valid values."""
    unknown = sorted(set(overrides) - REQUEST_FIELDS - {"guided_decoding"})
    if unknown:
        raise ValueError(
            f"--override-generation-config: {', '.join(map(repr, unknown))} not a sampling parameter; "
            f"known: {', '.join(sorted(REQUEST_FIELDS - {'guided_decoding'}))}"
        )
    try:
        SamplingParams(**{"max_tokens": None, **overrides})  # a request's own max_tokens comes later
    except ValueError as exc:
        raise ValueError(f"--override-generation-config: {exc}") from None
