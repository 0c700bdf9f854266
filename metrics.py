"""What serve.py's /metrics says: counters, gauges and histograms in Prometheus' text format.

Two sources. The engine's counters (decode.Output, scheduler.Scheduler: tokens, rounds, acceptance,
SSD's cache lookups, KV blocks) are read when a scraper asks. The HTTP side's (each request's
latencies, its prompt tokens, how it ended) are measured here: `RequestTimer` is one request's
clock, told of its tokens in the engine's thread, and adds to `RequestStats`. Plain Python, so the
engine needs no Prometheus library; tests/test_serve.py reads the output with prometheus_client's
parser.

The names are vLLM's (`vllm:` -> `ssd_`) where vLLM has the metric, units in the name; requests
by how they ended are not its request_success_total (stop, length, abort), as they count errors:

    ssd_requests_total                      counter    requests queued
    ssd_requests_finished_total             counter    requests ended, by finished_reason
                                                       (stop, length, cancelled, error)
    ssd_num_requests_running                gauge      rows in the batch
    ssd_num_requests_waiting                gauge      requests queued for KV room
    ssd_prompt_tokens_total                 counter    prompt tokens prefilled
    ssd_generation_tokens_total             counter    tokens generated
    ssd_time_to_first_token_seconds         histogram  arrival to the first token (the prefill's)
    ssd_inter_token_latency_seconds         histogram  one per token after the first: a round that
                                                       brings k tokens g seconds after the last
                                                       counts g / k, k times (bench_serve.py's ITL)
    ssd_e2e_request_latency_seconds         histogram  arrival to the end, of requests that ended
                                                       with stop or length
    ssd_rounds_total                        counter    verification rounds (one batch forward each)
    ssd_engine_restarts_total               counter    speculator restarts
    ssd_kv_blocks_used, ssd_kv_blocks_free  gauge      KV blocks, by cache (target, draft)
    ssd_prefix_cache_queries_total          counter    prompt tokens looked up in the prefix cache,
                                                       by cache (target, draft)
    ssd_prefix_cache_hits_total             counter    of those, tokens found there (prefix
                                                       caching: hit rate = hits / queries)
  sd and ssd (K > 0):
    ssd_spec_decode_num_drafts_total        counter    row-rounds (a row's K proposals verified)
    ssd_spec_decode_num_draft_tokens_total  counter    tokens proposed
    ssd_spec_decode_num_accepted_tokens_total  counter  tokens accepted
    ssd_spec_decode_num_accepted_tokens_per_pos_total  counter  by position (0..K-1) in the draft
  ssd:
    ssd_spec_cache_hits_total               counter    row-rounds whose outcome was in the
                                                       speculation cache (proposals ready)
    ssd_spec_cache_misses_total             counter    row-rounds where the fallback proposed

Ratios are a scraper's to take: acceptance rate = accepted / draft tokens, mean tokens per
row-round = 1 + accepted / drafts, SSD's hit rate = hits / (hits + misses).
"""
import threading
import time
from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text format

# vLLM's buckets, with finer ones below 10 ms for the inter-token latency: on a CPU a small model's
# token takes a few milliseconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
REASONS = ("stop", "length", "cancelled", "error")  # scheduler.Request.finish_reason


class Histogram:
    """Observations counted by the first bucket bound they do not exceed, their sum and count."""

    def __init__(self, bounds: tuple):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, x: float, times: int = 1):
        self.counts[bisect_left(self.bounds, x)] += times
        self.sum += x * times

    def samples(self) -> list:
        """_bucket (cumulative, `le` each bound and +Inf), _sum and _count."""
        cum = list(accumulate(self.counts))
        les = [repr(float(b)) for b in self.bounds] + ["+Inf"]
        return ([("_bucket", {"le": le}, n) for le, n in zip(les, cum)]
                + [("_sum", {}, self.sum), ("_count", {}, cum[-1])])


class RequestStats:
    """What the HTTP side measures of its requests. Timers write from the engine's thread and a
    scrape reads from the event loop's: both under `lock`."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ttft, self.itl = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.prompt_tokens = 0
        self.finished = dict.fromkeys(REASONS, 0)

    def timer(self, prompt_len: int, start: float) -> "RequestTimer":
        return RequestTimer(self, prompt_len, start)


class RequestTimer:
    """One request's clock, from its arrival (`start`, time.perf_counter()). `tokens` and `done`
    run in the engine's thread, as its tokens come (serve.Reply's callbacks)."""

    def __init__(self, stats: RequestStats, prompt_len: int, start: float):
        self.stats, self.prompt_len, self.start = stats, prompt_len, start
        self.seen, self.last = 0, start

    def tokens(self, n: int):
        """The request has n tokens now. The first came from its prefill, alone."""
        now, new, s = time.perf_counter(), n - self.seen, self.stats
        if new <= 0:
            return
        with s.lock:
            if self.seen == 0:
                s.ttft.observe(now - self.start)
                s.prompt_tokens += self.prompt_len
            else:
                s.itl.observe((now - self.last) / new, new)
        self.seen, self.last = n, now

    def done(self, reason: str):
        with self.stats.lock:
            self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
            if reason in ("stop", "length"):
                self.stats.e2e.observe(time.perf_counter() - self.start)


# --------------------------------------------------------------------------------------------------
# The text a scraper reads

@dataclass
class Family:
    """One metric family: its samples are (suffix of the name, labels, value)."""
    name: str
    kind: str   # counter, gauge, histogram
    help: str
    samples: list


def one(name, kind, help_, value) -> Family:
    return Family(name, kind, help_, [("", {}, value)])


def families(engine, state: dict, stats: RequestStats) -> list[Family]:
    """Every family, the engine's counters read now (plain ints a round adds to: a scrape may
    fall between two, never sees half of one)."""
    s, out = engine.scheduler, engine.scheduler.out
    with stats.lock:
        finished, prompt_tokens = dict(stats.finished), stats.prompt_tokens
        ttft, itl, e2e = stats.ttft.samples(), stats.itl.samples(), stats.e2e.samples()
    kv = {cache: blocks for cache, blocks in s.kv_blocks().items() if blocks is not None}
    prefix = {cache: n for cache, n in s.prefix_tokens().items() if n is not None}
    fams = [
        one("ssd_requests_total", "counter", "Requests queued.", s.submitted),
        Family("ssd_requests_finished_total", "counter", "Requests ended, by finish reason.",
               [("", {"finished_reason": r}, n) for r, n in finished.items()]),
        one("ssd_num_requests_running", "gauge", "Requests in the running batch.",
            len(s.running)),
        one("ssd_num_requests_waiting", "gauge", "Requests queued for KV cache room.",
            s.queue_length()),
        one("ssd_prompt_tokens_total", "counter", "Prompt tokens prefilled.", prompt_tokens),
        one("ssd_generation_tokens_total", "counter", "Tokens generated.", out.new_tokens),
        Family("ssd_time_to_first_token_seconds", "histogram",
               "Seconds from a request's arrival to its first token.", ttft),
        Family("ssd_inter_token_latency_seconds", "histogram",
               "Seconds between tokens of a request (a round's gap shared by its tokens).", itl),
        Family("ssd_e2e_request_latency_seconds", "histogram",
               "Seconds from a request's arrival to its end (stop or length).", e2e),
        one("ssd_rounds_total", "counter", "Verification rounds.", out.rounds),
        one("ssd_engine_restarts_total", "counter", "Speculator restarts.", state["restarts"]),
        Family("ssd_kv_blocks_used", "gauge", "KV cache blocks in use, by cache.",
               [("", {"cache": c}, b[0]) for c, b in kv.items()]),
        Family("ssd_kv_blocks_free", "gauge", "KV cache blocks free, by cache.",
               [("", {"cache": c}, b[1]) for c, b in kv.items()]),
        Family("ssd_prefix_cache_queries_total", "counter",
               "Prompt tokens looked up in the prefix cache, by cache.",
               [("", {"cache": c}, n[0]) for c, n in prefix.items()]),
        Family("ssd_prefix_cache_hits_total", "counter",
               "Prompt tokens found in the prefix cache, by cache.",
               [("", {"cache": c}, n[1]) for c, n in prefix.items()])]
    if engine.K:
        # position j was accepted in every row-round that accepted more than j tokens
        per_pos = [sum(out.hist[j + 1:]) for j in range(engine.K)]
        fams += [
            one("ssd_spec_decode_num_drafts_total", "counter",
                "Row-rounds: a row's draft tokens verified.", out.row_rounds),
            one("ssd_spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.",
                out.proposed),
            one("ssd_spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
                out.accepted),
            Family("ssd_spec_decode_num_accepted_tokens_per_pos_total", "counter",
                   "Draft tokens accepted, by position in the draft.",
                   [("", {"position": str(j)}, n) for j, n in enumerate(per_pos)])]
    if engine.mode == "ssd":
        fams += [one("ssd_spec_cache_hits_total", "counter",
                     "Row-rounds whose outcome was in the speculation cache.", out.rounds_hit),
                 one("ssd_spec_cache_misses_total", "counter",
                     "Row-rounds whose outcome was not: the fallback proposed.", out.rounds_miss)]
    return fams


def render(fams: list[Family]) -> str:
    """Prometheus' text format (version 0.0.4): each family's HELP, TYPE and samples together."""
    lines = []
    for f in fams:
        lines += [f"# HELP {f.name} {f.help}", f"# TYPE {f.name} {f.kind}"]
        for suffix, labels, value in f.samples:
            tags = ",".join(f'{k}="{v}"' for k, v in labels.items())
            lines.append(f"{f.name}{suffix}{{{tags}}} {value}" if tags
                         else f"{f.name}{suffix} {value}")
    return "\n".join(lines) + "\n"
