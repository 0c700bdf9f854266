"""The verifier's accept/reject step keeps the target's law exactly (statistically at T > 0, exactly at T = 0).

Setup of the statistical tests: synthetic per-depth target distributions p_0..p_K and draft distributions
q_0..q_{K-1} that do not depend on earlier tokens, so the (j+1)-th emitted token of a round, given that the
round emits at least j+1 tokens (n >= j), must have law p_j exactly. One batched call with b = 100k rows is
100k independent rounds.
"""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from saguaro_sample import probs_from_logits, sample, saguaro  # noqa: E402
from verify import accept_reject  # noqa: E402

torch.set_num_threads(1)

B = 100_000
K = 3
TEMPS = [1.0, 0.7]


def tv_bound(p, N, delta=1e-9):
    """Bound on the total variation between p [V] and the empirical law of N i.i.d. draws from it:
    E[TV] = 1/2 sum_v E|p^_v - p_v| <= 1/2 sum_v sqrt(p_v (1 - p_v) / N) (Jensen), and changing one draw moves
    TV by at most 1/N, so McDiarmid gives P(TV > E[TV] + e) <= exp(-2 N e^2); e = sqrt(ln(1/delta) / (2N)).
    With delta = 1e-9 a correct verifier fails a check with probability < 1e-9 (seeds are fixed anyway)."""
    return 0.5 * (p * (1 - p) / N).sqrt().sum().item() + math.sqrt(math.log(1 / delta) / (2 * N))


def law_checks(x, n, t, p):
    """For each depth j with rows, (j, TV, bound) of the (j+1)-th emitted token (x_{j+1} if n > j, else the
    bonus t when n == j) against p[j] (float64 [K+1, V]), over the rows with n >= j."""
    out = []
    for j in range(p.shape[0]):
        rows = n >= j
        N = int(rows.sum())
        if N == 0:
            continue
        tok = torch.where(n[rows] > j, x[rows, j] if j < x.shape[1] else t[rows], t[rows])
        emp = torch.bincount(tok, minlength=p.shape[1]).double() / N
        out.append((j, 0.5 * (emp - p[j]).abs().sum().item(), tv_bound(p[j], N)))
    return out


def assert_law(x, n, t, p):
    checks = law_checks(x, n, t, p)
    assert checks and all(d < bound for _, d, bound in checks), checks


def assert_not_law(x, n, t, p):
    """Negative control: the same check must catch a wrong verifier."""
    checks = law_checks(x, n, t, p)
    assert any(d > bound for _, d, bound in checks), checks


# ----------------------------------------------------------------------------------------------------
# Scenarios: target logits [K+1, V] and draft distributions q [K, V], the same for every row

def scenario(name, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    V = {"random": 8, "equal": 6, "disjoint": 10, "deterministic": 5, "saguaro": 8}[name]
    logits = 1.5 * torch.randn(K + 1, V, generator=g)
    draft_logits = 1.5 * torch.randn(K, V, generator=g)
    if name == "equal":
        draft_logits = logits[:K]
    if name == "disjoint":  # target on tokens 0..4, draft on 5..9
        logits[:, V // 2:] = -float("inf")
        draft_logits[:, :V // 2] = -float("inf")
    return logits, probs_from_logits(draft_logits, T)


def draft(q, g, b=B):
    """Tokens x [b, K] drawn from q [K, V], and draft_probs [b, K, V]."""
    qb = q.expand(b, *q.shape).clone()
    return sample(qb, g), qb


def target_law(logits, T):
    return torch.softmax(logits.double() / T, -1)


def run(logits, x, qb, det, T, seed=1):
    return accept_reject(logits.expand(x.shape[0], *logits.shape), x, qb, det, T, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("T", TEMPS)
@pytest.mark.parametrize("name", ["random", "equal", "disjoint"])
def test_law_sampled_proposals(name, T):
    logits, q = scenario(name, T)
    x, qb = draft(q, torch.Generator().manual_seed(2))
    n, t = run(logits, x, qb, torch.zeros(B, dtype=torch.bool), T)
    assert n.shape == t.shape == (B,) and n.dtype == t.dtype == torch.long
    assert ((0 <= n) & (n <= K)).all()
    if name == "equal":    # p == q bitwise: u q < p for every u < 1, so everything is accepted
        assert (n == K).all()
    if name == "disjoint":  # p(x) = 0 for every proposal: reject at once, bonus from the residual = p_0
        assert (n == 0).all()
    assert_law(x, n, t, target_law(logits, T))


@pytest.mark.parametrize("T", TEMPS)
def test_law_deterministic_proposals(T):
    # Half the rows are a deterministic backup (one-hot q, garbage draft_probs); the other half sample from q.
    logits, q = scenario("deterministic", T)
    g = torch.Generator().manual_seed(3)
    x, qb = draft(q, g)
    det = torch.arange(B) % 2 == 0
    V = q.shape[-1]
    # Deterministic rows: a "random backup" token on rows 0 mod 4, a fixed "n-gram" token on rows 2 mod 4.
    x[det] = torch.randint(0, V, (int(det.sum()), K), generator=g)
    x[torch.arange(B) % 4 == 2] = torch.tensor([1, 4, 0])
    qb[det] = float("nan")
    n, t = run(logits, x, qb, det, T)
    p = target_law(logits, T)
    assert_law(x[det], n[det], t[det], p)
    assert_law(x[~det], n[~det], t[~det], p)
    # Negative control: the same deterministic proposals tested as if drawn from q break the law.
    qb[det] = q
    n, t = run(logits, x, qb, torch.zeros(B, dtype=torch.bool), T)
    assert_not_law(x[det], n[det], t[det], p)


@pytest.mark.parametrize("T", TEMPS)
def test_law_saguaro_proposals(T):
    # Draft from q' = saguaro(q, F_j, C): exact when verified with q', wrong when verified with the raw q.
    logits, q = scenario("saguaro", T)
    qp = saguaro(q, torch.tensor([1, 2, 0]), 0.2)
    x, qpb = draft(qp, torch.Generator().manual_seed(4))
    det = torch.zeros(B, dtype=torch.bool)
    p = target_law(logits, T)
    n, t = run(logits, x, qpb, det, T)
    assert_law(x, n, t, p)
    n, t = run(logits, x, q.expand(B, *q.shape), det, T)
    assert_not_law(x, n, t, p)


def biased_accept_reject(target_logits, x, q, T, g, rule):
    """Deliberately wrong verifiers for the negative controls.
    'argmax': accept x_{i+1} exactly when it is the target's argmax, else reject and draw from the residual.
    'bonus_from_p': the right accept test, but the bonus after a rejection drawn from p_n, not the residual."""
    p = torch.softmax(target_logits / T, -1)                         # [b, K+1, V]
    b, K1, V = p.shape
    px = p[:, :K].gather(-1, x[..., None]).squeeze(-1)
    qx = q.gather(-1, x[..., None]).squeeze(-1)
    u = torch.rand(b, K, generator=g)
    acc = x == p[:, :K].argmax(-1) if rule == "argmax" else u * qx < px
    n = acc.long().cumprod(-1).sum(-1)
    rows = torch.arange(b)
    p_n = p[rows, n]
    if rule == "bonus_from_p":
        return n, sample(p_n, g)
    residual = (p_n - torch.where((n < K)[:, None], q[rows, n.clamp(max=K - 1)], 0.0)).clamp(min=0)
    return n, sample(torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_n), g)


@pytest.mark.parametrize("T", TEMPS)
@pytest.mark.parametrize("rule", ["argmax", "bonus_from_p"])
def test_negative_control_biased_rules_fail(rule, T):
    logits, q = scenario("random", T)
    x, qb = draft(q, torch.Generator().manual_seed(2))
    n, t = biased_accept_reject(logits.expand(B, *logits.shape), x, qb, T, torch.Generator().manual_seed(1), rule)
    assert_not_law(x, n, t, target_law(logits, T))


# ----------------------------------------------------------------------------------------------------
# Edge cases

@pytest.mark.parametrize("T", TEMPS)
def test_k0_bonus_from_p0(T):
    logits = torch.tensor([[0.3, -1.0, 2.0, 0.0, 1.0]])
    n, t = accept_reject(logits.expand(B, 1, 5), torch.zeros(B, 0, dtype=torch.long), torch.zeros(B, 0, 5),
                         torch.zeros(B, dtype=torch.bool), T, torch.Generator().manual_seed(0))
    assert (n == 0).all() and t.shape == (B,)
    assert_law(torch.zeros(B, 0, dtype=torch.long), n, t, target_law(logits, T))


@pytest.mark.parametrize("T", TEMPS)
def test_all_zero_residual_samples_from_p(T):
    # draft_probs = 2 p (not a distribution) forces what float round-off can only make rare: every rejection
    # (probability 1/2 per token here) leaves max(p - q, 0) = 0 everywhere. The bonus must then come from p_n:
    # never a zero-probability token, never an error, and since accepted tokens are drawn from p too, every
    # emitted token has law p_j.
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(K + 1, 7, generator=g)
    logits[:, 3] = -float("inf")
    p = probs_from_logits(logits, T)
    x, _ = draft(p[:K], g)
    n, t = run(logits, x, 2 * p[:K].expand(B, K, 7), torch.zeros(B, dtype=torch.bool), T)
    assert (t != 3).all()
    frac_rejected = (n < K).double().mean().item()
    assert abs(frac_rejected - (1 - 0.5 ** K)) < 0.01
    assert_law(x, n, t, target_law(logits, T))


def test_greedy_exact():
    g = torch.Generator().manual_seed(6)
    b, V = 500, 11
    logits = torch.randn(b, K + 1, V, generator=g)
    best = logits.argmax(-1)
    m = torch.randint(0, K + 1, (b,), generator=g)  # first mismatch position (K = none)
    x = best[:, :K].clone()
    wrong = torch.arange(K)[None, :] == m[:, None]
    x[wrong] = (x[wrong] + 1 + torch.randint(0, V - 1, (int(wrong.sum()),), generator=g)) % V
    x[torch.arange(K)[None, :] > m[:, None]] = torch.randint(0, V, (1,), generator=g)  # after a mismatch: anything
    det = torch.rand(b, generator=g) < 0.5
    garbage = torch.full((b, K, V), float("nan"))
    n, t = accept_reject(logits, x, garbage, det, 0, torch.Generator())
    assert torch.equal(n, m)
    assert torch.equal(t, best[torch.arange(b), m])
    # Ties go to the lowest index, as torch.argmax and greedy decoding: drafting the higher tied token fails.
    tied = torch.tensor([[[0.0, 2.0, 2.0], [5.0, 1.0, 5.0]]])
    n, t = accept_reject(tied, torch.tensor([[2]]), torch.zeros(1, 1, 3), torch.tensor([True]), 0, torch.Generator())
    assert (n.item(), t.item()) == (0, 1)
    n, t = accept_reject(tied, torch.tensor([[1]]), torch.zeros(1, 1, 3), torch.tensor([True]), 0, torch.Generator())
    assert (n.item(), t.item()) == (1, 0)
    # K = 0 at temperature 0: the bonus is argmax p_0.
    n, t = accept_reject(logits[:, :1], x[:, :0], garbage[:, :0], det, 0, torch.Generator())
    assert (n == 0).all() and torch.equal(t, best[:, 0])


def test_deterministic_given_generator():
    logits, q = scenario("random", 1.0)
    x, qb = draft(q, torch.Generator().manual_seed(2), b=1000)
    det = torch.zeros(1000, dtype=torch.bool)
    a, b_, c = (run(logits, x, qb, det, 1.0, seed=s) for s in (7, 7, 8))
    assert torch.equal(a[0], b_[0]) and torch.equal(a[1], b_[1])
    assert not (torch.equal(a[0], c[0]) and torch.equal(a[1], c[1]))


def test_bad_input():
    g = torch.Generator()
    ok = dict(target_logits=torch.zeros(2, K + 1, 5), draft_tokens=torch.zeros(2, K, dtype=torch.long),
              draft_probs=torch.full((2, K, 5), 0.2), deterministic=torch.zeros(2, dtype=torch.bool),
              temperature=1.0, generator=g)
    accept_reject(**ok)
    for key, bad in [("draft_tokens", torch.zeros(2, K + 1, dtype=torch.long)),
                     ("draft_probs", torch.zeros(2, K, 4)), ("deterministic", torch.zeros(2)),
                     ("temperature", -0.5), ("target_logits", torch.zeros(K + 1, 5))]:
        with pytest.raises(ValueError):
            accept_reject(**{**ok, key: bad})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_law():
    dev = "cuda"
    logits, q = scenario("random", 1.0)
    logits, q = logits.to(dev), q.to(dev)
    x, qb = draft(q, torch.Generator(dev).manual_seed(2))
    det = torch.arange(B, device=dev) % 3 == 0
    n, t = accept_reject(logits.expand(B, *logits.shape), x, qb, det, 1.0, torch.Generator(dev).manual_seed(1))
    assert n.device.type == t.device.type == "cuda"
    assert_law(x.cpu(), n.cpu(), t.cpu(), target_law(logits.cpu(), 1.0))
    n0, t0 = accept_reject(logits.expand(B, *logits.shape), x, qb, det, 0, torch.Generator(dev))
    best = logits.argmax(-1)
    assert torch.equal(t0, best[n0])


def test_per_row_temperature_zero_rows_accept_as_greedy_and_rows_draw_alone():
    """Per-row temperatures and generators (issue 43): a row at T = 0 among sampled rows goes
    through the sampled test with a one-hot p, and gets greedy_accept's (n, t) exactly; each row's
    outcome depends on its own generator only (the same row alone, same generator: same outcome)."""
    b, K, V = 64, 3, 7
    g = torch.Generator().manual_seed(3)
    logits = 2 * torch.randn(b, K + 1, V, generator=g)
    q = torch.softmax(torch.randn(b, K, V, generator=g), -1)
    x = torch.where(torch.rand(b, K, generator=g) < 0.5, logits[:, :K].argmax(-1),
                    torch.randint(V, (b, K), generator=g))  # argmax often: accepts and rejects
    T = torch.tensor([0.0, 0.7, 1.0, 0.0] * (b // 4))
    det = T == 0  # greedy rows propose deterministically; their q is never read
    gens = [torch.Generator().manual_seed(100 + i) for i in range(b)]
    n, t = accept_reject(logits, x, q, det, T, gens)
    n0, t0 = accept_reject(logits, x, q, det, 0, torch.Generator())
    assert torch.equal(n[det], n0[det]) and torch.equal(t[det], t0[det])
    assert (n0[det] > 0).any() and (n0[det] < K).any()
    for i in (1, 2, 5):
        ni, ti = accept_reject(logits[i:i + 1], x[i:i + 1], q[i:i + 1], det[i:i + 1],
                               float(T[i]), [torch.Generator().manual_seed(100 + i)])
        assert (int(ni), int(ti)) == (int(n[i]), int(t[i]))
