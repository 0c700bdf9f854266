"""Load on an OpenAI-compatible server: ours (serve.py, AR / SD / SSD) and transformers' own.

    python bench_serve.py --servers ar,sd,ssd,hf --clients 1,8 --requests 16 --max-tokens 64

For each server: start it on a free port of 127.0.0.1, wait for /health, warm it up, then for each
client count c send --requests streaming completions whose arrivals are a Poisson process of
--rate requests a second (0: all at once), with at most c in flight. Reported per (server, c):

    output tok/s    all output tokens over the wall time from the first request to the last token
    TTFT            time to first token, p50 / p99 over requests
    ITL             inter-token latency, p50 / p99 over tokens: a chunk of k tokens that came g
                    seconds after the previous one counts k gaps of g / k (SD and SSD send a round's
                    tokens together; this charges each of them its share of the wait)
    decode tok/s    per request, tokens after the first over the time from the first to the last
                    (its median), the figure to compare with run.py's decode_tok_s
    tok/round       SD and SSD: tokens a row-round, 1 + draft tokens accepted / row-rounds
    accept          SD and SSD: draft tokens accepted / proposed
    cache hits      SSD: rounds whose outcome the speculator had guessed / rounds
    prefix hits     the prompt tokens the target's prefix cache found, of those it looked up, over
                    the run (prefix caching is off with -- --no-prefix-caching)
The last four are the growth of serve.py's /metrics counters over the row.

Workloads for prefix caching: --shared-prefix N starts every prompt with the same system prompt of
N tokens (the start of Python's argparse.py, code the tiny pair knows); --turns T makes each
request a conversation of T turns, each turn's prompt the previous one, its answer and the next
question (a conversation's turns go one after another; a turn counts as a request in the figures).

Third-party load generators: --tool guidellm,aiperf (with own, bench_serve's clients above) runs
each named tool against every server started, in turn for each client count: `clients` streams,
--requests requests of --prompt-tokens synthetic prompt tokens and exactly --max-tokens output
tokens (ignore_eos), the tool's tokenizer the target's own. The row's figures are read from the
tool's JSON report (guidellm's --output json, aiperf's profile_export_aiperf.json): output tok/s,
TTFT p50 / p99 and ITL p50 / p99 as the tool computes them (both take a request's ITL as its
decode time over its tokens after the first: a per-request mean, not per-token gaps as above).
Neither is a dependency of the engine: install them apart, e.g.
    python3 -m venv ~/tools-venv && ~/tools-venv/bin/pip install guidellm==0.8.1 aiperf==0.13.0
and pass --tool-bin ~/tools-venv. Their reports stay in --log-dir.

"hf" is `transformers serve --continuous-batching` on the same target (float32, the CPU). Tokens
are counted by re-tokenising each answer with the target's tokenizer, the same for every server.
Only loopback addresses are used; every request has a timeout and every loop a bound.
"""
import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent
DEFAULT_PROMPTS = ["def merge_sorted(a, b):", "class LRUCache:\n    def __init__(self, capacity):",
                   "import os\n\ndef walk_files(root):", "def parse_args(argv):",
                   "def fibonacci(n):", "class Stack:\n    def __init__(self):"]
# the load generators --tool can run, with the versions docs/benchmarks.md measured
TOOL_PINS = {"guidellm": "guidellm==0.8.1", "aiperf": "aiperf==0.13.0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(kind: str, a, port: int) -> list[str]:
    """The command line that serves a.target on port: ours in `kind` mode, or transformers'."""
    if kind == "hf":
        return ["transformers", "serve", "--continuous-batching", "--device", "cpu", "--dtype",
                "float32", "--host", "127.0.0.1", "--port", str(port), a.hf_model or a.target]
    cmd = [sys.executable, str(REPO / "serve.py"), "--target", a.target, "--mode", kind,
           "--host", "127.0.0.1", "--port", str(port)] + (["--k", str(a.k)] if a.k else [])
    return cmd + (["--draft", a.draft] if kind != "ar" else []) + a.serve_args


def percentile(xs, p):
    """The nearest-rank p-th percentile: the smallest x with at least p% of xs at or below it."""
    xs = sorted(xs)
    return xs[min(len(xs), max(1, math.ceil(p / 100 * len(xs)))) - 1] if xs else float("nan")


async def stream_one(client, url, body, timeout):
    """One streaming request -> (sent, [(arrival time, text)] of its chunks)."""
    sent, chunks = time.perf_counter(), []
    async with client.stream("POST", url, json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            choice = (json.loads(line[5:]).get("choices") or [{}])[0]
            text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if text:
                chunks.append((time.perf_counter(), text))
    return sent, chunks


def shared_prefix(tok, n: int) -> str:
    """A system prompt of n tokens of the target's tokenizer: the start of argparse.py."""
    import argparse as source
    ids = tok.encode(Path(source.__file__).read_text(), add_special_tokens=False)[:n]
    return tok.decode(ids)


async def run_load(base, model, prompts, clients, requests, rate, max_tokens, seed, chat=False,
                   timeout=600, system="", turns=1):
    """Send `requests` conversations of `turns` completions each (Poisson arrivals, at most
    `clients` in flight), every prompt after the `system` prompt; chat: as chat completions, each
    prompt the user's message. -> (start, [(sent, chunks)] of every turn)."""
    import httpx
    rng = random.Random(seed)
    gate = asyncio.Semaphore(clients)
    url = f"{base}/v1/chat/completions" if chat else f"{base}/v1/completions"

    def body(history):
        """history: the conversation's (question, answer) turns, the last answer None."""
        if chat:
            text = {"messages": ([{"role": "system", "content": system}] if system else []) + [
                {"role": role, "content": x} for q, a in history
                for role, x in (("user", q), ("assistant", a)) if x is not None]}
        else:
            text = {"prompt": system + "".join(q + (a + "\n\n" if a is not None else "")
                                               for q, a in history)}
        return {"model": model, **text, "max_tokens": max_tokens, "temperature": 0,
                "stream": True}

    async def one(i, delay):
        await asyncio.sleep(delay)
        async with gate:
            history, out = [], []
            for k in range(turns):
                history.append((prompts[(i + k) % len(prompts)], None))
                out.append(await stream_one(client, url, body(history), timeout))
                history[-1] = (history[-1][0], "".join(text for _, text in out[-1][1]))
            return out

    delays, t = [], 0.0
    for _ in range(requests):
        delays.append(t)
        t += rng.expovariate(rate) if rate > 0 else 0.0
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(i, d) for i, d in enumerate(delays)))
    return start, [turn for conversation in results for turn in conversation]


def summarise(start, results, count_tokens) -> dict:
    ttft, itl, decode, total, end = [], [], [], 0, start
    for sent, chunks in results:
        if not chunks:
            continue
        ttft.append(chunks[0][0] - sent)
        # a chunk's tokens, re-tokenised alone, share out its wait; the answer's tokens are counted
        # whole (a chunk of several tokens can re-tokenise into fewer: BPE merges across them)
        counts = [count_tokens(text) for _, text in chunks]
        n = count_tokens("".join(text for _, text in chunks))
        total += n
        for (t_prev, _), (t_now, _), k in zip(chunks, chunks[1:], counts[1:]):
            itl += [(t_now - t_prev) / max(k, 1)] * max(k, 1)
        if n > counts[0] and chunks[-1][0] > chunks[0][0]:
            decode.append((n - counts[0]) / (chunks[-1][0] - chunks[0][0]))
        end = max(end, chunks[-1][0])
    ms = lambda xs, p: 1000 * percentile(xs, p)
    return {"output_tok_s": total / (end - start) if end > start else 0.0, "tokens": total,
            "ttft_ms_p50": ms(ttft, 50), "ttft_ms_p99": ms(ttft, 99),
            "itl_ms_p50": ms(itl, 50), "itl_ms_p99": ms(itl, 99),
            "decode_tok_s_median": statistics.median(decode) if decode else 0.0}


# serve.py's /metrics counters (metrics.py) a row's figures are read from, before and after it
COUNTERS = {"prefix_looked": 'ssd_prefix_cache_queries_total{cache="target"}',
            "prefix_found": 'ssd_prefix_cache_hits_total{cache="target"}',
            "drafts": "ssd_spec_decode_num_drafts_total",  # row-rounds that verified a proposal
            "proposed": "ssd_spec_decode_num_draft_tokens_total",
            "accepted": "ssd_spec_decode_num_accepted_tokens_total",
            "cache_hits": "ssd_spec_cache_hits_total",
            "cache_misses": "ssd_spec_cache_misses_total"}


def server_counters(base) -> dict:
    """COUNTERS' values now (those the server has: AR has no drafts, SD no cache)."""
    import httpx
    values = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        sample, _, value = line.rpartition(" ")
        values[sample] = value
    return {k: float(values[m]) for k, m in COUNTERS.items() if m in values}


def counter_figures(before: dict, after: dict) -> dict:
    """A row's figures from the counters' growth over it: the target's prefix cache hits (prompt
    tokens found / looked up), tokens a row-round (1 + accepted / row-rounds), draft tokens
    accepted / proposed, SSD's speculation cache hits / rounds. None where the server has none."""
    d = {k: after[k] - before[k] for k in after.keys() & before.keys()}
    ratio = lambda num, den: d[num] / d[den] if d.get(den) else None
    rounds = d.get("cache_hits", 0) + d.get("cache_misses", 0)
    hits = d["cache_hits"] / rounds if rounds else None
    per_round = ratio("accepted", "drafts")
    return {"prefix_hit_rate": ratio("prefix_found", "prefix_looked"),
            "tokens_per_round": None if per_round is None else 1 + per_round,
            "accept": ratio("accepted", "proposed"), "cache_hit_rate": hits}


def tool_executable(tool: str, tool_bin: str | None) -> str:
    """`tool`'s executable: in tool_bin (a virtual environment, a folder of executables or the
    executable itself), else on PATH; missing: a one-line exit naming how to install it."""
    p = Path(tool_bin).expanduser() if tool_bin else None
    on_path = shutil.which(tool)
    candidates = [p / "bin" / tool, p / tool, p] if p else [Path(on_path)] if on_path else []
    found = [str(x) for x in candidates
             if x.name == tool and x.is_file() and os.access(x, os.X_OK)]
    if not found:
        raise SystemExit(f"--tool {tool}: no {tool} executable in {tool_bin or 'PATH'}; install "
                         f"it apart from the engine: python3 -m venv ~/tools-venv && "
                         f"~/tools-venv/bin/pip install {TOOL_PINS[tool]}, then --tool-bin "
                         f"~/tools-venv")
    return found[0]


def guidellm_command(exe, a, base, model, clients, seed, out: Path) -> list[str]:
    """guidellm run: `clients` concurrent streams, a.requests requests of synthetic text (it
    asks for exactly output_tokens: ignore_eos), its JSON report in out/guidellm.json."""
    route = "/v1/chat/completions" if a.chat else "/v1/completions"
    return [exe, "run", "--backend",
            f"kind=openai_http,target={base},model={model},request_format={route}",
            "--profile", f"kind=concurrent,streams={clients}",
            "--constraint", f"kind=max_requests,count={a.requests}",
            "--data", f"kind=synthetic_text,prompt_tokens={a.prompt_tokens},"
                      f"output_tokens={a.max_tokens}",
            "--tokenizer", f"kind=hf_auto,model={a.tokenizer}",
            "--seed", f"kind=static,value={seed}",
            "--output", f"kind=json,path={out / 'guidellm.json'}", "--disable-console-interactive"]


def aiperf_command(exe, a, base, model, clients, seed, out: Path) -> list[str]:
    """aiperf profile: the same load (ignore_eos sent as an extra input), its artifacts in out."""
    return [exe, "profile", "--model", model, "--url", base,
            "--endpoint-type", "chat" if a.chat else "completions", "--streaming",
            "--tokenizer", a.tokenizer, "--concurrency", str(clients),
            "--request-count", str(a.requests), "--isl", str(a.prompt_tokens), "--isl-stddev", "0",
            "--osl", str(a.max_tokens), "--extra-inputs", "ignore_eos:true",
            "--random-seed", str(seed), "--artifact-dir", str(out), "--ui", "none"]


def guidellm_figures(report: dict) -> dict:
    """guidellm's JSON report of one benchmark -> the row's figures; a failed request fails it
    (guidellm itself exits 0 when every request failed, printing zeros)."""
    (bench,) = report["benchmarks"]
    m, totals = bench["metrics"], bench["metrics"]["request_totals"]
    if totals["errored"] or totals["incomplete"] or not totals["successful"]:
        first = (bench["requests"]["errored"] or [{"info": {"error": "none"}}])[0]["info"]["error"]
        raise RuntimeError(f"guidellm: {totals['successful']} of {totals['total']} requests "
                           f"succeeded; first error: {first}")
    ok = lambda name: m[name]["successful"]
    pct = lambda name, p: ok(name)["percentiles"][p]
    return {"output_tok_s": ok("output_tokens_per_second")["mean"],
            "tokens": int(ok("output_token_count")["total_sum"]), "requests": totals["successful"],
            "ttft_ms_p50": pct("time_to_first_token_ms", "p50"),
            "ttft_ms_p99": pct("time_to_first_token_ms", "p99"),
            "itl_ms_p50": pct("inter_token_latency_ms", "p50"),
            "itl_ms_p99": pct("inter_token_latency_ms", "p99"), "decode_tok_s_median": None}


def aiperf_figures(report: dict) -> dict:
    """aiperf's profile_export_aiperf.json -> the row's figures; a failed request fails it."""
    errors = sum(e["count"] for e in report["error_summary"])
    if errors or report["was_cancelled"]:
        first = report["error_summary"][0]["error_details"]["message"] if errors else "cancelled"
        raise RuntimeError(f"aiperf: {errors} requests failed; first error: {first}")
    return {"output_tok_s": report["output_token_throughput"]["avg"],
            "tokens": int(report["total_output_tokens"]["avg"]),
            "requests": int(report["request_count"]["avg"]),
            "ttft_ms_p50": report["time_to_first_token"]["p50"],
            "ttft_ms_p99": report["time_to_first_token"]["p99"],
            "itl_ms_p50": report["inter_token_latency"]["p50"],
            "itl_ms_p99": report["inter_token_latency"]["p99"], "decode_tok_s_median": None}


def run_tool(tool, a, base, model, clients, out: Path) -> dict:
    """Run `tool` against base once (its output in out/log.txt) -> its report's figures."""
    out.mkdir(parents=True, exist_ok=True)
    # another seed at each client count: the prompts of the last load are not in the prefix cache
    seed = a.seed + clients
    command = (guidellm_command if tool == "guidellm" else aiperf_command)(
        a.tool_exe[tool], a, base, model, clients, seed, out)
    # no hub: guidellm reads the tokenizer offline; aiperf 0.13.0 in offline mode looks a local
    # tokenizer folder up in the hub's cache and fails, and reads an absolute path locally without
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update({"HF_HUB_OFFLINE": "1"} if tool == "guidellm" else {})
    with open(out / "log.txt", "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out,
                                start_new_session=True)
        try:
            rc = proc.wait(a.tool_timeout)
        finally:  # past --tool-timeout, or bench_serve stopped: the tool and every process it began
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    report = out / ("guidellm.json" if tool == "guidellm" else "profile_export_aiperf.json")
    if rc or not report.exists():
        raise RuntimeError(f"{tool} exited with code {rc} and no report: see {out / 'log.txt'}")
    figures = json.loads(report.read_text())
    return (guidellm_figures if tool == "guidellm" else aiperf_figures)(figures)


def wait_healthy(base, proc, timeout):
    import httpx
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was up")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not up within {timeout} s")


def bench_server(kind, a, prompts, count_tokens, system="") -> list[dict]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(Path(a.log_dir) / f"server-{kind}.log", "w")
    proc = subprocess.Popen(server_command(kind, a, port), stdout=log, stderr=subprocess.STDOUT,
                            cwd=REPO, start_new_session=True)
    rows = []
    try:
        wait_healthy(base, proc, a.startup_timeout)
        model = a.hf_model or a.target if kind == "hf" else a.target
        # the warm-up's prompts are not the load's: a system prompt cached here would flatter
        # the first load's time to first token
        asyncio.run(run_load(base, model, prompts, 2, 2, 0, a.max_tokens, a.seed, a.chat))
        for c, tool in [(c, t) for c in a.clients for t in a.tools]:  # after the warm-up
            before = server_counters(base) if kind != "hf" else None
            if tool == "own":
                start, results = asyncio.run(run_load(base, model, prompts, c, a.requests, a.rate,
                                                      a.max_tokens, a.seed, a.chat, system=system,
                                                      turns=a.turns))
                figures = summarise(start, results, count_tokens)
            else:
                figures = run_tool(tool, a, base, model, c, Path(a.log_dir) / f"{tool}-{kind}-{c}")
            counted = counter_figures(before, server_counters(base)) if before is not None else {}
            rows.append({"server": kind, "clients": c, "load": tool, **figures, **counted})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    return rows


def table(rows) -> str:
    head = ("| server | clients | load from | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms "
            "| decode tok/s per request | tok/round | accept | cache hits | prefix hits |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"
    num = lambda x, f: "-" if x is None else f"{x:{f}}"  # the tools do not report decode tok/s
    lines = [f"| {r['server']} | {r['clients']} | {r.get('load', 'own')} | "
             f"{r['output_tok_s']:.1f} | {r['ttft_ms_p50']:.0f} / {r['ttft_ms_p99']:.0f} | "
             f"{r['itl_ms_p50']:.1f} / {r['itl_ms_p99']:.1f} | "
             f"{num(r['decode_tok_s_median'], '.1f')} | {num(r.get('tokens_per_round'), '.2f')} | "
             f"{num(r.get('accept'), '.2f')} | {pct(r.get('cache_hit_rate'))} | "
             f"{pct(r.get('prefix_hit_rate'))} |"
             for r in rows]
    return "\n".join([head, *lines])


def tool_tokenizer(target) -> str:
    """The tokenizer the tools read, an absolute path (no hub): the target's directory, or for a
    GGUF file the tokenizer load_tokenizer built from its header and kept (the tools read none)."""
    from checkpoint import gguf_tokenizer, load_tokenizer, resolve
    path = resolve(target).resolve()
    if not path.is_file():
        return str(path)
    saved = gguf_tokenizer(path)
    if not (saved / "tokenizer_config.json").exists():
        load_tokenizer(path)  # builds it and keeps it there
    if not (saved / "tokenizer_config.json").exists():
        raise SystemExit(f"bench_serve: {path.name} has no tokenizer, or it could not be kept in "
                         f"{saved.parent}: the tools need one as a folder")
    return str(saved)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="ar,sd,ssd,hf",
                    help="comma list of ar, sd, ssd (serve.py) and hf (transformers serve)")
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--draft", default="tiny-draft")
    ap.add_argument("--hf-model", default=None,
                    help="what transformers serve loads (default: the target's directory)")
    ap.add_argument("--k", type=int, default=None,
                    help="serve.py's --k (default: its own, the K the draft's checkpoint records)")
    ap.add_argument("--clients", default="1,8", help="comma list of concurrent clients")
    ap.add_argument("--requests", type=int, default=16, help="requests per client count")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="Poisson arrivals a second (0: all at once)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-file", default=None, help="one prompt per line, or JSONL 'prompt'")
    ap.add_argument("--chat", action="store_true",
                    help="send chat completions (instruct models): each prompt a user message")
    ap.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                    help="start every prompt with the same system prompt of this many tokens")
    ap.add_argument("--turns", type=int, default=1,
                    help="turns per conversation: each prompt the last one, its answer and the "
                         "next question")
    ap.add_argument("--tool", default="own",
                    help="comma list of what sends the load: own (these clients), guidellm, "
                         "aiperf (each installed apart from the engine: docs/benchmarks.md)")
    ap.add_argument("--tool-bin", default=None,
                    help="the virtual environment (or folder) holding the tools' executables "
                         "(default: PATH)")
    ap.add_argument("--prompt-tokens", type=int, default=128,
                    help="the tools' synthetic prompt length in tokens")
    ap.add_argument("--tool-timeout", type=float, default=1800,
                    help="seconds one tool run may take")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--log-dir", default="/tmp", help="where the servers' logs go")
    ap.add_argument("--json", default=None, help="append the rows to this JSONL file")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER,
                    help="after --: more serve.py flags (e.g. -- --budget 8)")
    a = ap.parse_args(argv)
    a.servers = [s for s in a.servers.split(",") if s]
    bad = [s for s in a.servers if s not in ("ar", "sd", "ssd", "hf")]
    if bad:
        ap.error(f"--servers: unknown {', '.join(bad)}; use ar, sd, ssd, hf")
    a.clients = [int(c) for c in a.clients.split(",")]
    if a.turns < 1 or a.shared_prefix < 0:
        ap.error("--turns must be >= 1 and --shared-prefix >= 0")
    a.serve_args = [x for x in a.serve_args if x != "--"]
    a.tools = [t for t in a.tool.split(",") if t]
    bad = [t for t in a.tools if t != "own" and t not in TOOL_PINS]
    if bad or not a.tools:
        ap.error(f"--tool: unknown {', '.join(bad) or 'nothing'}; use own, guidellm, aiperf")
    a.tool_exe = {t: tool_executable(t, a.tool_bin) for t in a.tools if t != "own"}
    return a


def main(argv=None):
    a = parse_args(argv)
    from checkpoint import load_tokenizer, resolve
    from bench import file_prompts
    tok = load_tokenizer(a.target)
    count_tokens = lambda text: len(tok.encode(text, add_special_tokens=False))
    prompts = file_prompts(a.prompt_file) if a.prompt_file else DEFAULT_PROMPTS
    if "hf" in a.servers and a.hf_model is None:
        a.hf_model = str(resolve(a.target))
    a.tokenizer = tool_tokenizer(a.target)
    system = shared_prefix(tok, a.shared_prefix) if a.shared_prefix else ""
    rows = [r for kind in a.servers
            for r in bench_server(kind, a, prompts, count_tokens, system)]
    print(table(rows))
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps({**r, "target": a.target, "max_tokens": a.max_tokens,
                                    "rate": a.rate, "requests": a.requests,
                                    "shared_prefix": a.shared_prefix, "turns": a.turns,
                                    "prompt_tokens": a.prompt_tokens,
                                    "serve_args": a.serve_args}) + "\n")


if __name__ == "__main__":
    main()
