"""Continuous batching keeps the output law the target's (issue 43, item 3): rows that join a
running batch at different rounds, next to rows mid-generation and rows leaving, emit the target's
exact law at temperature > 0, in SD and in SSD (one process: a Speculator here).

The engine is built here from its pieces (Verifier, load_draft, SDRounds / SSDRounds, Output,
Scheduler), and the test drives the scheduler itself: WAVES requests are submitted between rounds
(`sched.step()`), alternating two short prompts of different lengths and laws, with max_tokens
cycling through MAX_TOKENS so that rows leave at different rounds, and max_batch below a wave so
that the queue backs up and rows are admitted at every boundary as others leave. A row "joins
late" when the batch it joins already has rows running: in SSD it misses once and the fallback
proposes its first round, next to rows that hit; in SD the draft proposes for it next to rows
whose caches are rounds ahead.

The check is test_generate's: the empirical joint law of the first 3 emitted tokens against the
target's exact law (`exact_law`, by enumeration over V^3 continuations) in total variation, below
`tv_bound` (pure sampling noise), per prompt, for the late rows alone and for all rows: four
checks per test, each at delta = 1e-6 / 4, so a correct engine fails a test with probability
< 1e-6. The negative control breaks only the joining rows: their first round's proposals are
verified with a uniform q instead of the law they were drawn from; the same check on the late rows
must then fail.

With prefix caching (issue 53, item 4) the same check runs on two prompts that share their first
block (and each its own earlier requests' blocks), with blocks of 2 tokens: most rows' prompts are
then partly read from blocks other rows computed, on the target's cache and the draft's. Its
negative control hashes each block by its first token alone, so that a prompt takes a block whose
second token differs from its own; its law must then fail the check.
"""
import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import kv_cache
from checkpoint import load_model
from decode import Output, SDRounds, SSDRounds
from draft import DraftConfig, DraftSettings, load_draft
from fallback import BACKUPS
from scheduler import KVBudget, Request, Scheduler, cache_tokens
from speculator import in_row_order
from test_generate import empirical_law, exact_law, make_small_vocab_pair, tv, tv_bound
from verify import Verifier

torch.set_num_threads(1)

K, BUDGET, BS = 2, 3, 16
WAVES = [1000] * 5         # requests submitted before rounds 1..5 (wave 0 starts the batch)
MAX_BATCH = 800            # below a wave: the queue backs up, rows join as others leave
MAX_TOKENS = (3, 5, 8)     # cycled over the requests: rows leave at different rounds
PROMPTS = ([0, 3, 1], [2, 0, 3, 3])  # alternated: laws far apart (TV 0.6 over 3 tokens)
N_ALL = sum(WAVES)
DELTA = 1e-6 / 4           # each of a test's four TV checks


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    tgt, dft = make_small_vocab_pair(tmp_path_factory.mktemp("batched_law"))
    # laws[T][i]: the target's law of 3 tokens after PROMPTS[i]
    laws = {T: [exact_law(tgt, p, 3, T) for p in PROMPTS] for T in (1.0, 0.7)}
    for law in laws[1.0]:
        assert max(law.values()) < 0.5, "target law is near-degenerate: the test would be weak"
    return tgt, dft, laws


def engine(mode, tgt: Path, dft: Path, T, seed, fallback="neural", saguaro_c=0.3,
           prompts=PROMPTS, bs=BS, prefix_caching=False):
    """A scheduler over the mode's rounds (one process), its caches sized for max_batch rows, so
    that admission is bounded by max_batch alone. -> (the scheduler, the draft side)."""
    tmodel, _ = load_model(str(tgt), tokenizer=False)
    ssd = mode == "ssd"
    spec = DraftSettings(K, budget=BUDGET, saguaro_c=saguaro_c, fallback=fallback)
    need = -(-(max(map(len, prompts)) + max(MAX_TOKENS) + K + 1) // bs) * bs  # a row's, target
    branches = BUDGET * (K + 3 + 2 * bs) if ssd else 0  # its SSD branches, draft
    kv, draft_kv = MAX_BATCH * need + 2 * bs, MAX_BATCH * (need + branches) + 2 * bs
    verifier = Verifier(tmodel, T, seed, kv, block_size=bs, prefix_caching=prefix_caching)
    drafter = load_draft(DraftConfig(str(dft), "cpu", torch.float32, spec, ssd, T, seed + 1,
                                     draft_kv, bs, None, tmodel.config.vocab_size,
                                     prefix_caching=prefix_caching))
    rounds = (SSDRounds if mode == "ssd" else SDRounds)(verifier, drafter, Output([], K))
    budget = KVBudget(cache_tokens(kv, bs), cache_tokens(draft_kv, bs), bs, K, branches,
                      prefix_caching)
    return Scheduler(rounds, budget, MAX_BATCH), drafter


@dataclass
class Run:
    tokens: list        # every row's tokens
    prompt: list        # every row's prompt, as an index into PROMPTS
    late: set           # the rows that joined a running batch
    mid_joins: int      # joins that found rows mid-generation (past their first token)
    temp: list = None   # every row's own temperature (None: the engine's)


def run_waves(sched: Scheduler, run: Run | None = None, temps=(None,), prompts=PROMPTS) -> Run:
    """Submit WAVES between rounds, alternating `prompts`, request i at temperature
    temps[i % len(temps)] (None: the engine's); run until every request has left. `run` fills as
    rows join (a negative control reads it during the run)."""
    rounds, out = sched.rounds, sched.out
    run = run or Run(out.tokens, [], set(), 0)
    run.temp = []
    join = rounds.join

    def recording_join(joining, max_new, temperatures=None, seeds=None, eos_after=None):
        running = list(rounds.rows)
        new = join(joining, max_new, temperatures, seeds, eos_after)
        run.prompt += [prompts.index(p) for p in joining]
        run.temp += temperatures or [None] * len(joining)
        if running:
            run.late.update(new)
            run.mid_joins += any(len(out.tokens[r]) > 1 for r in running)
        return new

    rounds.join = recording_join
    i = 0
    for size in WAVES:
        for _ in range(size):
            sched.submit(Request(list(prompts[i % len(prompts)]), MAX_TOKENS[i % len(MAX_TOKENS)],
                                 temperature=temps[i % len(temps)]))
            i += 1
        sched.step()
    while sched.step() or sched.waiting:
        pass
    assert sched.finished == N_ALL and not sched.running and len(run.prompt) == N_ALL
    assert rounds.kv_used() == (0, 0), rounds.kv_used()  # every leaving row's KV was freed
    assert len(run.late) > N_ALL / 2 and run.mid_joins >= len(WAVES), (len(run.late), run.mid_joins)
    return run


def tvs(run: Run, rows, laws) -> list[tuple[float, float]]:
    """Per prompt, (TV, bound): the first 3 tokens of those of `rows` against the target's law."""
    res = []
    for i, law in enumerate(laws):
        mine = [run.tokens[r] for r in rows if run.prompt[r] == i]
        res.append((tv(empirical_law(mine, 3), law), tv_bound(law, len(mine), DELTA)))
    return res


# SD at both temperatures; SSD with every backup of fallback.BACKUPS (a new one joins), the
# temperatures alternating
CASES = [("sd", 1.0, "neural"), ("sd", 0.7, "neural"),
         *(("ssd", T, b) for b, T in zip(BACKUPS, itertools.cycle((1.0, 0.7))))]


@pytest.mark.parametrize("mode,T,fallback", CASES)
def test_batched_law_matches_target(small_vocab, mode, T, fallback):
    """The late rows' law, and every row's, is the target's, per prompt."""
    tgt, dft, laws = small_vocab
    sched, drafter = engine(mode, tgt, dft, T, seed=21, fallback=fallback)
    run = run_waves(sched)
    if mode == "ssd":  # hits and misses (every late row's first round) both happened
        s = drafter.stats()
        assert s["hits"] > 0 and s["misses"] >= len(run.late), s
        assert s["fallback_rounds"][fallback] > 0, s["fallback_rounds"]
    checks = tvs(run, run.late, laws[T]) + tvs(run, range(N_ALL), laws[T])
    assert all(d < bound for d, bound in checks), checks


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_batched_law_negative_control_wrong_q_for_joining_rows(small_vocab, monkeypatch, mode):
    """Rows joining a running batch get their first round verified with a uniform q (not the law
    their proposals were drawn from); every other round is untouched. The late rows' law is then no
    longer the target's: the check must see it."""
    tgt, dft, laws = small_vocab
    sched, drafter = engine(mode, tgt, dft, 1.0, seed=21)
    run = Run(sched.out.tokens, [], set(), 0)
    verify = sched.rounds.verifier.verify

    def verify_with_wrong_q(rows, tokens, q, deterministic, *args):
        # a row's first round: its history is its prompt and t0 (SD commits after the
        # verification, SSD's respond has committed t0 before it)
        first = [i for i, r in enumerate(rows) if r in run.late
                 and len(drafter.rows[r].history) == len(PROMPTS[run.prompt[r]]) + 1]
        if first:
            q, deterministic = q.clone(), deterministic.clone()
            q[first], deterministic[first] = 1.0 / q.shape[-1], False
        return verify(rows, tokens, q, deterministic, *args)

    monkeypatch.setattr(sched.rounds.verifier, "verify", verify_with_wrong_q)
    run_waves(sched, run)
    checks = tvs(run, run.late, laws[1.0])
    assert all(d > bound for d, bound in checks), checks


def test_proposals_follow_their_rows_when_hits_and_misses_interleave():
    """In SSD a joining row misses while the rows around it may hit: the round's proposals come in
    parts (hits, then misses) and in_row_order puts each row's tokens and q back in its place. The
    law test above barely sees a q handed to a neighbouring row of similar context (measured with
    q left in part order: TV at most 0.05 against bounds of 0.10), so the order is checked here."""
    b, V = 5, 4
    hits, misses = [0, 2, 3], [1, 4]
    tokens = torch.arange(b)[:, None].expand(b, K)  # [b, K]: row i proposes i, i
    q = torch.rand(b, K, V)
    lengths = [K, K - 1, K, 1, K]
    got_tokens, got_q, got_L = in_row_order(
        [(hits, tokens[hits], q[hits], [lengths[i] for i in hits]),
         (misses, tokens[misses], q[misses], [lengths[i] for i in misses])], b, V)
    assert torch.equal(got_tokens, tokens) and torch.equal(got_q, q) and got_L == lengths
    # a fast backup's misses are deterministic (no q): zeros in their places, the hits' q in theirs
    got_tokens, got_q, _ = in_row_order([(hits, tokens[hits], q[hits], [K] * 3),
                                         (misses, tokens[misses], None, [K] * 2)], b, V)
    assert torch.equal(got_tokens, tokens) and torch.equal(got_q[hits], q[hits])
    assert not got_q[misses].any()
    # parts of other widths (rows that stopped early): the narrower one padded, nothing moved
    got_tokens, got_q, _ = in_row_order([(hits, tokens[hits], q[hits], [K] * 3),
                                         (misses, tokens[misses, :1], q[misses, :1], [1, 1])], b, V)
    assert torch.equal(got_tokens[hits], tokens[hits]) and torch.equal(got_q[hits], q[hits])
    assert torch.equal(got_tokens[misses, :1], tokens[misses, :1])
    assert not got_tokens[misses, 1:].any() and not got_q[misses, 1:].any()


# --------------------------------------------------------------------------------------------------
# Rows at their own temperatures (issue 43, "Serve SSD"): greedy and sampled rows in one batch

MIXED_T = (0.5, 1.0, 0.0, 0.5, 1.0)  # request i's temperature: a cycle of 5 against PROMPTS' 2


@pytest.fixture(scope="module")
def mixed_laws(small_vocab):
    """The target's law of 3 tokens per prompt at T = 0.5 (small_vocab has 1.0), and each prompt's
    greedy tokens as the engine gives them to a request alone."""
    tgt, dft, laws = small_vocab
    laws = {0.5: [exact_law(tgt, p, 3, 0.5) for p in PROMPTS], 1.0: laws[1.0]}
    sched, _ = engine("sd", tgt, dft, 1.0, seed=1)
    alone = [sched.submit(Request(list(p), max(MAX_TOKENS), temperature=0.0)) for p in PROMPTS]
    sched.run()
    return laws, [req.tokens for req in alone]


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_mixed_temperatures_each_row_follows_its_own(small_vocab, mixed_laws, mode):
    """Requests at T = 0, 0.5 and 1 join, run beside each other and leave (the engine's default is
    1): each sampled row's law is the target's at its own T, per prompt; each greedy row's tokens
    are the greedy tokens of its prompt alone (a T = 0 row goes through the sampled test with a
    one-hot p, which accepts exactly what the greedy test does). Negative control, on the same
    rows: measured against the other temperature's law, the check fails (prompt 1, whose laws at
    0.5 and 1 are 0.40 apart in TV)."""
    tgt, dft, _ = small_vocab
    laws, greedy = mixed_laws
    sched, drafter = engine(mode, tgt, dft, 1.0, seed=33)
    run = run_waves(sched, temps=MIXED_T)
    if mode == "ssd":
        s = drafter.stats()
        assert s["hits"] > 0 and s["misses"] > 0, s

    def rows(T, i):
        return [run.tokens[r] for r in range(N_ALL) if run.temp[r] == T and run.prompt[r] == i]

    for i in range(len(PROMPTS)):
        assert all(x == greedy[i][:len(x)] for x in rows(0.0, i))
    checks = [(tv(empirical_law(rows(T, i), 3), laws[T][i]),
               tv_bound(laws[T][i], len(rows(T, i)), DELTA)) for T in (0.5, 1.0) for i in (0, 1)]
    assert all(d < bound for d, bound in checks), checks
    wrong = [(tv(empirical_law(rows(T, 1), 3), laws[other][1]),
              tv_bound(laws[other][1], len(rows(T, 1)), DELTA))
             for T, other in ((0.5, 1.0), (1.0, 0.5))]
    assert all(d > bound for d, bound in wrong), wrong


# --------------------------------------------------------------------------------------------------
# Prefix caching (issue 53, item 4): prompts read partly from blocks other rows computed

SHARED = ([1, 2, 0, 3, 1, 0], [1, 2, 0, 1, 2, 3, 3])  # one block of 2 in common, then 1 and 2 own
SHARED_BS = 2


@pytest.fixture(scope="module")
def shared_laws(small_vocab):
    tgt, _, _ = small_vocab
    return [exact_law(tgt, p, 3, 1.0) for p in SHARED]


def shared_run(small_vocab, mode):
    tgt, dft, _ = small_vocab
    sched, drafter = engine(mode, tgt, dft, 1.0, seed=5, prompts=SHARED, bs=SHARED_BS,
                            prefix_caching=True)
    run = run_waves(sched, prompts=SHARED)
    (t_looked, t_found), (d_looked, d_found) = sched.rounds.prefix_tokens()
    # most prompts came from blocks other rows computed, on both caches
    assert t_found > t_looked / 3 and d_found > d_looked / 3, sched.rounds.prefix_tokens()
    return run


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_batched_law_with_shared_prefixes(small_vocab, shared_laws, mode):
    run = shared_run(small_vocab, mode)
    checks = tvs(run, run.late, shared_laws) + tvs(run, range(N_ALL), shared_laws)
    assert all(d < bound for d, bound in checks), checks


def test_shared_prefixes_negative_control_blocks_named_by_their_first_token(small_vocab,
                                                                          shared_laws,
                                                                          monkeypatch):
    """Blocks hashed by their first token alone: the second prompt takes the first one's block
    [0, 3] for its own [0, 1] (the first registers it first), so its law is no longer the
    target's; the first prompt's is untouched."""
    def first_token_hashes(tokens, block_size):
        return real([t for i in range(0, len(tokens) - block_size + 1, block_size)
                     for t in [tokens[i]] * block_size], block_size)

    real = kv_cache.block_hashes
    monkeypatch.setattr(kv_cache, "block_hashes", first_token_hashes)
    run = shared_run(small_vocab, "sd")
    first, second = tvs(run, range(N_ALL), shared_laws)
    assert first[0] < first[1] and second[0] > second[1], (first, second)
