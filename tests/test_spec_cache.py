"""Fan-out (Theorem 12), guess selection, the speculation cache and the running estimates of a
and r."""
import math
import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from spec_cache import (FAN_OUTS, AcceptanceTracker, CacheStats, SpecCache,  # noqa: E402
                        acceptance_trials, check_fan_out, expected_tokens, rule_fan_out, fit_power_law,
                        geometric_fan_out, geometric_fan_out_real, guess_triples, parse_fan_out,
                        select_guesses_batch, uniform_fan_out)

torch.set_num_threads(1)


# --------------------------------------------------------------------------------------------------
# Fan-out

def expected_hit_rate(F: list, a: float, r: float) -> float:
    """The model's p_hit for fan-out F (len K+1; real values allowed) at acceptance rate a:
    sum_j P(n = j) (1 - F_j^(-r)), P capped-geometric; a depth's hit chance is clipped at 0."""
    K = len(F) - 1
    P = [(1 - a) * a ** j for j in range(K)] + [a ** K]  # P(n = j), capped geometric
    return sum(p * max(0.0, 1 - f ** -r) if f > 0 else 0.0 for p, f in zip(P, F))


def closed_form(a, r, K, B):
    """Theorem 12 written out independently of the module."""
    w = [a ** (j / (1 + r)) for j in range(K)] + [a ** (K / (1 + r)) * (1 - a) ** (-1 / (1 + r))]
    return [B * x / sum(w) for x in w]


@pytest.mark.parametrize("a,r,K,B", [(0.8, 0.8, 7, 24), (0.5, 0.3, 3, 10), (0.95, 2.0, 10, 50),
                                     (0.2, 1.0, 1, 5), (0.7, 0.5, 0, 4)])
def test_geometric_matches_theorem_12(a, r, K, B):
    F = geometric_fan_out_real(a, r, K, B)
    assert F == pytest.approx(closed_form(a, r, K, B), rel=1e-12)
    assert sum(F) == pytest.approx(B)
    q = a ** (1 / (1 + r))
    for j in range(K - 1):
        assert F[j + 1] / F[j] == pytest.approx(q, rel=1e-12)
    if K >= 1:  # the last step carries the extra (1-a)^(-1/(1+r))
        assert F[K] / F[K - 1] == pytest.approx(q * (1 - a) ** (-1 / (1 + r)), rel=1e-12)


def perturbations(n, count, eps, seed=0):
    g = random.Random(seed)
    for _ in range(count):
        d = [g.uniform(-1, 1) for _ in range(n)]
        m = sum(d) / n
        yield [eps * (x - m) for x in d]  # sum 0: same budget


@pytest.mark.parametrize("a,r,K", [(0.8, 0.8, 7), (0.6, 0.4, 4), (0.9, 1.5, 5)])
def test_geometric_maximises_hit_rate_locally(a, r, K):
    B = 40 * (K + 1)  # every real F_j well above 1, where the objective is smooth
    F = geometric_fan_out_real(a, r, K, B)
    assert min(F) > 1
    best = expected_hit_rate(F, a, r)
    for d in perturbations(K + 1, 200, eps=0.5):
        assert expected_hit_rate([f + x for f, x in zip(F, d)], a, r) < best
    # Lagrange condition: the marginal gain P(n=j) r F_j^(-r-1) is the same at every depth
    P = [(1 - a) * a ** j for j in range(K)] + [a ** K]
    grads = [p * r * f ** (-r - 1) for p, f in zip(P, F)]
    assert max(grads) == pytest.approx(min(grads), rel=1e-9)
    # negative control: the uniform real vector fails the same check (some perturbation improves it)
    U = [B / (K + 1)] * (K + 1)
    u = expected_hit_rate(U, a, r)
    assert u < best
    assert any(expected_hit_rate([f + x for f, x in zip(U, d)], a, r) > u
               for d in perturbations(K + 1, 200, eps=0.5))


@pytest.mark.parametrize("a", [0.0, 1e-6, 0.01, 0.3, 0.8, 0.99, 0.999999, 1.0])
@pytest.mark.parametrize("r", [0.1, 0.8, 3.0])
@pytest.mark.parametrize("K", [0, 1, 3, 7, 15])
def test_geometric_rounding_keeps_budget(a, r, K):
    for B in [1, 2, 3, K, K + 1, K + 2, 24, 101]:
        if B < 1:
            continue
        F = geometric_fan_out(a, r, K, B)
        real = geometric_fan_out_real(a, r, K, B)
        assert len(F) == K + 1 and sum(F) == B
        assert all(isinstance(f, int) and f >= 0 for f in F)
        # floor or floor + 1
        assert all(math.floor(x) <= f <= math.floor(x) + 1 for f, x in zip(F, real))
        assert all(f >= 1 for f, x in zip(F, real) if x >= 1)


def test_geometric_rounding_is_largest_remainder():
    F = geometric_fan_out_real(0.9, 0.5, 7, 8)
    G = geometric_fan_out(0.9, 0.5, 7, 8)
    left = 8 - sum(math.floor(x) for x in F)
    order = sorted(range(8), key=lambda j: -(F[j] - math.floor(F[j])))
    assert G == [math.floor(F[j]) + (j in order[:left]) for j in range(8)]


def test_geometric_clamps_a_and_validates():
    assert geometric_fan_out(0.0, 0.8, 5, 12) == geometric_fan_out(0.01, 0.8, 5, 12)
    assert geometric_fan_out(1.0, 0.8, 5, 12) == geometric_fan_out(0.99, 0.8, 5, 12)
    for args, msg in [((1.5, 0.8, 5, 12), "acceptance rate"),
                      ((-0.1, 0.8, 5, 12), "acceptance rate"),
                      ((0.8, 0.0, 5, 12), "exponent r"), ((0.8, float("inf"), 5, 12), "exponent r"),
                      ((0.8, 0.8, -1, 12), "K must"), ((0.8, 0.8, 5, 0), "budget B")]:
        with pytest.raises(ValueError, match=msg):
            geometric_fan_out(*args)


def test_uniform_fan_out():
    assert uniform_fan_out(3, 10) == [3, 3, 2, 2]
    assert uniform_fan_out(7, 24) == [3] * 8
    assert uniform_fan_out(7, 3) == [1, 1, 1, 0, 0, 0, 0, 0]
    for K in range(10):
        for B in range(1, 40):
            F = uniform_fan_out(K, B)
            assert len(F) == K + 1 and sum(F) == B and max(F) - min(F) <= 1
            assert F == sorted(F, reverse=True)


def test_fan_out_spec():
    assert rule_fan_out("uniform", 0.8, 0.8, 3, 10) == uniform_fan_out(3, 10)
    assert rule_fan_out("geometric", 0.8, 0.8, 3, 10) == geometric_fan_out(0.8, 0.8, 3, 10)
    assert rule_fan_out([1, 0, 2], 0.8, 0.8, 2, 999) == [1, 0, 2]  # an explicit list is its own budget
    assert rule_fan_out("3,3,3", 0.8, 0.8, 2, 9) == [3, 3, 3]
    with pytest.raises(ValueError, match=r"K\+1 = 4"):
        rule_fan_out([1, 2, 3], 0.8, 0.8, 3, 6)
    with pytest.raises(ValueError, match="non-negative"):
        rule_fan_out([1, -1, 3], 0.8, 0.8, 2, 3)
    with pytest.raises(ValueError, match="non-negative"):
        rule_fan_out([1, 1.5, 3], 0.8, 0.8, 2, 3)
    with pytest.raises(ValueError, match="uniform"):
        rule_fan_out("exponential", 0.8, 0.8, 2, 3)


def test_expected_hit_rate():
    # the same F at every depth: 1 - F^(-r), whatever a is
    for a in (0.1, 0.5, 0.9):
        assert expected_hit_rate([3] * 8, a, 0.8) == pytest.approx(1 - 3 ** -0.8)
    assert expected_hit_rate([0] * 4, 0.5, 1.0) == 0.0
    # only the all-accepted depth cached: its probability a^K times its hit chance
    assert expected_hit_rate([0, 0, 4], 0.6, 1.0) == pytest.approx(0.36 * 0.75)


# --------------------------------------------------------------------------------------------------
# Guess selection

def select_guesses(q_raw, drafted, F):
    """The single-sequence reference: q_raw [K+1, V], drafted [K] -> per depth j its top-F_j token
    ids (descending), without drafted[j] for j < K; nothing is excluded at depth K."""
    K = q_raw.shape[0] - 1
    guesses = []
    for j in range(K + 1):
        k = min(F[j] + (j < K), q_raw.shape[1])
        top = q_raw[j].topk(k).indices.tolist() if k > 0 else []
        if j < K:
            top = [t for t in top if t != int(drafted[j])]
        guesses.append(top[:F[j]])
    return guesses


def brute_force_guesses(q, drafted, F):
    K = q.shape[0] - 1
    out = []
    for j in range(K + 1):
        order = sorted(range(q.shape[1]), key=lambda t: -float(q[j, t]))
        if j < K:
            order = [t for t in order if t != int(drafted[j])]
        out.append(order[:F[j]])
    return out


def random_round(g, K, V):
    q = torch.softmax(torch.randn(K + 1, V, generator=g) * 2, -1)  # continuous: no ties
    drafted = torch.randint(V, (K,), generator=g)
    drafted[::2] = q[:K:2].argmax(-1)  # usually the drafted token is the top one
    return q, drafted


def test_select_guesses_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    for K, V, F in [(4, 30, [3, 2, 0, 5, 1]), (7, 100, [3] * 8), (0, 10, [4]), (2, 5, [4, 9, 9])]:
        for _ in range(5):
            q, drafted = random_round(g, K, V)
            guesses = select_guesses(q, drafted, F)
            assert guesses == brute_force_guesses(q, drafted, F)
            for j, gs in enumerate(guesses):
                assert len(gs) == min(F[j], V - (j < K))  # at most V-1 tokens once one is excluded
                assert len(set(gs)) == len(gs)
                if j < K:
                    assert int(drafted[j]) not in gs


def test_depth_K_excludes_nothing():
    K, V = 3, 20
    q = torch.softmax(torch.randn(K + 1, V, generator=torch.Generator().manual_seed(1)), -1)
    drafted = q[:K].argmax(-1)
    q[K] = q[K - 1]  # depth K's top token is the last drafted token: still a valid guess there
    for guesses in (select_guesses(q, drafted, [2] * (K + 1)),
                    select_guesses_batch(q[None], drafted[None], [[2] * (K + 1)])[0].tolist()):
        assert int(drafted[K - 1]) not in guesses[K - 1]
        assert guesses[K][0] == int(drafted[K - 1])
    # asking for the whole vocabulary: V-1 tokens at a rejection depth, all V at depth K
    full = select_guesses_batch(q[None], drafted[None], [[V] * (K + 1)])[0]
    for j in range(K):
        got = sorted(t for t in full[j].tolist() if t >= 0)
        assert got == [t for t in range(V) if t != int(drafted[j])]
    assert sorted(full[K].tolist()) == list(range(V))


def test_exclusion_survives_ties():
    # -inf logits tie with each other: the drafted token must still never come back
    V, K = 8, 2
    logits = torch.full((K + 1, V), float("-inf"))
    logits[:, :2] = torch.tensor([1.0, 0.5])
    drafted = torch.tensor([5, 6])  # both among the -inf ties
    for guesses in (select_guesses(logits, drafted, [V, V, V]),
                    select_guesses_batch(logits[None], drafted[None], [[V, V, V]])[0].tolist()):
        assert 5 not in guesses[0] and 6 not in guesses[1]
        assert guesses[0][:2] == [0, 1] and guesses[1][:2] == [0, 1]


def test_batched_guesses_equal_per_sequence():
    g = torch.Generator().manual_seed(2)
    b, K, V, F = 6, 4, 50, [3, 0, 2, 5, 1]
    rounds = [random_round(g, K, V) for _ in range(b)]
    q = torch.stack([r[0] for r in rounds])
    drafted = torch.stack([r[1] for r in rounds])
    per_seq = [select_guesses(q[i], drafted[i], F) for i in range(b)]

    padded = select_guesses_batch(q, drafted, [F] * b)
    assert padded.shape == (b, K + 1, max(F))
    for i in range(b):
        for j in range(K + 1):
            assert padded[i, j].tolist() == per_seq[i][j] + [-1] * (max(F) - F[j])

    expect = [(i, j, t) for i in range(b) for j in range(K + 1) for t in per_seq[i][j]]
    assert guess_triples(padded.tolist()) == expect  # read to the host once (draft.pre_speculate)
    assert len(expect) == b * sum(F)


def test_each_row_has_its_own_fan_out():
    """Rows with different F_0..F_K in one batch get what each would get alone; a row padded to depth
    0 only (round 0: no proposals, drafted -1, zero scores below) guesses its top F_0 there and nothing
    deeper."""
    g = torch.Generator().manual_seed(3)
    K, V = 3, 40
    rounds = [random_round(g, K, V) for _ in range(3)]
    q = torch.stack([r[0] for r in rounds])
    drafted = torch.stack([r[1] for r in rounds])
    q[2, 1:] = 0
    drafted[2] = -1
    F = [[3, 2, 1, 1], [1, 0, 0, 6], [5, 0, 0, 0]]
    got = select_guesses_batch(q, drafted, F).tolist()
    for i in range(2):
        assert [[x for x in d if x >= 0] for d in got[i]] == select_guesses(q[i], drafted[i], F[i])
    assert [x for x in got[2][0] if x >= 0] == q[2, 0].topk(5).indices.tolist()
    assert all(x == -1 for d in got[2][1:] for x in d)


def test_fan_out_names_and_parsing():
    assert list(FAN_OUTS) == ["geometric", "uniform"]
    for name, rule in FAN_OUTS.items():  # every rule: K + 1 non-negative counts summing to B
        for K, B in ((0, 3), (1, 5), (4, 9), (7, 40)):
            F = rule_fan_out(name, 0.6, 0.8, K, B)
            assert len(F) == K + 1 and sum(F) == B and min(F) >= 0, (name, K, B, F)
    assert [parse_fan_out(x) for x in ("geometric", "uniform", "3,2,1", "8")] == \
        ["geometric", "uniform", [3, 2, 1], [8]]
    assert check_fan_out((2, 1), 1) == [2, 1] and check_fan_out("uniform", 5) == "uniform"
    for bad, K in (("zigzag", 2), ([1, 1], 2), ([1, -1, 1], 2), (3, 2)):
        with pytest.raises(ValueError, match="fan_out") as e:
            check_fan_out(bad, K)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="geometric or uniform"):
        parse_fan_out("3,x")


def test_guess_validation():
    q = torch.rand(2, 4, 10)
    with pytest.raises(ValueError, match=r"K\+1 = 4"):
        select_guesses_batch(q, torch.zeros(2, 3, dtype=torch.long), [[1, 1, 1]] * 2)
    with pytest.raises(ValueError, match="drafted must be"):
        select_guesses_batch(q, torch.zeros(2, 2, dtype=torch.long), [[1, 1, 1, 1]] * 2)
    with pytest.raises(ValueError, match="per sequence"):  # one row of F per sequence
        select_guesses_batch(q, torch.zeros(2, 3, dtype=torch.long), [[1, 1, 1, 1]])
    none = select_guesses_batch(q, torch.zeros(2, 3, dtype=torch.long), [[0, 0, 0, 0]] * 2)
    assert guess_triples(none.tolist()) == []


# --------------------------------------------------------------------------------------------------
# The cache

def test_spec_cache_put_get_clear_and_counters():
    c = SpecCache(K=3)
    c.put(0, 0, 11, "a")
    c.put(0, 3, 12, "b")
    c.put(1, 2, 11, "c")
    assert len(c) == 3 and (0, 3, 12) in c and (0, 3, 13) not in c
    with pytest.raises(ValueError, match="already cached"):
        c.put(0, 0, 11, "again")
    with pytest.raises(ValueError, match="accepted count"):
        c.put(0, 4, 11, "x")

    assert c.get(0, 3, 12) == "b"      # hit: handed over and removed
    assert c.get(0, 3, 12) is None     # so a second lookup misses
    assert c.get(1, 1, 11) is None     # miss: right token, wrong depth
    assert len(c) == 2
    assert sorted(c.clear()) == ["a", "c"]  # unclaimed branches, for freeing
    assert len(c) == 0 and c.clear() == []

    s = c.stats
    assert (s.lookups, s.hits, s.misses, s.entries) == (3, 1, 2, 3)
    assert s.hit_rate == pytest.approx(1 / 3)
    assert s.lookups_per_depth == [0, 1, 0, 2] and s.hits_per_depth == [0, 0, 0, 1]
    c.put(0, 0, 11, "d")                # counters survive clear(): cumulative
    assert c.get(0, 0, 11) == "d" and c.stats.hits == 2 and c.stats.lookups == 4
    assert CacheStats(K=2).hit_rate == 0.0


def test_spec_cache_without_K_grows_depth_counters():
    c = SpecCache()
    c.put(0, 0, 5, "round 0")
    assert c.get(0, 0, 5) == "round 0"
    assert c.get(0, 4, 1) is None
    assert c.stats.lookups_per_depth == [1, 0, 0, 0, 1]
    assert c.stats.hits_per_depth == [1, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="accepted count"):
        c.get(0, -1, 5)


# --------------------------------------------------------------------------------------------------
# Running estimates

def test_fit_power_law_recovers_r():
    Fs = [2, 4, 8, 16, 32, 64, 128]
    assert fit_power_law(Fs, [f ** -0.7 for f in Fs]) == pytest.approx(0.7, rel=1e-12)
    # sampled hit counts: the fit must land within sampling noise of the truth
    g = torch.Generator().manual_seed(3)
    N = 20000
    miss = [float(torch.bernoulli(torch.full((N,), f ** -0.7), generator=g).mean()) for f in Fs]
    assert fit_power_law(Fs, miss) == pytest.approx(0.7, abs=0.02)
    assert fit_power_law([], [], default=0.3) == 0.3
    assert fit_power_law([1, 1], [1.0, 1.0], default=0.3) == 0.3  # no slope information
    assert fit_power_law([4, 8], [1.0, 0.0], default=0.3) == 0.3  # rates outside (0, 1) are skipped


def simulate_rounds(a, K, rounds, seed):
    g = torch.Generator().manual_seed(seed)
    acc = torch.rand(rounds, K, generator=g) < a                # [rounds, K] i.i.d. acceptances
    return acc.long().cumprod(1).sum(1)                         # n = accepted before a rejection


def test_acceptance_trials():
    # n accepted of K: n + 1 trials (the last one the rejection), or K when all K were accepted
    assert [acceptance_trials(n, 3) for n in range(4)] == [1, 2, 3, 3]
    assert acceptance_trials(0, 1) == 1 and acceptance_trials(1, 1) == 1
    assert acceptance_trials(0, 0) == 0  # nothing proposed: no trial
    t = AcceptanceTracker()
    t.update([0, 3, 1], 3)
    assert (t.accepted, t.trials) == (4, 1 + 3 + 2)


def test_acceptance_tracker_estimates_a():
    a, K, rounds = 0.7, 5, 20000
    n = simulate_rounds(a, K, rounds, seed=4)
    t = AcceptanceTracker(warmup=10)
    assert t.a() == pytest.approx(0.8) and not t.ready  # DEFAULT_A before data
    t.update(0, 0)                                       # round 0 proposes nothing: no information
    assert t.rounds == 0 and t.a() == pytest.approx(0.8)
    for chunk in n.split(100):
        t.update(chunk, K)
    t.update(int(n[0]), K)                               # a single sequence's count works too
    n = torch.cat([n, n[:1]])
    assert t.ready and t.rounds == rounds + 1
    sigma = math.sqrt(a * (1 - a) / t.trials)   # MLE standard error
    assert abs(t.a() - a) < 4 * sigma
    assert t.expected_tokens(K) == pytest.approx(expected_tokens(t.a(), K))
    # negative controls fail the same bound: ignoring the cap (n + 1 trials even when n = K),
    # and mean(n) / K
    uncapped = float(n.sum()) / float((n + 1).sum())
    assert abs(uncapped - a) > 4 * sigma
    assert abs(float(n.float().mean()) / K - a) > 4 * sigma
    with pytest.raises(ValueError, match="accepted count"):
        t.update([K + 1], K)


def test_acceptance_tracker_estimates_r_and_fan_out():
    g = torch.Generator().manual_seed(5)
    t = AcceptanceTracker(min_lookups=100)
    assert t.r() == pytest.approx(0.8)  # DEFAULT_R before data
    for F in (2, 4, 8):
        for hit in (torch.rand(5000, generator=g) > F ** -0.6).tolist():
            t.observe_lookup(F, hit)
    t.observe_lookup(64, True)  # too few lookups at F = 64: ignored
    assert t.r() == pytest.approx(0.6, abs=0.05)
    t.update([0, 3, 1], 3)
    assert t.a() == 4 / 6  # trials 1 + 3 + 2
    F = geometric_fan_out(t.a(), t.r(), 3, 12)
    assert sum(F) == 12 and F == geometric_fan_out(4 / 6, 0.6, 3, 12)


def test_expected_tokens():
    for a, K in [(0.3, 1), (0.8, 7), (0.95, 12)]:
        P = [(1 - a) * a ** j for j in range(K)] + [a ** K]
        assert expected_tokens(a, K) == pytest.approx(sum(p * (j + 1) for j, p in enumerate(P)))
    assert expected_tokens(1.0, 5) == 6 and expected_tokens(0.0, 5) == 1


def test_drop_rows_removes_only_those_rows_entries():
    """A row that leaves a running batch (continuous batching) takes its branches with it; the
    other rows' entries stay for their lookups."""
    cache = SpecCache(K=2)
    cache.put(0, 0, 5, "a"), cache.put(0, 1, 6, "b"), cache.put(1, 0, 5, "c"), cache.put(2, 2, 7, "d")
    assert sorted(cache.drop_rows([0, 2])) == ["a", "b", "d"]
    assert len(cache) == 1 and (1, 0, 5) in cache and cache.drop_rows([0]) == []
    assert cache.get(1, 0, 5) == "c"
