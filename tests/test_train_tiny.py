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
