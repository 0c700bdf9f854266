"""The draft side: drafting K tokens (speculative decoding) and pre-speculation (SSD / Saguaro).

Read in this order: `decode_k` (the draft's inner loop), `Drafter` (plain SD: prefill, draft, follow the
verifier's outcome), then `Speculator`, which adds SSD: while the target verifies round T, guess the
likely outcomes (n, t) of round T and draft round T+1 for each of them in advance (`pre_speculate`);
when the real outcome arrives, answer from the speculation cache (a hit) or from a fallback (a miss).

Invariant (the same as the verifier's): a sequence's KV cache holds every committed token except the
ones in `pending` (the last bonus token t, plus x_K when all K drafted tokens were accepted).
"""
import time
from dataclasses import dataclass

import torch

from fallback import (choose_fallback, critical_batch_size, default_critical_batch_size,
                      ngram_propose, random_propose)
from model import PagedKVCache, Transformer
from saguaro_sample import probs_from_logits, sample, saguaro
from spec_cache import DEFAULT_A, DEFAULT_R, AcceptanceTracker, SpecCache, fan_out, guess_triples


@dataclass
class Proposals:
    """One round's proposals for b rows: what the verifier needs to test them exactly."""
    tokens: torch.Tensor         # [b, K] x_1..x_K
    q: torch.Tensor              # [b, K, V] the distribution each x_i was drawn from (q, or Saguaro's q')
    deterministic: torch.Tensor  # [b] bool: proposals not drawn from q (greedy, n-gram, random): one-hot test
    hit: torch.Tensor            # [b] bool: answered from the speculation cache


def draft_probs(logits, temperature):
    """The draft's own distribution q, used to rank bonus-token guesses. At temperature 0 the draft is
    greedy (its q is one-hot), but the guesses still need a ranking: use the temperature-1 softmax."""
    return probs_from_logits(logits, temperature if temperature > 0 else 1.0)


def draw(logits, temperature, generator, f=None, c=1.0):
    """One draft sample per row. Returns (token [b], q_drawn [b, V], q_raw [b, V]): q_raw is the draft's
    own distribution; q_drawn is the one the token was actually drawn from (Saguaro's q' when f is set)."""
    q_raw = draft_probs(logits, temperature)
    if temperature == 0:
        return q_raw.argmax(-1), q_raw, q_raw
    q = saguaro(q_raw, f, c) if f is not None and c < 1 else q_raw
    return sample(q, generator), q, q_raw


def decode_k(model: Transformer, cache: PagedKVCache, seqs, first, K, temperature, generator,
             F=None, c=1.0, feed_last=False):
    """Feed each sequence its `first` tokens (a list per row, e.g. [t] or [x_K, t]), then draft K tokens
    one step at a time for all rows together. F (a list of K ints or None) and c select Saguaro sampling
    at each depth. With feed_last, x_K is fed too, so its KV is cached and q_raw[:, K] (the draft's
    distribution after x_K) is known. Returns tokens [b, K], q [b, K, V], q_raw [b, K(+1), V]."""
    counts = [len(f) for f in first]
    tokens, qs, raws = [], [], []
    step_in, step_counts = [x for f in first for x in f], counts
    for i in range(K + feed_last):
        logits = model.forward_cached(cache, seqs, step_in, step_counts, last_only=True)  # [b, V]
        if i == K:  # only feeding x_K
            raws.append(draft_probs(logits, temperature))
            break
        x, q, q_raw = draw(logits, temperature, generator, None if F is None else F[i], c)
        tokens.append(x), qs.append(q), raws.append(q_raw)
        step_in, step_counts = x, [1] * len(seqs)
    return torch.stack(tokens, 1), torch.stack(qs, 1), torch.stack(raws, 1)


class Drafter:
    """Plain speculative decoding's draft: prefill, draft K tokens, follow the verifier's outcome."""

    def __init__(self, model: Transformer, K: int, temperature: float, seed: int, kv_tokens: int, block_size=16):
        self.model, self.K, self.temperature = model, K, temperature
        self.cache = model.new_cache(kv_tokens, block_size)
        self.gen = torch.Generator(device=model.device).manual_seed(seed)
        self.V = model.config.vocab_size

    def prefill(self, prompts: list[list[int]]):
        """Cache every prompt token; returns the draft's raw next-token distribution [b, V]."""
        self.seqs = [self.cache.new_seq() for _ in prompts]
        self.pending = [[] for _ in prompts]
        self.history = [list(p) for p in prompts]  # committed tokens (prompt + output)
        self.proposed = {}  # row -> the K tokens now being verified
        logits = self.model.forward_cached(self.cache, self.seqs, [x for p in prompts for x in p],
                                           [len(p) for p in prompts], last_only=True)
        return draft_probs(logits, self.temperature)

    def draft(self, rows: list[int]) -> Proposals:
        """Draft K tokens for the given rows (in SD the verifier waits for this)."""
        tok, q, _ = decode_k(self.model, self.cache, [self.seqs[r] for r in rows], [self.pending[r] for r in rows],
                             self.K, self.temperature, self.gen)
        for i, r in enumerate(rows):
            self.proposed[r] = tok[i].tolist()
            self.pending[r] = []  # fed by decode_k
        b = len(rows)
        return Proposals(tok, q, torch.full((b,), self.temperature == 0), torch.zeros(b, dtype=torch.bool))

    def commit(self, rows, n, t):
        """Follow the verifier's outcome (n accepted, bonus t): the committed sequence grows by x_1..x_n, t.
        The cache keeps the committed prefix it already holds; whatever committed tokens it lacks (t, and
        x_K when all K were accepted, since drafting never fed it) become pending."""
        for r, n_r, t_r in zip(rows, n.tolist(), t.tolist()):
            x, s = self.proposed.pop(r, []), self.seqs[r]
            keep = min(len(self.history[r]) + n_r, self.cache.length(s))
            self.history[r] += x[:n_r] + [t_r]
            self.cache.truncate(s, keep)
            self.pending[r] = self.history[r][keep:]

    def finish(self, rows):
        """Free the KV of rows that ended (EOS or max_new_tokens)."""
        for r in rows:
            if self.seqs[r] is not None:
                self.cache.free(self.seqs[r])
                self.seqs[r] = None


# ----------------------------------------------------------------------------------------------------
# SSD: the speculator

@dataclass
class SSDConfig:
    fan_out: str | list = "geometric"  # "geometric" (Theorem 12), "uniform", or an explicit F_0..F_K
    budget: int = 8                     # B = sum_j F_j: branches pre-speculated per sequence per round
    saguaro_c: float = 1.0              # C: Saguaro's down-weighting of the likely bonus tokens
    fallback: str = "auto"              # on a miss: "neural", "ngram", "random", or "auto" (by b*)
    fast_fallback: str = "ngram"        # the backup "auto" switches to at batch sizes >= b*


def recent_median(xs, window=64):
    """Median of the last `window` measurements: robust to outliers, constant cost per round."""
    recent = sorted(xs[-window:])
    return recent[len(recent) // 2]


class Speculator(Drafter):
    """SSD's draft side. Per round: `respond` to the verifier's outcome (n, t) from the speculation cache
    or a fallback, then `pre_speculate` the next round's outcomes while the verifier works.

    Per row it holds `cur`: the proposals x_1..x_K now being verified, with the draft's raw distributions
    q_0..q_K at each depth (q_j: after j accepted tokens), from which the guesses for the outcome come."""

    def __init__(self, model, K, temperature, seed, kv_tokens, ssd: SSDConfig, block_size=16):
        super().__init__(model, K, temperature, seed, kv_tokens, block_size)
        self.ssd = ssd
        self.cache_index = SpecCache(K)
        self.accept = AcceptanceTracker()         # a (and r) of the neural draft's rounds
        self.accept_fast = AcceptanceTracker()    # a of the fast backup's proposals
        self.cur_fast = {}                        # row -> were its current proposals from a fast backup
        self.branches = None                      # this round's pre-speculated branches (batched tensors)
        self.busy_seconds = 0.0
        self.pre_seconds, self.fast_seconds, self.verify_seconds = [], [], []
        self.fallback_used = {"neural": 0, "ngram": 0, "random": 0}
        self.b_star = None

    # -- fan-out: which outcomes (j, t) to cache
    def fan_out_for(self, fast: bool) -> list[int]:
        """F_0..F_K for a round whose proposals came from the neural draft (fast=False) or from the fast
        backup (fast=True: its acceptance a is lower, so more of the budget goes to shallow depths)."""
        tracker = self.accept_fast if fast else self.accept
        # until a warm-up's worth of rounds is measured, use the documented defaults
        a, r = (tracker.a(), self.accept.r()) if tracker.ready else (0.1 if fast else DEFAULT_A, DEFAULT_R)
        return fan_out(self.ssd.fan_out, a, r, self.K, self.ssd.budget)

    def prefill(self, prompts):
        q0 = super().prefill(prompts)  # [b, V]: the draft's guess of the verifier's first token t0
        # round 0 has no proposals (K = 0): its outcome is (0, t0), all of the budget goes to depth 0
        self.cur = {r: ([], q0[r:r + 1], [self.ssd.budget]) for r in range(len(prompts))}
        return q0

    def pre_speculate(self, rows):
        """Guess each row's outcome (j, t) of the round being verified, fork one branch per guess at the
        committed prefix plus j drafted tokens, feed t and draft K tokens for all branches of all rows as
        one batch per step (K + 1 steps: x_K is fed too so a winning branch is complete)."""
        t0 = time.perf_counter()
        self.feed_fast_proposals(rows)
        groups = {}  # rows sharing a fan-out vector pick their guesses in one batched call
        for r in rows:
            groups.setdefault(tuple(self.cur[r][2]), []).append(r)
        rows_m, depths_m, guesses_m = [], [], []
        for F, group in groups.items():
            q_raw = torch.stack([self.cur[r][1] for r in group])  # [g, K+1, V]
            x = torch.tensor([self.cur[r][0] for r in group], dtype=torch.long, device=q_raw.device).view(len(group), -1)
            rr, dd, gg = guess_triples(q_raw, x, list(F))
            rows_m += [group[i] for i in rr.tolist()]
            depths_m += dd.tolist()
            guesses_m += gg.tolist()
        committed = {r: len(self.history[r]) for r in rows}
        forks = [self.cache.fork(self.seqs[r], committed[r] + j) for r, j in zip(rows_m, depths_m)]
        F_next = self.fan_out_for(fast=False)  # a hit answers with neural proposals: guessed with this vector
        tok, q, q_raw = decode_k(self.model, self.cache, forks, [[g] for g in guesses_m], self.K,
                                 self.temperature, self.gen, F=F_next[:self.K], c=self.ssd.saguaro_c,
                                 feed_last=True) if forks else (None, None, None)
        self.branches = (forks, tok, q, q_raw, F_next)
        for m, (r, j, g) in enumerate(zip(rows_m, depths_m, guesses_m)):
            self.cache_index.put(r, j, g, m)
        dt = time.perf_counter() - t0
        self.pre_seconds.append(dt)
        self.busy_seconds += dt

    def feed_fast_proposals(self, rows):
        """Rows answered by a fast backup (n-gram, random) have not run the draft on their proposals: feed
        [t, x_1..x_K] in one forward to cache their KV and get q_0..q_K for the guesses."""
        todo = [r for r in rows if self.pending[r]]
        if not todo:
            return
        counts = [len(self.pending[r]) for r in todo]
        logits = self.model.forward_cached(self.cache, [self.seqs[r] for r in todo],
                                           [x for r in todo for x in self.pending[r]], counts)
        probs = draft_probs(logits, self.temperature).split(counts)  # per row [K+1, V]
        for r, p in zip(todo, probs):
            self.cur[r] = (self.cur[r][0], p, self.cur[r][2])
            self.pending[r] = []

    def respond(self, rows, n, t, verify_seconds=None) -> Proposals:
        """The verifier's outcome for `rows` arrived: look each (row, n, t) up in the cache. A hit's branch
        becomes the sequence (its KV is already computed); a miss rolls back to the accepted prefix and
        asks the fallback. Returns the next round's proposals for these rows."""
        t0 = time.perf_counter()
        if verify_seconds is not None:
            self.verify_seconds.append(verify_seconds)
        forks, tok, q, q_raw, F_next = self.branches
        b, K, V = len(rows), self.K, self.V
        out_tok = torch.zeros(b, K, dtype=torch.long, device=self.model.device)
        out_q = torch.zeros(b, K, V, device=self.model.device)
        det = torch.full((b,), self.temperature == 0)
        hit = torch.zeros(b, dtype=torch.bool)
        misses = []
        for i, (r, n_r, t_r) in enumerate(zip(rows, n.tolist(), t.tolist())):
            x, _, F = self.cur[r]
            m = self.cache_index.get(r, n_r, t_r)
            (self.accept_fast if self.cur_fast.get(r) else self.accept).update(n_r, len(x))
            if F[n_r] > 0:  # (a depth with no guesses always misses; it says nothing about r)
                self.accept.observe_lookup(F[n_r], m is not None)
            self.history[r] += x[:n_r] + [t_r]
            if m is not None:  # hit: the branch already holds committed tokens + x_1..x_K of the next round
                self.cache.free(self.seqs[r])
                self.seqs[r] = forks[m]
                out_tok[i], out_q[i], hit[i] = tok[m], q[m], True
                self.cur[r] = (tok[m].tolist(), q_raw[m], F_next)
                self.cur_fast[r] = False
            else:              # miss: keep the accepted prefix, t is not in the cache yet
                self.cache.truncate(self.seqs[r], len(self.history[r]) - 1)
                self.pending[r] = [t_r]
                misses.append(i)
        for m in self.cache_index.clear():  # branches of outcomes that did not happen
            self.cache.free(forks[m])
        self.branches = ([], None, None, None, F_next)
        if misses:
            self.fallback_for(rows, misses, out_tok, out_q, det)
        self.busy_seconds += time.perf_counter() - t0
        return Proposals(out_tok, out_q, det, hit)

    def fallback_for(self, rows, misses, out_tok, out_q, det):
        """Propose for the rows that missed, with the policy's backup (fallback.py decides which)."""
        t0 = time.perf_counter()
        self.b_star = self.critical_batch_size()
        kind = choose_fallback(self.ssd.fallback, len(rows), self.b_star, fast=self.ssd.fast_fallback)
        self.fallback_used[kind] += 1
        miss_rows = [rows[i] for i in misses]
        if kind == "neural":  # the draft, just in time: good tokens, costs a full drafting pass
            F = self.fan_out_for(fast=False)
            tok, q, q_raw = decode_k(self.model, self.cache, [self.seqs[r] for r in miss_rows],
                                     [self.pending[r] for r in miss_rows], self.K, self.temperature, self.gen,
                                     F=F[:self.K], c=self.ssd.saguaro_c, feed_last=True)
            for k, (i, r) in enumerate(zip(misses, miss_rows)):
                out_tok[i], out_q[i] = tok[k], q[k]
                self.cur[r] = (tok[k].tolist(), q_raw[k], F)
                self.cur_fast[r] = False
                self.pending[r] = []
            return
        # a near-free backup: deterministic proposals, tested with a one-hot q by the verifier
        if kind == "ngram":
            tok = torch.tensor([ngram_propose(self.history[r], self.K) for r in miss_rows], dtype=torch.long)
        else:
            tok = random_propose(len(miss_rows), self.K, self.V, self.gen)
        F = self.fan_out_for(fast=True)
        for k, (i, r) in enumerate(zip(misses, miss_rows)):
            out_tok[i] = tok[k]
            det[i] = True
            self.cur[r] = (tok[k].tolist(), None, F)  # q_0..q_K come in feed_fast_proposals
            self.cur_fast[r] = True
            self.pending[r] = self.pending[r] + tok[k].tolist()
        self.fast_seconds.append(time.perf_counter() - t0)

    def critical_batch_size(self):
        """b* from what was measured so far (fallback.critical_batch_size documents the formula)."""
        if not self.verify_seconds or not self.pre_seconds or not self.accept.ready:
            return default_critical_batch_size(self.K, self.temperature)  # documented defaults until measured
        T_v = recent_median(self.verify_seconds)  # latencies in verifications, from the recent rounds
        T_p = recent_median(self.pre_seconds) / T_v
        T_f = recent_median(self.fast_seconds) / T_v if self.fast_seconds else 0.0
        st = self.cache_index.stats
        E_hit = self.accept.expected_tokens(self.K)
        E_f = self.accept_fast.expected_tokens(self.K) if self.accept_fast.ready else None
        return critical_batch_size(st.hit_rate, E_hit, T_p, E_f, T_f)

    def stats(self) -> dict:
        st = self.cache_index.stats
        return {"hits": st.hits, "misses": st.misses, "cache_hit_rate": st.hit_rate,
                "hits_per_depth": list(st.hits_per_depth), "lookups_per_depth": list(st.lookups_per_depth),
                "fallback_rounds": dict(self.fallback_used), "b_star": self.b_star,
                "draft_busy_seconds": self.busy_seconds,
                "fan_out": self.fan_out_for(fast=False), "acceptance_estimate": self.accept.a()}
