"""Tensor parallelism (issue 7), on the CPU with gloo: TP = 2 computes what TP = 1 computes.

1. Logits: two spawned gloo ranks load the tiny Llama (GQA) and Qwen3 (q/k norm, head_dim != hidden/heads)
   checkpoints, each reading only its slices; their full forward and their cached decoding (ragged prefill,
   single tokens, a K+1 step, a rollback) equal the TP = 1 model's within 1e-5, and both ranks hold the very
   same logits (the lockstep verifier relies on that).
2. generate() with target_devices=["cpu", "cpu"] emits the TP = 1 greedy tokens in ar, sd and ssd (parallel
   and serial), and the same sampled tokens at temperature > 0 (q travels to the worker).
3. A split that does not divide the heads is refused with one line naming the numbers and the valid sizes;
   a worker rank that dies makes the next call fail and close() name the rank, leaving no process behind.
4. The call protocol is generic: TPVerifier.call forwards any Verifier method, tensors travel by
   themselves (not pickled), an empty finish sends nothing, and close() ends the workers with "stop".
"""
import os
import shutil
import signal
import time

import pytest

import torch
import torch.multiprocessing as mp
from conftest import make_checkpoint
from safetensors.torch import load_file, save_file

import tp
from checkpoint import checkpoint_params, load_model
from model import TP, Transformer
from run import generate
from tp import TensorArg, TPVerifier, TPWorkers, broadcast_header, tp_init, tp_store
from verify import Verifier

TOL = 1e-5
V = 100  # vocab of the tiny checkpoints


TP_KINDS = ("llama", "qwen3", "qwen2")  # GQA; q/k norms; q/k/v biases (split with their rows)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {kind: make_checkpoint(tmp_path_factory.mktemp(kind), kind) for kind in TP_KINDS}


# ----------------------------------------------------------------------------------------------------
# 1. Logits: TP = 2 vs TP = 1

def logits_of(model):
    """Full-forward logits [2, 24, V] and cached-decoding logits [N, V] for fixed tokens."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (2, 24), generator=g)
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(256, block_size=4)
        a, b = cache.new_seq(), cache.new_seq()
        steps = [model.forward_cached(cache, [a, b], torch.cat([tokens[0, :7], tokens[1, :12]]), [7, 12])]  # ragged prefill
        for i in range(3):  # single-token decode steps
            steps.append(model.forward_cached(cache, [a, b], [tokens[0, 7 + i], tokens[1, 12 + i]], [1, 1]))
        steps.append(model.forward_cached(cache, [a, b], torch.cat([tokens[0, 10:14], tokens[1, 15:19]]), [4, 4]))
        cache.truncate(a, 12)  # roll back two of the K+1 tokens, then continue
        steps.append(model.forward_cached(cache, [a, b], [tokens[0, 20], tokens[1, 19]], [1, 1], last_only=True))
    return full, torch.cat(steps), cache.kv.shape


def tp_logits(rank, world, paths) -> dict:
    """On one rank of a process group: per checkpoint kind, the logits and the shapes this rank holds."""
    res = {}
    for kind, path in paths.items():
        model, _ = load_model(path, tp=TP(rank, world))
        full, cached, kv_shape = logits_of(model)
        res[kind] = (full.numpy(), cached.numpy(), tuple(kv_shape), tuple(checkpoint_params(model)["model.layers.0.self_attn.q_proj.weight"].shape))
    return res


def rank1_main(port, paths, out):
    torch.set_num_threads(1)
    try:
        tp_init(1, 2, tp_store(2, 60, port), "gloo", "cpu")
        out.put(tp_logits(1, 2, paths))
        torch.distributed.destroy_process_group()
    except BaseException as e:
        out.put(f"{type(e).__name__}: {e}")
    out.close()
    out.join_thread()
    os._exit(0)  # skip the interpreter's slow teardown of torch


def test_tp2_logits_equal_tp1(ckpts):
    """This process is rank 0 of a gloo group, a spawned process rank 1."""
    paths = {k: str(v) for k, v in ckpts.items()}
    ctx = mp.get_context("spawn")
    out, store = ctx.Queue(), tp_store(2, 60)
    proc = ctx.Process(target=rank1_main, args=(store.port, paths, out))
    proc.start()
    try:
        tp_init(0, 2, store, "gloo", "cpu")
        got = {0: tp_logits(0, 2, paths), 1: out.get(timeout=120)}
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
    assert isinstance(got[1], dict), f"rank 1 failed: {got[1]}"
    for kind in TP_KINDS:
        ref_model, _ = load_model(ckpts[kind])
        full1, cached1, kv1 = logits_of(ref_model)
        assert full1.std() > 0.3 and cached1.shape == (19 + 3 * 2 + 8 + 2, V)  # logits of order 1: 1e-5 is a real bound
        cfg = ref_model.config
        for r in (0, 1):
            full2, cached2, kv2, q_shape = got[r][kind]
            assert (torch.from_numpy(full2) - full1).abs().max() < TOL, kind
            assert (torch.from_numpy(cached2) - cached1).abs().max() < TOL, kind
            # each rank holds half the q heads and caches half the KV heads
            assert q_shape == (cfg.num_attention_heads // 2 * cfg.head_dim, cfg.hidden_size)
            assert kv2[4] == cfg.num_key_value_heads // 2 and kv1[4] == cfg.num_key_value_heads
        # every rank has the same gathered logits, bit for bit
        assert (got[0][kind][0] == got[1][kind][0]).all() and (got[0][kind][1] == got[1][kind][1]).all()


# ----------------------------------------------------------------------------------------------------
# 2. generate(): TP = 2 emits the TP = 1 tokens

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A target and a draft that is the target with noise on every weight: it agrees often, not always."""
    target = make_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=3)
    draft = tmp_path_factory.mktemp("draft")
    shutil.copy(target / "config.json", draft / "config.json")
    g = torch.Generator().manual_seed(4)
    weights = {k: w + 0.6 * w.std() * torch.randn(w.shape, generator=g) for k, w in load_file(target / "model.safetensors").items()}
    save_file(weights, draft / "model.safetensors", metadata={"format": "pt"})
    return target, draft


PROMPTS = [[1, 5, 9, 23, 40, 7], [1, 77, 3]]
KW = dict(max_new_tokens=20, k=3, seed=5, ignore_eos=True, target_threads=1, draft_threads=1)


@pytest.fixture(scope="module")
def greedy_tp1(pair):
    """The TP = 1 target's greedy tokens: at temperature 0 every mode must emit exactly these."""
    target, draft = pair
    return generate(PROMPTS, target=target, draft=draft, mode="ar", **KW).tokens


@pytest.mark.parametrize("mode,parallel", [("ar", True), ("sd", True), ("ssd", True), ("ssd", False)])
def test_generate_tp2_greedy_matches_tp1(pair, greedy_tp1, mode, parallel):
    target, draft = pair
    tp = generate(PROMPTS, target=target, draft=draft, mode=mode, parallel=parallel, target_devices=["cpu", "cpu"], **KW)
    assert tp.tokens == greedy_tp1 and [len(x) for x in tp.tokens] == [20, 20]
    if mode != "ar":  # rounds with accepted and with rejected proposals were both exercised
        assert 0 < tp.stats["accepted_per_proposed"] < 1, tp.stats
    assert not mp.active_children()  # every worker rank was stopped


def test_generate_tp2_sampled_matches_tp1(pair):
    """At temperature > 0 the worker needs q too; same seed, same (sampled) tokens as TP = 1."""
    target, draft = pair
    kw = dict(target=target, draft=draft, mode="sd", temperature=0.8, **KW)
    ref = generate(PROMPTS, **kw)
    assert ref.tokens != generate(PROMPTS, target=target, draft=draft, mode="ar", **KW).tokens  # really sampled
    assert generate(PROMPTS, target_devices=["cpu", "cpu"], **kw).tokens == ref.tokens


# ----------------------------------------------------------------------------------------------------
# 3. Refusals and failures

def test_non_dividing_split_is_refused(ckpts):
    cfg = load_model(ckpts["llama"])[0].config
    with pytest.raises(ValueError) as e:
        with torch.device("meta"):
            Transformer(cfg, TP(0, 3))
    msg = str(e.value)
    assert "\n" not in msg and "num_attention_heads=4" in msg and "num_key_value_heads=2" in msg
    assert msg.endswith("valid TP sizes are 1, 2")
    with pytest.raises(ValueError, match="tensor parallel size 4 must divide each of"):  # refused before any spawn
        generate([[1, 2, 3]], target=ckpts["llama"], mode="ar", max_new_tokens=2, target_devices=["cpu"] * 4)
    assert not mp.active_children()
    with torch.device("meta"):  # 2 divides everything: accepted
        assert Transformer(cfg, TP(1, 2)).model.embed_tokens.num_embeddings == V // 2


def test_quantizing_a_tensor_parallel_rank_is_refused(ckpts):
    """A rank slices float weights only: int8 / int4 refuse in one line before any weight is read,
    an unknown quant is named, and auto (a safetensors model's float) and none load."""
    for quant, match in (("int8", "quant='int8' with tensor parallelism"),
                         ("int4", "quant='int4' with tensor parallelism"), ("int2", "unknown quant")):
        with pytest.raises(ValueError, match=match) as e:
            load_model(ckpts["llama"], tp=TP(0, 2), quant=quant, tokenizer=False)
        assert "\n" not in str(e.value)
    for quant in ("auto", "none"):
        model, _ = load_model(ckpts["llama"], tp=TP(1, 2), quant=quant, tokenizer=False)
        assert type(model.model.layers[0].self_attn.qkv_proj) is torch.nn.Linear


def test_dead_rank_fails_cleanly(ckpts):
    workers = TPWorkers(ckpts["llama"], ["cpu", "cpu"], threads=1)
    try:
        model, _ = load_model(ckpts["llama"], tp=workers.rank0)
        verifier = TPVerifier(model, dict(temperature=0.0, seed=0, kv_tokens=64, block_size=4), workers)
        verifier.prefill([[1, 2, 3]])
        os.kill(workers.procs[0].pid, signal.SIGKILL)
        workers.procs[0].join(timeout=10)
        with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 died \(exit code -9\)"):
            try:
                verifier.verify([0], torch.tensor([[4, 5]]), torch.zeros(1, 2, V), torch.ones(1, dtype=torch.bool), [2])
            finally:
                workers.close()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert not mp.active_children() and not torch.distributed.is_initialized()


def test_workers_wait_for_the_next_call_longer_than_the_timeout(ckpts):
    """tp_timeout bounds a call's collectives, not the wait between calls: a server idle between
    requests (or a draft still loading) longer than it kept failing its first request after."""
    workers = TPWorkers(ckpts["llama"], ["cpu", "cpu"], threads=1, timeout_s=2.0)
    try:
        model, _ = load_model(ckpts["llama"], tp=workers.rank0)
        time.sleep(2.5)  # rank 0 slower than the worker to take the settings
        verifier = TPVerifier(model, dict(temperature=0.0, seed=0, kv_tokens=64, block_size=4), workers)
        first = verifier.prefill([[1, 2, 3]])
        time.sleep(3.0)  # idle, as a server between requests
        n, t = verifier.verify([0], torch.tensor([[4, 5]]), None, torch.ones(1, dtype=torch.bool), [2])
        assert first.shape == (1,) and n.shape == t.shape == (1,)
    finally:
        workers.close()  # raises a worker's error
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert not mp.active_children()


# ----------------------------------------------------------------------------------------------------
# 4. The call protocol

def echo(self, x, word, nothing, ints, empty):
    """A Verifier method TPVerifier has no wrapper for: the arguments as this rank received them."""
    facts = [len(word), *ints, x.dtype == torch.bfloat16, nothing is None, empty.shape == (2, 0)]
    return x.float(), torch.tensor(facts)


def echo_worker_main(*args):
    """tp_worker_main on a rank whose Verifier also has echo()."""
    Verifier.echo = echo
    tp.tp_worker_main(*args)


def test_call_forwards_any_verifier_method(ckpts, monkeypatch):
    """call() forwards any method by name, with tensors (a strided bfloat16 one, an empty one), None
    and plain values. Both ranks return what they received and the lockstep guard compares them: had
    rank 1 received anything else, it would stop, and close() would raise its error."""
    headers = []

    def recording(header=None, group=None):
        headers.append(header)
        return broadcast_header(header, group)

    monkeypatch.setattr(tp, "broadcast_header", recording)
    monkeypatch.setattr(tp, "tp_worker_main", echo_worker_main)  # what TPWorkers spawns
    monkeypatch.setattr(Verifier, "echo", echo, raising=False)
    x = torch.randn(V, 1, 3, generator=torch.Generator().manual_seed(1)).bfloat16().permute(2, 1, 0)
    assert not x.is_contiguous()
    workers = TPWorkers(ckpts["llama"], ["cpu", "cpu"], threads=1)
    try:
        model, _ = load_model(ckpts["llama"], tp=workers.rank0)
        verifier = TPVerifier(model, dict(temperature=0.0, seed=0, kv_tokens=64, block_size=4), workers)
        verifier.prefill([[1, 2, 3]])
        got, facts = verifier.call("echo", x, "word", None, [7, 8], torch.empty(2, 0))
        assert torch.equal(got, x.float()) and facts.tolist() == [4, 7, 8, 1, 1, 1]
        # the tensors travel by themselves, not pickled in the header
        assert headers[-1] == ("echo", [TensorArg((3, 1, V), torch.bfloat16), "word", None, [7, 8],
                                        TensorArg((2, 0), torch.float32)], {})
        verifier.release([])
        assert len(headers) == 2  # nothing to free: no message
        verifier.release([0])
        assert headers[-1] == ("release", [[0]], {})
    finally:
        workers.close()  # raises a worker's error
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert headers[-1] == ("stop", [], {}) and len(headers) == 4  # idle workers are stopped, not killed
    assert not mp.active_children()


def test_a_tp_timeout_that_cannot_pass_or_overflows_is_refused():
    """tp_timeout <= 0 never passes; infinity or 1e20 seconds overflowed in the process group
    (a traceback): each refused in one line before a rank starts."""
    import tp
    for bad in (0, -1, float("nan"), float("inf"), 1e20):
        with pytest.raises(ValueError,
                           match=r"--tp-timeout .*give the seconds a rank may wait in a collective"):
            tp.check_start("tiny", 2, bad)
