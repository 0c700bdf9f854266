"""The draft side: draft up to K tokens (SD); pre-speculate the next round's guessed outcomes (SSD).

Read in this order: `DraftSettings` (how the draft proposes), `draft_k` (its inner loop), `Drafter`
(plain SD: prefill, draft, follow the verifier's outcome), then `Speculator`, which adds SSD: while
the target verifies a round, guess its likely outcomes (n, t) and draft the next round for each
(`pre_speculate`); when the real outcome arrives, answer from the speculation cache (a hit) or a
fallback (a miss) (`respond`: `look_up`, `roll_back`, `adopt`, `propose_on_miss`). What the
speculator measures and decides from that is spec_policy.SpecPolicy's.

Invariant: a row's KV cache holds a prefix of its committed tokens + its proposals under
verification; the rest is unfed (`Drafter.unfed`: the last bonus t, the last proposal, a fast
backup's tokens), and the next forward feeds it first.
"""
import numbers
import time
from dataclasses import dataclass, field

import torch

import fallback
from fallback import POLICIES
from checkpoint import load_model
from cpu_linear import ROWS, use_forms
from devices import device_index, to_device, to_host
from kv_cache import PagedKVCache
from model import Transformer
from quantize import warm_up
from saguaro_sample import (draw, exp_noise, guess_probs_from_logits, row_seed,
                            row_settings, row_temperatures)
from spec_cache import SpecCache, check_fan_out, guess_triples, select_guesses_batch
from spec_policy import PRE_SPEC, SpecPolicy


@dataclass
class Proposals:
    """One round's proposals for b rows: what the verifier needs to test them exactly. Row i
    proposes lengths[i] <= K tokens (K when every row drafts to the end; fewer where the draft
    stopped early, DraftSettings.confidence); its tokens past that are padding, never tested."""
    tokens: torch.Tensor         # [b, W] x_1..x_W, W = the longest row's length (<= K)
    q: torch.Tensor | None       # [b, W, V] the law each x_i was drawn from (q or Saguaro's q');
                                 #   None when every row is greedy: the test reads the tokens
    deterministic: torch.Tensor  # [b] bool: not drawn from q (greedy, n-gram, random): one-hot test
    hit: torch.Tensor            # [b] bool: answered from the speculation cache
    lengths: list[int]           # each row's proposal length (host data: it crosses as a list)


# row_seed's streams of a row's draft-side draws (verify.py's is 0)
NOISE_STREAM, RANDOM_STREAM = 1, 2


@dataclass(frozen=True)
class DraftSettings:
    """How the draft side proposes: generate()'s draft parameters in one object, handed unchanged
    to the Drafter or Speculator, the speculator's process and bench.py (which sweeps any field by
    name). Checked once, here. The fields from fan_out on are SSD's."""
    K: int = 4                  # the most draft tokens a round proposes (a row may stop sooner)
    # stop a row's proposal after the first token the draft gives a probability below this (its
    # law at T > 0, the T = 1 softmax at T = 0), as assisted generation's assistant_confidence_
    # threshold does; 0: always K. Exact: the draft's side decides, the verifier tests what came
    confidence: float = 0.0
    fan_out: str | list = "geometric"  # the rule (spec_cache.FAN_OUTS), or F_0..F_K given
    budget: int = 8             # the ceiling of B = sum_j F_j, branches per row per round: B
                                # adapts below it to the time a round has (SpecPolicy)
    saguaro_c: float = 1.0      # C: Saguaro's down-weighting of the likely bonus tokens
    fallback: str = "auto"      # on a miss: "neural", "ngram", "random" or "auto" (by b*)
    fast_fallback: str = "ngram"  # the backup "auto" switches to at batch sizes >= b*
    pre_spec: str = "always"    # "auto": only while it measures faster (PreSpecGate);
                                # "never": SD's schedule across the two processes
    fixed_budget: bool = False  # B stays `budget` (experiments); else it adapts to time

    def __post_init__(self):
        for ok, problem in (
                (isinstance(self.K, numbers.Integral) and 1 <= self.K <= 64,
                 f"k={self.K} is impossible: use 1 <= k <= 64 draft tokens per round"),
                (0 <= self.confidence < 1, f"confidence={self.confidence}: use a probability in "
                                           f"[0, 1) (0: the draft always proposes K tokens)"),
                (self.budget >= 1, f"budget={self.budget}: the fan-out budget B must be >= 1"),
                (0 <= self.saguaro_c <= 1, f"saguaro_c={self.saguaro_c}: C must be in [0, 1]"),
                (self.fallback in POLICIES, f"fallback={self.fallback!r}: use {POLICIES}"),
                (self.pre_spec in PRE_SPEC, f"pre_spec={self.pre_spec!r}: use {PRE_SPEC}")):
            if not ok:
                raise ValueError(problem)
        fan_out = check_fan_out(self.fan_out, self.K)
        object.__setattr__(self, "fan_out", fan_out)  # normalised once (frozen: never after)
        if isinstance(fan_out, list):
            object.__setattr__(self, "budget", sum(fan_out))  # an explicit one is its own budget


@dataclass
class Drafted:
    """Draft steps so far for a batch of sequences. Step i feeds each sequence still drafting one
    token (its `first` tokens at i = 0, then x_i) and draws x_{i+1}; a proposal's last token is left
    to the caller's next forward. A sequence stops after K tokens or sooner (`ended`)."""
    tokens: list = field(default_factory=list)  # per step i: x_{i+1} [b] (0 where ended)
    q: list = field(default_factory=list)       # per step i: the law x_{i+1} came from [b, V]
    guess_probs: list = field(default_factory=list)  # per step i: `draw`'s guess_probs [b, V]
    ended: list = field(default_factory=list)   # per sequence: its proposal length once it stopped
                                                #   early, else None

    @property
    def steps(self) -> int:
        return len(self.tokens)

    def drafting(self) -> list[int]:
        """The sequences still drafting."""
        return [s for s, e in enumerate(self.ended) if e is None]

    def lengths(self) -> list[int]:
        """Each sequence's proposal length so far."""
        return [self.steps if e is None else e for e in self.ended]

    def rows(self, idx, which: list[int]) -> "Drafted":
        """These sequences' steps (idx: their positions as a device index, which: on the host)."""
        return Drafted([x[idx] for x in self.tokens], [x[idx] for x in self.q],
                       [x[idx] for x in self.guess_probs], [self.ended[s] for s in which])

    def stack(self):
        """-> tokens [b, W], q [b, W, V], guess_probs [b, W, V], lengths (b ints), W the longest
        length (the steps taken)."""
        return (torch.stack(self.tokens, 1), torch.stack(self.q, 1),
                torch.stack(self.guess_probs, 1), self.lengths())


def draft_k(model: Transformer, cache: PagedKVCache, seqs, first, K, temperature, noise, *,
            F=None, c=1.0, confidence=0.0, stop=None, done: Drafted | None = None,
            of=None) -> Drafted:
    """Feed each sequence its `first` tokens (a list per row, e.g. [t] or [x_K, t]), then draft up
    to K tokens a step at a time, the sequences still drafting together. temperature: one float, or
    a tensor [b]; noise [n, K, V]: step i's is noise[:, i] (None when greedy), its row of[s] for
    sequence s (SSD's branches share their row's; None: row s). With F (K ints) and C < 1, step i
    samples Saguaro's q' (its set: the top F[i] + 1 tokens). confidence > 0: a sequence stops after
    a token its guess_probs give less (a host read per step). stop(step) -> True ends the drafting
    before that step (SSD: the outcome arrived); done continues an earlier call's steps."""
    d = done if done is not None else Drafted(ended=[None] * len(seqs))
    while d.steps < K and d.drafting() and not (stop is not None and stop(d.steps)):
        i, live = d.steps, d.drafting()
        every = len(live) == len(seqs)
        at = None if every else device_index(live, model.device)  # the live rows' positions
        if i == 0:
            step_in, counts = [x for f in first for x in f], [len(f) for f in first]
        else:
            step_in, counts = d.tokens[i - 1], [1] * len(live)
            step_in = step_in if every else step_in.index_select(0, at)
        logits = model.forward_cached(cache, [seqs[s] for s in live], step_in, counts,
                                      last_only=True)                          # [live, V]
        e = None if noise is None else noise[:, i]                             # [n, V]
        e = e.index_select(0, of) if e is not None and of is not None else e    # [b, V]
        T = temperature
        if not every:
            e = None if e is None else e.index_select(0, at)                   # [live, V]
            T = T.index_select(0, at) if isinstance(T, torch.Tensor) else T
        x, q, probs = draw(logits, T, e, None if F is None else F[i], c)
        if not every:  # back to one slot per sequence; the ended ones' are never read
            x = x.new_zeros(len(seqs)).index_copy_(0, at, x)
            q = q.new_zeros(len(seqs), q.shape[-1]).index_copy_(0, at, q)
            probs = probs.new_zeros(len(seqs), probs.shape[-1]).index_copy_(0, at, probs)
        d.tokens.append(x), d.q.append(q), d.guess_probs.append(probs)
        if confidence > 0 and i + 1 < K:
            sure = to_host(probs.gather(1, x[:, None]).squeeze(1) >= confidence)
            for s in live:
                d.ended[s] = None if sure[s] else i + 1
    return d


@dataclass
class Row:
    """One sequence on the draft side: all the draft keeps about it, so a row can join or leave
    the batch alone (docs/design.md section 3 traces one). Its KV cache always holds a prefix of
    history + proposed; the rest is unfed (Drafter.unfed), and the next forward feeds it first."""
    seq: int | None        # its sequence in the draft's KV cache (None once released)
    history: list[int]     # committed tokens: prompt + output
    proposed: list[int] = field(default_factory=list)  # x_1..x_L being verified ([] in between)
    # SSD only: q_0..q_m, the draft's guess_probs after history + x_1..x_j for every j whose
    # prefix the cache has fed (m = cached tokens - len(history)): what its guesses at depth j
    # rank by. None while the cache lacks a committed token (after a fast backup proposed)
    guess_probs: torch.Tensor | None = None
    fast_backup: bool = False  # a fast backup (n-gram, random) proposed: it sets a for the fan-out
    temperature: float = 0.0   # the row's own
    seed: int = 0              # the row's own: its draws are keyed to it (Drafter.noise)
    drafts: int = 0            # proposal sets made for it so far: the next one's index d
    gen: torch.Generator | None = None  # reseeded for each of its draws (Drafter.noise)

    def take(self, proposed: list[int], guess_probs=None, fast_backup=False):
        """New proposals for the round about to be verified (the draft's, a branch's or a fast
        backup's), with the guess_probs the cache now has for them."""
        self.proposed, self.guess_probs, self.fast_backup = proposed, guess_probs, fast_backup
        self.drafts += 1

    def commit(self, n: int, t: int):
        """The outcome (n accepted, bonus t): history grows by x_1..x_n, t; nothing is proposed."""
        self.history += self.proposed[:n] + [t]
        self.proposed = []


class Drafter:
    """Plain speculative decoding's draft: prefill, draft up to K tokens, follow the verifier's
    outcome."""

    def __init__(self, model: Transformer, spec: DraftSettings, temperature: float, seed: int,
                 kv_tokens: int, *, block_size=16, prefix_caching=False):
        self.model, self.spec, self.K, self.temperature = model, spec, spec.K, temperature
        # its own prefix cache (kv_cache.py): a prompt's blocks the draft has, whatever the target's
        self.cache = model.new_cache(kv_tokens, block_size, prefix_caching=prefix_caching)
        self.seeds = torch.Generator().manual_seed(seed)  # of rows that give no seed
        self.V = model.config.vocab_size
        self.rows: list[Row] = []

    def add(self, prompts: list[list[int]], *, first: int | None = None, temps=None, seeds=None):
        """Rows joining (at a round boundary: scheduler.py): cache their prompts; they are numbered
        on from the rows here, or from `first` (a speculator started anew after one died never saw
        the rows before it). temps, seeds: each row's (saguaro_sample.row_settings). Returns the
        draft's next-token probabilities [len(prompts), V] for them."""
        if first is not None:
            self.rows += [None] * (first - len(self.rows))
        temps, seeds = row_settings(len(prompts), temps, seeds, self.temperature, self.seeds)
        new = [Row(self.cache.new_seq(), list(p), temperature=T, seed=s,
                   gen=torch.Generator(device=self.model.device))
               for p, T, s in zip(prompts, temps, seeds)]
        logits = self.model.prefill(self.cache, [row.seq for row in new], prompts)
        self.rows += new
        return guess_probs_from_logits(logits, row_temperatures(temps, logits.device))

    def unfed(self, row: Row) -> list[int]:
        fed = self.cache.length(row.seq)  # what of history + proposed the cache lacks (no copy)
        return row.history[fed:] + row.proposed[max(0, fed - len(row.history)):]

    def temperature_of(self, rows):
        """The temperature argument for these rows (saguaro_sample.row_temperatures)."""
        return row_temperatures([self.rows[r].temperature for r in rows], self.model.device)

    def noise(self, rows):
        """The Exp(1) noise [b, K, V] the rows' next proposals are drawn with (None when all are
        greedy): row r's from its seed and proposal index d alone (row_seed(seed, NOISE_STREAM, d)),
        so its tokens do not depend on the batch, and SSD's branch for the outcome that happens
        draws what its fallback would have."""
        if all(self.rows[r].temperature == 0 for r in rows):
            return None
        gens = [self.rows[r].gen.manual_seed(row_seed(self.rows[r].seed, NOISE_STREAM,
                                                      self.rows[r].drafts)) for r in rows]
        return exp_noise((len(rows), self.K, self.V), gens)

    def draft_rows(self, rows, *, F=None) -> Drafted:
        """Up to K tokens for each of the rows, from their committed tokens (what they have not fed
        goes in first), with their noise; F: Saguaro's sets (SSD)."""
        return draft_k(self.model, self.cache, [self.rows[r].seq for r in rows],
                       [self.unfed(self.rows[r]) for r in rows], self.K, self.temperature_of(rows),
                       self.noise(rows), F=F, c=self.spec.saguaro_c,
                       confidence=self.spec.confidence)

    def draft(self, rows: list[int]) -> Proposals:
        """Draft up to K tokens for the given rows (in SD the verifier waits for this)."""
        tok, q, _, lengths = self.draft_rows(rows).stack()
        for r, proposed, L in zip(rows, to_host(tok), lengths):
            self.rows[r].take(proposed[:L])
        greedy_rows = [self.rows[r].temperature == 0 for r in rows]
        return Proposals(tok, None if all(greedy_rows) else q,
                         torch.tensor(greedy_rows, device="cpu"),
                         torch.zeros(len(rows), dtype=torch.bool, device="cpu"), lengths)

    def commit(self, rows, n, t):
        """Follow the outcome (n accepted, bonus t): the committed sequence grows by x_1..x_n, t.
        The cache keeps the committed prefix it holds; the committed tokens it lacks (t, and the
        last proposal when all were accepted, since drafting never fed it) are unfed."""
        for r, (n_r, t_r) in zip(rows, to_host(torch.stack([n, t], 1))):
            row = self.rows[r]
            self.cache.truncate(row.seq, min(len(row.history) + n_r, self.cache.length(row.seq)))
            row.commit(n_r, t_r)

    def release(self, rows):
        """Free the KV of rows that ended, after registering the full blocks of the committed tokens
        it holds (prefix caching: a chat's next turn starts with them)."""
        for r in rows:
            row = self.rows[r]
            self.cache.register(row.seq, row.history[:self.cache.length(row.seq)])
            self.cache.free(row.seq)
            row.seq = None

    def capture_seconds(self) -> float:
        """Seconds the draft has spent capturing CUDA graphs (decode.Captures)."""
        return self.model.capture_seconds()

    # -- continuous batching (scheduler.py): rows leave a running batch

    def leave(self, rows):
        """Rows that left (done or cancelled): their KV freed now, their history dropped."""
        self.release([r for r in rows
                      if self.rows[r] is not None and self.rows[r].seq is not None])
        for r in rows:
            self.rows[r] = None

    def used_blocks(self) -> int:
        """KV blocks in use (the server's /metrics)."""
        return self.cache.num_blocks - self.cache.num_free_blocks()

    def prefix_tokens(self) -> tuple[int, int]:
        """Prompt tokens looked up in the prefix cache, and found (the server's /metrics)."""
        return self.cache.prefix_queries, self.cache.prefix_hits


# --------------------------------------------------------------------------------------------------
# SSD: the speculator

@dataclass
class Branches:
    """One round's branches, batched: branch m drafts the next round for (row, j, guess[m])."""
    seqs: list[int]       # [M] forked KV sequences
    guess: list[int]      # [M] the bonus token each one guessed (its first input)
    drafted: Drafted      # their draft steps: K, or fewer if the outcome arrived first
    prior: list[int]      # the prior fan-out their Saguaro sets were drawn with (SpecPolicy.prior)
    row_F: dict           # row -> the F_0..F_K its guesses used (the power-law fit reads F_n)
    owner: list[int]      # [M] the row each one drafts for
    noise: torch.Tensor | None  # [rows, K, V] the rows' noise (Drafter.noise), or None (greedy)
    of: list[int]         # [M] each one's row of `noise`: a row's branches share its noise


class Speculator(Drafter):
    """SSD's draft side. Per round: `respond` to the verifier's outcome (n, t) (adopt the branches
    that hit, roll back the rows that missed and let a fallback propose), then `pre_speculate` the
    next round's outcomes while the verifier works; what it measures and decides is the
    SpecPolicy's. arrived(step) -> bool: has the outcome arrived (checked before each
    pre-speculation step; the speculator's process reads the channel)? By default never: in one
    process the verifier runs only after pre_speculate returns."""

    def __init__(self, model, spec: DraftSettings, temperature, seed, kv_tokens, *,
                 block_size=16, prefix_caching=False, arrived=None):
        super().__init__(model, spec, temperature, seed, kv_tokens, block_size=block_size,
                         prefix_caching=prefix_caching)
        self.policy = SpecPolicy(spec)
        self.spec_cache = SpecCache(spec.K)       # (row, n, t) -> branch index m
        self.branches: Branches | None = None     # set by pre_speculate, used up by respond
        self.completed = 0                        # branches completed alone after a stop
        self.arrived = arrived or (lambda step: False)

    def add(self, prompts, *, first=None, temps=None, seeds=None):
        """As Drafter's; a new row's round 0 proposes nothing, its outcome will be (0, t0), and q_0
        [1, V] ranks its guesses of t0. Only a batch that starts empty pre-speculates round 0: a row
        joining a running batch misses once, and the fallback proposes its first round."""
        q0 = super().add(prompts, first=first, temps=temps, seeds=seeds)  # [b, V]
        for i, row in enumerate(self.rows[len(self.rows) - len(prompts):]):
            row.guess_probs = q0[i:i + 1]
        return q0

    # -- pre-speculation: while the verifier verifies

    def pre_speculate(self, rows):
        """Guess each row's outcome (j, t) of the round being verified, fork a branch per guess at
        the committed prefix + j drafted tokens, feed t and draft up to K tokens for all branches
        of all rows as one batch per step (a proposal's last token is left to the next round's
        feed_unfed). Stops early when the outcome arrives: `respond` then completes only the
        branch that hit. If the policy says no (the gate, pre_spec "never"), nothing is
        pre-speculated: the verifier works alone and every row misses."""
        if not self.policy.pre_speculate_now(len(rows)):
            return
        start = time.perf_counter()
        self.feed_unfed(rows)
        owner, depth, guess, row_F = self.choose_guesses(rows)
        seqs = [self.cache.fork(self.rows[r].seq, len(self.rows[r].history) + j)
                for r, j in zip(owner, depth)]
        prior = self.policy.prior()  # a hit answers with the draft's proposals
        # a row's branches share its noise: the one that hits proposes what the fallback would have
        at = {r: i for i, r in enumerate(rows)}
        noise, of = (self.noise(rows) if seqs else None), [at[r] for r in owner]
        drafted = Drafted()
        if seqs:
            drafted = draft_k(self.model, self.cache, seqs, [[g] for g in guess], self.K,
                              self.temperature_of(owner), noise, F=prior[:self.K],
                              c=self.spec.saguaro_c, confidence=self.spec.confidence,
                              stop=self.arrived, of=device_index(of, self.model.device))
        self.branches = Branches(seqs, guess, drafted, prior, row_F, owner, noise, of)
        for m, (r, j, g) in enumerate(zip(owner, depth, guess)):
            self.spec_cache.put(r, j, g, m)
        self.policy.pre_speculated(time.perf_counter() - start,
                                   stopped=bool(seqs) and bool(drafted.drafting())
                                   and drafted.steps < self.K)

    def feed_unfed(self, rows):
        """Feed, in one forward, the tokens the rows' caches lack (the last proposal after neural
        drafting, which the verifier got sooner for it; a fast backup's, and committed tokens before
        them): their KV, and guess_probs completed to q_0..q_L, what the guesses rank by."""
        unfed = {r: self.unfed(self.rows[r]) for r in rows}
        todo = [r for r in rows if unfed[r]]
        if not todo:
            return
        counts = [len(unfed[r]) for r in todo]
        logits = self.model.forward_cached(self.cache, [self.rows[r].seq for r in todo],
                                           [x for r in todo for x in unfed[r]], counts)
        T = self.temperature_of([r for r, c in zip(todo, counts) for _ in range(c)])  # per token
        for r, new in zip(todo, guess_probs_from_logits(logits, T).split(counts)):
            row = self.rows[r]
            probs = new if row.guess_probs is None else torch.cat([row.guess_probs, new])
            row.guess_probs = probs[-(len(row.proposed) + 1):]  # [L+1, V]: after history + x_1..x_j

    def choose_guesses(self, rows):
        """Each row's guesses (j, t): its fan-out F_0..F_K (SpecPolicy.row_fan_out: depths past its
        L get none), then the top F_j tokens at each depth j (spec_cache.select_guesses_batch).
        Returns per branch its row, depth j and guess t, and each row's F."""
        K = self.K
        probs, drafted, F = [], [], []
        for r in rows:
            row = self.rows[r]
            p = row.guess_probs                                      # [L+1, V]
            probs.append(torch.cat([p, p.new_zeros(K + 1 - len(p), p.shape[-1])]))
            drafted.append(row.proposed + [-1] * (K - len(row.proposed)))  # -1: nothing excluded
            F.append(self.policy.row_fan_out(p, row.proposed, row.fast_backup))
        probs = torch.stack(probs)                                   # [b, K+1, V]
        x = to_device(torch.tensor(drafted, dtype=torch.long, device="cpu").view(len(rows), K),
                      probs.device)                                  # [b, K]
        guesses = to_host(select_guesses_batch(probs, x, F))
        owner, depth, guess = [], [], []
        for i, j, g in guess_triples(guesses):
            owner.append(rows[i]), depth.append(j), guess.append(g)
        return owner, depth, guess, dict(zip(rows, F))

    # -- the answer: when the outcome arrives

    def respond(self, rows, n, t, *, round_seconds=None) -> Proposals:
        """The outcome (n, t) of the round just verified, for `rows`: a hit adopts its branch, whose
        proposals are ready; a miss rolls back and the fallback proposes. -> the next proposals."""
        self.policy.outcome_arrived(round_seconds, pre_speculated=self.branches is not None)
        outcome = to_host(torch.stack([n, t], 1))
        hits, misses = self.look_up(rows, outcome)
        self.roll_back([rows[i] for i in misses])
        parts = []  # (row positions, tokens [m, W], q [m, W, V] or None, lengths): hits, misses
        if hits:
            parts.append(([i for i, _ in hits], *self.adopt([(rows[i], m) for i, m in hits])))
        skipped = self.branches is None
        self.free_branches()
        backup = None
        if misses:
            backup = self.propose_on_miss([rows[i] for i in misses], len(rows), skipped=skipped)
            parts.append((misses, backup.tokens, backup.q, backup.lengths))
        greedy_rows = [self.rows[r].temperature == 0 for r in rows]
        tokens, q, lengths = in_row_order(parts, len(rows), None if all(greedy_rows) else self.V)
        # deterministic (tested one-hot): greedy rows, a fast backup's
        one_hot = set(misses) if backup is not None and backup.q is None else set()
        flags = [[greedy_rows[i] or i in one_hot, i not in misses] for i in range(len(rows))]
        deterministic, hit = torch.tensor(flags, device="cpu").unbind(1)  # on the host
        self.policy.answered(sum(n_r + 1 for n_r, _ in outcome))
        return Proposals(tokens, q, deterministic, hit, lengths)

    def look_up(self, rows, outcome):
        """Each row's outcome (n, t) looked up (if the round pre-speculated), shown to the policy
        and committed. Returns the hits [(position, branch m)] and the misses [position]."""
        br, hits, misses = self.branches, [], []
        for i, (r, (n_r, t_r)) in enumerate(zip(rows, outcome)):
            row = self.rows[r]
            m = self.spec_cache.get(r, n_r, t_r) if br is not None else None
            # a row that joined after this round's pre-speculation has no fan-out in it
            F_n = br.row_F[r][n_r] if br is not None and r in br.row_F else None
            self.policy.observe(n_r, len(row.proposed), row.fast_backup, F_n, m is not None)
            row.commit(n_r, t_r)
            if m is not None:
                hits.append((i, m))
            else:
                misses.append(i)
        return hits, misses

    def roll_back(self, miss_rows):
        """A miss keeps the committed prefix its cache holds (all but t, or less); rest unfed."""
        for r in miss_rows:
            row = self.rows[r]
            self.cache.truncate(row.seq, min(len(row.history) - 1, self.cache.length(row.seq)))
            row.guess_probs = None

    def adopt(self, hits):
        """A hit's branch becomes its row's sequence (committed tokens, then x'_1..x'_{L-1}; x'_L
        unfed). hits: (row, branch m) pairs. -> tokens [h, W], q [h, W, V], lengths."""
        tokens, q, probs, lengths = self.complete_branches([m for _, m in hits])
        for (r, m), proposed, p, L in zip(hits, to_host(tokens), probs, lengths):
            row = self.rows[r]
            self.cache.free(row.seq)
            row.seq = self.branches.seqs[m]
            row.take(proposed[:L], p[:L])  # q_0..q_{L-1}: after t, x'_1..x'_{L-1}
        return tokens, q, lengths

    def complete_branches(self, ms):
        """The proposals of the branches that hit: tokens [h, W], q [h, W, V], guess_probs
        [h, W, V], lengths. If pre-speculation stopped early, these branches alone draft their
        remaining steps now, with their rows' noise: the same tokens as without the stop."""
        br, dev = self.branches, self.model.device
        d = br.drafted.rows(device_index(ms, dev), ms)
        if d.steps < self.K and d.drafting():
            d = draft_k(self.model, self.cache, [br.seqs[m] for m in ms],
                        [[br.guess[m]] for m in ms], self.K,
                        self.temperature_of([br.owner[m] for m in ms]), br.noise,
                        F=br.prior[:self.K], c=self.spec.saguaro_c,
                        confidence=self.spec.confidence, done=d,
                        of=device_index([br.of[m] for m in ms], dev))
            self.completed += len(ms)
        return d.stack()

    def free_branches(self):
        """Free the branches of outcomes that did not happen; the round's cache is used up."""
        for m in self.spec_cache.clear():
            self.cache.free(self.branches.seqs[m])
        self.branches = None

    def propose_on_miss(self, miss_rows, b, *, skipped=False) -> fallback.Backup:
        """The fallback's proposals for the rows that missed, from the backup the policy picks for
        batch size b; each row then holds what its next guesses need."""
        start = time.perf_counter()
        kind = self.policy.choose_backup(b, skipped, self.spec_cache.stats.hit_rate)
        prior = self.policy.prior()

        def neural():  # the draft, just in time: good tokens, costs SD's drafting (K steps)
            return self.draft_rows(miss_rows, F=prior[:self.K]).stack()

        gens = [self.rows[r].gen for r in miss_rows]
        if kind == "random":  # a row's random tokens are keyed to it, as its noise is
            gens = [g.manual_seed(row_seed(self.rows[r].seed, RANDOM_STREAM, self.rows[r].drafts))
                    for g, r in zip(gens, miss_rows)]
        backup = fallback.propose(kind, [self.rows[r].history for r in miss_rows], self.K, self.V,
                                  gens, neural)
        fast = backup.guess_probs is None
        for k, (r, proposed, L) in enumerate(zip(miss_rows, to_host(backup.tokens),
                                                 backup.lengths)):
            # feed_unfed feeds a fast backup's tokens, the neural one's last (q_0..q_{L-1} here)
            self.rows[r].take(proposed[:L], None if fast else backup.guess_probs[k][:L], fast)
        self.policy.backup_took(fast, time.perf_counter() - start, skipped)
        return backup

    def stats(self) -> dict:
        st = self.spec_cache.stats
        s = {"hits": st.hits, "misses": st.misses, "cache_hit_rate": st.hit_rate,
             "hits_per_depth": list(st.hits_per_depth),
             "lookups_per_depth": list(st.lookups_per_depth),
             "draft_capture_seconds": self.capture_seconds(),
             "branches_completed": self.completed, **self.policy.stats()}
        # the draft's graph captures and compiles happen inside its busy time; decode time leaves
        # them out (set-up, decode.Captures), so busy time does too
        s["draft_busy_seconds"] = max(0.0, s["draft_busy_seconds"] - s["draft_capture_seconds"])
        return s

    # -- continuous batching (scheduler.py)

    def check(self):
        """Nothing to check: it runs in the caller's process (channel.py's may die)."""

    def leave(self, rows):
        """As Drafter's, and the branches pre-speculated for these rows are freed now, not at the
        next respond (which looks up only the rows still running)."""
        for m in self.spec_cache.drop_rows(rows):
            self.cache.free(self.branches.seqs[m])
        super().leave(rows)


def in_row_order(parts, b: int, V: int | None):
    """One round's proposals in row order: tokens [b, W], q [b, W, V] (None when V is) and
    lengths from parts (row positions, tokens [m, w], q [m, w, V] or None for deterministic rows,
    lengths) covering rows 0..b-1, padded to the widest. Interleaved parts are reordered by one
    index built on the host (indexing device tensors with a list would copy synchronously)."""
    order = [i for pos, _, _, _ in parts for i in pos]
    W = max(x.shape[1] for _, x, _, _ in parts)
    pad = torch.nn.functional.pad
    tokens = torch.cat([pad(x, (0, W - x.shape[1])) for _, x, _, _ in parts])
    lengths = [L for _, _, _, Ls in parts for L in Ls]
    q = None
    if V is not None:
        q = torch.cat([pad(x, (0, 0, 0, W - x.shape[1])) if x is not None
                       else torch.zeros(*x_tok.shape[:1], W, V, device=x_tok.device)
                       for _, x_tok, x, _ in parts])
    if order == list(range(b)):
        return tokens, q, lengths
    where = [0] * b  # where[i]: row i's place in the concatenation
    for k, i in enumerate(order):
        where[i] = k
    idx = device_index(where, tokens.device)
    return (tokens.index_select(0, idx), None if q is None else q.index_select(0, idx),
            [lengths[k] for k in where])


# --------------------------------------------------------------------------------------------------
# One loader for every mode

@dataclass
class DraftConfig:
    """What builds the draft side, here or in the speculator's process (it is pickled there)."""
    name: str                   # checkpoint directory, alias or GGUF file
    device: str
    dtype: torch.dtype
    spec: DraftSettings
    ssd: bool                   # a Speculator (SSD); else a Drafter (SD)
    temperature: float
    seed: int
    kv_tokens: int
    block_size: int = 16
    graphs: bool | None = None    # static shapes / CUDA graphs (Transformer.use_graphs)
    vocab_size: int | None = None  # the target's: a draft padded to another size is read over it
    compile: bool | None = None   # torch.compile the graphs' layers (Transformer.use_graphs)
    quant: str = "auto"           # its weights (checkpoint.load_model, quantize.py)
    prefix_caching: bool = False  # its cache's (kv_cache.py)


def load_draft(c: DraftConfig, *, arrived=None) -> Drafter:
    """Load the draft model: a Drafter for SD, a Speculator for SSD (arrived: Speculator's)."""
    model, _ = load_model(c.name, device=c.device, dtype=c.dtype, tokenizer=False,
                          vocab_size=c.vocab_size, quant=c.quant)
    use_forms(model, ROWS)  # the CPU's product forms for any rows a round drafts (cpu_linear.py)
    warm_up(model, range(1, c.spec.K + 2))  # quantized products: a step to a catch-up (K + 1)
    model.use_graphs(c.graphs, c.compile)
    kw = dict(block_size=c.block_size, prefix_caching=c.prefix_caching)
    if not c.ssd:
        return Drafter(model, c.spec, c.temperature, c.seed, c.kv_tokens, **kw)
    return Speculator(model, c.spec, c.temperature, c.seed, c.kv_tokens, arrived=arrived, **kw)
