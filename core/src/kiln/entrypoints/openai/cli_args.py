"""``kiln serve`` flags (vLLM's names) and ``--config file.yaml`` (command line > file > defaults)."""

from __future__ import annotations

import argparse
import json
import os
import ssl
from dataclasses import dataclass

import yaml

from kiln.engine_args import add_engine_args


def _json_list(value: str) -> list[str]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = [v.strip() for v in value.split(",")]
    if isinstance(parsed, str):
        parsed = [parsed]
    if not isinstance(parsed, list):
        raise argparse.ArgumentTypeError(f"expected a JSON list, got {value!r}")
    return parsed


def _json_dict(value: str) -> dict:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


@dataclass(frozen=True, slots=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry (vLLM's type)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str | dict) -> LoRAModulePath:
    """``name=path`` or a JSON object ``{"name", "path", "base_model_name"}`` (a mapping from
    ``--config``); the argparse ``type`` of ``--lora-modules``."""
    if isinstance(value, str) and not value.lstrip().startswith("{"):
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(f"expected name=path or a JSON object, got {value!r}")
        return LoRAModulePath(name, path)
    if isinstance(value, str):
        value = _json_dict(value)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected name=path or a JSON object, got {value!r}")
    unknown = sorted(set(value) - {"name", "path", "base_model_name"})
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown key {unknown[0]!r} (keys: name, path, base_model_name)")
    fields = {k: value.get(k) for k in ("name", "path", "base_model_name")}
    if not all(isinstance(fields[k], str) and fields[k] for k in ("name", "path")):
        raise argparse.ArgumentTypeError(f"needs a non-empty name and path, got {value!r}")
    if fields["base_model_name"] is not None and not isinstance(fields["base_model_name"], str):
        raise argparse.ArgumentTypeError(f"base_model_name must be a string, got {value!r}")
    return LoRAModulePath(**fields)


def _positive_or_zero(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected a count >= 0, got {value}")
    return number


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag", nargs="?", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--model", default=None, help="the model, as a flag (the positional wins)")
    parser.add_argument("--config", default=None, help="YAML file of flags (keys as flag names); the command line wins")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="0.0.0.0", help="address to listen on (default: 0.0.0.0)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    server.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical", "trace"],
        help="uvicorn's log level (default: info)",
    )
    server.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    server.add_argument("--allowed-origins", type=_json_list, default=["*"], help='CORS origins, JSON list (["*"])')
    server.add_argument("--allowed-methods", type=_json_list, default=["*"], help='CORS methods, JSON list (["*"])')
    server.add_argument("--allowed-headers", type=_json_list, default=["*"], help='CORS headers, JSON list (["*"])')
    server.add_argument(
        "--api-key",
        default=os.environ.get("KILN_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health, /version, /metrics and the docs "
        "(default: $KILN_API_KEY)",
    )
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names the API accepts for the model; the first is reported (default: the model's name)",
    )
    server.add_argument("--chat-template", default=None, help="chat template: a file, a registered name, or inline")
    server.add_argument(
        "--chat-template-content-format",
        default="auto",
        choices=["auto", "string", "openai"],
        help="render message content as a string or as OpenAI parts (auto: detect from the template)",
    )
    server.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat template from requests (chat_template, or chat_template_kwargs overriding it or the "
        "renderer's arguments); every template renders in a bounded sandbox either way",
    )
    server.add_argument("--response-role", default="assistant", help="role of generated chat messages")
    server.add_argument("--ssl-keyfile", default=None, help="TLS key file")
    server.add_argument("--ssl-certfile", default=None, help="TLS certificate file")
    server.add_argument("--ssl-ca-certs", default=None, help="CA certificates file (to verify client certificates)")
    server.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=ssl.CERT_NONE,
        choices=[ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED],
        help="client certificates: 0 not asked for, 1 optional, 2 required (needs --ssl-ca-certs) (default: 0)",
    )
    server.add_argument(
        "--enable-ssl-refresh",
        action="store_true",
        help="reload the TLS key, certificate and CA files when they change on disk (no restart)",
    )
    server.add_argument(
        "--max-queued-requests",
        type=_positive_or_zero,
        default=None,
        help="requests that may wait beyond the --max-num-seqs running ones; past it a 503 with Retry-After "
        "(default: no bound)",
    )
    server.add_argument(
        "--max-request-body-bytes",
        type=_positive_or_zero,
        default=32 * 1024 * 1024,
        help="largest request body accepted; larger ones get a 413; 0: no limit (default: 32 MiB)",
    )
    server.add_argument("--root-path", default=None, help="FastAPI root_path when behind a path-routing proxy")
    server.add_argument(
        "--middleware",
        action="append",
        default=[],
        help="import path of an ASGI middleware class or an @app.middleware('http') function (repeatable)",
    )
    server.add_argument(
        "--return-tokens-as-token-ids", action="store_true", help="logprob tokens as 'token_id:{id}' strings"
    )
    server.add_argument("--enable-request-id-headers", action="store_true", help="add X-Request-Id to responses")
    server.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json")
    server.add_argument("--disable-log-requests", action="store_true", help="do not log each request")
    server.add_argument("--max-log-len", type=int, default=None, help="characters/tokens of a prompt to log")
    server.add_argument(
        "--disable-log-stats", action="store_true", help="no periodic throughput / queue / KV-usage log line"
    )
    server.add_argument(
        "--enable-prompt-tokens-details", action="store_true", help="usage.prompt_tokens_details.cached_tokens"
    )
    server.add_argument(
        "--override-generation-config",
        type=_json_dict,
        default=None,
        help="JSON sampling defaults over the model's generation config, e.g. '{\"temperature\": 0.5}'",
    )
    lora = parser.add_argument_group("LoRA adapters (with --enable-lora)")
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=None,
        help='adapters served by name: name=path, or JSON \'{"name": ..., "path": ..., "base_model_name": ...}\' '
        "(several values; needs --enable-lora)",
    )
    lora.add_argument(
        "--enable-lora-runtime-updates",
        action="store_true",
        help="add POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also: KILN_ALLOW_RUNTIME_LORA_UPDATING=true "
        "or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
    )
    tools = parser.add_argument_group("tool calling and reasoning")
    tools.add_argument("--enable-auto-tool-choice", action="store_true", help='parse tool calls for tool_choice "auto"')
    tools.add_argument("--tool-call-parser", default=None, help="a registered tool parser (see `kiln plugins`)")
    tools.add_argument(
        "--tool-parser-plugin",
        default=None,
        help="a Python file whose @kiln.hookimpl register_tool_parsers adds parsers selectable by name",
    )
    tools.add_argument(
        "--enable-reasoning",
        action="store_true",
        help="deprecated, as in vLLM: --reasoning-parser alone turns on reasoning_content",
    )
    tools.add_argument("--reasoning-parser", default=None, help="a registered reasoning parser (see `kiln plugins`)")
    add_engine_args(parser)


def apply_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Make the values of ``--config FILE`` the parser's defaults, so the command line still wins."""
    path = None
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
    if path is None:
        return
    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"--config: cannot read {path}: {exc}")
    if not isinstance(values, dict):
        parser.error(f"--config: {path} must hold a mapping of flag names to values")
    actions = {a.dest: a for a in parser._actions}
    defaults = {}
    for key, value in values.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in actions or dest in ("config", "help"):
            parser.error(f"--config: unknown flag {key!r} in {path}")
        action = actions[dest]
        if action.nargs in ("+", "*") and not isinstance(value, list):
            value = [value]
        if action.type is not None and isinstance(value, list) and action.nargs in ("+", "*"):
            value = [_config_value(parser, action, key, v) for v in value]
        elif action.type is not None and isinstance(value, str):
            value = _config_value(parser, action, key, value)
        defaults[dest] = value
    parser.set_defaults(**defaults)


def _config_value(parser: argparse.ArgumentParser, action: argparse.Action, key: str, value: object) -> object:
    """A ``--config`` value through the flag's ``type``, as the command line would give it."""
    if not isinstance(value, str) and action.type is not parse_lora_module:  # a mapping is a JSON object
        return value
    try:
        return action.type(value)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        parser.error(f"--config: {key}: {exc}")
