"""The OpenAI-compatible HTTP server (a Starlette ASGI app).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` as
server-sent events in OpenAI's chunk format ending with ``data: [DONE]``), ``GET /v1/models``,
``GET /health`` and ``GET /metrics`` (Prometheus text format).

Bad input is answered 400 with an OpenAI error body naming the problem, and the server keeps serving.
With an API key, the ``/v1`` endpoints need ``Authorization: Bearer <key>``. Decoding is greedy unless a
request samples (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, penalties, ``logit_bias``,
``min_tokens``; ``n`` choices share the prompt's prefill), with ``logprobs`` / ``top_logprobs`` and, for
completions, ``echo`` with the prompt's logprobs from the prefill.

``stop`` strings end a choice where its text completes one (the text is cut before it; the tokens
run through the one that completed it): ``dflash_jax.serving.text_stream``. Extensions (as in vLLM):
``ignore_eos``, ``stop_token_ids`` (token ids that end generation besides the model's own),
``return_token_ids`` (adds ``token_ids`` to each choice and ``prompt_token_ids`` to the response),
``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``) and ``add_generation_prompt`` for chat.
Responses carry a ``dflash`` list with each choice's decoding statistics (tau, steps, acceptance
lengths, time to first token, time per output token); a stream, with each choice's finish chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import weakref
from typing import Any, AsyncIterator, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from dflash_jax.serving import protocol as P
from dflash_jax.serving.metrics import Metrics
from dflash_jax.serving.scheduler import QueueFull, Scheduler, SchedulerClosed, Sink, asyncio_sink
from dflash_jax.serving.settings import ServerSettings
from dflash_jax.serving.text_stream import TextStream, finish_text
from dflash_jax.io.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

log = logging.getLogger("dflash_jax.serving")

_DEFAULTS = ServerSettings()  # create_app's defaults are serve.py's: one place for each


@dataclasses.dataclass
class ServerContext:
    """Everything the handlers need; kept on ``app.state.ctx``."""

    engine: Any
    tokenizer: Tokenizer
    scheduler: Scheduler
    metrics: Metrics
    model_name: str
    max_length: int  # prompt + generated tokens
    vocab_size: int
    default_max_tokens: int
    max_request_bytes: int
    api_key: str | None
    stop_token_ids: tuple[int, ...]
    info: dict[str, Any]
    body_timeout_s: float = _DEFAULTS.body_timeout_s
    max_prompt_chars: int = 0  # a prompt text longer than this cannot fit; refused before it is tokenized
    # The requests on the scheduler, answered 503 shutting_down once the graceful shutdown's time is up.
    jobs: weakref.WeakSet = dataclasses.field(default_factory=weakref.WeakSet)
    shutdown_expired: bool = False

    def shutdown_started(self, timeout_s: float | None) -> None:
        """Called on the event loop when the server starts shutting down (``runner._Server``): with a
        timeout, the requests still running after it are ended with ``shutting_down`` errors."""
        if timeout_s is not None:
            asyncio.get_running_loop().call_later(max(0.0, timeout_s), self.end_requests)

    def end_requests(self) -> None:
        self.shutdown_expired = True
        for job in list(self.jobs):
            job.queue.put_nowait((0, "error", SchedulerClosed(
                "the server is shutting down, and its graceful shutdown timeout passed before this request finished")))


def create_app(
    engine: Any,
    tokenizer: Tokenizer,
    *,
    model_name: str = "dflash",
    max_length: int = 2048,
    vocab_size: int | None = None,
    default_max_tokens: int = _DEFAULTS.default_max_tokens,
    max_request_bytes: int = _DEFAULTS.max_request_bytes,
    body_timeout_s: float = _DEFAULTS.body_timeout_s,
    api_key: str | None = None,
    metrics_api_key: bool = _DEFAULTS.metrics_api_key,
    max_waiting: int = _DEFAULTS.max_waiting_requests,
    batch_wait_s: float = _DEFAULTS.batch_wait_ms / 1000,
    stop_token_ids: Sequence[int] | None = None,
    info: dict[str, Any] | None = None,
) -> Starlette:
    """The ASGI app serving ``engine`` (an ``Engine``, or anything with its slot interface: see
    ``dflash_jax.runtime.batcher``).

    The scheduler starts with the app's lifespan and is drained on shutdown (uvicorn first finishes
    the open HTTP requests, then runs the lifespan shutdown). ``app.state.shutdown_started(timeout_s)``
    (called by ``runner``) bounds how long the open requests may run: past it they are answered 503
    ``shutting_down``.
    """
    metrics = Metrics()
    scheduler = Scheduler(engine, batch_wait_s=batch_wait_s, max_waiting=max_waiting, metrics=metrics)
    ctx = ServerContext(
        engine=engine,
        tokenizer=tokenizer,
        scheduler=scheduler,
        metrics=metrics,
        model_name=model_name,
        max_length=max_length,
        vocab_size=vocab_size if vocab_size is not None else tokenizer.vocab_size,
        default_max_tokens=default_max_tokens,
        max_request_bytes=max_request_bytes,
        api_key=api_key or None,
        stop_token_ids=tuple(tokenizer.stop_token_ids if stop_token_ids is None else stop_token_ids),
        info=dict(info or {}),
        body_timeout_s=body_timeout_s,
        max_prompt_chars=_max_prompt_chars(tokenizer, min(max_length, engine.config.max_prompt_length)),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        scheduler.start()
        log.info("serving %s (max_length %d, max_batch_size %d)", model_name, max_length,
                 engine.config.max_batch_size)
        try:
            yield
        finally:
            log.info("draining the scheduler")
            await asyncio.to_thread(scheduler.close, True)
            log.info("scheduler drained")

    routes = [
        Route("/v1/completions", _endpoint(ctx, "/v1/completions", _completions, auth=True), methods=["POST"]),
        Route("/v1/chat/completions", _endpoint(ctx, "/v1/chat/completions", _chat, auth=True), methods=["POST"]),
        Route("/v1/models", _endpoint(ctx, "/v1/models", _models, auth=True), methods=["GET"]),
        Route("/health", _endpoint(ctx, "/health", _health), methods=["GET"]),
        # open by default, as vLLM's: scrapers rarely carry a key, and it shows only counts and latencies
        Route("/metrics", _endpoint(ctx, "/metrics", _metrics, auth=metrics_api_key), methods=["GET"]),
    ]

    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        path, method = P.clip(request.url.path), P.clip(request.method, 20)
        message = {404: f"no route {path}", 405: f"method {method} not allowed on {path}"}.get(
            exc.status_code, P.clip(exc.detail))
        return JSONResponse(P.error_body(message, type="invalid_request_error", code=code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    async def server_error(request: Request, exc: Exception) -> Response:
        return _internal_error(request, exc)

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.ctx = ctx
    app.state.shutdown_started = ctx.shutdown_started
    return app


# A token stands for at most this many characters of text times its own length in the vocabulary
# (byte-level BPE: bytes, which are at least the characters). The factor leaves room for normalizers
# that merge characters (NFC, NFKC) and for multi-character escapes.
_CHARS_PER_VOCAB_CHAR = 4


def _max_prompt_chars(tokenizer: Tokenizer, max_tokens: int) -> int:
    """How long a prompt's text can be and still encode to at most ``max_tokens`` tokens: the longest
    entry of the vocabulary, times ``_CHARS_PER_VOCAB_CHAR``, per token. Measured once per app."""
    longest = 1
    for i in range(tokenizer.vocab_size):
        token = tokenizer.id_to_token(i)
        if token is not None and len(token) > longest:
            longest = len(token)
    return max(1, max_tokens) * longest * _CHARS_PER_VOCAB_CHAR


# ---------------------------------------------------------------------------------------- plumbing


def _json(data: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(data, status_code=status)


def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", P.clip(request.url.path))
    return JSONResponse(P.error_body(f"internal server error: {type(exc).__name__}: {P.server_text(exc)}",
                                     type="server_error", code="internal_error"), status_code=500)


def _endpoint(ctx: ServerContext, name: str, handler, *, auth: bool = False):
    async def endpoint(request: Request) -> Response:
        try:
            if auth and ctx.api_key is not None:
                _check_auth(ctx, request)
            response = await handler(ctx, request)
        except P.APIError as err:
            response = _json(err.body(), err.status)
        except Exception as exc:  # a bug: answered 500 and counted, and the server keeps serving
            response = _internal_error(request, exc)
        ctx.metrics.http(name, response.status_code)
        return response

    return endpoint


def _check_auth(ctx: ServerContext, request: Request) -> None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), ctx.api_key.encode()):
        raise P.APIError(
            "missing or invalid API key: send 'Authorization: Bearer <key>'" if header else
            "missing API key: send 'Authorization: Bearer <key>'",
            status=401, type="authentication_error", code="invalid_api_key",
        )


async def _body(ctx: ServerContext, request: Request) -> dict[str, Any]:
    """The request's JSON object; a body over ``max_request_bytes`` is refused before it is read whole,
    and one that has not arrived whole within ``body_timeout_s`` is answered 408 (and its connection
    closed: a slow client holds neither memory nor a connection for long).

    Bodies are parsed on the event loop, holding the GIL, so without a limit one huge body stalled
    every stream and the scheduler's host loop (a 20 MB prompt: 30 s on a 2-core machine), and a
    body of any size was held in memory.
    """
    limit = ctx.max_request_bytes
    too_large = P.APIError(f"the request body is larger than the server's limit of {limit} bytes", status=413,
                           code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    try:
        async with asyncio.timeout(ctx.body_timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise too_large
    except ClientDisconnect:
        raise _client_gone() from None
    except TimeoutError:
        raise P.APIError(f"the request body did not arrive within the server's limit of {ctx.body_timeout_s:g} s",
                         status=408, code="request_timeout") from None
    return P.parse_json_body(bytes(body))


def _client_gone() -> P.APIError:
    # Nobody reads this answer; its status (nginx's "client closed request") is for the metrics.
    return P.APIError("the client disconnected before the response", status=499, code="client_disconnected")


def _check_model(ctx: ServerContext, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise P.APIError(f"the model {P.echo(model)} does not exist; this server serves {ctx.model_name!r}",
                         status=404, param="model", code="model_not_found")


def _check_prompt(ctx: ServerContext, ids: list[int], params: P.CommonParams, where: str = "the prompt",
                  param: str = "prompt") -> int:
    """Checks token ids and lengths; returns the number of tokens to generate."""
    max_tokens, name = params.max_tokens, params.max_tokens_param
    bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
    if bad:
        raise P.invalid(f"{where} has token ids outside the vocabulary [0, {ctx.vocab_size}): {P.echo(bad[:5])}",
                        param=param, code="invalid_token_id")
    n = len(ids)
    if n >= ctx.max_length:
        raise P.invalid(
            f"{where} has {n} tokens, but the maximum length is {ctx.max_length} tokens (prompt plus output), "
            "which leaves no room to generate", param=param, code="context_length_exceeded")
    longest = ctx.scheduler.engine.config.max_prompt_length  # the engine's largest prompt bucket can be shorter
    if n > longest:
        raise P.invalid(f"{where} has {n} tokens, but this server takes prompts of at most {longest} tokens",
                        param=param, code="context_length_exceeded")
    if max_tokens is None:
        return min(ctx.default_max_tokens, ctx.max_length - n)
    if max_tokens > ctx.max_length - n:  # no sum to print: max_tokens may have thousands of digits
        raise P.invalid(
            f"{where} has {n} tokens and {name} is {max_tokens}: together over the maximum length of "
            f"{ctx.max_length} tokens; lower {name} to at most {ctx.max_length - n}",
            param=name, code="context_length_exceeded")
    return max_tokens


@dataclasses.dataclass(eq=False)
class _Job:
    """One request's rows on the scheduler, the queue their events arrive on and their texts."""

    queue: asyncio.Queue
    requests: list
    prompt_ids: list[list[int]]
    texts: list[TextStream]

    def cancel(self) -> None:
        for r in self.requests:
            r.cancel()


def _stop_ids(ctx: ServerContext, params: P.CommonParams) -> tuple[int, ...]:
    """The model's stop ids (unless ``ignore_eos``) and the request's ``stop_token_ids``."""
    bad = [t for t in params.stop_token_ids if not 0 <= t < ctx.vocab_size]
    if bad:
        raise P.invalid(f"'stop_token_ids' has ids outside the vocabulary [0, {ctx.vocab_size}): "
                        f"{P.echo(bad[:5])}",
                        param="stop_token_ids", code="invalid_token_id")
    stop = tuple(dict.fromkeys((() if params.ignore_eos else ctx.stop_token_ids) + params.stop_token_ids))
    limit = ctx.scheduler.engine.max_stop_ids
    if len(stop) > limit:
        raise P.invalid(f"{len(stop)} distinct stop token ids (the model's and 'stop_token_ids'); the engine takes at "
                        f"most {limit}", param="stop_token_ids", code="too_many_stop_token_ids")
    return stop


def _choice_sampling(ctx: ServerContext, params: P.CommonParams) -> list:
    """The ``SamplingParams`` of each of a prompt's ``params.n`` choices (their own seeds:
    ``protocol.choice_seed``); a logit bias outside the vocabulary is a 400 naming it."""
    sampling = params.sampling
    bad = [t for t in (sampling.logit_bias or {}) if t >= ctx.vocab_size]
    if bad:
        raise P.invalid(f"'logit_bias' has token ids outside the vocabulary [0, {ctx.vocab_size}): {P.echo(bad[:5])}",
                        param="logit_bias", code="invalid_token_id")
    most = getattr(ctx.scheduler.engine.config, "max_logprobs", 0)
    if sampling.logprobs is not None and sampling.logprobs > most:
        raise P.invalid(f"this server returns at most {most} top logprobs per token, not {sampling.logprobs}",
                        param="top_logprobs" if sampling.logprobs > P.MAX_COMPLETION_LOGPROBS else "logprobs")
    if sampling.verify == "rejection" and getattr(getattr(ctx.scheduler.engine, "drafter", None), "selects_drafts",
                                                  False):
        raise P.invalid("'verify': 'rejection' needs drafts drawn from the drafter's distribution; this server's "
                        "DFlash2 drafter selects a path instead (use 'exact')", param="verify")
    return [dataclasses.replace(sampling, seed=P.choice_seed(sampling.seed, j)) for j in range(params.n)]


def _submit(ctx: ServerContext, prompts: list[list[int]], max_tokens: list[int], params: P.CommonParams) -> _Job:
    """Queues the prompts, ``params.n`` rows each (choice ``i * n + j`` is prompt i's j-th), each with
    the ``TextStream`` of its choice's text. With stop strings the
    text is decoded on the scheduler's thread, where the stream is the row's stop check, and each
    ``("tokens", ...)`` event carries ``(ids, text)``; without, on the event loop (``_tokens_event``)."""
    most = ctx.scheduler.max_waiting
    if len(prompts) * params.n > most:  # a 503 would tell the client to retry what never fits
        if len(prompts) == 1:
            raise P.invalid(f"'n' is {P.echo(params.n)}; this server queues at most {most} choices at once",
                            param="n", code="too_many_prompts")
        raise P.invalid(f"'prompt' has {len(prompts)} prompts of {P.echo(params.n)} choices; this server queues at "
                        f"most {most} at once", param="prompt", code="too_many_prompts")
    stop = _stop_ids(ctx, params)
    choices = _choice_sampling(ctx, params)
    sampling = [sp for _ in prompts for sp in choices]
    prompts = [ids for ids in prompts for _ in choices]
    max_tokens = [m for m in max_tokens for _ in choices]
    if ctx.shutdown_expired:
        raise P.APIError("the server is shutting down", status=503, type="server_error", code="shutting_down")
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    texts = [TextStream(ctx.tokenizer, params.stop) for _ in prompts]
    sinks = [asyncio_sink(loop, queue, i) for i in range(len(prompts))]
    if params.stop:
        sinks = [_text_sink(text, sink) for text, sink in zip(texts, sinks)]
    try:
        reqs = ctx.scheduler.submit_all(
            [(ids, m, sink) for ids, m, sink in zip(prompts, max_tokens, sinks)], stop_token_ids=stop,
            stop_checks=[text.add for text in texts] if params.stop else None,
            sampling=None if all(sp.plain for sp in sampling) else sampling)
    except (QueueFull, SchedulerClosed) as err:
        raise P.APIError(f"the server cannot take the request now: {err}", status=503, type="server_error",
                         code="server_overloaded" if isinstance(err, QueueFull) else "shutting_down") from None
    job = _Job(queue=queue, requests=reqs, prompt_ids=prompts, texts=texts)
    ctx.jobs.add(job)
    return job


def _text_sink(text: TextStream, sink: Sink) -> Sink:
    """``sink`` with each chunk's text beside its ids, taken right after the stop check decoded it."""

    def send(kind: str, payload: Any) -> None:
        sink(kind, (payload, text.take()) if kind == "tokens" else payload)

    return send


def _tokens_event(text: TextStream, payload: Any) -> tuple[list[int], str]:
    """A ``("tokens", ...)`` event's ids and text. Without stop strings the text is decoded here, on
    the event loop: on the scheduler's thread it cost a host-bound server (8 streams, no device
    work) 3-19% of its tokens/s (docs/performance.md)."""
    if text.stop:
        return payload
    text.add(payload)
    return payload, text.take()


def _engine_error(err: Exception) -> P.APIError:
    if isinstance(err, SchedulerClosed):
        return P.APIError(str(err), status=503, type="server_error", code="shutting_down")
    return P.APIError(f"generation failed: {type(err).__name__}: {P.server_text(err)}", status=500,
                      type="server_error", code="engine_error")


async def _results(job: _Job) -> list[Any]:
    results: list[Any] = [None] * len(job.requests)
    pending = len(job.requests)
    while pending:
        tag, kind, payload = await job.queue.get()
        if kind == "done":
            results[tag] = payload
            pending -= 1
        elif kind == "error":
            raise _engine_error(payload)
    return results


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away. The body has been read, so the next ASGI message is the
    disconnect (uvicorn sends it when the connection closes, or once the response is sent)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(job: _Job, request: Request) -> list[Any]:
    """The job's results. A client that goes away cancels the job, as a stream's does (Starlette
    watches for the disconnect only while it streams): its rows are released at the next host sync
    instead of generating for nobody."""
    results = asyncio.ensure_future(_results(job))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((results, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        results.cancel()
        job.cancel()
    if not results.done() or results.cancelled():
        raise _client_gone()
    return results.result()


def _stats(index: int, res: Any) -> dict[str, Any]:
    """A choice's decoding statistics (the ``dflash`` field of a response, and of a stream's finish chunk)."""
    return {
        "index": index,
        "tau": float(res.tau),  # 1.0 for target-only decoding
        "num_steps": int(res.num_steps),
        "acceptance_lengths": list(res.acceptance_lengths),
        "time_to_first_token": float(res.time_to_first_token),
        "time_per_output_token": float(res.time_per_output_token),
        **({} if getattr(res, "block_steps", None) is None else {  # adaptive speculation
            "block_steps": {str(b): int(n) for b, n in res.block_steps.items()},
            "acceptance_rate": None if res.acceptance_rate is None else float(res.acceptance_rate)}),
    }


# ---------------------------------------------------------------------------------------- completions


# Texts up to this long are encoded on the event loop: sending one to a thread costs more (~0.1 ms).
_INLINE_ENCODE_CHARS = 2048


def _check_prompt_chars(ctx: ServerContext, text: str, where: str, param: str) -> None:
    """Refuses a text that cannot encode to a prompt the server takes, without encoding it: a 2 MB
    prompt took ~0.85 s to encode, all of it wasted."""
    if len(text) > ctx.max_prompt_chars:
        raise P.invalid(f"{where} has {len(text)} characters, more than any prompt of at most "
                        f"{ctx.scheduler.engine.config.max_prompt_length} tokens this server takes can have "
                        f"({ctx.max_prompt_chars} characters)", param=param, code="context_length_exceeded")


async def _encode(ctx: ServerContext, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """Token ids of ``texts``. Long texts are encoded on a worker thread by ``encode_batch``, which
    lets go of the GIL while it works (``encode`` holds it: a 2 MB prompt stalled every stream and
    the scheduler for ~0.85 s)."""
    if sum(len(t) for t in texts) <= _INLINE_ENCODE_CHARS:
        return [ctx.tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]
    return await asyncio.to_thread(ctx.tokenizer.encode_batch, texts, add_special_tokens=add_special_tokens)


async def _completions(ctx: ServerContext, request: Request) -> Response:
    req = P.parse_completion_request(await _body(ctx, request))
    params = req.params
    _check_model(ctx, params.model)
    where = (lambda i: "the prompt") if len(req.prompts) == 1 else (lambda i: f"prompt[{i}]")
    texts = {i: p for i, p in enumerate(req.prompts) if isinstance(p, str)}
    for i, p in texts.items():
        _check_prompt_chars(ctx, p, where(i), "prompt")
    encoded = dict(zip(texts, await _encode(ctx, list(texts.values()), add_special_tokens=True))) if texts else {}
    prompts: list[list[int]] = []
    for i, p in enumerate(req.prompts):
        ids = encoded[i] if i in encoded else list(p)
        if not ids:
            raise P.invalid("'prompt' encodes to no tokens", param="prompt", code="empty_prompt")
        prompts.append(ids)
    echo_logprobs = req.echo and params.sampling.logprobs is not None
    if echo_logprobs and not getattr(ctx.scheduler.engine, "records_prompt_logprobs", False):
        raise P.unsupported("echo", True, "this engine does not compute prompt logprobs; send echo without logprobs")
    max_tokens = [_check_prompt(ctx, ids, params, where(i)) for i, ids in enumerate(prompts)]
    if echo_logprobs:  # the prompt's logprobs come from its prefill
        params = dataclasses.replace(params, sampling=dataclasses.replace(
            params.sampling, prompt_logprobs=params.sampling.logprobs))
    job = _submit(ctx, prompts, max_tokens, params)
    rid, created = P.new_id("cmpl"), P.now()
    if params.stream:
        return _stream(ctx, job, params, rid, created, chat=False,
                       echo=[_echo_text(ctx, p, ids) for p, ids in zip(req.prompts, prompts)] if req.echo else None)
    results = await _collect(job, request)
    choices, completion_tokens = [], 0
    for i, (res, text) in enumerate(zip(results, job.texts)):
        out, _, finish = finish_text(text, res)
        completion_tokens += len(out)
        prefix = _echo_text(ctx, req.prompts[i // params.n], job.prompt_ids[i]) if req.echo else ""
        choice = {"index": i, "text": prefix + text.text, "logprobs": None, "finish_reason": finish}
        if res.logprobs is not None and res.prompt_logprobs is not None:
            choice["logprobs"] = _completion_logprobs(ctx, job.prompt_ids[i] + out, res.prompt_logprobs + res.logprobs,
                                                      res.prompt_top_logprobs + res.top_logprobs)
        elif res.logprobs is not None:
            choice["logprobs"] = _completion_logprobs(ctx, out, res.logprobs, res.top_logprobs, len(prefix))
        if params.return_token_ids:
            choice["token_ids"] = out
            choice["prompt_token_ids"] = job.prompt_ids[i]
        choices.append(choice)
    body = {
        "id": rid, "object": "text_completion", "created": created, "model": ctx.model_name, "choices": choices,
        "usage": P.usage(sum(len(p) for p in prompts), completion_tokens),
        "dflash": [_stats(i, r) for i, r in enumerate(results)],
    }
    return _json(body)


async def _chat(ctx: ServerContext, request: Request) -> Response:
    req = P.parse_chat_request(await _body(ctx, request))
    params = req.params
    _check_model(ctx, params.model)
    try:
        text = ctx.tokenizer.apply_chat_template(
            req.messages, add_generation_prompt=req.add_generation_prompt, tokenize=False, **req.chat_template_kwargs)
    except ChatTemplateError as err:
        raise P.invalid(f"the chat template rejected the messages: {P.server_text(err)}", param="messages",
                        code="chat_template_error") from None
    except TokenizerError as err:  # the server's template: the client learns what, the log where
        if ctx.tokenizer.chat_template_names:  # a model without one was logged once, at start-up
            log.error("cannot apply the chat template: %s", err)
        raise P.invalid(f"cannot apply the chat template: {P.server_text(err.reason or 'it is not valid')}",
                        param="messages", code="chat_template_error") from None
    _check_prompt_chars(ctx, text, "the chat prompt", "messages")
    # as apply_chat_template(tokenize=True): the template writes the special tokens itself
    (ids,) = await _encode(ctx, [text], add_special_tokens=False)
    if not ids:
        raise P.invalid("the messages render to an empty prompt", param="messages", code="empty_prompt")
    max_tokens = _check_prompt(ctx, ids, params, "the chat prompt", param="messages")
    job = _submit(ctx, [ids], [max_tokens], params)
    rid, created = P.new_id("chatcmpl"), P.now()
    if params.stream:
        return _stream(ctx, job, params, rid, created, chat=True)
    results = await _collect(job, request)
    choices, completion_tokens = [], 0
    for i, (res, text) in enumerate(zip(results, job.texts)):
        out, _, finish = finish_text(text, res)
        completion_tokens += len(out)
        choice = {"index": i, "message": {"role": "assistant", "content": text.text},
                  "logprobs": None, "finish_reason": finish}
        if res.logprobs is not None:
            choice["logprobs"] = {"content": _chat_logprobs(ctx, out, res.logprobs, res.top_logprobs)}
        if params.return_token_ids:
            choice["token_ids"] = out
        choices.append(choice)
    body = {
        "id": rid, "object": "chat.completion", "created": created, "model": ctx.model_name, "choices": choices,
        "usage": P.usage(len(ids), completion_tokens),
        "dflash": [_stats(i, r) for i, r in enumerate(results)],
    }
    if params.return_token_ids:
        body["prompt_token_ids"] = ids
    return _json(body)


def _token_text(ctx: ServerContext, token: int) -> str:
    return ctx.tokenizer.decode([token], skip_special_tokens=False)


def _echo_text(ctx: ServerContext, prompt: str | list[int], ids: list[int]) -> str:
    """The prompt as ``echo`` prints it: its text, or its ids decoded."""
    return prompt if isinstance(prompt, str) else ctx.tokenizer.decode(ids, skip_special_tokens=False)


def _completion_logprobs(ctx: ServerContext, ids: list[int], logprobs: list, top: list,
                         offset: int = 0) -> dict[str, Any]:
    """Completions' ``logprobs`` object (OpenAI's legacy shape) for ``ids``: ``text_offset`` counts
    from ``offset`` characters of the choice's text; an echoed prompt's first token has None entries."""
    tokens = [_token_text(ctx, t) for t in ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [None if x is None else float(x) for x in logprobs[:len(ids)]],
            "top_logprobs": [None if d is None else {_token_text(ctx, t): float(v) for t, v in d.items()}
                             for d in top[:len(ids)]],
            "text_offset": offsets}


def _chat_logprobs(ctx: ServerContext, ids: list[int], logprobs: list[float], top: list[dict[int, float]],
                   ) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content``: per token its text, logprob, UTF-8 bytes and top alternatives."""
    def entry(token: int, value: float) -> dict[str, Any]:
        text = _token_text(ctx, token)
        return {"token": text, "logprob": float(value), "bytes": list(text.encode("utf-8"))}

    return [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in d.items()]}
            for t, lp, d in zip(ids, logprobs, top)]


def _stream(ctx: ServerContext, job: _Job, params: P.CommonParams, rid: str, created: int, *, chat: bool,
            echo: list[str] | None = None) -> StreamingResponse:
    """``echo``: completions' prompt texts, streamed first in each choice; with prompt logprobs
    (``SamplingParams.prompt_logprobs``) when the choice's prefill has given them, with its first tokens."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    n = len(job.requests)
    want_logprobs = params.sampling.logprobs is not None
    offsets = [0] * n  # completions' text_offset: characters streamed per choice

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return P.sse({"id": rid, "object": obj, "created": created, "model": ctx.model_name, "choices": choices,
                      **extra})

    def piece(i: int, text: str | None, ids: list[int] | None, finish: str | None,
              entries: tuple[list, list] | None = None, entry_ids: list[int] | None = None) -> dict[str, Any]:
        entry_ids = ids if entry_ids is None else entry_ids
        if chat:
            c: dict[str, Any] = {"index": i, "delta": {} if text is None else {"content": text}, "logprobs": None,
                                 "finish_reason": finish}
            if entries is not None and ids:
                c["logprobs"] = {"content": _chat_logprobs(ctx, ids, *entries)}
        else:
            c = {"index": i, "text": text or "", "logprobs": None, "finish_reason": finish}
            if entries is not None and entry_ids:
                c["logprobs"] = _completion_logprobs(ctx, entry_ids, *entries, offsets[i])
            offsets[i] += len(text or "")
        if params.return_token_ids and ids is not None:
            c["token_ids"] = ids
        return c

    async def events() -> AsyncIterator[bytes]:
        sent = [0] * n  # token ids streamed per choice
        completion_tokens = 0
        pending = n
        try:
            if chat:
                for i in range(n):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
            echoing = [echo is not None] * n  # choices whose echo is still to stream

            def echoed(i: int) -> bytes:
                echoing[i] = False
                g = job.requests[i].generation
                entries = None if g is None or g.prompt_logprobs is None else (g.prompt_logprobs, g.prompt_top_logprobs)
                return chunk([piece(i, echo[i // params.n], None, None, entries, job.prompt_ids[i])])

            if echo is not None and params.sampling.prompt_logprobs is None:
                for i in range(n):
                    yield echoed(i)
            while pending:
                i, kind, payload = await job.queue.get()
                if echoing[i] and kind != "error":  # its prompt logprobs came with its admission
                    yield echoed(i)
                if kind == "tokens":
                    ids, text = _tokens_event(job.texts[i], payload)
                    entries = None
                    if want_logprobs:  # the batcher filled the generation's entries before sending the ids
                        g = job.requests[i].generation
                        entries = (g.logprobs[sent[i]:sent[i] + len(ids)], g.top_logprobs[sent[i]:sent[i] + len(ids)])
                    sent[i] += len(ids)
                    if text or params.return_token_ids or entries is not None:
                        yield chunk([piece(i, text, list(ids), None, entries)])
                elif kind == "done":
                    pending -= 1
                    out, text, finish = finish_text(job.texts[i], payload)
                    rest = out[sent[i]:]
                    if text or rest:
                        entries = None
                        if want_logprobs and payload.logprobs is not None:
                            entries = (payload.logprobs[sent[i]:len(out)], payload.top_logprobs[sent[i]:len(out)])
                        yield chunk([piece(i, text, rest, None, entries)])
                    completion_tokens += len(out)
                    yield chunk([piece(i, None, None, finish)], dflash=[_stats(i, payload)])
                elif kind == "error":
                    err = _engine_error(payload)
                    yield P.sse(err.body())
                    break
            if params.include_usage:
                prompt_tokens = sum(len(p) for p in job.prompt_ids)
                yield chunk([], usage=P.usage(prompt_tokens, completion_tokens))
            yield P.SSE_DONE
        finally:
            job.cancel()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---------------------------------------------------------------------------------------- info endpoints


async def _models(ctx: ServerContext, request: Request) -> Response:
    card = {"id": ctx.model_name, "object": "model", "created": P.now(), "owned_by": "dflash-jax",
            "max_model_len": ctx.max_length, **ctx.info}
    return _json({"object": "list", "data": [card]})


async def _health(ctx: ServerContext, request: Request) -> Response:
    if ctx.scheduler.closing:
        return _json({"status": "shutting_down"}, 503)
    if not ctx.scheduler.alive:
        return _json({"status": "scheduler_not_running"}, 503)
    return _json({"status": "ok", "model": ctx.model_name})


async def _metrics(ctx: ServerContext, request: Request) -> Response:
    return PlainTextResponse(ctx.metrics.render(ctx.model_name), media_type="text/plain; version=0.0.4")
