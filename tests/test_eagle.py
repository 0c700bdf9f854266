"""The EAGLE-3 head (eagle.py): what training sees is what drafting sees, SD with it is exact, its
checkpoint round-trips.

Training-time test (EagleHead.train_forward) claims that its step j at entry i computes exactly
what the head computes at its j-th draft step after position i, through its paged KV cache
(EagleHead.step), with the target's features on the verified prefix and its own outputs past it.
The tests run both, and SD rounds whose draft reads the verifier's features.
"""
import pytest
import torch

import eagle
from checkpoint import load_model
from kv_cache import PagedKVCache
from model import Transformer


def random_head(target: Transformer, seed: int = 0, vocab: int = 40):
    torch.manual_seed(seed)
    V = target.config.vocab_size
    token_ids = sorted(torch.randperm(V)[:vocab].tolist())
    head = eagle.head_for(target.config, [0, 1, 1], token_ids)
    with torch.no_grad():  # norms away from 1, so a swapped norm shows
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    head.attach(target.model.embed_tokens)
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from conftest import make_checkpoint
    path = make_checkpoint(tmp_path_factory.mktemp("t"), "llama", num_hidden_layers=2)
    return load_model(path, dtype="float32", tokenizer=False)[0]


def drafted_by_steps(head, target, seq: list[int], m: int, K: int):
    """The head's draft after position m as the engine runs it: tokens x_0..x_m fed in one cached
    forward, each with the target's features of the position before (zero for x_0), then K - 1
    single steps on its own outputs, the tokens fed being the sequence's own (the ones the target
    would accept). -> h' [K, H]."""
    feats = target.layer_states(torch.tensor([seq]), head.target_layers)[0]  # [L, 3, H]
    cache = PagedKVCache(head.config, 64, 4, "cpu", torch.float32)  # the head's one layer
    sid = cache.new_seq()
    g = torch.cat([torch.zeros(1, head.config.hidden_size), head.fuse(feats[:m])])  # g_{-1..m-1}
    h = head.step(cache, torch.tensor(seq[:m + 1]), g, cache.prepare([sid], [m + 1]))
    outs = [h[-1]]
    for j in range(1, K):
        tok = torch.tensor([seq[m + j]])
        h = head.step(cache, tok, outs[-1][None], cache.prepare([sid], [1]))
        outs.append(h[0])
    return torch.stack(outs)


def test_training_time_test_is_what_drafting_computes(target):
    head = random_head(target)
    torch.manual_seed(1)
    seq = torch.randint(3, target.config.vocab_size, (20,)).tolist()
    K = 4
    with torch.no_grad():
        feats = target.layer_states(torch.tensor([seq]), head.target_layers)
        ttt = head.train_forward(torch.tensor([seq]), feats, K)  # K x [1, L, H]
    for m in (0, 4, 12):
        steps = drafted_by_steps(head, target, seq, m, K)
        for j in range(K):  # draft step j after position m is TTT's step j at entry m
            torch.testing.assert_close(steps[j], ttt[j][0, m], atol=1e-5, rtol=1e-5)


def test_training_time_test_differs_from_teacher_forcing(target):
    """Negative control: step 1 of TTT reads the head's own output, not the target's features of
    the next position; were it to read the target's (plain teacher forcing), it would differ."""
    head = random_head(target)
    seq = torch.randint(3, target.config.vocab_size, (12,)).tolist()
    with torch.no_grad():
        feats = target.layer_states(torch.tensor([seq]), head.target_layers)
        ttt = head.train_forward(torch.tensor([seq]), feats, 2)
        forced = head.train_forward(torch.tensor([seq]), feats, 1)[0]
    assert not torch.allclose(ttt[1][0, :-1], forced[0, 1:], atol=1e-3)
    # and its step 0 is teacher forcing: the same computation
    torch.testing.assert_close(ttt[0], forced)


def test_layer_states_are_the_forward_residual_stream(target):
    """layer_states(.., [last]) through the final norm and head gives forward()'s logits."""
    tokens = torch.randint(0, target.config.vocab_size, (2, 9))
    n = target.config.num_hidden_layers
    with torch.no_grad():
        h = target.layer_states(tokens, [0, n - 1])[:, :, 1]
        torch.testing.assert_close(target.head(h), target(tokens), atol=1e-5, rtol=1e-5)


def test_logits_are_a_law_over_the_target_vocabulary(target):
    head = random_head(target)
    h = torch.randn(3, target.config.hidden_size)
    logits = head.logits(h)
    assert logits.shape == (3, target.config.vocab_size)
    outside = torch.ones(target.config.vocab_size, dtype=torch.bool)
    outside[head.token_of] = False
    assert torch.isinf(logits[:, outside]).all() and torch.isfinite(logits[:, ~outside]).all()
    assert torch.allclose(logits.softmax(-1).sum(-1), torch.ones(3))


def test_save_load_round_trip(target, tmp_path):
    head = random_head(target, seed=3)
    eagle.save(head, tmp_path / "h", {"target": "x"}, dtype=torch.float32)
    assert eagle.is_head(tmp_path / "h")
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "h").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes  # not safetensors' 0600
    back = eagle.load(tmp_path / "h")
    assert back.token_of.tolist() == head.token_of.tolist()
    assert back.target_layers == head.target_layers
    sd, sd2 = head.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        torch.testing.assert_close(sd[k], sd2[k])



def test_a_head_with_biases_saves_and_loads_them_by_eagle3s_names(tmp_path):
    """A Qwen2 target's head has q/k/v biases: saved apart as q_proj.bias, k_proj.bias and
    v_proj.bias (EAGLE-3's names, as the weights), loaded back into the fused layer; a tensor
    missing from the file is one line naming it."""
    from conftest import make_checkpoint
    from safetensors.torch import load_file, save_file
    qwen2 = load_model(make_checkpoint(tmp_path / "t", "qwen2", num_hidden_layers=2),
                       dtype="float32", tokenizer=False)[0]
    head = random_head(qwen2, seed=4)
    with torch.no_grad():
        head.midlayer.self_attn.qkv_proj.bias.normal_()
    eagle.save(head, tmp_path / "h", {"target": "x"}, dtype=torch.float32)
    saved = load_file(str(tmp_path / "h" / "model.safetensors"))
    sizes = head.midlayer.self_attn.sizes
    for part, b in zip(("q_proj", "k_proj", "v_proj"),
                       head.midlayer.self_attn.qkv_proj.bias.split(sizes)):
        torch.testing.assert_close(saved[f"midlayer.self_attn.{part}.bias"], b)
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in saved)
    back = eagle.load(tmp_path / "h")
    for k, v in head.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v)
    del saved["midlayer.self_attn.k_proj.bias"]
    save_file(saved, str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(ValueError, match="the head's tensor 'midlayer.self_attn.k_proj.bias' is "
                                         "missing"):
        eagle.load(tmp_path / "h")

def sd_with_head(target, head, prompts, K, max_new):
    """Greedy SD with an EAGLE head, the rounds as decode.sd_round runs them (the outcome and the
    target's features handed to the draft). -> each row's tokens."""
    from draft import DraftSettings
    from verify import Verifier
    target.want_features(head.target_layers)
    verifier = Verifier(target, 0.0, 0, 512)
    drafter = eagle.EagleDrafter(eagle.EagleModel(head), DraftSettings(K=K), 0.0, 0, 512)
    rows = list(range(len(prompts)))
    drafter.add(prompts)
    t0 = verifier.add(prompts)
    drafter.commit(rows, torch.zeros_like(t0), t0, verifier.features)
    out = [[t] for t in t0.tolist()]
    while min(len(o) for o in out) < max_new:
        p = drafter.draft(rows)
        n, t = verifier.verify(rows, p.tokens, p.q, p.deterministic, p.lengths)
        drafter.commit(rows, n, t, verifier.features)
        for r, (n_r, t_r) in enumerate(zip(n.tolist(), t.tolist())):
            out[r] += p.tokens[r, :n_r].tolist() + [t_r]
    target.want_features(None)
    return [o[:max_new] for o in out]


def greedy(target, prompt, max_new):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            ids.append(target(torch.tensor([ids]))[0, -1].argmax().item())
    return ids[len(prompt):]


def test_sd_with_an_eagle_head_emits_the_targets_greedy_tokens(target):
    head = random_head(target)
    torch.manual_seed(5)
    prompts = [torch.randint(3, 100, (n,)).tolist() for n in (7, 12)]
    out = sd_with_head(target, head, prompts, K=3, max_new=20)
    for prompt, tokens in zip(prompts, out):
        assert tokens == greedy(target, prompt, 20)


def test_each_round_drafts_what_a_fresh_head_drafts_from_the_targets_features(target):
    """After every outcome the head's cache is what a fresh forward over the committed tokens with
    the target's features gives: its laws at each draft step are training-time test's from the
    last committed position. Outcomes are forced (n of the proposals accepted, a random bonus), so
    that drafted tokens are accepted, and their entries, computed from the head's own states while
    drafting, must be corrected to the target's: a cache that kept them fails (checked by hand)."""
    from draft import DraftSettings
    head = random_head(target, vocab=100)
    torch.manual_seed(6)
    history = torch.randint(3, 100, (9,)).tolist()
    K, rng = 3, torch.Generator().manual_seed(0)
    drafter = eagle.EagleDrafter(eagle.EagleModel(head), DraftSettings(K=K), 0.0, 0, 512)
    steps = []  # the logits of each draft step
    forward = drafter.model.forward_cached
    drafter.model.forward_cached = lambda *a, **kw: steps.append(forward(*a, **kw)) or steps[-1]

    def features(seq):
        with torch.no_grad():
            return target.layer_states(torch.tensor([seq]), head.target_layers)[0]

    drafter.add([history])
    t0 = 50
    drafter.commit([0], torch.tensor([0]), torch.tensor([t0]), [features(history)])
    history = history + [t0]
    accepted = 0
    for _ in range(8):
        steps.clear()
        proposed = drafter.draft([0]).tokens[0].tolist()
        m = len(history) - 1  # drafting after entry m (the last bonus token)
        seq = history + proposed[:-1]
        with torch.no_grad():
            f = features(seq)
            f[m:] = 0  # not verified: never read by the chain
            ttt = head.train_forward(torch.tensor([seq]), f[None], K)
        for j in range(K):
            torch.testing.assert_close(steps[j][0], head.logits(ttt[j][0, m]), atol=1e-4,
                                       rtol=1e-4)
        n = int(torch.randint(1, K + 1, (1,), generator=rng))
        t = int(torch.randint(3, 100, (1,), generator=rng))
        verified = history[-1:] + proposed[:n]  # r, x_1..x_n: the target's cache gains them
        f = features(history + proposed[:n])[-len(verified):]
        drafter.commit([0], torch.tensor([n]), torch.tensor([t]), [f])
        history += proposed[:n] + [t]
        accepted += n
    assert accepted >= 8


def ssd_rounds_with_forced_outcomes(target, correct_hits: bool) -> tuple[int, int]:
    """SSD's draft side with a head (eagle.EagleSpeculator, one process), outcomes forced: half the
    rounds hit a branch it pre-speculated, the others miss with a random (n, t). After each
    outcome the head must draft from the target's features as a fresh training-time test forward
    does: a miss's neural backup at once (its draft steps' laws), a hit at its next
    pre-speculation, which re-feeds the round's tokens (the laws it ranks its guesses by: t's, then
    each proposal's). -> (hits, rounds where a law differed from the fresh forward's)."""
    from draft import DraftSettings
    head = random_head(target, vocab=100)
    torch.manual_seed(6)
    history = torch.randint(3, 100, (9,)).tolist()
    K, rng = 3, torch.Generator().manual_seed(1)
    spec = eagle.EagleSpeculator(eagle.EagleModel(head), DraftSettings(K=K, fallback="neural"),
                                 0.0, 0, 4096)
    spec.correct_hits = correct_hits
    calls = []  # (sequences, logits) of every forward of the head
    forward = spec.model.forward_cached
    spec.model.forward_cached = lambda c, seqs, *a, **kw: calls.append(
        (list(seqs), forward(c, seqs, *a, **kw))) or calls[-1][1]

    def features(seq):
        with torch.no_grad():
            return target.layer_states(torch.tensor([seq]), head.target_layers)[0]

    def fresh(seq, m, steps):  # training-time test's laws after position m: [steps, V]
        with torch.no_grad():
            f = features(seq)
            f[m:] = 0  # not verified: never read by the chain
            return torch.stack([head.logits(x[0, m]) for x in
                                head.train_forward(torch.tensor([seq]), f[None], steps)])

    spec.add([history])
    n, t, f = 0, 50, features(history)  # round 0: the prompt's features, a miss
    hits = differed = 0
    for round_ in range(10):
        calls.clear()
        p = spec.respond([0], torch.tensor([n]), torch.tensor([t]), features=[f])
        history += spec.rows[0].history[len(history):]  # + x_1..x_n, t
        proposed = p.tokens[0, :p.lengths[0]].tolist()
        m = len(history) - 1  # the proposals follow entry m (t)
        if not bool(p.hit[0]):  # the backup drafted now, from the target's features
            steps = [x for seqs, x in calls if seqs == [spec.rows[0].seq]]
            expect = fresh(history + proposed[:-1], m, K)
            got = torch.cat([s[-1:] for s in steps])
            differed += not torch.allclose(got, expect, atol=1e-4, rtol=1e-4)
        calls.clear()
        spec.pre_speculate([0])
        if bool(p.hit[0]):  # its first forward re-fed the round (corrected) or x'_L alone
            seqs, fed = calls[0]
            expect = fresh(history + proposed, m, len(proposed) + 1)  # after t, x'_1..x'_L
            differed += not torch.allclose(fed[-len(expect):], expect, atol=1e-4, rtol=1e-4)
        guesses = sorted(spec.spec_cache.entries)
        if round_ % 2 and guesses:  # a hit: an outcome it guessed
            _, n, t = guesses[int(torch.randint(len(guesses), (1,), generator=rng))]
            hits += 1
        else:
            n = int(torch.randint(0, len(proposed) + 1, (1,), generator=rng))
            t = next(x for x in range(3, 100) if (0, n, x) not in spec.spec_cache)
        verified = history[-1:] + proposed[:n]  # r, x_1..x_n: what the target's cache gains
        f = features(history + proposed[:n])[-len(verified):]
    return hits, differed


def test_ssd_with_a_head_drafts_from_the_targets_features_after_each_outcome(target):
    hits, differed = ssd_rounds_with_forced_outcomes(target, correct_hits=True)
    assert hits >= 4 and differed == 0
    # negative control: a hit that keeps the head's own states re-feeds nothing, and its laws
    # are not the fresh forward's
    hits, differed = ssd_rounds_with_forced_outcomes(target, correct_hits=False)
    assert hits >= 4 and differed >= 3


def test_outcomes_with_no_forward_between_keep_every_verified_features(target):
    """Two outcomes reach a row with no forward of the head between them (the round between
    pre-speculated nothing, a fast backup proposed): the target's g of both stay pending, one
    run from the cache's end, so the next forward feeds every verified token with them."""
    from draft import DraftSettings
    head = random_head(target)
    spec = eagle.EagleSpeculator(eagle.EagleModel(head), DraftSettings(
        K=3, fallback="ngram", pre_spec="never"), 0.0, 0, 4096)
    H, prompt = target.config.hidden_size, list(range(5, 14))
    spec.add([prompt])
    spec.respond([0], torch.tensor([0]), torch.tensor([50]), features=[torch.randn(9, 3, H)])
    spec.respond([0], torch.tensor([2]), torch.tensor([51]), features=[torch.randn(3, 3, H)])
    seq, history = spec.rows[0].seq, spec.rows[0].history
    assert len(spec.cache.pending[seq][1]) == 2  # a piece an outcome, not yet joined
    start, g = spec.cache.pending_g(seq)
    # the prompt, r, x_1, x_2: all but the bonus t, from the cache's end on
    assert start == spec.cache.length(seq) and start + len(g) == len(history) - 1 == 12



def test_a_long_catch_up_goes_in_prefill_chunks_with_the_same_laws(target, monkeypatch):
    """A row's first forward feeds its whole prompt: at most model.PREFILL_CHUNK tokens a forward
    (the attention mask of one forward grows with its square), the same laws as one forward."""
    head = random_head(target)
    H, prompt = target.config.hidden_size, list(range(5, 16))
    g = head.fuse(torch.randn(len(prompt), 3, H))

    def laws():
        model = eagle.EagleModel(head)
        cache = model.new_cache(256, 4)
        seq = cache.new_seq()
        cache.pend(seq, 0, g)
        sizes = []
        step = head.step
        monkeypatch.setattr(head, "step", lambda c, x, *a: sizes.append(len(x)) or step(c, x, *a))
        out = model.forward_cached(cache, [seq], prompt, [len(prompt)])
        monkeypatch.undo()
        return out, sizes
    whole, one = laws()
    monkeypatch.setattr(eagle, "PREFILL_CHUNK", 4)
    chunked, pieces = laws()
    assert one == [11] and pieces == [4, 4, 3]
    torch.testing.assert_close(chunked, whole)

def test_a_batch_that_empties_leaves_no_branches_to_the_next(target):
    """Every row leaves after a pre-speculation (a server between requests): its branches go with
    them, so the next batch's first round, which an EAGLE head never pre-speculates, is not taken
    for one that did (no lookups counted for a row nothing was cached for)."""
    from draft import DraftSettings
    spec = eagle.EagleSpeculator(eagle.EagleModel(random_head(target)), DraftSettings(K=2), 0.0,
                                 0, 4096)
    H = target.config.hidden_size
    spec.add([list(range(5, 14))])
    spec.respond([0], torch.tensor([0]), torch.tensor([50]), features=[torch.randn(9, 3, H)])
    spec.pre_speculate([0])
    assert spec.branches is not None
    spec.leave([0])
    assert spec.branches is None
    spec.add([list(range(20, 30))])
    spec.pre_speculate([1])  # no features of its prompt yet: nothing
    before = spec.spec_cache.stats.lookups
    spec.respond([1], torch.tensor([0]), torch.tensor([60]), features=[torch.randn(10, 3, H)])
    assert spec.spec_cache.stats.lookups == before


def saved_head(target, path, seed=0):
    head = random_head(target, seed=seed, vocab=min(200, target.config.vocab_size))
    eagle.save(head, path, {"target": "test"}, dtype=torch.float32)
    return path


@pytest.mark.parametrize("compile", [False, True])
def test_generate_sd_and_ssd_with_a_head_emit_ar_tokens(tmp_path, compile):
    """run.generate with an EAGLE head's directory as the draft: SD's and SSD's (one process)
    greedy tokens are AR's, on the eager path and on the CPU's compiled steps (their graphs give
    the features too)."""
    from run import generate
    target = load_model("tiny", tokenizer=False)[0]
    head = saved_head(target, tmp_path / "head")
    prompts = [[1, 400, 52, 9, 77], [1, 12, 13, 14, 15, 16, 17, 18]]
    kw = dict(target=target, max_new_tokens=24, temperature=0.0, ignore_eos=True,
              compile=compile, target_threads=1)
    ar = generate(prompts, draft="tiny-draft", mode="ar", **kw)
    assert target.feature_layers is None  # AR asks for none
    sd = generate(prompts, draft=str(head), mode="sd", k=3, **kw)
    ssd = generate(prompts, draft=str(head), mode="ssd", k=3, parallel=False, **kw)
    assert sd.tokens == ar.tokens and ssd.tokens == ar.tokens
    assert sd.stats["rounds"] < 2 * 23  # the head proposed: rounds are fewer than tokens twice
    assert ssd.stats["misses"] > 0


def test_two_process_ssd_with_a_head_emits_ar_tokens(tmp_path):
    """SSD in two processes with a head: the outcome's features cross the channel (a prompt's, too
    long for its buffer, as a control message) and the speculator's process reads tokens through
    the target's embedding module, received in shared memory; the head runs in int4 there
    (eagle.quantize). Greedy tokens are AR's, and the
    outcomes were looked up among branches pre-speculated over there (a random head hits rarely:
    the forced-outcome test above covers hits)."""
    from run import generate
    target = load_model("tiny", tokenizer=False)[0]
    head = saved_head(target, tmp_path / "head")
    prompts = [[1, 400, 52, 9, 77], [1, 12, 13, 14, 15, 16, 17, 18]]
    kw = dict(target=target, max_new_tokens=24, temperature=0.0, ignore_eos=True,
              target_threads=1, draft_threads=1)
    ar = generate(prompts, draft="tiny-draft", mode="ar", **kw)
    ssd = generate(prompts, draft=str(head), mode="ssd", k=3, draft_quant="int4", **kw)
    assert ssd.tokens == ar.tokens
    assert sum(ssd.stats["lookups_per_depth"]) > 0 and ssd.stats["misses"] >= len(prompts)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_a_quantized_head_drafts_what_its_dequantised_weights_do(target, quant):
    """eagle.quantize: the head's linear layers in quant.py's layouts (int4: the decoder layer;
    fc and lm_head int8). Its draft steps are those of the float head whose weights are the
    quantized ones read back (to the kernels' rounding), and differ from the unquantized head's."""
    import copy
    from quantize import QuantLinear
    head = random_head(target, vocab=100)
    q = eagle.quantize(copy.deepcopy(head), quant)
    layers = {n: m for n, m in q.named_modules() if isinstance(m, QuantLinear)}
    assert set(layers) == {"fc", "midlayer.self_attn.qkv_proj", "midlayer.self_attn.o_proj",
                           "midlayer.mlp.gate_up_proj", "midlayer.mlp.down_proj", "lm_head"}
    assert layers["lm_head"].bits == layers["fc"].bits == 8
    assert layers["midlayer.mlp.down_proj"].bits == {"int8": 8, "int4": 4}[quant]
    back = copy.deepcopy(head)  # float, with the quantized weights read back
    with torch.no_grad():
        for name, m in layers.items():
            back.get_submodule(name).weight.copy_(m.dequantize())
    seq = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(0)).tolist()[0]
    out = {k: drafted_by_steps(h, target, seq, 8, 3) for k, h in
           (("q", q), ("back", back), ("float", head))}
    own = {k: h.lm_head(h.norm(out[k])).float() for k, h in (("q", q), ("back", back),
                                                              ("float", head))}  # its rows
    to_back, to_float = ((own["q"] - own[k]).abs().max() for k in ("back", "float"))
    assert to_back < 1e-3 and to_float > 10 * to_back, (to_back, to_float)


def test_a_head_refuses_what_it_does_not_run_in_one_line(tmp_path):
    from run import generate
    target_path = load_model("tiny", tokenizer=False)[0]
    head = saved_head(target_path, tmp_path / "head")
    with pytest.raises(ValueError, match="tensor-parallel target with a draft that reads"):
        generate([[1, 2, 3]], target="tiny", draft=str(head), mode="sd", max_new_tokens=4,
                 target_devices=["cpu", "cpu"])
    other = load_model(make_other(tmp_path), tokenizer=False)[0]
    with pytest.raises(ValueError, match="train a head for it"):
        generate([[1, 2, 3]], target=other, draft=str(head), mode="sd", max_new_tokens=4)


def make_other(tmp_path):
    from conftest import make_checkpoint
    return make_checkpoint(tmp_path / "other", "llama")


def test_served_ssd_with_a_head_on_an_int8_target_is_exact(tmp_path):
    """serve.py with an EAGLE head's directory as its draft and an int8 target: 9 greedy streams at
    once, joining the running batch at different rounds, each give the text AR gives the prompt
    alone on the same int8 target (the head's features come from quantized products, batched)."""
    pytest.importorskip("httpx")
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import threading
    from run import generate
    from test_serve import MAX_NEW, PROMPTS, Server, stream_text
    model, tok = load_model("tiny", quant="int8")
    head = saved_head(model, tmp_path / "head")
    alone = [generate(p, target=model, tokenizer=tok, mode="ar", max_new_tokens=MAX_NEW - i).text[0]
             for i, p in enumerate(PROMPTS)]
    server, texts = Server("--mode", "ssd", "--k", "3", "--draft", str(head), "--quant", "int8"), {}
    try:
        client = server.client()
        threads = [threading.Thread(target=lambda i=i: texts.__setitem__(
            i, stream_text(client, PROMPTS[i], MAX_NEW - i, delay=0.05 * i)))
            for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        m = server.metrics()
    finally:
        assert server.stop() == 0
    assert [texts.get(i) for i in range(len(PROMPTS))] == alone
    assert m['ssd_kv_blocks_used{cache="target"}'] == 0
    assert m["ssd_spec_decode_num_draft_tokens_total"] > 0  # speculated: the head proposed
    assert m["ssd_spec_cache_hits_total"] + m["ssd_spec_cache_misses_total"] > 0
