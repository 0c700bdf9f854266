"""Backup speculators (n-gram, random), the speed model and the critical batch size b*."""
import os
import random
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from fallback import (DEFAULT_A, DEFAULT_E_F, DEFAULT_K, DEFAULT_P_HIT, DEFAULT_T_F, DEFAULT_T_P,  # noqa: E402
                      choose_fallback, critical_batch_size, default_critical_batch_size, expected_tokens,
                      ngram_propose, predicted_sd_speedup, predicted_speedup, propose, random_propose)

torch.set_num_threads(1)


# ----------------------------------------------------------------------------------------------------
# n-gram

def test_ngram_longest_most_recent_match():
    # suffix [1,2,3] occurs twice earlier; the most recent one was followed by 9
    assert ngram_propose([1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    # longer beats more recent: [7,8,9] -> 5 (oldest), [8,9] -> 6, [9] -> 3 (newest)
    seq = [7, 8, 9, 5, 1, 8, 9, 6, 2, 9, 3, 7, 8, 9]
    assert ngram_propose(seq, 3) == [5, 1, 8]
    assert ngram_propose(seq, 3, max_n=2) == [6, 2, 9]
    assert ngram_propose(seq, 3, max_n=1) == [3, 7, 8]


def test_ngram_short_continuation_and_no_match():
    assert ngram_propose([4, 5, 6, 4], 4) == [5, 6, 4, 4]   # continuation [5,6,4], padded with its last token
    assert ngram_propose([3, 3], 3) == [3, 3, 3]
    assert ngram_propose([1, 2, 3], 3) == [3, 3, 3]          # no match: the last token repeated
    assert ngram_propose([5], 2) == [5, 5]
    assert ngram_propose([1, 2, 1], 0) == []
    with pytest.raises(ValueError, match="at least one token"):
        ngram_propose([], 3)


def reference_ngram(tokens, K, max_n):
    L = len(tokens)
    for m in range(min(max_n, L - 1), 0, -1):
        suffix = tokens[L - m:]
        for start in range(L - m - 1, -1, -1):  # most recent first; the occurrence must end before L
            if tokens[start:start + m] == suffix:
                cont = tokens[start + m:start + m + K]
                return cont + [cont[-1]] * (K - len(cont))
    return [tokens[-1]] * K


def test_ngram_matches_reference():
    g = random.Random(0)
    for _ in range(500):
        tokens = [g.randrange(3) for _ in range(g.randrange(1, 30))]
        K, max_n = g.randrange(1, 6), g.randrange(1, 5)
        assert ngram_propose(tokens, K, max_n) == reference_ngram(tokens, K, max_n), (tokens, K, max_n)


def test_ngram_fast_on_long_sequences():
    tokens = [random.Random(1).randrange(50) for _ in range(5000)]
    t0 = time.perf_counter()
    for _ in range(20):
        ngram_propose(tokens, 8)
    assert time.perf_counter() - t0 < 2.0  # ~1 ms a call; generous for a shared CPU


# ----------------------------------------------------------------------------------------------------
# random

def test_random_propose_deterministic_and_in_range():
    a = random_propose(4, 7, 13, torch.Generator().manual_seed(0))
    b = random_propose(4, 7, 13, torch.Generator().manual_seed(0))
    c = random_propose(4, 7, 13, torch.Generator().manual_seed(1))
    assert a.shape == (4, 7) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert int(a.min()) >= 0 and int(a.max()) < 13
    big = random_propose(100, 50, 13, torch.Generator().manual_seed(2))
    assert set(big.unique().tolist()) == set(range(13))  # 5000 draws hit every one of 13 tokens
    with pytest.raises(ValueError, match="V must be"):
        random_propose(1, 1, 0, torch.Generator())


# ----------------------------------------------------------------------------------------------------
# Speed model and b*

def test_predicted_speedup():
    assert predicted_speedup(1.0, 4.0, 1.0, 0.5, 0.0) == pytest.approx(4.0)             # always hit, T_p <= 1
    assert predicted_speedup(1.0, 4.0, 1.0, 2.0, 0.0) == pytest.approx(2.0)             # hit round lasts T_p
    assert predicted_speedup(0.0, 4.0, 3.0, 0.5, 0.5) == pytest.approx(2.0)             # always the backup
    assert predicted_speedup(0.9, 4.0, 4.0, 0.4, 0.4, b=2) == pytest.approx(4 / (0.81 + 0.19 * 1.4))
    assert predicted_sd_speedup(4.0, 0.6) == pytest.approx(2.5)
    # same draft as primary and backup: never slower than SD (paper, Theorem 7)
    for p in (0.0, 0.3, 0.9, 1.0):
        for T in (0.1, 0.5, 1.0):
            assert predicted_speedup(p, 4.0, 4.0, T, T) >= predicted_sd_speedup(4.0, T) - 1e-12


def brute_force_flip(p_hit, E_hit, T_p, E_f, T_f, b_max):
    T_p = min(T_p, 1.0)
    for b in range(1, b_max + 1):
        w = p_hit ** b
        neural = E_hit / (w + (1 - w) * (1 + T_p))
        fast = (p_hit * E_hit + (1 - p_hit) * E_f) / (w + (1 - w) * (1 + T_f))
        if fast > neural:
            return b
    return None


def test_critical_batch_size_matches_brute_force():
    g = random.Random(0)
    flips = 0
    for _ in range(300):
        args = (g.uniform(0.3, 0.999), g.uniform(1.5, 6), g.uniform(0.05, 1.5), g.uniform(1, 2), g.uniform(0, 0.05))
        b_star = critical_batch_size(*args, b_max=500)
        assert b_star == brute_force_flip(*args, 500), args
        if b_star is not None:
            flips += 1
            if b_star > 1:  # the flip is exactly there: neural still at least as good one step before
                p, E_hit, T_p, E_f, T_f = args
                T_p = min(T_p, 1.0)
                assert predicted_speedup(p, E_hit, E_hit, T_p, T_p, b_star - 1) >= \
                    predicted_speedup(p, E_hit, E_f, T_p, T_f, b_star - 1)
    assert 50 < flips < 300  # the grid covers both outcomes


def test_critical_batch_size_edges():
    # fast backup already better at b = 1: misses are common and the neural draft is slow
    assert critical_batch_size(0.2, 3.0, 1.0, 2.5, 0.0) == 1
    # never: a free neural draft (T_p = 0) cannot lose to a worse backup
    assert critical_batch_size(0.9, 4.0, 0.0, 1.0, 0.0) is None
    assert critical_batch_size(1.0, 4.0, 0.5, 1.0, 0.0) is None           # every round hits
    # T_p is clamped to 1
    assert critical_batch_size(0.8, 4.0, 5.0, 1.0, 0.0) == critical_batch_size(0.8, 4.0, 1.0, 1.0, 0.0)
    # the paper's setting flips early; our documented defaults give a small b* at temperature 0
    assert default_critical_batch_size(7, 0.0) in range(2, 9)
    # unmeasured quantities (None) take the documented defaults
    E_hit = expected_tokens(DEFAULT_A, DEFAULT_K)
    assert critical_batch_size() == critical_batch_size(DEFAULT_P_HIT[0], E_hit, DEFAULT_T_P, DEFAULT_E_F, DEFAULT_T_F)
    assert critical_batch_size(p_hit=0.2, E_f=3.5) == critical_batch_size(0.2, E_hit, DEFAULT_T_P, 3.5, DEFAULT_T_F) == 1
    with pytest.raises(ValueError, match="p_hit"):
        critical_batch_size(1.2, 4.0, 0.5, 1.0, 0.0)


def test_critical_batch_size_reads_the_neural_backups_own_time():
    """The neural backup drafts for the missed rows only; charged its measured time T_n instead of T_p (the
    whole cache's), it stays the better backup to larger batches, and never flips if it is free."""
    p, E_hit, T_p, E_f, T_f = 0.5, 3.0, 1.0, 1.7, 0.01
    charged_T_p = critical_batch_size(p, E_hit, T_p, E_f, T_f)
    assert critical_batch_size(p, E_hit, T_p, E_f, T_f, T_n=T_p) == charged_T_p
    assert charged_T_p == 1 and critical_batch_size(p, E_hit, T_p, E_f, T_f, T_n=0.3) == 5
    assert critical_batch_size(p, E_hit, T_p, E_f, T_f, T_n=0.2) is None
    for b in range(1, 40):  # the same flip as a direct comparison of the two predicted speed-ups
        faster = predicted_speedup(p, E_hit, E_f, T_p, T_f, b) > predicted_speedup(p, E_hit, E_hit, T_p, 0.3, b)
        assert faster == (b >= 5), b


def test_choose_fallback():
    assert choose_fallback("auto", 1, 4) == "neural"
    assert choose_fallback("auto", 3, 4) == "neural"
    assert choose_fallback("auto", 4, 4) == "ngram"
    assert choose_fallback("auto", 16, 4, fast="random") == "random"
    assert choose_fallback("auto", 1000, None) == "neural"  # never flips
    for policy in ("neural", "ngram", "random"):
        assert choose_fallback(policy, 1, 1) == choose_fallback(policy, 64, None) == policy
    with pytest.raises(ValueError, match="auto, neural, ngram, random"):
        choose_fallback("eagle", 1, 4)
    with pytest.raises(ValueError, match="choose one of ngram, random"):
        choose_fallback("auto", 1, 4, fast="neural")


# ----------------------------------------------------------------------------------------------------
# propose: the one call a miss makes

def test_propose_runs_the_chosen_backup():
    histories, K, V = [[1, 2, 3, 1, 2], [5, 6, 5]], 3, 50
    calls = []

    def neural():
        calls.append(1)
        return (torch.zeros(2, K, dtype=torch.long), torch.full((2, K, V), 1 / V), torch.full((2, K + 1, V), 1 / V),
                [K, K - 1])

    g = torch.Generator().manual_seed(0)
    b = propose("neural", histories, K, V, g, neural)  # the neural draft proposes, with its laws
    assert b.kind == "neural" and calls == [1] and b.q.shape == (2, K, V) and b.guess_probs.shape == (2, K + 1, V)
    assert b.lengths == [K, K - 1]  # the neural draft's rows may stop early
    # the n-gram backup: its tokens, deterministic (no laws), the draft not run
    b = propose("ngram", histories, K, V, g, neural)
    assert b.kind == "ngram" and calls == [1] and b.q is None and b.guess_probs is None
    assert b.tokens.tolist() == [ngram_propose(h, K) for h in histories] and b.lengths == [K, K]
    b = propose("random", histories, K, V, g, neural)
    assert b.kind == "random" and b.q is None and b.tokens.shape == (2, K) and int(b.tokens.max()) < V
    with pytest.raises(ValueError, match="unknown backup"):
        propose("auto", histories, K, V, g, neural)  # a policy, not a backup: choose_fallback resolves it


def test_fast_fallback_is_checked_with_the_settings():
    """A fast backup that is not one (the neural draft, an unknown name) is refused when the
    settings are made, not at the first miss of a large batch."""
    from draft import DraftSettings
    from fallback import FAST_BACKUPS
    assert FAST_BACKUPS == ("ngram", "random")
    for bad in ("neural", "auto", "zigzag"):
        with pytest.raises(ValueError, match="fast_fallback"):
            DraftSettings(fast_fallback=bad)
    assert DraftSettings(fast_fallback="random").fast_fallback == "random"
