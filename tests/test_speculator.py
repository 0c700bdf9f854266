"""One row of the speculator, traced (issue 71): docs/design.md section 3 tabulates a row's state
across SSD rounds (K = 2, B = 3); this test reads that table and runs it on the shipped tiny draft.

A Speculator in one process is driven by hand: the outcomes (n, t) the verifier would post are
chosen here so that each moment of the table happens (a hit on a round-0 guess, a hit at depth 2,
a miss at depth 1 answered by the neural and by the n-gram backup). After each moment the row's
state is compared with the table's line: history, unfed (Row.unfed: what its cache lacks),
proposed, how many guess laws it holds (`guess_probs`), its fan-out F_0..F_2 and the length of its
KV sequence; and what the KV column says of the branches (their lengths, which were freed). The
symbols of the table (P, t0, x'_1, ...) are bound to the tokens the run produced, moment by moment.

Negative controls: the miss's bonus u is a token cached at depth 2, so it is the key (row, n, t),
not t alone, that decides a hit; and a round that pre-speculates nothing (the gate says no) feeds
nothing, so the row stays as the miss left it and the table's last line does not hold.
"""
import re
from pathlib import Path

import pytest
import torch

from checkpoint import load_model
from draft import DraftSettings
from speculator import Speculator

torch.set_num_threads(1)

DESIGN = Path(__file__).resolve().parent.parent / "docs" / "design.md"
K, B = 2, 3
MOMENTS = ["prefill", "round 0 pre-speculates", "outcome (0, t0), a hit on g = t0",
           "round 1 pre-speculates (x_i: the x'_i adopted)", "outcome (2, t), a hit",
           "outcome (1, u), a miss, neural backup", "the same miss, n-gram backup",
           "round 2 pre-speculates after the n-gram"]


def trace_table() -> dict[str, dict[str, str]]:
    """design.md's "One row, traced" table: moment -> {column: cell}."""
    text = DESIGN.read_text(encoding="utf-8")
    lines = text[text.index("**One row, traced**"):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| moment |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    table = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        table[cells[0]] = dict(zip(header, cells))
    return table


def tokens(cell: str, sym: dict) -> list[int]:
    """A cell such as "P t0 x_1 u" as tokens, each symbol bound in sym."""
    return [x for s in cell.split() for x in sym[s]]


def laws(cell: str) -> int | None:
    """"[2, V]: ..." -> 2; "None: ..." -> None."""
    return None if cell.startswith("None") else int(re.match(r"\[(\d+), V\]", cell).group(1))


def fan_out(cell: str) -> list[int] | None:
    """"[3, 0, 0]: ..." -> [3, 0, 0]; an empty cell (no pre-speculation) -> None."""
    m = re.match(r"\[([\d, ]+)\]", cell)
    return None if m is None else [int(f) for f in m.group(1).split(",")]


def kv_length(cell: str, L: int) -> int:
    """The row's KV length: the first "(m)" or "(m + k)" of the cell (m: the prompt's length)."""
    k = re.search(r"\(m(?: \+ (\d+))?\)", cell).group(1)
    return L + int(k or 0)


def mismatches(s: Speculator, line: dict, sym: dict, L: int) -> list[str]:
    """Where row 0 of s differs from a line of the table (none: it holds the line's state)."""
    row = s.rows[0]
    got = dict(history=row.history, unfed=s.unfed(row), proposed=row.proposed,
               guess_probs=None if row.guess_probs is None else len(row.guess_probs),
               KV=s.cache.length(row.seq))
    want = dict(history=tokens(line["history"], sym), unfed=tokens(line["unfed"], sym),
                proposed=tokens(line["proposed"], sym), guess_probs=laws(line["guess_probs"]),
                KV=kv_length(line["KV"], L))
    F = fan_out(line["F_0..F_2"])
    if F is not None:  # a pre-speculation's (none: the round skipped it)
        got["F"], want["F"] = None if s.branches is None else s.branches.row_F[0], F
    return [f"{k}: {got[k]} where the table has {want[k]}" for k in want if got[k] != want[k]]


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_model("tiny-draft")
    return model, tok.encode("def main():\n    return")


@pytest.fixture(scope="module")
def table():
    table = trace_table()
    assert list(table) == MOMENTS, "docs/design.md's trace table changed: update MOMENTS and the run"
    return table


def respond(s: Speculator, n: int, t: int):
    return s.respond([0], torch.tensor([n]), torch.tensor([t]))


def guess_at(s: Speculator, j: int) -> list[int]:
    """The bonus tokens row 0's branches guessed at depth j."""
    return [t for (r, d, t) in s.spec_cache.entries if r == 0 and d == j]


def to_round_1(tiny, table, temperature: float, fallback: str):
    """Run the table's first four moments, checking each. -> the speculator and the symbols."""
    model, P = tiny
    L = len(P)
    s = Speculator(model, DraftSettings(K=K, budget=B, fixed_budget=True, fallback=fallback),
                   temperature, seed=7, kv_tokens=512)
    sym = {"P": P}
    s.add([P])
    assert mismatches(s, table["prefill"], sym, L) == []
    s.pre_speculate([0])
    assert mismatches(s, table["round 0 pre-speculates"], sym, L) == []
    branches = s.branches.seqs  # 3 forked at L, each fed g x'_1: L + 2; x'_2 drawn, not fed
    assert len(branches) == B and [s.cache.length(m) for m in branches] == [L + 2] * B
    assert s.branches.drafted.steps == K
    t0 = guess_at(s, 0)[1]
    p = respond(s, 0, t0)
    sym.update({"t0": [t0], "x'_1": s.rows[0].proposed[:1], "x'_2": s.rows[0].proposed[1:]})
    assert p.hit.tolist() == [True] and p.tokens[0].tolist() == s.rows[0].proposed
    assert mismatches(s, table["outcome (0, t0), a hit on g = t0"], sym, L) == []
    assert list(s.cache.seqs) == [s.rows[0].seq] and s.rows[0].seq in branches  # the rest freed
    s.pre_speculate([0])
    sym.update({"x_1": sym["x'_1"], "x_2": sym["x'_2"]})
    assert mismatches(s, table["round 1 pre-speculates (x_i: the x'_i adopted)"], sym, L) == []
    for (_, j, _), m in s.spec_cache.entries.items():  # forked at L + 1 + j, fed t x'_1
        assert s.cache.length(s.branches.seqs[m]) == L + 3 + j
    return s, sym, p


def check_q(p, temperature: float, drawn: bool):
    """The verifier gets q [1, 2, V] for drawn proposals (none at temperature 0: all one-hot)."""
    assert p.deterministic.tolist() == [temperature == 0 or not drawn]
    if temperature == 0:
        assert p.q is None
    else:
        assert p.q.shape[:2] == (1, K)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_hit_at_depth_2(tiny, table, temperature):
    s, sym, p = to_round_1(tiny, table, temperature, "neural")
    check_q(p, temperature, drawn=True)
    t = guess_at(s, 2)[0]
    p = respond(s, 2, t)
    sym.update({"t": [t], "x'_1": s.rows[0].proposed[:1], "x'_2": s.rows[0].proposed[1:]})
    assert p.hit.tolist() == [True]
    check_q(p, temperature, drawn=True)
    assert mismatches(s, table["outcome (2, t), a hit"], sym, len(sym["P"])) == []
    assert list(s.cache.seqs) == [s.rows[0].seq]


def miss_at_depth_1(s: Speculator, sym: dict):
    """The outcome (1, u), u a token cached at depth 2 only: a miss, whatever t it shares."""
    u = guess_at(s, 2)[0]
    assert u not in guess_at(s, 1) and (0, 2, u) in s.spec_cache
    p = respond(s, 1, u)
    assert p.hit.tolist() == [False]
    sym["u"] = [u]
    return p


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_miss_neural_backup(tiny, table, temperature):
    s, sym, _ = to_round_1(tiny, table, temperature, "neural")
    p = miss_at_depth_1(s, sym)
    sym.update({"y_1": s.rows[0].proposed[:1], "y_2": s.rows[0].proposed[1:]})
    check_q(p, temperature, drawn=True)
    assert mismatches(s, table["outcome (1, u), a miss, neural backup"], sym, len(sym["P"])) == []
    assert list(s.cache.seqs) == [s.rows[0].seq]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_miss_ngram_backup_then_round_2(tiny, table, temperature):
    s, sym, _ = to_round_1(tiny, table, temperature, "ngram")
    p = miss_at_depth_1(s, sym)
    sym.update({"z_1": s.rows[0].proposed[:1], "z_2": s.rows[0].proposed[1:]})
    check_q(p, temperature, drawn=False)
    L = len(sym["P"])
    assert mismatches(s, table["the same miss, n-gram backup"], sym, L) == []
    s.pre_speculate([0])
    assert mismatches(s, table["round 2 pre-speculates after the n-gram"], sym, L) == []


def test_a_round_that_pre_speculates_nothing_feeds_nothing(tiny, table):
    """Negative control: the gate says no before round 2, so nothing is fed: the row is still as
    the miss left it (u z_1 z_2 unfed, no guess laws) and the table's last line fails. Then, as
    the text under the table says, the next answer misses and keeps what the cache holds: the
    committed tokens past it are unfed with the new proposals, and the next pre-speculation feeds
    them all but keeps only the laws q_0..q_L (Row.fed)."""
    s, sym, _ = to_round_1(tiny, table, 0.0, "ngram")
    miss_at_depth_1(s, sym)
    sym.update({"z_1": s.rows[0].proposed[:1], "z_2": s.rows[0].proposed[1:]})
    s.policy.pre_speculate_now = lambda b: False
    s.pre_speculate([0])
    L = len(sym["P"])
    assert mismatches(s, table["the same miss, n-gram backup"], sym, L) == []
    wrong = mismatches(s, table["round 2 pre-speculates after the n-gram"], sym, L)
    assert [w.split(":")[0] for w in wrong] == ["unfed", "guess_probs", "KV", "F"], wrong

    del s.policy.pre_speculate_now  # the gate opens again
    row, v = s.rows[0], 7
    assert respond(s, 1, v).hit.tolist() == [False]  # outcome (1, v): z_1 accepted, bonus v
    w = row.proposed
    assert row.history == tokens("P t0 x_1 u z_1", sym) + [v] and len(w) == K
    assert s.cache.length(row.seq) == L + 2 and row.guess_probs is None  # still P t0 x_1
    assert s.unfed(row) == tokens("u z_1", sym) + [v] + w
    s.pre_speculate([0])
    assert s.unfed(row) == [] and s.cache.length(row.seq) == L + 7
    assert len(row.guess_probs) == row.depths == K + 1  # 5 tokens fed, the last 3 laws kept
