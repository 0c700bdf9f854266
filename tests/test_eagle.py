"""The EAGLE-3 head (eagle.py): what training sees is what drafting sees, and its checkpoint round-trips.

Training-time test (EagleHead.train_forward) claims that its step j at entry i computes exactly what
the head computes at its j-th draft step from position i, through its paged KV cache (EagleHead.step),
with the target's features on the verified prefix and its own outputs past it. The test runs both.
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
    back = eagle.load(tmp_path / "h")
    assert back.token_of.tolist() == head.token_of.tolist()
    assert back.target_layers == head.target_layers
    sd, sd2 = head.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        torch.testing.assert_close(sd[k], sd2[k])
