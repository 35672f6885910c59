"""The models a request may name: the base model's served names and the LoRA adapters (vLLM's
``OpenAIServingModels``).

Adapters come from ``--lora-modules`` at start-up and, with runtime updates enabled
(``--enable-lora-runtime-updates`` or ``KILN_ALLOW_RUNTIME_LORA_UPDATING=true``), from
``POST /v1/load_lora_adapter``; ``POST /v1/unload_lora_adapter`` drops one. Each adapter gets a
fresh ``lora_int_id`` (1, 2, ...; never reused, so an adapter loaded again under the same name
shares no prefix-cache entries with its predecessor). The registry is changed on the event loop
only; the adapter is read and checked (``LLMEngine.add_lora``) in a worker thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from kiln.entrypoints.openai.cli_args import LoRAModulePath
from kiln.entrypoints.openai.protocol import APIError, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from kiln.envs import env_flag
from kiln.lora.request import LoRARequest

if TYPE_CHECKING:
    from kiln.engine.async_engine import AsyncEngine

logger = logging.getLogger("kiln.server")
RUNTIME_UPDATES_ENV = ("KILN_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updates_enabled(flag: bool) -> bool:
    """``--enable-lora-runtime-updates``, or ``KILN_ALLOW_RUNTIME_LORA_UPDATING`` (vLLM's
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) set to true; a value neither true nor false is refused."""
    return any([flag] + [env_flag(name, False) for name in RUNTIME_UPDATES_ENV])


class ServingModels:
    """Served names and adapters: what ``model`` may be, and the ``/v1/models`` cards."""

    def __init__(self, engine: AsyncEngine, served_model_names: list[str]) -> None:
        self.engine = engine
        self.base_names = list(served_model_names)
        self.info = engine.model_info
        self.created = int(time.time())
        self.loras: dict[str, LoRARequest] = {}  # by name, in load order
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()  # one load or unload at a time (each awaits a disk read)

    # ------------------------------------------------------------ requests
    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names; None for the base model (or no name); else a 404."""
        if model is None or model in self.base_names:
            return None
        lora = self.loras.get(model)
        if lora is None:
            raise APIError(f"The model `{model}` does not exist.", status=404, param="model")
        return lora

    def model_name(self, lora: LoRARequest | None) -> str:
        """The name responses and metrics report: the adapter's, else the first served name."""
        return self.base_names[0] if lora is None else lora.lora_name

    def cards(self) -> list[dict]:
        """``/v1/models``: the served names, then each adapter."""
        return [self.card(name) for name in [*self.base_names, *self.loras]]

    def card(self, name: str) -> dict:
        """One model's card (``name`` is a served name or an adapter's)."""
        lora = self.loras.get(name) if name not in self.base_names else None
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "kiln",
            "root": self.info.path if lora is None else lora.lora_path,
            "parent": None if lora is None else lora.base_model_name or self.base_names[0],
            "max_model_len": self.info.max_model_len,
        }

    # ------------------------------------------------------------ adapters
    def _new_lora(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        if name in self.base_names:
            raise ValueError(f"LoRA adapter {name!r}: the name is a served model name (--served-model-name)")
        return LoRARequest(name, next(self._ids), path, base_model_name)

    def add_static(self, modules: list[LoRAModulePath]) -> None:
        """Register ``--lora-modules`` at start-up (before the engine loop runs); ``ValueError`` says
        which adapter is wrong and why."""
        for module in modules:
            if module.name in self.loras:
                raise ValueError(f"--lora-modules: {module.name!r} is given twice")
            try:
                lora = self._new_lora(module.name, module.path, module.base_model_name)
                self.engine.add_lora(lora)
            except ValueError as exc:
                raise ValueError(f"--lora-modules: {exc}") from None
            self.loras[module.name] = lora
            logger.info("LoRA adapter %r (id %d) from %s", lora.lora_name, lora.lora_int_id, lora.lora_path)

    async def load(self, req: LoadLoRAAdapterRequest) -> str:
        """Read, check and register an adapter; a bad one is a 400 saying why."""
        async with self._lock:
            old = self.loras.get(req.lora_name)
            if old is not None and not req.load_inplace:
                raise APIError(f"The lora adapter '{req.lora_name}' has already been loaded.", param="lora_name")
            try:
                lora = self._new_lora(req.lora_name, req.lora_path)
                await asyncio.to_thread(self.engine.add_lora, lora)
            except ValueError as exc:
                raise APIError(str(exc), param="lora_path") from None
            self.loras[req.lora_name] = lora
            if old is not None:  # load_inplace: new requests take the new weights
                self.engine.remove_lora(old.lora_int_id)
        logger.info("LoRA adapter %r loaded (id %d) from %s", lora.lora_name, lora.lora_int_id, lora.lora_path)
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    async def unload(self, req: UnloadLoRAAdapterRequest) -> str:
        """Drop an adapter: new requests naming it get a 404, running ones finish with it."""
        async with self._lock:
            if req.lora_name is None and req.lora_int_id is None:
                raise APIError("give lora_name or lora_int_id", param="lora_name")
            found = [
                lora
                for lora in self.loras.values()
                if req.lora_name in (None, lora.lora_name) and req.lora_int_id in (None, lora.lora_int_id)
            ]
            if not found:
                which = repr(req.lora_name) if req.lora_name is not None else f"with lora_int_id {req.lora_int_id}"
                raise APIError(f"The lora adapter {which} cannot be found.", status=404, param="lora_name")
            lora = found[0]
            del self.loras[lora.lora_name]
            self.engine.remove_lora(lora.lora_int_id)
        logger.info("LoRA adapter %r unloaded (id %d)", lora.lora_name, lora.lora_int_id)
        return f"Success: LoRA adapter '{lora.lora_name}' removed successfully."


def add_routes(app: FastAPI, models: ServingModels) -> None:
    """``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (runtime updates only)."""
    logger.warning("LoRA runtime updates are on: clients may load adapters from any folder this server can read")

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await models.load(body))

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await models.unload(body))
