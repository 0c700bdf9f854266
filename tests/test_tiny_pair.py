"""The shipped tiny pair (checkpoints/tiny-target, tiny-draft): the architecture and size limits, a draft
under 1/10 of the target's FLOPs per token (from the configs; nothing is timed here), and on a deterministic
held-out subset (the first 8 windows of 128 positions of the held-out stream, see scripts/eval_tiny.py) a
target loss <= 4.0 nats/token and lower than the draft's, greedy agreement >= 0.65 and expected acceptance at
T=1 >= 0.72 (the pair of run 7 measured 3.268 / 3.337, 0.686 and 0.756 there); run.py's default prompt
continues for 128 greedy tokens with >= 80% of its token 4-grams distinct (measured 0.808; the pair before
run 7 looped, 0.632). Negative controls: a randomly initialised draft fails the pair checks, and a loop fails
the 4-gram check."""
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TARGET, DRAFT = REPO / "checkpoints" / "tiny-target", REPO / "checkpoints" / "tiny-draft"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")
MISSING = [str(d / f) for d in (TARGET, DRAFT) for f in FILES if not (d / f).exists()]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"tiny checkpoints absent ({', '.join(MISSING[:2])}): "
                                                      "run scripts/train_tiny.py")

TARGET_LOSS_MAX, AGREEMENT_MIN, ACCEPTANCE_MIN, DISTINCT4_MIN = 4.0, 0.65, 0.72, 0.8


def config(d):
    return json.loads((d / "config.json").read_text())


def test_architecture_and_size():
    t, d = config(TARGET), config(DRAFT)
    for c in (t, d):
        assert c["model_type"] == "llama" and not c.get("attention_bias") and not c.get("rope_scaling")
        # heads x head_dim need not be the hidden size (run 4's draft: 2 heads of 64 on a 192-wide stream)
        assert c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]) == 64
        assert c["num_attention_heads"] % c["num_key_value_heads"] == 0
    assert t["num_key_value_heads"] < t["num_attention_heads"], "target must use GQA"
    assert t["num_hidden_layers"] >= 8 and d["num_hidden_layers"] in (1, 2)
    assert t["vocab_size"] == d["vocab_size"]
    from safetensors.torch import load_file
    weights = load_file(TARGET / "model.safetensors")
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    n = sum(w.numel() for w in weights.values())  # tied: the LM head is the embedding, stored once
    assert 10e6 <= n <= 20e6, f"target has {n} parameters"
    mb = sum((p / "model.safetensors").stat().st_size for p in (TARGET, DRAFT)) / 2**20
    assert mb < 40, f"checkpoints are {mb:.1f} MiB"


def test_special_tokens_match_tokenizer():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(TARGET)
    for d in (TARGET, DRAFT):
        c = config(d)
        assert (c["bos_token_id"], c["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id)
        assert tok.bos_token_id is not None and tok.eos_token_id is not None
        assert AutoTokenizer.from_pretrained(d).get_vocab() == tok.get_vocab()


def test_draft_flops_under_a_tenth():
    from scripts.eval_tiny import flops_per_token
    t, d = config(TARGET), config(DRAFT)
    for context in (0, 256):  # attention over context only adds to the ratio (target is deeper and wider)
        ratio = flops_per_token(t, context) / flops_per_token(d, context)
        assert ratio >= 10, f"draft is 1/{ratio:.2f} of the target's FLOPs/token at context {context}"


@pytest.fixture(scope="module")
def held_out():
    from scripts.eval_tiny import heldout_windows, load_hf
    from transformers import AutoTokenizer
    torch.set_num_threads(1)
    windows = heldout_windows(AutoTokenizer.from_pretrained(TARGET), seq_len=128, n_windows=8)  # [8, 129]
    return load_hf(TARGET), windows


def test_pair_quality_on_held_out(held_out):
    from scripts.eval_tiny import evaluate_pair, load_hf
    target, windows = held_out
    m = evaluate_pair(target, load_hf(DRAFT), windows)
    assert m["positions"] == 8 * 128
    assert m["target_loss"] <= TARGET_LOSS_MAX and m["target_loss"] < m["draft_loss"], m
    assert m["greedy_agreement"] >= AGREEMENT_MIN, m
    assert m["acceptance_t1"] >= ACCEPTANCE_MIN, m


def test_negative_control_random_draft_fails(held_out):
    """The same checks must be able to fail: an untrained draft of the same shape does not pass."""
    from scripts.eval_tiny import evaluate_pair
    from transformers import AutoConfig, AutoModelForCausalLM
    target, windows = held_out
    torch.manual_seed(0)
    random_draft = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DRAFT)).float().eval()
    m = evaluate_pair(target, random_draft, windows)
    assert m["greedy_agreement"] < AGREEMENT_MIN and m["acceptance_t1"] < ACCEPTANCE_MIN, m


def test_default_prompt_continues_without_a_loop():
    """What `python run.py` shows first: run.py's default prompt, greedy, 128 tokens, must not end at once or
    fall into a loop (distinct token 4-grams / all 4-grams). The same measure on a loop is the negative control."""
    from scripts.eval_tiny import default_prompt_greedy, distinct_ngram_ratio
    tokens = default_prompt_greedy(TARGET)
    assert len(tokens) == 128, f"the target stopped after {len(tokens)} tokens"
    assert distinct_ngram_ratio(tokens) >= DISTINCT4_MIN, distinct_ngram_ratio(tokens)
    loop = tokens[:5] + [tokens[5], tokens[6]] * 60  # "x, x, x, ...": what the first pair did ("the the the")
    assert distinct_ngram_ratio(loop) < 0.1 and distinct_ngram_ratio(list(range(128))) == 1.0



def test_agreement_by_target_confidence_bins_and_ceiling():
    """eval_tiny's (8): positions binned by the target's top-1 probability, agreement per bin, and the
    agreement a draft would reach by matching the target wherever it is sure. Known logits, two batches
    summed as evaluate_pair sums them."""
    from scripts.eval_tiny import agreement_ceiling, pair_metrics, summarize
    V = 4

    def logits_with_top1(p_top, top):  # one row whose softmax gives token `top` probability p_top
        rest = (1 - p_top) / (V - 1)
        row = torch.full((V,), rest).log()
        row[top] = torch.tensor(p_top).log()
        return row

    # target's top-1: 0.26 (unsure), 0.4, 0.6, 0.95 (sure); the draft agrees at the 2nd and 4th only
    target = torch.stack([logits_with_top1(p, 0) for p in (0.26, 0.4, 0.6, 0.95)])      # [4, V]
    draft = torch.stack([logits_with_top1(0.9, t) for t in (1, 0, 2, 0)])                # [4, V]
    labels = torch.zeros(4, dtype=torch.long)
    a = pair_metrics(target[:2], draft[:2], labels[:2])
    b = pair_metrics(target[2:], draft[2:], labels[2:])
    m = summarize({k: a[k] + b[k] for k in a})
    assert m["greedy_agreement"] == 0.5
    bins = {tuple(c["target_top1"]): (c["share"], c["agreement"])
            for c in m["agreement_by_target_confidence"]}
    assert bins == {(0.0, 0.3): (0.25, 0.0), (0.3, 0.5): (0.25, 1.0), (0.5, 0.7): (0.25, 0.0),
                    (0.7, 0.9): (0.0, None), (0.9, 1.0): (0.25, 1.0)}
    assert agreement_ceiling(m, 0.5) == 0.75    # positions 3 and 4 matched, 1 and 2 as measured
    assert agreement_ceiling(m, 0.3) == 0.75    # position 2 already agrees
    assert agreement_ceiling(m, 0.0) == 1.0
