"""generate() end to end (issue 4): modes ar and sd against transformers, the output law at temperature 1,
seeds, EOS and max_new_tokens, bad input and the command line.

References are transformers models reloaded from the checkpoint directory (`hf_model(path)`), never the
in-memory model that wrote it. Greedy references are transformers' own `generate(do_sample=False)`, one
prompt at a time (no padding), so a ragged batch here is compared row by row against unpadded runs.

The statistical test (`test_sd_law_matches_target`) compares the empirical joint law of the first 3 emitted
tokens of N independent rows with the target's exact law, computed by enumerating all V^3 continuations
(`exact_law`), in total variation (TV). The bound (`tv_bound`) is pure sampling noise:
  E[TV] = 1/2 sum_x E|p^(x) - p(x)| <= 1/2 sum_x sqrt(p(x)(1 - p(x)) / N)          (Jensen, per cell)
and TV is a function of N independent rows that moves by at most 1/N when one row changes, so McDiarmid
gives P(TV >= E[TV] + eps) <= exp(-2 N eps^2) = delta for eps = sqrt(ln(1/delta) / (2N)), delta = 1e-6.
A correct engine exceeds the bound with probability < 1e-6; the negative control (the right proposals
verified with the wrong q) must exceed it. The helpers here are reused by tests/test_ssd.py.
"""
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine
import run
import verify
from checkpoint import load_model
from conftest import hf_model, make_checkpoint
from run import generate

torch.set_num_threads(1)

# the main pair: a small llama target (V = 100), and three drafts with the same vocabulary
TARGET_KW = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, eos_token_id=None,
                 max_position_embeddings=256)
RANDOM_DRAFT_KW = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, eos_token_id=None,
                       max_position_embeddings=256)
PROMPTS = [[1, 5, 7, 9, 11], [1, 3], [1, 8, 22, 33, 44, 55, 66, 77, 88]]  # ragged on purpose
NEW = 24  # greedy tokens compared per prompt


# ----------------------------------------------------------------------------------------------------
# Helpers (also used by test_ssd.py)

def gen(prompts, target, draft=None, **kw):
    """generate() on one thread per side (CI has 2 cores shared by everything)."""
    kw.setdefault("target_threads", 1)
    kw.setdefault("draft_threads", 1)
    return generate(prompts, target=str(target), draft=str(draft or target), **kw)


def edit_weights(path: Path, fn):
    """Rewrite a single-file checkpoint's tensors in place: fn(name, tensor) -> tensor."""
    w = load_file(path / "model.safetensors")
    save_file({k: fn(k, v).contiguous() for k, v in w.items()}, path / "model.safetensors", metadata={"format": "pt"})
    return path


def edit_config(path: Path, **fields):
    """Set fields of config.json and generation_config.json (when present) in place."""
    for name in ("config.json", "generation_config.json"):
        f = path / name
        if f.exists():
            cfg = json.loads(f.read_text())
            cfg.update(fields)
            f.write_text(json.dumps(cfg))
    return path


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def perturbed_copy(src: Path, dst: Path, noise: float, seed: int) -> Path:
    """The same model plus relative Gaussian noise on every weight: agrees with src often, not always,
    so speculative rounds accept some tokens and reject others."""
    g = torch.Generator().manual_seed(seed)
    copy_checkpoint(src, dst)
    return edit_weights(dst, lambda k, w: w + noise * w.std() * torch.randn(w.shape, generator=g))


def hf_greedy(path: Path, prompts, max_new_tokens: int, eos=None):
    """transformers' greedy continuation of each prompt (run alone, unpadded), and the smallest gap between
    the top two logits along the way (a near tie could flip on harmless float differences)."""
    m = hf_model(path)
    m.generation_config.eos_token_id = eos
    m.generation_config.pad_token_id = 0
    outs, gap = [], math.inf
    for p in prompts:
        x = torch.tensor([p])
        with torch.no_grad():
            o = m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                           output_scores=True, return_dict_in_generate=True)
        outs.append(o.sequences[0, len(p):].tolist())
        for s in o.scores:
            top = s[0].float().topk(2).values
            gap = min(gap, float(top[0] - top[1]))
    return outs, gap


def exact_law(path: Path, prompt, n_tokens: int, temperature: float) -> dict:
    """The target's exact law of its first n_tokens sampled tokens after `prompt`, by enumeration: one
    full forward of prompt + every one of the V^n continuations. Returns {tuple of tokens: probability}."""
    m = hf_model(path)
    V = m.config.vocab_size
    conts = torch.cartesian_prod(*[torch.arange(V)] * n_tokens).view(-1, n_tokens)  # [V^n, n]
    x = torch.cat([torch.tensor(prompt).expand(len(conts), -1), conts], 1)         # [V^n, L + n]
    with torch.no_grad():
        logits = m(x).logits.double()                                              # [V^n, L + n, V]
    L = len(prompt)
    logp = torch.log_softmax(logits[:, L - 1:L - 1 + n_tokens] / temperature, -1)  # [V^n, n, V]
    logp = logp.gather(-1, conts[..., None]).squeeze(-1).sum(-1)                   # [V^n]
    law = {tuple(c): float(p) for c, p in zip(conts.tolist(), logp.exp())}
    assert abs(sum(law.values()) - 1) < 1e-9
    return law


def empirical_law(rows, n_tokens: int) -> dict:
    counts = {}
    for r in rows:
        assert len(r) >= n_tokens, r
        key = tuple(r[:n_tokens])
        counts[key] = counts.get(key, 0) + 1
    return {k: c / len(rows) for k, c in counts.items()}


def tv(p: dict, q: dict) -> float:
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


def tv_bound(law: dict, N: int, delta: float = 1e-6) -> float:
    """Sampling-noise bound on TV(empirical of N rows, law), exceeded with probability <= delta (module doc)."""
    mean = 0.5 * sum(math.sqrt(p * (1 - p) / N) for p in law.values())
    return mean + math.sqrt(math.log(1 / delta) / (2 * N))


def make_small_vocab_pair(root: Path, V: int = 4, head_scale: float = 2.5):
    """A target and a different draft over V tokens with peaked, non-degenerate next-token laws (the
    LM heads are scaled up so the laws are far from uniform, and target and draft disagree)."""
    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, bos_token_id=None,
              eos_token_id=None, max_position_embeddings=32)
    scale = lambda k, w: w * head_scale if k == "lm_head.weight" else w
    tgt = edit_weights(make_checkpoint(root / "target", "llama", seed=10, **kw), scale)
    dft = edit_weights(make_checkpoint(root / "draft", "llama", seed=11, **kw), scale)
    return tgt, dft


def make_own_vocab_draft(root: Path, token_ids: list[int], V: int = 4, head_scale: float = 2.5):
    """A draft for make_small_vocab_pair's target that writes only token_ids of its V tokens (its own
    vocabulary, config.ModelConfig.token_ids: one row per token, and a last row for every other)."""
    kw = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, bos_token_id=None,
              eos_token_id=None, max_position_embeddings=32)
    path = make_checkpoint(root, "llama", seed=12, vocab_size=len(token_ids) + 1,
                           target_token_ids=token_ids, target_vocab_size=V, **kw)
    return edit_weights(path, lambda k, w: w * head_scale if k == "lm_head.weight" else w)


# ----------------------------------------------------------------------------------------------------
# Fixtures

@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    tgt = make_checkpoint(root / "target", "llama", seed=0, **TARGET_KW)
    d = dict(target=tgt,
             random=make_checkpoint(root / "random", "llama", seed=1, **RANDOM_DRAFT_KW),
             perturbed=perturbed_copy(tgt, root / "perturbed", noise=0.05, seed=2),
             copy=copy_checkpoint(tgt, root / "copy"))
    d["ref"], gap = hf_greedy(tgt, PROMPTS, NEW)
    assert gap > 1e-4, f"the fixture's greedy path has a near tie (gap {gap:.2e}): pick another seed"
    return d


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    tgt, dft = make_small_vocab_pair(tmp_path_factory.mktemp("small_vocab"))
    prompt = [0, 3, 1]
    law = exact_law(tgt, prompt, 3, 1.0)
    assert max(law.values()) < 0.5, "target law is near-degenerate: the test would be weak"
    # the draft's own law is far from the target's, so proposals are often rejected
    assert tv(exact_law(dft, prompt, 3, 1.0), law) > 0.2
    return tgt, dft, prompt, law


# ----------------------------------------------------------------------------------------------------
# Device-to-host reads: a fixed few per round, none per draft step (on a GPU each read is a sync)

@pytest.fixture
def host_reads(monkeypatch):
    """Log the shape of every read through devices.to_host, the decode loop's one device-to-host crossing."""
    import decode
    import draft
    import speculator
    log = []
    for module in (decode, draft, speculator, verify):
        real = module.to_host
        monkeypatch.setattr(module, "to_host", lambda x, real=real: log.append(tuple(x.shape)) or real(x))
    return log


@pytest.mark.parametrize("batch", [1, 3])
def test_host_reads_per_round_do_not_grow_with_batch(ckpts, host_reads, batch):
    """AR reads twice per round (the verifier's n to roll back its cache; n, t and the tokens for the output)
    and SD four times (+ the draft's proposals, + n and t for the draft's cache), whatever the batch size;
    the prefill adds one read (the first tokens) and SD's draft one more (t0). None per draft step. SSD in one
    process reads at most 7 times per round (the outcome, the hits' proposals, a fallback's proposals, the
    guesses of each fan-out group (at most 2), the verifier's n, the output)."""
    for mode, per_round, prefill in (("ar", 2, 1), ("sd", 4, 2)):
        host_reads.clear()
        res = gen(PROMPTS[:batch], ckpts["target"], ckpts["perturbed"], mode=mode, k=3, max_new_tokens=NEW)
        assert res.tokens == ckpts["ref"][:batch]
        assert len(host_reads) == per_round * res.stats["rounds"] + prefill, (mode, host_reads)
    host_reads.clear()
    res = gen(PROMPTS[:batch], ckpts["target"], ckpts["perturbed"], mode="ssd", k=3, max_new_tokens=NEW,
              parallel=False)
    assert res.tokens == ckpts["ref"][:batch] and res.stats["hits"] > 0
    assert len(host_reads) <= 7 * res.stats["rounds"] + 3, host_reads


# ----------------------------------------------------------------------------------------------------
# Greedy: exactly transformers' tokens

@pytest.mark.parametrize("batch", [1, 3])
def test_ar_greedy_matches_transformers(ckpts, batch):
    res = gen(PROMPTS[:batch], ckpts["target"], mode="ar", max_new_tokens=NEW)
    assert res.tokens == ckpts["ref"][:batch]
    assert res.stats["new_tokens"] == NEW * batch and res.stats["mode"] == "ar"


def test_greedy_sd_and_ssd_with_a_draft_of_its_own_vocabulary(ckpts, tmp_path):
    """A draft that writes 40 of the target's 100 tokens: where the target's token is outside them
    every proposal is rejected, and SD and SSD still emit exactly the target's greedy tokens."""
    own = make_checkpoint(tmp_path / "own", "llama", seed=4, vocab_size=41,
                          target_token_ids=list(range(0, 80, 2)), target_vocab_size=100,
                          **RANDOM_DRAFT_KW)
    for mode, extra in (("sd", {}), ("ssd", {"parallel": False})):
        res = gen(PROMPTS, ckpts["target"], own, mode=mode, k=3, max_new_tokens=NEW, **extra)
        assert res.tokens == ckpts["ref"], mode
    # transformers' assisted generation runs it too (bench.py's hf-assisted), through
    # checkpoint.hf_over_target_vocab: the target's greedy tokens again
    x = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        out = hf_model(ckpts["target"]).generate(x, assistant_model=hf_model(own), do_sample=False,
                                                 max_new_tokens=NEW, pad_token_id=0)
    assert out[0, x.shape[1]:].tolist() == ckpts["ref"][0]


def test_qwen2_greedy_ar_sd_ssd_match_transformers(tmp_path):
    """Qwen2 (q/k/v biases, tied embeddings): every mode emits transformers' greedy tokens."""
    tgt = make_checkpoint(tmp_path / "target", "qwen2", seed=20, **TARGET_KW)
    dft = perturbed_copy(tgt, tmp_path / "draft", noise=0.05, seed=21)
    ref, gap = hf_greedy(tgt, PROMPTS[:2], NEW)
    assert gap > 1e-4, f"near tie in the reference (gap {gap:.2e}): pick another seed"
    for mode, extra in (("ar", {}), ("sd", {}), ("ssd", {"parallel": False}), ("ssd", {})):
        res = gen(PROMPTS[:2], tgt, dft, mode=mode, k=3, max_new_tokens=NEW, **extra)
        assert res.tokens == ref, mode
    assert 0 < res.stats["accepted_per_proposed"] < 1


@pytest.mark.parametrize("draft", ["random", "perturbed", "copy"])
@pytest.mark.parametrize("K", [1, 3, 7])
@pytest.mark.parametrize("batch", [1, 3])
def test_sd_greedy_matches_transformers(ckpts, draft, K, batch):
    res = gen(PROMPTS[:batch], ckpts["target"], ckpts[draft], mode="sd", k=K, max_new_tokens=NEW)
    assert res.tokens == ckpts["ref"][:batch]
    s = res.stats
    hist = s["accept_len_histogram"]
    assert len(hist) == K + 1 and sum(hist) > 0
    if draft == "copy":  # the draft is the target: every proposal is its argmax, all K accepted (n = K)
        assert s["accepted_per_proposed"] > 0.9, s
        assert hist[K] > 0, hist
    if draft == "random":  # an unrelated draft: rejections happen
        assert s["accepted_per_proposed"] < 0.5 and hist[0] > 0, s
    if draft == "perturbed" and K > 1:  # partial runs: some tokens accepted, then a rejection
        assert 0 < s["accepted_per_proposed"] < 1 and sum(hist[1:K]) > 0, s


# ----------------------------------------------------------------------------------------------------
# Temperature 1: the output law is the target's

N_LAW = 20000


def test_sd_law_matches_target(small_vocab):
    """Joint law of the first 3 tokens from sd (K = 2): token 1 is the prefill's, tokens 2-3 come from the
    first round (accepted drafts or the residual bonus) or, after an early rejection, the second."""
    tgt, dft, prompt, law = small_vocab
    res = gen([prompt] * N_LAW, tgt, dft, mode="sd", k=2, temperature=1.0, max_new_tokens=3, seed=123)
    emp = empirical_law(res.tokens, 3)
    assert 0.1 < res.stats["accepted_per_proposed"] < 0.9, res.stats  # both branches of the test are exercised
    assert tv(emp, law) < tv_bound(law, N_LAW), (tv(emp, law), tv_bound(law, N_LAW))


def test_sd_law_with_a_draft_of_its_own_vocabulary(small_vocab, tmp_path):
    """A draft that writes only tokens 0 and 2 of the target's 4: tokens 1 and 3 come only from the
    residual after a rejection, and the output law is still the target's."""
    tgt, _, prompt, law = small_vocab
    dft = make_own_vocab_draft(tmp_path / "own", [0, 2])
    res = gen([prompt] * N_LAW, tgt, dft, mode="sd", k=2, temperature=1.0, max_new_tokens=3, seed=5)
    assert 0.1 < res.stats["accepted_per_proposed"] < 0.9, res.stats
    assert {1, 3} <= {t for row in res.tokens for t in row[1:]}  # written by the residual
    assert tv(empirical_law(res.tokens, 3), law) < tv_bound(law, N_LAW)


def test_sd_law_negative_control_wrong_q(small_vocab, monkeypatch):
    """The same check must catch a verifier that tests the draft's tokens with the wrong law (uniform q
    instead of the q they were drawn from): the output is then no longer the target's."""
    tgt, dft, prompt, law = small_vocab
    orig = verify.accept_reject

    def wrong_q(target_logits, draft_tokens, draft_probs, *args, **kw):
        if draft_probs is not None:  # None: the prefill's first token, nothing proposed
            draft_probs = torch.full_like(draft_probs, 1.0 / draft_probs.shape[-1])
        return orig(target_logits, draft_tokens, draft_probs, *args, **kw)

    monkeypatch.setattr(verify, "accept_reject", wrong_q)
    res = gen([prompt] * N_LAW, tgt, dft, mode="sd", k=2, temperature=1.0, max_new_tokens=3, seed=123)
    d = tv(empirical_law(res.tokens, 3), law)
    assert d > tv_bound(law, N_LAW), (d, tv_bound(law, N_LAW))


# ----------------------------------------------------------------------------------------------------
# Seeds, EOS, max_new_tokens

@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_seeded_runs_repeat(ckpts, mode):
    kw = dict(mode=mode, k=3, temperature=1.0, max_new_tokens=16)
    a = gen(PROMPTS, ckpts["target"], ckpts["perturbed"], seed=7, **kw).tokens
    b = gen(PROMPTS, ckpts["target"], ckpts["perturbed"], seed=7, **kw).tokens
    c = gen(PROMPTS, ckpts["target"], ckpts["perturbed"], seed=8, **kw).tokens
    assert a == b
    assert a != c
    assert all(len(x) == 16 for x in a + c)


@pytest.mark.parametrize("mode,parallel", [("ar", True), ("sd", True), ("ssd", False), ("ssd", True)])
def test_a_loaded_target_decodes_as_its_name_does(ckpts, mode, parallel):
    """generate(target=model) (a bench sweep's one load): the tokens of generate(target=name), at T = 1 with
    the same seed, call after call on the same model, which keeps its KV pool (Verifier(reuse_cache=True))."""
    from checkpoint import load_model
    kw = dict(mode=mode, k=3, temperature=1.0, max_new_tokens=12, seed=5, parallel=parallel,
              target_threads=1, draft_threads=1)
    by_name = generate(PROMPTS, target=str(ckpts["target"]), draft=str(ckpts["perturbed"]), **kw).tokens
    model = load_model(ckpts["target"], tokenizer=False)[0]
    pools = []
    for _ in range(2):
        assert generate(PROMPTS, target=model, draft=str(ckpts["perturbed"]), **kw).tokens == by_name
        pools.append(model.kv_pool)
    assert pools[0] is not None and pools[1] is pools[0]


def test_auto_decodes_in_the_mode_it_measured_fastest(ckpts, capsys):
    """mode="auto": every mode measured on these prompts, one stderr line with the numbers and the choice,
    and the tokens of generate(mode=chosen) at T = 1 with the same seed (the measurement runs draw from none
    of the chosen run's random streams)."""
    kw = dict(k=3, temperature=1.0, max_new_tokens=12, seed=5, parallel=False, target_threads=1,
              draft_threads=1, draft=str(ckpts["perturbed"]))
    res = generate(PROMPTS, target=str(ckpts["target"]), mode="auto", **kw)
    rates, chosen = res.stats["auto_tok_s"], res.stats["mode"]
    assert list(rates) == list(run.MODES) and all(r > 0 for r in rates.values())
    assert chosen == max(rates, key=rates.get)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("mode auto:")]
    assert len(lines) == 1, lines
    assert all(f"{m} {r:.1f}" in lines[0] for m, r in rates.items()) and f"-> {chosen}," in lines[0]
    assert res.tokens == generate(PROMPTS, target=str(ckpts["target"]), mode=chosen, **kw).tokens
    with pytest.raises(ValueError) as e:  # nothing to load once: refused before anything loads
        generate(PROMPTS, target=str(ckpts["target"]), mode="auto", target_devices=["cpu", "cpu"])
    assert "\n" not in str(e.value) and "tensor-parallel" in str(e.value)


def test_a_loaded_target_runs_where_it_is(ckpts):
    from checkpoint import load_model
    model = load_model(ckpts["target"], tokenizer=False)[0]
    for kw, words in ((dict(target_devices=["cpu", "cpu"]), ("tensor-parallel", "target_devices")),
                      # a device the engine does not run is refused before the model's is read
                      (dict(target_device="meta"), ("'meta' is not supported", "cpu or cuda"))):
        with pytest.raises(ValueError) as e:
            generate(PROMPTS, target=model, mode="ar", max_new_tokens=2, **kw)
        assert len(str(e.value).splitlines()) == 1 and all(w in str(e.value) for w in words), e.value


def pick_eos(ref, K, prompt):
    """A token (not in the prompt) whose first occurrence in ref is inside a round, two or more tokens
    before its end, so that with an always-accepting draft the EOS sits inside an accepted run with more
    accepted tokens after it. ref[0] comes from the prefill; round r >= 1 emits ref[1 + (r-1)(K+1) : 1 + r(K+1)]."""
    for i, x in enumerate(ref):
        if i >= 2 and x not in ref[:i] and x not in prompt and (i - 1) % (K + 1) < K - 1:
            return x, i
    raise AssertionError(f"no usable EOS candidate in {ref}: pick another seed")


@pytest.fixture(scope="module")
def eos_ckpts(ckpts, tmp_path_factory):
    """The target (and a copy as draft) with eos_token_id set to a token the greedy path emits mid-run."""
    K = 7
    eos, at = pick_eos(ckpts["ref"][0], K, PROMPTS[0])
    root = tmp_path_factory.mktemp("eos")
    tgt = edit_config(copy_checkpoint(ckpts["target"], root / "target"), eos_token_id=eos)
    copy = edit_config(copy_checkpoint(ckpts["target"], root / "copy"), eos_token_id=eos)
    ref, _ = hf_greedy(tgt, PROMPTS, NEW, eos=eos)  # transformers stops at EOS (kept)
    assert ref[0] == ckpts["ref"][0][:at + 1]
    return dict(target=tgt, copy=copy, eos=eos, K=K, ref=ref)


@pytest.mark.parametrize("mode,draft,K", [("ar", None, 0), ("sd", "copy", 7), ("sd", "random", 3)])
def test_eos_ends_sequence(ckpts, eos_ckpts, mode, draft, K):
    e = eos_ckpts
    d = e["copy"] if draft == "copy" else ckpts.get(draft)
    res = gen(PROMPTS, e["target"], d, mode=mode, k=max(K, 1), max_new_tokens=NEW)
    assert res.tokens == e["ref"]
    for out in res.tokens:
        assert e["eos"] not in out[:-1]
    assert res.tokens[0][-1] == e["eos"] and len(res.tokens[0]) < NEW
    assert res.stats["new_tokens"] == sum(len(x) for x in e["ref"])
    # ignore_eos runs past it: the full greedy continuation
    res = gen(PROMPTS, e["target"], d, mode=mode, k=max(K, 1), max_new_tokens=NEW, ignore_eos=True)
    assert res.tokens == ckpts["ref"]


@pytest.mark.parametrize("max_new", [1, 2, 5, 12])
def test_max_new_tokens_cuts_exactly(ckpts, max_new):
    """With an always-accepting draft and K = 7 each round emits 8 tokens: the cut falls inside a round."""
    res = gen(PROMPTS, ckpts["target"], ckpts["copy"], mode="sd", k=7, max_new_tokens=max_new)
    assert res.tokens == [r[:max_new] for r in ckpts["ref"]]
    assert res.stats["new_tokens"] == 3 * max_new


# ----------------------------------------------------------------------------------------------------
# Bad input: one-line ValueError

@pytest.fixture(scope="module")
def bad_ckpts(ckpts, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    small_ctx = edit_config(copy_checkpoint(ckpts["target"], root / "small_ctx"), max_position_embeddings=16)
    other_vocab = make_checkpoint(root / "other_vocab", "llama", seed=3, **{**RANDOM_DRAFT_KW, "vocab_size": 50})
    return dict(small_ctx=small_ctx, other_vocab=other_vocab)


def expect_value_error(match, **kw):
    with pytest.raises(ValueError) as e:
        gen(**kw)
    msg = str(e.value)
    assert "\n" not in msg and msg.strip(), msg
    assert match in msg, msg
    return msg


def test_bad_input(ckpts, bad_ckpts):
    t, d = ckpts["target"], ckpts["random"]
    base = dict(prompts=[PROMPTS[0]], target=t, draft=d, max_new_tokens=4)
    expect_value_error("mode", **{**base, "mode": "beam"})
    expect_value_error("k=0", **{**base, "mode": "sd", "k": 0})
    expect_value_error("temperature", **{**base, "mode": "sd", "temperature": -0.5})
    expect_value_error("context", **{**base, "target": bad_ckpts["small_ctx"], "prompts": [list(range(1, 21))]})
    expect_value_error("context", **{**base, "target": bad_ckpts["small_ctx"], "max_new_tokens": 64})
    expect_value_error("vocabulary", **{**base, "mode": "sd", "draft": bad_ckpts["other_vocab"]})
    expect_value_error("vocabulary", **{**base, "mode": "ssd", "parallel": False, "draft": bad_ckpts["other_vocab"]})
    expect_value_error("100", **{**base, "prompts": [[1, 100, 3]]})
    for seed in (2**64, -2**63 - 1, 1.5, True):  # what no torch.Generator takes, named
        expect_value_error(f"seed={seed!r}: use an integer in [-2**63, 2**64)",
                           **{**base, "seed": seed})


def test_bad_input_negative_token_id_is_named(ckpts):
    """A negative id is out of range too, and the message must name it (not the largest id of the prompt)."""
    msg = expect_value_error("vocabulary", prompts=[[1, -3, 5]], target=ckpts["target"], max_new_tokens=4)
    assert "-3" in msg, msg


# ----------------------------------------------------------------------------------------------------
# The command line

def test_cli_bad_target_is_one_error_line(capsys, tmp_path):
    rc = run.main(["--target", str(tmp_path / "no_such_model"), "--mode", "ar", "--max-new-tokens", "2", "--json"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 1
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    rc = run.main(["--draft", str(tmp_path / "no_such_draft"), "--mode", "sd", "--max-new-tokens",
                   "2", "--json"])
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("error: draft: model "), lines


@pytest.mark.parametrize("argv,hint", [([], True), (["--mode", "ssd", "--device", "cpu"], True),
                                        (["--no-parallel"], False), (["--mode", "sd"], False),
                                        (["--mode", "ar"], False), (["--mode", "auto"], False),
                                        (["--draft-device", "cuda:0"], False)])
def test_cli_hints_at_sd_where_ssd_shares_the_cpu(monkeypatch, capsys, argv, hint):
    """SSD (the default) with both models on the CPU: one stderr line says the speculator takes cores the
    target could use and names --mode sd / auto; not for ar, sd, auto, one-process ssd, or a draft on
    another device (SSD's premise holds). generate is a stub here: the line comes before any decoding."""
    got = {}
    monkeypatch.setattr(run, "generate", lambda prompts, **kw: got.update(kw) or run.GenerateResult([[3]], None))
    assert run.main(argv + ["--json"]) == 0
    err = capsys.readouterr().err
    assert got["mode"] == (argv[argv.index("--mode") + 1] if "--mode" in argv else "ssd")
    assert ("--mode sd or --mode auto may be faster" in err) == hint, err
    assert len(err.splitlines()) == hint, err


def save_word_tokenizer(path: Path, V: int, bos: bool = True):
    """A word-level tokenizer over V tokens "<unk>", "<s>", "</s>", "w3" .. "w{V-1}" (ids = their
    index); bos: it puts "<s>" before a text itself, as a Llama's does (SmolLM2's puts nothing)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, processors
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, V)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece()  # joins word-level tokens with spaces
    if bos:
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)


def test_cli_json_with_tokenizer(ckpts, tmp_path, capsys):
    tgt = copy_checkpoint(ckpts["target"], tmp_path / "with_tokenizer")
    save_word_tokenizer(tgt, 100)
    rc = run.main(["--target", str(tgt), "--draft", str(ckpts["perturbed"]), "--mode", "sd", "--json",
                   "--max-new-tokens", "5", "--prompt", "w5 w7 w9"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    got = json.loads(lines[0])
    # the tokenizer puts BOS (id 1) first; EOS is the tokenizer's "</s>" (id 2), kept if emitted
    ref, _ = hf_greedy(tgt, [[1, 5, 7, 9]], 5, eos=2)
    assert got["tokens"] == ref[0]
    # the text skips the special tokens <unk>, <s>, </s> (ids 0-2); the token ids keep them
    assert isinstance(got["text"], str) and got["text"].split() == [f"w{x}" for x in ref[0] if x > 2]
    s = got["stats"]
    for key in ("mode", "new_tokens", "prefill_seconds", "decode_seconds", "decode_tok_s", "rounds",
                "mean_tokens_per_round", "accepted_per_proposed", "acceptance",
                "accept_len_histogram"):
        assert key in s, key
    assert s["mode"] == "sd" and s["new_tokens"] == len(got["tokens"])
    # a = accepted / trials (a proposal stops being tried at its first rejection): at least the
    # accepted share of the proposed tokens, and 1 exactly where that is
    accepted = s["accepted_per_proposed"] * s["proposed_tokens"]
    assert s["acceptance"] == pytest.approx(accepted / s["acceptance_trials"])
    assert s["acceptance"] >= s["accepted_per_proposed"]


def test_raw_prompt_gets_the_tokenizers_own_special_tokens(tmp_path):
    """A prompt without --chat is encoded as transformers encodes it: BOS first only where the
    tokenizer puts one (a Llama's); SmolLM2's BOS, <|im_start|>, opens a chat turn and is not added."""
    from transformers import AutoTokenizer
    for bos, want in ((True, [1, 5, 7]), (False, [5, 7])):
        save_word_tokenizer(tmp_path / str(bos), 100, bos=bos)
        tok = AutoTokenizer.from_pretrained(tmp_path / str(bos))
        assert run.encode(tok, "w5 w7", chat=False) == want


def test_draft_with_another_tokenizer_of_the_same_size_is_one_line(tmp_path):
    """Same vocabulary size, two tokens swapped in the draft's tokenizer: refused before decoding,
    naming the first id that differs."""
    draft = tmp_path / "draft"
    shutil.copytree(Path(run.__file__).parent / "checkpoints" / "tiny-draft", draft)
    tj = json.loads((draft / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = [t for t, i in vocab.items() if i in (300, 301)]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(tj))
    for mode, extra in (("sd", {}), ("ssd", {"parallel": False})):
        msg = expect_value_error("tokenizer differs", prompts=["def f():"], target="tiny",
                                 draft=str(draft), mode=mode, max_new_tokens=2, **extra)
        assert "token 300" in msg and "distill_draft" in msg, msg
    gen(prompts=["def f():"], target="tiny", draft="tiny-draft", mode="sd", max_new_tokens=2)


def padded_draft(root: Path, rows: int) -> Path:
    """tiny-draft (tied embeddings) cut or padded to `rows` rows with its own tokenizer: the
    padding copies its first rows, scaled up, so that its head would propose them if they were
    read."""
    path = copy_checkpoint(Path(run.__file__).parent / "checkpoints" / "tiny-draft", root)
    edit_config(path, vocab_size=rows)

    def fit(name, w):
        if name != "model.embed_tokens.weight":
            return w
        return w[:rows] if rows <= len(w) else torch.cat([w, 4 * w[:rows - len(w)]])
    return edit_weights(path, fit)


@pytest.mark.parametrize("rows", [4096 - 40, 4096 + 40])
def test_a_draft_padded_to_another_vocabulary_size(tmp_path, rows):
    """Qwen2.5-7B has 152,064 rows and its 0.5B 151,936, one tokenizer: a pair whose tokenizers
    agree is accepted, the draft's logits are read over the target's vocabulary (-inf where it has
    no row, its extra rows dropped) and SD / SSD emit the target's greedy tokens."""
    draft = padded_draft(tmp_path / "draft", rows)
    own, _ = load_model(draft, tokenizer=False)
    over, _ = load_model(draft, tokenizer=False, vocab_size=4096)
    x = torch.tensor([[1, 50, 300, 7]])
    with torch.no_grad():
        mine, read = own(x), over(x)
    assert mine.shape[-1] == rows and read.shape[-1] == 4096
    n = min(rows, 4096)
    assert torch.equal(read[..., :n], mine[..., :n]) and (read[..., n:] == -math.inf).all()
    if rows > 4096:  # the padding would have been proposed
        assert (mine.argmax(-1) >= 4096).any()
    prompts = ["def f(x):\n    return", "class A:"]
    ref = gen(prompts, "tiny", mode="ar", max_new_tokens=16).tokens
    for mode, extra in (("sd", {}), ("ssd", {"parallel": False}), ("ssd", {})):
        res = gen(prompts, "tiny", draft, mode=mode, k=3, max_new_tokens=16, **extra)
        assert res.tokens == ref, mode
        assert res.stats["accepted_per_proposed"] > 0.2, res.stats


def test_a_prompt_of_no_tokens_is_one_line():
    expect_value_error("tokenizes to no tokens", prompts=[""], target="tiny", mode="ar",
                       max_new_tokens=2)


def test_cli_builds_the_target_tokenizer_once(monkeypatch, capsys):
    import checkpoint
    calls = []
    real = checkpoint.load_tokenizer

    def counting(*a, **kw):
        calls.append(a[0])
        return real(*a, **kw)
    monkeypatch.setattr(checkpoint, "load_tokenizer", counting)
    monkeypatch.setattr(run, "load_tokenizer", counting)
    monkeypatch.setattr(engine, "load_tokenizer", counting)
    assert run.main(["--mode", "sd", "--max-new-tokens", "4", "--prompt", "def f():"]) == 0
    assert calls.count("tiny") == 1, calls  # and the draft's once, for the pairing check
    assert capsys.readouterr().out.startswith("def f():")  # a plain prompt is continued in place


def test_a_draft_records_its_settings_and_a_value_given_wins(tmp_path):
    """A draft checkpoint's config.json may record the settings measured best with its target
    ("speculation": DraftSettings' fields and "quant"): generate() and the command line start from
    them, a value given (argument or flag) wins, a draft without them gets DraftSettings'
    defaults, and an entry that is no field of DraftSettings is refused in one line."""
    draft = tmp_path / "draft"
    shutil.copytree(Path(run.__file__).parent / "checkpoints" / "tiny-draft", draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "speculation": {
        "K": 2, "confidence": 0.3, "quant": "int8"}}))
    args = lambda *flags: run.generate_kwargs(run.parser().parse_args(["--draft", str(draft),
                                                                        *flags]))
    kw = args()
    assert (kw["draft_settings"].K, kw["draft_settings"].confidence) == (2, 0.3)
    assert kw["draft_quant"] == "int8"
    kw = args("--k", "3", "--draft-quant", "none")
    assert (kw["draft_settings"].K, kw["draft_settings"].confidence) == (3, 0.3)
    assert kw["draft_quant"] == "none"
    default = run.generate_kwargs(run.parser().parse_args(["--draft", "tiny-draft"]))
    assert default["draft_settings"] == run.SPEC and default["draft_quant"] == "auto"
    # generate(): K from the record (the histogram has K + 1 entries), the weights int8
    res = generate([[1, 5, 9, 23]], draft=str(draft), mode="sd", max_new_tokens=8)
    assert len(res.stats["accept_len_histogram"]) == 3
    assert len(generate([[1, 5, 9, 23]], draft=str(draft), mode="sd", max_new_tokens=8,
                        k=1).stats["accept_len_histogram"]) == 2
    (draft / "config.json").write_text(json.dumps({**config, "speculation": {"Kay": 2}}))
    with pytest.raises(ValueError, match="speculation.*DraftSettings"):
        args()
    # the shipped real-pair draft's record is one the engine takes (its model card says why)
    from quantize import QUANTS
    recorded, recorded_quant = run.recorded_settings("smollm2-135m-draft")
    shipped = run.settings_of(None, recorded)
    assert shipped != run.SPEC and run.draft_quant_of(recorded_quant, "auto") in QUANTS


def test_an_explicit_fan_out_and_another_budget_are_refused_not_one_ignored():
    """An explicit fan-out F_0..F_K is its own budget B = sum F_j: a --budget that disagrees would
    be silently dropped, so the two together are one line; a budget that agrees is taken."""
    flags = lambda *f: run.generate_kwargs(run.parser().parse_args(["--fan-out", "2,1,1,0,0",
                                                                    *f]))
    with pytest.raises(ValueError, match=r"fan_out=\[2, 1, 1, 0, 0\] makes B = 4 branches and "
                                         r"budget=8 was given too"):
        flags("--budget", "8")
    assert flags("--budget", "4")["draft_settings"].budget == 4
    assert flags()["draft_settings"].budget == 4


def test_more_threads_than_cores_is_a_warning(ckpts):
    """Threads past the machine's cores take turns: the engine says so, naming the flags."""
    import os
    with pytest.warns(UserWarning, match=r"target \+ 0 draft threads on \d+ cores: threads past "
                                         r"the cores take turns.*--target-threads"):
        generate([PROMPTS[0]], target=ckpts["target"], mode="ar", max_new_tokens=2,
                 target_threads=(os.cpu_count() or 1) + 1)


def test_the_cli_shows_a_warning_as_one_line():
    """run.py shows the engine's warnings as it shows its errors: 'warning: ...', one line, not
    the file and line of the call that warned."""
    import os
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "run.py", "--mode", "ar", "--max-new-tokens", "2",
                          "--target-threads", str((os.cpu_count() or 1) + 1), "--json"],
                         cwd=Path(run.__file__).parent, capture_output=True, text=True,
                         timeout=120)
    lines = [ln for ln in out.stderr.splitlines() if "threads past the cores" in ln]
    assert out.returncode == 0 and len(lines) == 1 and lines[0].startswith("warning: ") \
        and "UserWarning" not in out.stderr, out.stderr


def test_the_cli_refuses_bad_flags_before_loading(monkeypatch, capsys):
    """--k 0 and a negative --temperature are one line before the tokenizer or a model loads (the
    prompt not yet printed); --chat with a model that has no chat template is one line too."""
    monkeypatch.setattr(run, "load_tokenizer", lambda *a: pytest.fail("loaded the tokenizer"))
    for flags, said in ((["--k", "0"], "k=0 is impossible"),
                        (["--temperature", "-1"], "--temperature -1.0 must be >= 0")):
        assert run.main(flags) == 1
        out, err = capsys.readouterr()
        assert out == "" and err.strip().splitlines()[-1] == f"error: {said}" + (
            ": use 1 <= k <= 64 draft tokens per round" if "k=0" in said else ""), err
    with pytest.raises(ValueError, match="this model's tokenizer has no chat template: leave "
                                         "--chat out"):
        generate(["def f():"], mode="ar", chat=True, max_new_tokens=2)


def test_draft_settings_and_a_field_together_are_refused_by_the_names_given():
    from draft import DraftSettings
    """generate(k=..., draft_settings=...): one would silently win; the refusal names k as the
    caller typed it (DraftSettings calls it K)."""
    with pytest.raises(ValueError, match=r"^draft_settings and k, confidence given together: put "
                                         r"them in draft_settings$"):
        generate(["def f():"], k=3, confidence=0.2, draft_settings=DraftSettings(),
                 max_new_tokens=2)
