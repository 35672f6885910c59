"""``AsyncEngine``: the engine loop on its own thread, fed from and read by asyncio.

The HTTP front end tokenizes and validates on the event loop
(``LLMEngine.process_request``), so bad input fails before it is queued; the
engine loop alone steps the model (one process, one compute thread pool: two
OpenMP pools on the same cores slow each other badly) and posts each step's
outputs back to the event loop. The event loop only ever waits on queues, never
on torch.

``kiln serve`` runs the engine loop on the process's main thread and the HTTP
server on another (``run_loop``): small oneDNN matmuls ran about twice as slow
from a second thread as from the main one on this project's machines. Tests and
embedders can let ``start()`` run it on a thread of its own instead.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

from kiln.engine.llm_engine import LLMEngine, PromptInput
from kiln.lora.request import LoRARequest
from kiln.outputs import RequestOutput
from kiln.sampling_params import SamplingParams

logger = logging.getLogger("kiln.engine")


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can be served any more."""


class EngineOverloadedError(RuntimeError):
    """The engine holds as many requests as it may queue (``--max-queued-requests``); try again later."""


class RequestStream:
    """The outputs of one request, as an async iterator; ``close()`` aborts it if unfinished."""

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class AsyncEngine:
    """The engine loop fed from asyncio.

    ``max_queued_requests``: requests waiting beyond the ``max_num_seqs`` the engine runs at once;
    past it ``add_request`` raises ``EngineOverloadedError`` (None: no bound).
    ``iteration_timeout``: seconds one engine step may take before a watchdog declares the engine
    stuck: it is then dead (``is_healthy`` False, every stream fails) and ``on_stuck`` is called
    from the watchdog's thread, since the stuck thread cannot act (None: no watchdog).
    """

    def __init__(
        self,
        engine: LLMEngine,
        log_stats_interval: float | None = 10.0,
        own_thread: bool = True,
        max_queued_requests: int | None = None,
        iteration_timeout: float | None = None,
        on_stuck: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.max_in_flight = None if max_queued_requests is None else engine.config.max_num_seqs + max_queued_requests
        self.iteration_timeout = iteration_timeout
        self.on_stuck = on_stuck
        self._step_started: float | None = None  # monotonic time of the running step, read by the watchdog
        self.model_info = engine.model_info  # what the front end may know of the model
        self.input_processor = engine.input_processor
        self.own_thread = own_thread  # False: the caller runs ``run_loop()`` on a thread it chose
        self.log_stats_interval = log_stats_interval
        self.dead: BaseException | None = None
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._looping = False
        self._last_log: tuple[float, dict] = (time.monotonic(), {})  # when, and get_stats() then

    # ------------------------------------------------------------ event loop side
    def start(self) -> None:
        """Post outputs to the running event loop; start the engine thread unless the caller runs it.

        A new event loop restarts the thread (test clients run one loop per client)."""
        loop = asyncio.get_running_loop()
        if not self.own_thread:
            self._loop = loop
            return
        if self._thread is not None and self._thread.is_alive():
            if loop is self._loop:
                return
            self.shutdown()
        self._loop, self._stopping, self._looping = loop, False, True
        self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
        self._thread.start()

    def run_loop(self) -> None:
        """Run the engine loop on the calling thread until ``shutdown()`` (``own_thread=False``)."""
        self._run()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Let the engine finish what it holds, then stop its loop."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def get_stats(self) -> dict:
        """The engine's counters and gauges (read from another thread: plain numbers only)."""
        return self.engine.get_stats()

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the engine posts outputs to (the HTTP server's), once started."""
        return self._loop

    @property
    def is_healthy(self) -> bool:
        return self.dead is None and self._looping

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Validate and queue a request; raises ``ValueError`` for bad input, ``EngineDeadError`` if stopped."""
        if not self.is_healthy:
            raise EngineDeadError(f"the engine is not running: {self.dead!r}" if self.dead else "the engine is stopped")
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if self.max_in_flight is not None and len(self._streams) >= self.max_in_flight:
            raise EngineOverloadedError(
                f"the server is at capacity ({len(self._streams)} requests in flight, --max-queued-requests "
                f"{self.max_in_flight - self.engine.config.max_num_seqs}); retry later"
            )
        processed = self.engine.process_request(request_id, prompt, params, arrival_time, priority, lora_request)
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        self._commands.put(("add", processed))
        self._wake.set()
        return stream

    def add_lora(self, lora_request: LoRARequest) -> None:
        """``LLMEngine.add_lora`` (reads the adapter: call it off the event loop)."""
        self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        """``LLMEngine.remove_lora``."""
        self.engine.remove_lora(lora_int_id)

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._commands.put(("abort", request_id))
            self._wake.set()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted while the step ran
            stream.queue.put_nowait(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_all(self, exc: BaseException) -> None:
        error = EngineDeadError(f"the engine stopped: {exc!r}")
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        self._streams.clear()

    # ---------------------------------------------------------------- engine side
    def _run(self) -> None:
        engine = self.engine
        self._looping = True
        if self.iteration_timeout is not None:
            threading.Thread(target=self._watch, name="kiln-watchdog", daemon=True).start()
        try:
            while self.dead is None:
                self._drain_commands()
                if not engine.has_unfinished_requests():
                    if self._stopping:
                        return
                    self._wake.wait(self.log_stats_interval)
                    self._wake.clear()
                    self._log_stats()
                    continue
                self._step_started = time.monotonic()
                outputs = engine.step()
                self._step_started = None
                if outputs and self.dead is None:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs)
                self._log_stats()
        except BaseException as exc:  # the loop must report every death, not only Exceptions
            logger.exception("engine loop stopped")
            self.dead = exc
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._fail_all, exc)
        finally:
            self._looping = False

    def _watch(self) -> None:
        """Declare the engine dead when one step runs past ``iteration_timeout``."""
        timeout = self.iteration_timeout
        while self._looping and self.dead is None:
            started = self._step_started
            if started is not None and time.monotonic() - started > timeout:
                logger.error("an engine step has run for over %.0f s: the engine is stuck", timeout)
                self.dead = TimeoutError(f"an engine step ran past {timeout:g} s (KILN_ENGINE_ITERATION_TIMEOUT_S)")
                if self._loop is not None:
                    self._loop.call_soon_threadsafe(self._fail_all, self.dead)
                if self.on_stuck is not None:
                    self.on_stuck()
                return
            time.sleep(min(1.0, timeout / 4))

    def _drain_commands(self) -> None:
        while True:
            try:
                command, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "add":
                self.engine.add_processed(arg)
            else:
                self.engine.abort_request(arg)

    def _log_stats(self) -> None:
        if self.log_stats_interval is None:
            return
        now = time.monotonic()
        then, before = self._last_log
        if now - then < self.log_stats_interval:
            return
        stats = self.get_stats()
        elapsed = now - then
        logger.info(
            "throughput: prompt %.1f tokens/s, generation %.1f tokens/s | running %d, waiting %d reqs | "
            "KV cache usage %.1f%%",
            (stats["prompt_tokens"] - before.get("prompt_tokens", 0)) / elapsed,
            (stats["generation_tokens"] - before.get("generation_tokens", 0)) / elapsed,
            stats["num_running"],
            stats["num_waiting"],
            100 * stats["kv_cache_usage"],
        )
        if stats["spec_decode"] is not None:
            spec = stats["spec_decode"].since(before.get("spec_decode"))
            if spec.num_drafts:  # quiet while nothing was drafted
                logger.info("%s", spec.summary())
        self._last_log = (now, stats)
