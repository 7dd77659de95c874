"""`moeferry serve`: the loaded model behind a local OpenAI-compatible API.

Server library: aiohttp. It is one maintained package that is both the HTTP server and the
framework (no separate ASGI server to pin), it runs on an event loop in a thread of its own
(which the desktop app needs: its UI thread and engine thread are taken), streams with
`StreamResponse`, caps request bodies (`client_max_size`), and cancels a handler when its
client disconnects (`handler_cancellation`), which is how a dropped stream stops its
generation at once.

Batch 1, honestly: one engine, one generation at a time. Requests wait in a bounded FIFO
(`Scheduler`); a full queue answers 429 with Retry-After. Jobs run on one thread (the
`runner`: here `run_job` on the engine, in the app the engine worker's thread, so the chat
window and API requests take turns). A job reports through `Job.emit`, called on the
runner's thread, with these events in this order:

    ("start", prompt_tokens)             the prompt fits; tokens follow
    ("text", str) ...                    reply text, stop sequences already cut out
    ("end", finish_reason, usage, extra) finish_reason "stop" | "length" | "cancelled"
    or at any point ("error", ApiError)  and nothing after it

The engine keeps the keys/values of the last conversation and reuses its longest common token
prefix (moeferry.engine.runtime.generate.common_prefix), so a request that extends the previous conversation
computes only its new tokens; `usage.prompt_tokens_details.cached_tokens` says how many were
reused.

Safe by default: binds 127.0.0.1; another address needs an API key or --no-auth (with a
warning). The key is compared with hmac.compare_digest and never logged (no access log).
Every error is an OpenAI error object with a 4xx/5xx status, never a traceback. The server
writes no files at all.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import ipaddress
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from moeferry.engine.api.openai_api import (
    SSE_DONE,
    ApiError,
    ApiRequest,
    StopMatcher,
    chunk_body,
    error_body,
    fold_system,
    model_body,
    models_body,
    moeferry_extra,
    new_id,
    parse_request,
    response_body,
    shown,
    sse,
    usage_body,
)
from moeferry.engine.errors import UserError

log = logging.getLogger("moeferry.serve")
http_log = logging.getLogger("moeferry.serve.http")  # aiohttp's own, for what happens outside the handlers
MAX_BODY_BYTES = 1 << 20
RETRY_AFTER_S = 2
KEY_ENV = "MOEFERRY_API_KEY"


@dataclass
class Job:
    request: ApiRequest
    emit: Callable[[tuple], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    max_context: int
    created: int


def model_info(engine) -> ModelInfo:
    """The id clients name the model by: the store's folder name (`demo` for the demo)."""
    return ModelInfo(engine.store.path.name, engine.max_context, int(engine.store.path.stat().st_mtime))


# ---------------------------------------------------------------------------------------------
# Running one request on the engine (on the thread that owns the engine)


def run_job(engine, job: Job) -> None:
    """Generate one request's reply, reporting through job.emit; never raises."""
    try:
        if job.cancel.is_set():  # the client left while it waited
            log.info("%s: cancelled before it started, 0 new", "chat" if job.request.chat else "completion")
            return
        if engine is None:
            raise ApiError(503, "No model is loaded in MoE Ferry; load one in the app and try again.",
                           type="server_error")
        ids = encode_request(engine, job.request)
        max_new = check_room(job.request, len(ids), engine.max_context)
        job.emit(("start", len(ids)))
        finish = generate_reply(engine, job, ids, max_new)
        stats = engine.last_stats
        log.info("%s: %d prompt tokens (%d reused), %d new, %s, %.1f tokens/s",
                 "chat" if job.request.chat else "completion", len(ids), stats.reused_prompt_tokens,
                 stats.new_tokens, finish, stats.tokens_per_s)
        job.emit(("end", finish, usage_body(len(ids), stats.new_tokens, stats.reused_prompt_tokens),
                  moeferry_extra(stats)))
    except ApiError as e:
        job.emit(("error", e))
    except UserError as e:
        job.emit(("error", ApiError(400, str(e))))
    except Exception as e:  # noqa: BLE001 - the client gets one sentence, the log the type
        log.error("generation failed: %s: %s", type(e).__name__, e)
        job.emit(("error", ApiError(500, f"The generation failed ({type(e).__name__}); see the server's log.",
                                    type="server_error")))
    finally:
        job.done.set()


def encode_request(engine, req: ApiRequest) -> list[int]:
    """Token ids of the prompt; chats go through the model's chat template."""
    if not req.chat:
        return engine.encode(req.prompt, chat=False)
    from jinja2 import TemplateError
    try:
        return engine.encode(req.prompt, chat=True)
    except TemplateError as e:
        folded = fold_system(req.prompt)
        if folded != req.prompt:  # templates without a system role
            try:
                return engine.encode(folded, chat=True)
            except TemplateError:
                pass
        raise ApiError(400, f"The model's chat template refused these messages ({e}).", "messages") from None


def check_room(req: ApiRequest, prompt_tokens: int, context: int) -> int:
    """The number of tokens to generate at most; ApiError when prompt + max_tokens exceed the context."""
    room = context - prompt_tokens
    if room < 1 or (req.max_tokens is not None and req.max_tokens > room):
        asked = f" plus max_tokens {req.max_tokens}" if req.max_tokens is not None else ""
        raise ApiError(400, f"The prompt has {prompt_tokens} tokens{asked}, which does not fit this model's "
                            f"context of {context} tokens with a reply; shorten the prompt or lower max_tokens.",
                       "messages" if req.chat else "prompt", "context_length_exceeded")
    return req.max_tokens or room


def generate_reply(engine, job: Job, ids: list[int], max_new: int) -> str:
    """Stream the reply's text to job.emit; return the finish reason."""
    from moeferry.engine.runtime.generate import SamplingSettings, detokenize  # torch: not needed to refuse bad options

    req = job.request
    sampling = SamplingSettings(req.temperature, req.top_p, max_new, req.seed)
    stop = StopMatcher(req.stop)
    tokens = engine.generate_ids(ids, sampling, job.cancel)
    finish, last = "", None
    try:
        for last, piece in detokenize(engine.tokenizer, tokens):  # noqa: B007 - `last` is read after the loop
            text, hit = stop.feed(piece)
            if text:
                job.emit(("text", text))
            if hit:
                finish = "stop"
                break
            if job.cancel.is_set():
                finish = "cancelled"
                break
    finally:
        tokens.close()  # ends the generation now: the engine's stats and lock are released
    if finish:
        return finish
    if stop.held:
        job.emit(("text", stop.flush()))
    ended_early = engine.last_stats.new_tokens < max_new or last in engine.eos_ids
    return "stop" if ended_early else "length"


# ---------------------------------------------------------------------------------------------
# The queue: batch 1, arrival order


class Scheduler:
    """One job runs at a time, in arrival order; at most `max_waiting` wait behind it."""

    def __init__(self, runner: Callable[[Job], None], max_waiting: int):
        self.runner, self.max_waiting = runner, max_waiting
        self.waiting: collections.deque[Job] = collections.deque()
        self.current: Job | None = None
        self.cond = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._loop, name="moeferry-api-queue", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> bool:
        """Queue a job; False when the queue is full."""
        with self.cond:
            # a client that left while it waited gives its place up now, not when its turn would have come
            self.waiting = collections.deque(j for j in self.waiting if not j.cancel.is_set())
            if self.closed or len(self.waiting) >= self.max_waiting:
                return False
            self.waiting.append(job)
            self.cond.notify()
            return True

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.waiting and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                job = self.current = self.waiting.popleft()
            self.runner(job)
            self.current = None

    def close(self) -> None:
        with self.cond:
            self.closed = True
            for job in [*self.waiting, self.current]:
                if job is not None:
                    job.cancel.set()
            self.waiting.clear()
            self.cond.notify_all()


# ---------------------------------------------------------------------------------------------
# HTTP


HTTP_WORDS = {404: "There is nothing at this address; the API is under /v1 (GET /v1/models).",
              405: "This address does not take that method (POST the completions, GET the models).",
              413: f"The request body is larger than {MAX_BODY_BYTES} bytes; send a shorter conversation."}


def make_app(scheduler: Scheduler, info: Callable[[], ModelInfo | None], api_key: str | None) -> web.Application:
    """The aiohttp application; info() is the loaded model (None while none is)."""

    def current() -> ModelInfo:
        found = info()
        if found is None:
            raise ApiError(503, "No model is loaded in MoE Ferry; load one and try again.", type="server_error")
        return found

    @web.middleware
    async def guard(request: web.Request, handler):
        try:
            if api_key is not None and not key_matches(request.headers.get("Authorization", ""), api_key):
                raise ApiError(401, "The API key is missing or wrong; send it as 'Authorization: Bearer KEY'.",
                               code="invalid_api_key", type="authentication_error")
            return await handler(request)
        except ApiError as e:
            headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else None
            return web.json_response(e.body(), status=e.status, headers=headers)
        except web.HTTPException as e:
            words = HTTP_WORDS.get(e.status, e.reason)
            return web.json_response(error_body(words, "invalid_request_error"), status=e.status)
        except (ConnectionResetError, asyncio.CancelledError):
            raise  # the client left: nobody to answer
        except Exception as e:  # noqa: BLE001 - an error object, never a traceback
            log.error("%s %s failed: %s: %s", request.method, request.path, type(e).__name__, e)
            return web.json_response(error_body(f"The server failed ({type(e).__name__}); see its log.",
                                                "server_error"), status=500)

    async def models(_request):
        m = current()
        return web.json_response(models_body(m.model_id, m.created))

    async def one_model(request):
        m = current()
        if request.match_info["model"] != m.model_id:
            raise ApiError(404, f"The model '{shown(request.match_info['model'])}' does not exist here; this server has "
                                f"'{m.model_id}'.", "model", "model_not_found")
        return web.json_response(model_body(m.model_id, m.created))

    async def chat(request):
        return await generation(request, scheduler, current(), chat=True)

    async def completions(request):
        return await generation(request, scheduler, current(), chat=False)

    app = web.Application(middlewares=[guard], client_max_size=MAX_BODY_BYTES)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", one_model)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    return app


def key_matches(header: str, api_key: str) -> bool:
    scheme, _, given = header.partition(" ")
    # surrogatepass: a header's bytes that are not UTF-8 arrive as surrogates (and a key from argv may hold them)
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("utf-8", "surrogatepass"),
                                                              api_key.encode("utf-8", "surrogatepass"))


async def generation(request: web.Request, scheduler: Scheduler, model: ModelInfo, chat: bool):
    req = parse_request(await request.read(), chat, model.model_id, model.max_context)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def emit(event: tuple) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the server stopped meanwhile
            pass

    job = Job(req, emit)
    if not scheduler.submit(job):
        raise ApiError(429, f"The server is busy ({scheduler.max_waiting} request(s) already waiting); try again "
                            f"in a few seconds.", code="rate_limit_exceeded", type="rate_limit_error")
    try:
        first = await events.get()
        if first[0] == "error":
            raise first[1]
        if req.stream:
            return await stream_reply(request, req, model.model_id, events)
        return await whole_reply(req, model.model_id, events)
    finally:
        job.cancel.set()  # a client that left cancels its generation at once (a no-op when done)


async def whole_reply(req: ApiRequest, model: str, events: asyncio.Queue) -> web.Response:
    text = []
    while True:
        event = await events.get()
        if event[0] == "text":
            text.append(event[1])
        elif event[0] == "error":
            raise event[1]
        else:
            _, finish, usage, extra = event
            body = response_body(req, new_id(req.chat), model, "".join(text), finish, usage, extra)
            return web.json_response(body)


async def stream_reply(request: web.Request, req: ApiRequest, model: str, events: asyncio.Queue):
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    rid = new_id(req.chat)
    try:
        await resp.write(sse(chunk_body(req, rid, model, "" if req.chat else None, first=True)))
        while True:
            event = await events.get()
            if event[0] == "text":
                await resp.write(sse(chunk_body(req, rid, model, event[1])))
                continue
            if event[0] == "error":
                await resp.write(sse(event[1].body()))
                break
            _, finish, usage, extra = event
            await resp.write(sse({**chunk_body(req, rid, model, finish=finish), "moeferry": extra}))
            if req.include_usage:
                await resp.write(sse({**chunk_body(req, rid, model), "choices": [], "usage": usage}))
            await resp.write(SSE_DONE)
            break
        await resp.write_eof()
    except ConnectionResetError:
        pass  # the client left; the caller's finally cancels the generation
    return resp


# ---------------------------------------------------------------------------------------------
# The server on a thread of its own


class OneLineBadHttp(logging.Filter):
    """aiohttp logs each malformed HTTP request (a bad Content-Length, a 10 kB header line) with a
    traceback, which any client could fill the terminal with; such a record keeps one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            what = error.message.splitlines()[0] if error.message else type(error).__name__
            record.msg, record.args = f"{record.getMessage()}: {what}", ()
            record.exc_info = record.exc_text = None
        return True


http_log.addFilter(OneLineBadHttp())


IDLE_S = 60.0  # a connection without a whole request for this long is closed


class ApiServer:
    """An aiohttp app served from its own thread and event loop. start() returns the bound port.

    A connection that has not sent a whole request within idle_s of opening (or of its last
    reply) is closed: a client that trickles its headers (slowloris) or idles would otherwise
    hold its socket for aiohttp's default hour. A request being answered is never cut."""

    def __init__(self, app: web.Application, host: str, port: int, idle_s: float = IDLE_S):
        self.app, self.host, self.port, self.idle_s = app, host, port, idle_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> int:
        self.thread = threading.Thread(target=self._run, name="moeferry-api-http", daemon=True)
        self.thread.start()
        self._ready.wait()
        if self._error is not None:
            raise UserError(f"Cannot listen on {self.host}:{self.port} ({self._error}); pick another --port "
                            f"or stop the program that uses it.")
        return self.port

    def _run(self) -> None:
        loop = self.loop = asyncio.new_event_loop()
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, logger=http_log,
                               keepalive_timeout=self.idle_s)
        try:
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, self.host, self.port)
            loop.run_until_complete(site.start())
            self.port = runner.addresses[0][1]
        except OSError as e:
            self._error = e.strerror or e
            self._ready.set()
            loop.run_until_complete(runner.cleanup())
            loop.close()
            return
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.loop is not None and self.thread is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout_s)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None, no_auth: bool) -> str:
    """A warning to print ('' when none); UserError when another address has no key and no --no-auth."""
    if api_key is not None and no_auth:
        raise UserError("--api-key and --no-auth exclude each other; give one of them.")
    if api_key is not None and not api_key.strip():
        raise UserError("The API key is empty; give a key of a few random words or characters.")
    if is_loopback(host) or api_key is not None:
        return ""
    if not no_auth:
        raise UserError(f"Serving on {host} lets other machines use the model; give --api-key KEY (or set "
                        f"{KEY_ENV}), or --no-auth to serve it without a key.")
    return (f"warning: the API on {host} has no key: anyone who can reach this machine can use the model "
            f"(give --api-key to require one).")


def cli_serve(args) -> int:
    """`moeferry serve STORE ...` until Ctrl+C."""
    from moeferry.engine.progress import ProgressLine

    if args.queue_size < 1 or not 0 <= args.port <= 65535:
        raise UserError("--queue-size must be 1 or more and --port between 0 (any free port) and 65535.")
    api_key = args.api_key if args.api_key is not None else os.environ.get(KEY_ENV)
    warning = check_exposure(args.host, api_key, args.no_auth)
    logging.basicConfig(level=logging.INFO, format="moeferry serve: %(message)s", stream=sys.stderr)
    from moeferry.engine.runtime.generate import load_engine
    engine = load_engine(args.store, device=args.device, dtype=args.dtype, cache_experts=args.cache_experts,
                         vram_budget=args.vram_budget, prefetch=args.prefetch, kernels=args.kernels,
                         progress=ProgressLine())
    if engine.note:
        print(f"moeferry: {engine.note}", file=sys.stderr)
    info = model_info(engine)
    scheduler = Scheduler(lambda job: run_job(engine, job), args.queue_size)
    server = ApiServer(make_app(scheduler, lambda: info, api_key), args.host, args.port)
    port = server.start()
    if warning:
        print(f"moeferry: {warning}", file=sys.stderr)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"moeferry: serving '{info.model_id}' at http://{host}:{port}/v1 "
          f"({'key required' if api_key else 'no key'}); Ctrl+C stops.", file=sys.stderr, flush=True)
    try:
        while server.thread.is_alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        scheduler.close()
        server.stop()
    return 0
