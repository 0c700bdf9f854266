"""An OpenAI-compatible server with continuous batching: AR, SD or SSD behind HTTP.

    python serve.py                                  # the shipped tiny pair, SSD, 127.0.0.1:8000
    python serve.py --target smollm2-135m --draft checkpoints/smollm2-135m-draft --port 8080
    curl localhost:8000/v1/completions -d '{"prompt": "def fib(n):", "max_tokens": 32}'

Endpoints: POST /v1/chat/completions and /v1/completions (streamed as server-sent events with
"stream": true), GET /v1/models and /v1/models/{id} (the model id is --target as given), GET
/health, GET and HEAD /metrics (Prometheus' text format: latency histograms, token and request
counters, acceptance, SSD's cache hits, KV blocks; metrics.py lists them), GET /openapi.json
(every body, protocol.py's models).
Every decoding flag of run.py applies; --temperature is the default of a request that gives none.
A request may give its own `temperature` (0 to 2) and `seed` (an integer): its row samples at its
own T from its own generators, so a seed gives the same text whatever else is in the batch (in
SSD when every proposal is the draft's: docs/design.md, Serving). `prompt` may be a list (of
strings or of token lists): one choice each, `index` set. Chat content may be text parts.
`stream_options`: `include_usage` (OpenAI's usage chunk, `choices: []`, after the last content
chunk) and vLLM's `continuous_usage_stats` (usage on every chunk). vLLM's `ignore_eos` and
`min_tokens` change where a row stops, never which tokens are drawn: an EOS before min_tokens (or
any, with ignore_eos) is kept and the row goes on, so SD and SSD stay exact; vLLM instead masks
EOS until min_tokens (docs/design.md, Serving). A field the engine cannot honour exactly (top_p !=
1, n > 1, logprobs, ...) is a 400 naming it; an unknown model a 404 `model_not_found`.

Every error, whatever its status (400, 401, 404, 405, 413, 500, 503), has OpenAI's shape:
{"error": {"message", "type", "param", "code"}}. Bodies are JSON whatever their content type;
pydantic's parser reads them (a malformed, 100,000-deep or lone-surrogate body is a 400); one over
--max-body-mb is a 413; an exception nothing foresaw is a 500 and one line in the log, and the
server goes on. --api-key (or SSD_API_KEY): each /v1 request must send it as a Bearer token (a
401 otherwise), as vLLM's and llama.cpp's servers do; /health, /metrics and /openapi.json stay
open (probes and scrapers carry no key).

This file speaks HTTP only: the engine (engine.load_engine: scheduler.py over decode.py's rounds)
runs in its own thread, which hands each request's tokens to the asyncio side. FastAPI and uvicorn
are optional requirements that only this file (and protocol.py, its bodies) imports. A checkpoint
without a chat template (the tiny pair) is chatted with in a plain one: "role: content" lines,
then "assistant:".
"""
import argparse
import asyncio
import json
import os
import secrets
import signal
import socket
import sys
import threading
import time
import uuid

import metrics
import run
from engine import SERVE_KV_TOKENS, Engine, EngineConfig, load_engine, one_line_warnings
from scheduler import Request

try:
    import uvicorn
    from fastapi import Depends, FastAPI, Request as HTTPRequest
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
    from pydantic import ValidationError
    from starlette.exceptions import HTTPException

    from protocol import (BadRequest, ChatCompletion, ChatRequest, Completion, CompletionRequest,
                          ErrorResponse, Health, Model, ModelList, check_fields, invalid,
                          message_text, openapi_schema)
except ImportError:
    sys.exit("serve.py needs FastAPI and uvicorn: pip install fastapi uvicorn")

MiB = 2**20


def error(status: int, message: str, param=None, code=None, kind="invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status)


def refuse(e: BadRequest) -> JSONResponse:
    return error(e.status, str(e), e.param, e.code)


# --------------------------------------------------------------------------------------------------
# A request's prompts as token ids (protocol.py has checked its fields)

def settings(body, engine: Engine, model_id: str, defaults) -> dict:
    """The request's settings (protocol.check_fields) and its prompts as token ids, each within
    the context, or a BadRequest naming the field."""
    f = check_fields(body, model_id, defaults)
    chat = isinstance(body, ChatRequest)
    prompts = [chat_ids(body.messages, engine)] if chat else prompt_ids(body.prompt, engine)
    for ids in prompts:
        check_length(ids, f["max_tokens"], engine, "messages" if chat else "prompt",
                     f["max_tokens_param"])
    return {**f, "prompts": prompts}


def encode(engine, text: str, param: str) -> list[int]:
    try:
        return run.encode(engine.tokenizer, text, chat=False)
    except ValueError as e:  # no tokenizer, or no tokens
        raise BadRequest(str(e), param, "invalid_value") from None


def prompt_ids(prompt, engine) -> list[list[int]]:
    """/v1/completions' prompt: a string, token ids, or a list of either (one choice each)."""
    single = isinstance(prompt, str) or isinstance(prompt[0], int)
    ids = [encode(engine, p, "prompt") if isinstance(p, str) else p
           for p in ([prompt] if single else prompt)]
    V = engine.config.vocab_size
    bad = [x for p in ids for x in p if x >= V]
    if bad:
        raise BadRequest(f"prompt token id {bad[0]} outside the vocabulary ({V})", "prompt",
                         "invalid_value")
    return ids


def chat_ids(messages, engine) -> list[int]:
    """/v1/chat/completions' messages, through the tokenizer's chat template (or the plain one)."""
    msgs = [{"role": "system" if m.role == "developer" else m.role,  # OpenAI's newer name
             "content": message_text(m.content, i)} for i, m in enumerate(messages)]
    tok = engine.tokenizer
    if not getattr(tok, "chat_template", None):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:"
        return encode(engine, text, "messages")
    try:
        return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                            return_dict=False))
    except Exception as e:  # noqa: BLE001 - a template's own checks (jinja's raise_exception)
        raise BadRequest(f"the chat template refused the messages: {e}", "messages",
                         "invalid_value") from None


def check_length(ids, max_tokens, engine, prompt_param, tokens_param):
    ctx = engine.config.max_position_embeddings
    if max_tokens + 1 + engine.K > ctx:
        raise BadRequest(f"{tokens_param}={max_tokens} exceeds the context of {ctx} tokens",
                         tokens_param, "context_length_exceeded")
    if len(ids) + max_tokens + engine.K + 1 > ctx:
        raise BadRequest(f"the prompt's {len(ids)} tokens + {tokens_param}={max_tokens} exceed "
                         f"the context of {ctx} tokens: shorten them", prompt_param,
                         "context_length_exceeded")


# --------------------------------------------------------------------------------------------------
# From the engine's thread to the asyncio side

class Reply:
    """One choice's text as the engine produces it. on_tokens and on_done run in the engine's
    thread; they decode, cut at a stop string (which ends the request; none is looked for before
    min_tokens, as in vLLM) and post (index, None: new text; or the finished request) to the
    request's queue. A whole answer with no stop string is decoded once, at the end."""

    def __init__(self, engine: Engine, f: dict, index: int, queue: asyncio.Queue, loop,
                 timer: metrics.RequestTimer):
        self.tok, self.stop, self.min_tokens = engine.tokenizer, f["stop"], f["min_tokens"]
        self.index, self.queue, self.loop, self.timer = index, queue, loop, timer
        self.each_round = f["stream"] or bool(self.stop)
        self.hold = max((len(s) - 1 for s in self.stop), default=0)  # a stop string's start
        self.detok = run.Detokenizer(self.tok)
        self.text, self.n_tokens = "", 0

    def post(self, item):
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, item))

    def on_tokens(self, tokens) -> bool:
        self.n_tokens = len(tokens)
        self.timer.tokens(len(tokens))
        if not self.each_round:
            return False
        seen, text = len(self.text), self.detok.add(tokens)
        cut = -1
        if len(tokens) > self.min_tokens:  # a stop string ends within the new text: look from
            # where one could have started
            cut = min((i for i in (text.find(s, max(seen - self.hold, 0)) for s in self.stop)
                       if i >= 0), default=-1)
        # one assignment: the asyncio thread may read it (ready) at any moment, never uncut
        self.text = text[:cut] if cut >= 0 else text
        self.post(None)
        return cut >= 0

    def on_done(self, req):
        self.timer.done(req.finish_reason)
        self.n_tokens = len(req.tokens)
        if not self.each_round:
            self.text = self.tok.decode(req.tokens, skip_special_tokens=True)
        elif not req.stopped:  # the last tokens' characters, complete or not
            self.text = self.detok.add(req.tokens, done=True)
        self.post(req)

    def ready(self, done: bool) -> str:
        """The text safe to send: at the end all of it; before, without what could be the start
        of a stop string (the detokenizer holds back an incomplete character)."""
        if done:
            return self.text
        return self.text[:len(self.text) - self.hold] if self.hold else self.text


class Answer:
    """The bodies of one response in OpenAI's shapes (protocol.py): the whole answer, or a
    stream's chunks; one choice per prompt."""

    def __init__(self, kind: str, model_id: str, stream: bool):
        self.kind, self.model_id, self.created = kind, model_id, int(time.time())
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.object = ("text_completion" if kind == "text" else
                       "chat.completion.chunk" if stream else "chat.completion")

    def body(self, choices: list, **usage) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model_id, "choices": choices, **usage}

    def choice(self, index: int, text: str, reason, delta=False) -> dict:
        if self.kind == "text":
            return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
        body = ({"delta": {"content": text} if text or reason is None else {}} if delta
                else {"message": {"role": "assistant", "content": text}})
        return {"index": index, **body, "logprobs": None, "finish_reason": reason}


async def answered(http: HTTPRequest, queue: asyncio.Queue, n: int) -> bool:
    """Wait for n replies' ends; False once the client has gone (asked every 0.5 s: no one else
    tells a handler that does not stream)."""
    while n:
        try:  # an item None is a reply's progress, not its end
            n -= (await asyncio.wait_for(queue.get(), timeout=0.5))[1] is not None
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                return False
    return True


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage_of(reqs: list[Request]) -> dict:
    return usage(sum(len(r.prompt) for r in reqs), sum(len(r.tokens) for r in reqs))


def chunk_usage(f: dict, req: Request, reply: Reply) -> dict:
    """A chunk's usage: none without include_usage; null, or with continuous_usage_stats its
    choice's so far."""
    if not f["usage"]:
        return {}
    return {"usage": usage(len(req.prompt), reply.n_tokens) if f["continuous"] else None}


# --------------------------------------------------------------------------------------------------
# The app

BEARER = HTTPBearer(auto_error=False, description="serve.py --api-key (or SSD_API_KEY)")


class API:
    """The endpoints of one engine; `state` says whether the engine is up ("healthy", "error")."""

    def __init__(self, engine: Engine, model_id: str, defaults, state: dict, api_key=None):
        self.engine, self.model_id, self.defaults, self.state = engine, model_id, defaults, state
        self.sched, self.api_key = engine.scheduler, api_key
        self.max_body = int(defaults.max_body_mb * MiB)
        self.stats = metrics.RequestStats()  # /metrics: the requests' latencies and ends

    async def completions(self, http: HTTPRequest):
        return await self.complete(http, CompletionRequest, "text")

    async def chat_completions(self, http: HTTPRequest):
        return await self.complete(http, ChatRequest, "chat")

    async def complete(self, http: HTTPRequest, schema, kind: str):
        """POST /v1/completions (kind "text") and /v1/chat/completions ("chat"): the request
        checked, each of its prompts submitted to the scheduler, and answered whole or streamed
        (events)."""
        start = time.perf_counter()  # its arrival, for /metrics' latencies
        try:
            body = schema.model_validate_json(await self.read(http))
            f = settings(body, self.engine, self.model_id, self.defaults)
        except ValidationError as e:
            return refuse(invalid(e))
        except BadRequest as e:
            return refuse(e)
        if self.state["down"]:  # while the speculator restarts, requests wait in the queue
            return error(503, f"the engine is down: {self.state['error']}", kind="server_error",
                         code="engine_down")
        queue, loop = asyncio.Queue(), asyncio.get_running_loop()
        replies = [Reply(self.engine, f, i, queue, loop, self.stats.timer(len(ids), start))
                   for i, ids in enumerate(f["prompts"])]
        reqs = [Request(ids, f["max_tokens"], r.on_tokens, r.on_done, temperature=f["temperature"],
                        seed=f["seed"], min_tokens=f["min_tokens"], ignore_eos=f["ignore_eos"])
                for ids, r in zip(f["prompts"], replies)]
        try:
            for req in reqs:
                self.sched.submit(req)
        except ValueError as e:
            self.cancel(reqs)  # the prompts queued before this one
            return error(400, str(e), "max_tokens", "kv_cache_too_small")
        answer = Answer(kind, self.model_id, f["stream"])
        if f["stream"]:
            return StreamingResponse(self.events(f, answer, replies, reqs),
                                     media_type="text/event-stream")
        try:
            if not await answered(http, queue, len(reqs)):
                return error(499, "the client closed the connection", kind="client_closed")
        finally:
            self.cancel(reqs)  # the client went away: free its rows
        failed = [req for req in reqs if req.finish_reason == "error"]
        if failed:
            return error(500, f"the engine failed: {failed[0].error}", kind="server_error",
                         code="engine_error")
        return answer.body([answer.choice(i, r.text, req.finish_reason)
                            for i, (r, req) in enumerate(zip(replies, reqs))],
                           usage=usage_of(reqs))

    async def read(self, http: HTTPRequest) -> bytes:
        """The request's body, or a 413 once it is over --max-body-mb (before it is all read)."""
        too_large = BadRequest(f"the request body is over {self.max_body} bytes (serve.py "
                               f"--max-body-mb)", code="request_too_large", status=413)
        length = http.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            raise too_large
        size, chunks = 0, []
        async for chunk in http.stream():
            size += len(chunk)
            if size > self.max_body:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    async def events(self, f: dict, answer: Answer, replies: list[Reply], reqs: list[Request]):
        """The stream's server-sent events: each choice's text as it comes, its finish_reason,
        then (include_usage) the usage chunk; a client that disconnects cancels its requests."""
        queue, sent, left = replies[0].queue, [0] * len(replies), len(replies)
        try:
            if answer.kind == "chat":  # each choice's first chunk names the role
                for i, (r, req) in enumerate(zip(replies, reqs)):
                    first = answer.choice(i, "", None, delta=True)
                    first["delta"] = {"role": "assistant", "content": ""}
                    yield sse(answer.body([first], **chunk_usage(f, req, r)))
            while left:
                i, item = await queue.get()
                r, req = replies[i], reqs[i]
                text = r.ready(done=item is not None)
                if len(text) > sent[i]:
                    yield sse(answer.body([answer.choice(i, text[sent[i]:], None, delta=True)],
                                          **chunk_usage(f, req, r)))
                    sent[i] = len(text)
                if item is None:
                    continue
                if item.finish_reason == "error":
                    yield sse({"error": {"message": f"the engine failed: {item.error}",
                                         "type": "server_error", "param": None,
                                         "code": "engine_error"}})
                    break
                left -= 1
                yield sse(answer.body([answer.choice(i, "", item.finish_reason, delta=True)],
                                      **chunk_usage(f, req, r)))
            if f["usage"] and not left:
                yield sse(answer.body([], usage=usage_of(reqs)))
            yield "data: [DONE]\n\n"
        finally:
            self.cancel(reqs)  # the client went away: free its rows

    def cancel(self, reqs: list[Request]):
        for req in reqs:
            if req.finish_reason is None:
                self.sched.cancel(req)

    async def authorize(self, key: HTTPAuthorizationCredentials | None = Depends(BEARER)):
        """--api-key: each /v1 request must bring it as a Bearer token."""
        if key is None or not secrets.compare_digest(key.credentials.encode(),
                                                     self.api_key.encode()):
            raise HTTPException(401, "invalid or missing API key: send the server's --api-key "
                                     "as 'Authorization: Bearer KEY'",
                                headers={"WWW-Authenticate": "Bearer"})

    async def models(self):
        return {"object": "list", "data": [self.model()]}

    async def get_model(self, model_id: str):
        if model_id != self.model_id:
            return error(404, f"the model {model_id!r} does not exist: this server serves "
                              f"{self.model_id!r}", "model", "model_not_found")
        return self.model()

    def model(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": 0, "owned_by": "ssd"}

    async def health(self):
        ok = self.state["healthy"]
        status = "ok" if ok else "down" if self.state["down"] else "restarting the speculator"
        body = {"status": status, "mode": self.engine.mode, "error": self.state["error"],
                "restarts": self.state["restarts"]}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(self):
        """GET (and HEAD) /metrics: Prometheus' text format (metrics.py says what each is)."""
        text = metrics.render(metrics.families(self.engine, self.state, self.stats))
        return Response(text, media_type=metrics.CONTENT_TYPE)


ERRORS = {status: {"model": ErrorResponse, "description": why} for status, why in [
    (400, "a field the engine cannot honour, or a malformed body"), (401, "--api-key not given"),
    (404, "an unknown model"), (413, "a body over --max-body-mb"),
    (500, "the engine failed"), (503, "the engine is down")]}
STREAM = {200: {"content": {"text/event-stream": {"schema": {
    "type": "string", "description": "with stream: true, server-sent events, each 'data: ' "
                                     "and one chunk, then 'data: [DONE]'"}}}}}


def make_app(engine: Engine, model_id: str, defaults, state: dict, api_key=None) -> FastAPI:
    """The HTTP side: API's endpoints at their paths, errors in OpenAI's shape."""
    api, app = API(engine, model_id, defaults, state, api_key), FastAPI(title="ssd serve")
    v1 = dict(dependencies=[Depends(api.authorize)] if api_key else [],
              responses={**ERRORS, **STREAM})
    app.post("/v1/completions", response_model=Completion, **v1)(api.completions)
    app.post("/v1/chat/completions", response_model=ChatCompletion, **v1)(api.chat_completions)
    app.get("/v1/models", response_model=ModelList, **v1)(api.models)
    app.get("/v1/models/{model_id:path}", response_model=Model, **v1)(api.get_model)
    app.get("/health", response_model=Health, responses={503: {"model": Health}})(api.health)
    app.get("/metrics", response_class=PlainTextResponse)(api.metrics)
    app.head("/metrics", include_in_schema=False)(api.metrics)  # a scraper's probe: no body
    app.exception_handler(HTTPException)(http_error)
    app.add_middleware(CatchAll)
    schema = openapi_schema(app, {"/v1/completions": CompletionRequest,
                                  "/v1/chat/completions": ChatRequest})
    app.openapi = lambda: schema  # (FastAPI's own would make it again, without the bodies)
    return app


async def http_error(http: HTTPRequest, e: HTTPException) -> JSONResponse:
    """Starlette's own errors (an unknown path, a method not allowed, a missing key) in OpenAI's
    shape."""
    where = f"{http.method} {http.url.path}"
    message = {404: f"no such path: {where}", 405: f"method not allowed: {where}"}
    code = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed"}
    response = error(e.status_code, message.get(e.status_code, str(e.detail)),
                     code=code.get(e.status_code))
    response.headers.update(e.headers or {})  # 405's Allow, 401's WWW-Authenticate
    return response


class CatchAll:
    """Anything unforeseen that a handler raised: a 500 in OpenAI's shape and one line in the
    log (no traceback); the engine goes on serving."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        started = False

        async def sending(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, receive, sending)
        except Exception as e:  # noqa: BLE001
            where = f"{scope.get('method', '')} {scope.get('path', '')}"
            print(f"serve.py: {where}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            if not started and scope["type"] == "http":
                await error(500, f"internal error ({type(e).__name__}); the server goes on",
                            kind="server_error", code="internal_error")(scope, receive, send)


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def run_engine(engine: Engine, stopping: threading.Event, state: dict):
    """Rounds until the server stops. If a round fails, every request in flight has ended with
    the error. When the speculator's process died (SSD in two processes), a new one is started
    with the same settings and the queued requests go on in SSD, never in another mode; anything
    else, or a restart that fails, leaves the engine down. /health says which."""
    while not stopping.is_set():
        try:
            engine.scheduler.serve(stopping)
            return
        except BaseException as e:  # noqa: BLE001 - reported by /health, in-flight requests got it
            state["error"] = f"{type(e).__name__}: {e}"
        state["healthy"] = False
        if engine.started.respawn is None:
            break
        try:
            said = engine.restart_speculator()
        except BaseException as e:  # noqa: BLE001
            state["error"] += f"; restarting the speculator failed: {type(e).__name__}: {e}"
            break
        state["error"] += f" ({said})" if said else ""
        state["healthy"], state["restarts"] = True, state["restarts"] + 1
    else:
        return  # the server is stopping
    state["down"] = True
    engine.scheduler.fail(f"the engine is down: {state['error']}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Serve the target (with a draft: sd, ssd) behind an "
                                             "OpenAI-compatible HTTP API, batching requests as "
                                             "they come.")
    g = ap.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    g.add_argument("--max-batch", type=int, default=16, metavar="N",
                   help="rows per round at most; more requests wait (default: %(default)s)")
    g.add_argument("--http-cores", type=int, default=1, metavar="N",
                   help="CPU cores left to the HTTP side (the event loop, and clients on this "
                        "machine); the engine's threads take the rest. 0: every core to the "
                        "engine, as run.py (default: %(default)s)")
    g.add_argument("--api-key", default=os.environ.get("SSD_API_KEY"), metavar="KEY",
                   help="every /v1 request must send 'Authorization: Bearer KEY' (a 401 "
                        "otherwise); /health, /metrics and /openapi.json stay open (default: "
                        "$SSD_API_KEY, else no key)")
    g.add_argument("--max-body-mb", type=float, default=16.0, metavar="MB",
                   help="a request body over this many MiB is a 413 (default: %(default)s)")
    g.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM / Ctrl-C, seconds in-flight requests get to finish "
                        "(default: %(default)s)")
    run.add_decoding_options(ap.add_argument_group("decoding (every request's defaults; "
                                                   "--max-new-tokens: max_tokens' default)"))
    run.add_algorithm_options(ap.add_argument_group("models and algorithm"))
    run.add_device_options(ap.add_argument_group("devices and memory"),
                           kv_default=f"{SERVE_KV_TOKENS}, shared by the running requests",
                           threads_default="all cores but --http-cores")
    return ap


def check_listen(host: str, port: int):
    """Bind (host, port) a moment: a port in use or an unknown host refused before the models
    load (minutes, for a large one), not after."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            s.bind(address)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror or e}): give another "
                         f"--port or --host, or stop what holds it") from None


def engine_config(a: argparse.Namespace) -> EngineConfig:
    """The engine of run.py's flags (--max-new-tokens: each request's default max_tokens)."""
    kw = run.generate_kwargs(a)
    if kw.pop("max_new_tokens") < 1:
        raise ValueError(f"--max-new-tokens={a.max_new_tokens} must be >= 1")
    if a.http_cores < 0:
        raise ValueError(f"--http-cores={a.http_cores} must be >= 0")
    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port {a.port}: give a port in 0..65535")
    check_listen(a.host, a.port)
    if not a.max_body_mb > 0:
        raise ValueError(f"--max-body-mb={a.max_body_mb} must be > 0")
    return EngineConfig(spec=kw.pop("draft_settings"), **kw, reserve_cores=a.http_cores)


def main(argv=None):
    a = parser().parse_args(argv)
    one_line_warnings()
    try:
        engine = load_engine(engine_config(a), a.max_batch)
        try:  # every request's default max_tokens: within the context
            check_length([], a.max_new_tokens, engine, "prompt", "--max-new-tokens")
        except BadRequest as e:
            engine.started.stop()
            raise ValueError(str(e)) from None
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # while loading (serving has its own: --grace)
        print("\ninterrupted", file=sys.stderr)
        return 130
    # healthy: the models are up; down: the engine will not serve again; error: the last one
    state = {"healthy": True, "down": False, "error": None, "restarts": 0}
    stopping = threading.Event()
    thread = threading.Thread(target=run_engine, args=(engine, stopping, state), daemon=True)
    thread.start()
    app = make_app(engine, a.target, a, state, a.api_key)
    print(f"serve.py: {a.mode} on http://{a.host}:{a.port} (model {a.target!r})", file=sys.stderr)
    # uvicorn stops accepting on SIGTERM / Ctrl-C, waits up to --grace for the requests in flight,
    # then raises the signal again for the handler it found: ours lets main stop the engine and
    # exit 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        uvicorn.run(app, host=a.host, port=a.port, log_level="warning",
                    timeout_graceful_shutdown=a.grace)
    finally:
        stopping.set()
        thread.join(timeout=a.grace + 5)
        engine.started.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
