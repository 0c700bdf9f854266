"""model.py against transformers, and its paged KV cache against its own full forward.

1. The full forward equals transformers' logits (float32, 1e-4) for every architecture of
   config.ARCHS (conftest.KINDS): Llama with GQA, Llama with tied embeddings and llama3 RoPE scaling
   past the original context, Qwen3 with q/k norm and an explicit head_dim, Qwen2 with q/k/v
   biases; sharded checkpoints, and legacy config.json files (rope_theta / rope_scaling keys).
2. Cached decoding (prefill, single tokens, K+1-token steps, any block size, ragged batches,
   last_only) equals the full forward.
3. Rollback (truncate) and fork with copy on write keep every sequence's logits equal to a fresh
   forward of its own tokens; the allocator returns every block; exhaustion names kv_tokens.
4. The loader refuses bad checkpoints with one-line errors naming the problem.
(cpu_linear.py's product forms are tests/test_cpu_linear.py's.)
All checkpoints are tiny random ones written by conftest.make_checkpoint.
"""
import json
from dataclasses import replace

import pytest
import torch
from conftest import KINDS, hf_model, make_checkpoint, needs_cpu_kernels, one_line
from safetensors.torch import load_file, save_file

from checkpoint import load_model
import config
import model
from config import ModelConfig
from kv_cache import PagedKVCache, paged_attention, paged_attention_cpu
from model import rope_inv_freq
from scripts.gpu_check import Allocations

TOL = 1e-4
V = 100  # vocab of the tiny checkpoints


def max_diff(a, b):
    return (a - b).abs().max().item()


def rand_tokens(n, seed):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """One checkpoint directory per kind, shared by the tests of this module (read-only)."""
    return {kind: make_checkpoint(tmp_path_factory.mktemp(kind), kind) for kind in KINDS}


@pytest.fixture(scope="module")
def llama(ckpts):
    return load_model(ckpts["llama"])[0]


@pytest.fixture(scope="module")
def qwen(ckpts):
    return load_model(ckpts["qwen3"])[0]


# --------------------------------------------------------------------------------------------------
# 1. Full forward vs transformers

def hf_logits(path, tokens):
    with torch.no_grad():
        return hf_model(path)(tokens).logits.float()


def test_every_architecture_has_a_test_kind():
    assert {KINDS[kind]["model_type"] for kind in KINDS} == set(config.ARCHS)


@pytest.mark.parametrize("kind", list(KINDS))
def test_full_forward_matches_transformers(ckpts, kind):
    path = ckpts[kind]
    # [2, 64]: past the original 32 of llama3
    tokens = torch.stack([rand_tokens(64, 1), rand_tokens(64, 2)])
    model, _ = load_model(path)
    with torch.no_grad():
        ours = model(tokens)
    ref = hf_logits(path, tokens)
    assert ours.shape == ref.shape == (2, 64, V) and ours.dtype == torch.float32
    assert max_diff(ours, ref) < TOL
    assert ref.std() > 0.3  # logits of order 1, so 1e-4 is a real bound
    cfg = model.config
    if kind == "llama":
        assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    if kind == "qwen3":
        assert cfg.arch.qk_norm and cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size
    if kind == "qwen2":  # the biases are loaded, and they matter
        bias = model.model.layers[0].self_attn.qkv_proj.bias
        assert bias is not None and bias.abs().max() > 0.1
        assert model.model.layers[0].self_attn.o_proj.bias is None
    if kind == "llama_tied_rope":
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_llama3_scaling_covers_all_three_bands(ckpts):
    """The rope_scaling checkpoint exercises high (kept), medium (smoothed) and low (divided)
    frequencies, and ignoring the scaling changes the logits past the original context (so the
    test above can fail)."""
    model, _ = load_model(ckpts["llama_tied_rope"])
    cfg = model.config
    plain = ModelConfig(**{**cfg.__dict__, "rope_scaling": None})
    ratio = rope_inv_freq(cfg) / rope_inv_freq(plain)
    factor = cfg.rope_scaling["factor"]
    assert (ratio == 1).any() and (ratio == 1 / factor).any()
    assert ((ratio > 1 / factor) & (ratio < 1)).any()
    tokens = rand_tokens(64, 3)[None]
    ref = hf_logits(ckpts["llama_tied_rope"], tokens)
    model.inv_freq = rope_inv_freq(plain)  # negative control: no scaling
    with torch.no_grad():
        wrong = model(tokens)
    assert max_diff(wrong[:, 40:], ref[:, 40:]) > 100 * TOL


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2"])
def test_sharded_checkpoint(tmp_path, kind):
    path = make_checkpoint(tmp_path, kind, sharded=True)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3 and not (path / "model.safetensors").exists()
    tokens = rand_tokens(20, 4)[None]
    model, _ = load_model(path)
    with torch.no_grad():
        assert max_diff(model(tokens), hf_logits(path, tokens)) < TOL


def to_legacy(cfg: dict) -> dict:
    """transformers >= 5 "rope_parameters" -> released checkpoints' top-level rope_theta +
    rope_scaling."""
    cfg = dict(cfg)
    rope = dict(cfg.pop("rope_parameters", None) or {})
    if rope:
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    assert "rope_theta" in cfg
    return cfg


@pytest.mark.parametrize("kind", ["llama_tied_rope", "qwen3"])
def test_legacy_config_format(tmp_path, kind):
    path = make_checkpoint(tmp_path, kind)
    tokens = rand_tokens(64, 5)[None]
    ref = hf_logits(path, tokens)
    cfg_file = path / "config.json"
    cfg_file.write_text(json.dumps(to_legacy(json.loads(cfg_file.read_text()))))
    model, _ = load_model(path)
    assert model.config.rope_theta == KIND_THETA[kind]
    assert (model.config.rope_scaling is not None) == (kind == "llama_tied_rope")
    with torch.no_grad():
        assert max_diff(model(tokens), ref) < TOL


KIND_THETA = {"llama_tied_rope": 10000.0, "qwen3": 1000000.0}


# --------------------------------------------------------------------------------------------------
# 2. Cached decoding

def run_steps(model, cache, sid, tokens, steps):
    """Feed `tokens` to one sequence in chunks of `steps`; -> logits of every token
    [len(tokens), V]."""
    out, i = [], 0
    for n in steps:
        out.append(model.forward_cached(cache, [sid], tokens[i:i + n], [n]))
        i += n
    assert i == len(tokens)
    return torch.cat(out)


def full(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(tokens)[None])[0]


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "sdpa"])
@pytest.mark.parametrize("block_size", [1, 2, 3, 4])
@pytest.mark.parametrize("which", ["llama", "qwen"])
def test_cached_decoding_matches_full_forward(request, which, block_size, kernel):
    """Attention by cpu_kernels.cpp's op where it runs (a float32 pool on a CPU), and by the
    reference (gather + SDPA, as on a GPU)."""
    model = request.getfixturevalue(which)
    tokens = rand_tokens(20, 6)
    steps = [5, 1, 1, 1, 3, 3, 4, 1, 1]  # prefill, single tokens, K+1-token verifies, across blocks
    cache = model.new_cache(64, block_size)
    if kernel != cache.cpu_kernel:
        if kernel:
            pytest.skip("cpu_kernels.cpp does not run here")
        cache.cpu_kernel = False
    with torch.no_grad():
        cached = run_steps(model, cache, cache.new_seq(), tokens, steps)
    assert cached.shape == (20, V) and cached.dtype == torch.float32
    assert max_diff(cached, full(model, tokens)) < TOL


def test_ragged_batch_equals_one_by_one(llama):
    """Three sequences with different counts in each call equal the same sequences run alone."""
    seqs = [rand_tokens(12, 10 + i) for i in range(3)]
    # per call, the count of each sequence
    rounds = [[5, 2, 7], [1, 3, 2], [3, 1, 1], [1, 4, 1], [2, 2, 1]]
    cache = llama.new_cache(64, 3)
    sids = [cache.new_seq() for _ in seqs]
    pos, batched = [0, 0, 0], [[], [], []]
    with torch.no_grad():
        for counts in rounds:
            toks = torch.cat([s[p:p + c] for s, p, c in zip(seqs, pos, counts)])
            out = llama.forward_cached(cache, sids, toks, counts)
            assert out.shape == (sum(counts), V)
            for i, part in enumerate(out.split(counts)):
                batched[i].append(part)
            pos = [p + c for p, c in zip(pos, counts)]
        for i, s in enumerate(seqs):
            n = pos[i]
            alone_cache = llama.new_cache(64, 3)
            alone = run_steps(llama, alone_cache, alone_cache.new_seq(), s[:n],
                              [c[i] for c in rounds])
            got = torch.cat(batched[i])
            assert max_diff(got, alone) < TOL
            assert max_diff(got, full(llama, s[:n])) < TOL
            assert cache.length(sids[i]) == n


def test_last_only(llama):
    seqs = [rand_tokens(n, 20 + n) for n in (4, 1, 6)]
    counts = [len(s) for s in seqs]
    cache = llama.new_cache(64, 4)
    sids = [cache.new_seq() for _ in seqs]
    with torch.no_grad():
        last = llama.forward_cached(cache, sids, torch.cat(seqs), counts, last_only=True)
        assert last.shape == (3, V)
        for i, s in enumerate(seqs):
            assert max_diff(last[i], full(llama, s)[-1]) < TOL
        # and on a decode round after the prefill
        nxt = [rand_tokens(c, 30 + c) for c in (2, 3, 1)]
        last = llama.forward_cached(cache, sids, torch.cat(nxt), [2, 3, 1], last_only=True)
        for i in range(3):
            assert max_diff(last[i], full(llama, torch.cat([seqs[i], nxt[i]]))[-1]) < TOL


def test_one_host_to_device_copy_per_forward(llama, monkeypatch):
    """A forward's metadata (slots, positions, block table, query index, last tokens, padded
    positions) is built on the host and crosses to the device in one copy through
    devices.to_device; no other host tensor is made during the forward (on a GPU each would be a
    copy, and most a sync). Counted on the CPU by logging tensors created from Python data."""
    import kv_cache
    copies, created = [], []
    real = kv_cache.to_device
    monkeypatch.setattr(kv_cache, "to_device", lambda h, d: copies.append(h.numel()) or real(h, d))
    cache = llama.new_cache(64, 4)
    sids = [cache.new_seq() for _ in range(3)]
    tokens = torch.cat([rand_tokens(n, 40 + n) for n in (4, 1, 6)])
    real_tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: created.append(1) or real_tensor(*a, **k))
    with torch.no_grad():
        llama.forward_cached(cache, sids, tokens, [4, 1, 6], last_only=True)
        llama.forward_cached(cache, sids, tokens[:5], [2, 2, 1], last_only=True)
    assert len(copies) == 2, copies          # one per forward
    assert len(created) == 2, created        # only the packed metadata, once per forward
    # [slots 11 | positions 11 | query_index 11 | last 3 | table 3 x 2 blocks | qpos 3 x 6]
    assert copies[0] == 3 * 11 + 3 + 3 * 2 + 3 * 6


@needs_cpu_kernels
@pytest.mark.parametrize("nh,nkv,hd,block_size",
                         [(9, 3, 64, 16), (4, 4, 20, 3), (8, 2, 16, 1), (4, 2, 136, 16)])
def test_cpu_attention_kernel_equals_the_reference(nh, nkv, hd, block_size):
    """kv_cache.paged_attention_cpu (cpu_kernels.cpp) against paged_attention (gather + SDPA): a
    ragged batch over three sequences, one a fork sharing another's blocks, GQA groups of 3, 1
    and 4, a head size that is no multiple of 8 (the vector loop's tail) and one of over 64 (the
    outputs in registers 64 at a time), blocks of 16 keys (scores 8 keys at a time) and of fewer
    than 8 (one by one). Equal to float rounding,
    and the same K/V written into the pool. Each token's output is bit for bit the same alone, in
    the batch and on 2 threads. A negative control: attending one key fewer moves it 100x more."""
    from types import SimpleNamespace
    cfg = SimpleNamespace(num_hidden_layers=1, num_attention_heads=nh, num_key_value_heads=nkv,
                          head_dim=hd)
    g = torch.Generator().manual_seed(nh + hd)
    caches = [PagedKVCache(cfg, 256, block_size) for _ in range(2)]  # reference, kernel
    caches[0].cpu_kernel = False  # its plans carry SDPA's mask (the kernel's need none)
    for cache in caches:
        a, b = cache.new_seq(), cache.new_seq()
        cache.append(a, 37), cache.append(b, 5)
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=g.manual_seed(1)))
        cache.fork(a, 30)  # c: a's first 30 positions, sharing its blocks
    counts = [3, 1, 2]
    q, k, v = (torch.randn(6, n, hd, generator=g) for n in (nh, nkv, nkv))
    with torch.no_grad():
        want = paged_attention(q, k, v, caches[0].kv[0], caches[0].prepare([0, 1, 2], counts))
        meta = caches[1].prepare([0, 1, 2], counts)
        got = paged_attention_cpu(q, k, v, caches[1].kv[0], meta)
    assert got.shape == want.shape and max_diff(got, want) < 1e-5
    assert torch.equal(caches[1].kv, caches[0].kv)  # the new tokens' K and V in the same slots
    # the kernel's plan carries no SDPA mask, and the SDPA path refuses it rather than attend
    # without one
    assert meta.mask is None and caches[0].prepare([0], [1]).mask is not None
    with pytest.raises(ValueError, match="made for the CPU kernel"):
        paged_attention(q, k, v, caches[1].kv[0], meta)
    for i in range(6):  # token i alone (its K/V already written: writing them again is the same)
        row = lambda t: t[i:i + 1]
        alone = replace(meta, slots=row(meta.slots), rows=row(meta.rows),
                        positions=row(meta.positions))
        assert torch.equal(paged_attention_cpu(row(q), row(k), row(v), caches[1].kv[0], alone),
                           got[i:i + 1])
    torch.set_num_threads(2)
    try:
        assert torch.equal(paged_attention_cpu(q, k, v, caches[1].kv[0], meta), got)
    finally:
        torch.set_num_threads(1)
    # a prefill's pieces attend by the reference, the decode loops' forwards by the kernel
    assert caches[1].prepare([0], [1], prompt=True).cpu_kernel is False and meta.cpu_kernel
    shorter = replace(meta, positions=meta.positions - 1)
    off = paged_attention_cpu(q, k, v, caches[1].kv[0], shorter)
    assert max_diff(off, want) > 100 * max_diff(got, want)


def test_chunked_prefill_equals_one_forward(llama):
    """Prompts prefilled in pieces of 8 tokens (two rows whose pieces share forwards, one that waits) give
    the same last-token logits and the same cache as one forward over everything: the next step agrees."""
    prompts = [rand_tokens(n, 70 + n).tolist() for n in (37, 5, 20)]
    out = []
    for chunk in (8, 1000):
        cache = llama.new_cache(128, 4)
        sids = [cache.new_seq() for _ in prompts]
        with torch.no_grad():
            first = llama.prefill(cache, sids, prompts, chunk=chunk)
            nxt = llama.forward_cached(cache, sids, [3, 4, 5], [1, 1, 1], last_only=True)
        out.append((first, nxt, [cache.length(s) for s in sids]))
    (a, a2, la), (b, b2, lb) = out
    assert a.shape == (3, V) and la == lb == [38, 6, 21]
    assert max_diff(a, b) < TOL and max_diff(a2, b2) < TOL


def test_long_prefill_never_builds_a_prompt_by_prompt_tensor(llama):
    """Issue 13, item 6: a long prompt is prefilled in chunks, so no forward allocates anything of the size of
    a [prompt x prompt] float32 matrix (an attention mask or score matrix); one forward over the whole prompt
    does (the negative control)."""
    L = 200
    square = L * L * 4
    largest = {}
    for chunk in (32, L):
        cache = llama.new_cache(L + 8, 4)
        sid = cache.new_seq()
        with torch.no_grad(), Allocations() as allocs:
            llama.prefill(cache, [sid], [rand_tokens(L, 9).tolist()], chunk=chunk)
        largest[chunk] = allocs.largest
    assert largest[32] < square / 2 <= square <= largest[L], (largest, square)


# --------------------------------------------------------------------------------------------------
# 3. Rollback, fork, copy on write, the allocator

def step(model, cache, sid, tokens):
    with torch.no_grad():
        return model.forward_cached(cache, [sid], torch.as_tensor(tokens), [len(tokens)])


def check(model, cache, sid, history, new):
    """Append `new` to sequence sid (whose tokens so far are `history`) and compare with a fresh
    forward."""
    got = step(model, cache, sid, new)
    ref = full(model, torch.cat([history, new]))[len(history):]
    assert max_diff(got, ref) < TOL
    return torch.cat([history, new])


def all_returned(cache):
    return (all(r == 0 for r in cache.refcount) and cache.num_free_blocks() == cache.num_blocks
            and sorted(cache.free_blocks) == list(range(cache.num_blocks)))


@pytest.mark.parametrize("length", [8, 6, 0])  # a block boundary, mid-block, everything
def test_truncate_then_decode_new_tokens(llama, length):
    bs = 4
    a = rand_tokens(10, 40)
    cache = llama.new_cache(64, bs)
    sid = cache.new_seq()
    step(llama, cache, sid, a)
    cache.truncate(sid, length)
    assert cache.length(sid) == length and len(cache.seqs[sid].blocks) == -(-length // bs)
    assert cache.num_free_blocks() == cache.num_blocks - -(-length // bs)
    new = (a[length:length + 3] + 1) % V  # different tokens from the ones rolled back
    kept = check(llama, cache, sid, a[:length], new)
    kept = check(llama, cache, sid, kept, rand_tokens(1, 41))  # and keep decoding
    cache.free(sid)
    assert all_returned(cache)


def test_truncate_twice_and_regrow(llama):
    cache = llama.new_cache(64, 3)
    sid = cache.new_seq()
    a = rand_tokens(11, 42)
    step(llama, cache, sid, a)
    cache.truncate(sid, 7)
    h = check(llama, cache, sid, a[:7], rand_tokens(4, 43))  # length 11 again, different tokens
    cache.truncate(sid, 5)
    cache.truncate(sid, 5)  # a no-op
    check(llama, cache, sid, h[:5], rand_tokens(2, 44))
    with pytest.raises(ValueError, match="truncate length"):
        cache.truncate(sid, 8)


def test_fork_isolates_parent_and_child(llama):
    bs = 4
    cache = llama.new_cache(96, bs)
    parent = cache.new_seq()
    a = rand_tokens(10, 50)
    step(llama, cache, parent, a)
    mid = cache.fork(parent, 6)      # mid-block: blocks 0 shared, the partial block 1 copied
    edge = cache.fork(parent, 8)     # block boundary: blocks 0 and 1 shared
    whole = cache.fork(parent, 10)   # the whole sequence
    empty = cache.fork(parent, 0)
    assert cache.seqs[edge].blocks == cache.seqs[parent].blocks[:2]
    assert cache.seqs[mid].blocks[0] == cache.seqs[parent].blocks[0]
    assert cache.seqs[mid].blocks[1] != cache.seqs[parent].blocks[1]
    assert cache.refcount[cache.seqs[parent].blocks[0]] == 4  # parent, mid, edge, whole
    # the forks write first (into what they share with the parent), then the parent continues
    h_mid = check(llama, cache, mid, a[:6], rand_tokens(3, 51))
    h_edge = check(llama, cache, edge, a[:8], rand_tokens(5, 52))
    h_whole = check(llama, cache, whole, a, rand_tokens(2, 53))
    h_empty = check(llama, cache, empty, a[:0], rand_tokens(4, 54))
    h_par = check(llama, cache, parent, a, rand_tokens(3, 55))
    # a ragged round over all of them at once
    news = [rand_tokens(n, 60 + n) for n in (1, 2, 3, 1, 2)]
    sids, hists = [parent, mid, edge, whole, empty], [h_par, h_mid, h_edge, h_whole, h_empty]
    with torch.no_grad():
        out = llama.forward_cached(cache, sids, torch.cat(news), [len(n) for n in news])
    for got, h, n in zip(out.split([len(n) for n in news]), hists, news):
        assert max_diff(got, full(llama, torch.cat([h, n]))[len(h):]) < TOL
    for s in sids:
        cache.free(s)
    assert all_returned(cache)


def test_fork_then_truncate_parent_mid_block_copies_on_write(llama):
    """Truncating the parent into a block it shares with a fork, then appending, must copy that
    block."""
    bs = 4
    cache = llama.new_cache(64, bs)
    parent = cache.new_seq()
    a = rand_tokens(10, 70)
    step(llama, cache, parent, a)
    child = cache.fork(parent, 8)  # shares blocks 0 and 1
    shared = cache.seqs[parent].blocks[1]
    cache.truncate(parent, 5)      # parent's last block (1) is now partial and still shared
    assert cache.seqs[parent].blocks[1] == shared and cache.refcount[shared] == 2
    h_par = check(llama, cache, parent, a[:5], (a[5:8] + 7) % V)  # writes slots 5..7 of block 1
    assert cache.seqs[parent].blocks[1] != shared and cache.refcount[shared] == 1  # copied
    assert cache.seqs[child].blocks[1] == shared
    h_child = check(llama, cache, child, a[:8], rand_tokens(3, 71))  # the child still sees a[5:8]
    h_par = check(llama, cache, parent, h_par, rand_tokens(2, 72))
    # a fork of the fork, truncated the same way
    grand = cache.fork(child, 11)
    cache.truncate(child, 9)
    check(llama, cache, child, h_child[:9], rand_tokens(2, 73))
    check(llama, cache, grand, h_child, rand_tokens(2, 74))
    for s in (parent, child, grand):
        cache.free(s)
    assert all_returned(cache)


def test_exhaustion_names_kv_tokens(llama):
    cache = llama.new_cache(8, 4)  # 2 blocks
    sid = cache.new_seq()
    step(llama, cache, sid, rand_tokens(8, 80))
    with pytest.raises(RuntimeError) as e:
        step(llama, cache, sid, rand_tokens(1, 81))
    assert "kv_tokens" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(RuntimeError, match="kv_tokens"):  # forking a partial block needs a block
        cache.fork(sid, 7)


def cache_state(cache):
    return (list(cache.free_blocks), list(cache.refcount),
            {sid: (list(s.blocks), s.length) for sid, s in cache.seqs.items()})


def test_too_few_free_blocks_raises_before_touching_anything(llama):
    """Some blocks free but fewer than a forward needs: nothing is appended, no block is taken."""
    cache = llama.new_cache(24, 4)  # 6 blocks
    a, b = cache.new_seq(), cache.new_seq()
    step(llama, cache, a, rand_tokens(8, 82))  # 2 blocks, full
    step(llama, cache, b, rand_tokens(5, 83))  # 2 blocks, the second holds 1 token
    assert cache.num_free_blocks() == 2
    before = cache_state(cache)
    # a needs 2 new blocks (free: 2), b needs 1 more: short by one, and a alone would fit
    with pytest.raises(RuntimeError, match="3 more blocks.*2 of 6 free.*kv_tokens") as e:
        cache.prepare([a, b], [8, 4])
    assert "\n" not in str(e.value)
    assert cache_state(cache) == before
    cache.prepare([a, b], [8, 3])  # exactly the 2 free blocks: fits, and the cache is full
    assert cache.num_free_blocks() == 0


def test_fork_copy_on_write_takes_the_last_block(llama):
    cache = llama.new_cache(16, 4)  # 4 blocks
    sid = cache.new_seq()
    step(llama, cache, sid, rand_tokens(10, 84))  # 3 blocks, 1 free
    child = cache.fork(sid, 6)  # shares block 0, copies the partial block 1 into the last free one
    assert cache.num_free_blocks() == 0
    before = cache_state(cache)
    with pytest.raises(RuntimeError, match="1 more blocks.*0 of 4 free"):
        cache.fork(sid, 7)  # needs a copy too: refused without raising any refcount
    assert cache_state(cache) == before
    edge = cache.fork(sid, 8)  # a block boundary needs no new block
    cache.truncate(sid, 6)     # sid's block 1 is now partial and shared with edge; block 2 is freed
    other = cache.new_seq()
    cache.append(other, 1)     # takes it: the cache is full again
    before = cache_state(cache)
    with pytest.raises(RuntimeError, match="kv_tokens"):  # an append's copy on write needs a block
        cache.append(sid, 1)
    assert cache_state(cache) == before
    for s in (sid, child, edge, other):
        cache.free(s)
    assert all_returned(cache)


# --------------------------------------------------------------------------------------------------
# 4. Loader errors and defaults

def rewrite_weights(path, edit):
    f = path / "model.safetensors"
    w = load_file(f)
    edit(w)
    save_file(w, f, metadata={"format": "pt"})


def rewrite_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_tensor(make_ckpt):
    path = make_ckpt("llama")
    rewrite_weights(path, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError) as e:
        load_model(path)
    one_line(e, "missing", "model.layers.1.mlp.up_proj.weight")


def test_unexpected_tensor(make_ckpt):
    path = make_ckpt("qwen3")
    rewrite_weights(path, lambda w: w.update({"model.layers.0.self_attn.extra.weight":
                                              torch.zeros(3)}))
    with pytest.raises(ValueError) as e:
        load_model(path)
    one_line(e, "unexpected", "model.layers.0.self_attn.extra.weight")


def test_wrong_shape(make_ckpt):
    path = make_ckpt("llama")
    rewrite_config(path, intermediate_size=96)  # the checkpoint's MLP is 128 wide
    with pytest.raises(ValueError) as e:
        load_model(path)
    one_line(e, "shape", "mlp", "128", "96")


def test_missing_shard(make_ckpt):
    path = make_ckpt("llama", sharded=True)
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError) as e:
        load_model(path)
    one_line(e, shard.name)


def test_a_damaged_shard_is_one_line(make_ckpt, capsys):
    """A download cut short: one line naming the file, from load_model and from the CLI (no traceback)."""
    import run
    path = make_ckpt("llama")
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ValueError) as e:
        load_model(path)
    one_line(e, str(f), "not a readable safetensors file", "again")
    capsys.readouterr()
    assert run.main(["--mode", "ar", "--target", str(path), "--max-new-tokens", "2", "--prompt", "x"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "not a readable safetensors file" in err and "Traceback" not in err


@pytest.mark.parametrize("changes,needle", [
    (dict(model_type="gpt2"), "gpt2"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}), "yarn"),
    (dict(use_sliding_window=True), "sliding-window"),
    (dict(layer_types=["sliding_attention"]), "sliding-window"),
])
def test_unsupported_config(make_ckpt, changes, needle):
    path = make_ckpt("llama", num_hidden_layers=1)
    rewrite_config(path, **changes)
    with pytest.raises(ValueError) as e:
        load_model(path)
    one_line(e, needle)


def test_bad_paths_and_names(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load_model(tmp_path / "does-not-exist")
    one_line(e, "does-not-exist")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError) as e:
        load_model(tmp_path / "empty")
    one_line(e, "config.json")
    with pytest.raises(FileNotFoundError) as e:
        load_model("llama-9000b")  # neither an alias, a directory nor an org/name hub id
    one_line(e, "llama-9000b", "llama-8b")  # names the problem and lists the known aliases


def test_defaults_dtype_tokenizer_and_device(ckpts):
    model, tok = load_model(ckpts["llama"], dtype=None)
    assert tok is None  # the tiny checkpoints have no tokenizer files
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.device.type == "cpu" and not any(p.requires_grad for p in model.parameters())
    model16, _ = load_model(ckpts["llama_tied_rope"], dtype=torch.bfloat16)
    assert {p.dtype for p in model16.parameters()} == {torch.bfloat16}
    assert model16.lm_head.weight is model16.model.embed_tokens.weight
    if not torch.cuda.is_available():
        with pytest.raises(ValueError) as e:
            load_model(ckpts["llama"], device="cuda:7")
        one_line(e, "cuda:7")


# --------------------------------------------------------------------------------------------------
# 6. A draft with its own vocabulary (ModelConfig.token_ids): rows of the target's token ids

OWN = [2, 5, 7, 11, 13, 40, 41, 42, 99]  # the target token behind each row but the last


@pytest.fixture(scope="module")
def own_vocab(tmp_path_factory):
    """A draft of len(OWN) + 1 rows over the V-token vocabulary of the tiny checkpoints."""
    return make_checkpoint(tmp_path_factory.mktemp("own"), "llama", vocab_size=len(OWN) + 1,
                           target_token_ids=OWN, target_vocab_size=V)


def test_a_draft_of_its_own_vocabulary_reads_and_writes_the_targets_ids(own_vocab):
    engine = load_model(own_vocab)[0]
    assert engine.config.vocab_size == V and engine.config.rows == len(OWN) + 1
    x = torch.tensor([[2, 99, 3, 40, 60, 7]])  # 3 and 60 are outside OWN
    logits = engine(x)  # [1, 6, V]
    with torch.no_grad():  # transformers' own model, in its rows: ids in as rows, logits per row
        rows = torch.tensor([[0, 8, 9, 5, 9, 2]])
        own = raw_hf(own_vocab)(rows).logits  # [1, 6, rows]
    outside = torch.ones(V, dtype=torch.bool)
    outside[OWN] = False
    assert torch.isneginf(logits[..., outside]).all()  # never written: probability 0
    torch.testing.assert_close(logits[..., OWN], own[..., :-1], atol=TOL, rtol=TOL)
    # every token outside reads the last row: 3 and 60 are the same input
    torch.testing.assert_close(engine(torch.tensor([[2, 99, 60, 40, 3, 7]])), logits)
    # and transformers made to speak the target's ids (checkpoint.hf_over_target_vocab) agrees
    torch.testing.assert_close(hf_logits(own_vocab, x), logits, atol=TOL, rtol=TOL)
    # the cached path: a prefill then single tokens equal the full forward
    cache = engine.new_cache(64)
    sid = cache.new_seq()
    first = engine.prefill(cache, [sid], [x[0, :3].tolist()])
    steps = [engine.forward_cached(cache, [sid], [t], [1]) for t in x[0, 3:].tolist()]
    torch.testing.assert_close(torch.cat([first] + steps), logits[0, 2:], atol=TOL, rtol=TOL)


def raw_hf(path):
    """transformers' model of a checkpoint as stored (a draft of its own vocabulary: in its rows)."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("changes,needle", [
    (dict(target_token_ids=OWN[:-1]), "vocab_size - 1 = 9"),
    (dict(target_token_ids=OWN[:-1] + [2]), "distinct"),
    (dict(target_token_ids=OWN[:-1] + [V]), "target_vocab_size=100"),
])
def test_a_bad_vocabulary_map_is_one_line(make_ckpt, changes, needle):
    path = make_ckpt("llama", num_hidden_layers=1, vocab_size=len(OWN) + 1,
                     target_token_ids=OWN, target_vocab_size=V)
    rewrite_config(path, **changes)
    with pytest.raises(ValueError) as e:
        load_model(path)
    one_line(e, needle, "re-export the draft")


def test_a_draft_of_its_own_vocabulary_refuses_tensor_parallelism(own_vocab):
    cfg = load_model(own_vocab)[0].config
    with pytest.raises(ValueError) as e:
        model.Transformer(cfg, model.TP(rank=0, world=2))
    one_line(e, "own vocabulary", "one device")
