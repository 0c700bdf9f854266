"""serve.py through the official openai client and raw HTTP, on loopback: the tiny pair.

- exact under load: 9 greedy requests streaming at once, joining a running batch at different
  rounds, each return the tokens generate() gives for the prompt alone (fp32), for ar, sd and ssd;
- the API: chat and completions, streaming and not, /v1/models, /health;
- /metrics as a Prometheus scraper reads it (prometheus_client's parser): every family once with
  its type, histograms cumulative, the counters moved by what the responses say;
- bad input: each case a 400 in OpenAI's error shape, naming the field (an unknown model: 404;
  tests/test_openai_conformance.py has the rest of OpenAI's conformance);
- a client that disconnects mid-stream: its row leaves, the KV blocks return to their baseline,
  the other stream goes on unchanged;
- a full KV cache: requests wait in the queue and all finish exactly; one that could never fit is
  a 400;
- the speculator's process killed: the stream in flight ends with an error event, the server starts
  a new speculator and serves the next request in SSD, exactly; SIGTERM lets a stream in flight
  finish, then the server exits 0 and leaves no process behind.
"""
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from checkpoint import load_model  # noqa: E402
from run import generate  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MAX_NEW = 24
PROMPTS = [[1, 5, 9, 23], [1, 77, 300, 12, 8], [1, 4000, 17], [1, 42], [1, 9, 9, 9, 9, 100],
           [1, 250, 251, 252], [1, 3], [1, 1000, 2000, 3000], [1, 600, 7, 600]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """serve.py in a subprocess on a free loopback port; stopped by SIGTERM."""

    def __init__(self, *flags):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "serve.py"), "--port", str(self.port),
             "--max-new-tokens", str(MAX_NEW), *flags], cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            assert self.proc.poll() is None, self.proc.stdout.read()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise AssertionError("serve.py did not become healthy in 120 s")

    def metrics(self) -> dict:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=120,
                             max_retries=0)

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@pytest.fixture(scope="module", params=["ar", "sd", "ssd"])
def server(request):
    s = Server("--mode", request.param, "--k", "3")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def target():
    return load_model("tiny")  # (model, tokenizer), loaded once for the references


def alone_text(target, prompt, max_new_tokens) -> str:
    """What generate() gives the prompt alone (greedy, fp32; sd and ssd match ar exactly)."""
    model, tok = target
    return generate(prompt, target=model, tokenizer=tok, mode="ar",
                    max_new_tokens=max_new_tokens).text[0]


@pytest.fixture(scope="module")
def alone(target):
    return [alone_text(target, p, MAX_NEW - i) for i, p in enumerate(PROMPTS)]


def stream_text(client, prompt, max_tokens, delay=0.0) -> str:
    time.sleep(delay)
    chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                       stream=True)
    return "".join(c.choices[0].text for c in chunks)


def test_exact_under_load(server, alone):
    """9 concurrent streams, started at different rounds: each has the text it has alone."""
    client, texts = server.client(), [None] * len(PROMPTS)

    def one(i):
        texts[i] = stream_text(client, PROMPTS[i], MAX_NEW - i, delay=0.05 * i)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert texts == alone
    m = server.metrics()
    assert m['ssd_kv_blocks_used{cache="target"}'] == 0 and m["ssd_num_requests_running"] == 0
    # every prompt looked up in the prefix cache
    looked = m['ssd_prefix_cache_queries_total{cache="target"}']
    assert sum(map(len, PROMPTS)) <= looked
    assert m['ssd_prefix_cache_hits_total{cache="target"}'] < looked


def test_bench_serve_reads_a_rows_counters_from_metrics(server, alone):
    """bench_serve's per-row counters, read from this server's /metrics before and after a
    request: what the engine's own counters say, in their ranges (AR has no proposal, SD no
    speculation cache)."""
    import bench_serve
    before = bench_serve.server_counters(server.url)
    assert stream_text(server.client(), PROMPTS[0], MAX_NEW) == alone[0]
    after = bench_serve.server_counters(server.url)
    f = bench_serve.counter_figures(before, after)
    m = server.metrics()
    looked = 'ssd_prefix_cache_queries_total{cache="target"}'
    assert after["prefix_looked"] == m[looked] and 0 <= f["prefix_hit_rate"] <= 1
    mode = server.proc.args[server.proc.args.index("--mode") + 1]
    if mode == "ar":
        assert f["tokens_per_round"] is f["accept"] is f["cache_hit_rate"] is None
        return
    rounds = after["drafts"] - before["drafts"]
    assert rounds >= 1 and after["accepted"] == m["ssd_spec_decode_num_accepted_tokens_total"]
    assert 1 <= f["tokens_per_round"] <= 4 and 0 <= f["accept"] <= 1  # K = 3
    assert f["tokens_per_round"] == 1 + (after["accepted"] - before["accepted"]) / rounds
    assert (f["cache_hit_rate"] is None) == (mode == "sd")
    if mode == "ssd":
        hits = after["cache_hits"] - before["cache_hits"]
        assert f["cache_hit_rate"] == hits / (hits + after["cache_misses"] - before["cache_misses"])


def test_openai_client(server, alone):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_NEW)
    assert r.choices[0].text == alone[0] and r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == len(PROMPTS[0])
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=12)
    text = chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 12
    streamed = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=12,
        stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["mode"] in ("ar", "sd", "ssd")


def test_stop_string(server, alone):
    """A stop string ends the request where it first appears; the text stops before it."""
    stop = alone[0][5:8]
    r = server.client().completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_NEW,
                                           stop=stop)
    assert r.choices[0].text == alone[0][:alone[0].find(stop)]
    assert r.choices[0].finish_reason == "stop"


BAD = [  # (body or raw bytes, the param the error names)
    (b'{"prompt": "x"', None),                                     # malformed JSON
    ({"prompt": "x", "max_tokens": "10"}, "max_tokens"),           # wrong type
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": [1] * 2100}, "prompt"),                            # longer than the context
    ({"prompt": "x", "max_tokens": 5000}, "max_tokens"),           # beyond the context
    ({"prompt": "x", "top_p": 0.5}, "top_p"),                      # cannot be honoured exactly
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "logprobs": 2}, "logprobs"),
    ({"prompt": "x", "logprobs": 0}, "logprobs"),                  # 0: the sampled tokens' ones
    ({"prompt": "x", "temperature": 2.5}, "temperature"),          # outside 0..2
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "seed": 1.5}, "seed"),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
]


def test_per_request_temperature_and_seed(server, alone):
    """Requests bring their own temperature and seed. Two streams at T = 1 with the same seed,
    started at different rounds beside greedy streams and an unseeded T = 0.7 one, have the same
    text (AR and SD; SSD with this server's `auto` fallback may propose from the n-gram backup,
    which depends on the batch: tests/test_row_seeds.py has SSD's case); another seed, another
    text. The greedy streams beside them keep the text they have alone (every mode)."""
    client, mode = server.client(), httpx.get(server.url + "/health").json()["mode"]
    texts = {}

    def one(name, prompt, max_tokens, delay, **kw):
        time.sleep(delay)
        chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                           stream=True, **kw)
        texts[name] = "".join(c.choices[0].text for c in chunks)

    jobs = [("seeded", PROMPTS[0], MAX_NEW, 0.0, dict(temperature=1.0, seed=7)),
            ("greedy1", PROMPTS[1], MAX_NEW - 1, 0.02, {}),
            ("warm", PROMPTS[3], MAX_NEW, 0.04, dict(temperature=0.7)),
            ("again", PROMPTS[0], MAX_NEW, 0.1, dict(temperature=1.0, seed=7)),
            ("greedy2", PROMPTS[2], MAX_NEW - 2, 0.15, dict(temperature=0))]
    threads = [threading.Thread(target=one, args=job[:4], kwargs=job[4]) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert texts["greedy1"] == alone[1] and texts["greedy2"] == alone[2]
    assert texts["seeded"] and texts["warm"]
    if mode != "ssd":
        assert texts["again"] == texts["seeded"]
    one("other", PROMPTS[0], MAX_NEW, 0.0, temperature=1.0, seed=8)
    assert texts["other"] != texts["seeded"]


def test_bad_input(server):
    for body, param in BAD:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(server.url + "/v1/completions", content=content, timeout=10)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": "hi"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model="tiny", prompt="x", top_p=0.5)


def test_bad_requests_change_no_good_stream(server, alone):
    """1,000 bad requests (every case of BAD in turn) sent while 4 greedy streams run: each is a
    400, and the streams' texts are the ones they have alone. SSD only (the one with a second
    process to disturb): the other modes answer bad input by the same code."""
    if httpx.get(server.url + "/health").json()["mode"] != "ssd":
        pytest.skip("ssd's server carries this one")
    client, texts, codes = server.client(), [None] * 4, []

    def good(i):
        texts[i] = stream_text(client, PROMPTS[i], MAX_NEW - i, delay=0.05 * i)

    def bad():
        with httpx.Client(base_url=server.url, timeout=10) as http:
            for k in range(1000):
                body, _ = BAD[k % len(BAD)]
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                codes.append(http.post("/v1/completions", content=content).status_code)
    threads = [threading.Thread(target=good, args=(i,)) for i in range(4)]
    threads.append(threading.Thread(target=bad))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert texts == alone[:4]
    assert codes == [400] * 1000


def test_disconnect_frees_its_row(server, alone):
    """A stream closed after two chunks leaves within a round: the KV blocks return to their
    baseline; a stream running beside it is unchanged."""
    base = server.metrics()
    other = {}
    t = threading.Thread(target=lambda: other.update(
        text=stream_text(server.client(), PROMPTS[1], MAX_NEW - 1)))
    t.start()
    body = {"prompt": PROMPTS[2], "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
    assert any(line.startswith("data: ") for line in got)
    t.join(timeout=120)
    assert other["text"] == alone[1]
    m = idle_metrics(server)
    for cache in ("target", "draft"):
        key = f'ssd_kv_blocks_used{{cache="{cache}"}}'
        assert m.get(key) == base.get(key), (cache, m)
    key = 'ssd_requests_finished_total{finished_reason="cancelled"}'
    assert m[key] == base[key] + 1 and m["ssd_requests_total"] == base["ssd_requests_total"] + 2


def test_a_whole_answer_whose_client_left_is_cancelled(server):
    """A request that is not streamed, its client gone before the answer (a timeout): its row
    leaves (within a second), instead of decoding on to max_tokens."""
    base = server.metrics()
    body = {"prompt": PROMPTS[2], "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.5)
    m = idle_metrics(server)
    assert m["ssd_num_requests_running"] == 0, m
    key = 'ssd_requests_finished_total{finished_reason="cancelled"}'
    assert m[key] == base[key] + 1, m
    assert m["ssd_generation_tokens_total"] - base["ssd_generation_tokens_total"] < 2000, m


def idle_metrics(server) -> dict:
    """/metrics once no request runs or waits (within 30 s)."""
    deadline = time.time() + 30
    while time.time() < deadline:
        m = server.metrics()
        if m["ssd_num_requests_running"] == m["ssd_num_requests_waiting"] == 0:
            break
        time.sleep(0.1)
    return m


PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
FAMILIES = {  # name as the parser gives it (a counter's without _total) -> type
    "ssd_requests": "counter", "ssd_requests_finished": "counter",
    "ssd_num_requests_running": "gauge", "ssd_num_requests_waiting": "gauge",
    "ssd_prompt_tokens": "counter", "ssd_generation_tokens": "counter",
    "ssd_time_to_first_token_seconds": "histogram", "ssd_inter_token_latency_seconds": "histogram",
    "ssd_e2e_request_latency_seconds": "histogram", "ssd_rounds": "counter",
    "ssd_engine_restarts": "counter", "ssd_kv_blocks_used": "gauge", "ssd_kv_blocks_free": "gauge",
    "ssd_prefix_cache_queries": "counter", "ssd_prefix_cache_hits": "counter"}
SPEC_FAMILIES = {"ssd_spec_decode_num_drafts": "counter",
                 "ssd_spec_decode_num_draft_tokens": "counter",
                 "ssd_spec_decode_num_accepted_tokens": "counter",
                 "ssd_spec_decode_num_accepted_tokens_per_pos": "counter"}
CACHE_FAMILIES = {"ssd_spec_cache_hits": "counter", "ssd_spec_cache_misses": "counter"}


def scrape(server) -> dict:
    """/metrics through prometheus_client's parser: {family: its samples}, no family twice."""
    parser = pytest.importorskip("prometheus_client.parser")
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"] == PROMETHEUS_TEXT
    fams = list(parser.text_string_to_metric_families(r.text))
    assert len({f.name for f in fams}) == len(fams), [f.name for f in fams]
    return {f.name: f for f in fams}


def value(fams, family, suffix="_total", **labels) -> float:
    """The sum of a family's samples named family + suffix whose labels include `labels`."""
    return sum(s.value for s in fams[family].samples if s.name == family + suffix
               and labels.items() <= s.labels.items())


def test_metrics_a_scraper_reads(server):
    """After two requests answered whole (completion, chat) and one streamed: /metrics is
    Prometheus' text (its content type; HEAD answered), each family once with its type and the
    mode's families only; each histogram cumulative up to +Inf = its count; no counter went
    down; prompt and generation tokens moved by the responses' usage, one time to first token
    and one end-to-end latency per request, one inter-token latency per token after the first;
    acceptance and SSD's cache lookups add up."""
    before = scrape(server)
    client, mode = server.client(), httpx.get(server.url + "/health").json()["mode"]
    r = client.completions.create(model="tiny", prompt="def fib(n):", max_tokens=8)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=8)
    usage = [(x.usage.prompt_tokens, x.usage.completion_tokens) for x in (r, chat)]
    chunks = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8,
                                       stream=True)
    reasons = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert reasons == ["length"]  # so it has 8 tokens
    usage.append((len(PROMPTS[0]), 8))
    idle_metrics(server)
    after = scrape(server)
    head = httpx.head(server.url + "/metrics", timeout=10)
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == PROMETHEUS_TEXT

    want = {**FAMILIES, **(SPEC_FAMILIES if mode != "ar" else {}),
            **(CACHE_FAMILIES if mode == "ssd" else {})}
    assert {name: f.type for name, f in after.items()} == want
    for name, f in after.items():
        if f.type == "histogram":
            buckets = [(float(s.labels["le"]), s.value) for s in f.samples
                       if s.name == name + "_bucket"]
            les, counts = zip(*buckets)
            assert list(les) == sorted(les) and les[-1] == float("inf"), name
            assert list(counts) == sorted(counts), name
            assert counts[-1] == value(after, name, "_count") and value(after, name, "_sum") >= 0
        if f.type == "counter":
            for s in f.samples:
                old = [o.value for o in before[name].samples if o.labels == s.labels]
                assert s.value >= max(old, default=0), (name, s)

    def moved(family, suffix="_total", **labels):
        return value(after, family, suffix, **labels) - value(before, family, suffix, **labels)
    n, prompt_tokens, tokens = len(usage), sum(p for p, _ in usage), sum(c for _, c in usage)
    assert moved("ssd_requests") == n
    assert moved("ssd_requests_finished", finished_reason="stop") + moved(
        "ssd_requests_finished", finished_reason="length") == moved("ssd_requests_finished") == n
    assert moved("ssd_prompt_tokens") == prompt_tokens
    assert moved("ssd_generation_tokens") == tokens
    assert moved("ssd_time_to_first_token_seconds", "_count") == n
    assert moved("ssd_e2e_request_latency_seconds", "_count") == n
    assert moved("ssd_inter_token_latency_seconds", "_count") == tokens - n
    assert moved("ssd_inter_token_latency_seconds", "_sum") > 0 and moved("ssd_rounds") > 0
    assert value(after, "ssd_num_requests_running", "") == 0
    assert value(after, "ssd_kv_blocks_used", "") == 0  # every cache's
    if mode == "ar":
        return
    drafts, accepted = moved("ssd_spec_decode_num_drafts"), after[
        "ssd_spec_decode_num_accepted_tokens_per_pos"].samples
    assert drafts > 0 and moved("ssd_spec_decode_num_draft_tokens") == 3 * drafts  # --k 3
    assert moved("ssd_spec_decode_num_accepted_tokens") <= 3 * drafts
    per_pos = [s.value for s in sorted(accepted, key=lambda s: int(s.labels["position"]))]
    assert len(per_pos) == 3 and per_pos == sorted(per_pos, reverse=True)
    assert sum(per_pos) == value(after, "ssd_spec_decode_num_accepted_tokens")
    if mode == "ssd":  # every row-round of SSD looked its outcome up
        assert moved("ssd_spec_cache_hits") + moved("ssd_spec_cache_misses") == drafts


def test_kv_full_waits(target):
    """A cache that holds two requests at a time: six wait their turn and all finish exactly;
    one that could never fit is refused with a 400."""
    s = Server("--mode", "ar", "--kv-tokens", "144")
    try:
        client, texts = s.client(), [None] * 6

        def one(i):
            texts[i] = client.completions.create(model="tiny", prompt=PROMPTS[i],
                                                 max_tokens=40).choices[0].text
        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert texts == [alone_text(target, p, 40) for p in PROMPTS[:6]]
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 200})
        assert r.status_code == 400 and r.json()["error"]["code"] == "kv_cache_too_small"
    finally:
        assert s.stop() == 0


def test_generate_from_threads_in_a_fresh_process():
    """generate() called from 8 threads at once, first thing in a process, returns in each what
    it returns sequentially (transformers' lazy imports once raced here)."""
    code = """
import threading
from run import generate
out = [None] * 8
def one(i):
    out[i] = generate([1, 5, 9 + i], mode="ar", max_new_tokens=8, target_threads=1).tokens[0]
threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
assert out == [generate([1, 5, 9 + i], mode="ar", max_new_tokens=8).tokens[0] for i in range(8)]
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_the_server_builds_generates_engine(monkeypatch):
    """serve.py's engine is generate()'s (engine.py): EngineConfig holds generate()'s parameters less
    the request's (the draft's settings as one object, draft.DraftSettings), every run.py flag reaches
    it, and the server's engine gets what generate()'s does: the CPU product forms for its verifier's
    rows b (K + 1), b <= --max-batch, the draft read over the target's vocabulary (a padded draft),
    and --fixed-budget."""
    import dataclasses
    import inspect
    import draft
    import engine
    import serve
    fields = {f.name for f in dataclasses.fields(engine.EngineConfig) if f.init}
    request = {"prompts", "max_new_tokens", "chat", "stream", "tokenizer"}
    spec = {f.name for f in dataclasses.fields(draft.DraftSettings)} - {"K", "fast_fallback"}
    given = set(inspect.signature(generate).parameters) - request - spec - {"k", "draft_settings"}
    assert fields - {"reserve_cores", "spec"} == given
    cfg = serve.engine_config(serve.parser().parse_args(["--fixed-budget", "--budget", "3", "--k", "2",
                                                         "--confidence", "0.25"]))
    assert cfg.mode == "ssd" and cfg.spec.fixed_budget and cfg.spec.budget == 3 and cfg.K == 2
    assert cfg.spec.confidence == 0.25
    rows, drafts = [], []
    real_draft = engine.load_draft
    monkeypatch.setattr(engine, "use_forms", lambda model, r: rows.append(list(r)))  # recorded, not timed
    monkeypatch.setattr(draft, "use_forms", lambda model, r: None)
    monkeypatch.setattr(engine, "load_draft", lambda c, **kw: drafts.append(c) or real_draft(c, **kw))
    eng = engine.load_engine(serve.engine_config(serve.parser().parse_args(["--mode", "sd", "--k", "4"])),
                             max_batch=4)
    try:
        assert rows == [[5, 10, 15]]  # 4 rows x 5 tokens = 20 is past cpu_linear.ROWS: plain
        assert drafts[0].vocab_size == eng.config.vocab_size and eng.scheduler.max_batch == 4
    finally:
        eng.started.stop()


def test_http_cores_are_left_to_the_http_side(monkeypatch):
    """--http-cores N: the engine's threads take the other cores (a target computing on every core
    stalls whenever the event loop or a client runs); SSD's sides still poll where each has a core."""
    import engine
    import serve
    monkeypatch.setattr(engine.os, "cpu_count", lambda: 4)

    def placed(*flags):
        return engine.place(serve.engine_config(serve.parser().parse_args(list(flags))))
    assert placed("--mode", "sd").target_threads == 3  # default: one core for HTTP
    assert placed("--mode", "sd", "--http-cores", "0").target_threads == 4
    where = placed("--mode", "ssd")
    assert (where.target_threads, where.draft_threads, where.cores) == (2, 1, 4)
    assert placed("--mode", "ar", "--http-cores", "9").target_threads == 1  # never below one
    with pytest.raises(ValueError, match="--http-cores=-1 must be >= 0"):
        placed("--http-cores", "-1")


def test_cpu_tensor_parallel_ranks_share_the_cores(monkeypatch):
    """--target-devices cpu,cpu: each rank takes its share of the cores (each took them all: 2 x 4
    threads on 4 cores, with no warning); a --target-threads given is each rank's, and warned about
    counting every rank."""
    import engine
    import serve
    monkeypatch.setattr(engine.os, "cpu_count", lambda: 4)

    def placed(*flags):
        return engine.place(serve.engine_config(serve.parser().parse_args(
            ["--http-cores", "0", "--target-devices", "cpu,cpu", *flags])))
    assert placed("--mode", "sd").target_threads == 2
    assert placed("--mode", "ar").target_threads == 2
    with pytest.warns(UserWarning, match=r"2 ranks x 3 target \+ 0 draft threads on 4 cores"):
        assert placed("--mode", "ar", "--target-threads", "3").target_threads == 3


def test_a_server_with_no_room_is_refused_before_loading():
    """--max-batch 0 would serve nothing (requests queued for good behind a healthy /health);
    --kv-tokens 0 holds no block: both refused in one line, before a model loads."""
    import engine
    import serve

    def load(*flags, max_batch=4):
        return engine.load_engine(serve.engine_config(serve.parser().parse_args(list(flags))),
                                  max_batch)
    with pytest.raises(ValueError, match="max_batch=0: .* --max-batch >= 1"):
        load(max_batch=0)
    with pytest.raises(ValueError, match="kv_tokens=0 holds no KV block"):
        load("--kv-tokens", "0")
    with pytest.raises(ValueError, match="--port 99999: give a port in 0..65535"):
        load("--port", "99999")



def test_a_default_max_tokens_past_the_context_is_refused_at_start(capsys):
    """--max-new-tokens is every request's default max_tokens: past the context, every request
    that leaves max_tokens out would be refused; the server refuses to start, its speculator
    stopped."""
    import serve
    import torch.multiprocessing as mp
    assert serve.main(["--max-new-tokens", "100000", "--mode", "ssd"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: --max-new-tokens=100000 exceeds the context of 2048 tokens"
    assert not mp.active_children()


def speculator_pid(server_pid: int) -> int:
    """The server's speculator: its child process started by multiprocessing's spawn (not the
    resource tracker)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int(proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = proc.joinpath("cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid == server_pid and b"multiprocessing" in cmd and b"resource_tracker" not in cmd:
            return int(proc.name)
    raise AssertionError(f"no speculator process under {server_pid}")


def wait_health(s: Server, ok, timeout=60) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        body = httpx.get(s.url + "/health", timeout=5).json()
        if ok(body):
            return body
        time.sleep(0.2)
    raise AssertionError(f"/health never got there: {body}")


def test_speculator_killed_then_sigterm(target, alone):
    """SSD in two processes. The speculator killed mid-stream: that stream ends with an error
    event, /health reports the restart, the next request is served in SSD again with exactly the
    tokens it has alone. Then SIGTERM with a stream in flight: it finishes, the server exits 0
    and leaves no process behind."""
    s = Server("--mode", "ssd", "--k", "3", "--grace", "30")
    client = s.client()
    old = speculator_pid(s.proc.pid)
    stream = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=200,
                                       stream=True)
    with pytest.raises(openai.APIError, match="engine failed"):
        for i, _ in enumerate(stream):
            if i == 1:
                os.kill(old, 9)
    body = wait_health(s, lambda b: b["status"] == "ok" and b["restarts"] == 1)
    assert body["mode"] == "ssd" and "speculator" in body["error"], body
    new = speculator_pid(s.proc.pid)
    assert new != old
    hits = s.metrics()["ssd_spec_cache_hits_total"]
    text = client.completions.create(model="tiny", prompt=PROMPTS[1],
                                     max_tokens=MAX_NEW - 1).choices[0].text
    assert text == alone[1]
    assert s.metrics()["ssd_spec_cache_hits_total"] > hits  # SSD again: the new speculator's cache hits
    # SIGTERM while a request streams: it finishes (within --grace), then the server exits 0
    got = []
    t = threading.Thread(target=lambda: got.append(stream_text(client, PROMPTS[2], MAX_NEW - 2)))
    t.start()
    time.sleep(0.5)
    s.proc.terminate()
    t.join(timeout=60)
    assert got == [alone[2]]
    assert s.proc.wait(timeout=60) == 0
    assert not Path(f"/proc/{new}").exists() or b"zombie" in Path(f"/proc/{new}/status").read_bytes()


@pytest.mark.parametrize("flag", ["--port", "--host"])
def test_a_port_in_use_or_an_unknown_host_is_refused_before_loading(flag, capsys, monkeypatch):
    """Loading takes minutes for a large model: a port the server could not listen on, or a host
    that does not resolve, is one line before it, not after."""
    import serve
    monkeypatch.setattr(serve, "load_engine", lambda *a: pytest.fail("the models were loaded"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["--port", str(port)] if flag == "--port" else ["--host", "no-such-host.invalid"]
        assert serve.main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    where = f"127.0.0.1:{port}" if flag == "--port" else "no-such-host.invalid:8000"
    assert err.startswith(f"error: cannot listen on {where} (") and "--port or --host" in err
