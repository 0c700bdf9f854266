"""What the speculator measures, and the choices it makes from that: beside the algorithm
(speculator.Speculator), not inside it.

Read top to bottom:
1. `recent_median`, `next_budget`: the budget B, adapted so that pre-speculation fits within one
   verification (or fixed: `--fixed-budget`, an explicit fan-out);
2. `PreSpecGate`: pre-speculate this round at all (`--pre-spec auto`);
3. `SpecPolicy`, one per speculator: its clocks (the verifier's rounds, pre-speculation, the
   backups, the answers), the acceptance trackers, B, the gate, b* and the backup it picks, and the
   fan-out in its two uses: `row_fan_out`, a row's F_0..F_K for its guesses, decided when they are
   chosen, and `prior`, the F that drafting uses for Saguaro's sets before any proposals exist.

The formulas these read stay beside the algorithm: the fan-out (Theorem 12) and the acceptance
estimates in spec_cache.py, b* (Theorem 17) in fallback.py.
"""
import statistics
import time
from collections import deque

import fallback
from fallback import BACKUPS
from spec_cache import DEFAULT_A, DEFAULT_R, AcceptanceTracker, expected_tokens, rule_fan_out

PRE_SPEC = ("always", "auto", "never")  # --pre-spec; never: the control that prices the split alone
# a fast backup's acceptance before it is measured: its proposals are rarely accepted, so its rows'
# fan-out puts most of B at depth 0
DEFAULT_A_FAST = 0.1


WINDOW = 64  # the measurements a median reads: the last 64 (the older are dropped)


def recent_median(xs):
    """Median of xs, the last WINDOW measurements (a deque that keeps no more): robust to
    outliers, constant cost per round."""
    recent = sorted(xs)
    return recent[len(recent) // 2]


def next_budget(B: int, ceiling: int, T_p: float, stopped: bool) -> int:
    """The budget B for the next pre-speculation, so that it fits within one verification.
    T_p: the last pre-speculation's time in verifications; stopped: the outcome arrived before it
    was done. Too slow: B shrinks by a quarter (at least 1); under 3/4 of a verification: it grows
    by one, up to `ceiling` (the user's budget). Additive increase, multiplicative decrease: it
    settles just under the verification time and recovers quickly from a slow round. Never below
    1: a round without pre-speculation is PreSpecGate's choice, not a budget of 0."""
    if stopped or T_p > 1:
        return max(1, B - max(1, B // 4))
    if T_p < 0.75:
        return min(ceiling, B + 1)
    return B


class PreSpecGate:
    """Pre-speculate this round at all? Where the draft's work slows the verifier (two CPU cores
    that share caches and memory bandwidth), pre-speculation that rarely hits costs more than it
    saves. "Off" skips the round's pre-speculation (the budget B itself never drops below 1:
    next_budget), SD's schedule across the two processes: the speculator idles while the verifier
    works, every row misses and the neural draft proposes after the outcome arrives (under
    fallback "auto"; a named backup proposes instead).

    The gate compares tokens per second of the two, as measured in this run. A choice made for
    round k (during its verification) decides how long that verification takes and whether the
    answer to its outcome is a hit, so it is charged the time from round k's proposals to round
    k + 1's: the verification (until the outcome arrives) and the answer after it.
    - on: round k + 1's tokens over that time, summed over the last `window` such rounds;
    - off: a round's tokens from the neural draft, E_off (rows x expected tokens per row at the
      measured acceptance), over the median verification plus the median answer of the off rounds.
      Off rounds are few, so their tokens are not counted but predicted; their times vary little.
    The first `warmup` rounds are on, the next `probe` off; then off when its rate beats on's by
    `margin` (on's estimate is the noisier one, from rounds that hit or not), with one round of the
    other every `probe_every` so that a wrong choice or a change (fewer rows, another hit rate) is
    seen within a short run. On's first `settle` rounds are left out: a run's first rounds are
    slower (first-time shapes, cold caches) whatever the choice."""

    def __init__(self, warmup: int = 6, probe: int = 2, probe_every: int = 8, window: int = 32,
                 margin: float = 1.05, settle: int = 2):
        self.warmup, self.probe, self.probe_every, self.window = warmup, probe, probe_every, window
        self.margin, self.settle = margin, settle
        self.on = []       # (tokens, seconds) per charged round that pre-speculated
        self.off = []      # (verification s, answer s) per charged round that did not
        self.chosen = {True: 0, False: 0}  # choices so far; chosen[False]: rounds skipped
        self.E_off = None  # the last choice's E_off
        self.arm = None    # the choice for the round being verified
        self.sent = None   # when that round's proposals went out
        self.open = None   # the previous round's (arm, verification s, answer s), awaiting tokens

    def rate_on(self):
        """Tokens per second of the last `window` rounds that pre-speculated; None before one."""
        recent = self.on[self.settle:][-self.window:]
        seconds = sum(s for _, s in recent)
        return sum(t for t, _ in recent) / seconds if seconds > 0 else None

    def rate_off(self, E_off: float | None = None):
        """E_off (default: the last choice's) tokens per round over the median time of a round that
        did not pre-speculate; None before one."""
        recent = self.off[-self.window:]
        E_off = self.E_off if E_off is None else E_off
        if not recent or E_off is None:
            return None
        return E_off / (statistics.median(v for v, _ in recent)
                        + statistics.median(a for _, a in recent))

    def choose(self, E_off: float) -> bool:
        """The choice for the round about to be verified (True pre-speculates); E_off: the tokens a
        round of it would yield from the neural draft."""
        self.E_off = E_off
        on, off = self.rate_on(), self.rate_off()
        if self.chosen[True] < self.warmup:
            arm = True
        elif self.chosen[False] < self.probe:
            arm = False
        elif on is None or off is None:  # a probe is not charged yet
            arm = True
        else:
            best = on * self.margin >= off
            arm = best if sum(self.chosen.values()) % self.probe_every else not best
        self.chosen[arm] += 1
        self.arm = arm
        return arm

    def answered(self, tokens: int, arrived: float, now: float):
        """An outcome that yielded `tokens` arrived at time `arrived` (seconds) and its answer, the
        next proposals, goes out at `now`."""
        if self.open is not None:
            arm, verify, answer = self.open
            if arm:  # kept: on's first `settle` (left out) and the last `window`
                self.on.append((tokens, verify + answer))
                del self.on[self.settle:-self.window]
            else:
                self.off.append((verify, answer))
                del self.off[:-self.window]
        self.open = (None if self.sent is None or self.arm is None
                     else (self.arm, arrived - self.sent, now - arrived))
        self.sent = now

    def rows_joined(self):
        """Rows joined since the last answer: the round now open held their prefills (and, in a
        server, the time it stood empty), which neither arm's rounds cost; it is not charged."""
        self.open = self.sent = None


# --------------------------------------------------------------------------------------------------
# The speculator's policy

class SpecPolicy:
    """What speculator.Speculator measures and decides besides the algorithm (the module docstring).
    spec: the speculator's draft.DraftSettings (K: the most draft tokens per round)."""

    def __init__(self, spec):
        self.spec, K = spec, spec.K
        self.K = K
        self.accept = AcceptanceTracker()       # a and r of the neural draft's proposals
        self.accept_fast = AcceptanceTracker()  # a of the fast backup's proposals
        # B of the next pre-speculation: the user's budget is its ceiling, the measured time its
        # limit (next_budget); fixed with --fixed-budget, and for an explicit fan-out (its sum)
        self.B = spec.budget
        self.adaptive = not spec.fixed_budget and isinstance(spec.fan_out, str)
        # or none at all: skip pre-speculation in rounds where measuring says it does not pay
        self.gate = PreSpecGate() if spec.pre_spec == "auto" else None
        # the last WINDOW of each (recent_median): the verifier's rounds that had a pre-speculation
        # beside them, pre-speculations, and backups in rounds that missed a cache
        self.round_seconds, self.pre_seconds = deque(maxlen=WINDOW), deque(maxlen=WINDOW)
        self.neural_seconds, self.fast_seconds = deque(maxlen=WINDOW), deque(maxlen=WINDOW)
        self.busy_seconds, self.arrived_at = 0.0, None
        self.fallback_used = dict.fromkeys(BACKUPS, 0)
        self.b_star, self.b_star_terms = None, {}  # b* and what it was computed from (stats)
        self.stopped = self.skipped = self.budget_sum = self.pre_rounds = 0
        self.guesses_per_depth, self.rows_guessed = [0] * (K + 1), 0  # the fan-out used

    # -- the fan-out

    def spread(self, fast_backup: bool, L: int) -> list[int]:
        """The rule's F_0..F_L for proposals of length L, at the acceptance of the neural draft's
        proposals or a fast backup's (lower: more of B goes to shallow depths); the defaults until
        a warm-up's worth of rounds is measured. An explicit F_0..F_K cut to L gives its deeper
        entries to depth L (all L accepted)."""
        tracker = self.accept_fast if fast_backup else self.accept
        a, r = ((tracker.a(), self.accept.r()) if tracker.ready
                else (DEFAULT_A_FAST if fast_backup else DEFAULT_A, DEFAULT_R))
        rule = self.spec.fan_out
        if isinstance(rule, list):
            return rule[:L] + [sum(rule[L:])]
        return rule_fan_out(rule, a, r, L, self.B)

    def prior(self) -> list[int]:
        """The prior fan-out: F_0..F_K before any proposals exist, for drafting, where Saguaro's
        set at depth j is the top F_j + 1 tokens of q_j (saguaro_sample.saguaro). A branch is
        drafted with the prior of its round, and its proposals' guesses get their row_fan_out a
        round later: the same F unless a, r or B moved in between, or the draft stopped short of
        K. Either way the law stays exact: Saguaro's sets only shape q', which the verifier tests
        with, and guesses only decide what is cached."""
        return self.spread(fast_backup=False, L=self.K)

    def row_fan_out(self, probs, proposed: list[int], fast_backup: bool) -> list[int]:
        """A row's fan-out F_0..F_K for its guesses, decided as they are chosen, with the row's
        proposals (x_1..x_L; none before its first round) and the draft's probabilities after each
        (probs [L+1, V]) in hand. geometric, uniform and an explicit list read only the acceptance
        of whoever proposed; a rule that reads the probabilities belongs here. Depths past L get
        nothing: a row without proposals puts all of B at depth 0."""
        L = len(proposed)
        F = ([self.B] if not proposed else self.spread(fast_backup, L)) + [0] * (self.K - L)
        self.guesses_per_depth = [s + f for s, f in zip(self.guesses_per_depth, F)]
        self.rows_guessed += 1
        return F

    # -- pre-speculation: whether, and the budget after it

    def rows_joined(self):
        """Rows joined the batch: the gate does not charge the round their prefills fell in."""
        if self.gate is not None:
            self.gate.rows_joined()

    def pre_speculate_now(self, b: int) -> bool:
        """Pre-speculate the round about to be verified (b rows)? always, never, or the gate's
        choice (E_off: the tokens that round would yield from the neural draft)."""
        on = self.spec.pre_spec != "never" and (
            self.gate is None or self.gate.choose(b * self.accept.expected_tokens(self.K)))
        self.skipped += not on
        return on

    def pre_speculated(self, seconds: float, stopped: bool):
        """A pre-speculation took `seconds`; stopped: the outcome arrived before its last step.
        The next B follows (next_budget)."""
        self.pre_seconds.append(seconds)
        self.busy_seconds += seconds
        self.stopped += stopped
        self.budget_sum, self.pre_rounds = self.budget_sum + self.B, self.pre_rounds + 1
        if self.adaptive and self.round_seconds:
            self.B = next_budget(self.B, self.spec.budget,
                                 seconds / recent_median(self.round_seconds), stopped)

    # -- the answer to an outcome

    def outcome_arrived(self, round_seconds, pre_speculated: bool):
        """The verifier's outcome is here; round_seconds: its time on that round (None for round
        0). B and b* model rounds that pre-speculate: a skipped one's times are the gate's alone."""
        self.arrived_at = time.perf_counter()
        if round_seconds is not None and pre_speculated:
            self.round_seconds.append(round_seconds)

    def observe(self, n: int, proposed: int, fast_backup: bool, F_n, hit: bool):
        """One row's outcome: n of `proposed` tokens accepted; F_n guesses were cached at depth n
        (None: the round pre-speculated nothing); hit: one of them was the bonus."""
        (self.accept_fast if fast_backup else self.accept).update(n, proposed)
        if F_n:  # a depth with no guesses always misses: it says nothing about r
            self.accept.observe_lookup(F_n, hit)

    def answered(self, tokens: int):
        """The answer (the next proposals) goes out; the outcome yielded `tokens`."""
        now = time.perf_counter()
        self.busy_seconds += now - self.arrived_at
        if self.gate is not None:
            self.gate.answered(tokens, self.arrived_at, now)

    # -- the backup on a miss, and b*

    def choose_backup(self, b: int, skipped: bool, p_hit: float) -> str:
        """The backup for a miss round at batch size b (`backup_for`), b* refreshed first; under
        "auto", the neural one after a round that pre-speculated nothing (the gate's "off" is SD's
        schedule). p_hit: the cache hit rate so far."""
        self.b_star = self.measured_b_star(p_hit)
        kind = "neural" if skipped and self.spec.fallback == "auto" else self.backup_for(b)
        self.fallback_used[kind] += 1
        return kind

    def backup_took(self, fast: bool, seconds: float, skipped: bool):
        """b*'s T_n, T_f: the backups' times in rounds that missed a cache (not after a skip)."""
        if not skipped:
            (self.fast_seconds if fast else self.neural_seconds).append(seconds)

    def backup_for(self, b) -> str:
        """The backup for this miss round: the user's, or under "auto" the neural draft while
        b < b*, the fast backup from b* on. b* reads this run's measurements, each term replacing
        its cautious default once measured: a backup that turns out worse than assumed loses the
        comparison, and the other one gets used and measured."""
        return fallback.choose_fallback(self.spec.fallback, b, self.b_star, self.spec.fast_fallback)

    def measured_b_star(self, p_hit: float):
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
        self.b_star_terms = dict(p_hit=p_hit, E_hit=E_hit, T_p=T_p, E_f=E_f, T_f=T_f, T_n=T_n)
        return fallback.critical_batch_size(**self.b_star_terms)

    def stats(self) -> dict:
        rows = max(self.rows_guessed, 1)
        return {"fallback_rounds": dict(self.fallback_used), "b_star": self.b_star,
                "b_star_terms": self.b_star_terms, "draft_busy_seconds": self.busy_seconds,
                "pre_speculation_stopped": self.stopped, "pre_speculation_skipped": self.skipped,
                "gate_tok_s": (None if self.gate is None else
                               {"on": self.gate.rate_on(), "off": self.gate.rate_off()}),
                "mean_budget": self.budget_sum / self.pre_rounds if self.pre_rounds else 0.0,
                "pre_speculations": self.pre_rounds, "budget_sum": self.budget_sum,
                "fixed_budget": not self.adaptive, "fan_out_prior": self.prior(),
                # F_j per row-round guessed, round 0's rows (all of B at depth 0) included
                "row_fan_out_mean": [s / rows for s in self.guesses_per_depth],
                "guesses_per_depth": list(self.guesses_per_depth),
                "rows_guessed": self.rows_guessed,
                "acceptance_estimate": self.accept.a()}
