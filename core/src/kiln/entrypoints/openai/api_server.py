"""``kiln serve``: the FastAPI app (OpenAI and vLLM endpoints) and how uvicorn runs it."""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import logging
import os
import signal
import threading
import time
from contextlib import asynccontextmanager

import psutil
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import kiln
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.openai.chat_utils import resolve_chat_template
from kiln.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from kiln.entrypoints.openai.middleware import APIKeyMiddleware, BodyLimitMiddleware, RequestIdMiddleware
from kiln.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
)
from kiln.entrypoints.openai.serving import Prompt, ServerOptions, error_message, new_id
from kiln.entrypoints.openai.serving_chat import ChatServing
from kiln.entrypoints.openai.serving_completion import CompletionServing
from kiln.entrypoints.openai.serving_models import ServingModels, runtime_updates_enabled
from kiln.entrypoints.openai.serving_models import add_routes as add_lora_routes
from kiln.entrypoints.openai.serving_pooling import PoolingServing
from kiln.entrypoints.openai.serving_pooling import add_routes as add_pooling_routes
from kiln.entrypoints.openai.serving_responses import add_routes as add_responses_routes
from kiln.entrypoints.openai.structured_outputs import structured_outputs_constraint
from kiln.entrypoints.openai.tls import CertRefresher, check_tls_args
from kiln.entrypoints.openai.validation import ValidatedJSONRoute, check_generation_overrides
from kiln.envs import env_number
from kiln.interfaces.tokenizer import is_mistral
from kiln.pooling_params import PoolingParams
from kiln.registry import load_ref
from kiln.sampling_params import REQUEST_FIELDS, RequestOutputKind, SamplingParams

logger = logging.getLogger("kiln.server")


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = param or (loc[0] if loc else None)
        where = ".".join(loc) or "body"
        parts.append(f"{where}: {err.get('msg')}")
    error = APIError("; ".join(parts) or "invalid request", param=param)
    return JSONResponse(error.body(), status_code=400)


def build_app(
    engine: AsyncEngine, options: ServerOptions, args: argparse.Namespace, models: ServingModels | None = None
) -> FastAPI:
    """The app; ``models`` holds the LoRA adapters registered at start-up (default: none)."""
    models = models if models is not None else ServingModels(engine, options.served_model_names)
    metrics = ServerMetrics(engine, options.served_model_names[0])
    completions = CompletionServing(engine, options, metrics, models)
    chat = ChatServing(engine, options, metrics, models)
    model = engine.model_info

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    docs = {} if not args.disable_fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="Kiln", version=kiln.__version__, lifespan=lifespan, **docs)  # uvicorn sets root_path
    app.router.route_class = ValidatedJSONRoute  # every route added below checks its JSON body first

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        return _validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(APIError(str(exc.detail), status=exc.status_code).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logger.exception("internal error on %s", request.url.path)
        error = APIError(f"internal server error: {type(exc).__name__}", status=500)
        return JSONResponse(error.body(), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_healthy else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": kiln.__version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": models.cards()}

    @app.get("/v1/models/{model_id:path}")  # served names may hold slashes ("org/model")
    async def retrieve_model(model_id: str) -> dict:
        models.check_model(model_id)
        return models.card(model_id)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request):
        return await completions.create(body, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
        return await chat.create(body, raw)

    add_responses_routes(app, chat)
    if runtime_updates_enabled(getattr(args, "enable_lora_runtime_updates", False)):
        add_lora_routes(app, models)
    add_pooling_routes(app, PoolingServing(engine, options, metrics, chat))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        completions.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            ids = chat.render(body, bool(body.add_special_tokens)).token_ids
        else:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = completions.tokenize(body.prompt, add)
        out = {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = model.tokenizer.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        completions.check_model(body.model)
        vocab = model.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"tokens: ids out of the vocabulary [0, {vocab}): {bad[:5]}", param="tokens")
        return {"prompt": model.tokenizer.decode(body.tokens)}

    @app.post("/generate")
    async def generate(body: GenerateRequest, raw: Request):
        """vLLM's simple API: ``{"prompt", "stream", ...SamplingParams}`` → ``{"text": [prompt + output]}``."""
        fields = dict(body.model_extra or {})
        if "guided_decoding" in fields:  # an engine-side field: clients give the constraint as structured_outputs
            raise APIError("guided_decoding: give the constraint as structured_outputs", param="guided_decoding")
        unknown = sorted(set(fields) - REQUEST_FIELDS)
        if unknown:
            raise APIError(f"{unknown[0]}: not a sampling parameter", param=unknown[0])
        kind = RequestOutputKind.CUMULATIVE if body.stream else RequestOutputKind.FINAL_ONLY
        try:
            params = SamplingParams(**fields, output_kind=kind)
            if body.structured_outputs is not None:
                params.guided_decoding = structured_outputs_constraint(body.structured_outputs)
        except ValueError as exc:
            raise error_message(exc) from None
        if isinstance(body.prompt, str):
            prompt = Prompt(body.prompt, completions.tokenize(body.prompt, True))
        else:
            prompt = Prompt(None, body.prompt)
        await completions.compile_guide(params)
        stream = completions.start(new_id("generate"), [(prompt, params)])[0]
        prefix = body.prompt if isinstance(body.prompt, str) else ""
        if body.stream:

            async def lines():
                try:
                    async for out in stream:
                        yield json.dumps({"text": [prefix + c.text for c in out.outputs]}) + "\n"
                finally:
                    stream.close()

            return StreamingResponse(lines(), media_type="application/x-ndjson")
        out = (await completions.final_outputs([stream], raw))[0]
        return {"text": [prefix + c.text for c in out.outputs]}

    _add_middleware(app, args)
    return app


def _add_middleware(app: FastAPI, args: argparse.Namespace) -> None:
    for ref in args.middleware:
        imported = load_ref(ref)
        if inspect.isclass(imported):
            app.add_middleware(imported)
        elif inspect.iscoroutinefunction(imported):
            app.middleware("http")(imported)
        else:
            raise ValueError(f"--middleware: {ref!r} is neither a class nor an async function")
    if args.max_request_body_bytes:
        app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_request_body_bytes)
    if args.api_key:  # outside the body limit: a client without the key is refused before its body is read
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)
    if args.enable_request_id_headers:  # outside both, so their 401s and 413s carry the id too
        app.add_middleware(RequestIdMiddleware)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=args.allowed_origins,
        allow_credentials=args.allow_credentials,
        allow_methods=args.allowed_methods,
        allow_headers=args.allowed_headers,
    )


def _warm_up(llm: LLMEngine) -> None:
    """One tiny request through every stage, so the first client does not pay for lazy set-up."""
    if llm.model_info.task == "generate":
        params = SamplingParams(max_tokens=2, ignore_eos=True)
    else:  # a pooling model (--task)
        params = PoolingParams()
    llm.add_request("warm-up", {"prompt_token_ids": [0] * 4}, params)
    while llm.has_unfinished_requests():
        llm.step()


def resolve_parsers(args: argparse.Namespace) -> tuple[type | None, type | None]:
    """The tool and reasoning parser classes the flags name (a ``--tool-parser-plugin`` file first)."""
    from kiln.plugins import get_plugin_manager

    plugins = get_plugin_manager()
    if args.tool_parser_plugin:
        plugins.load_file(args.tool_parser_plugin)
    registry = plugins.registry
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice: needs --tool-call-parser")
    if args.enable_reasoning:
        if not args.reasoning_parser:
            raise ValueError("--enable-reasoning: needs --reasoning-parser")
        logger.warning("--enable-reasoning is deprecated (as in vLLM): --reasoning-parser alone turns reasoning on")
    found = []
    for flag, kind, name in (
        ("--tool-call-parser", "tool_parsers", args.tool_call_parser),
        ("--reasoning-parser", "reasoning_parsers", args.reasoning_parser),
    ):
        if name is None:
            found.append(None)
            continue
        table = registry.table(kind)
        if name not in table:
            known = ", ".join(registry.names(kind)) or "none (pip install kiln-plugin-tool-parsers)"
            raise ValueError(f"{flag}: {name!r} is not registered; registered: {known}")
        found.append(load_ref(table[name]))
    return found[0], found[1]


def _iteration_timeout() -> float | None:
    """``KILN_ENGINE_ITERATION_TIMEOUT_S`` (vLLM's default of 60 s; 0 turns the watchdog off)."""
    return env_number("KILN_ENGINE_ITERATION_TIMEOUT_S", 60.0) or None


MISTRAL_TEMPLATE = (
    "--chat-template: the model's mistral_common tokenizer (--tokenizer-mode mistral) encodes conversations itself, "
    "with no template"
)


def run_server(args: argparse.Namespace) -> int:
    """Load the model, then serve until SIGINT/SIGTERM (in-flight requests are drained first)."""
    import uvicorn

    from kiln.config import EngineConfig
    from kiln.engine_args import engine_kwargs
    from kiln.plugins import get_plugin_manager

    started = time.monotonic()
    tool_parser, reasoning_parser = resolve_parsers(args)  # bad flags fail before the model loads
    if args.chat_template is not None and getattr(args, "tokenizer_mode", "auto") == "mistral":  # given flags only
        raise ValueError(MISTRAL_TEMPLATE)
    check_tls_args(args)
    check_generation_overrides(args.override_generation_config or {})
    iteration_timeout = _iteration_timeout()
    runtime_updates_enabled(args.enable_lora_runtime_updates)  # a bad KILN_ALLOW_RUNTIME_LORA_UPDATING fails here
    config = EngineConfig.create(model=args.model_tag or args.model, **engine_kwargs(args))
    if args.lora_modules and not config.enable_lora:
        raise ValueError("--lora-modules: needs --enable-lora")
    llm = LLMEngine(config)
    if args.chat_template is not None and is_mistral(llm.model_info.tokenizer):  # auto picked mistral_common
        raise ValueError(MISTRAL_TEMPLATE)
    _warm_up(llm)
    options = ServerOptions(
        tool_parser=tool_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=reasoning_parser,
        served_model_names=args.served_model_name or [llm.model_info.name],
        response_role=args.response_role,
        chat_template=resolve_chat_template(args.chat_template, get_plugin_manager().registry),
        chat_template_content_format=args.chat_template_content_format,
        trust_request_chat_template=args.trust_request_chat_template,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        disable_log_requests=args.disable_log_requests,
        max_log_len=args.max_log_len,
        generation_overrides=args.override_generation_config or {},
    )
    http: threading.Thread | None = None

    def exit_stuck() -> None:
        # The main thread is stuck in a step: let the HTTP side answer 503s and close, then end the
        # process non-zero so its supervisor restarts it.
        server.should_exit = True
        if http is not None:
            http.join(timeout=10)
        logger.error("exiting: the engine is stuck")
        # os._exit skips atexit: stop the children (tensor-parallel ranks, likely stuck in the same
        # collective, and guided compile workers) here, so a restart finds the devices free.
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
        os._exit(1)

    engine = AsyncEngine(
        llm,
        log_stats_interval=None if args.disable_log_stats else 10.0,
        own_thread=False,
        max_queued_requests=args.max_queued_requests,
        iteration_timeout=iteration_timeout,
        on_stuck=exit_stuck,
    )
    models = ServingModels(engine, options.served_model_names)
    try:
        models.add_static(args.lora_modules or [])  # a bad adapter fails start-up, naming it
    except ValueError:
        llm.shutdown()  # tensor-parallel workers, if any
        raise
    app = build_app(engine, options, args, models)
    # The model, tokenizer and engine live as long as the server: keep them out of the
    # collector's full passes, which otherwise walk every one of them (~1-2 % of a decode step).
    gc.freeze()
    logger.info(
        "model loaded in %.1f s; serving %s on %s:%d",
        time.monotonic() - started,
        options.served_model_names[0],
        args.host,
        args.port,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs,
            root_path=args.root_path or "",
        )
    )
    refresher = None
    if args.enable_ssl_refresh:
        server.config.load()  # builds the SSLContext the refresher reloads in place
        refresher = CertRefresher(
            server.config.ssl, args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, lambda: engine.event_loop
        ).start()

    def serve_http() -> None:
        try:
            server.run()
        finally:
            engine.shutdown(timeout=0)  # stops the engine loop once it holds no requests

    def stop(signum, frame) -> None:
        logger.info("received signal %d: draining in-flight requests", signum)
        server.should_exit = True

    # uvicorn only installs signal handlers on the main thread, which the engine loop holds.
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    http = threading.Thread(target=serve_http, name="kiln-http")
    http.start()
    engine.run_loop()
    http.join()
    if refresher is not None:
        refresher.stop()
    llm.shutdown()  # tensor-parallel workers, if any
    return 1 if engine.dead is not None else 0
