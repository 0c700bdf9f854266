"""An OpenAI-compatible server with continuous batching: AR, SD or SSD behind HTTP.

    python serve.py                                  # the shipped tiny pair, SSD, 127.0.0.1:8000
    python serve.py --target smollm2-135m --draft checkpoints/smollm2-135m-draft --port 8080
    curl localhost:8000/v1/completions -d '{"prompt": "def fib(n):", "max_tokens": 32}'

Endpoints: POST /v1/chat/completions and /v1/completions (streamed as server-sent events with
"stream": true), GET /v1/models (the model id is --target as given), GET /health, GET and HEAD
/metrics (Prometheus' text format: latency histograms, token and request counters, acceptance,
SSD's cache hits, KV blocks; metrics.py lists them). Every decoding flag of run.py applies;
--temperature is the default of a request that gives none. A request may give its own
`temperature` (0 to 2) and `seed` (an integer):
its row samples at its own T from its own generators, so a seed gives the same text whatever else
is in the batch (in SSD when every proposal is the draft's: docs/design.md, Serving). A field
the engine cannot honour exactly (top_p != 1, n > 1, logprobs, ...) is a 400 naming it. Errors
have OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

This file speaks HTTP only: the engine (engine.load_engine: scheduler.py over decode.py's rounds)
runs in its own thread, which hands each request's tokens to the asyncio side. FastAPI and uvicorn
are optional requirements that only this file imports. A checkpoint without a chat template (the
tiny pair) is chatted with in a plain one: "role: content" lines, then "assistant:".
"""
import argparse
import asyncio
import json
import signal
import sys
import threading
import time
import uuid

import metrics
import run
from engine import Engine, EngineConfig, load_engine
from scheduler import Request

try:
    import uvicorn
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.responses import JSONResponse, Response, StreamingResponse
except ImportError:
    sys.exit("serve.py needs FastAPI and uvicorn: pip install fastapi uvicorn")

# Fields this server honours, and the ones OpenAI defines that it accepts only at the value that
# changes nothing (any other value, or any other field, is a 400 naming it: never silently ignored)
HONOURED = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
            "seed", "stop", "stream", "user"}
NEUTRAL = {"n": (1,), "top_p": (1,), "presence_penalty": (0,), "frequency_penalty": (0,),
           "logprobs": (None, False), "echo": (False,), "best_of": (1,), "logit_bias": (None,),
           "top_logprobs": (None,), "suffix": (None,), "stream_options": (None,)}


class BadRequest(Exception):
    def __init__(self, message, param=None, code=None):
        super().__init__(message)
        self.param, self.code = param, code


def error(status: int, message: str, param=None, code=None, kind="invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status)


# --------------------------------------------------------------------------------------------------
# A request's fields, checked before the engine sees it

def check_fields(body, chat: bool, engine: Engine, model_id: str, defaults) -> dict:
    """The request's settings from its JSON body, or a BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for name, value in body.items():
        if name in NEUTRAL and value not in NEUTRAL[name]:
            raise BadRequest(f"{name}={value!r} is not supported: this engine decodes one "
                             f"sequence per request at the server's settings; leave {name} out",
                             name, "unsupported_parameter")
        if name not in HONOURED and name not in NEUTRAL:
            raise BadRequest(f"unknown or unsupported field {name!r}: leave it out", name,
                             "unsupported_parameter")
    if body.get("model", model_id) != model_id:
        raise BadRequest(f"model {body['model']!r} is not served here: use {model_id!r}", "model",
                         "model_not_found")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", defaults.max_new_tokens))
    param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if not is_int(max_tokens) or max_tokens < 1:
        raise BadRequest(f"{param} must be an integer >= 1", param, "invalid_type")
    temperature, seed = sampling_fields(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false", "stream", "invalid_type")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s
                                                               for s in stop)):
        raise BadRequest("stop must be a non-empty string or a list of up to 4", "stop",
                         "invalid_type")
    ids = chat_ids(body, engine) if chat else prompt_ids(body, engine)
    check_length(ids, max_tokens, engine, "messages" if chat else "prompt", param)
    return {"ids": ids, "max_tokens": max_tokens, "stop": stop, "stream": stream,
            "temperature": temperature, "seed": seed}


def sampling_fields(body) -> tuple:
    """The request's own (temperature, seed); None where it gives none (the server's
    --temperature; a seed drawn from the server's --seed)."""
    temperature, seed = body.get("temperature"), body.get("seed")
    if temperature is not None and not (isinstance(temperature, (int, float))
                                        and not isinstance(temperature, bool)
                                        and 0 <= temperature <= 2):
        raise BadRequest(f"temperature must be a number from 0 to 2 (0 = greedy), got "
                         f"{temperature!r}", "temperature", "invalid_value")
    if seed is not None and not is_int(seed):
        raise BadRequest("seed must be an integer", "seed", "invalid_type")
    return temperature, seed


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def prompt_ids(body, engine) -> list[int]:
    """/v1/completions' prompt: a string, token ids, or a list of one of either."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str) and p:
        return run.encode(engine.tokenizer, p, chat=False)
    if isinstance(p, list) and p and all(is_int(x) for x in p):
        bad = [x for x in p if not 0 <= x < engine.config.vocab_size]
        if bad:
            raise BadRequest(f"prompt token id {bad[0]} outside the vocabulary", "prompt")
        return p
    raise BadRequest("prompt must be a non-empty string or list of token ids (one prompt per "
                     "request)", "prompt", "invalid_type")


def chat_ids(body, engine) -> list[int]:
    """/v1/chat/completions' messages, through the tokenizer's chat template (or the plain one)."""
    msgs = body.get("messages")
    if not (isinstance(msgs, list) and msgs and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in msgs)):
        raise BadRequest("messages must be a non-empty list of {role, content} strings",
                         "messages", "invalid_type")
    msgs = [{"role": m["role"], "content": m["content"]} for m in msgs]
    tok = engine.tokenizer
    if getattr(tok, "chat_template", None):
        return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                            return_dict=False))
    text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:"
    return run.encode(tok, text, chat=False)


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
    """One request's text as the engine produces it. on_tokens and on_done run in the engine's
    thread; they decode, cut at a stop string (which ends the request) and post to the event
    loop. A whole answer with no stop string is decoded once, at the end, not every round."""

    def __init__(self, engine: Engine, stop: list[str], loop, stream: bool,
                 timer: metrics.RequestTimer):
        self.tok, self.stop, self.loop, self.timer = engine.tokenizer, stop, loop, timer
        self.each_round = stream or bool(stop)
        self.hold = max((len(s) - 1 for s in stop), default=0)  # a stop string's start, held back
        self.detok = run.Detokenizer(self.tok)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.text = ""

    def on_tokens(self, tokens) -> bool:
        self.timer.tokens(len(tokens))
        if not self.each_round:
            return False
        seen = len(self.text)
        self.text = self.detok.add(tokens)
        # a stop string ends within the new text: look from where one could have started
        cut = min((i for i in (self.text.find(s, max(seen - self.hold, 0)) for s in self.stop)
                   if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)  # new text
        return cut >= 0

    def on_done(self, req):
        self.timer.done(req.finish_reason)
        if not self.each_round:
            self.text = self.tok.decode(req.tokens, skip_special_tokens=True)
        elif not req.stopped:  # the last tokens' characters, complete or not
            self.text = self.detok.add(req.tokens, done=True)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, req)

    def ready(self, done: bool) -> str:
        """The text safe to send: at the end all of it; before, without what could be the start
        of a stop string (the detokenizer holds back an incomplete character)."""
        if done:
            return self.text
        return self.text[:len(self.text) - self.hold] if self.hold else self.text


def completion(kind, rid, model_id, text, reason, usage=None, delta=False):
    """A response body (or a stream's chunk) of /v1/chat/completions or /v1/completions."""
    if kind == "chat":
        body = ({"delta": {"content": text} if text or reason is None else {}} if delta
                else {"message": {"role": "assistant", "content": text}})
        obj = "chat.completion.chunk" if delta else "chat.completion"
    else:
        body, obj = {"text": text, "logprobs": None}, "text_completion"
    out = {"id": rid, "object": obj, "created": int(time.time()), "model": model_id,
           "choices": [{"index": 0, **body, "finish_reason": reason}]}
    if usage:
        out["usage"] = usage
    return out


def usage_of(req: Request) -> dict:
    p, c = len(req.prompt), len(req.tokens)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


# --------------------------------------------------------------------------------------------------
# The app

class API:
    """The endpoints of one engine; `state` says whether the engine is up ("healthy", "error")."""

    def __init__(self, engine: Engine, model_id: str, defaults, state: dict):
        self.engine, self.model_id, self.defaults, self.state = engine, model_id, defaults, state
        self.sched = engine.scheduler
        self.stats = metrics.RequestStats()  # /metrics: the requests' latencies and ends

    async def completions(self, http: HTTPRequest):
        return await self.complete(http, "text")

    async def chat_completions(self, http: HTTPRequest):
        return await self.complete(http, "chat")

    async def complete(self, http: HTTPRequest, kind: str):
        """POST /v1/completions (kind "text") and /v1/chat/completions ("chat"): the request
        checked, submitted to the scheduler, and answered whole or streamed (events)."""
        start = time.perf_counter()  # its arrival, for /metrics' latencies
        try:
            body = json.loads(await http.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(400, f"malformed JSON: {e}", code="invalid_json")
        try:
            f = check_fields(body, kind == "chat", self.engine, self.model_id, self.defaults)
        except BadRequest as e:
            return error(400, str(e), e.param, e.code)
        if self.state["down"]:  # while the speculator restarts, requests wait in the queue
            return error(503, f"the engine is down: {self.state['error']}", kind="server_error",
                         code="engine_down")
        reply = Reply(self.engine, f["stop"], asyncio.get_running_loop(), f["stream"],
                      self.stats.timer(len(f["ids"]), start))
        req = Request(f["ids"], f["max_tokens"], reply.on_tokens, reply.on_done,
                      temperature=f["temperature"], seed=f["seed"])
        try:
            self.sched.submit(req)
        except ValueError as e:
            return error(400, str(e), "max_tokens", "kv_cache_too_small")
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        if f["stream"]:
            return StreamingResponse(self.events(reply, req, kind, rid),
                                     media_type="text/event-stream")
        try:
            while (item := await reply.queue.get()) is None:
                pass
        finally:
            if req.finish_reason is None:  # the client went away: free its row
                self.sched.cancel(req)
        if item.finish_reason == "error":
            return error(500, f"the engine failed: {item.error}", kind="server_error",
                         code="engine_error")
        return completion(kind, rid, self.model_id, reply.text, item.finish_reason,
                          usage_of(item))

    async def events(self, reply: Reply, req: Request, kind: str, rid: str):
        """The stream's server-sent events; a client that disconnects cancels its request."""
        sent, model_id = 0, self.model_id
        try:
            if kind == "chat":
                first = completion(kind, rid, model_id, "", None, delta=True)
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield sse(first)
            while True:
                item = await reply.queue.get()
                text = reply.ready(done=item is not None)
                if len(text) > sent:
                    yield sse(completion(kind, rid, model_id, text[sent:], None, delta=True))
                    sent = len(text)
                if item is None:
                    continue
                if item.finish_reason == "error":
                    yield sse({"error": {"message": f"the engine failed: {item.error}",
                                         "type": "server_error", "param": None,
                                         "code": "engine_error"}})
                else:
                    yield sse(completion(kind, rid, model_id, "", item.finish_reason,
                                         usage_of(item), delta=True))
                yield "data: [DONE]\n\n"
                return
        finally:
            if req.finish_reason is None:  # the client went away: free its row
                self.sched.cancel(req)

    async def models(self):
        return {"object": "list", "data": [{"id": self.model_id, "object": "model",
                                            "created": 0, "owned_by": "ssd"}]}

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


def make_app(engine: Engine, model_id: str, defaults, state: dict) -> FastAPI:
    """The HTTP side: API's endpoints at their paths."""
    api, app = API(engine, model_id, defaults, state), FastAPI(title="ssd serve")
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    app.get("/v1/models")(api.models)
    app.get("/health")(api.health)
    app.api_route("/metrics", methods=["GET", "HEAD"])(api.metrics)
    return app


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


# --------------------------------------------------------------------------------------------------
# The engine's thread and the command line

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
    g.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM / Ctrl-C, seconds in-flight requests get to finish "
                        "(default: %(default)s)")
    run.add_decoding_options(ap.add_argument_group("decoding (every request's defaults; "
                                                   "--max-new-tokens: max_tokens' default)"))
    run.add_algorithm_options(ap.add_argument_group("models and algorithm"))
    run.add_device_options(ap.add_argument_group("devices and memory"))
    return ap


def engine_config(a: argparse.Namespace) -> EngineConfig:
    """The engine of run.py's flags (--max-new-tokens: each request's default max_tokens)."""
    kw = run.generate_kwargs(a)
    if kw.pop("max_new_tokens") < 1:
        raise ValueError(f"--max-new-tokens={a.max_new_tokens} must be >= 1")
    if a.http_cores < 0:
        raise ValueError(f"--http-cores={a.http_cores} must be >= 0")
    return EngineConfig(**kw, reserve_cores=a.http_cores)


def main(argv=None):
    a = parser().parse_args(argv)
    try:
        engine = load_engine(engine_config(a), a.max_batch)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    # healthy: the models are up; down: the engine will not serve again; error: the last one
    state = {"healthy": True, "down": False, "error": None, "restarts": 0}
    stopping = threading.Event()
    thread = threading.Thread(target=run_engine, args=(engine, stopping, state), daemon=True)
    thread.start()
    app = make_app(engine, a.target, a, state)
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
