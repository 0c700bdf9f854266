"""serve.py as the tools people point at it see it (issue 53): the tiny pair, one SD server.

- the exact bodies guidellm 0.8.1 and aiperf 0.13.0 send (streaming and not, chat and
  completions; read from their sources: guidellm/backends/openai/request_handlers.py,
  aiperf/endpoints/openai_{completions,chat}.py): a 200, chunks of protocol.py's shapes, the usage
  chunk (`choices: []`) last;
- the openai SDK: models.retrieve, an unknown model (404 model_not_found), chat streaming with
  include_usage, a list of prompts (one choice each, `index` set, each the text it has alone);
- the inputs that were 500s (100,000-deep JSON, a 5,000-digit seed, a lone surrogate), a body over
  --max-body-mb, unknown paths and methods: each an error in OpenAI's shape, the server serving on;
- a bounded schemathesis run against the server's own /openapi.json: no 5xx, no response outside
  the schema;
- in process: --api-key (401 in OpenAI's shape), an unforeseen exception (a 500 in OpenAI's shape,
  one line in the log, the app still answering);
- ignore_eos and min_tokens in the engine, AR, SD and SSD: where a row stops, exactly.
"""
import json

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import protocol  # noqa: E402
from test_serve import Server  # noqa: E402

MAX_BODY_MB = 0.25


@pytest.fixture(scope="module")
def server():
    # a small KV cache (144 tokens a request at most) and 4 tokens by default: a fuzzed request
    # is a short answer, or a 400 at once
    s = Server("--mode", "sd", "--k", "3", "--kv-tokens", "160", "--max-new-tokens", "4",
               "--max-body-mb", str(MAX_BODY_MB))
    yield s
    assert s.stop() == 0


def sse_chunks(r) -> list[dict]:
    """A stream's chunks; it must end with [DONE]."""
    lines = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", r.text[-500:]
    return [json.loads(line) for line in lines[:-1]]


# guidellm 0.8.1 (TextCompletionsRequestHandler / ChatCompletionsRequestHandler.format, streaming,
# a fixed output length) and aiperf 0.13.0 (CompletionsEndpoint / ChatEndpoint.format_payload)
GUIDELLM_TEXT = {"model": "tiny", "stream": True,
                 "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                 "max_tokens": 12, "stop": None, "ignore_eos": True, "prompt": "def fib(n):"}
GUIDELLM_CHAT = {"model": "tiny", "stream": True,
                 "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                 "max_completion_tokens": 12, "stop": None, "ignore_eos": True,
                 "messages": [{"role": "system", "content": "You write Python."},
                              {"role": "user", "content": [{"type": "text", "text": "a sort"}]}]}
AIPERF_TEXT = {"prompt": "def fib(n):", "model": "tiny", "stream": True, "max_tokens": 12,
               "stream_options": {"include_usage": True}}
AIPERF_CHAT = {"messages": [{"role": "user", "content": "a sort"}], "model": "tiny",
               "stream": True, "max_completion_tokens": 12,
               "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", GUIDELLM_TEXT), ("/v1/chat/completions", GUIDELLM_CHAT),
    ("/v1/completions", AIPERF_TEXT), ("/v1/chat/completions", AIPERF_CHAT)],
    ids=["guidellm-text", "guidellm-chat", "aiperf-text", "aiperf-chat"])
def test_tool_bodies(server, path, body):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    chunks = sse_chunks(r)
    shape = protocol.Completion if "prompt" in body else protocol.ChatCompletionChunk
    for c in chunks:
        shape.model_validate(c)
    *content, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] >= 1
    assert content[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    continuous = body["stream_options"].get("continuous_usage_stats")
    assert all((c["usage"] is not None) == bool(continuous) for c in content)
    if body.get("ignore_eos"):  # guidellm fixes the output length: exactly max_tokens
        n = body.get("max_tokens") or body["max_completion_tokens"]
        assert last["usage"]["completion_tokens"] == n
        assert content[-1]["usage"] == last["usage"]  # continuous usage ends at the total
    # the same body without streaming (guidellm's and aiperf's non-streaming form)
    whole = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    r = httpx.post(server.url + path, json=whole, timeout=60)
    assert r.status_code == 200, r.text
    answer = (protocol.Completion if "prompt" in body else protocol.ChatCompletion)(**r.json())
    assert answer.usage.completion_tokens == last["usage"]["completion_tokens"]


def test_openai_sdk(server):
    client = server.client()
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=8,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])
    # a list of prompts: one choice each, in order, each the text the prompt has alone (greedy)
    prompts = ["def add(a, b):", "class Stack:"]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=8)
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=8).choices[0].text
             for p in prompts]
    assert [c.index for c in r.choices] == [0, 1] and [c.text for c in r.choices] == alone
    assert r.usage.completion_tokens == 16
    streamed = ["", ""]
    for c in client.completions.create(model="tiny", prompt=[[1, 5, 9], [1, 77]],
                                       max_tokens=6, stream=True):
        streamed[c.choices[0].index] += c.choices[0].text
    assert all(streamed)


def error_of(r, status) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_no_input_is_a_500(server):
    post = lambda content, path="/v1/completions": httpx.post(  # noqa: E731
        server.url + path, content=content, timeout=30)
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert error_of(post(deep), 400)["code"] == "invalid_json"
    assert error_of(post(b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}"), 400)
    assert error_of(post(b'{"prompt": "x", "seed": ' + b"9" * 30 + b"}"), 400)["param"] == "seed"
    assert error_of(post(b'{"prompt": "a\\ud800b"}'), 400)
    lone = b'{"messages": [{"role": "user", "content": "a\\udc00b"}]}'
    assert error_of(post(lone, "/v1/chat/completions"), 400)
    big = json.dumps({"prompt": "x" * int(MAX_BODY_MB * 2**20)}).encode()
    assert error_of(post(big), 413)["code"] == "request_too_large"
    assert error_of(httpx.get(server.url + "/v1/nowhere"), 404)["code"] == "not_found"
    assert error_of(httpx.delete(server.url + "/v1/models"), 405)["code"] == "method_not_allowed"
    # what OpenAI validates, and what it accepts
    bad = [({"messages": [{"role": "bogus", "content": "x"}]}, "messages[0].role"),
           ({"messages": [{"role": "user", "content": "x"}], "user": {}}, "user"),
           ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
               "url": "http://x"}}]}]}, "messages[0].content[0]"),
           ({"messages": [{"role": "user", "content": "x"}], "stream_options": {
               "include_usage": True}}, "stream_options"),
           ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2.5}, "max_tokens")]
    for body, param in bad:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert error_of(r, 400)["param"] == param, body
    ok = {"prompt": "x", "max_tokens": 3.0, "stream": None, "seed": None, "stop": None,
          "temperature": None, "user": None, "n": None, "stream_options": None}
    r = httpx.post(server.url + "/v1/completions", json=ok, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_schemathesis_finds_no_5xx_and_no_response_outside_the_schema(server):
    """Every operation of /openapi.json, 10 generated cases each (derandomized): the checks that
    the server never answers 5xx and answers with the status codes, content types and bodies its
    schema declares. (A body the schema allows may still be a 400: a field the engine cannot
    honour exactly at that value.)"""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import (content_type_conformance, not_a_server_error,
                                     response_schema_conformance, status_code_conformance)
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance]
    ran = 0
    for result in schema.get_all_operations():
        op = result.ok()

        @given(case=op.as_strategy())
        @settings(max_examples=10, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck), phases=["generate"])
        def check(case):
            nonlocal ran
            case.call_and_validate(checks=checks, timeout=30)
            ran += 1
        check()
    assert ran >= 6 * 5


# --------------------------------------------------------------------------------------------------
# In process: a stub engine behind the app

class BrokenTokenizer:
    chat_template = None

    def __call__(self, text):
        raise RuntimeError("the stub tokenizer broke")


class StubEngine:
    """Enough of an Engine for the HTTP side, with a tokenizer that fails as nothing foreseen
    does."""
    mode, K, scheduler, tokenizer = "ar", 0, None, BrokenTokenizer()
    config = type("Config", (), {"vocab_size": 100, "max_position_embeddings": 256})


def stub_app(**kw):
    import argparse
    import serve
    defaults = argparse.Namespace(max_new_tokens=4, max_body_mb=1.0)
    state = {"healthy": True, "down": False, "error": None, "restarts": 0}
    return serve.make_app(StubEngine, "stub", defaults, state, **kw)


def test_api_key_and_the_catch_all(capfd):
    from starlette.testclient import TestClient
    http = TestClient(stub_app(api_key="sesame"))
    err = error_of(http.get("/v1/models"), 401)
    assert err["code"] == "invalid_api_key"
    assert error_of(http.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401)
    key = {"Authorization": "Bearer sesame"}
    assert http.get("/v1/models", headers=key).json()["data"][0]["id"] == "stub"
    assert http.get("/health").status_code == 200  # open: a load balancer's probe has no key
    schema = http.get("/openapi.json").json()
    assert "HTTPBearer" in schema["components"]["securitySchemes"]
    # an exception nothing foresaw: a 500 in OpenAI's shape, one line in the log, no traceback
    capfd.readouterr()
    r = http.post("/v1/completions", json={"prompt": "x"}, headers=key)
    assert error_of(r, 500)["type"] == "server_error"
    log = capfd.readouterr().err.strip().splitlines()
    assert log == ["serve.py: POST /v1/completions: RuntimeError: the stub tokenizer broke"]
    assert http.get("/v1/models/stub", headers=key).status_code == 200  # still answering


# --------------------------------------------------------------------------------------------------
# ignore_eos and min_tokens: where a row stops

@pytest.fixture(scope="module")
def reference():
    """The tiny pair's greedy tokens for a prompt, 40 of them, EOS never ending them."""
    from run import generate
    return generate([1, 5, 9, 23], mode="ar", max_new_tokens=40, ignore_eos=True,
                    target_threads=1).tokens[0]


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_ignore_eos_and_min_tokens_stop_rows_exactly(mode, reference):
    """The tiny pair never emits its EOS early, so a token the greedy answer holds twice plays
    EOS (Output.eos). In one batch: a plain request stops at its first occurrence; ignore_eos
    runs to max_tokens; min_tokens = the first occurrence's length goes on past it and stops at
    the second. Each row's tokens are the reference's up to there, in every mode (the rule
    changes where a row stops, never which tokens are drawn)."""
    from draft import DraftSettings
    from engine import EngineConfig, load_engine
    from scheduler import Request
    R = reference
    eos = next(x for x in R if R.count(x) >= 2)
    first = R.index(eos)
    second = R.index(eos, first + 1)
    engine = load_engine(EngineConfig(
        target="tiny", draft="tiny-draft", mode=mode, temperature=0.0,
        spec=DraftSettings(K=3, fallback="neural"), seed=0, ignore_eos=False,
        parallel=False, target_device=None, draft_device=None, target_threads=1,
        draft_threads=None, kv_tokens=2048, target_devices=None, tp_timeout=60.0,
        dtype="float32", graphs=None), max_batch=4)
    try:
        engine.scheduler.out.eos = {eos}
        plain = Request([1, 5, 9, 23], 40)
        ignoring = Request([1, 5, 9, 23], 40, ignore_eos=True)
        at_least = Request([1, 5, 9, 23], 40, min_tokens=first + 1)
        for req in (plain, ignoring, at_least):
            engine.scheduler.submit(req)
        for _ in range(200):
            if not engine.scheduler.step() and not engine.scheduler.waiting:
                break
    finally:
        engine.started.stop()
    assert (plain.tokens, plain.finish_reason) == (R[:first + 1], "stop")
    assert (ignoring.tokens, ignoring.finish_reason) == (R, "length")
    assert (at_least.tokens, at_least.finish_reason) == (R[:second + 1], "stop")
