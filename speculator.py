"""SSD's draft side, the speculator: read after decode.py's `ssd_round`, which calls it, and
draft.py, which it builds on (a `Speculator` is a draft.Drafter that pre-speculates).

Per round (docs/design.md section 3, whose trace of one row tests/test_speculator.py runs):
`respond` to the verifier's outcome (n, t), a hit adopting the branch drafted for it, a miss rolling
back and letting a fallback propose (`look_up`, `roll_back`, `adopt`, `propose_on_miss`); then
`pre_speculate` the next round while the verifier works: feed each row's unfed tokens
(`feed_unfed`), guess its likely outcomes (j, t) (`choose_guesses`) and draft the next round for
each guess, all rows' `Branches` as one batch. What the speculator measures and decides from that is
spec_policy.SpecPolicy's. `in_row_order` puts a round's hits and misses back in row order.

From draft.py: `Proposals`, `Drafted`, `draft_k`, `Row` (`unfed`, `fed`, `take`, `commit`) and
`Drafter` (`unfed`, `keep_prefix`, `noise`, `draft_rows`). Used here before the reading order
shows them: `SpecCache`, `select_guesses_batch`, `guess_triples` (spec_cache.py), `SpecPolicy`
(spec_policy.py), `guess_probs_from_logits`, `row_seed` (saguaro_sample.py), `fallback.propose`
(fallback.py), the cache's `fork` and `free` (kv_cache.py), host/device copies (devices.py).
"""
import time
from dataclasses import dataclass

import torch

import fallback
from devices import device_index, to_device, to_host
from draft import RANDOM_STREAM, DraftSettings, Drafted, Drafter, Proposals, draft_k
from saguaro_sample import guess_probs_from_logits, row_seed
from spec_cache import SpecCache, guess_triples, select_guesses_batch
from spec_policy import SpecPolicy


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
        self.policy.rows_joined()
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
        for r, laws in zip(todo, guess_probs_from_logits(logits, T).split(counts)):
            self.rows[r].fed(laws)  # guess_probs [L+1, V]: after history + x_1..x_j, j = 0..L

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

    def respond(self, rows, n, t, *, features=None, round_seconds=None) -> Proposals:
        """The outcome (n, t) of the round just verified, for `rows`: a hit adopts its branch, whose
        proposals are ready; a miss rolls back and the fallback proposes. -> the next proposals.
        features: the target's of the tokens just verified (Verifier.features), for a draft that
        reads them (eagle.py); None for one that does not."""
        self.policy.outcome_arrived(round_seconds, pre_speculated=self.branches is not None)
        outcome = to_host(torch.stack([n, t], 1))
        hits, misses = self.look_up(rows, outcome)
        self.roll_back([rows[i] for i in misses])
        parts = []  # (row positions, tokens [m, W], q [m, W, V] or None, lengths): hits, misses
        if hits:
            parts.append(([i for i, _ in hits], *self.adopt([(rows[i], m) for i, m in hits])))
        skipped = self.branches is None
        self.free_branches()
        if features is not None:  # before the fallback drafts: a miss's backup reads them
            self.correct(rows, features, hit=[i for i, _ in hits])
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
            self.keep_prefix(row, len(row.history) - 1)  # history ends in t now: all but t
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

    def correct(self, rows, features, hit):
        """Follow the target's features of the tokens just verified (rows at positions `hit` hit):
        only a draft that reads them has anything to do (eagle.EagleSpeculator)."""

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
        if self.branches is not None and all(row is None for row in self.rows):
            self.branches = None  # nobody left to answer: the next batch starts without them


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
