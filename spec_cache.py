"""The speculation cache of SSD / Saguaro: which outcomes to pre-speculate, and where to keep them.

Read top to bottom:
1. the fan-out F_0..F_K (bonus-token guesses cached at depth j = j accepted tokens): uniform, or
   the paper's geometric fan-out (Theorem 12), or an explicit list; `FAN_OUTS` names the rules
   (the config check, both command lines and their help read it);
2. guess selection: per row, at depth j the top-F_j tokens of the draft's own distribution,
   excluding the drafted token x_{j+1} (a rejected token has zero residual mass, so it is never
   the bonus); every row has its own F_0..F_K;
3. `SpecCache`: the round's branches keyed by the outcome (row, n, t), with hit/miss counters;
4. `AcceptanceTracker`: running estimates of the acceptance rate a and the power-law exponent r,
   to refresh the geometric fan-out from measurements after a warm-up.

Pure math and plain Python containers: an entry's KV state is the caller's (speculator.py)
business; what the speculator measures and decides from it (the budget B, the gate, b*, which
fan-out a row gets) is spec_policy.py's.
"""
import math
import numbers
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

    Worked example, a = 0.8, r = 0.8, B = 8 (the defaults before anything is measured), K = 3:
    the ratios F_j / F_0 are 0.8^(j/1.8) = 1, 0.883, 0.780 for j < 3, and for "all 3 accepted"
    0.8^(3/1.8) 0.2^(-1/1.8) = 1.686; they sum to 4.349, so F_0 = 8 / 4.349 = 1.84 and the real
    optimum is [1.84, 1.62, 1.44, 3.10]. Rounding floors it to [1, 1, 1, 3] and gives the two
    units left to the largest fractions (depths 0 and 1): F = [2, 2, 1, 3]. The last depth gets
    the most because it is the likeliest outcome: P(n = 3) = a^3 = 0.512, against
    P(n = j) = a^j (1 - a) = 0.2, 0.16, 0.128 for j = 0, 1, 2.
    """
    return round_to_budget(geometric_fan_out_real(a, r, K, B), B)


# The named fan-out rules: (a, r, K, B) -> F_0..F_K summing to B; an explicit F_0,..,F_K is the
# third form. A rule added here is law-tested and greedy-tested by tests/test_ssd.py with no test
# written for it.
FAN_OUTS = {
    "geometric": geometric_fan_out,
    "uniform": lambda a, r, K, B: uniform_fan_out(K, B),
}
FAN_OUT_HELP = f"{' or '.join(FAN_OUTS)}, or K+1 comma-separated integers F_0,..,F_K"


def parse_fan_out(text: str):
    """A fan-out as a command line gives it: a rule's name, or "3,2,2" -> [3, 2, 2]."""
    if text in FAN_OUTS:
        return text
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"fan-out {text!r}: use {FAN_OUT_HELP}") from None


def check_fan_out(fan_out, K: int):
    """The fan-out a user asked for, checked: a name of FAN_OUTS (returned as is) or K+1
    non-negative ints (returned as a list; its sum is the budget B)."""
    if isinstance(fan_out, str):
        if fan_out in FAN_OUTS:
            return fan_out
        raise ValueError(f"fan_out={fan_out!r}: use {FAN_OUT_HELP}")
    if not isinstance(fan_out, (list, tuple)):
        raise ValueError(f"fan_out={fan_out!r}: use {FAN_OUT_HELP}")
    if len(fan_out) != K + 1:
        raise ValueError(f"fan_out={list(fan_out)}: an explicit fan-out needs K+1 = {K + 1} "
                         f"entries (depths 0..K), got {len(fan_out)}")
    if not all(isinstance(f, numbers.Integral) and not isinstance(f, bool) and f >= 0
               for f in fan_out):
        raise ValueError(f"fan_out={list(fan_out)}: an explicit fan-out must hold non-negative "
                         f"ints")
    return [int(f) for f in fan_out]


def rule_fan_out(fan_out, a: float, r: float, K: int, B: int) -> list[int]:
    """F_0..F_K from a rule of FAN_OUTS (geometric at acceptance a and exponent r), or an explicit
    list of K+1 non-negative ints (or a comma-separated string such as "3,3,3"), returned as is:
    its sum is the budget, not B."""
    fan_out = check_fan_out(parse_fan_out(fan_out) if isinstance(fan_out, str) else fan_out, K)
    return FAN_OUTS[fan_out](a, r, K, B) if isinstance(fan_out, str) else fan_out


def fit_power_law(F_values, miss_rates, default: float = DEFAULT_R) -> float:
    """Least-squares fit of log(miss) = -r log(F), a line through the origin (F = 1 always misses).
    Points with F <= 1 or a miss rate outside (0, 1) are skipped. Returns `default` when no point
    is left or the fit is not positive."""
    pts = [(math.log(f), math.log(m)) for f, m in zip(F_values, miss_rates) if f > 1 and 0 < m < 1]
    if not pts:
        return default
    r = -sum(x * y for x, y in pts) / sum(x * x for x, _ in pts)
    return r if r > 0 else default


# --------------------------------------------------------------------------------------------------
# Guess selection: at depth j the top-F_j tokens of the draft's distribution, excluding x_{j+1}

def _check_F(F, b, K):
    if len(F) != b or any(len(row) != K + 1 or min(row) < 0 for row in F):
        raise ValueError(f"F must hold one row of K+1 = {K + 1} non-negative ints (depths 0..K) "
                         f"per sequence, {b} rows, got {[list(row) for row in F]}")


def select_guesses_batch(probs: torch.Tensor, drafted: torch.Tensor, F: list) -> torch.Tensor:
    """Guesses for b sequences, each with its own fan-out. probs [b, K+1, V]: the draft's own
    (pre-Saguaro) scores at depths 0..K, probabilities or logits (only their order matters; at
    temperature 0 not a one-hot); drafted [b, K]: x_1..x_K (-1: nothing to exclude); F: b lists of
    K+1 ints, row i's F_0..F_K. Returns LongTensor [b, K+1, max F]: row i, depth j holds its top
    F[i][j] token ids, descending, without drafted[i, j] (j < K), padded with -1.
    Ties: torch.topk's order."""
    b, K1, V = probs.shape
    K = K1 - 1
    _check_F(F, b, K)
    if drafted.shape != (b, K):
        raise ValueError(f"drafted must be [b, K] = [{b}, {K}] to match probs, "
                         f"got {list(drafted.shape)}")
    maxF = max((max(row) for row in F), default=0)
    if maxF == 0:
        return torch.full((b, K1, 0), -1, dtype=torch.long, device=probs.device)
    # one extra candidate, the drafted one dropped by position: masking its score fails on ties
    k = min(maxF + 1, V)
    idx = probs.topk(k, dim=-1).indices                                   # [b, K+1, k]
    excl = torch.cat([drafted, drafted.new_full((b, 1), -1)], dim=1)       # [b, K+1]: none at K
    keep = idx != excl.unsqueeze(-1)                                       # [b, K+1, k]
    rank = keep.cumsum(-1) - 1                                             # rank among kept
    Ft = to_device(torch.tensor(F, device="cpu"), probs.device).view(b, K1, 1)
    keep &= rank < Ft
    out = torch.full((b, K1, maxF + 1), -1, dtype=torch.long, device=probs.device)  # +1: a dump
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
    """One round's speculation cache: outcome (row, n, t) -> the caller's entry. row is the row's
    index in the batch (speculator.Speculator.rows), which stays the same while a hit replaces its
    KV sequence.

    `get` hands a hit's entry over and removes it, so `clear` returns exactly the unclaimed entries
    (the caller frees their KV branches). K (optional) bounds n and sizes the per-depth counters."""

    def __init__(self, K: int | None = None):
        self.K = K
        self.entries = {}
        self.stats = CacheStats(K)

    def _check_n(self, n):
        if n < 0 or (self.K is not None and n > self.K):
            raise ValueError(f"accepted count n must be in [0, K={self.K}], got {n}")

    def put(self, row: int, n: int, t: int, entry):
        self._check_n(n)
        key = (int(row), int(n), int(t))
        if key in self.entries:
            raise ValueError(f"outcome {key} is already cached this round; "
                             f"clear() the cache between rounds")
        self.entries[key] = entry
        self.stats.entries += 1

    def get(self, row: int, n: int, t: int):
        """Look up the real outcome: the entry (removed from the cache) on a hit, None on a miss."""
        self._check_n(n)
        entry = self.entries.pop((int(row), int(n), int(t)), None)
        self.stats.record(int(n), entry is not None)
        return entry

    def drop_rows(self, rows) -> list:
        """Remove the entries of rows that left the batch (continuous batching); returns them (to
        free their KV branches)."""
        gone = {int(r) for r in rows}
        keys = [key for key in self.entries if key[0] in gone]
        return [self.entries.pop(key) for key in keys]

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
