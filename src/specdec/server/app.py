"""The OpenAI-compatible HTTP API: ``create_app(llm)`` (no globals; one app per LLM).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming SSE or not,
with ``usage``, and for one choice the request's speculation counters in vLLM's
``metrics.speculative_decoding`` object, see :func:`speculation_metrics`; streamed, on the
chunk that carries the finish reason), ``GET /v1/models``, ``GET /health``, ``GET
/metrics`` (Prometheus). Every request runs in the batched engine
(:class:`~specdec.server.async_engine.AsyncEngine`) with its own sampling and speculative
settings. Errors are OpenAI-style JSON: 400 for a malformed or invalid request (``param``
names the field; see :mod:`specdec.server.protocol` for which fields are accepted), 429
when too many requests wait, 503 while shutting down, and 500 ``internal_error`` for
anything unexpected (never a plain-text page; the server logs it once). A client that
disconnects has its requests aborted, quietly, their KV cache freed and each choice
counted once as ``finished_reason="abort"``.
"""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import functools
import hmac
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec import __version__, registry
from specdec.config import CUSTOM, SamplingParams, SpeculativeConfig, choice_seed
from specdec.engine.stops import stop_reason
from specdec.llm import LLM
from specdec.sampling import TokenLogprob
from specdec.server.async_engine import AsyncEngine, Overloaded, Unavailable, Update
from specdec.server.metrics import ServerMetrics, StatsLog
from specdec.server.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelNotFound,
    SpeculativeOptions,
    TokenizeRequest,
    describe_errors,
    error_body,
)
from specdec.text import TextStream
from specdec.tools import TOOL_CALL_PARSERS, ToolCallParser, ToolCallStream, ToolChoice
from specdec.tools import finish as tool_finish
from specdec.tools import tool_call_parser as tool_call_parser_named
from specdec.trees.spec import names_a_file

__all__ = ["BadRequest", "create_app"]


def create_app(
    llm: LLM,
    model_name: str | None = None,
    max_waiting: int = 256,
    shutdown_timeout: float = 30.0,
    engine_thread: bool = True,
    stats_interval: float | None = None,
    api_key: str | None = None,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The FastAPI app serving ``llm``.

    Args:
        llm: the loaded model with its default speculative settings and engine limits.
        model_name: the id clients pass as ``model`` (default: the model's name).
        max_waiting: requests queued beyond this get HTTP 429.
        shutdown_timeout: on shutdown (SIGTERM), seconds in-flight requests may take to
            finish before they are aborted.
        engine_thread: run the engine on its own thread when the app starts; ``False``:
            the caller runs ``app.state.engine.run()`` on a thread of its choosing (the
            main thread, for speed: see :meth:`AsyncEngine.run`).
        stats_interval: seconds between lines of load on standard output while the server
            works (:class:`~specdec.server.metrics.StatsLog`); ``None`` or 0: none.
        api_key: requests to ``/v1/*`` must carry ``Authorization: Bearer <api_key>``,
            else HTTP 401 (vLLM's ``--api-key``); ``None``: no key. ``/health``,
            ``/metrics`` and ``/reset_prefix_cache`` stay open, as in vLLM.
        tool_call_parser: how to read tool calls out of the model's text, which makes
            ``tool_choice: "auto"`` available (vLLM's ``--tool-call-parser``; see
            :data:`specdec.tools.TOOL_CALL_PARSERS`); ``None``: ``"auto"`` with tools is a
            400, as in vLLM, and forced choices (``"required"``, a named function) work.

    Raises:
        ValueError: an unknown ``tool_call_parser``.
    """
    parser = None if tool_call_parser is None else tool_call_parser_named(tool_call_parser)
    name = model_name or llm.target.name
    stats = StatsLog(stats_interval) if stats_interval else None
    engine = AsyncEngine(llm, max_waiting, ServerMetrics(name), stats)
    # Requests' prompts are tokenized here, one at a time, off the event loop (as vLLM's
    # server does): a long prompt no longer holds every other request and /health.
    tokenizing = ThreadPoolExecutor(1, thread_name_prefix="specdec-tokenizer")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine_thread:
            engine.start()
        yield
        await engine.shutdown(shutdown_timeout)
        tokenizing.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.state.engine = engine
    _add_error_handlers(app)
    if api_key is not None:
        _require_api_key(app, api_key)

    @app.get("/health")
    async def health():
        if engine._draining:
            raise Unavailable("the server is shutting down")
        return {"status": "ok"}

    created = int(time.time())

    def card() -> dict:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "specdec",
            "max_model_len": llm.target.max_context,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        _check_model(model_id, name)
        return card()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """vLLM's route: the prompt's token ids, as a completions or chat request would
        feed them to the model."""
        if body.model:
            _check_model(body.model, name)
        return await _off_loop(tokenizing, _tokenize, llm, body)  # a JSONResponse, rendered

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        """vLLM's route: token ids back to text."""
        if body.model:
            _check_model(body.model, name)
        vocab = llm.target.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise BadRequest(f"token ids outside the vocabulary ({vocab}): {bad[:5]}", "tokens")
        return {"prompt": await _off_loop(tokenizing, llm.tokenizer.hf.decode, body.tokens)}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """vLLM's route: drop every block of the prefix cache (between the engine's steps)."""
        if not await asyncio.to_thread(llm.reset_prefix_cache):
            raise BadRequest("prefix caching is off: start the server with --enable-prefix-caching")
        return {"reset": True}

    _add_generation_routes(app, llm, engine, name, tokenizing, parser)
    return app


async def _off_loop(pool: ThreadPoolExecutor, fn, *args):
    """``fn(*args)`` on ``pool`` (the server's one tokenizer thread), awaited; its
    exception, if any, is raised here."""
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))


def _tokenize(llm: LLM, body: TokenizeRequest) -> JSONResponse:
    """``POST /tokenize``'s answer, its JSON rendered here on the tokenizer thread (the
    ids of a long prompt took seconds to render on the event loop)."""
    if body.prompt == "":  # nothing to generate from, but a string to tokenize
        ids = llm.tokenizer.encode("", chat=False) if body.add_special_tokens else []
    elif body.prompt is not None:
        ids = _completion_prompts(llm, body.prompt)[0]
        if not body.add_special_tokens:
            ids = list(llm.tokenizer.hf(body.prompt, add_special_tokens=False)["input_ids"])
    else:
        messages = [m.template_message() for m in body.messages]
        ids = _chat_prompt(llm, messages, body)
    out = {"count": len(ids), "max_model_len": llm.target.max_context, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = llm.tokenizer.hf.convert_ids_to_tokens(ids)
    return JSONResponse(out)


def _add_generation_routes(
    app: FastAPI,
    llm: LLM,
    engine: AsyncEngine,
    name: str,
    tokenizing: ThreadPoolExecutor,
    parser: ToolCallParser | None = None,
) -> None:
    """``POST /v1/completions`` and ``POST /v1/chat/completions``; prompts are tokenized
    on ``tokenizing``."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if body.model:  # optional, as in vLLM (which reads "" as left out too)
            _check_model(body.model, name)
        prompts = await _off_loop(tokenizing, _completion_prompts, llm, body.prompt)
        return await _serve(llm, engine, name, body, prompts, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        if body.model:
            _check_model(body.model, name)
        if body.choice.mode == "auto" and parser is None:  # vLLM's rule
            raise BadRequest(
                'tool_choice "auto" (the default with tools) needs a tool-call parser: start '
                f"the server with --tool-call-parser ({', '.join(TOOL_CALL_PARSERS)}), or send "
                'tool_choice "required", "none" or a named function',
                "tool_choice",
            )
        messages = [m.template_message() for m in body.messages]
        prompts = [await _off_loop(tokenizing, _chat_prompt, llm, messages, body)]
        if body.max_completion_tokens is not None:  # OpenAI's name; vLLM's rule: it wins
            body.max_tokens = body.max_completion_tokens
        tools = (body.choice, parser if body.choice.mode == "auto" else None)
        return await _serve(llm, engine, name, body, prompts, request, chat=True, tools=tools)


def _require_api_key(app: FastAPI, api_key: str) -> None:
    """HTTP 401 (OpenAI's ``invalid_api_key``) for a ``/v1/*`` request without
    ``Authorization: Bearer <api_key>``; the comparison takes the same time wherever the
    keys differ."""
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def _check_key(request: Request, call_next):
        if request.url.path.startswith("/v1"):
            sent = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(sent, expected):
                message = "invalid or missing API key: send 'Authorization: Bearer <key>'"
                body = error_body(message, code="invalid_api_key")
                return JSONResponse(body, status_code=401)
        return await call_next(request)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error is OpenAI-style JSON, an unexpected one included (500, logged once by
    the server, which Starlette re-raises it to)."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError):
        kind = request.headers.get("content-type", "")
        if "json" not in kind.lower():  # e.g. curl -d's default form encoding
            message = (
                "the request body must be a JSON object sent with Content-Type: "
                f"application/json (got {kind or 'no Content-Type'})"
            )
            return JSONResponse(error_body(message), status_code=400)
        message, param = describe_errors(error.errors(), error.body)
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, error: BadRequest):
        body = error_body(str(error), param=error.param, code=error.code)
        return JSONResponse(body, status_code=error.status)

    @app.exception_handler(Overloaded)
    async def _overloaded(request: Request, error: Overloaded):
        body = error_body(str(error), "rate_limit_exceeded")
        return JSONResponse(body, status_code=429, headers={"Retry-After": "1"})

    @app.exception_handler(Unavailable)
    async def _unavailable(request: Request, error: Unavailable):
        return JSONResponse(error_body(str(error), "service_unavailable"), status_code=503)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        message = _undecodable_body(error) or str(error.detail)
        return JSONResponse(error_body(message, kind), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, error: Exception):
        message = f"internal error ({type(error).__name__}); see the server's log"
        return JSONResponse(error_body(message, "internal_error"), status_code=500)


def _undecodable_body(error: StarletteHTTPException) -> str | None:
    """The message for a body that is not UTF-8 (FastAPI only says it could not parse it)."""
    cause = error.__cause__
    if not isinstance(cause, UnicodeDecodeError):
        return None
    byte = cause.object[cause.start]
    return f"the request body is not valid UTF-8: byte 0x{byte:02x} at offset {cause.start}"


# ---------------------------------------------------------------- request handling


async def _serve(llm, engine, name, body, prompts, request, chat: bool, tools=None):
    """Submit ``n`` choices per prompt and answer (JSON or SSE); chat's ``tools``: the
    request's :class:`~specdec.tools.ToolChoice` and the parser of an ``"auto"`` one."""
    speculative = _speculative(llm.speculative, body.speculative)
    needs_draft = speculative.method != CUSTOM and registry.needs_draft_model(
        speculative.method, speculative.options
    )
    if needs_draft and not llm.has_draft_model(speculative):
        raise BadRequest(
            f"speculative: method {speculative.method!r} needs a draft model, and this server "
            "has none (start it with --draft-model)",
            "speculative",
        )
    spec, field = body.structured_spec()
    if spec is not None:  # compiled off the event loop (cached: each request's state is new)
        try:
            await asyncio.to_thread(llm.grammars.compile, spec)
        except ValueError as error:
            raise BadRequest(f"{field}: {error}", field) from None
    score_only = not chat and body.max_tokens == 0  # OpenAI's legacy scoring
    if score_only:
        if not body.echo:
            raise BadRequest(
                "max_tokens 0 generates nothing: it needs echo: true (to return the prompt, "
                "with logprobs its scores)",
                "max_tokens",
            )
        body.max_tokens = 1  # run for the prompt's scores; the one token is not returned
    best_of = getattr(body, "best_of", None) or body.n  # candidates per prompt
    if len(prompts) * best_of > engine.max_waiting:  # could never be queued: not a 429
        count = f"{len(prompts)} prompt(s) x {best_of} choice(s)"
        raise BadRequest(
            f"this request needs {len(prompts) * best_of} sequences ({count}), more than the "
            f"server queues at once (--max-waiting {engine.max_waiting}): split it",
            ("best_of" if best_of > body.n else "n") if best_of > 1 else "prompt",
        )
    jobs = []  # (candidate index, prompt ids, params)
    for p, ids in enumerate(prompts):
        for i in range(best_of):
            params = _sampling(llm, body, ids, choice_seed(body.seed, i), spec)
            if best_of > body.n and params.logprobs is None:  # to rank the candidates
                params = dataclasses.replace(params, logprobs=0)
            jobs.append((p * best_of + i, ids, params))
    drafters = [_prediction(llm, body, speculative) for _ in jobs]  # one per choice
    kind = "chatcmpl" if chat else "cmpl"
    response_id = f"{kind}-{uuid.uuid4().hex}"
    ids, queues = [], []
    engine.check_room(len(jobs))  # all of the request's sequences fit, or a 429 for all
    try:
        for (_, prompt_ids, params), drafter in zip(jobs, drafters, strict=True):
            request_id = engine.new_request_id(response_id)
            queues.append(
                engine.submit(request_id, prompt_ids, params, speculative, drafter, score_only)
            )
            ids.append(request_id)
    except ValueError as error:  # the drafter, tree or controller refused these settings
        for request_id in ids:
            engine.abort(request_id)
        raise BadRequest(f"speculative: {error}", "speculative") from None
    except (Overloaded, Unavailable):
        for request_id in ids:
            engine.abort(request_id)
        raise
    streams = [TextStream(llm.tokenizer, params.stop) for _, _, params in jobs]
    choice, parser = tools or (ToolChoice("none"), None)
    calls = [ToolCallStream(choice, parser) for _ in jobs]  # chat: text -> content / tool calls
    asked = body.logprobs is not None if not chat else bool(body.logprobs)
    wanted = [asked] * len(jobs)
    logprobs = LogprobFormat(llm.tokenizer, chat, wanted)
    echo = not chat and body.echo
    texts = _echo_texts(llm, body.prompt) if echo else []
    logprobs.prompts = PromptEcho(
        llm.tokenizer,
        [texts[p // body.n] if echo else None for p, _, _ in jobs],
        [ids for _, ids, _ in jobs],
        body.prompt_logprobs,
        body.logprobs if echo and not chat else None,
    )
    usage = Usage(
        sum(len(ids) for ids in prompts), streams, drafters, best_of,
        llm.engine_config.enable_prefix_caching,
    )  # fmt: skip
    meta = dict(id=response_id, created=int(time.time()), model=name)
    reason = functools.partial(_stop_reason, llm.tokenizer, body)
    if body.stream:
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options.continuous_usage_stats)
        events = _events(
            engine, ids, queues, streams, meta, chat, usage, include_usage, logprobs, reason,
            continuous, calls,
        )  # fmt: skip
        return StreamingResponse(events, media_type="text/event-stream")
    pick = (body.n, best_of)
    return await _complete(
        engine, ids, queues, streams, meta, chat, usage, request, logprobs, pick, reason, calls
    )


def _prediction(llm: LLM, body, speculative: SpeculativeConfig):
    """The request's Predicted Outputs drafter (one per choice), or ``None``."""
    if body.prediction is None:
        return None
    try:
        return llm.prediction_drafter(body.prediction.text, speculative)
    except ValueError as error:
        raise BadRequest(f"prediction: {error}", "prediction") from None


class Usage:
    """A response's ``usage``: prompt and completion tokens (every choice), with a
    ``prediction`` OpenAI's ``completion_tokens_details`` (``accepted_prediction_tokens``,
    ``rejected_prediction_tokens``, summed over the choices; see
    :meth:`~specdec.drafters.prediction.PredictionDrafter.usage`), and with prefix caching
    on OpenAI's ``prompt_tokens_details.cached_tokens`` (per prompt, the most any of its
    candidates took from the prefix cache)."""

    def __init__(
        self, num_prompt: int, streams: list, drafters: list, per_prompt: int = 1,
        caching: bool = False,
    ) -> None:  # fmt: skip
        self.num_prompt, self.streams, self.drafters = num_prompt, streams, drafters
        self.per_prompt, self.caching = per_prompt, caching
        self.cached: dict[int, int] = {}

    def record(self, index: int, update) -> None:
        """Keep candidate ``index``'s cached prompt tokens from its final update."""
        if update.stats is not None:
            self.cached[index] = update.stats.num_cached_tokens

    def body(self) -> dict:
        generated = sum(len(s.ids) for s in self.streams)
        usage = {
            "prompt_tokens": self.num_prompt,
            "completion_tokens": generated,
            "total_tokens": self.num_prompt + generated,
        }
        if self.caching:
            per_prompt: dict[int, int] = {}
            for index, cached in self.cached.items():
                prompt = index // self.per_prompt
                per_prompt[prompt] = max(per_prompt.get(prompt, 0), cached)
            usage["prompt_tokens_details"] = {"cached_tokens": sum(per_prompt.values())}
        if any(d is not None for d in self.drafters):
            counts = [
                d.usage(s.ids)
                for d, s in zip(self.drafters, self.streams, strict=True)
                if d is not None
            ]
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": sum(a for a, _ in counts),
                "rejected_prediction_tokens": sum(r for _, r in counts),
            }
        return usage


async def _complete(
    engine, ids, queues, streams, meta, chat, usage, request, logprobs, pick, reason, calls
):
    """Wait for every candidate (aborting all if the client goes away); answer the ``n``
    of each prompt's ``best_of`` with the highest mean log-probability per token
    (``pick = (n, best_of)``; all of them when equal)."""
    """Wait for every choice (aborting all if the client goes away)."""
    collected: list[list] = [[] for _ in queues]
    tasks = [
        asyncio.ensure_future(_collect(q, s, c, logprobs.prompts, i))
        for i, (q, s, c) in enumerate(zip(queues, streams, collected, strict=True))
    ]
    try:
        finished = await _wait_unless_gone(tasks, request)
    finally:  # finished, the client went away, or this handler was cancelled
        if not all(task.done() for task in tasks):
            for task in tasks:  # cancelled tasks log nothing (a cancelled gather() would)
                task.cancel()
            for request_id in ids:
                engine.abort(request_id)
    if not finished:  # nobody to answer; the engine is freed
        return JSONResponse(error_body("client disconnected"), status_code=499)
    finals = [task.result() for task in tasks]
    for index, update in enumerate(finals):
        usage.record(index, update)
    errors = [u for u in finals if u.error]
    if errors:
        status = max(u.status for u in errors)
        kind = "invalid_request_error" if status == 400 else "internal_error"
        return JSONResponse(error_body(errors[0].error, kind), status_code=status)
    choices = []
    echo = logprobs.prompts
    answered = _best(collected, *pick)
    for out, index in enumerate(answered):
        update, stream = finals[index], streams[index]
        entries = echo.logprob_entries(index) + collected[index]
        choice = {
            "index": out,
            "logprobs": logprobs.format(index, entries),
            "finish_reason": update.finish_reason,
            "stop_reason": reason(stream, update),
        }
        if chat:  # the text, or the tool calls read out of it (see specdec.tools.finish)
            tool = calls[index]
            content, made, finish_reason = tool_finish(
                tool.choice, tool.parser, stream.text, update.finish_reason
            )
            choice["message"] = {"role": "assistant", "content": content}
            if made:
                choice["message"]["tool_calls"] = [call.openai() for call in made]
            choice["finish_reason"] = finish_reason
        else:
            choice["text"] = echo.text(index) + stream.text
        if echo.top is not None and not chat:  # vLLM: per choice in completions
            choice["prompt_logprobs"] = echo.vllm_format(index)
        choices.append(choice)
    response = {
        **meta,
        "object": "chat.completion" if chat else "text_completion",
        "choices": choices,
        "usage": usage.body(),
    }
    if chat and echo.top is not None:  # vLLM: one prompt, at the response's top level
        response["prompt_logprobs"] = echo.vllm_format(0)
    if len(answered) == 1 and finals[answered[0]].stats is not None:  # one choice answered
        stats = finals[answered[0]].stats
        response["metrics"] = {"speculative_decoding": speculation_metrics(stats)}
    return response


def _best(collected: list[list], n: int, best_of: int) -> list[int]:
    """Candidate indices to answer, in choice order: per prompt, the ``n`` of its
    ``best_of`` candidates with the highest mean log-probability per token (OpenAI's
    ``best_of`` rule; ties keep the earlier seed)."""
    if best_of == n:
        return list(range(len(collected)))
    chosen = []
    for start in range(0, len(collected), best_of):
        group = range(start, start + best_of)

        def score(i: int) -> float:
            values = [e.logprob for e in collected[i]]
            return sum(values) / len(values) if values else float("-inf")

        chosen += sorted(group, key=lambda i: (-score(i), i))[:n]
    return chosen


def speculation_metrics(stats) -> dict:
    """A response's ``metrics.speculative_decoding`` object (vLLM's per-request metrics,
    for ``n == 1``), from the request's :class:`~specdec.metrics.SpecStats`. Every count
    is of what the client got: draft tokens an accepted block held after a stop or past
    ``max_tokens`` are not counted as accepted.

    Fields: ``num_steps`` (verification steps), ``num_spec_steps`` (those that verified
    at least one draft token), ``num_draft_tokens``, ``num_accepted_draft_tokens``,
    ``draft_acceptance_rate`` (accepted / drafted, ``null`` when nothing was drafted),
    ``mean_acceptance_length`` (output tokens per step, the bonus or recovered token
    included), ``acceptance_histogram`` (entry j: steps that accepted exactly j draft
    tokens), ``acceptance_per_position`` (entry i: fraction of drafting steps whose i-th
    draft token was accepted), ``num_spec_tokens`` (the longest draft, or deepest tree),
    ``verifier`` and ``lossy`` (true when a lossy verifier sampled this output; see
    :mod:`specdec.verify.typical`); with a drafter that chooses a source per step
    (``hybrid``), ``draft_sources``: the steps each source drafted, e.g. ``{"suffix": 12,
    "model": 30}``.
    """
    out = {
        "num_steps": stats.num_steps,
        "num_spec_steps": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_draft_tokens": stats.num_accepted_tokens,
        "draft_acceptance_rate": stats.acceptance_rate if stats.num_draft_tokens else None,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "acceptance_histogram": list(stats.accepted_length_counts),
        "acceptance_per_position": stats.per_position_acceptance_rate,
        "num_spec_tokens": len(stats.accepted_per_position),
        "verifier": stats.verifier,
        "lossy": stats.lossy,
    }
    if stats.draft_sources:
        out["draft_sources"] = dict(stats.draft_sources)
    return out


async def _wait_unless_gone(tasks: list[asyncio.Future], request: Request) -> bool:
    """Wait for ``tasks``; ``True`` when all finished, ``False`` when the client
    disconnected first."""
    pending = set(tasks)
    while pending:
        _, pending = await asyncio.wait(pending, timeout=0.25)
        if pending and await request.is_disconnected():
            return False
    return True


async def _collect(
    queue: asyncio.Queue, stream: TextStream, logprobs: list, echo: PromptEcho, index: int
) -> Update:
    """Consume one choice's updates; returns the final one (``stream.text`` is set, and
    ``logprobs`` holds every token's :class:`~specdec.sampling.TokenLogprob` if asked)."""
    while True:
        update = await queue.get()
        echo.receive(index, update)
        stream.push(update.new_token_ids, update.finish_reason, update.text_end)
        if update.logprobs:
            logprobs.extend(update.logprobs)
        if update.finish_reason is not None or update.error:
            return update


async def _events(
    engine, ids, queues, streams, meta, chat, usage, include_usage, logprobs, reason,
    continuous=False, calls=None,
):  # fmt: skip
    """Server-sent events: one chunk per step and choice, then usage, then ``[DONE]``.
    A choice's token log-probabilities ride on its next chunk (text held back for a stop
    string holds its tokens' entries back with it). The chunks ready at once are sent
    together. ``continuous`` (vLLM's ``continuous_usage_stats``): every chunk also carries
    the usage so far."""
    pending: list[list] = [[] for _ in queues]
    merged: asyncio.Queue = asyncio.Queue()

    async def forward(index: int, queue: asyncio.Queue) -> None:
        while True:
            update = await queue.get()
            await merged.put((index, update))
            if update.finish_reason is not None or update.error:
                return

    tasks = [asyncio.create_task(forward(i, q)) for i, q in enumerate(queues)]
    live = set(range(len(queues)))
    obj = "chat.completion.chunk" if chat else "text_completion"

    def render(index: int, update: Update) -> str:
        """The event(s) ``update`` of choice ``index`` makes ("" for none)."""
        if update.error:
            kind = "invalid_request_error" if update.status == 400 else "internal_error"
            live.discard(index)
            return _sse(error_body(update.error, kind))
        text = streams[index].push(update.new_token_ids, update.finish_reason, update.text_end)
        echo = logprobs.prompts
        first = echo.receive(index, update)
        if first:  # the echoed prompt and its scores lead the choice's first chunk
            text = echo.text(index) + text
            pending[index][:0] = echo.logprob_entries(index)
        if update.logprobs:
            pending[index].extend(update.logprobs)
        if update.finish_reason is not None:
            live.discard(index)
            usage.record(index, update)
        finish_reason = update.finish_reason
        if chat:  # content, or tool calls (held back until they parse, see ToolCallStream)
            delta, finish_reason = calls[index].push(text, update.finish_reason)
            if delta is None and not (first and echo.top is not None):
                return ""  # nothing to send yet (the prompt's logprobs lead the first chunk)
            delta = delta or {"content": ""}
        elif not (text or finish_reason is not None or first):
            return ""
        else:
            delta = text
        choice = _chunk(index, delta, finish_reason, chat)
        choice["logprobs"] = logprobs.format(index, pending[index])
        if update.finish_reason is not None:
            choice["stop_reason"] = reason(streams[index], update)
        if first and echo.top is not None and not chat:
            choice["prompt_logprobs"] = echo.vllm_format(index)
        pending[index] = []
        chunk = {**meta, "object": obj, "choices": [choice]}
        if first and echo.top is not None and chat:
            chunk["prompt_logprobs"] = echo.vllm_format(index)
        if update.stats is not None and len(queues) == 1:
            chunk["metrics"] = {"speculative_decoding": speculation_metrics(update.stats)}
        if continuous:
            chunk["usage"] = usage.body()
        return _sse(chunk)

    try:
        if chat:
            role = {"role": "assistant", "content": ""}
            extra = {"usage": usage.body()} if continuous else {}
            yield "".join(
                _sse({**meta, "object": obj, "choices": [_chunk(i, role, None, chat)], **extra})
                for i in range(len(queues))
            )
        while live:
            # Every update already waiting goes out in one write: n choices' chunks of a
            # step are one send, not n (and a client gone mid-stream meets one failed
            # send, not a burst of them, each logged by asyncio).
            ready = [await merged.get()]
            while not merged.empty():
                ready.append(merged.get_nowait())
            events = "".join(render(index, update) for index, update in ready)
            if events:
                yield events
        if include_usage:
            yield _sse({**meta, "object": obj, "choices": [], "usage": usage.body()})
        yield "data: [DONE]\n\n"
    finally:  # finished, or the client went away (the generator is closed or cancelled)
        for task in tasks:
            task.cancel()
        for i in live:
            engine.abort(ids[i])


class LogprobFormat:
    """Token log-probabilities in OpenAI's response formats.

    Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
    "logprob", "bytes"}]}]}``. Completions: ``{"tokens", "token_logprobs",
    "top_logprobs": [{token: logprob}] (the chosen token included, as vLLM does),
    "text_offset"}``. A token's text is its own decoding, special tokens shown (U+FFFD for
    a token holding part of a character); its ``bytes`` are the bytes it stands for
    (:meth:`~specdec.tokenizer.Tokenizer.token_bytes`), so that the bytes of the tokens
    of one character join into it. ``text_offset``: the characters of the choice's text
    before the token, counted from the bytes of the tokens before it (the tokens of one
    split character all start where it does).

    Args:
        tokenizer: the model's :class:`~specdec.tokenizer.Tokenizer`.
        chat: chat completions (else completions).
        wanted: per choice, whether its request asked for log-probabilities.
    """

    def __init__(self, tokenizer, chat: bool, wanted: list[bool]) -> None:
        self.tokenizer, self.chat, self.wanted = tokenizer, chat, wanted
        self.offsets = [0] * len(wanted)
        # per choice, the text's bytes decoded so far (characters complete; offsets count them)
        self._decoders = [codecs.getincrementaldecoder("utf-8")("replace") for _ in wanted]
        #: the response's :class:`PromptEcho` (set by the request handler)
        self.prompts: PromptEcho | None = None

    def _text(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id)

    def _entry(self, token_id: int, logprob: float) -> dict:
        raw = self.tokenizer.token_bytes(token_id)
        return {"token": self._text(token_id), "logprob": logprob, "bytes": list(raw)}

    def _offset(self, index: int, token_id: int) -> int:
        """Choice ``index``'s text offset of this token (characters before it), then the
        token's bytes counted in."""
        offset = self.offsets[index]
        text = self._decoders[index].decode(self.tokenizer.token_bytes(token_id))
        self.offsets[index] += len(text)
        return offset

    def format(self, index: int, entries: list) -> dict | None:
        """Choice ``index``'s next ``entries`` (``None`` when it asked for none)."""
        if not self.wanted[index]:
            return None
        if self.chat:
            content = []
            for e in entries:
                entry = self._entry(e.token_id, e.logprob)
                entry["top_logprobs"] = [self._entry(i, lp) for i, lp in e.top]
                content.append(entry)
            return {"content": content}
        tokens, offsets, tops = [], [], []
        for e in entries:
            text = self._text(e.token_id)
            tokens.append(text)
            offsets.append(self._offset(index, e.token_id))
            if e.logprob is None:  # an echoed prompt's first token: nothing predicts it
                tops.append(None)
                continue
            top = {self._text(i): lp for i, lp in e.top}
            top.setdefault(text, e.logprob)
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }


class PromptEcho:
    """What a response says about its prompts, per choice: the prompt text a completion
    echoes (``echo``), the prompt tokens' entries its ``logprobs`` then start with (the
    first with ``null`` values: nothing predicts it), and vLLM's ``prompt_logprobs``
    (``[null, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]``: the prompt token and
    the ``prompt_logprobs`` most probable).

    Args:
        tokenizer: the model's :class:`~specdec.tokenizer.Tokenizer`.
        texts: per choice, the echoed prompt text, or ``None`` (no echo).
        prompt_ids: per choice, its prompt's token ids.
        top: ``prompt_logprobs`` (``None``: not asked).
        echo_top: ``logprobs`` of an echoing completion (``None``: no entries).
    """

    def __init__(self, tokenizer, texts, prompt_ids, top, echo_top) -> None:
        self.tokenizer, self.texts, self.prompt_ids = tokenizer, texts, prompt_ids
        self.top, self.echo_top = top, echo_top
        self.scores: list = [None] * len(texts)
        self.started = [False] * len(texts)

    def receive(self, index: int, update) -> bool:
        """Note an update of choice ``index``; whether it is the choice's first."""
        if update.prompt_logprobs is not None:
            self.scores[index] = update.prompt_logprobs
        first = not self.started[index] and not update.error
        self.started[index] = True
        return first

    def text(self, index: int) -> str:
        return self.texts[index] or ""

    def logprob_entries(self, index: int) -> list:
        if self.echo_top is None or self.texts[index] is None:
            return []
        ids = self.prompt_ids[index]
        scored = self.scores[index] or [None] * len(ids)
        entries = [TokenLogprob(ids[0], None)]
        for e in scored[1:]:
            entries.append(TokenLogprob(e.token_id, e.logprob, e.top[: self.echo_top]))
        return entries

    def vllm_format(self, index: int) -> list | None:
        scored = self.scores[index]
        if scored is None:
            return None
        out: list = [None]
        for e in scored[1:]:
            entry = {
                str(e.token_id): {
                    "logprob": e.logprob,
                    "rank": e.rank,
                    "decoded_token": self._text(e.token_id),
                }
            }
            for rank, (i, lp) in enumerate(e.top[: self.top], start=1):
                entry.setdefault(
                    str(i), {"logprob": lp, "rank": rank, "decoded_token": self._text(i)}
                )
            out.append(entry)
        return out

    def _text(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id)


def _echo_texts(llm: LLM, prompt) -> list[str]:
    """Each completion prompt as echoed: a string as sent, token ids decoded."""
    items = [prompt] if isinstance(prompt, str) or _is_ids(prompt) else list(prompt)
    return [p if isinstance(p, str) else llm.tokenizer.hf.decode(p) for p in items]


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) for t in value) and bool(value)


def _stop_reason(tokenizer, body, stream: TextStream, update: Update) -> str | int | None:
    """vLLM's ``stop_reason`` of a finished choice (:func:`~specdec.engine.stops.stop_reason`
    with the request's stops)."""
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    return stop_reason(
        stream.ids, update.finish_reason, update.text_end, stops, body.stop_token_ids or (),
        tokenizer.eos_token_ids, tokenizer.decode,
    )  # fmt: skip


def _chunk(index: int, delta, finish_reason, chat: bool) -> dict:
    choice = {"index": index, "logprobs": None, "finish_reason": finish_reason}
    choice["delta" if chat else "text"] = delta
    return choice


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


# ---------------------------------------------------------------- request validation


def _check_model(requested: str, served: str) -> None:
    if requested != served:
        message = f"the model {requested!r} does not exist; this server has {served!r}"
        raise ModelNotFound(message, "model")


def _chat_prompt(llm: LLM, messages: list[dict], body) -> list[int]:
    """A chat's messages as token ids, with the request's template fields; a 400 naming
    the field at fault."""
    flags = (body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs)
    try:
        return llm.encode(messages, None, *flags, tools=getattr(body, "checked_tools", None))
    except ValueError as error:
        fields = ("chat_template_kwargs", "continue_final_message")
        param = next((f for f in fields if f in str(error)), "messages")
        raise BadRequest(str(error), param) from None


def _completion_prompts(llm: LLM, prompt) -> list[list[int]]:
    """The prompt(s) of a completions request as token ids (raw text: no chat template)."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not prompt:
        raise BadRequest("prompt is empty", "prompt")
    if len({isinstance(p, str) for p in prompt}) > 1:  # OpenAI's and vLLM's schema
        raise BadRequest(
            "prompt: a list of prompts is all strings or all token-id lists, not a mix", "prompt"
        )
    out = []
    for i, p in enumerate(prompt):
        try:
            out.append(llm.encode(p, chat=False))
        except ValueError as error:
            raise BadRequest(str(error), "prompt" if len(prompt) == 1 else f"prompt[{i}]") from None
    return out


def _sampling(
    llm: LLM, body, prompt_ids: list[int], seed: int | None, structured=None
) -> SamplingParams:
    context = llm.target.max_context
    if len(prompt_ids) >= context:
        raise BadRequest(
            f"the prompt has {len(prompt_ids)} tokens; this model's context is {context} "
            "tokens in total, so nothing could be generated",
            "messages" if isinstance(body, ChatCompletionRequest) else "prompt",
        )
    max_tokens = body.max_tokens if body.max_tokens is not None else context - len(prompt_ids)
    if len(prompt_ids) + max_tokens > context:
        raise BadRequest(
            f"this model's maximum context length is {context} tokens; the prompt has "
            f"{len(prompt_ids)} tokens and max_tokens is {max_tokens}",
            "max_tokens",
        )
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    stop_ids = tuple(body.stop_token_ids or ())
    outside = [t for t in stop_ids if t >= llm.target.vocab_size]
    if outside:
        raise BadRequest(
            f"stop_token_ids outside the vocabulary ({llm.target.vocab_size} tokens): "
            f"{outside[:5]}",
            "stop_token_ids",
        )
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs and not body.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    prompt_logprobs = body.prompt_logprobs
    if getattr(body, "echo", False) and body.logprobs is not None:  # echoed prompt scores
        prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
    bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
    outside = sorted(t for t in bias if t >= llm.target.vocab_size)
    if outside:
        raise BadRequest(
            f"logit_bias names token ids outside the vocabulary ({llm.target.vocab_size} "
            f"tokens): {outside[:5]}",
            "logit_bias",
        )
    try:
        return llm.resolve_params(
            SamplingParams(
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=max(body.top_k, 0),
                max_new_tokens=max_tokens,
                seed=seed,
                stop=tuple(stop),
                stop_token_ids=stop_ids,
                ignore_eos=body.ignore_eos,
                min_p=body.min_p,
                repetition_penalty=body.repetition_penalty,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                logit_bias=bias,
                min_tokens=body.min_tokens,
                logprobs=logprobs,
                structured_outputs=structured,
                bad_words=tuple(body.bad_words or ()),
                prompt_logprobs=prompt_logprobs,
            )
        )
    except ValueError as error:  # the request model checks most of it; kept as a backstop
        text = str(error)
        param = next((f for f in _PARAM_NAMES if f in text), None)
        raise BadRequest(text, param or ("stop" if "stop" in text else None)) from None


#: Request fields a :class:`SamplingParams` error may name first.
_PARAM_NAMES = (
    "min_tokens", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "logit_bias", "bad_words", "stop",
)  # fmt: skip


def _speculative(base: SpeculativeConfig, options: SpeculativeOptions | None) -> SpeculativeConfig:
    """The server's default settings with the request's ``speculative`` object applied."""
    if options is None:
        return base
    if not options.enabled:
        return dataclasses.replace(base, method="none", options=None, tree=None)
    changes = {}
    if options.method is not None and options.method != base.method:
        # another drafter runs with its default options (one drafter per name, so
        # requests cannot make the server build unbounded drafter state)
        changes.update(method=options.method, options=None)
    if options.num_speculative_tokens is not None:
        changes["num_speculative_tokens"] = options.num_speculative_tokens
    if "tree" in options.model_fields_set:
        own = None if base.tree is None else str(base.tree)
        if options.tree is not None and options.tree != own and names_a_file(options.tree):
            # a path would open a file on the server's disk, and its error quote it
            raise BadRequest(
                "speculative: a request's static tree is a preset (tree-8, tree-16, tree-32, "
                "chain-K); trees from a paths file come only from the server's own --tree",
                "speculative.tree",
            )
        changes["tree"] = options.tree
    if options.verifier is not None:
        changes["verifier"] = options.verifier
    if "allow_lossy" in options.model_fields_set:
        changes["allow_lossy"] = options.allow_lossy
        if not options.allow_lossy and options.verifier is None and base.lossy:
            changes["verifier"] = "rejection"  # "no lossy verification": the server's is
    if options.controller is not None and options.controller != base.controller:
        changes.update(controller=options.controller, controller_options=None)
    try:
        return dataclasses.replace(base, **changes)
    except ValueError as error:
        text = str(error).replace("allow_lossy=True", '"allow_lossy": true')
        raise BadRequest(f"speculative: {text}", "speculative") from None
