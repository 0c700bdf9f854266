"""Fallback on a cache miss: the near-free backup speculators and the batch-size policy that picks
one.

A whole batch waits for the backup if any of its b sequences misses, so a round needs the backup
with chance 1 - p_hit^b. For small b the neural draft just in time is worth its cost (good tokens);
for large b a near-free backup wins: an n-gram lookup over the sequence's own tokens, or random
tokens. Both are deterministic proposals, so the verifier tests them with a one-hot q. The neural
backup itself is draft.py's ordinary drafting; this file holds the cheap backups, the paper's speed
model (Theorem 7, Corollary 16) and the critical batch size b* (Theorem 17) where the choice flips.
"""

from dataclasses import dataclass

import numpy as np
import torch

from devices import to_device
from spec_cache import DEFAULT_A, expected_tokens

# Defaults for b* before anything is measured (assumptions, times normalised to one verification):
# T_p: the draft's time to build a round's cache; also the neural backup's time on a miss (T_n)
#   until that is measured (the paper charges T_p for both). From the paper's SD speed-up at greedy
#   (161.8 / 54.7 = 2.96 tok/s ratio, K = 6) and a = 0.8: E_SD = 3.95, so T_SD = 3.95 / 2.96 - 1 =
#   0.34 for 6 tokens, about 0.4 for K = 7.
DEFAULT_T_P = 0.4
# T_f: an n-gram lookup or random draw on the host: near zero beside a verification.
DEFAULT_T_F = 0.01
# E_f: tokens per round after a fast-backup proposal; random tokens are almost always rejected (1 =
#   the bonus token only). The n-gram backup does better on repetitive text; 1 is the cautious
#   value.
DEFAULT_E_F = 1.0
# p_hit: the paper's cache hit rates (Llama-3.1-70B / 1B, geometric fan-out): 0.86 at temperature 0,
#   0.63 at temperature 1.
DEFAULT_P_HIT = {0: 0.86, 1: 0.63}
# E_hit: tokens per round of the neural draft, expected_tokens(DEFAULT_A, K) with the paper's SSD
#   K = 7 when the caller does not say (4.16).
DEFAULT_K = 7


# --------------------------------------------------------------------------------------------------
# Fast backups

def ngram_propose(tokens, K: int, max_n: int = 4) -> list[int]:
    """Propose K tokens by prompt lookup over the sequence's own tokens (prompt + output so far).

    Find the longest suffix (length max_n down to 1) that also occurs earlier, take its most recent
    earlier occurrence, and propose the K tokens that followed it. A continuation shorter than K is
    padded by repeating its last token; with no match at all the last token is repeated K times.
    Deterministic; O(len(tokens) * max_n) vectorised work per call."""
    if K < 0 or max_n < 1:
        raise ValueError(f"need K >= 0 and max_n >= 1, got K={K}, max_n={max_n}")
    x = np.asarray(tokens, dtype=np.int64)
    L = len(x)
    if L == 0:
        raise ValueError("ngram_propose needs at least one token (the prompt is empty)")
    if K == 0:
        return []
    # match[p]: the occurrence ending at position p (p <= L-2, so a continuation exists) matches the
    # suffix for the current length m. Grow m one token at a time, keeping the most recent survivor.
    match = x[:L - 1] == x[L - 1]
    end = None
    for m in range(1, min(max_n, L - 1) + 1):
        if m > 1:
            prev = np.zeros(L - 1, dtype=bool)
            prev[m - 1:] = x[:L - m] == x[L - m]  # prev[p]: x[p-m+1] == x[L-m]
            match &= prev
        hits = np.flatnonzero(match)
        if len(hits) == 0:
            break
        end = int(hits[-1]) + 1  # the continuation starts here
    if end is None:
        return [int(x[-1])] * K
    cont = x[end:end + K].tolist()
    return cont + [cont[-1]] * (K - len(cont))


def random_propose(b: int, K: int, V: int, generator) -> torch.Tensor:
    """b x K uniform random token ids in [0, V), LongTensor [b, K] on the generator's device
    (generator: one, or a list of b: row i's from generator[i])."""
    if V < 1:
        raise ValueError(f"vocabulary size V must be >= 1, got {V}")
    if isinstance(generator, torch.Generator):
        return torch.randint(V, (b, K), generator=generator, device=generator.device)
    return torch.stack([torch.randint(V, (K,), generator=g, device=g.device) for g in generator])


# --------------------------------------------------------------------------------------------------
# The speed model (times normalised to one verification forward)

def predicted_speedup(p_hit, E_hit, E_miss, T_p, T_b, b: int = 1) -> float:
    """SSD over plain decoding (Theorem 7; Corollary 16 for a batch):

        [p_hit E_hit + (1 - p_hit) E_miss] / [w max(1, T_p) + (1 - w)(1 + T_b)],   w = p_hit^b

    p_hit: cache hit rate per sequence; E_hit / E_miss: tokens per round after a hit / a miss; T_p:
    time to build the cache (a hit round lasts max(1, T_p): the verification or the draft, whichever
    is longer); T_b: the backup's time on a miss (a miss round lasts 1 + T_b); b: batch size (a
    round hits only if every sequence hits)."""
    w = p_hit ** b
    return (p_hit * E_hit + (1 - p_hit) * E_miss) / (w * max(1.0, T_p) + (1 - w) * (1 + T_b))


def predicted_sd_speedup(E_sd, T_sd) -> float:
    """Ordinary SD over plain decoding: E_SD / (1 + T_SD) (E_SD tokens per round, T_SD drafting
    time)."""
    return E_sd / (1 + T_sd)


# --------------------------------------------------------------------------------------------------
# The batch-size policy

def critical_batch_size(p_hit=None, E_hit=None, T_p=None, E_f=None, T_f=None, T_n=None,
                        b_max: int = 4096):
    """b*: the smallest batch size b >= 1 at which the fast backup beats the neural one
    (Theorem 17).

    At batch b a round hits with chance w = p_hit^b. The speed-ups over plain decoding are
        neural backup (T_b = T_n, E_miss = E_hit):  E_hit / (w + (1 - w)(1 + T_n)),
        fast backup   (T_b = T_f, E_miss = E_f):    (p_hit E_hit + (1 - p_hit) E_f)
                                                        / (w + (1 - w)(1 + T_f)),
    with T_p clamped to <= 1 as the paper does (the cache is built within one verification, so a hit
    round lasts 1). Symbols: p_hit, the per-sequence cache hit rate; E_hit, tokens per round of the
    neural draft; E_f, tokens per round of the fast backup's proposals; T_p, the time to build the
    cache; T_n, the neural backup's time on a miss (default: T_p; measured, it is K draft steps
    for the rows that missed only); T_f, the fast backup's time (all times in verifications).
    "Beats" is strict; we search the integers 1..b_max (their ratio is monotone in w, so it flips
    at most once). Returns None if it never flips. A quantity not measured yet (None) takes the
    documented default at the top of this file (temperature 0)."""
    p_hit = DEFAULT_P_HIT[0] if p_hit is None else p_hit
    E_hit = expected_tokens(DEFAULT_A, DEFAULT_K) if E_hit is None else E_hit
    T_p = DEFAULT_T_P if T_p is None else T_p
    E_f = DEFAULT_E_F if E_f is None else E_f
    T_f = DEFAULT_T_F if T_f is None else T_f
    if not 0 <= p_hit <= 1:
        raise ValueError(f"p_hit must be in [0, 1], got {p_hit}")
    if min(E_hit, E_f, T_p, T_f, T_p if T_n is None else T_n) < 0 or b_max < 1:
        raise ValueError(f"need E_hit, E_f, T_p, T_f, T_n >= 0 and b_max >= 1, "
                         f"got {E_hit}, {E_f}, {T_p}, {T_f}, {T_n}, {b_max}")
    T_p = min(T_p, 1.0)
    T_n = T_p if T_n is None else T_n
    for b in range(1, b_max + 1):
        neural = predicted_speedup(p_hit, E_hit, E_hit, T_p, T_n, b)
        fast = predicted_speedup(p_hit, E_hit, E_f, T_p, T_f, b)
        if fast > neural:
            return b
        # w no longer changes: neither will the comparison
        if p_hit ** b < 1e-12 or p_hit in (0, 1):
            return None
    return None


def default_critical_batch_size(K: int, temperature: float = 0.0):
    """b* from the documented defaults above: the paper's choice before anything is measured
    (None at temperature 1 from K = 7 on: the fast backup never wins; docs/design.md section 5
    gives its values). The speculator does not start from it: until measured, it uses the neural
    backup."""
    p_hit = DEFAULT_P_HIT[0 if temperature == 0 else 1]
    return critical_batch_size(p_hit, expected_tokens(DEFAULT_A, K), DEFAULT_T_P, DEFAULT_E_F,
                               DEFAULT_T_F)


# The backups a miss can use, each a rule: (histories, K, V, generator, neural) -> Backup (below).
# "neural" is the draft model (neural() drafts just in time, with the laws its tokens were drawn
# from); the fast ones propose without it, tokens that are deterministic given their inputs (a
# one-hot q). A rule added here is law-tested and greedy-tested by tests/test_ssd.py with no test
# written for it; `--fallback auto` switches to DraftSettings.fast_fallback from b* on.
BACKUPS = {
    "neural": lambda histories, K, V, generator, neural: Backup("neural", *neural()),
    "ngram": lambda histories, K, V, generator, neural: fast_backup(
        "ngram", torch.tensor([ngram_propose(h, K) for h in histories], dtype=torch.long,
                              device="cpu"),  # made on the host, then one copy to the draft's
        generator),
    "random": lambda histories, K, V, generator, neural: fast_backup(
        "random", random_propose(len(histories), K, V, generator), generator),
}
POLICIES = ("auto", *BACKUPS)  # --fallback: a backup, or auto (neural below b*, a fast one above)
FAST_BACKUPS = tuple(b for b in BACKUPS if b != "neural")  # what auto may switch to


def choose_fallback(policy: str, b: int, b_star, fast: str = "ngram") -> str:
    """The backup for a miss round. "auto" picks the neural draft while b < b* (b_star None: it
    never flips) and the fast backup `fast` from b* on."""
    if policy not in POLICIES:
        raise ValueError(f"unknown fallback policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if fast not in FAST_BACKUPS:
        raise ValueError(f"unknown fast backup {fast!r}; choose one of {', '.join(FAST_BACKUPS)}")
    if policy != "auto":
        return policy
    return "neural" if b_star is None or b < b_star else fast


# --------------------------------------------------------------------------------------------------
# On a miss: the chosen backup proposes

@dataclass
class Backup:
    """A backup's proposals for the m rows that missed."""
    kind: str                    # "neural", "ngram" or "random"
    tokens: torch.Tensor         # [m, W] x_1..x_W (W = K, or the longest a neural row drafted)
    q: torch.Tensor | None       # [m, W, V] the law each x_i was drawn from; None: deterministic
    # [m, W, V] what the guesses rank by at depths 0..W-1 (draft.draw's guess_probs; neural only)
    guess_probs: torch.Tensor | None
    lengths: list[int]           # each row's proposal length (<= W)


def propose(kind, histories, K, V, generator, neural) -> Backup:
    """Proposals from backup `kind` (a rule of BACKUPS) for the rows that missed, one committed
    token list per row in `histories`. `neural()` runs the draft model just in time and returns
    (tokens, q, guess_probs, lengths); generator: the random backup's (one, or one per row; its
    device is the proposals'). The fast backups are deterministic (tested with a one-hot q)."""
    if kind not in BACKUPS:
        raise ValueError(f"unknown backup {kind!r}; choose one of {', '.join(BACKUPS)}")
    return BACKUPS[kind](histories, K, V, generator, neural)


def fast_backup(kind: str, tokens, generator) -> Backup:
    """A fast backup's Backup: tokens [m, K] moved to the generator's device, q one-hot (None)."""
    device = (generator if isinstance(generator, torch.Generator) else generator[0]).device
    return Backup(kind, to_device(tokens, device), None, None, [tokens.shape[1]] * len(tokens))
