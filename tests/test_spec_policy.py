"""The speculator's policy (spec_policy.py): the adaptive budget, the pre-speculation gate, and
SpecPolicy's choices: each row's fan-out, a fixed budget, b* from measurements."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from draft import DraftSettings  # noqa: E402
from spec_cache import geometric_fan_out, uniform_fan_out  # noqa: E402
from spec_policy import PreSpecGate, SpecPolicy, next_budget  # noqa: E402


# ----------------------------------------------------------------------------------------------------
# The adaptive budget

def test_next_budget_steps():
    assert next_budget(8, 8, 1.3, False) == 6 and next_budget(8, 8, 0.5, True) == 6  # too slow or stopped
    assert next_budget(3, 8, 2.0, False) == 2 and next_budget(1, 8, 5.0, True) == 1   # at least 1
    assert next_budget(5, 8, 0.5, False) == 6 and next_budget(8, 8, 0.1, False) == 8  # grows to the ceiling
    assert next_budget(5, 8, 0.9, False) == 5                                         # fits: stays


@pytest.mark.parametrize("step_cost,expect", [(0.02, 8), (0.05, 6), (0.2, 1)])
def test_next_budget_settles_where_pre_speculation_fits(step_cost, expect):
    """Pre-speculation costing 0.1 + step_cost * B verifications (a fixed part and one per branch): from the
    user's budget 8 the budget settles near the largest B that fits one verification, and rounds that do
    not fit are a minority once it has."""
    B, seen = 8, []
    for _ in range(200):
        T_p = 0.1 + step_cost * B
        seen.append(B)
        B = next_budget(B, 8, T_p, stopped=T_p > 1)
    settled = seen[50:]
    fits = max(b for b in range(1, 9) if 0.1 + step_cost * b <= 1) if step_cost < 0.9 else 1
    assert min(expect, fits) - 2 <= sorted(settled)[len(settled) // 2] <= fits
    assert sum(0.1 + step_cost * b > 1 for b in settled) <= len(settled) / 2


# ----------------------------------------------------------------------------------------------------
# The gate: pre-speculate at all?

def run_gate(gate, rounds, verify, answer, tokens):
    """Drive a gate the way the speculator does: choose() for round k, then at the answer to round k's
    outcome answered(tokens of round k, arrival, clock). The arm chosen for round k sets round k's
    verification time verify[arm], the answer after it answer[arm], and round k + 1's tokens tokens[arm].
    Off rounds are predicted at E_off = tokens[False]. Returns the choices."""
    clock, arms, prev = 0.0, [], None
    for k in range(rounds):
        arm = gate.choose(tokens[False])     # during round k's verification
        arms.append(arm)
        clock += verify[arm]
        arrived = clock
        clock += answer[arm]
        gate.answered(tokens[prev] if prev is not None else 1, arrived, clock)  # round k's tokens
        prev = arm
    return arms


def test_gate_schedule_warmup_then_probe():
    gate = PreSpecGate(warmup=6, probe=2)
    assert gate.rate_on() is None and gate.rate_off(3.0) is None
    arms = run_gate(gate, 10, {True: 2.0, False: 1.0}, {True: 1.0, False: 1.0}, {True: 2, False: 2})
    assert arms[:8] == [True] * 6 + [False] * 2


def test_gate_leaves_out_the_first_rounds():
    """A run's first rounds are slow whatever the choice: on's rate starts after its first `settle`."""
    gate = PreSpecGate(settle=2)
    gate.on = [(1, 100.0), (1, 50.0), (4, 10.0), (2, 10.0)]
    assert gate.rate_on() == pytest.approx(6 / 20)


def test_gate_charges_each_arm_and_takes_the_faster():
    """On yields more tokens per round but its verification runs slower beside the draft. The rates must
    be each arm's own (the tokens of the round after the choice over the verification of the round of the
    choice plus the answer after it), and the gate spends most rounds off, trying on once every
    probe_every rounds."""
    tokens, verify, answer = {True: 4, False: 2}, {True: 12.0, False: 3.0}, {True: 1.0, False: 2.0}
    gate = PreSpecGate(warmup=4, probe=2, probe_every=10, window=16)
    arms = run_gate(gate, 200, verify, answer, tokens)
    assert gate.rate_on() == pytest.approx(4 / 13)
    assert gate.rate_off(tokens[False]) == pytest.approx(2 / 5)
    later = arms[20:]
    assert 0.85 <= sum(not a for a in later) / len(later) <= 0.95


@pytest.mark.parametrize("off_seconds,off_share", [(4.6, 0.1), (4.3, 0.9)])
def test_gate_margin(off_seconds, off_share):
    """Margin 1.1. On at 4 tokens per 10 s; off at 2 tokens per 4.6 s is 9% faster: the gate stays on but
    for its probes of off (1 round in 10); at 4.3 s off is 16% faster and taken but for the probes of on."""
    gate = PreSpecGate(warmup=4, probe=2, probe_every=10, window=16, margin=1.1)
    arms = run_gate(gate, 200, {True: 9.0, False: off_seconds - 1}, {True: 1.0, False: 1.0},
                    {True: 4, False: 2})
    share = sum(not a for a in arms[20:]) / 180
    assert abs(share - off_share) <= 0.03, share


def test_gate_follows_a_change():
    """Off is faster for 100 rounds, then on becomes faster (say the hit rate rose): the probes see it."""
    gate = PreSpecGate()
    tokens = {True: 4, False: 2}
    run_gate(gate, 100, {True: 12.0, False: 3.0}, {True: 1.0, False: 2.0}, tokens)
    arms = run_gate(gate, 300, {True: 6.0, False: 3.0}, {True: 1.0, False: 2.0}, tokens)
    assert sum(arms[-100:]) >= 85, arms  # all on but for the probes of off, 1 in 8


# ----------------------------------------------------------------------------------------------------
# SpecPolicy

def test_fan_out_is_decided_per_row():
    """A row without proposals puts all of B at depth 0; a row the draft proposed for and one a fast
    backup proposed for get the rule's vector at their own acceptance (the defaults until measured, then
    the measured a); the used fan-out is their mean per depth."""
    p = SpecPolicy(DraftSettings(K=3, budget=8))
    assert p.row_fan_out(None, [], False) == [8, 0, 0, 0]
    neural, fast = p.row_fan_out(None, [1, 2, 3], False), p.row_fan_out(None, [1, 2, 3], True)
    assert neural == p.prior() == geometric_fan_out(0.8, 0.8, 3, 8)
    assert fast == geometric_fan_out(0.1, 0.8, 3, 8) and fast[0] > neural[0]
    p.accept_fast.update([3] * 40, 3)  # the fast backup measured as good as can be
    measured = p.row_fan_out(None, [1, 2, 3], True)
    assert measured == geometric_fan_out(0.99, 0.8, 3, 8)
    rows = [[8, 0, 0, 0], neural, fast, measured]
    assert p.stats()["row_fan_out_mean"] == pytest.approx([sum(F[j] for F in rows) / 4 for j in range(4)])
    u = SpecPolicy(DraftSettings(K=3, fan_out="uniform", budget=6))
    assert u.row_fan_out(None, [4, 5, 6], True) == uniform_fan_out(3, 6)
    e = SpecPolicy(DraftSettings(K=2, fan_out=[2, 1, 0]))
    assert e.row_fan_out(None, [4, 5], False) == [2, 1, 0] and e.row_fan_out(None, [], False) == [3, 0, 0]


@pytest.mark.parametrize("fixed", [False, True])
def test_fixed_budget_never_moves(fixed):
    """Pre-speculation that overruns the verification shrinks an adaptive B; --fixed-budget keeps it."""
    p = SpecPolicy(DraftSettings(K=3, budget=8, fixed_budget=fixed))
    p.outcome_arrived(0.010, pre_speculated=True)
    for _ in range(5):
        p.pre_speculated(0.030, stopped=True)
    assert (p.B == 8) == fixed and p.stats()["fixed_budget"] == fixed
    assert p.stats()["mean_budget"] == (8 if fixed else pytest.approx((8 + 6 + 5 + 4 + 3) / 5))


def test_pre_speculate_now():
    assert SpecPolicy(DraftSettings(K=2)).pre_speculate_now(4)
    never = SpecPolicy(DraftSettings(K=2, pre_spec="never"))
    assert not never.pre_speculate_now(4) and never.skipped == 1 and never.gate is None
    auto = SpecPolicy(DraftSettings(K=2, pre_spec="auto"))
    assert [auto.pre_speculate_now(1) for _ in range(8)] == [True] * 6 + [False] * 2  # warm-up, probe


def gate_after_a_gap(joined: bool):
    """A gate at 4 tokens per 11 s on (3 per 11 s off); after 40 rounds, one round on whose
    verification held a 600 s gap (a server standing empty, then a request's prefill) and, if
    `joined`, was told so; then 40 rounds more. -> (rate_on before the gap, rate_on after)."""
    gate, clock, prev, before = PreSpecGate(), 0.0, None, None
    for k in range(81):
        arm = gate.choose(3)
        if k == 40:
            gate.arm = arm = True  # the gap's round pre-speculates
            before = gate.rate_on()
            if joined:
                gate.rows_joined()
        clock += 10.0 + (600.0 if k == 40 else 0.0)
        arrived = clock
        clock += 1.0
        gate.answered({True: 4, False: 3}[prev] if prev is not None else 1, arrived, clock)
        prev = arm
    return before, gate.rate_on()


def test_a_join_is_not_charged_to_the_gate():
    """Rows joining (SpecPolicy.rows_joined): the round their prefill fell in is no arm's cost; on's
    rate after is on's rate before. Negative control: charged, one such round in the window halves
    it (and pre-speculation would be turned off for about 256 rounds)."""
    before, after = gate_after_a_gap(joined=True)
    assert after == pytest.approx(before)
    before, after = gate_after_a_gap(joined=False)
    assert after < before / 2


def test_the_gate_keeps_a_window_not_a_history():
    """A server's gate runs for ever: it keeps on's first `settle` rounds and the last `window` of
    each arm, nothing older."""
    gate = PreSpecGate(warmup=4, probe=2, probe_every=3, window=16, settle=2)
    run_gate(gate, 2000, {True: 2.0, False: 1.0}, {True: 1.0, False: 1.0}, {True: 3, False: 2})
    assert len(gate.on) == 2 + 16 and len(gate.off) == 16
