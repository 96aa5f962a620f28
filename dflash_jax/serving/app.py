"""The OpenAI-compatible HTTP server (a Starlette ASGI app).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` as
server-sent events in OpenAI's chunk format ending with ``data: [DONE]``), ``GET /v1/models``,
``GET /health`` and ``GET /metrics`` (Prometheus text format).

Bad input is answered 400 with an OpenAI error body naming the problem, and the server keeps serving.
With an API key, the ``/v1`` endpoints need ``Authorization: Bearer <key>``. Decoding is greedy.

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


def create_app(
    engine: Any,
    tokenizer: Tokenizer,
    *,
    model_name: str = "dflash",
    max_length: int = 2048,
    vocab_size: int | None = None,
    default_max_tokens: int = _DEFAULTS.default_max_tokens,
    max_request_bytes: int = _DEFAULTS.max_request_bytes,
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
    the open HTTP requests, then runs the lifespan shutdown).
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
        message = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed on "
                   f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
        return JSONResponse(P.error_body(message, type="invalid_request_error", code=code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    async def server_error(request: Request, exc: Exception) -> Response:
        return _internal_error(request, exc)

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.ctx = ctx
    return app


# ---------------------------------------------------------------------------------------- plumbing


def _json(data: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(data, status_code=status)


def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path)
    return JSONResponse(P.error_body(f"internal server error: {type(exc).__name__}: {exc}", type="server_error",
                                     code="internal_error"), status_code=500)


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
    """The request's JSON object; a body over ``max_request_bytes`` is refused before it is read whole.

    Bodies are parsed and tokenized on the event loop, holding the GIL (tokenizers' encode does), so
    without a limit one huge prompt stalled every stream and the scheduler's host loop (a 20 MB
    prompt: 30 s on a 2-core machine), and a body of any size was held in memory.
    """
    limit = ctx.max_request_bytes
    too_large = P.APIError(f"the request body is larger than the server's limit of {limit} bytes", status=413,
                           code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:
        raise _client_gone() from None
    return P.parse_json_body(bytes(body))


def _client_gone() -> P.APIError:
    # Nobody reads this answer; its status (nginx's "client closed request") is for the metrics.
    return P.APIError("the client disconnected before the response", status=499, code="client_disconnected")


def _check_model(ctx: ServerContext, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise P.APIError(f"the model {model!r} does not exist; this server serves {ctx.model_name!r}",
                         status=404, param="model", code="model_not_found")


def _check_prompt(ctx: ServerContext, ids: list[int], params: P.CommonParams, where: str = "the prompt",
                  param: str = "prompt") -> int:
    """Checks token ids and lengths; returns the number of tokens to generate."""
    max_tokens, name = params.max_tokens, params.max_tokens_param
    bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
    if bad:
        raise P.invalid(f"{where} has token ids outside the vocabulary [0, {ctx.vocab_size}): {bad[:5]}",
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


@dataclasses.dataclass
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
        raise P.invalid(f"'stop_token_ids' has ids outside the vocabulary [0, {ctx.vocab_size}): {bad[:5]}",
                        param="stop_token_ids", code="invalid_token_id")
    stop = tuple(dict.fromkeys((() if params.ignore_eos else ctx.stop_token_ids) + params.stop_token_ids))
    limit = ctx.scheduler.engine.max_stop_ids
    if len(stop) > limit:
        raise P.invalid(f"{len(stop)} distinct stop token ids (the model's and 'stop_token_ids'); the engine takes at "
                        f"most {limit}", param="stop_token_ids", code="too_many_stop_token_ids")
    return stop


def _submit(ctx: ServerContext, prompts: list[list[int]], max_tokens: list[int], params: P.CommonParams) -> _Job:
    """Queues the prompts, each with the ``TextStream`` of its choice's text. With stop strings the
    text is decoded on the scheduler's thread, where the stream is the row's stop check, and each
    ``("tokens", ...)`` event carries ``(ids, text)``; without, on the event loop (``_tokens_event``)."""
    stop = _stop_ids(ctx, params)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    texts = [TextStream(ctx.tokenizer, params.stop) for _ in prompts]
    sinks = [asyncio_sink(loop, queue, i) for i in range(len(prompts))]
    if params.stop:
        sinks = [_text_sink(text, sink) for text, sink in zip(texts, sinks)]
    try:
        reqs = ctx.scheduler.submit_all(
            [(ids, m, sink) for ids, m, sink in zip(prompts, max_tokens, sinks)], stop_token_ids=stop,
            stop_checks=[text.add for text in texts] if params.stop else None)
    except (QueueFull, SchedulerClosed) as err:
        raise P.APIError(f"the server cannot take the request now: {err}", status=503, type="server_error",
                         code="server_overloaded" if isinstance(err, QueueFull) else "shutting_down") from None
    return _Job(queue=queue, requests=reqs, prompt_ids=prompts, texts=texts)


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
    return P.APIError(f"generation failed: {type(err).__name__}: {err}", status=500, type="server_error",
                      code="engine_error")


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
    }


# ---------------------------------------------------------------------------------------- completions


async def _completions(ctx: ServerContext, request: Request) -> Response:
    req = P.parse_completion_request(await _body(ctx, request))
    params = req.params
    _check_model(ctx, params.model)
    prompts: list[list[int]] = []
    for i, p in enumerate(req.prompts):
        ids = ctx.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
        if not ids:
            raise P.invalid("'prompt' encodes to no tokens", param="prompt", code="empty_prompt")
        prompts.append(ids)
    if len(prompts) > ctx.scheduler.max_waiting:  # a 503 would tell the client to retry what never fits
        raise P.invalid(f"'prompt' has {len(prompts)} prompts; this server queues at most "
                        f"{ctx.scheduler.max_waiting} at once", param="prompt", code="too_many_prompts")
    where = (lambda i: "the prompt") if len(prompts) == 1 else (lambda i: f"prompt[{i}]")
    max_tokens = [_check_prompt(ctx, ids, params, where(i)) for i, ids in enumerate(prompts)]
    job = _submit(ctx, prompts, max_tokens, params)
    rid, created = P.new_id("cmpl"), P.now()
    if params.stream:
        return _stream(ctx, job, params, rid, created, chat=False)
    results = await _collect(job, request)
    choices, completion_tokens = [], 0
    for i, (res, text) in enumerate(zip(results, job.texts)):
        out, _, finish = finish_text(text, res)
        completion_tokens += len(out)
        choice = {"index": i, "text": text.text, "logprobs": None, "finish_reason": finish}
        if params.return_token_ids:
            choice["token_ids"] = out
            choice["prompt_token_ids"] = prompts[i]
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
        ids = ctx.tokenizer.apply_chat_template(
            req.messages, add_generation_prompt=req.add_generation_prompt, tokenize=True, **req.chat_template_kwargs)
    except ChatTemplateError as err:
        raise P.invalid(f"the chat template rejected the messages: {err}", param="messages",
                        code="chat_template_error") from None
    except TokenizerError as err:
        raise P.invalid(f"cannot apply the chat template: {err}", param="messages",
                        code="chat_template_error") from None
    if not ids:
        raise P.invalid("the messages render to an empty prompt", param="messages", code="empty_prompt")
    max_tokens = _check_prompt(ctx, ids, params, "the chat prompt", param="messages")
    job = _submit(ctx, [ids], [max_tokens], params)
    rid, created = P.new_id("chatcmpl"), P.now()
    if params.stream:
        return _stream(ctx, job, params, rid, created, chat=True)
    (res,) = await _collect(job, request)
    out, _, finish = finish_text(job.texts[0], res)
    choice = {"index": 0, "message": {"role": "assistant", "content": job.texts[0].text},
              "logprobs": None, "finish_reason": finish}
    if params.return_token_ids:
        choice["token_ids"] = out
    body = {
        "id": rid, "object": "chat.completion", "created": created, "model": ctx.model_name, "choices": [choice],
        "usage": P.usage(len(ids), len(out)),
        "dflash": [_stats(0, res)],
    }
    if params.return_token_ids:
        body["prompt_token_ids"] = ids
    return _json(body)


def _stream(ctx: ServerContext, job: _Job, params: P.CommonParams, rid: str, created: int, *, chat: bool
            ) -> StreamingResponse:
    obj = "chat.completion.chunk" if chat else "text_completion"
    n = len(job.requests)

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return P.sse({"id": rid, "object": obj, "created": created, "model": ctx.model_name, "choices": choices,
                      **extra})

    def piece(i: int, text: str | None, ids: list[int] | None, finish: str | None) -> dict[str, Any]:
        if chat:
            c: dict[str, Any] = {"index": i, "delta": {} if text is None else {"content": text}, "logprobs": None,
                                 "finish_reason": finish}
        else:
            c = {"index": i, "text": text or "", "logprobs": None, "finish_reason": finish}
        if params.return_token_ids and ids is not None:
            c["token_ids"] = ids
        return c

    async def events() -> AsyncIterator[bytes]:
        sent = [0] * n  # token ids streamed per choice
        completion_tokens = 0
        pending = n
        try:
            if chat:
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            while pending:
                i, kind, payload = await job.queue.get()
                if kind == "tokens":
                    ids, text = _tokens_event(job.texts[i], payload)
                    sent[i] += len(ids)
                    if text or params.return_token_ids:
                        yield chunk([piece(i, text, list(ids), None)])
                elif kind == "done":
                    pending -= 1
                    out, text, finish = finish_text(job.texts[i], payload)
                    rest = out[sent[i]:]
                    if text or rest:
                        yield chunk([piece(i, text, rest, None)])
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
