"""The static-shape path that CUDA graphs replay (graphs.StaticSteps), run here on the CPU without capture.

A step whose rows all add T tokens is padded to a bucket (rows and block-table columns rounded up to powers of
two; padding rows write into the cache's pad block) and run over preallocated buffers. These tests check that
the padded step computes what the dynamic step computes (logits, the K/V it writes, the tokens generate()
emits), that padding never touches a sequence's blocks, and that buckets are reused, so a GPU captures a
bounded number of graphs. The capture itself needs CUDA: scripts/gpu_check.py times it there.
"""
import shutil

import pytest
import torch

from conftest import make_checkpoint
from checkpoint import load_model
from graphs import StaticSteps
from kv_cache import bucket
from run import generate

torch.set_num_threads(1)

PROMPTS = [[1, 5, 7, 9, 11], [1, 3], [1, 8, 22, 33, 44, 55, 66, 77, 88, 90, 91, 92, 93, 94, 95, 96, 97, 98]]
# every target here: one shape, so the compiled tests share graphs (and Inductor's disk cache)
SHAPES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, eos_token_id=None,
              max_position_embeddings=256)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), request.param, **SHAPES)
    return load_model(path, tokenizer=False)[0]


def steps(model, graphs: bool | None, compile: bool = False, static: StaticSteps | None = None):
    """Prefill three ragged prompts, 6 greedy decode steps, then a verification of 4 tokens per row ->
    (every step's logits, the cache, the rows' ids). static: these static steps instead of use_graphs'."""
    model.use_graphs(graphs, compile)
    model.static = static or model.static
    cache = model.new_cache(1024, block_size=4)  # small blocks: the rows cross block boundaries
    ids = [cache.new_seq() for _ in PROMPTS]
    logits = [model.prefill(cache, ids, PROMPTS)]
    tok = logits[-1].argmax(-1)
    for _ in range(6):
        logits.append(model.forward_cached(cache, ids, tok, [1] * 3, last_only=True))
        tok = logits[-1].argmax(-1)
    logits.append(model.forward_cached(cache, ids, torch.arange(12) + 3, [4] * 3))  # [12, V]
    return logits, cache, ids


def test_static_steps_equal_the_dynamic_path(model):
    dynamic, cache_d, ids = steps(model, graphs=False)
    static, cache_s, _ = steps(model, graphs=True)
    assert model.static is not None and not model.static.capture  # the CPU runs the padded path eagerly
    for a, b in zip(dynamic, static):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5)
    for sid in ids:  # the K/V every row wrote, block by block
        s_d, s_s = cache_d.seqs[sid], cache_s.seqs[sid]
        assert s_d.length == s_s.length
        for bd, bs_ in zip(s_d.blocks, s_s.blocks):
            torch.testing.assert_close(cache_s.kv[:, bs_], cache_d.kv[:, bd], atol=1e-5, rtol=1e-5)
    # 3 rows pad to 4: decode steps over T = 1 and the verification over T = 4, each in a bucket of 4 rows
    shapes = {k[1:] for k in model.static.buckets}
    assert {(rows, T) for rows, T, _ in shapes} == {(4, 1), (4, 4)}
    assert all(blocks == bucket(blocks) for _, _, blocks in shapes)
    model.use_graphs(False)


NO_CXX = pytest.mark.skipif(shutil.which("g++") is None,
                            reason="torch.compile's CPU code needs a C++ compiler (g++)")


def check_compiled_steps(model, graphs_made: int, then: int, static: StaticSteps | None = None):
    """The compiled path's steps against the dynamic eager path's: logits, the K/V they write, and how many
    graphs torch.compile made (counted again after a new bucket: none more)."""
    from torch._dynamo.utils import counters
    dynamic, cache_d, ids = steps(model, graphs=False)
    graphs_before = counters["stats"]["unique_graphs"]
    compiled, cache_c, _ = steps(model, graphs=None, compile=True, static=static)
    assert counters["stats"]["unique_graphs"] - graphs_before == graphs_made
    for a, b in zip(dynamic, compiled):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    for sid in ids:
        for bd, bc in zip(cache_d.seqs[sid].blocks, cache_c.seqs[sid].blocks):
            torch.testing.assert_close(cache_c.kv[:, bc], cache_d.kv[:, bd], atol=1e-5, rtol=1e-5)
    model.forward_cached(cache_c, ids[:2], torch.arange(6) + 3, [3] * 2)  # a new bucket: 2 rows x 3 tokens
    model.forward_cached(cache_c, ids, torch.arange(6) + 3, [2] * 3)  # and 4 (3) rows x 2 tokens
    assert counters["stats"]["unique_graphs"] - graphs_before == then


@NO_CXX
def test_compiled_body_computes_what_eager_computes(model):
    """compile=True on the CPU (graphs left at None: compiling turns the static path on): the embedding and
    every layer as one compiled graph (model.compiled_body), the paged attention inside it the ssd operator
    that writes the pool in place. The steps compute what the dynamic eager path computes. The sizes a bucket
    sets (rows, tokens, block-table width) are symbolic from the first compile, so one graph serves every
    bucket of several rows; one row compiles apart (torch.compile specialises sizes of 1), once for one token
    and once for more. A bucket's first run is set-up, counted with the captures, not as decoding."""
    from torch._dynamo.utils import counters
    check_compiled_steps(model, graphs_made=1, then=1)
    assert model.static.body is not None and model.static.halves is None and not model.static.capture
    assert model.static.captures == len(model.static.buckets) and model.capture_seconds() > 0
    graphs_before = counters["stats"]["unique_graphs"]
    cache = model.new_cache(256, block_size=4)
    sid = cache.new_seq()
    model.prefill(cache, [sid], [PROMPTS[0]])
    for T in (1, 1, 3, 2, 4):  # a decode step, a verification of K + 1 tokens (K varies)
        model.forward_cached(cache, [sid], torch.arange(T) + 3, [T])
    assert counters["stats"]["unique_graphs"] - graphs_before == 2
    with pytest.raises(ValueError, match="leave graphs on"):
        model.use_graphs(False, compile=True)
    model.use_graphs(False)


@NO_CXX
def test_compiled_halves_compute_what_eager_computes(model):
    """CUDA's compiled form, run here without capture: each layer's halves around attention through
    torch.compile, the attention between them eager. One compiled graph per half serves every layer: the
    decode steps' 4 tokens compile one, the verification's 16 one more with the token count symbolic, which
    any other step reuses (automatic dynamic shapes), not a compile per bucket. Each model compiles its own
    (the fixture's second model, compiled after the first in this process, counts exactly as many graphs)."""
    from model import compiled_halves
    halves = StaticSteps(capture=False, halves=compiled_halves(f"{id(model):x}"))
    check_compiled_steps(model, graphs_made=4, then=4, static=halves)  # 2 x (pre_attention, post_attention)
    model.use_graphs(False)


@NO_CXX
def test_rows_are_independent_eager_bit_for_bit_compiled_to_rounding(tmp_path):
    """SD and SSD are exact only if a row's logits do not depend on the rows beside it: a decode step of one
    token, a verification of three and a batch of two sequences must give the same token the same logits.
    The eager path, with the CPU's quantized kernels, does so bit for bit. The compiled body does to float
    rounding, not bit for bit: Inductor fuses a 1-token step, a row of 3 and a batch into different loops,
    and the kernels' 16-bit inputs carry a last-bit difference on (a 1/32767 step of a block now and then).
    (With torch's int4 kernel, whose bfloat16 inputs absorbed such differences, it happened to be exact.)"""
    from quantize import QuantLinear
    path = make_checkpoint(tmp_path, "llama", **SHAPES)
    model = load_model(path, tokenizer=False, quant="int4")[0]
    if not any(m.packed is not None for m in model.modules() if isinstance(m, QuantLinear)):
        pytest.skip("the int4 kernels need AVX2 or AVX-512")
    prompt, tokens = [1, 5, 7, 9, 11, 13], [4, 40, 17]
    for compile in (False, True):
        model.use_graphs(True if compile else False, compile=compile)
        cache = model.new_cache(256, block_size=4)
        a, b = cache.new_seq(), cache.new_seq()
        model.prefill(cache, [a, b], [prompt, prompt])
        one = torch.cat([model.forward_cached(cache, [a], torch.tensor([t]), [1]) for t in tokens])
        cache.truncate(a, len(prompt))
        three = model.forward_cached(cache, [a], torch.tensor(tokens), [3])
        cache.truncate(a, len(prompt))
        batch = model.forward_cached(cache, [a, b], torch.tensor(tokens * 2), [3, 3])
        for rows in (three, batch[:3], batch[3:]):
            if compile:
                torch.testing.assert_close(rows, one, rtol=0, atol=1e-3)
                top2 = one.topk(2, -1).values
                clear = top2[:, 0] - top2[:, 1] > 2e-3  # the same greedy token, but at a near-tie
                assert torch.equal(rows.argmax(-1)[clear], one.argmax(-1)[clear])
            else:
                assert torch.equal(rows, one)
    model.use_graphs(False)


def test_padding_rows_touch_no_sequence(model):
    """The padding row of a 3-row step writes only into the pad block, which no sequence owns and which is
    never handed out; the rows' own K/V are unchanged by it (compared with the dynamic path above)."""
    _, cache, ids = steps(model, graphs=True)
    pad = cache.pad_block()
    assert all(pad not in cache.seqs[s].blocks for s in ids)
    assert pad not in cache.free_blocks and cache.refcount[pad] == 1
    before = cache.kv.clone()
    tok = torch.tensor([4, 5, 6])
    model.forward_cached(cache, ids, tok, [1] * 3)
    changed = (cache.kv != before).flatten(2).any(-1).any(0).nonzero().flatten().tolist()  # blocks
    last_blocks = {cache.seqs[s].blocks[(cache.seqs[s].length - 1) // cache.block_size] for s in ids}
    assert set(changed) <= last_blocks | {pad}
    model.use_graphs(False)


def test_buckets_are_reused(model):
    """Decoding 60 steps over 3 rows at block size 4 crosses 15 blocks, yet uses one bucket per power of two
    of the block count (so a GPU captures a handful of graphs, not one per step)."""
    model.use_graphs(True)
    cache = model.new_cache(2048, block_size=4)
    ids = [cache.new_seq() for _ in PROMPTS]
    tok = model.prefill(cache, ids, PROMPTS).argmax(-1)
    for _ in range(60):
        tok = model.forward_cached(cache, ids, tok, [1] * 3, last_only=True).argmax(-1)
    blocks = sorted(k[3] for k in model.static.buckets)
    longest = -(-max(cache.length(s) for s in ids) // 4)
    assert blocks == [8, 16, 32][:len(blocks)] and blocks[-1] == bucket(longest), blocks
    model.use_graphs(False)


def test_one_host_to_device_copy_per_static_step(model, monkeypatch):
    """As the dynamic path (tests/test_model.py): a static step's plan crosses in one copy, into its bucket's
    buffer, and no other host tensor is made."""
    import graphs
    model.use_graphs(True)
    cache = model.new_cache(256, block_size=4)
    ids = [cache.new_seq() for _ in PROMPTS]
    tok = model.prefill(cache, ids, PROMPTS).argmax(-1)
    copies, created = [], []
    real, real_tensor = graphs.to_device, torch.tensor
    monkeypatch.setattr(graphs, "to_device", lambda h, d, out=None: copies.append(out) or real(h, d, out))
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: created.append(1) or real_tensor(*a, **k))
    for _ in range(3):
        tok = model.forward_cached(cache, ids, tok, [1] * 3, last_only=True).argmax(-1)
    assert len(copies) == 3 and all(c is copies[0] for c in copies), copies  # one per step, the same buffer
    assert len(created) == 3
    model.use_graphs(False)


def test_uneven_or_long_steps_stay_dynamic(model):
    s = StaticSteps(capture=False)
    assert s.fits([1, 1, 1]) and s.fits([5, 5]) and s.fits([StaticSteps.MAX_T])
    assert not s.fits([2, 1]) and not s.fits([StaticSteps.MAX_T + 1])  # ragged (SSD feeding backups), prefill


def test_on_cuda_graphs_compile_by_default_and_not_without_graphs(model, monkeypatch):
    """The defaults on CUDA, decided here with the model's device read as CUDA: graphs of compiled layers;
    compile=False: graphs of the eager layers; graphs=False: neither (compiling needs the static path, so it
    is off, not an error, unless asked for)."""
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda")))
    model.use_graphs(None)
    assert model.static.capture and model.static.halves is not None
    model.use_graphs(None, compile=False)
    assert model.static.capture and model.static.halves is None
    model.use_graphs(False)
    assert model.static is None
    with pytest.raises(ValueError, match="leave graphs on"):
        model.use_graphs(False, compile=True)
    model.use_graphs(False)


def test_graphs_need_cuda_only_when_capturing(model):
    model.use_graphs(None)  # the default: graphs where CUDA is, the dynamic path on the CPU
    assert model.static is None
    model.use_graphs(None, compile=False)
    assert model.static is None
    model.use_graphs(True)
    assert model.static is not None and model.static.capture is False
    model.use_graphs(False)
    assert model.static is None


@pytest.mark.parametrize("mode,parallel", [("ar", True), ("sd", True), ("ssd", False), ("ssd", True)])
def test_generate_with_static_shapes_emits_the_same_tokens(mode, parallel, tmp_path_factory):
    """Greedy, batch 3, ragged prompts: the static-shape path (draft and target, both processes in SSD) emits
    exactly the dynamic path's tokens."""
    root = tmp_path_factory.mktemp("pair")
    target = make_checkpoint(root / "t", "llama", **SHAPES)
    draft = make_checkpoint(root / "d", "llama", seed=1, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=1, eos_token_id=None, max_position_embeddings=256)
    kw = dict(target=str(target), draft=str(draft), mode=mode, max_new_tokens=20, k=3, parallel=parallel)
    dynamic = generate(PROMPTS, graphs=False, **kw)
    static = generate(PROMPTS, graphs=True, **kw)
    assert static.tokens == dynamic.tokens


@NO_CXX
def test_compiled_steps_keep_sd_and_ssd_exact(tmp_path_factory):
    """Greedy, an int4 pair (an int4 kernel where the CPU has one): with every step of both models through
    the compiled body (run.py --compile), SD and two-process SSD emit the compiled AR's tokens. Compiling is
    most of this test's time on a CI machine, so it compiles little that is new: one prompt, one thread, and a
    draft of the target's shapes (other weights), so that the steps of both models run the graphs that
    test_rows_are_independent_eager_bit_for_bit_compiled_to_rounding compiled (one row of one token, of more, several rows)."""
    root = tmp_path_factory.mktemp("pair")
    target = make_checkpoint(root / "t", "llama", **SHAPES)
    draft = make_checkpoint(root / "d", "llama", seed=1, **SHAPES)
    kw = dict(target=str(target), draft=str(draft), max_new_tokens=20, k=3, quant="int4", draft_quant="int4",
              compile=True, target_threads=1, draft_threads=1)  # one thread, as the graphs were compiled for
    ar = generate(PROMPTS[2:], mode="ar", **kw)
    assert ar.stats["capture_seconds"] > 0  # the compiles, reported apart from decoding
    for mode in ("sd", "ssd"):
        res = generate(PROMPTS[2:], mode=mode, **kw)
        assert res.tokens == ar.tokens, mode
    # the speculator's busy time leaves its compiles out, as decode time does (they take seconds,
    # where this run decodes in a tenth of one: bench's busy% and Theorem 7's T_p read busy time).
    # The slack: the first round's pre-speculation runs beside the prefill.
    s = res.stats
    clocks = {k: s[k] for k in ("draft_busy_seconds", "draft_capture_seconds", "prefill_seconds",
                                "decode_seconds")}
    assert s["draft_capture_seconds"] > 0.5, clocks
    assert 0 < s["draft_busy_seconds"] <= s["prefill_seconds"] + s["decode_seconds"] + 0.2, clocks


def test_compiled_sd_after_compiled_ar_on_one_model():
    """The tiny pair, one loaded target, compiled steps: AR, then SD on the same model object (as
    bench.py runs them) must emit AR's tokens. SD needs a bigger pool than AR: before the pool's
    size was held static in the compiled graph (graphs.symbolic_sizes), the second size made it
    symbolic and that graph lost its writes into the pool."""
    target = load_model("tiny", tokenizer=False)[0]
    prompts = [[1, 400, 52, 9, 77], [1, 12, 13, 14, 15, 16, 17, 18]]
    kw = dict(target=target, draft="tiny-draft", max_new_tokens=12, temperature=0.0,
              ignore_eos=True, compile=True, target_threads=1)
    ar = generate(prompts, mode="ar", **kw)
    assert generate(prompts, mode="sd", k=3, **kw).tokens == ar.tokens


def test_a_model_decoded_again_reuses_its_pool_and_its_buckets(model):
    """A model loaded once and decoded with again (generate(target=model), a bench sweep): the Verifier's
    new_cache(reuse=True) hands back the same pool, emptied, and use_graphs keeps the buckets, so a GPU
    replays the graphs it captured before instead of capturing again; the logits are those of a fresh cache.
    A request the pool cannot hold replaces it, and the old pool's buckets are dropped with it."""
    runs = []
    for reuse in (True, True, False):
        model.use_graphs(True)
        before = dict(model.static.buckets)
        cache = model.new_cache(1024, block_size=4, reuse=reuse)
        ids = [cache.new_seq() for _ in PROMPTS]
        logits = [model.prefill(cache, ids, PROMPTS)]
        for _ in range(5):
            logits.append(model.forward_cached(cache, ids, logits[-1].argmax(-1), [1] * 3, last_only=True))
        runs.append((cache, before, dict(model.static.buckets), logits))
    (pool, _, after_1, logits_1), (again, before_2, after_2, logits_2), (fresh, _, _, logits_3) = runs
    assert again is pool and fresh is not pool and model.kv_pool is pool
    assert before_2 == after_1 and after_2 == after_1  # no bucket made (on a GPU: no graph captured)
    assert len(pool.seqs) == 3  # the first run's sequences were freed when the pool came back
    for a, b, c in zip(logits_1, logits_2, logits_3):
        torch.testing.assert_close(b, a, atol=0, rtol=0)
        torch.testing.assert_close(c, a, atol=2e-5, rtol=1e-5)
    model.use_graphs(True)  # the next call: the buckets of the fresh cache (not reused) are dropped
    assert model.static.buckets == after_1
    bigger = model.new_cache(4096, block_size=4, reuse=True)
    assert bigger is not pool and model.kv_pool is bigger
    assert all(bk.cache is not pool for bk in model.static.buckets.values())
    model.use_graphs(False)
