"""The proposal length (issue 54): each row proposes L <= K tokens, and the confidence stop
(DraftSettings.confidence: a row's proposal ends after the first token the draft gives less than
the threshold) lets rows stop apart.

- `draft_k` stops rows apart: each row's tokens are those of a run without the stop, cut after its
  first unsure token, and its cache holds exactly what it fed;
- `accept_reject` tests a row as a round of L proposals: n <= L, padding never emitted, and the
  emitted law is the target's (the first token p_0; after L accepts, the bonus p_L), with a
  negative control that tests the padding;
- greedy SD and SSD (one and two processes) with the stop emit the target's tokens;
- at temperature 1 the output law of SD and SSD with the stop is the target's (the negative
  control of the law tests, a wrong q, is test_generate's and test_ssd's).
"""
import pytest
import torch

import verify
from checkpoint import load_model
from draft import draft_k, draw, guess_probs_from_logits
from saguaro_sample import exp_noise
from test_generate import empirical_law, tv, tv_bound
from test_ssd import ckpts, gen, small_vocab, PROMPTS, NEW  # noqa: F401 (fixtures)

torch.set_num_threads(1)
# thresholds that stop some rows of the pairs below early, not all: the tiny llama pair's draft
# is unsure of everything (its top token's probability 0.05-0.16 over 100 tokens), the 4-token
# pair's draft nearly sure of its tokens (0.95-0.99, or under 0.4): at 0.99 its rows propose 1.3
# tokens a round on average, of K = 2
CONFIDENCE, CONFIDENCE_4 = 0.06, 0.99


# --------------------------------------------------------------------------------------------------
# draft_k: rows stop apart

@pytest.mark.parametrize("T", [0.0, 1.0])
def test_draft_k_stops_rows_apart(ckpts, T):  # noqa: F811
    model, _ = load_model(str(ckpts["different"]), tokenizer=False)
    K, V = 5, model.config.vocab_size
    noise = None if T == 0 else exp_noise((len(PROMPTS), K, V), torch.Generator().manual_seed(1))

    def run(confidence):
        cache = model.new_cache(1024, 16)
        seqs = [cache.new_seq() for _ in PROMPTS]
        model.prefill(cache, seqs, [p[:-1] for p in PROMPTS])
        d = draft_k(model, cache, seqs, [p[-1:] for p in PROMPTS], K, T, noise,
                    confidence=confidence)
        return d, [cache.length(s) for s in seqs]

    full, _ = run(0.0)
    tokens, _, probs, lengths = full.stack()
    drawn = probs.gather(2, tokens[..., None]).squeeze(2)                 # [b, K]
    first = drawn[:, 0].sort().values
    threshold = (first[1] + first[2]).item() / 2  # two rows sure of their first token, two not
    stopped, cached = run(threshold)
    got, _, _, got_L = stopped.stack()
    sure = drawn >= threshold
    for i, p in enumerate(PROMPTS):
        unsure = [j for j in range(K - 1) if not sure[i, j]]
        L = unsure[0] + 1 if unsure else K
        assert got_L[i] == L and torch.equal(got[i, :L], tokens[i, :L]), (i, L)
        assert cached[i] == len(p) + L - 1  # fed its prompt and x_1..x_{L-1}, nothing after
    assert len(set(got_L)) > 1, got_L  # the rows did stop apart
    assert lengths == [K] * len(PROMPTS)


def test_draw_confidence_is_the_drawn_tokens_guess_probability():
    """At T = 0 the stop reads the temperature-1 softmax of the greedy token, at T > 0 the law it
    was drawn from (before Saguaro): draw's guess_probs."""
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    x, _, probs = draw(logits, 0.0, None)
    assert x.item() == 0 and torch.allclose(probs, guess_probs_from_logits(logits, 0.0))
    assert probs[0, 0] == pytest.approx(torch.softmax(logits, -1)[0, 0].item())


# --------------------------------------------------------------------------------------------------
# accept_reject: a row of length L is a round of L proposals

def law_of_a_round(lengths, honour_lengths=True, N=40000):
    """accept_reject on N rows with K = 2 proposals drawn from q, row i proposing lengths[i % 2]:
    -> (the emitted first tokens, the bonus of rows that accepted all L, n, L)."""
    g = torch.Generator().manual_seed(0)
    V, K = 4, 2
    p = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.3, 0.3, 0.1, 0.3], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.4, 0.1, 0.3, 0.2], [0.1, 0.2, 0.3, 0.4]])
    L = torch.tensor(lengths * (N // len(lengths)))
    x = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g)
                     for i in range(K)], 1)                              # [N, K]
    x[:, 1] = torch.where(L < 2, 3, x[:, 1])  # padding: a token the target likes
    draft_probs = q.expand(N, K, V).clone()
    draft_probs[L < 2, 1] = 0  # as a round's padding is: zeros
    logits = p.log().expand(N, K + 1, V)
    n, t = verify.accept_reject(logits, x, draft_probs, torch.zeros(N, dtype=torch.bool), 1.0,
                                g, lengths=L.tolist() if honour_lengths else None)
    first = torch.where(n > 0, x[:, 0], t)
    return first, t[n == L], n, L, p


def test_accept_reject_tests_a_row_as_a_round_of_its_length():
    first, bonus_after_all, n, L, p = law_of_a_round([1, 2])
    assert (n <= L).all() and (n == 0).any() and (n == 1).any() and (n == 2).any()
    N = len(first)
    law0 = {(i,): p[0, i].item() for i in range(4)}
    assert tv(empirical_law([[x] for x in first.tolist()], 1), law0) < tv_bound(law0, N)
    # rows of length 1 that accepted x_1: the bonus is p_1's draw, not a residual's
    t1 = bonus_after_all[L[n == L] == 1]
    law1 = {(i,): p[1, i].item() for i in range(4)}
    assert tv(empirical_law([[x] for x in t1.tolist()], 1), law1) < tv_bound(law1, len(t1))


def test_accept_reject_negative_control_padding_tested():
    """The same round with the lengths ignored tests the padding as a proposal: rows of length 1
    then emit it (n = 2 > L)."""
    _, _, n, L, _ = law_of_a_round([1, 2], honour_lengths=False)
    assert (n > L).any()


# --------------------------------------------------------------------------------------------------
# Greedy: the target's tokens with the stop, in SD and SSD, one and two processes

@pytest.mark.parametrize("mode,parallel", [("sd", True), ("ssd", False), ("ssd", True)])
def test_greedy_with_the_confidence_stop(ckpts, mode, parallel):  # noqa: F811
    res = gen(PROMPTS, ckpts["target"], ckpts["different"], mode=mode, k=4,
              confidence=CONFIDENCE, max_new_tokens=NEW, parallel=parallel)
    assert res.tokens == ckpts["ref"]
    s = res.stats
    # rows stopped early: fewer tokens proposed than K per row-round
    assert 0 < s["proposed_tokens"] < 4 * sum(s["accept_len_histogram"]), s


@pytest.mark.parametrize("parallel", [False, True])
def test_a_round_is_as_wide_as_its_longest_proposal(ckpts, monkeypatch, parallel):  # noqa: F811
    """SSD's hits with the stop: the verifier runs W + 1 positions, W the longest row's L, not the
    steps the whole pre-speculation took (each padded position is a row of the target's forward)."""
    widths = []
    real = verify.Verifier.verify

    def record(self, rows, tokens, q, deterministic, lengths):
        widths.append((tokens.shape[1], max(lengths)))
        return real(self, rows, tokens, q, deterministic, lengths)

    monkeypatch.setattr(verify.Verifier, "verify", record)
    res = gen(PROMPTS, ckpts["target"], ckpts["different"], mode="ssd", k=4,
              confidence=CONFIDENCE, max_new_tokens=NEW, parallel=parallel)
    assert res.tokens == ckpts["ref"] and res.stats["cache_hit_rate"] > 0, res.stats
    assert [w for w, _ in widths] == [L for _, L in widths], widths


# --------------------------------------------------------------------------------------------------
# Temperature 1: the output law with the stop is the target's

N_LAW = 4000


def law_run(small_vocab, mode, N=N_LAW, **kw):  # noqa: F811
    tgt, dft, prompt, laws = small_vocab
    res = gen([prompt] * N, tgt, dft, mode=mode, k=2, confidence=CONFIDENCE_4, temperature=1.0,
              max_new_tokens=3, seed=17, parallel=False, **kw)
    s = res.stats
    row_rounds = sum(s["accept_len_histogram"])
    assert row_rounds < s["proposed_tokens"] < 2 * row_rounds, s  # some rows proposed 1, some 2
    return tv(empirical_law(res.tokens, 3), laws[1.0]), tv_bound(laws[1.0], N)


@pytest.mark.parametrize("mode,kw", [("sd", {}), ("ssd", dict(budget=3, fallback="neural")),
                                     ("ssd", dict(budget=3, fallback="ngram", saguaro_c=0.3))])
def test_law_with_the_confidence_stop(small_vocab, mode, kw):  # noqa: F811
    d, bound = law_run(small_vocab, mode, **kw)
    assert d < bound, (d, bound)
