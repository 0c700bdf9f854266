"""Prefix caching (issue 53, item 4): full KV blocks named by the hash of their tokens and every
token before them, shared by prompts that start alike, on the target's cache and the draft's.

1. The allocator (kv_cache.PagedKVCache): the hash chain, references taken and returned, one block
   per hash, registered blocks that nobody holds staying findable until the pool needs them and
   then evicted least recently freed first (blocks without a hash before any), a write into a
   registered block forgetting its hash; a prefill that reuses cached blocks gives the logits of a
   full forward.
2. Admission (scheduler.Scheduler) counts the blocks running requests share once, by hash, and
   still counts them while any holder runs.
3. Exact: greedy tokens with prefix caching are those without, in AR, SD and SSD (one process and
   two), for requests sharing a prompt of several blocks that join while others run and after
   they left (the caches hit on both sides), and a chat's next turn, which finds the blocks of the
   earlier prompt and answer. The law at T > 0 is tests/test_batched_law.py's.
"""
from types import SimpleNamespace

import pytest
import torch

from checkpoint import load_model
from conftest import make_checkpoint
from decode import Output
from draft import DraftSettings
from engine import EngineConfig, load_engine
from kv_cache import PagedKVCache, block_hashes, shareable_hashes
from scheduler import KVBudget, Request, Scheduler

torch.set_num_threads(1)

BS = 4
CFG = SimpleNamespace(num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                      head_dim=2)


def cache(blocks, prefix_caching=True) -> PagedKVCache:
    return PagedKVCache(CFG, blocks * BS, BS, prefix_caching=prefix_caching)


def prefilled(c: PagedKVCache, prompt) -> int:
    """A new sequence holding `prompt`, as Transformer.prefill leaves it (no forward: the
    allocator alone)."""
    sid = c.new_seq()
    done = c.reuse_prefix(sid, prompt)
    c.append(sid, len(prompt) - done)
    c.register(sid, prompt)
    return sid


# --------------------------------------------------------------------------------------------------
# 1. The allocator

def test_hash_chain_names_a_block_and_everything_before_it():
    a = block_hashes(list(range(12)), BS)
    assert len(a) == 3 and len(set(a)) == 3
    assert block_hashes(list(range(12)) + [5, 5], BS) == a  # a partial block has no hash
    b = block_hashes([0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11], BS)  # block 1 differs
    assert b[0] == a[0] and b[1] != a[1] and b[2] != a[2]  # block 2's tokens alike, not its past
    assert len(shareable_hashes(list(range(12)), BS)) == 2  # the last token is always prefilled
    assert len(shareable_hashes(list(range(13)), BS)) == 3


def test_a_prompt_reuses_the_full_blocks_it_starts_with_and_keeps_its_last_block():
    c = cache(16)
    p = list(range(10))
    a = prefilled(c, p)
    b = c.new_seq()
    assert c.reuse_prefix(b, p[:9] + [77, 78]) == 8  # 2 full blocks shared, the third differs
    assert c.seqs[b].blocks == c.seqs[a].blocks[:2] and c.length(b) == 8
    assert [c.refcount[x] for x in c.seqs[a].blocks] == [2, 2, 1]
    assert (c.prefix_queries, c.prefix_hits) == (10 + 11, 8)
    c.append(b, 3)  # its own blocks from there on
    assert c.seqs[b].blocks[2] != c.seqs[a].blocks[2]
    # a prompt of exactly two full blocks takes one: its last token must be prefilled
    assert c.reuse_prefix(c.new_seq(), p[:8]) == 4
    off = cache(16, prefix_caching=False)
    prefilled(off, p)
    assert off.reuse_prefix(off.new_seq(), p) == 0 and not off.cached


def test_freed_blocks_stay_findable_and_are_evicted_least_recently_freed():
    c = cache(6)
    a = prefilled(c, list(range(9)))          # blocks 0, 1 registered, 2 partial
    b = prefilled(c, [50 + i for i in range(5)])  # block 3 registered, 4 partial
    c.free(a)
    c.free(b)
    assert c.num_free_blocks() == 6 and len(c.cached) == 3
    # blocks without a hash go first (the partial ones, the never used one), then the registered
    # ones in the order they were freed: a's tail (1) before its head (0), then b's block 3
    order = [c._alloc() for _ in range(6)]
    assert set(order[:3]) == {2, 4, 5} and order[3:] == [1, 0, 3]
    assert not c.cached and not c.hash_of  # every one evicted on the way


def test_a_hit_on_a_free_block_takes_it_back_and_a_pool_that_needs_room_evicts():
    c = cache(4)
    a = prefilled(c, list(range(9)))  # 3 blocks, 2 registered
    c.free(a)
    b = prefilled(c, list(range(9)))  # the same prompt: both registered blocks reused
    assert c.prefix_hits == 8 and c.num_free_blocks() == 1
    c.free(b)
    d = prefilled(c, [90 + i for i in range(13)])  # 4 blocks: the pool evicts both cached ones
    assert len(c.seqs[d].blocks) == 4 and c.num_free_blocks() == 0
    assert c.reuse_prefix(c.new_seq(), list(range(9))) == 0  # gone
    with pytest.raises(RuntimeError, match="KV cache full"):
        c.append(d, 4)


def test_prompts_prefilled_together_keep_one_block_per_hash():
    c = cache(16)
    p = list(range(9))
    a, b = c.new_seq(), c.new_seq()
    for s in (a, b):  # both looked up before either was prefilled: neither hits
        assert c.reuse_prefix(s, p) == 0
    c.append(a, 9), c.append(b, 9)
    free = c.num_free_blocks()
    c.register(a, p), c.register(b, p)
    assert c.seqs[b].blocks[:2] == c.seqs[a].blocks[:2]  # b took a's, and freed its own
    assert c.seqs[b].blocks[2] != c.seqs[a].blocks[2]
    assert c.num_free_blocks() == free + 2


def test_rollback_never_writes_a_shared_block_and_a_rewritten_one_forgets_its_hash():
    c = cache(16)
    p = list(range(9))
    a, b = prefilled(c, p), prefilled(c, p)
    shared = c.seqs[a].blocks[1]
    c.truncate(b, 6)  # into a shared block (no caller does this): the write copies it
    c.append(b, 1)
    assert c.seqs[b].blocks[1] != shared and c.hash_of[shared] in c.cached
    c.free(b)
    c.truncate(a, 6)  # into a registered block it alone holds: written, no longer cached
    c.append(a, 1)
    assert shared not in c.hash_of and len(c.cached) == 1


def test_rows_leaving_register_their_own_tokens_when_one_already_left():
    """Verifier.leave with a row already freed among those leaving: each live row registers its
    own tokens (a shifted pairing would name one row's KV by another's prompt)."""
    from verify import Verifier
    c = cache(16)
    p1, p2 = list(range(8)) + [0], list(range(50, 58)) + [0]
    seqs = [c.new_seq(), c.new_seq()]  # each holding its prompt, not yet registered
    for sid, p in zip(seqs, (p1, p2)):
        c.append(sid, len(p))
    v = SimpleNamespace(cache=c, seqs=[None, *seqs], gens=[0, 0, 0])
    v.release = lambda rows: Verifier.release(v, rows)
    Verifier.leave(v, [0, 1, 2], tokens=[list(range(100, 109)), p1, p2])
    assert v.seqs == [None, None, None]
    for p in (p1, p2):  # each prompt finds its own two blocks, the first row's tokens none
        assert c.reuse_prefix(c.new_seq(), p + [1]) == 8
    assert c.reuse_prefix(c.new_seq(), list(range(100, 109))) == 0


def test_prefill_after_a_cached_prefix_equals_the_full_forward(tmp_path):
    model = load_model(make_checkpoint(tmp_path, "llama"), tokenizer=False)[0]
    tokens = torch.randint(0, 100, (23,), generator=torch.Generator().manual_seed(3)).tolist()
    full = model(torch.tensor([tokens]))[0, -1]
    c = model.new_cache(256, BS, prefix_caching=True)
    first = model.prefill(c, [c.new_seq()], [tokens[:17] + [1, 2]])
    sid = c.new_seq()
    got = model.prefill(c, [sid], [tokens])[0]
    assert c.prefix_hits == 16 and c.length(sid) == 23 and first.shape == (1, 100)
    assert torch.allclose(got, full, atol=1e-4), (got - full).abs().max()


# --------------------------------------------------------------------------------------------------
# 2. Admission

class Rounds:
    """The rounds a scheduler drives, less the models: rows join and leave."""

    def __init__(self):
        self.out, self.rows = Output([], 1), []

    def join(self, prompts, max_new, temps=None, seeds=None, eos_after=None):
        new = self.out.add(max_new, eos_after)
        self.rows += new
        return new

    def leave(self, rows, tokens=None):
        self.rows = [r for r in self.rows if r not in rows]


def scheduler(prefix_caching, draft=True) -> Scheduler:
    # a request of 13 prompt tokens and 2 new: (13 + 2 + K + 1) -> 20 tokens, 5 blocks, of which 3
    # shareable (12 tokens): two such requests hold 12 + 2 * 8 = 28 tokens, counted once
    budget = KVBudget(28, 28 + 8 if draft else None, BS, 1, 4 if draft else 0, prefix_caching)
    return Scheduler(Rounds(), budget, max_batch=8)


def test_admission_counts_shared_blocks_once_while_anyone_holds_them():
    prompt = list(range(13))
    s = scheduler(True)
    s.submit(Request(prompt, 2))
    s.admit()
    s.submit(Request(prompt, 2))
    s.admit()
    assert len(s.running) == 2 and s.used == [28, 36]
    s.out.done[0] = True
    s.leave()  # its shared blocks are still the other one's
    assert s.used == [20, 24]
    s.submit(Request(prompt, 2))
    s.submit(Request(list(range(100, 113)), 2))  # shares nothing: waits
    s.admit()
    assert len(s.running) == 2 and s.queue_length() == 1 and s.used == [28, 36]
    for r in list(s.running):
        s.out.done[r] = True
    s.leave()
    assert s.used == [0, 0] and not s.held
    # without prefix caching the second request of the same prompt waits for the first
    off = scheduler(False, draft=False)
    off.submit(Request(prompt, 2))
    off.submit(Request(prompt, 2))
    off.admit()
    assert len(off.running) == 1 and off.used == [20, 0]


def test_requests_joining_together_each_pay_for_blocks_no_running_request_holds():
    """Prompts prefilled together each compute their blocks (the cache keeps one afterwards), so
    the second waits one boundary, then shares."""
    s = scheduler(True)
    for _ in range(2):
        s.submit(Request(list(range(13)), 2))
    s.admit()
    assert len(s.running) == 1
    s.admit()
    assert len(s.running) == 2 and s.used == [28, 36]


# --------------------------------------------------------------------------------------------------
# 3. Exact: the same greedy tokens with and without

SYSTEM = ("You are a careful Python programmer. Answer with code only, in the style of the\n"
          "standard library: short functions, docstrings, no globals.\n\n"
          "import os\nimport sys\nimport re\nfrom collections import deque, namedtuple\n"
          "from itertools import chain\n\n")
TURNS = ["def fib(n):", "class Stack:\n    def __init__(self):\n        ",
         "def parse_args(argv):", "def read_lines(path):"]
NEW = 12


def engine(model, mode, parallel=False, prefix_caching=True):
    return load_engine(EngineConfig(
        target=model, draft="tiny-draft", mode=mode, temperature=0.0,
        spec=DraftSettings(K=3, budget=4, fallback="neural"), seed=0, ignore_eos=True,
        parallel=parallel, target_device=None, draft_device=None, target_threads=1,
        draft_threads=1 if parallel else None, kv_tokens=2048, target_devices=None,
        tp_timeout=60.0, dtype="float32", graphs=None, prefix_caching=prefix_caching), max_batch=8)


# request i is submitted before round WHEN[i]: beside the first (its shared blocks held) and,
# the next turn, after it has left (its prompt's and answer's blocks cached, free)
WHEN = [0, 2, 2, 4, NEW + 3]


def waves(engine, prompts, turn):
    """The prompts, and a next turn of the first one (its prompt, its answer, `turn`), submitted
    at WHEN's rounds. -> (every request, the target's prefix hits in tokens of the next turn)."""
    sched, step = engine.scheduler, 0
    reqs = [Request(p, NEW) for p in prompts] + [None]
    while step <= max(WHEN) or sched.running or sched.waiting:
        for i, when in enumerate(WHEN):
            if when == step:
                if reqs[i] is None:
                    reqs[i] = Request(prompts[0] + reqs[0].tokens + turn, NEW)
                    before = sched.prefix_tokens()["target"][1]
                sched.submit(reqs[i])
        sched.step()
        step += 1
    return reqs, sched.prefix_tokens()["target"][1] - before


@pytest.fixture(scope="module")
def tiny():
    """The tiny target, the prompts, and the tokens each request gets without prefix caching."""
    model, tok = load_model("tiny")
    prompts, turn = [tok.encode(SYSTEM + t) for t in TURNS], tok.encode("\n\ndef main():")
    assert all(len(p) > 4 * 16 for p in prompts), [len(p) for p in prompts]
    off = engine(model, "ar", prefix_caching=False)
    try:
        reqs, _ = waves(off, prompts, turn)
    finally:
        off.started.stop()
    return model, prompts, turn, [req.tokens for req in reqs]


@pytest.mark.parametrize("mode,parallel", [("ar", False), ("sd", False), ("ssd", False),
                                           ("ssd", True)])
def test_greedy_tokens_equal_those_without_prefix_caching(tiny, mode, parallel):
    model, prompts, turn, ref = tiny
    eng = engine(model, mode, parallel)
    try:
        reqs, turn_hits = waves(eng, prompts, turn)
        assert [req.tokens for req in reqs] == ref
        # the next turn found the first conversation's prompt and answer (all but the last bonus
        # token, which the target had not cached), in full blocks: more than the prompt's
        p0 = len(prompts[0])
        assert turn_hits == (p0 + NEW - 1) // 16 * 16 > p0 // 16 * 16, (turn_hits, p0)
        sched = eng.scheduler
        hits = sched.prefix_tokens()
        for side in ("target", "draft") if mode != "ar" else ("target",):
            looked, found = hits[side]
            # every request after the first finds the system prompt (a few blocks at least)
            assert (looked == sum(len(req.prompt) for req in reqs)
                    and found >= 4 * 16 * (len(reqs) - 1)), hits
        # every block returned (the draft's process frees its rows after this returns)
        used = sched.rounds.kv_used()
        assert sched.used == [0, 0] and used[0] == 0 and (parallel or used[1] == 0), used
    finally:
        eng.started.stop()


def test_a_request_submitted_after_the_engine_went_down_ends_with_its_error():
    """fail() ends the running and the waiting; a request submitted after it (a handler that
    looked at /health's state a moment before) ends at once with the error, never queued where no
    thread will serve it."""
    s = scheduler(True)
    ended = []
    s.submit(Request(list(range(13)), 2, on_done=ended.append))
    s.fail("the speculator died")
    late = s.submit(Request(list(range(13)), 2, on_done=ended.append))
    assert [r.finish_reason for r in ended] == ["error", "error"] and late in ended
    assert late.error == "the speculator died" and s.queue_length() == 0


def test_two_servers_on_one_loaded_model_keep_their_own_caches(tiny):
    """A server's engine owns its KV pool: a second one built on the same loaded model neither
    empties the first one's cache (its rows went on, then failed on a freed sequence) nor takes
    its size."""
    model, prompts, _, ref = tiny
    a = engine(model, "sd")
    b = None
    try:
        req = a.scheduler.submit(Request(prompts[0], NEW))
        a.scheduler.step()
        b = engine(model, "sd")
        assert b.scheduler.rounds.verifier.cache is not a.scheduler.rounds.verifier.cache
        while a.scheduler.running or a.scheduler.waiting:
            a.scheduler.step()
        assert req.finish_reason == "length" and req.tokens == ref[0]
    finally:
        a.started.stop()
        if b is not None:
            b.started.stop()
