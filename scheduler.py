"""Continuous batching: which rows the next round runs (nano-vllm's scheduler is the model).

A waiting queue and a running set. At each round boundary the scheduler
1. lets rows leave: done (EOS, past the request's min_tokens and unless it ignores EOS;
   max_tokens; a stop string) or cancelled. Their KV blocks, the
   target's and the draft's (SSD's branches included), are freed at once (`Rounds.leave`);
2. admits waiting requests in arrival order while their KV fits (`KVBudget`): each reserves the
   blocks its prompt and max_tokens can ever take, on both caches, so a running row never runs out
   of cache and nothing is ever preempted. With prefix caching, the full prompt blocks a request
   can share (kv_cache.shareable_hashes) are counted once for all the running requests that hold
   them, by their hashes: a cache keeps one block per hash while anyone holds it. The head of the
   queue waits until enough is freed (first come, first served: a long request is not starved by
   short ones). A request that could not fit even alone is refused at submit. The admitted prompts
   are prefilled together (each cache feeding only what it does not hold) and emit their first
   token (`Rounds.join`);
3. runs one round over the running rows, old and new together (decode.SDRounds / SSDRounds).

A static batch (generate()) is the simplest case: every request submitted at once, all admitted at
the first boundary, run until the last one leaves. A server runs `serve` in an engine thread and
submits and cancels from its own (the queue is guarded by a lock; the rounds are the engine's).
"""
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

from kv_cache import shareable_hashes


def cache_tokens(kv_tokens: int, block_size: int) -> int:
    """The tokens a cache of kv_tokens holds for rows: whole blocks, less the one kept for the
    padding rows of static-shape steps (PagedKVCache.pad_block)."""
    return -(-kv_tokens // block_size) * block_size - block_size


@dataclass
class KVBudget:
    """What one request reserves on each cache, in tokens of whole blocks, and what they hold."""
    target_tokens: int          # cache_tokens() of the target's cache
    draft_tokens: int | None    # of the draft's (None: ar has no draft)
    block_size: int
    K: int
    branch_tokens: int = 0      # ssd: the draft's B branches per row (engine.kv_sizes has the sum)
    prefix_caching: bool = False  # both caches share prompts' full blocks (kv_cache.py)

    def need(self, prompt_len: int, max_tokens: int) -> tuple[int, int]:
        """(target, draft) tokens: the prompt, the output and a round's K + 1 in flight, in blocks
        (the draft's plus its branches)."""
        bs = self.block_size
        target = -(-(prompt_len + max_tokens + self.K + 1) // bs) * bs
        return target, (0 if self.draft_tokens is None else target + self.branch_tokens)

    def shared(self, prompt: list[int]) -> list[bytes]:
        """The hashes of the prompt's blocks that the caches may share with other requests."""
        return shareable_hashes(prompt, self.block_size) if self.prefix_caching else []

    def own(self, need: tuple[int, int], shared: int) -> tuple[int, int]:
        """(target, draft) tokens of a need that are the request's alone: all but its `shared`
        blocks."""
        s = shared * self.block_size
        return need[0] - s, (0 if self.draft_tokens is None else need[1] - s)

    def never_fits(self, need: tuple[int, int]) -> str | None:
        """Why a request of this need could not run even alone, or None."""
        if need[0] > self.target_tokens:
            return (f"the prompt and max_tokens need {need[0]} tokens of KV cache, the target's "
                    f"holds {self.target_tokens}: shorten them or raise --kv-tokens")
        if self.draft_tokens is not None and need[1] > self.draft_tokens:
            return (f"the prompt and max_tokens need {need[1]} tokens of the draft's KV cache, it "
                    f"holds {self.draft_tokens}: shorten them or raise --kv-tokens")
        return None


@dataclass(eq=False)  # a request is itself (cancel finds it in the queue), not its fields
class Request:
    """One prompt to continue. The callbacks run in the engine's thread."""
    prompt: list[int]
    max_tokens: int
    # on_tokens(tokens so far) after each round that added some; True ends the request there
    on_tokens: Callable | None = None
    on_done: Callable | None = None   # on_done(request) once it has left
    temperature: float | None = None  # its own (None: the engine's)
    seed: int | None = None           # its own (None: one drawn from the engine's seed)
    min_tokens: int = 0               # an EOS before this many tokens does not end it (kept)
    ignore_eos: bool = False          # no EOS ends it (max_tokens, a stop string do)
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS or a stop string), "length", "cancelled",
                                      #   "error" (then `error` says why)
    error: str | None = None
    cancelled: bool = False
    stopped: bool = False             # on_tokens ended it
    need: tuple[int, int] = (0, 0)
    shared: list = field(default_factory=list)  # KVBudget.shared of its prompt


class Scheduler:
    """The waiting queue, the running set and the round loop of one engine (`rounds`: a
    decode.SDRounds or SSDRounds, whose `out` records every row)."""

    def __init__(self, rounds, budget: KVBudget, max_batch: int, forget: bool = False):
        self.rounds, self.out, self.budget, self.max_batch = rounds, rounds.out, budget, max_batch
        self.out.stream = self.stream
        self.forget = forget  # drop a row's tokens once it has left (a server)
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # row -> request
        # tokens reserved on the target's and the draft's caches: each running request's own
        # (`own`), and every shareable block it holds once, by hash (`held`: how many hold it)
        self.own, self.held = [0, 0], Counter()
        self.wake = threading.Condition()  # guards `waiting`; notified on submit and cancel
        self.submitted = self.finished = 0
        self.down: str | None = None  # the error that ended the waiting too (fail): none will run

    # -- any thread
    def submit(self, req: Request) -> Request:
        """Queue a request; a ValueError if it could never fit."""
        req.need = self.budget.need(len(req.prompt), req.max_tokens)
        req.shared = self.budget.shared(req.prompt)
        why = self.budget.never_fits(req.need)
        if why:
            raise ValueError(why)
        with self.wake:
            self.submitted += 1
            if self.down is None:
                self.waiting.append(req)
                self.wake.notify()
                return req
            req.error = self.down  # the engine went down after the caller looked: end it now
        self.done(req, "error")
        return req

    def cancel(self, req: Request):
        """End a request: a waiting one now, a running one at the next round boundary."""
        with self.wake:
            req.cancelled = True
            if req in self.waiting:
                self.waiting.remove(req)
                self.done(req, "cancelled")
            self.wake.notify()

    def queue_length(self) -> int:
        return len(self.waiting)

    @property
    def used(self) -> list[int]:
        """Tokens reserved on the target's and the draft's caches."""
        s = len(self.held) * self.budget.block_size
        return [self.own[0] + s, self.own[1] + (s if self.budget.draft_tokens is not None else 0)]

    def prefix_tokens(self) -> dict:
        """{"target": (looked up, found), "draft": the same or None}: prompt tokens each prefix
        cache looked up and found since it started (its hit rate)."""
        t, d = self.rounds.prefix_tokens()
        return {"target": t, "draft": d}

    def kv_blocks(self) -> dict:
        """{"target": (used, free), "draft": (used, free) or None} blocks of each KV cache."""
        bs, (t, d) = self.budget.block_size, self.rounds.kv_used()
        total_t = self.budget.target_tokens // bs + 1  # cache_tokens() left the pad block out
        draft = (None if self.budget.draft_tokens is None
                 else (d, self.budget.draft_tokens // bs + 1 - d))
        return {"target": (t, total_t - t), "draft": draft}

    # -- the engine's thread
    def step(self) -> bool:
        """One round boundary and one round; False when there was nothing to run."""
        self.leave()
        self.admit()
        self.leave()  # rows done at their first token
        if not self.rounds.rows:
            return False
        self.rounds.round()
        return True

    def run(self) -> tuple[float, float]:
        """A static batch: run until every submitted request has left.
        -> (prefill seconds, decode seconds without graph captures)."""
        start = time.perf_counter()
        self.admit()
        prefill_s, start = time.perf_counter() - start, time.perf_counter()
        while self.step() or self.waiting:
            pass
        return prefill_s, time.perf_counter() - start - self.out.capture_s

    def serve(self, stopping: threading.Event):
        """The engine thread of a server: rounds while there are rows, asleep while there are none,
        until `stopping` is set. An error in a round ends every request in flight with it and is
        raised; the waiting ones stay queued (the caller decides whether the engine can go on, and
        fails them too if not)."""
        while not stopping.is_set():
            try:
                self.rounds.check()  # a speculator that died while idle fails before a join
                with self.wake:
                    if not self.waiting and not self.running:
                        self.wake.wait(timeout=0.1)
                        continue
                self.step()
            except BaseException as e:
                self.fail(f"{type(e).__name__}: {e}", waiting=False)
                raise

    def admit(self):
        """Take waiting requests, first come first served, while the batch has room and their KV
        fits; prefill them together."""
        new, bs, (t, d) = [], self.budget.block_size, self.used
        with self.wake:
            while self.waiting and len(self.running) + len(new) < self.max_batch:
                req = self.waiting[0]
                # blocks no running request holds are its own to pay for, even when another one
                # joining now has them: prompts prefilled together each compute theirs (the
                # cache keeps one of them after the prefill: kv_cache.PagedKVCache.register)
                fresh = sum(h not in self.held for h in req.shared) * bs
                own = self.budget.own(req.need, len(req.shared))
                t_new, d_new = t + own[0] + fresh, d + own[1] + fresh
                if t_new > self.budget.target_tokens or (self.budget.draft_tokens is not None
                                                         and d_new > self.budget.draft_tokens):
                    break  # the head waits until enough is freed
                t, d = t_new, d_new
                new.append(self.waiting.popleft())
        if not new:
            return
        for req in new:
            own = self.budget.own(req.need, len(req.shared))
            self.own = [self.own[0] + own[0], self.own[1] + own[1]]
            self.held.update(req.shared)
        first = len(self.out.tokens)  # the rows they get (join numbers them on)
        self.running.update({first + i: req for i, req in enumerate(new)})
        self.rounds.join([req.prompt for req in new], [req.max_tokens for req in new],
                         [req.temperature for req in new], [req.seed for req in new],
                         [req.max_tokens if req.ignore_eos else req.min_tokens for req in new])

    def stream(self, row, tokens) -> bool:
        """Output's stream: hand each request its tokens; True when the request ends itself."""
        req = self.running[row]
        req.tokens = tokens
        req.stopped = bool(req.on_tokens(tokens)) if req.on_tokens else False
        return req.stopped

    def leave(self):
        """Rows done or cancelled leave the batch; their KV is freed now."""
        rows = [r for r, req in self.running.items() if self.out.done[r] or req.cancelled]
        if not rows:
            return
        # each row's prompt and output: the full blocks they fill stay cached (prefix caching)
        self.rounds.leave(rows, [self.running[r].prompt + self.out.tokens[r] for r in rows])
        for r in rows:
            req = self.running.pop(r)
            own = self.budget.own(req.need, len(req.shared))
            self.own = [self.own[0] - own[0], self.own[1] - own[1]]
            self.held.subtract(req.shared)
            self.held = +self.held  # the hashes no one holds any more are free
            req.tokens = list(self.out.tokens[r])
            if self.forget:
                self.out.forget(r)
            eos = self.out.ended_at_eos(r, req.tokens)
            self.done(req, "cancelled" if req.cancelled else
                      "stop" if req.stopped or eos else "length")

    def fail(self, error: str, waiting: bool = True):
        """The engine failed: every request in flight (and the waiting ones) ends with the error.
        The rows are the rounds' to free (SSDRounds.restart), or the engine is down."""
        with self.wake:
            reqs = list(self.running.values()) + (list(self.waiting) if waiting else [])
            if self.forget:
                for r in self.running:
                    self.out.forget(r)
            self.running.clear()
            if waiting:
                self.waiting.clear()
                self.down = error
            # nothing runs: what the waiting need is reserved on admission
            self.own, self.held = [0, 0], Counter()
        for req in reqs:
            req.error = error
            self.done(req, "error")

    def done(self, req: Request, reason: str):
        req.finish_reason = reason
        self.finished += 1
        if req.on_done:
            req.on_done(req)
