"""The draft side: draft K tokens (SD), and pre-speculate the next round for guessed outcomes (SSD).

Read in this order: `draft_k` (the draft's inner loop), `Drafter` (plain SD: prefill, draft, follow
the verifier's outcome), then `Speculator`, which adds SSD: while the target verifies a round, guess
its likely outcomes (n, t) and draft the next round for each of them (`pre_speculate`); when the
real outcome arrives, answer from the speculation cache (a hit) or from a fallback (a miss)
(`respond`).

Invariant (the verifier's too): a row's KV cache holds every committed token except its `pending`
ones (the last bonus token t, plus x_K when all K drafted tokens were accepted).
"""
import time
from dataclasses import dataclass, field

import torch

import fallback
from fallback import BACKUPS, POLICIES, critical_batch_size
from checkpoint import load_model
from devices import device_index, to_device, to_host
from kv_cache import PagedKVCache
from model import Transformer
from saguaro_sample import exp_noise, probs_from_logits, sample, saguaro
from spec_cache import (DEFAULT_A, DEFAULT_R, AcceptanceTracker, PreSpecGate, SpecCache,
                        expected_tokens, fan_out, guess_triples, next_budget,
                        select_guesses_batch)


@dataclass
class Proposals:
    """One round's proposals for b rows: what the verifier needs to test them exactly."""
    tokens: torch.Tensor         # [b, K] x_1..x_K
    q: torch.Tensor | None       # [b, K, V] the law each x_i was drawn from (q or Saguaro's q');
                                 #   None at temperature 0, where the test reads only the tokens
    deterministic: torch.Tensor  # [b] bool: not drawn from q (greedy, n-gram, random): one-hot test
    hit: torch.Tensor            # [b] bool: answered from the speculation cache


def draft_probs(logits, temperature):
    """The draft's own law q. At temperature 0 the draft is greedy, but guesses still need a
    ranking of the tokens: use the temperature-1 softmax."""
    return probs_from_logits(logits, temperature if temperature > 0 else 1.0)


def draw(logits, temperature, generator, f=None, c=1.0, of_batch=None):
    """One draft token per row: (token [b], q_drawn [b, V], q_raw [b, V]). q_raw is the draft's
    own law; q_drawn the one the token was drawn from (Saguaro's q' when f is set and C < 1).
    of_batch (M, rows): these rows are `rows` of a batch of M drawn with `generator`: draw the
    batch's noise and keep theirs."""
    q_raw = draft_probs(logits, temperature)
    if temperature == 0:
        return q_raw.argmax(-1), q_raw, q_raw
    q = saguaro(q_raw, f, c) if f is not None and c < 1 else q_raw
    noise = None
    if of_batch is not None:
        noise = exp_noise((of_batch[0], q.shape[-1]), generator)[of_batch[1]]
    return sample(q, generator, noise), q, q_raw


@dataclass
class Drafted:
    """Draft steps taken so far for a batch of sequences. Step i < K feeds one token per sequence
    (its `first` tokens at i = 0, then x_i) and draws x_{i+1}; x_K is not fed here (the caller's
    next forward feeds it). SSD's pre-speculation may stop after any step and finish a branch
    later."""
    tokens: list = field(default_factory=list)  # per step i < K: x_{i+1} [b]
    q: list = field(default_factory=list)       # per step i < K: the law x_{i+1} came from [b, V]
    q_raw: list = field(default_factory=list)   # per step i < K: the draft's law at depth i [b, V]

    @property
    def steps(self) -> int:
        return len(self.q_raw)

    def rows(self, idx) -> "Drafted":
        return Drafted([x[idx] for x in self.tokens], [x[idx] for x in self.q],
                       [x[idx] for x in self.q_raw])

    def stack(self):
        """-> tokens [b, K], q [b, K, V], q_raw [b, steps, V]."""
        return torch.stack(self.tokens, 1), torch.stack(self.q, 1), torch.stack(self.q_raw, 1)


def draft_k(model: Transformer, cache: PagedKVCache, seqs, first, K, temperature, generator,
            F=None, c=1.0, stop=None, done: Drafted | None = None, of_batch=None) -> Drafted:
    """Feed each sequence its `first` tokens (a list per row, e.g. [t] or [x_K, t]), then draft K
    tokens one step at a time, all rows together. F (K ints) and C select Saguaro sampling at each
    stop(step) -> True ends the drafting before that step (SSD: the verifier's outcome arrived);
    done continues an earlier call's steps; of_batch: see `draw`."""
    d = done if done is not None else Drafted()
    while d.steps < K and not (stop is not None and stop(d.steps)):
        i = d.steps
        if i == 0:
            step_in, counts = [x for f in first for x in f], [len(f) for f in first]
        else:
            step_in, counts = d.tokens[i - 1], [1] * len(seqs)
        logits = model.forward_cached(cache, seqs, step_in, counts, last_only=True)  # [b, V]
        x, q, q_raw = draw(logits, temperature, generator, None if F is None else F[i], c,
                           of_batch)
        d.tokens.append(x), d.q.append(q), d.q_raw.append(q_raw)
    return d


@dataclass
class Row:
    """One sequence on the draft side."""
    seq: int | None        # its sequence in the draft's KV cache (None once finished)
    history: list[int]     # committed tokens: prompt + output
    # fed first by the next forward: committed tokens not in the cache (SSD: also proposals the
    # draft has not fed, a fast backup's or x_K)
    pending: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)  # x_1..x_K now being verified
    # SSD only: what the guesses for the round being verified come from
    q_raw: torch.Tensor | None = None  # [K+1, V] the draft's own laws after 0..K proposed tokens
                                       #   (until feed_pending: [K, V] or None)
    F: list[int] = field(default_factory=list)         # F_0..F_K: guesses per depth this round
    fast: bool = False     # the proposals came from a fast backup (n-gram, random)


class Drafter:
    """Plain speculative decoding's draft: prefill, draft K tokens, follow the verifier's
    outcome."""

    def __init__(self, model: Transformer, K: int, temperature: float, seed: int, kv_tokens: int,
                 block_size=16):
        self.model, self.K, self.temperature = model, K, temperature
        self.cache = model.new_cache(kv_tokens, block_size)
        self.gen = torch.Generator(device=model.device).manual_seed(seed)
        self.V = model.config.vocab_size
        self.rows: list[Row] = []

    def prefill(self, prompts: list[list[int]]):
        """Cache every prompt token; returns the draft's own next-token law [b, V]."""
        self.rows = [Row(self.cache.new_seq(), list(p)) for p in prompts]
        logits = self.model.prefill(self.cache, [row.seq for row in self.rows], prompts)
        return draft_probs(logits, self.temperature)

    def draft(self, rows: list[int]) -> Proposals:
        """Draft K tokens for the given rows (in SD the verifier waits for this)."""
        tok, q, _ = draft_k(self.model, self.cache, [self.rows[r].seq for r in rows],
                            [self.rows[r].pending for r in rows], self.K, self.temperature,
                            self.gen).stack()
        for r, proposed in zip(rows, to_host(tok)):
            self.rows[r].proposed, self.rows[r].pending = proposed, []  # fed by draft_k
        b = len(rows)
        return Proposals(tok, q if self.temperature > 0 else None,
                         torch.full((b,), self.temperature == 0, device=tok.device),
                         torch.zeros(b, dtype=torch.bool, device="cpu"))

    def commit(self, rows, n, t):
        """Follow the outcome (n accepted, bonus t): the committed sequence grows by x_1..x_n, t.
        The cache keeps the committed prefix it holds; the committed tokens it lacks (t, and x_K
        when all K were accepted, since drafting never fed it) become pending."""
        for r, (n_r, t_r) in zip(rows, to_host(torch.stack([n, t], 1))):
            row = self.rows[r]
            keep = min(len(row.history) + n_r, self.cache.length(row.seq))
            row.history += row.proposed[:n_r] + [t_r]
            row.proposed = []
            self.cache.truncate(row.seq, keep)
            row.pending = row.history[keep:]

    def finish(self, rows):
        """Free the KV of rows that ended (EOS or max_new_tokens)."""
        for r in rows:
            self.cache.free(self.rows[r].seq)
            self.rows[r].seq = None

    def capture_seconds(self) -> float:
        """Seconds the draft has spent capturing CUDA graphs (decode.Captures)."""
        return self.model.capture_seconds()

    # -- continuous batching (scheduler.py): rows join and leave a running batch
    def add(self, prompts: list[list[int]]):
        """Rows joining: cache their prompts; they are numbered on from the rows already here.
        Returns the draft's own next-token law [len(prompts), V] for them."""
        new = [Row(self.cache.new_seq(), list(p)) for p in prompts]
        logits = self.model.prefill(self.cache, [row.seq for row in new], prompts)
        self.rows += new
        return draft_probs(logits, self.temperature)

    def leave(self, rows):
        """Rows that left (done or cancelled): their KV freed now, their history dropped."""
        self.finish([r for r in rows if self.rows[r] is not None and self.rows[r].seq is not None])
        for r in rows:
            self.rows[r] = None

    def used_blocks(self) -> int:
        """KV blocks in use (the server's /metrics)."""
        return self.cache.num_blocks - self.cache.num_free_blocks()


# --------------------------------------------------------------------------------------------------
# SSD: the speculator

PRE_SPEC = ("always", "auto", "never")  # never: the control that prices the process split alone


@dataclass
class SSDConfig:
    """SSD's knobs, checked once here (the names are generate()'s parameters)."""
    K: int = 4                          # draft tokens per round
    fan_out: str | list = "geometric"   # "geometric" (Theorem 12), "uniform", or F_0..F_K
    budget: int = 8                     # B = sum_j F_j: branches per sequence per round
    saguaro_c: float = 1.0              # C: Saguaro's down-weighting of the likely bonus tokens
    fallback: str = "auto"              # on a miss: "neural", "ngram", "random" or "auto" (by b*)
    fast_fallback: str = "ngram"        # the backup "auto" switches to at batch sizes >= b*
    pre_spec: str = "always"            # "auto": only while it measures faster (PreSpecGate);
                                        # "never": SD's schedule across the two processes

    def __post_init__(self):
        if self.budget < 1:
            raise ValueError(f"budget={self.budget}: the fan-out budget B must be >= 1")
        if not 0 <= self.saguaro_c <= 1:
            raise ValueError(f"saguaro_c={self.saguaro_c}: C must be in [0, 1]")
        if self.fallback not in POLICIES:
            raise ValueError(f"fallback={self.fallback!r}: use {', '.join(POLICIES)}")
        if self.pre_spec not in PRE_SPEC:
            raise ValueError(f"pre_spec={self.pre_spec!r}: use {', '.join(PRE_SPEC)}")
        if isinstance(self.fan_out, (list, tuple)):
            if len(self.fan_out) != self.K + 1 or min(self.fan_out) < 0:
                raise ValueError(f"fan_out={list(self.fan_out)}: give K+1 = {self.K + 1} "
                                 f"non-negative integers F_0..F_K")
            self.budget = sum(self.fan_out)  # an explicit fan-out is its own budget
        elif self.fan_out not in ("geometric", "uniform"):
            raise ValueError(f"fan_out={self.fan_out!r}: use geometric, uniform or K+1 integers")


@dataclass
class Branches:
    """One round's pre-speculated branches, batched: branch m drafts the next round for one
    guess."""
    seqs: list[int]       # [M] forked KV sequences
    guess: list[int]      # [M] the bonus token each one guessed (its first input)
    drafted: Drafted      # their draft steps: K, or fewer if the outcome arrived first
    F: list[int]          # the fan-out the next round's guesses will use


def recent_median(xs, window=64):
    """Median of the last `window` measurements: robust to outliers, constant cost per round."""
    recent = sorted(xs[-window:])
    return recent[len(recent) // 2]


class Speculator(Drafter):
    """SSD's draft side. Per round: `respond` to the verifier's outcome (n, t) from the speculation
    cache or a fallback, then `pre_speculate` the next round's outcomes while the verifier works."""

    def __init__(self, model, ssd: SSDConfig, temperature, seed, kv_tokens, block_size=16):
        super().__init__(model, ssd.K, temperature, seed, kv_tokens, block_size)
        self.ssd = ssd
        self.spec_cache = SpecCache(ssd.K)        # (row, n, t) -> branch index
        self.branches: Branches | None = None     # set by pre_speculate, used up by respond
        self.accept = AcceptanceTracker()         # a and r of the neural draft's proposals
        self.accept_fast = AcceptanceTracker()    # a of the fast backup's proposals
        # B of the next pre-speculation: the user's budget is its ceiling, the measured time its
        # limit (spec_cache.next_budget); an explicit fan-out is fixed
        self.B = ssd.budget
        self.adaptive = not isinstance(ssd.fan_out, (list, tuple))
        # B = 0 too: skip pre-speculation in rounds where measuring says it does not pay
        self.gate = PreSpecGate() if ssd.pre_spec == "auto" else None
        # branch noise: a generator reseeded each round from a host-side one (no device sync)
        self.seeds = torch.Generator().manual_seed(seed)
        self.branch_gen = torch.Generator(device=model.device)
        self.busy_seconds = 0.0
        self.pre_seconds, self.neural_seconds, self.fast_seconds = [], [], []
        self.round_seconds = []
        self.fallback_used = dict.fromkeys(BACKUPS, 0)
        self.b_star, self.b_star_terms = None, {}  # b* and what it was computed from (stats)
        self.stopped = self.finished = self.skipped = self.budget_sum = self.pre_rounds = 0

    def arrived(self, step: int) -> bool:
        """Has the verifier's outcome arrived? Checked before each pre-speculation step. In one
        process the verifier runs only after pre_speculate returns: never. The speculator's process
        looks at the channel instead (channel.speculator_main); tests force an arrival at a step."""
        return False

    def fan_out_for(self, fast: bool) -> list[int]:
        """F_0..F_K for a round whose proposals came from the neural draft or a fast backup (its
        acceptance a is lower, so more of the budget goes to shallow depths)."""
        tracker = self.accept_fast if fast else self.accept
        # until a warm-up's worth of rounds is measured, use the documented defaults
        a, r = (tracker.a(), self.accept.r()) if tracker.ready else (0.1 if fast else DEFAULT_A,
                                                                     DEFAULT_R)
        return fan_out(self.ssd.fan_out, a, r, self.K, self.B)

    def prefill(self, prompts):
        q0 = super().prefill(prompts)  # [b, V]: the draft's guess of the verifier's first token
        for r, row in enumerate(self.rows):  # round 0 proposes nothing: its outcome is (0, t0)
            row.q_raw, row.F = q0[r:r + 1], [self.B]
        return q0

    def pre_speculate(self, rows):
        """Guess each row's outcome (j, t) of the round being verified, fork a branch per guess at
        the committed prefix + j drafted tokens, feed t and draft K tokens for all branches of all
        rows as one batch per step (K steps; x_K is not fed: the branch that hits feeds it in the
        next round's feed_pending, with the other rows' pending tokens, rather than every branch
        paying one more step). Stops early when the outcome arrives: `respond` then finishes only
        the branch that hit. If the gate says it does not pay (or pre_spec is "never"), nothing is
        pre-speculated this round: the verifier works alone and every row misses."""
        if self.ssd.pre_spec == "never" or (self.gate is not None and not self.gate.choose(
                len(rows) * self.accept.expected_tokens(self.K))):  # E_off: neural proposals
            self.skipped += 1
            return
        start = time.perf_counter()
        self.feed_pending(rows)
        groups = {}  # rows sharing a fan-out vector pick their guesses in one batched call
        for r in rows:
            groups.setdefault(tuple(self.rows[r].F), []).append(r)
        owner, depth, guess = [], [], []  # per branch m: its row, depth j and guessed bonus t
        for F, group in groups.items():
            q_raw = torch.stack([self.rows[r].q_raw for r in group])  # [g, K+1, V]
            x = torch.tensor([self.rows[r].proposed for r in group], dtype=torch.long,
                             device="cpu").view(len(group), -1)  # [g, K]
            guesses = to_host(select_guesses_batch(q_raw, to_device(x, q_raw.device), list(F)))
            for i, j, g in guess_triples(guesses):
                owner.append(group[i]), depth.append(j), guess.append(g)
        seqs = [self.cache.fork(self.rows[r].seq, len(self.rows[r].history) + j)
                for r, j in zip(owner, depth)]
        F_next = self.fan_out_for(fast=False)  # a hit answers with neural proposals
        self.branch_gen.manual_seed(
            torch.randint(2**62, (1,), generator=self.seeds, device="cpu").item())
        drafted = Drafted()
        if seqs:
            drafted = draft_k(self.model, self.cache, seqs, [[g] for g in guess], self.K,
                              self.temperature, self.branch_gen, F=F_next[:self.K],
                              c=self.ssd.saguaro_c, stop=self.arrived)
        self.branches = Branches(seqs, guess, drafted, F_next)
        for m, (r, j, g) in enumerate(zip(owner, depth, guess)):
            self.spec_cache.put(r, j, g, m)
        seconds, stopped = time.perf_counter() - start, bool(seqs) and drafted.steps < self.K
        self.pre_seconds.append(seconds)
        self.busy_seconds += seconds
        self.stopped += stopped
        self.budget_sum, self.pre_rounds = self.budget_sum + self.B, self.pre_rounds + 1
        if self.adaptive and self.round_seconds:
            self.B = next_budget(self.B, self.ssd.budget,
                                 seconds / recent_median(self.round_seconds), stopped)

    def feed_pending(self, rows):
        """Feed, in one forward, the tokens of the proposals under verification that the draft has
        not fed: a fast backup's [t, x_1..x_K], or x_K after neural drafting (which stops at x_K
        so that the verifier gets it sooner). This caches their KV and completes q_0..q_K, the laws
        the guesses come from."""
        todo = [r for r in rows if self.rows[r].pending]
        if not todo:
            return
        counts = [len(self.rows[r].pending) for r in todo]
        logits = self.model.forward_cached(self.cache, [self.rows[r].seq for r in todo],
                                           [x for r in todo for x in self.rows[r].pending], counts)
        for r, q_new in zip(todo, draft_probs(logits, self.temperature).split(counts)):
            row = self.rows[r]
            q_raw = q_new if row.q_raw is None else torch.cat([row.q_raw, q_new])
            # after t, x_1..x_K: a fast backup's pending also holds earlier committed tokens when
            # the last round pre-speculated nothing
            row.q_raw = q_raw[-(self.K + 1):]  # [K+1, V]
            row.pending = []

    def respond(self, rows, n, t, round_seconds=None) -> Proposals:
        """The outcome (n, t) of the round just verified arrives for `rows`. Look each up in the
        speculation cache: a hit's branch becomes the row's sequence, its proposals are ready; a
        miss rolls back to the accepted prefix and the fallback proposes. Returns the next
        proposals."""
        start = time.perf_counter()  # the outcome arrived
        br, b, K = self.branches, len(rows), self.K
        # B and b* model rounds that pre-speculate: a skipped one's times are the gate's alone
        if round_seconds is not None and br is not None:
            self.round_seconds.append(round_seconds)
        hits, misses = [], []  # (i, branch m) / i
        outcome = to_host(torch.stack([n, t], 1))
        for i, (r, (n_r, t_r)) in enumerate(zip(rows, outcome)):
            row = self.rows[r]
            # the branch drafted for this outcome, or None (a round that pre-speculated nothing
            # looks nothing up)
            m = self.spec_cache.get(r, n_r, t_r) if br is not None else None
            (self.accept_fast if row.fast else self.accept).update(n_r, len(row.proposed))
            # a depth with no guesses always misses: it says nothing about r
            if br is not None and row.F[n_r] > 0:
                self.accept.observe_lookup(row.F[n_r], m is not None)
            row.history += row.proposed[:n_r] + [t_r]
            if m is not None:
                hits.append((i, m))
            else:  # miss: keep the accepted prefix the cache holds; the rest becomes pending
                keep = min(len(row.history) - 1, self.cache.length(row.seq))
                self.cache.truncate(row.seq, keep)
                row.pending = row.history[keep:]  # [t], or more if pre-speculation was skipped
                misses.append(i)
        parts = []  # (row positions, tokens [m, K], q [m, K, V] or None): hits, then misses
        if hits:  # the branch holds the committed tokens + the next x_1..x_K
            hit_tokens, hit_q, hit_q_raw = self.finish_branches([m for _, m in hits])
            for (i, m), proposed, q_raw in zip(hits, to_host(hit_tokens), hit_q_raw):
                row = self.rows[rows[i]]
                self.cache.free(row.seq)
                row.seq, row.proposed, row.q_raw, row.F, row.fast = (br.seqs[m], proposed, q_raw,
                                                                     br.F, False)
                row.pending = proposed[-1:]  # x_K: the next pre_speculate feeds it
            parts.append(([i for i, _ in hits], hit_tokens, hit_q))
        for m in self.spec_cache.clear():  # branches of outcomes that did not happen
            self.cache.free(br.seqs[m])
        self.branches = None
        one_hot = set()  # rows a fast backup proposed for: not sampled, tested one-hot
        if misses:
            backup = self.propose_on_miss([rows[i] for i in misses], b, skipped=br is None)
            parts.append((misses, backup.tokens, backup.q))
            if backup.q is None:
                one_hot = set(misses)
        tokens, q = in_row_order(parts, b, self.V if self.temperature > 0 else None)
        missed = set(misses)
        flags = [[self.temperature == 0 or i in one_hot, i not in missed] for i in range(b)]
        deterministic, hit = torch.tensor(flags, device="cpu").unbind(1)  # on the host
        now = time.perf_counter()
        self.busy_seconds += now - start
        if self.gate is not None:
            self.gate.answered(sum(n_r + 1 for n_r, _ in outcome), start, now)
        return Proposals(tokens, q, deterministic, hit)

    def finish_branches(self, ms):
        """The proposals of the branches that hit: tokens [h, K], q [h, K, V], q_raw [h, K, V].
        If pre-speculation stopped before x_K was drawn, these branches (and no others) draft their
        remaining steps now, with the noise they would have had in the full batch: the same tokens
        as without the stop. Feeding x_K waits for the next pre-speculation (feed_pending)."""
        br = self.branches
        idx = device_index(ms, self.model.device)
        d = br.drafted.rows(idx)
        if d.steps < self.K:
            d = draft_k(self.model, self.cache, [br.seqs[m] for m in ms],
                        [[br.guess[m]] for m in ms], self.K, self.temperature, self.branch_gen,
                        F=br.F[:self.K], c=self.ssd.saguaro_c, done=d,
                        of_batch=(len(br.seqs), idx))
            self.finished += len(ms)
        return d.stack()

    def propose_on_miss(self, miss_rows, b, skipped=False) -> fallback.Backup:
        """The fallback's proposals for the rows that missed, from the backup `backup_for` picks
        for batch size b (under "auto", the neural one after a round that pre-speculated nothing:
        the gate's "off" is SD's schedule); each row then holds what its next guesses need."""
        start = time.perf_counter()
        self.b_star = self.critical_batch_size()
        kind = "neural" if skipped and self.ssd.fallback == "auto" else self.backup_for(b)
        F = self.fan_out_for(fast=False)

        def neural():  # the draft, just in time: good tokens, costs SD's drafting (K steps)
            return draft_k(self.model, self.cache, [self.rows[r].seq for r in miss_rows],
                           [self.rows[r].pending for r in miss_rows], self.K, self.temperature,
                           self.gen, F=F[:self.K], c=self.ssd.saguaro_c).stack()

        backup = fallback.propose(kind, [self.rows[r].history for r in miss_rows], self.K, self.V,
                                  self.gen, neural)
        self.fallback_used[kind] += 1
        fast = backup.q_raw is None
        F = self.fan_out_for(fast=True) if fast else F
        for k, (r, proposed) in enumerate(zip(miss_rows, to_host(backup.tokens))):
            row = self.rows[r]
            row.proposed, row.F, row.fast = proposed, F, fast
            # tokens the draft has not fed yet go in at the start of pre_speculate (feed_pending):
            # all of a fast backup's, x_K of the neural one's
            row.q_raw, row.pending = ((None, row.pending + proposed) if fast
                                      else (backup.q_raw[k], proposed[-1:]))
        if not skipped:  # b*'s T_n, T_f: the backups' times for the rows that missed a cache
            (self.fast_seconds if fast else self.neural_seconds).append(time.perf_counter() - start)
        return backup

    def backup_for(self, b) -> str:
        """The backup for this miss round: the user's, or under "auto" the neural draft while
        b < b*, the fast backup from b* on. b* reads this run's measurements, each term replacing
        its cautious default once measured: a backup that turns out worse than assumed loses the
        comparison, and the other one gets used and measured."""
        return fallback.choose_fallback(self.ssd.fallback, b, self.b_star, self.ssd.fast_fallback)

    def critical_batch_size(self):
        """b* from what was measured so far (fallback.critical_batch_size has the formula). Until
        the draft's acceptance and the round times are measured: None, the neural backup, whose miss
        round costs what an SD round costs. (Starting from the paper's default b* instead sent every
        early miss at batch 8 to the n-gram backup; its rounds never measured the draft, so the
        default held: 338 against 418 tok/s with the neural backup at T = 1, batch 8, here.)"""
        if not self.round_seconds or not self.pre_seconds or not self.accept.ready:
            return None
        T_v = recent_median(self.round_seconds)  # latencies in verifications, recent rounds
        T_p = recent_median(self.pre_seconds) / T_v
        T_n = recent_median(self.neural_seconds) / T_v if self.neural_seconds else None
        T_f = recent_median(self.fast_seconds) / T_v if self.fast_seconds else None
        E_hit = self.accept.expected_tokens(self.K)
        E_f = (expected_tokens(self.accept_fast.a(), self.K) if self.accept_fast.rounds
               else None)
        self.b_star_terms = dict(p_hit=self.spec_cache.stats.hit_rate, E_hit=E_hit, T_p=T_p,
                                 E_f=E_f, T_f=T_f, T_n=T_n)
        return critical_batch_size(**self.b_star_terms)

    def stats(self) -> dict:
        st = self.spec_cache.stats
        return {"hits": st.hits, "misses": st.misses, "cache_hit_rate": st.hit_rate,
                "hits_per_depth": list(st.hits_per_depth),
                "lookups_per_depth": list(st.lookups_per_depth),
                "fallback_rounds": dict(self.fallback_used), "b_star": self.b_star,
                "b_star_terms": self.b_star_terms,
                "draft_busy_seconds": self.busy_seconds,
                "draft_capture_seconds": self.capture_seconds(),
                "pre_speculation_stopped": self.stopped, "branches_finished": self.finished,
                "pre_speculation_skipped": self.skipped,
                "gate_tok_s": (None if self.gate is None else
                               {"on": self.gate.rate_on(), "off": self.gate.rate_off()}),
                "mean_budget": self.budget_sum / self.pre_rounds if self.pre_rounds else 0.0,
                "fan_out": self.fan_out_for(fast=False), "acceptance_estimate": self.accept.a()}

    # -- continuous batching (scheduler.py)
    def add(self, prompts: list[list[int]]):
        """As Drafter's, and each new row starts as after prefill: round 0 proposes nothing, its
        outcome will be (0, t0). It has no branch unless the caller pre-speculates for it (a batch
        starting from empty), so a row joining a running batch misses once: the fallback proposes
        its first round."""
        q0 = super().add(prompts)
        for i, row in enumerate(self.rows[len(self.rows) - len(prompts):]):
            row.q_raw, row.F = q0[i:i + 1], [self.B]
        return q0

    def leave(self, rows):
        """As Drafter's, and the branches pre-speculated for these rows are freed now, not at the
        next respond (which looks up only the rows still running)."""
        gone = set(rows)
        for key in [key for key in self.spec_cache.entries if key[0] in gone]:
            self.cache.free(self.branches.seqs[self.spec_cache.entries.pop(key)])
        super().leave(rows)


def in_row_order(parts, b: int, V: int | None):
    """One round's proposals in row order: tokens [b, K] and q [b, K, V] (None when V is: at
    temperature 0) from parts (row positions, tokens [m, K], q [m, K, V] or None: deterministic
    rows, whose q the verifier never reads) covering rows 0..b-1. When the parts interleave, one
    index built on the host crosses to the device (indexing device tensors with a list would copy
    synchronously)."""
    order = [i for pos, _, _ in parts for i in pos]
    tokens = torch.cat([x for _, x, _ in parts])
    q = None
    if V is not None:
        q = torch.cat([x if x is not None else torch.zeros(*x_tok.shape, V, device=x_tok.device)
                       for _, x_tok, x in parts])
    if order == list(range(b)):
        return tokens, q
    where = [0] * b  # where[i]: row i's place in the concatenation
    for k, i in enumerate(order):
        where[i] = k
    idx = device_index(where, tokens.device)
    return tokens.index_select(0, idx), None if q is None else q.index_select(0, idx)


# --------------------------------------------------------------------------------------------------
# One loader for every mode

@dataclass
class DraftConfig:
    """What builds the draft side, here or in the speculator's process (it is pickled there)."""
    name: str                   # checkpoint directory, alias or GGUF file
    device: str
    dtype: torch.dtype
    K: int
    temperature: float
    seed: int
    kv_tokens: int
    block_size: int = 16
    ssd: SSDConfig | None = None  # None: plain SD
    graphs: bool | None = None    # static shapes / CUDA graphs (Transformer.use_graphs)


def load_draft(c: DraftConfig) -> Drafter:
    """Load the draft model: a Drafter for SD, a Speculator for SSD."""
    model, _ = load_model(c.name, device=c.device, dtype=c.dtype, tokenizer=False)
    model.use_graphs(c.graphs)
    if c.ssd is None:
        return Drafter(model, c.K, c.temperature, c.seed, c.kv_tokens, c.block_size)
    return Speculator(model, c.ssd, c.temperature, c.seed, c.kv_tokens, c.block_size)
