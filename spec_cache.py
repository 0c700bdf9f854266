"""The speculation cache of SSD / Saguaro: which outcomes to pre-speculate, and where to keep them.

Read top to bottom:
1. the fan-out F_0..F_K (bonus-token guesses cached at depth j = j accepted tokens): uniform, or
   the paper's geometric fan-out (Theorem 12); its budget B from the measured time
   (`next_budget`), and whether to pre-speculate at all (`PreSpecGate`);
2. guess selection: at depth j the top-F_j tokens of the draft's own distribution, excluding the
   drafted token x_{j+1} (a rejected token has zero residual mass, so it is never the bonus);
3. `SpecCache`: the round's branches keyed by the outcome (seq, n, t), with hit/miss counters;
4. `AcceptanceTracker`: running estimates of the acceptance rate a and the power-law exponent r,
   to refresh the geometric fan-out from measurements after a warm-up.

Pure math and plain Python containers: an entry's KV state is the caller's (draft.py) business.
"""
import math
import numbers
import statistics
from dataclasses import dataclass, field

import torch

from devices import to_device

# Used before any counters exist (assumptions, not measurements of this engine):
# a: the paper's acceptance rate, Llama-3.1-70B / Llama-3.2-1B at temperature 1 with C = 1.
DEFAULT_A = 0.8
# r: from the paper's uniform hit rates, p_hit = 1 - 3^(-r) if F = 3 at every depth: 0.582 at
# temperature 1 gives r ~ 0.79, 0.847 at 0 gives ~1.7; the lower r gives a more cautious fan-out.
DEFAULT_R = 0.8


# --------------------------------------------------------------------------------------------------
# Fan-out: F_0..F_K with sum B

def _check_budget(K, B):
    if not isinstance(K, numbers.Integral) or K < 0:
        raise ValueError(f"K must be an integer >= 0 (draft tokens per round), got {K!r}")
    if not isinstance(B, numbers.Integral) or B < 1:
        raise ValueError(f"the budget B must be an integer >= 1 (branches per round), got {B!r}")


def uniform_fan_out(K: int, B: int) -> list[int]:
    """K+1 integers summing to B, as even as possible; the extra ones go to the shallowest depths
    (the likeliest rejection depths)."""
    _check_budget(K, B)
    base, extra = divmod(B, K + 1)
    return [base + (j < extra) for j in range(K + 1)]


def _clamp_a(a):
    # a measured a can be exactly 0 or 1 (a few greedy rounds); the closed form needs 0 < a < 1
    return min(max(a, 0.01), 0.99)


def _check_a_r(a, r):
    if not (isinstance(a, numbers.Real) and 0 <= a <= 1):
        raise ValueError(f"acceptance rate a must be in [0, 1], got {a!r}")
    if not (isinstance(r, numbers.Real) and r > 0 and math.isfinite(r)):
        raise ValueError(f"power-law exponent r must be a finite number > 0, got {r!r}")


def geometric_fan_out_real(a: float, r: float, K: int, B: int) -> list[float]:
    """The real-valued optimum of Theorem 12 (before rounding); see `geometric_fan_out`."""
    _check_a_r(a, r)
    _check_budget(K, B)
    a = _clamp_a(a)
    w = [a ** (j / (1 + r)) for j in range(K)]                       # F_j / F_0 for j < K
    w.append(a ** (K / (1 + r)) * (1 - a) ** (-1 / (1 + r)))        # F_K / F_0: all K accepted
    F0 = B / sum(w)
    return [F0 * wj for wj in w]


def round_to_budget(F_real: list[float], B: int) -> list[int]:
    """Largest-remainder rounding: floor every F_j, then give the B - sum(floors) leftover units to
    the largest fractional parts (ties: shallower depth first). The sum is exactly B; a depth whose
    real F_j is below about 0.5 may get 0."""
    floors = [math.floor(f) for f in F_real]
    left = B - sum(floors)
    order = sorted(range(len(F_real)), key=lambda j: (-(F_real[j] - floors[j]), j))
    for j in order[:left]:
        floors[j] += 1
    return floors


def geometric_fan_out(a: float, r: float, K: int, B: int) -> list[int]:
    """The paper's geometric fan-out (Theorem 12), rounded to integers with sum exactly B:

        F_j = F_0 a^(j/(1+r))                          for j < K,
        F_K = F_0 a^(K/(1+r)) (1-a)^(-1/(1+r))         (all K accepted),

    F_0 setting the sum to B. It maximises the hit rate when n is capped-geometric in a and a
    depth with F guesses misses with chance F^(-r) (docs/design.md section 4). a is clamped into
    [0.01, 0.99]; r > 0, K >= 0, B >= 1.
    """
    return round_to_budget(geometric_fan_out_real(a, r, K, B), B)


def fan_out(spec, a: float, r: float, K: int, B: int) -> list[int]:
    """The fan-out from a spec: "uniform", "geometric", or an explicit list of K+1 non-negative ints
    (or a comma-separated string such as "3,3,3"), returned as is: its sum is the budget, not B."""
    if isinstance(spec, str) and spec in ("uniform", "geometric"):
        return uniform_fan_out(K, B) if spec == "uniform" else geometric_fan_out(a, r, K, B)
    if isinstance(spec, str):
        try:
            spec = [int(x) for x in spec.split(",")]
        except ValueError:
            raise ValueError(f"fan-out must be 'uniform', 'geometric' or K+1 ints like '3,3,3', "
                             f"got {spec!r}") from None
    if not isinstance(spec, (list, tuple)):
        raise ValueError(f"fan-out must be 'uniform', 'geometric' or a list of K+1 ints, "
                         f"got {spec!r}")
    if len(spec) != K + 1:
        raise ValueError(f"an explicit fan-out needs K+1 = {K + 1} entries (depths 0..K), "
                         f"got {len(spec)}")
    if not all(isinstance(f, numbers.Integral) and not isinstance(f, bool) and f >= 0
               for f in spec):
        raise ValueError(f"an explicit fan-out must hold non-negative ints, got {list(spec)}")
    return [int(f) for f in spec]


def fit_power_law(F_values, miss_rates, default: float = DEFAULT_R) -> float:
    """Least-squares fit of log(miss) = -r log(F), a line through the origin (F = 1 always misses).
    Points with F <= 1 or a miss rate outside (0, 1) are skipped. Returns `default` when no point
    is left or the fit is not positive."""
    pts = [(math.log(f), math.log(m)) for f, m in zip(F_values, miss_rates) if f > 1 and 0 < m < 1]
    if not pts:
        return default
    r = -sum(x * y for x, y in pts) / sum(x * x for x, _ in pts)
    return r if r > 0 else default


def next_budget(B: int, ceiling: int, T_p: float, stopped: bool) -> int:
    """The budget B for the next pre-speculation, so that it fits within one verification.
    T_p: the last pre-speculation's time in verifications; stopped: the outcome arrived before it
    was done. Too slow: B shrinks by a quarter (at least 1); under 3/4 of a verification: it grows
    by one, up to `ceiling` (the user's budget). Additive increase, multiplicative decrease: it
    settles just under the verification time and recovers quickly from a slow round."""
    if stopped or T_p > 1:
        return max(1, B - max(1, B // 4))
    if T_p < 0.75:
        return min(ceiling, B + 1)
    return B


class PreSpecGate:
    """Pre-speculate this round at all? Where the draft's work slows the verifier (two CPU cores
    that share caches and memory bandwidth), pre-speculation that rarely hits costs more than it
    saves. "Off" is B = 0, SD's schedule across the two processes: the speculator idles while the
    verifier works, every row misses and the neural draft proposes after the outcome arrives.

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
            if arm:
                self.on.append((tokens, verify + answer))
            else:
                self.off.append((verify, answer))
        self.open = (None if self.sent is None or self.arm is None
                     else (self.arm, arrived - self.sent, now - arrived))
        self.sent = now


# --------------------------------------------------------------------------------------------------
# Guess selection: at depth j the top-F_j tokens of the draft's distribution, excluding x_{j+1}

def _check_F(F, K):
    if len(F) != K + 1 or any(f < 0 for f in F):
        raise ValueError(f"F must hold K+1 = {K + 1} non-negative ints (depths 0..K), "
                         f"got {list(F)}")


def select_guesses_batch(q_raw: torch.Tensor, drafted: torch.Tensor, F: list[int]) -> torch.Tensor:
    """Guesses for b sequences. q_raw [b, K+1, V]: the draft's own (pre-Saguaro) scores at depths
    0..K, probabilities or logits (only their order matters; at temperature 0 not a one-hot);
    drafted [b, K]: x_1..x_K. Returns LongTensor [b, K+1, max(F)]: row i, depth j holds its
    top-F_j token ids, descending, without drafted[i, j] (j < K), padded with -1.
    Ties: torch.topk's order."""
    b, K1, V = q_raw.shape
    K = K1 - 1
    _check_F(F, K)
    if drafted.shape != (b, K):
        raise ValueError(f"drafted must be [b, K] = [{b}, {K}] to match q_raw, "
                         f"got {list(drafted.shape)}")
    maxF = max(F)
    if maxF == 0:
        return torch.full((b, K1, 0), -1, dtype=torch.long, device=q_raw.device)
    # one extra candidate, the drafted one dropped by position: masking its score fails on ties
    k = min(maxF + 1, V)
    idx = q_raw.topk(k, dim=-1).indices                                   # [b, K+1, k]
    excl = torch.cat([drafted, drafted.new_full((b, 1), -1)], dim=1)       # [b, K+1]: none at K
    keep = idx != excl.unsqueeze(-1)                                       # [b, K+1, k]
    rank = keep.cumsum(-1) - 1                                             # rank among kept
    Ft = to_device(torch.tensor(F, device="cpu"), q_raw.device).view(1, K1, 1)
    keep &= rank < Ft
    out = torch.full((b, K1, maxF + 1), -1, dtype=torch.long, device=q_raw.device)  # +1: a dump
    out.scatter_(-1, torch.where(keep, rank, maxF), torch.where(keep, idx, -1))
    return out[..., :maxF]


def guess_triples(guesses: list) -> list[tuple[int, int, int]]:
    """All (row, depth j, guess token) triples of a batch, ordered by row, depth, rank: the branches
    to fork. guesses: select_guesses_batch's [b, K+1, maxF] as nested lists, read to the host in one
    read (its number of guesses is known only there: torch.nonzero on the device would sync)."""
    return [(i, j, x) for i, depths in enumerate(guesses) for j, ranked in enumerate(depths)
            for x in ranked if x >= 0]


# --------------------------------------------------------------------------------------------------
# The cache and its counters

@dataclass
class CacheStats:
    """Cumulative counters (never cleared). Depths are the REAL accepted count n of each lookup; the
    per-depth lists have K+1 entries (or grow with the deepest n seen when K is not given)."""
    K: int | None = None
    lookups: int = 0
    hits: int = 0
    entries: int = 0                                        # branches stored (put) in all rounds
    lookups_per_depth: list = field(default_factory=list)
    hits_per_depth: list = field(default_factory=list)

    def __post_init__(self):
        if self.K is not None:
            self.lookups_per_depth = self.lookups_per_depth or [0] * (self.K + 1)
            self.hits_per_depth = self.hits_per_depth or [0] * (self.K + 1)

    def record(self, n: int, hit: bool):
        while len(self.lookups_per_depth) <= n:
            self.lookups_per_depth.append(0)
            self.hits_per_depth.append(0)
        self.lookups += 1
        self.lookups_per_depth[n] += 1
        self.hits += hit
        self.hits_per_depth[n] += hit

    @property
    def misses(self) -> int:
        return self.lookups - self.hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class SpecCache:
    """One round's speculation cache: outcome (seq, n, t) -> the caller's entry.

    `get` hands a hit's entry over and removes it, so `clear` returns exactly the unclaimed entries
    (the caller frees their KV branches). K (optional) bounds n and sizes the per-depth counters."""

    def __init__(self, K: int | None = None):
        self.K = K
        self.entries = {}
        self.stats = CacheStats(K)

    def _check_n(self, n):
        if n < 0 or (self.K is not None and n > self.K):
            raise ValueError(f"accepted count n must be in [0, K={self.K}], got {n}")

    def put(self, seq: int, n: int, t: int, entry):
        self._check_n(n)
        key = (int(seq), int(n), int(t))
        if key in self.entries:
            raise ValueError(f"outcome {key} is already cached this round; "
                             f"clear() the cache between rounds")
        self.entries[key] = entry
        self.stats.entries += 1

    def get(self, seq: int, n: int, t: int):
        """Look up the real outcome: the entry (removed from the cache) on a hit, None on a miss."""
        self._check_n(n)
        entry = self.entries.pop((int(seq), int(n), int(t)), None)
        self.stats.record(int(n), entry is not None)
        return entry

    def clear(self) -> list:
        """Empty the cache for the next round; returns the unclaimed entries (to free them)."""
        left = list(self.entries.values())
        self.entries.clear()
        return left

    def __contains__(self, key) -> bool:  # no counters touched
        return tuple(int(x) for x in key) in self.entries

    def __len__(self) -> int:
        return len(self.entries)


# --------------------------------------------------------------------------------------------------
# Running estimates of a and r, to refresh the geometric fan-out from measurements

def expected_tokens(a: float, K: int) -> float:
    """Expected tokens per round (accepted + bonus) at acceptance rate a:
    (1 - a^(K+1)) / (1 - a)."""
    if not 0 <= a <= 1:
        raise ValueError(f"acceptance rate a must be in [0, 1], got {a}")
    return K + 1.0 if a == 1 else (1 - a ** (K + 1)) / (1 - a)


def acceptance_trials(n: int, K: int) -> int:
    """Bernoulli trials behind n accepted of K proposals: a round stops at the first rejection or
    after K accepts, so n + 1 if n < K else K. a_hat = sum(n) / sum(trials) is the MLE of a."""
    return n + 1 if n < K else K


@dataclass
class AcceptanceTracker:
    """Running estimates for the geometric fan-out; keep one per kind of proposal (the neural draft
    and a fast backup accept at different rates).

    a: sum(n) / sum(acceptance_trials(n, K)), the capped-geometric MLE.
    r: `fit_power_law` over the cumulative miss rate at each fan-out value F seen at lookups (F
    values with fewer than `min_lookups` ignored). DEFAULT_A / DEFAULT_R until there is data."""
    warmup: int = 20            # rounds before `ready` (refresh the fan-out after this many)
    min_lookups: int = 20
    accepted: int = 0
    trials: int = 0
    rounds: int = 0             # sequence-rounds with K >= 1 seen
    lookups_by_F: dict = field(default_factory=dict)  # F -> [lookups, hits]

    def update(self, n, K: int):
        """One round's accepted count n of K proposals: an int, or a list / tensor, one per row."""
        ns = n.tolist() if isinstance(n, torch.Tensor) else n
        for x in ([ns] if isinstance(ns, numbers.Integral) else ns):
            if not 0 <= x <= K:
                raise ValueError(f"accepted count n must be in [0, K={K}], got {x}")
            if K == 0:  # nothing was proposed: no information about a
                continue
            self.accepted += x
            self.trials += acceptance_trials(x, K)
            self.rounds += 1

    def observe_lookup(self, F_n: int, hit: bool):
        """One cache lookup at the real depth n, where F_n guesses had been cached."""
        c = self.lookups_by_F.setdefault(int(F_n), [0, 0])
        c[0] += 1
        c[1] += bool(hit)

    def a(self) -> float:
        return self.accepted / self.trials if self.trials else DEFAULT_A

    def r(self) -> float:
        pts = [(f, 1 - h / n) for f, (n, h) in self.lookups_by_F.items() if n >= self.min_lookups]
        return fit_power_law([f for f, _ in pts], [m for _, m in pts])

    def expected_tokens(self, K: int) -> float:
        return expected_tokens(self.a(), K)

    @property
    def ready(self) -> bool:
        return self.rounds >= self.warmup
