"""scripts/train_tiny.py's grow_draft: a resumed run can change the draft's shape (more layers, fewer query heads,
another MLP width) and start from the trained draft's weights instead of from scratch."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts.train_tiny import grow_draft  # noqa: E402


def llama(layers, heads, inter, seed):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
                      max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def test_grow_draft_with_silent_new_parts_is_the_old_draft():
    """Same heads and width, one layer more: with the new layer's output projections zeroed, the grown draft
    computes exactly what the old one did (copied tensors, a residual layer that adds nothing)."""
    old, new = llama(1, 3, 96, 0), llama(2, 3, 96, 1)
    grow_draft(old, new)
    with torch.no_grad():
        new.model.layers[1].self_attn.o_proj.weight.zero_()
        new.model.layers[1].mlp.down_proj.weight.zero_()
    x = torch.randint(64, (2, 10))
    torch.testing.assert_close(new(x).logits, old(x).logits)
    assert not torch.equal(llama(2, 3, 96, 1)(x).logits, old(x).logits)  # control: not grown, not equal


def test_grow_draft_keeps_the_strongest_units_and_the_first_heads():
    old, new = llama(1, 3, 96, 0), llama(2, 2, 40, 1)
    grow_draft(old, new)
    o, n = old.model.layers[0], new.model.layers[0]
    assert torch.equal(n.self_attn.q_proj.weight, o.self_attn.q_proj.weight[:32])   # 2 heads of 16
    assert torch.equal(n.self_attn.o_proj.weight, o.self_attn.o_proj.weight[:, :32])
    assert torch.equal(n.self_attn.k_proj.weight, o.self_attn.k_proj.weight)
    score = (o.mlp.down_proj.weight.norm(dim=0) * o.mlp.up_proj.weight.norm(dim=1)
             * o.mlp.gate_proj.weight.norm(dim=1))
    keep = score.topk(40).indices.sort().values
    assert torch.equal(n.mlp.down_proj.weight, o.mlp.down_proj.weight[:, keep])
    assert torch.equal(n.mlp.up_proj.weight, o.mlp.up_proj.weight[keep])
    assert torch.equal(n.mlp.gate_proj.weight, o.mlp.gate_proj.weight[keep])
    assert torch.equal(new.model.embed_tokens.weight, old.model.embed_tokens.weight)


def test_grow_draft_to_more_heads_and_a_wider_mlp_keeps_all_old_parts():
    """The other direction: every old head and MLP unit is kept in the first slots, the new ones stay random."""
    old, new = llama(1, 2, 40, 0), llama(1, 3, 96, 1)
    fresh = llama(1, 3, 96, 1)
    grow_draft(old, new)
    o, n, f = old.model.layers[0], new.model.layers[0], fresh.model.layers[0]
    assert torch.equal(n.self_attn.q_proj.weight[:32], o.self_attn.q_proj.weight)
    assert torch.equal(n.self_attn.q_proj.weight[32:], f.self_attn.q_proj.weight[32:])
    assert torch.equal(n.self_attn.o_proj.weight[:, :32], o.self_attn.o_proj.weight)
    assert torch.equal(n.mlp.down_proj.weight[:, :40], o.mlp.down_proj.weight)  # all 40 units, in order
    assert torch.equal(n.mlp.up_proj.weight[:40], o.mlp.up_proj.weight)
    assert torch.equal(n.mlp.gate_proj.weight[40:], f.mlp.gate_proj.weight[40:])


def test_repeated_ngram_mask_marks_the_tokens_that_repeat_a_4gram():
    from scripts.train_tiny import repeated_ngram_mask
    row = [1, 2, 3, 4, 9, 1, 2, 3, 4, 5, 1, 2, 3, 4]
    # positions 8 and 13 complete (1, 2, 3, 4) again; the prefix (start=4) is context and never marked
    assert repeated_ngram_mask(torch.tensor([row]), 4, 4)[0].nonzero().flatten().tolist() == [8, 13]
    # an n-gram seen only inside the prefix still counts as seen
    assert repeated_ngram_mask(torch.tensor([row]), 4, 9)[0].nonzero().flatten().tolist() == [13]
    assert not repeated_ngram_mask(torch.arange(14)[None], 4, 4).any()  # control: no repeats, no marks


def test_unlikelihood_steps_make_greedy_text_repeat_less(tmp_path):
    """train_unlikelihood on a small random model whose greedy continuations loop: after a few steps they
    repeat fewer 4-grams. The model's own CE term alone (--ul-weight 0) is the control."""
    from types import SimpleNamespace

    from scripts.train_tiny import greedy_continuations, repeated_ngram_mask, train_unlikelihood

    def repeats(model, prefixes):
        seq = greedy_continuations(model, prefixes, 32)
        return repeated_ngram_mask(seq, 4, prefixes.shape[1]).float().mean().item()

    torch.manual_seed(0)
    data = torch.randint(64, (4096,))
    prefixes = data[:8 * 16].view(8, 16)
    out = {}
    for weight in (1.0, 0.0):
        model = llama(1, 3, 96, 0)
        before = repeats(model, prefixes)
        work = tmp_path / str(weight)
        work.mkdir()
        args = SimpleNamespace(ul_lr=1e-2, ul_weight=weight, ul_prefix=16, ul_len=32, ul_steps=25, warmup=1,
                               batch_size=8, seq_len=48, device="cpu", autocast="none", work_dir=str(work),
                               save_every_s=1e9, eval_every=1000, seed=0)
        train_unlikelihood(model, data, args)
        out[weight] = (before, repeats(model, prefixes))
    assert out[1.0][0] > 0.3, out  # the random model loops
    assert out[1.0][1] < 0.5 * out[1.0][0], out
    assert out[0.0][1] > out[1.0][1], out


def test_greedy_continuations_are_the_targets_argmax_after_the_prefix():
    from scripts.train_tiny import greedy_continuations
    target = llama(2, 3, 96, 0)
    prefix = torch.randint(64, (3, 10), generator=torch.Generator().manual_seed(1))
    prefix[0, -1] = prefix[1, 3] = 0  # BOS (= the pad id it passes) inside a crop: still attended to
    seq = greedy_continuations(target, prefix, 12)
    assert seq.shape == (3, 22) and torch.equal(seq[:, :10], prefix)
    with torch.no_grad():
        logits = target(input_ids=seq).logits  # [3, 22, V]
    assert torch.equal(logits[:, 9:-1].argmax(-1), seq[:, 10:])


def test_on_policy_distillation_scores_the_continuation_and_lowers_its_kl(tmp_path):
    """distill_kl is 0 for a draft that is the target and counts only the positions from `start` on;
    train_draft with --on-policy 0.5 lowers the draft's KL on the target's greedy continuations."""
    from types import SimpleNamespace

    from scripts.train_tiny import distill_kl, greedy_continuations, train_draft
    target, draft = llama(2, 3, 96, 0), llama(1, 3, 96, 1)
    prefix = torch.randint(64, (8, 16), generator=torch.Generator().manual_seed(2))
    seq = greedy_continuations(target, prefix, 32)
    with torch.no_grad():
        assert distill_kl(target, target, seq)[0].item() < 1e-6
        full = distill_kl(draft, target, seq)[0].item()
        tail = distill_kl(draft, target, seq, start=40)[0].item()
        # causal models: position t's KL needs only x[:, :t + 1], so the tail is the mean of these
        alone = [distill_kl(draft, target, seq[:, :t + 1], start=t)[0].item() for t in range(40, 48)]
    assert abs(tail - sum(alone) / len(alone)) < 1e-4 and abs(tail - full) > 2e-4, (tail, full, alone)
    with torch.no_grad():
        before = distill_kl(draft, target, seq[:, :-1], start=15)[0].item()
    args = SimpleNamespace(draft_lr=1e-2, draft_steps=30, warmup=1, ce_weight=0.0, distill_temp=1.0, on_policy=0.5,
                           ul_prefix=16, ul_len=32, batch_size=8, seq_len=48, device="cpu", autocast="none",
                           work_dir=str(tmp_path), save_every_s=1e9, eval_every=1000, seed=0)
    train_draft(draft, target, torch.randint(64, (4096,), generator=torch.Generator().manual_seed(3)), args)
    with torch.no_grad():
        after = distill_kl(draft, target, seq[:, :-1], start=15)[0].item()
    assert after < 0.7 * before, (before, after)


def test_distill_temperature_sharpens_toward_the_targets_argmax():
    """--distill-temp: at 0 the loss is the draft's cross-entropy on the target's argmax, a small
    temperature approaches it, and 1 is the plain KL (as the draft was distilled before)."""
    import torch.nn.functional as F

    from scripts.train_tiny import distill_kl
    target, draft = llama(2, 3, 96, 0), llama(1, 3, 96, 1)
    x = torch.randint(64, (4, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        lp, lq = target(input_ids=x).logits.float(), F.log_softmax(draft(input_ids=x).logits.float(), -1)
        hard = -lq.gather(-1, lp.argmax(-1, keepdim=True)).mean().item()
        logp = F.log_softmax(lp, -1)
        plain = (logp.exp() * (logp - lq)).sum(-1).mean().item()
        assert abs(distill_kl(draft, target, x, temp=0)[0].item() - hard) < 1e-5
        assert abs(distill_kl(draft, target, x, temp=1)[0].item() - plain) < 1e-5
        near = distill_kl(draft, target, x, temp=1e-3)[0].item()
    # KL to a near one-hot p is the CE of its argmax minus p's (near-zero) entropy
    assert abs(near - hard) < 1e-2 and abs(plain - hard) > 0.1, (near, hard, plain)

