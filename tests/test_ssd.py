"""SSD / Saguaro end to end (issue 5): greedy tokens equal transformers' for every fan-out, fallback, K and
batch size, in one process and in two; the output law at temperature 1 and 0.7 for every Saguaro C is the
target's; stats; a killed speculator; bad input; the hit rate of the shipped tiny pair.

Helpers (checkpoint editing, transformers references, exact laws, the TV noise bound and its derivation)
come from tests/test_generate.py. Most runs use parallel=False (one process, the same tokens as the
two-process run for the same seed); a handful check parallel=True against it, since each spawns a process.
"""
import dataclasses
import itertools
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import draft as draft_module
import fallback as fallback_module
import speculator as speculator_module
import spec_policy
from fallback import BACKUPS, POLICIES, critical_batch_size, default_critical_batch_size
from spec_cache import FAN_OUTS
from conftest import make_checkpoint
from test_generate import (copy_checkpoint, empirical_law, exact_law, gen, hf_greedy, make_own_vocab_draft,
                           make_small_vocab_pair, perturbed_copy, tv, tv_bound)

torch.set_num_threads(1)

TARGET_KW = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, eos_token_id=None,
                 max_position_embeddings=256)
RANDOM_DRAFT_KW = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, eos_token_id=None, max_position_embeddings=256)
PROMPTS = [[1, 5, 7, 9, 11], [1, 3], [1, 8, 22, 33, 44, 55, 66, 77, 88], [1, 42, 17, 4]]  # ragged
NEW = 12  # greedy tokens per prompt: several rounds at every K, few forwards (the product below is 60 runs)
STATS_KEYS = ("cache_hit_rate", "hits", "misses", "tokens_per_round_hit", "tokens_per_round_miss", "fallback",
              "b_star", "verifier_wait_seconds", "draft_busy_seconds")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ssd")
    tgt = make_checkpoint(root / "target", "llama", seed=20, **TARGET_KW)
    d = dict(target=tgt,
             copy=copy_checkpoint(tgt, root / "copy"),                              # always accepted: hits
             different=perturbed_copy(tgt, root / "different", noise=0.1, seed=21),  # hits and misses
             random=make_checkpoint(root / "random", "llama", seed=22, **RANDOM_DRAFT_KW))  # mostly misses
    d["ref"], gap = hf_greedy(tgt, PROMPTS, NEW)
    assert gap > 1e-4, f"the fixture's greedy path has a near tie (gap {gap:.2e}): pick another seed"
    return d


def check_stats(s, fallback):
    for key in STATS_KEYS:
        assert key in s, key
    assert s["mode"] == "ssd" and s["fallback"] == fallback
    assert s["hits"] + s["misses"] > 0
    assert s["cache_hit_rate"] == pytest.approx(s["hits"] / (s["hits"] + s["misses"]))
    assert s["draft_busy_seconds"] > 0 and s["verifier_wait_seconds"] >= 0
    for key in ("tokens_per_round_hit", "tokens_per_round_miss"):
        assert s[key] == 0 or 1 <= s[key] <= s["k"] + 1, (key, s[key])


# ----------------------------------------------------------------------------------------------------
# Greedy: exactly transformers' tokens, in every configuration

# The fan-out rules and the backups come from their tables (spec_cache.FAN_OUTS, fallback.BACKUPS):
# a rule added to either is tested here, greedy and at T > 0, with no test written for it.

@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("fallback", POLICIES)
@pytest.mark.parametrize("fan_out", list(FAN_OUTS))
@pytest.mark.parametrize("K", [1, 4, 7])
def test_greedy_different_draft(ckpts, K, fan_out, fallback, batch):
    """A draft that disagrees with the target now and then: hits and misses, every fallback is used."""
    res = gen(PROMPTS[:batch], ckpts["target"], ckpts["different"], mode="ssd", k=K, fan_out=fan_out,
              fallback=fallback, max_new_tokens=NEW, parallel=False)
    assert res.tokens == ckpts["ref"][:batch]
    s = res.stats
    check_stats(s, fallback)
    assert s["hits"] > 0
    if batch > 1:
        assert s["misses"] > 0
        if fallback != "auto":
            assert s["fallback_rounds"][fallback] > 0, s["fallback_rounds"]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("fan_out", list(FAN_OUTS))
@pytest.mark.parametrize("K", [1, 4, 7])
def test_greedy_copy_draft_hits(ckpts, K, fan_out, batch):
    """The draft is the target: all K accepted each round and the bonus is the draft's own top guess at
    depth K, so (nearly) every lookup hits; the fallback is never needed (hence not varied here)."""
    res = gen(PROMPTS[:batch], ckpts["target"], ckpts["copy"], mode="ssd", k=K, fan_out=fan_out,
              max_new_tokens=NEW, parallel=False)
    assert res.tokens == ckpts["ref"][:batch]
    s = res.stats
    check_stats(s, "auto")
    assert s["hits"] > 0 and s["cache_hit_rate"] > 0.9 and s["accepted_per_proposed"] > 0.9, s


@pytest.mark.parametrize("K,fallback", [(1, "neural"), (4, "ngram"), (7, "random")])
def test_greedy_random_draft(ckpts, K, fallback):
    """An unrelated draft of another shape (1 layer, 2 heads): mostly misses, still the target's tokens."""
    res = gen(PROMPTS, ckpts["target"], ckpts["random"], mode="ssd", k=K, fallback=fallback,
              max_new_tokens=NEW, parallel=False)
    assert res.tokens == ckpts["ref"]
    assert res.stats["misses"] > 0 and res.stats["fallback_rounds"][fallback] > 0


# ----------------------------------------------------------------------------------------------------
# Two processes: the same tokens as one process (each case spawns the speculator: keep them few)

@pytest.mark.parametrize("K,fan_out,fallback,batch", [(4, "geometric", "auto", 4), (1, "uniform", "ngram", 1)])
def test_parallel_greedy(ckpts, K, fan_out, fallback, batch):
    kw = dict(mode="ssd", k=K, fan_out=fan_out, fallback=fallback, max_new_tokens=NEW)
    par = gen(PROMPTS[:batch], ckpts["target"], ckpts["different"], parallel=True, **kw)
    assert par.tokens == ckpts["ref"][:batch]
    check_stats(par.stats, fallback)
    assert par.stats["parallel"] is True and par.stats["hits"] > 0


def test_parallel_matches_serial_at_temperature_1(ckpts):
    """Same seed, same tokens, and the same cache hits, whether the two sides share a process or not, and
    although the two-process speculator stops pre-speculating whenever the outcome arrives first. (A fixed
    fallback and fan-out, every round pre-speculated: `auto`, the adaptive budget and the gate read measured
    times, so their choices may differ.)"""
    kw = dict(mode="ssd", k=7, fan_out=[1] * 8, fallback="random", saguaro_c=0.5, temperature=1.0, seed=5,
              max_new_tokens=2 * NEW, pre_spec="always")  # an explicit fan-out: the budget does not adapt
    # to measured times; and every round pre-speculates (the gate reads measured times too)
    ser = gen(PROMPTS, ckpts["target"], ckpts["different"], parallel=False, **kw)
    par = gen(PROMPTS, ckpts["target"], ckpts["different"], parallel=True, **kw)
    assert par.tokens == ser.tokens
    assert all(len(x) == 2 * NEW for x in par.tokens)
    for key in ("hits", "misses", "rounds", "accept_len_histogram", "fallback_rounds"):
        assert par.stats[key] == ser.stats[key], key
    check_stats(par.stats, "random")
    assert par.stats["hits"] > 0 and par.stats["misses"] > 0
    other = gen(PROMPTS, ckpts["target"], ckpts["different"], parallel=False, **{**kw, "seed": 6})
    assert other.tokens != ser.tokens


def test_fixed_budget_repeats_tokens_in_one_process_and_two(ckpts):
    """--fixed-budget: B stays the user's in every round, so a geometric fan-out at temperature 1 (each
    row's vector decided from the measured acceptance alone) repeats its tokens and hits from run to run,
    and in two processes (with pre-speculation stopped whenever the outcome arrives first)."""
    kw = dict(mode="ssd", k=3, fan_out="geometric", budget=5, fixed_budget=True, fallback="neural",
              saguaro_c=0.5, temperature=1.0, seed=4, max_new_tokens=2 * NEW)
    runs = [gen(PROMPTS, ckpts["target"], ckpts["different"], parallel=p, **kw) for p in (False, False, True)]
    assert runs[0].tokens == runs[1].tokens == runs[2].tokens
    for r in runs:
        assert r.stats["mean_budget"] == 5 and r.stats["fixed_budget"] and r.stats["hits"] > 0
        assert sum(r.stats["row_fan_out_mean"]) == pytest.approx(5)
    assert runs[0].stats["hits"] == runs[2].stats["hits"]


# ----------------------------------------------------------------------------------------------------
# Pre-speculation stopped early (the outcome arrives before the branches are drafted): the same tokens

def arrive_at(monkeypatch, j):
    """Force the verifier's outcome to arrive before pre-speculation step j, every round (the hook the
    two-process speculator reads the channel through)."""
    init = speculator_module.Speculator.__init__

    def arriving(self, *args, **kw):
        init(self, *args, **{**kw, "arrived": lambda step: step >= j})
    monkeypatch.setattr(speculator_module.Speculator, "__init__", arriving)


@pytest.mark.parametrize("j", range(4))  # K = 3: steps 0..2; j = 3 never stops (the reference)
def test_stopped_pre_speculation_same_tokens(ckpts, monkeypatch, j):
    """Greedy and at temperature 1: wherever pre-speculation stops, the tokens are those of a run that never
    stops (a hit's branch is finished alone with its row's noise, which does not depend on the batch)."""
    greedy = dict(mode="ssd", k=3, max_new_tokens=NEW, parallel=False, pre_spec="always")
    sampled = dict(greedy, fan_out=[2, 2, 2, 2], fallback="neural", saguaro_c=0.5, temperature=1.0, seed=3)
    ref = gen(PROMPTS, ckpts["target"], ckpts["different"], **sampled)
    arrive_at(monkeypatch, j)
    res = gen(PROMPTS, ckpts["target"], ckpts["different"], **greedy)
    assert res.tokens == ckpts["ref"]
    res_t1 = gen(PROMPTS, ckpts["target"], ckpts["different"], **sampled)
    assert res_t1.tokens == ref.tokens
    for s in (res.stats, res_t1.stats):
        assert s["hits"] > 0 and s["misses"] > 0, s
        assert (s["pre_speculation_stopped"] > 0) == (j <= 2), s
        assert (s["branches_completed"] > 0) == (j <= 2), s  # a stop leaves the hit's draws to do
    assert res_t1.stats["hits"] == ref.stats["hits"]
    if j <= 2:  # the stops shrank the adaptive budget (greedy run); the explicit fan-out stays
        assert res.stats["mean_budget"] < 8 and res_t1.stats["mean_budget"] == 8


# ----------------------------------------------------------------------------------------------------
# Rounds that pre-speculate nothing (the gate measured it slower): the same tokens, the same law

def gate_pattern(monkeypatch, pattern):
    """Force the gate's choices: round i of every run pre-speculates iff pattern[i % len(pattern)]."""
    def choose(self, E_off):
        self.arm = pattern[sum(self.chosen.values()) % len(pattern)]
        self.chosen[self.arm] += 1
        return self.arm
    monkeypatch.setattr(spec_policy.PreSpecGate, "choose", choose)


def hf_greedy_2new(ckpts):
    """The target's first 2 NEW greedy tokens after each prompt."""
    if "ref2" not in ckpts:
        ckpts["ref2"], gap = hf_greedy(ckpts["target"], PROMPTS, 2 * NEW)
        assert gap > 1e-4, gap
    return ckpts["ref2"]


@pytest.mark.parametrize("fallback", ["neural", "ngram", "random"])
@pytest.mark.parametrize("K", [1, 4])
def test_greedy_with_skipped_pre_speculation(ckpts, monkeypatch, K, fallback):
    """Every transition (on -> off, off -> off, off -> on) with every backup: a skipped round leaves the
    draft's cache short of the tokens it did not feed (x_K, a fast backup's proposals), which the next
    answer must feed; the tokens stay the target's."""
    gate_pattern(monkeypatch, [True, False, False])
    res = gen(PROMPTS, ckpts["target"], ckpts["different"], mode="ssd", k=K, fallback=fallback,
              max_new_tokens=2 * NEW, parallel=False, pre_spec="auto")
    assert res.tokens == hf_greedy_2new(ckpts)
    s = res.stats
    assert s["pre_speculation_skipped"] > 0 and s["hits"] > 0, s
    # a skipped round looks nothing up: lookups happen only after rounds that pre-speculated
    assert s["hits"] + s["misses"] <= len(PROMPTS) * (s["rounds"] - s["pre_speculation_skipped"] + 1), s


def test_branches_hold_k_tokens_and_leave_x_K_to_the_next_round(ckpts, monkeypatch):
    """Pre-speculation drafts K steps per branch: a branch for guess (j, t) holds the committed tokens,
    x_1..x_j, then t, x'_1..x'_{K-1} (K tokens); x'_K is fed only if the branch hits, in the next round."""
    orig, extra = speculator_module.Speculator.pre_speculate, []

    def checked(self, rows):
        orig(self, rows)
        owner = {m: key for key, m in self.spec_cache.entries.items()}  # branch m -> (row, j, t)
        for m, seq in enumerate(self.branches.seqs):
            r, j, _ = owner[m]
            extra.append(self.cache.length(seq) - (len(self.rows[r].history) + j))

    monkeypatch.setattr(speculator_module.Speculator, "pre_speculate", checked)
    res = gen(PROMPTS, ckpts["target"], ckpts["copy"], mode="ssd", k=3, max_new_tokens=NEW, parallel=False)
    assert res.tokens == ckpts["ref"] and res.stats["hits"] > 0
    assert extra and set(extra) == {3}, extra


def test_pre_spec_always_never_skips(ckpts, monkeypatch):
    gate_pattern(monkeypatch, [False])
    kw = dict(mode="ssd", k=3, max_new_tokens=NEW, parallel=False)
    always = gen(PROMPTS, ckpts["target"], ckpts["different"], pre_spec="always", **kw)
    never = gen(PROMPTS, ckpts["target"], ckpts["different"], pre_spec="auto", **kw)  # forced off
    assert always.tokens == never.tokens == ckpts["ref"]
    assert always.stats["pre_speculation_skipped"] == 0 and always.stats["gate_tok_s"] is None
    assert never.stats["pre_speculation_skipped"] == never.stats["rounds"] + 1  # + the prefill's
    assert never.stats["hits"] == never.stats["misses"] == 0
    # under `auto` a round after a skipped one is SD's: the neural draft proposes
    assert never.stats["fallback_rounds"] == {"neural": never.stats["rounds"], "ngram": 0, "random": 0}
    # pre_spec="never" is that forced-off gate without a gate: the same rounds, no gate's rates
    control = gen(PROMPTS, ckpts["target"], ckpts["different"], pre_spec="never", **kw)
    assert control.tokens == ckpts["ref"] and control.stats["gate_tok_s"] is None
    keys = ("pre_speculation_skipped", "rounds", "hits", "misses", "fallback_rounds")
    assert {k: control.stats[k] for k in keys} == {k: never.stats[k] for k in keys}


def test_auto_fallback_reads_its_measurements(ckpts):
    """`auto` picks the backup by b*, computed from what this run measured, each term replacing its default."""
    cfg = draft_module.DraftConfig(str(ckpts["different"]), "cpu", torch.float32,
                                   draft_module.DraftSettings(K=3), True, 0.0, 0, 256)
    spec = draft_module.load_draft(cfg)
    policy = spec.policy
    assert default_critical_batch_size(3, 0.0) is not None  # the paper's default would flip at some b ...
    # ... but until measured, misses go to the neural backup
    assert policy.measured_b_star(spec.spec_cache.stats.hit_rate) is None
    # rounds of 10 ms, pre-speculation 8 ms, the neural backup 5 ms, the n-gram one 0.1 ms; hit rate 1/2;
    # the draft accepts 2 of 3 on every round, the n-gram backup none
    policy.round_seconds, policy.pre_seconds = [0.010] * 9, [0.008] * 9
    policy.neural_seconds, policy.fast_seconds = [0.005] * 5, [0.0001] * 5
    for i in range(40):
        spec.spec_cache.stats.record(1, hit=i % 2 == 0)
    policy.accept.update([2] * 40, 3)
    policy.accept_fast.update([0] * 40, 3)
    E_hit = policy.accept.expected_tokens(3)
    p_hit = spec.spec_cache.stats.hit_rate
    assert policy.choose_backup(1, False, p_hit) == "neural"  # b* refreshed first
    b_star = policy.b_star
    assert b_star == critical_batch_size(0.5, E_hit, 0.8, 1.0, 0.01, 0.5) == 3
    assert [policy.backup_for(b) for b in (1, 2, 3, 8)] == ["neural", "neural", "ngram", "ngram"]
    assert policy.choose_backup(8, True, p_hit) == "neural"  # after a skipped round: SD's schedule
    policy.neural_seconds = []  # unmeasured, the neural backup is charged T_p (cautious): b* is lower
    assert policy.measured_b_star(p_hit) == critical_batch_size(0.5, E_hit, 0.8, 1.0, 0.01) == 2
    policy.neural_seconds = [0.005] * 5
    policy.accept_fast.update([3] * 400, 3)  # the n-gram backup turns out as good as the draft: from b = 1
    policy.b_star = policy.measured_b_star(p_hit)
    assert policy.b_star == 1 and policy.backup_for(1) == "ngram"
    policy.b_star = b_star
    fixed = speculator_module.Speculator(spec.model, draft_module.DraftSettings(K=3, fallback="random"), 0.0, 0, 64)
    assert fixed.policy.backup_for(1) == "random"  # a fixed policy is never overridden


# ----------------------------------------------------------------------------------------------------
# Temperature > 0: the output law is the target's, for every Saguaro C and fallback
#
# Which tokens come from where (K = 2, budget B = 3, max_new_tokens = 3): token 1 is the verifier's prefill
# draw (round 0). Round 1 answers round 0's outcome from the cache the draft built at its prefill (hit: t0
# among its guesses; miss: the fallback) and emits tokens 2..2+n; so token 2 always comes from round 1 and
# token 3 from round 1 when n >= 1, else from round 2 - the first round whose lookup key (n, t) is the
# outcome of a real verification, whose proposals come from a branch pre-speculated at depth 0..K with
# Saguaro's q', or from the fallback after a miss at one of those depths. So the joint law of tokens 1..3
# covers hits and misses at round 1 and (in the rows where round 1 rejected its first token, checked to be
# a sizeable fraction below) at round 2, with the residual after a rejection taken against q' at depths 0
# and 1. V = 4 and B = 3 spread over 3 depths: at most 2 of the 3 possible bonus tokens are guessed at any
# depth, so misses are frequent.
#
# Every (T, C, backup, fan-out) combination would be 36 runs; the cases below are pairwise: every
# pair of values of two factors appears in at least one case (each C with each backup, each T with
# each fan-out, ...), at N rows each. The backups and fan-outs are their tables' (fallback.BACKUPS,
# spec_cache.FAN_OUTS): a rule added to one joins these cases, and the negative control below shows
# that a broken rule fails them.

def pairwise(factors: dict) -> list[tuple]:
    """Combinations of the factors' values that cover every pair of values of two factors: greedy,
    each next one the combination (in product order) that covers the most pairs not yet covered."""
    pairs = lambda c: {(i, c[i], j, c[j]) for i, j in itertools.combinations(range(len(c)), 2)}  # noqa: E731
    todo = set().union(*(pairs(c) for c in itertools.product(*factors.values())))
    cases = []
    while todo:
        best = max(itertools.product(*factors.values()), key=lambda c: len(pairs(c) & todo))
        cases.append(best)
        todo -= pairs(best)
    return cases


N_LAW = 3000
LAW_CASES = pairwise({"T": (1.0, 0.7), "C": (1.0, 0.3, 0.0), "fallback": tuple(BACKUPS),
                      "fan_out": tuple(FAN_OUTS)})


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    tgt, dft = make_small_vocab_pair(tmp_path_factory.mktemp("ssd_small_vocab"))
    prompt = [0, 3, 1]
    laws = {T: exact_law(tgt, prompt, 3, T) for T in (1.0, 0.7)}
    return tgt, dft, prompt, laws


def ssd_law_run(small_vocab, T, C, fallback, seed=11, pre_spec="always", fan_out="geometric"):
    tgt, dft, prompt, laws = small_vocab
    res = gen([prompt] * N_LAW, tgt, dft, mode="ssd", k=2, budget=3, saguaro_c=C, fallback=fallback,
              temperature=T, max_new_tokens=3, seed=seed, parallel=False, pre_spec=pre_spec,
              fan_out=fan_out)
    return res, tv(empirical_law(res.tokens, 3), laws[T]), tv_bound(laws[T], N_LAW)


def test_law_cases_cover_every_pair():
    assert len(LAW_CASES) <= 12
    for a, b in itertools.combinations(range(4), 2):
        seen = {(c[a], c[b]) for c in LAW_CASES}
        assert len(seen) == len({c[a] for c in LAW_CASES}) * len({c[b] for c in LAW_CASES})
    assert {c[2] for c in LAW_CASES} == set(BACKUPS) and {c[3] for c in LAW_CASES} == set(FAN_OUTS)


@pytest.mark.parametrize("T,C,fallback,fan_out", LAW_CASES)
def test_ssd_law_matches_target(small_vocab, T, C, fallback, fan_out):
    res, d, bound = ssd_law_run(small_vocab, T, C, fallback, fan_out=fan_out)
    s = res.stats
    assert s["hits"] > 0 and s["misses"] > 0, s
    assert s["fallback_rounds"][fallback] > 0, s["fallback_rounds"]
    # row-rounds beyond the first round of each row: rows whose token 3 came from round 2
    assert sum(s["accept_len_histogram"]) - N_LAW > N_LAW / 5, s["accept_len_histogram"]
    assert d < bound, (d, bound)


def test_a_broken_backup_in_the_table_fails_the_law_test(small_vocab, monkeypatch):
    """The negative control of the table-driven cases: the neural backup replaced in
    fallback.BACKUPS by one that keeps the draft's tokens but reports a uniform law for them (q is
    no longer what they were drawn from): the same run as a law case, and the law is not the
    target's."""
    real = BACKUPS["neural"]

    def broken(histories, K, V, generator, neural):
        b = real(histories, K, V, generator, neural)
        return dataclasses.replace(b, q=torch.full_like(b.q, 1 / b.q.shape[-1]))
    monkeypatch.setitem(fallback_module.BACKUPS, "neural", broken)
    res, d, bound = ssd_law_run(small_vocab, 1.0, 0.0, "neural")
    assert res.stats["fallback_rounds"]["neural"] > 0
    assert d > bound, (d, bound)  # what test_ssd_law_matches_target asserts the other way


def test_ssd_law_with_a_draft_of_its_own_vocabulary(small_vocab, tmp_path):
    """The draft writes tokens 0 and 2 of 4 only: Saguaro's fan-out still guesses the others (the
    target's bonus can be any token), and the output law is the target's."""
    tgt, _, prompt, laws = small_vocab
    dft = make_own_vocab_draft(tmp_path / "own", [0, 2])
    res = gen([prompt] * N_LAW, tgt, dft, mode="ssd", k=2, budget=3, saguaro_c=0.5,
              temperature=1.0, max_new_tokens=3, seed=7, parallel=False)
    assert res.stats["hits"] > 0 and res.stats["misses"] > 0, res.stats
    assert tv(empirical_law(res.tokens, 3), laws[1.0]) < tv_bound(laws[1.0], N_LAW)


def small_vocab_head(target_path, path):
    """A random EAGLE head (eagle.py) for make_small_vocab_pair's one-layer target: every token a
    row of its own, its head scaled up as the pair's are, so its laws are peaked and not the
    target's."""
    import eagle
    from checkpoint import load_config
    torch.manual_seed(13)
    head = eagle.head_for(load_config(target_path), [0, 0, 0], [0, 1, 2, 3])
    with torch.no_grad():
        head.lm_head.weight.mul_(8.0)
    eagle.save(head, path, {"target": "test"}, dtype=torch.float32)
    return path


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_law_with_an_eagle_head(small_vocab, tmp_path, mode):
    """The draft is an EAGLE head reading the target's features (one process): in SSD its branches
    draft from its own states past the verified prefix and are corrected after each outcome; hits
    answer with Saguaro's q' (C = 0.5). The output law is the target's."""
    tgt, _, prompt, laws = small_vocab
    head = small_vocab_head(tgt, tmp_path / "head")
    res = gen([prompt] * N_LAW, tgt, head, mode=mode, k=2, budget=3, saguaro_c=0.5,
              fallback="neural", temperature=1.0, max_new_tokens=3, seed=9, parallel=False)
    if mode == "ssd":
        assert res.stats["hits"] > 0 and res.stats["misses"] > 0, res.stats
    assert sum(res.stats["accept_len_histogram"][1:]) > N_LAW / 5  # its proposals were accepted
    assert tv(empirical_law(res.tokens, 3), laws[1.0]) < tv_bound(laws[1.0], N_LAW)


@pytest.mark.parametrize("pattern,fallback", [([False, True], "neural"), ([True, False], "ngram"),
                                              ([True, False], "random")])
def test_ssd_law_with_skipped_pre_speculation(small_vocab, monkeypatch, pattern, fallback):
    """Pre-speculation skipped at the prefill (round 1 has no cache: every row misses), or after round 1
    (round 2 answers from the fallback, with the tokens the draft did not feed still pending): the law is
    still the target's."""
    gate_pattern(monkeypatch, pattern)
    res, d, bound = ssd_law_run(small_vocab, 1.0, 0.3, fallback, pre_spec="auto")
    s = res.stats
    assert s["pre_speculation_skipped"] > 0 and s["fallback_rounds"][fallback] > 0, s
    assert d < bound, (d, bound)


@pytest.mark.parametrize("j,fallback", [(0, "neural"), (1, "ngram"), (1, "random")])
def test_ssd_law_with_stopped_pre_speculation(small_vocab, monkeypatch, j, fallback):
    """The outcome arrives before pre-speculation step j of every round (K = 2, Saguaro C = 0.3): the hit
    branches are finished alone (their x_K is fed in the next round, as every hit's), the law is still the
    target's."""
    arrive_at(monkeypatch, j)
    res, d, bound = ssd_law_run(small_vocab, 1.0, 0.3, fallback)
    s = res.stats
    assert s["hits"] > 0 and s["pre_speculation_stopped"] > 0, s
    assert s["branches_completed"] > 0, s
    assert d < bound, (d, bound)


def test_ssd_law_negative_control_wrong_q(small_vocab, monkeypatch):
    """The speculator samples from Saguaro's q' (C = 0: the likely tokens get no mass at all) but reports the
    raw q to the verifier: the test then uses the wrong law and the output is biased; the check must fail.
    Patched at draft.draw, the one place where the law a token was drawn from (q') and the raw q part ways."""
    orig = draft_module.draw

    def draw_reporting_raw_q(logits, temperature, noise, f=None, c=1.0):
        token, q_drawn, q_raw = orig(logits, temperature, noise, f, c)
        return token, q_raw, q_raw

    monkeypatch.setattr(draft_module, "draw", draw_reporting_raw_q)
    _, d, bound = ssd_law_run(small_vocab, 1.0, 0.0, "neural")
    assert d > bound, (d, bound)


# ----------------------------------------------------------------------------------------------------
# A speculator that dies mid-run

def test_killed_speculator_raises(tmp_path):
    tgt = make_checkpoint(tmp_path / "target", "llama", seed=30, **{**TARGET_KW, "max_position_embeddings": 4096})
    dft = make_checkpoint(tmp_path / "draft", "llama", seed=31, **{**RANDOM_DRAFT_KW, "max_position_embeddings": 4096})
    started, result = threading.Event(), {}

    def stream(row, tokens):
        if len(tokens) >= 8:
            started.set()

    def run_generate():
        try:
            result["value"] = gen([[1, 2, 3]], tgt, dft, mode="ssd", k=4, max_new_tokens=3000, ignore_eos=True,
                                  parallel=True, stream=stream)
        except BaseException as e:  # noqa: B036 (handed to the test thread)
            result["error"] = e

    th = threading.Thread(target=run_generate, daemon=True)
    th.start()
    try:
        assert started.wait(60), f"decoding never started: {result}"
        children = multiprocessing.active_children()
        assert len(children) == 1, children
        os.kill(children[0].pid, signal.SIGKILL)
        t0 = time.perf_counter()
        th.join(10)
        assert not th.is_alive(), "generate still running 10 s after the speculator was killed"
        assert "value" not in result, "the run finished before the kill: make it longer"
        err = result.get("error")
        assert isinstance(err, RuntimeError) and "speculator" in str(err), repr(err)
        assert time.perf_counter() - t0 < 10
        assert multiprocessing.active_children() == []
    finally:
        for c in multiprocessing.active_children():  # only ever the speculator this test started
            c.kill()
            c.join(5)


# ----------------------------------------------------------------------------------------------------
# Bad SSD input: one-line ValueError

@pytest.mark.parametrize("kw,match", [(dict(fan_out=[1, 1]), "fan_out"), (dict(fan_out="zigzag"), "fan_out"),
                                      (dict(budget=0), "budget"), (dict(saguaro_c=1.5), "saguaro_c"),
                                      (dict(saguaro_c=-0.1), "saguaro_c"), (dict(fallback="magic"), "fallback"),
                                      (dict(pre_spec="sometimes"), "pre_spec")])
def test_bad_ssd_input(ckpts, kw, match):
    with pytest.raises(ValueError) as e:
        gen([PROMPTS[0]], ckpts["target"], ckpts["different"], mode="ssd", k=4, max_new_tokens=4, parallel=False, **kw)
    msg = str(e.value)
    assert "\n" not in msg and match in msg, msg


# ----------------------------------------------------------------------------------------------------
# The shipped tiny pair

REPO = Path(__file__).resolve().parent.parent
CODE_PROMPTS = ["def binary_search(items, target):\n",
                "import os\n\n\ndef list_files(path):\n",
                "class Stack:\n    def __init__(self):\n"]


@pytest.mark.skipif(not (REPO / "checkpoints" / "tiny-target" / "model.safetensors").exists()
                    or not (REPO / "checkpoints" / "tiny-draft" / "model.safetensors").exists(),
                    reason="the shipped tiny pair is not trained yet (scripts/train_tiny.py)")
def test_shipped_pair_hit_rate():
    kw = dict(max_new_tokens=64, ignore_eos=True, temperature=0.0)
    res = gen(CODE_PROMPTS, "tiny", "tiny-draft", mode="ssd", parallel=False, **kw)
    assert res.stats["cache_hit_rate"] >= 0.5, res.stats
    assert res.tokens == gen(CODE_PROMPTS, "tiny", mode="ar", **kw).tokens
