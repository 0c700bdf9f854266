"""A seeded request's text does not depend on the batch (issue 43, "Serve SSD").

Each row draws from its own generators, seeded from its request's seed: the verifier's uniforms and
bonus noise (verify.Verifier.add), the draft's noise for its d-th proposals, a function of the
seed and d alone (draft.Drafter.noise). So in AR and SD a request sampled at T = 1 alone, and the
same request joining a running batch at another round, beside rows at other temperatures that join
and leave, emit the same tokens. In SSD this holds when every proposal comes from the draft model
(the neural fallback, Saguaro's C = 1): the branch that hits drew with the noise the fallback would
have drawn with. A fast backup (n-gram, random), or C < 1 (q' depends on the fan-out, which adapts
to the batch), makes a row's proposals depend on the batch; what holds then is that the same batch
with the same seeds gives the same text (docs/design.md, section 7's Serving).
"""
import pytest
import torch

from conftest import make_checkpoint
from draft import DraftSettings
from engine import EngineConfig, load_engine
from scheduler import Request
from test_generate import TARGET_KW, perturbed_copy

torch.set_num_threads(1)

K, NEW = 3, 40
SEEDED = [1, 5, 7, 9, 11]  # the seeded request's prompt


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("row_seeds")
    tgt = make_checkpoint(root / "target", "llama", seed=0, **TARGET_KW)
    return tgt, perturbed_copy(tgt, root / "draft", noise=0.05, seed=2)


def load(pair, mode, **kw):
    """A server's engine (one process), its default temperature 0.7: requests bring their own."""
    tgt, dft = pair
    settings = dict(target=str(tgt), draft=str(dft), mode=mode, temperature=0.7,
                    spec=DraftSettings(K=K, fallback="neural"), seed=0, ignore_eos=True,
                    parallel=False, target_device=None, draft_device=None,
                    target_threads=1, draft_threads=None, kv_tokens=4096, target_devices=None,
                    tp_timeout=60.0, dtype="float32", graphs=None)
    return load_engine(EngineConfig(**{**settings, **kw}), max_batch=8)


def seeded_tokens(engine, seed, busy: bool) -> list[int]:
    """The seeded request's tokens (T = 1): alone, or (busy) joining at round 3 a batch of rows at
    T = 0, the default 0.7 and 1, which join at rounds 0, 3 and 6 and leave at different rounds."""
    sched = engine.scheduler
    me = Request(list(SEEDED), NEW, temperature=1.0, seed=seed)
    others = {0: [Request([1, 3], 12, temperature=0.0), Request([2, 4, 6], 30)],
              3: [me, Request([1, 8, 22, 33], 9, temperature=1.0, seed=99)],
              6: [Request([5, 5, 5], 25, temperature=1.0)]} if busy else {0: [me]}
    step = 0
    while step <= max(others) or sched.running or sched.waiting:
        for req in others.get(step, []):
            sched.submit(req)
        sched.step()
        step += 1
    assert me.finish_reason == "length" and len(me.tokens) == NEW
    return me.tokens


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_seeded_request_same_tokens_alone_and_in_a_changing_batch(pair, mode):
    engine = load(pair, mode)
    try:
        alone = seeded_tokens(engine, 123, busy=False)
        assert seeded_tokens(engine, 123, busy=True) == alone
        assert seeded_tokens(engine, 124, busy=False) != alone  # the seed decides the text
        if mode == "ssd":  # rows hit and missed: both paths drew the same tokens
            s = engine.started.speculator.stats()
            assert s["hits"] > 0 and s["misses"] > 0, s
    finally:
        engine.started.stop()


def test_ssd_seeded_text_is_sds(pair):
    """With the neural fallback and C = 1 every SSD proposal is the draft's draw with the row's
    noise for that round, as in SD: a seed gives SSD the text it gives SD."""
    texts = []
    for mode in ("sd", "ssd"):
        engine = load(pair, mode)
        try:
            texts.append(seeded_tokens(engine, 5, busy=False))
        finally:
            engine.started.stop()
    assert texts[0] == texts[1]


def test_ssd_with_a_fast_backup_same_batch_same_text(pair):
    """The n-gram backup and C = 0.5 (an explicit fan-out, so nothing adapts to the clocks): the
    same batch with the same seeds gives the same text, run after run."""
    kw = dict(spec=DraftSettings(K=K, fallback="ngram", saguaro_c=0.5, fan_out=[2, 1, 1, 1]))
    runs = []
    for _ in range(2):
        engine = load(pair, "ssd", **kw)
        try:
            runs.append(seeded_tokens(engine, 123, busy=True))
            s = engine.started.speculator.stats()
            assert s["fallback_rounds"]["ngram"] > 0 and s["hits"] > 0, s
        finally:
            engine.started.stop()
    assert runs[0] == runs[1]
