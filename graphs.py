"""Static shapes and CUDA graphs for decode steps and verifications (`StaticSteps`): a step is
padded to a bucket of rows and block-table columns, so that each bucket's run can be captured once
as a CUDA graph and replayed; on the CPU the same padded path runs eagerly, so tests check it.
"""
import time
from dataclasses import dataclass, field

import torch

from devices import to_device
from kv_cache import PagedKVCache

# --------------------------------------------------------------------------------------------------
# Static shapes and CUDA graphs
#
# A decode step (T = 1 new token per sequence) or a verification (T = K + 1) does little work per
# kernel, so on a GPU its time goes to launching some 50 kernels per layer from Python. A CUDA graph
# records the launches once and replays them in one call, but it replays fixed shapes at fixed
# addresses. So a forward is split into the host's plan (PagedKVCache.plan: slots, positions, block
# tables) and the device's run (Transformer.run), and a step whose rows all add the same T tokens is
# padded to a *bucket*: the rows to a power of two (padding rows are masked and write into the
# cache's pad block) and the block table to a power of two of columns (masked as well). Each bucket
# owns its input buffers; a step copies its plan into them (one host-to-device copy, as the dynamic
# path) and runs, or on CUDA replays the run captured the first time the bucket came up. On the CPU
# the same padded path runs without capture, so tests check it against the dynamic path.


@dataclass
class Bucket:
    cache: PagedKVCache     # held: a graph reads its pool's address
    ints: torch.Tensor      # the plan's int64 layout, on the device (PagedKVCache.plan)
    tokens: torch.Tensor    # [rows * T] input tokens; padding rows keep token 0
    logits: object = None   # the captured run's output: [rows * T, V], or (logits, features)
    graph: object = None    # torch.cuda.CUDAGraph once captured
    ran: set = field(default_factory=set)  # the thread counts a compiled CPU body ran it at


class StaticSteps:
    MAX_T = 16       # longer uniform steps (prefill pieces) stay on the dynamic path
    MAX_ROWS = 512   # so do larger batches: a bucket keeps its logits, [rows * T, V] float32

    def __init__(self, capture: bool, halves=None, body=None):
        self.capture = capture
        self.halves = halves  # the layers' compiled halves (model.compiled_halves), or None
        self.body = body      # the CPU's compiled body (model.compiled_body), or None
        self.buckets: dict[tuple, Bucket] = {}
        self.pool = None    # one memory pool for all of a model's graphs (they never run at once)
        self.captures = 0
        self.capture_seconds = 0.0

    @property
    def compiled(self) -> bool:
        return self.halves is not None or self.body is not None

    def keep(self, cache: PagedKVCache | None):
        """Drop the buckets (and graphs) of every other cache: theirs are done, and the buckets
        would keep their pools alive."""
        self.buckets = {key: bk for key, bk in self.buckets.items() if bk.cache is cache}

    def fits(self, counts: list[int]) -> bool:
        uniform = all(c == counts[0] for c in counts)
        return uniform and counts[0] <= self.MAX_T and len(counts) <= self.MAX_ROWS

    def step(self, model, cache: PagedKVCache, seq_ids: list[int], tokens, T: int):
        """One padded step -> float32 logits [b * T, V] of the real rows (with the model's
        feature_layers, (logits, features [b * T, layers, hidden]))."""
        b = len(seq_ids)
        host, shape = cache.plan(seq_ids, [T] * b, pad=True)  # shape: (rows, T, blocks)
        key = (id(cache), *shape)
        bk = self.buckets.get(key)
        if bk is None:
            tokens_buf = torch.zeros(shape[0] * T, dtype=torch.long, device=model.device)
            bk = self.buckets[key] = Bucket(cache, torch.empty_like(host, device=model.device),
                                            tokens_buf)
        to_device(host, model.device, out=bk.ints)  # the one host-to-device copy of this step
        bk.tokens[:b * T].copy_(tokens)

        def run():
            meta = cache.meta(bk.ints, *shape)
            if self.body is not None:
                symbolic_sizes(bk.tokens, meta, cache)
            return model.run(cache, bk.tokens, meta, halves=self.halves, body=self.body)
        if not self.capture:
            threads = torch.get_num_threads()  # compiled code is made for a thread count
            if self.body is None or threads in bk.ran:
                return real_rows(run(), b * T)
            # a bucket's first run on the CPU at this thread count compiles, or checks that a
            # compiled graph serves it: set-up, timed apart as captures are (one step's work is
            # counted with it)
            start = time.perf_counter()
            logits = real_rows(run(), b * T)
            bk.ran.add(threads)
            self.captures += 1
            self.capture_seconds += time.perf_counter() - start
            return logits
        if bk.graph is None:
            self.capture_graph(bk, run)
        bk.graph.replay()
        return real_rows(bk.logits, b * T, clone=True)  # the next replay overwrites bk.logits

    def capture_graph(self, bk: Bucket, run):
        # one eager run first, on a side stream (as torch.cuda.graphs asks): cuBLAS and the caching
        # allocator set themselves up outside the capture. It writes the same K/V the replay will.
        # Captures happen during decoding, the first time a shape comes up, and are timed (a sync
        # each, rare): the decode loops leave that time out of decode time and report it apart
        # (decode.Captures), so that tokens per second measure decoding, not set-up. The clock
        # starts once the steps queued before have run: their time is decoding.
        torch.cuda.synchronize()
        start = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        bk.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(bk.graph, pool=self.pool):
            bk.logits = run()
        self.pool = bk.graph.pool()
        torch.cuda.synchronize()
        self.captures += 1
        self.capture_seconds += time.perf_counter() - start


def real_rows(out, n: int, clone: bool = False):
    """The first n rows (the real ones) of a step's output: logits, or (logits, features)."""
    if isinstance(out, tuple):
        return tuple(real_rows(x, n, clone) for x in out)
    return out[:n].clone() if clone else out[:n]


def symbolic_sizes(tokens, meta, cache: PagedKVCache):
    """Tell torch.compile that the sizes a bucket sets (rows, tokens per row, block-table width)
    vary, before the CPU's compiled body (model.compiled_body) first sees them: its first graph
    then serves every later bucket. Left to find out, it compiles once per size that changes, and
    a 30-layer graph takes 10-20 s to compile on a laptop's core. Sizes of 1 still compile apart
    (a decode step of one row is one graph, a verification of one row another).
    The pool's size stays fixed in a graph (a new pool compiles its own): left to torch.compile,
    a second pool of another size (generate(target=model) again, needing more blocks) made its
    number of blocks symbolic, and the graph compiled then lost most of the layers' writes into the
    pool (the attention op's in-place kv_layer: 2,048 of the 16,384 values a verification of the
    tiny pair writes) and attended over stale K/V: wrong logits (torch 2.13, CPU;
    tests/test_graphs.py::test_compiled_sd_after_compiled_ar_on_one_model)."""
    torch._dynamo.mark_static(cache.kv)
    mark = torch._dynamo.maybe_mark_dynamic
    for t in (tokens, meta.slots, meta.positions, meta.query_index, meta.rows, meta.last):
        mark(t, 0)          # [N] or [b]
    for d in (0, 1):        # [b, max_blocks]
        mark(meta.block_table, d)
    for d in (0, 2, 3) if meta.mask is not None else ():  # [b, 1, g * T, max_blocks * bs]
        mark(meta.mask, d)

