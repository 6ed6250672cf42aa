"""The engine behind the server: one background thread drives :class:`specdec.engine.Engine`;
request handlers (asyncio) submit requests and receive each step's tokens on a queue.

Torch releases the GIL inside its kernels, so the event loop stays responsive while the
thread runs a forward. Only the engine thread touches the engine; handlers talk to it
through an inbox (add / abort), and it answers on each request's asyncio queue with
``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from specdec.config import SamplingParams, SpeculativeConfig
from specdec.engine import Engine, Sequence, StepOutput
from specdec.llm import LLM
from specdec.metrics import SpecStats
from specdec.server.metrics import ServerMetrics, StatsLog

logger = logging.getLogger(__name__)


class Overloaded(Exception):
    """Too many requests queued (HTTP 429)."""


class Unavailable(Exception):
    """The server is shutting down (HTTP 503)."""


@dataclass
class Update:
    """One step's news for a request: new tokens, and the finish reason when done.

    Attributes:
        new_token_ids: tokens this step added.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``None``.
        text_end: for a stop string, where the text ends.
        error: set when the request failed inside the engine (the message).
        status: the HTTP status that error maps to (400: the engine refused the request;
            500: an internal failure).
        stats: on the final update, a snapshot of the request's speculation counters.
        logprobs: with ``SamplingParams.logprobs``, one
            :class:`~specdec.sampling.TokenLogprob` per new token.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, on the first update:
            one entry per prompt token (``None`` first).
    """

    new_token_ids: list[int]
    finish_reason: str | None = None
    text_end: int | None = None
    error: str | None = None
    status: int = 200
    stats: SpecStats | None = None
    logprobs: list | None = None
    prompt_logprobs: list | None = None


@dataclass
class _Handle:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrived: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    #: the request scores its prompt only (completions' ``echo`` with ``max_tokens: 0``):
    #: the one token it runs for is not passed on
    score_only: bool = False


class AsyncEngine:
    """Runs an :class:`LLM`'s target in the batched engine on a background thread.

    Args:
        llm: the loaded model, drafter defaults and engine limits.
        max_waiting: most requests queued but not yet admitted before new ones get
            :class:`Overloaded` (HTTP 429).
        metrics: where counters go (default: a new :class:`ServerMetrics`).
        stats: a :class:`~specdec.server.metrics.StatsLog` the engine thread feeds and
            ticks (``None``: no periodic line).
    """

    def __init__(
        self,
        llm: LLM,
        max_waiting: int = 256,
        metrics: ServerMetrics | None = None,
        stats: StatsLog | None = None,
    ):
        self.llm = llm
        self.stats = stats
        self._prompt_counted = 0  # the engine's computed prompt tokens already in ``stats``
        self.engine = Engine(llm.target, llm.engine_config, llm.cost_model, llm.prefix_cache())
        self.max_waiting = max_waiting
        self.metrics = metrics or ServerMetrics()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[str, _Handle] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._draining = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._last_stats: dict[str, tuple] = {}

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Run the engine loop on a background thread."""
        self._thread.start()

    def run(self) -> None:
        """Run the engine loop on the calling thread until :meth:`shutdown` (what
        ``specdec serve`` does on the main thread: PyTorch's OpenMP workers belong to the
        thread that computes, and a second thread's team ran the model ~1.6x slower while
        the main thread's team existed, measured on 2 cores)."""
        self._run()

    @property
    def num_live(self) -> int:
        """Requests submitted and not finished."""
        return len(self._handles)

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting; let live requests finish for up to ``timeout`` seconds, abort the
        rest, and stop the thread."""
        self._draining = True
        deadline = time.monotonic() + timeout
        while self._handles and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._handles):
            self.abort(request_id)
        await asyncio.sleep(0.05)
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 5.0)

    # ------------------------------------------------------------------ requests

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        speculative: SpeculativeConfig,
        drafter=None,
        score_only: bool = False,
    ) -> asyncio.Queue:
        """Queue a request; its :class:`Update` items arrive on the returned queue.
        ``drafter``: the request's own (its prediction), instead of ``speculative``'s.
        ``score_only``: the request is run for its prompt's log-probabilities (with
        ``params.prompt_logprobs``); its updates carry no token, and its finish reason
        is ``"length"`` (OpenAI's legacy ``echo`` with ``max_tokens: 0``).

        Raises:
            Unavailable: the server is shutting down.
            Overloaded: ``max_waiting`` sequences are waiting.
            ValueError: invalid settings for this model (e.g. a stop id outside the
                vocabulary, a draft-model method without a draft model).
        """
        self.check_room(1)
        kwargs = self.llm._request(speculative, params, drafter)
        handle = _Handle(asyncio.get_running_loop(), asyncio.Queue(), score_only=score_only)
        self._handles[request_id] = handle
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        self._inbox.put(("add", request_id, prompt_ids, params, kwargs))
        self._wake.set()
        return handle.queue

    def check_room(self, count: int) -> None:
        """Refuse ``count`` more sequences where they would pass ``max_waiting`` queued ones,
        before any of them is queued (a request's choices are queued together or not at
        all, so a refused one leaves no aborts or prompt tokens in the metrics).

        Raises:
            Unavailable: the server is shutting down.
            Overloaded: they do not fit now.
        """
        if self._draining:
            raise Unavailable("the server is shutting down")
        waiting = len(self.engine.waiting) + self._inbox.qsize()
        if waiting + count > self.max_waiting:
            ask = f"this request's {count} would make {waiting + count}"
            if count == 1:
                ask = "one more would pass that"
            raise Overloaded(
                f"{waiting} sequences are waiting and at most {self.max_waiting} may ({ask}); "
                "retry later"
            )

    def abort(self, request_id: str) -> None:
        """Abort a request (client gone); frees its KV cache. No-op if it finished."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self._update_gauges()
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                with self.llm._lock:
                    outputs = self.engine.step()
            except Exception as error:  # a bug must not take the server down
                logger.exception("engine step failed")
                self._fail_all(f"internal error: {error}")
                continue
            if self.stats is not None:  # prompt tokens as their chunks run, as vLLM counts
                computed = self.engine.num_prompt_tokens_computed
                self.stats.add(prompt=computed - self._prompt_counted)
                self._prompt_counted = computed
            for seq, step in outputs:
                self._deliver(seq, step)
            self._update_gauges()

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if message[0] == "add":
                _, request_id, prompt_ids, params, kwargs = message
                if request_id not in self._handles:
                    continue  # aborted before it reached the engine
                try:
                    self.engine.add_request(request_id, prompt_ids, params, **kwargs)
                except ValueError as error:
                    update = Update([], "abort", error=str(error), status=400)
                    self._post(request_id, update, final=True)
            else:
                request_id = message[1]
                self._abort(request_id)
                self._post(request_id, Update([], "abort"), final=True)

    def _abort(self, request_id: str, reason: str = "abort") -> None:
        """Abort a request in the engine; counted as ``finished_reason=reason`` (``abort``:
        the client's; ``error``: the server's failure) when it was live there (so once
        per request, however many aborts arrive)."""
        if self.engine.abort(request_id):
            self.metrics.request_success.labels(finished_reason=reason).inc()
            self._last_stats.pop(request_id, None)

    def _deliver(self, seq: Sequence, step: StepOutput) -> None:
        handle = self._handles.get(seq.request_id)
        if handle is None:
            return
        now = time.perf_counter()
        if handle.first_token is None and step.new_token_ids:
            handle.first_token = now
            self.metrics.time_to_first_token.observe(now - handle.arrived)
        self.metrics.generation_tokens.inc(len(step.new_token_ids))
        if self.stats is not None:
            self.stats.add(generation=len(step.new_token_ids))
        self._record_speculation(seq)
        if step.error:  # this request failed (its transforms allow no token); a 400
            self.metrics.request_success.labels(finished_reason="error").inc()
            self._last_stats.pop(seq.request_id, None)
            self._post(seq.request_id, Update([], "abort", error=step.error, status=400), True)
            return
        final = step.finish_reason is not None
        if final:
            self.metrics.request_success.labels(finished_reason=step.finish_reason).inc()
            self.metrics.e2e_latency.observe(now - handle.arrived)
            self._last_stats.pop(seq.request_id, None)
        if handle.score_only:  # the prompt's scores only: no token, the limit reached
            update = Update([], "length" if final else None)
        else:
            update = Update(list(step.new_token_ids), step.finish_reason, step.text_end)
            update.logprobs = step.logprobs
        update.prompt_logprobs = step.prompt_logprobs
        if final:
            update.stats = seq.stats.snapshot()
        self._post(seq.request_id, update, final)

    def _record_speculation(self, seq: Sequence) -> None:
        """Add this step's drafted / accepted counts (deltas of the sequence's stats)."""
        s = seq.stats
        now = (
            s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, list(s.accepted_per_position),
            s.num_steps_off, list(s.chosen_k_counts),
        )  # fmt: skip
        before = self._last_stats.get(seq.request_id, (0, 0, 0, [], 0, []))
        m = self.metrics
        m.num_drafts.inc(now[0] - before[0])
        m.num_draft_tokens.inc(now[1] - before[1])
        m.num_accepted_tokens.inc(now[2] - before[2])
        if self.stats is not None:
            self.stats.add(
                drafts=now[0] - before[0], drafted=now[1] - before[1],
                accepted=now[2] - before[2],
            )  # fmt: skip
        m.num_steps_off.inc(now[4] - before[4])
        for counter, label, i in ((m.accepted_per_position, "position", 3), (m.chosen_k, "k", 5)):
            for key, count in enumerate(now[i]):
                previous = before[i][key] if key < len(before[i]) else 0
                if count > previous:
                    counter.labels(**{label: str(key)}).inc(count - previous)
        self._last_stats[seq.request_id] = now

    def _post(self, request_id: str, update: Update, final: bool) -> None:
        handle = self._handles.get(request_id)
        if handle is None:
            return
        if final:
            del self._handles[request_id]
        handle.loop.call_soon_threadsafe(handle.queue.put_nowait, update)

    def _fail_all(self, message: str) -> None:
        for request_id in list(self._handles):
            self._abort(request_id, "error")  # not the client's abort (a new user's trial)
            self._post(request_id, Update([], "abort", error=message, status=500), final=True)

    def _update_gauges(self) -> None:
        engine, m = self.engine, self.metrics
        load = (
            len(engine.running), len(engine.waiting),
            engine.num_kv_tokens_used / engine.config.max_kv_tokens,
        )  # fmt: skip
        m.set_load(*load)
        cache, prefix = engine.prefix_cache, None
        if cache is not None:
            prefix = (cache.num_queried_tokens, cache.num_hit_tokens)
            m.set_prefix_cache(*prefix)
        if self.stats is not None:
            self.stats.tick(*load, prefix)
