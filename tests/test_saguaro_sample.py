"""Saguaro sampling (Definition 14), seeded sampling and logits -> probabilities."""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from saguaro_sample import argmax, probs_from_logits, sample, saguaro  # noqa: E402

torch.set_num_threads(1)


def random_q(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(2 * torch.randn(*shape, generator=g), -1)


def tv_bound(p, N, delta=1e-9):
    """Total-variation bound on the empirical law of N i.i.d. draws from p [V] (float64):
    E[TV] = 1/2 sum_v E|p^_v - p_v| <= 1/2 sum_v sqrt(p_v (1 - p_v) / N) (Jensen), and TV changes
    by at most 1/N when one draw changes, so McDiarmid gives P(TV > E[TV] + e) <= exp(-2 N e^2):
    e = sqrt(ln(1/delta) / (2N))."""
    return 0.5 * (p * (1 - p) / N).sqrt().sum().item() + math.sqrt(math.log(1 / delta) / (2 * N))


def tv(tokens, p):
    V = p.shape[-1]
    emp = torch.bincount(tokens.flatten(), minlength=V).double() / tokens.numel()
    return 0.5 * (emp - p.double()).abs().sum().item()


# --------------------------------------------------------------------------------------------------
# saguaro()

@pytest.mark.parametrize("f,c", [(0, 0.5), (2, 0.0), (3, 0.3), (8, 0.9)])
def test_saguaro_definition(f, c):
    q = random_q((5, 3, 12))
    qp = saguaro(q, f, c)
    assert qp.shape == q.shape and qp.dtype == torch.float32
    assert torch.allclose(qp.sum(-1), torch.ones(5, 3), atol=1e-6)
    S = torch.zeros_like(q, dtype=torch.bool).scatter(-1, q.topk(f + 1, -1).indices, True)
    # Outside S every ratio q'/q is the same constant 1/Z (so order and ratios are kept); inside S
    # it is C/Z.
    ratio = qp / q
    out_ratio = ratio.masked_fill(S, float("nan"))
    one_over_Z = out_ratio.nanmean(-1, keepdim=True)
    assert torch.allclose(out_ratio[~S], one_over_Z.expand_as(q)[~S], rtol=1e-5)
    assert torch.allclose(ratio[S], (c * one_over_Z).expand_as(q)[S], rtol=1e-5, atol=1e-7)
    # Z computed independently: 1 - (1 - C) q(S).
    Z = 1 - (1 - c) * (q * S).sum(-1, keepdim=True)
    assert torch.allclose(one_over_Z, 1 / Z, rtol=1e-5)


def test_saguaro_scaled_set_is_exactly_top_f_plus_1():
    q = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10 - 1e-3, 1e-3])  # 0.10 vs 0.099: distinct
    qp = saguaro(q, 2, 0.5)
    lowered = (qp / q) < (qp / q).max() * (1 - 1e-4)
    assert lowered.nonzero().flatten().tolist() == [1, 3, 4]  # the three largest: 0.30, 0.25, 0.20
    qp0 = saguaro(q, 0, 0.5)
    assert ((qp0 / q) < (qp0 / q).max() * (1 - 1e-4)).nonzero().flatten().tolist() == [1]


def test_saguaro_c1_is_identity():
    q = random_q((4, 9))
    assert saguaro(q, 3, 1.0) is q
    assert saguaro(q, torch.tensor([0, 1, 2, 3]), 1) is q


def test_saguaro_per_row_f_matches_scalar_calls():
    q = random_q((6, 10), seed=1)
    f = torch.tensor([0, 1, 2, 5, 9, 20])  # 9 and 20: every token is in the set -> q unchanged
    qp = saguaro(q, f, 0.25)
    for i in range(6):
        assert torch.allclose(qp[i], saguaro(q[i], int(f[i]), 0.25), atol=1e-7)
    assert torch.allclose(qp[4], q[4], atol=1e-6) and torch.allclose(qp[5], q[5], atol=1e-6)
    # Leading dims [2, 3] with f [2, 3].
    assert torch.allclose(saguaro(q.view(2, 3, 10), f.view(2, 3), 0.25), qp.view(2, 3, 10))


def test_saguaro_c0():
    q = random_q((3, 8), seed=2)
    qp = saguaro(q, 1, 0.0)
    top2 = q.topk(2, -1).indices
    assert (qp.gather(-1, top2) == 0).all()  # C = 0 removes the set entirely
    assert torch.allclose(qp.sum(-1), torch.ones(3))


def test_saguaro_c0_degenerate_returns_q():
    # Row 0: all mass inside the top 2 -> q' undefined for C = 0 -> that row keeps q. Row 1: normal.
    q = torch.tensor([[0.7, 0.3, 0.0, 0.0], [0.4, 0.3, 0.2, 0.1]])
    qp = saguaro(q, 1, 0.0)
    assert torch.equal(qp[0], q[0])
    assert torch.allclose(qp[1], torch.tensor([0.0, 0.0, 2 / 3, 1 / 3]))
    assert not torch.isnan(qp).any()
    # A one-hot q (e.g. a temperature-0 draft) with f = 0 is the same case.
    oh = torch.tensor([0.0, 1.0, 0.0])
    assert torch.equal(saguaro(oh, 0, 0.0), oh)


@pytest.mark.parametrize("f,c", [(-1, 0.5), (1, -0.1), (1, 1.5), (1, float("nan")), (1.5, 0.5),
                                 (torch.tensor([1, -1]), 0.5), (torch.tensor([1.0, 2.0]), 0.5)])
def test_saguaro_rejects_bad_input(f, c):
    with pytest.raises(ValueError):
        saguaro(random_q((2, 5)), f, c)


# --------------------------------------------------------------------------------------------------
# sample(), probs_from_logits()

def test_sample_deterministic_given_seed():
    probs = random_q((3, 50, 7), seed=3)
    a = sample(probs, torch.Generator().manual_seed(11))
    b = sample(probs, torch.Generator().manual_seed(11))
    c = sample(probs, torch.Generator().manual_seed(12))
    assert a.shape == (3, 50) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)
    # The global RNG is neither used nor disturbed.
    state = torch.get_rng_state()
    sample(probs, torch.Generator().manual_seed(11))
    assert torch.equal(state, torch.get_rng_state())


def test_sample_law_matches_probs():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.4, 0.0, 0.25, 0.2, 0.1, 0.05, 0.0])
    N = 200_000
    tok = sample(p.expand(4, N // 4, 7), g)  # leading dims [4, N/4]
    assert tok.shape == (4, N // 4)
    assert (p[tok] > 0).all()  # never a zero-probability token
    assert tv(tok, p) < tv_bound(p.double(), N)
    # Negative control: the same check rejects a law off by 0.02 in TV.
    wrong = p.clone()
    wrong[0] -= 0.02
    wrong[2] += 0.02
    assert tv(tok, wrong) > tv_bound(wrong.double(), N)
    # Unnormalised rows are fine (the residual of the verifier is passed unnormalised).
    tok2 = sample(3 * p.expand(N, 7), g)
    assert tv(tok2, p) < tv_bound(p.double(), N)


def test_sample_empty_rows():
    assert sample(torch.ones(0, 5), torch.Generator()).shape == (0,)


def test_probs_from_logits():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.5, -1.0, 0.0, 0.2]], dtype=torch.bfloat16)
    oh = probs_from_logits(logits, 0)
    assert oh.dtype == torch.float32
    assert torch.equal(oh, torch.tensor([[0.0, 1, 0, 0], [1, 0, 0, 0]]))  # tie -> lowest index
    assert torch.equal(logits.argmax(-1), oh.argmax(-1))  # greedy decoding's argmax, same ties
    for T in (1.0, 0.7):
        p = probs_from_logits(logits, T)
        assert p.dtype == torch.float32
        assert torch.allclose(p, torch.softmax(logits.double() / T, -1).float(), atol=1e-6)
    with pytest.raises(ValueError):
        probs_from_logits(logits, -1.0)


@pytest.mark.parametrize("V", [49152, 128256, 151936, 4096, 32001, 16384])
def test_argmax_is_torchs_first_largest(V):
    """The block-wise argmax gives torch's index: ties inside a block and across blocks (the
    first wins), NaN (counts as largest, the first one), a row all -inf, +inf, the largest in the
    last block, bfloat16, any leading dims. V 4096 and 32001 take torch's own (a small row; no
    block divides 32001); a form that takes the last of tied blocks, or the last tie inside the
    block, fails the other four."""
    g = torch.Generator().manual_seed(V)
    x = torch.randn(7, 3, V, generator=g)
    x[0, 0, [5, V // 2, V - 1]] = 9.0           # tied across blocks
    x[0, 1, [700, 701]] = 9.0                   # tied inside a block
    x[0, 2, [V - 3, 10]] = float("nan")         # NaN wins, the first one
    x[1, 0] = -float("inf")                     # nothing larger than -inf: index 0
    x[1, 1, [V - 2, 3]] = float("inf")
    x[1, 2, V - 1] = 50.0                       # in the last block
    for t in (x, x.bfloat16(), x[0, 0], x[:, :, :].reshape(21, V), x[:0]):
        assert torch.equal(argmax(t), t.argmax(-1))
