"""Evaluate the shipped tiny target/draft pair (checkpoints/tiny-target, checkpoints/tiny-draft).

Held-out data: the files `scripts.stdlib_corpus.split_files()` holds out (md5 of the stdlib-relative path
% 100 < 5), in sorted path order, each encoded as BOS + tokens + EOS and concatenated; the first
--windows non-overlapping windows of --seq-len + 1 tokens from the start of that stream (default: 128
windows of 256 predicted positions, 32768 positions, the same windows train_tiny.py reports on).

Measures (1) both models' held-out cross-entropy, (2) greedy agreement (draft argmax == target argmax),
(3) expected acceptance at temperature 1, mean over positions of sum_x min(p(x), q(x)), all with
transformers' LlamaForCausalLM in float32 loaded from the bf16 files; (4) wall-clock of one target
forward over 8 tokens vs one draft forward over 1 token with the project's model (checkpoint.load_model) on
one CPU thread, medians after warm-up; (5) a sample from the target at temperature 0.7 after `def `;
(6) run.py's default prompt continued greedily for 128 tokens, and the share of its token 4-grams that are
distinct (a degenerate loop scores low); (7) (1)-(3) on as many windows from the start of the training
stream, where the target has seen the text (the gap to the held-out figures is what memorising adds);
(8) (2) by the target's confidence, its top-1 probability, binned: agreement where the target itself
is unsure is what caps (2).

    python scripts/eval_tiny.py
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # so `python scripts/eval_tiny.py` finds model.py and scripts/
    sys.path.insert(0, str(REPO))

import torch
import torch.nn.functional as F

from scripts.stdlib_corpus import read_text, split_files

TARGET_DIR = REPO / "checkpoints" / "tiny-target"
DRAFT_DIR = REPO / "checkpoints" / "tiny-draft"


# ----------------------------------------------------------------------------------------------------
# Data and the pure metrics (tests call these)

def heldout_windows(tok, seq_len: int, n_windows: int, split: int = 1) -> torch.Tensor:
    """First n_windows non-overlapping windows of the held-out stream (split=0: the training stream)
    -> LongTensor [n, seq_len + 1]. Files are encoded in sorted order only until the stream is long
    enough."""
    need = n_windows * seq_len + 1
    ids = []
    for path in split_files()[split]:
        ids += [tok.bos_token_id] + tok(read_text(path), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        if len(ids) >= need:
            break
    n = min(n_windows, (len(ids) - 1) // seq_len)
    if n == 0:
        raise ValueError(f"held-out stream has {len(ids)} tokens, fewer than one window of {seq_len + 1}: lower seq_len")
    ids = torch.tensor(ids)
    return torch.stack([ids[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])


# (8): greedy agreement by the target's own confidence, its top-1 probability, in these bins
CONFIDENCE_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)


def pair_metrics(target_logits, draft_logits, labels) -> dict:
    """target_logits, draft_logits: [..., V]; labels: [...] -> sums (not means) and the count, so that
    batches add up: target_nll, draft_nll, agree (argmax equal), accept (sum_x min(p, q)), n, and per
    bin of the target's top-1 probability (CONFIDENCE_EDGES) the positions and agreements in it."""
    lp, lq = target_logits.float().flatten(0, -2), draft_logits.float().flatten(0, -2)  # [N, V]
    y = labels.flatten()
    p = lp.softmax(-1)
    agree = lp.argmax(-1) == lq.argmax(-1)                                              # [N]
    inner = torch.tensor(CONFIDENCE_EDGES[1:-1], device=lp.device)
    bins = torch.bucketize(p.max(-1).values, inner, right=True)                         # [N]
    nbins = len(CONFIDENCE_EDGES) - 1
    return {
        "target_nll": F.cross_entropy(lp, y, reduction="sum").item(),
        "draft_nll": F.cross_entropy(lq, y, reduction="sum").item(),
        "agree": agree.sum().item(),
        "accept": torch.minimum(p, lq.softmax(-1)).sum(-1).sum().item(),
        "n": y.numel(),
        "bin_n": torch.bincount(bins, minlength=nbins),
        "bin_agree": torch.bincount(bins, weights=agree.double(), minlength=nbins),
    }


def summarize(sums: dict) -> dict:
    n = sums["n"]
    by_conf = [{"target_top1": [lo, hi], "share": k / n, "agreement": a / k if k else None}
               for lo, hi, k, a in zip(CONFIDENCE_EDGES, CONFIDENCE_EDGES[1:],
                                       sums["bin_n"].tolist(), sums["bin_agree"].tolist())]
    return {"target_loss": sums["target_nll"] / n, "draft_loss": sums["draft_nll"] / n,
            "greedy_agreement": sums["agree"] / n, "acceptance_t1": sums["accept"] / n, "positions": n,
            "agreement_by_target_confidence": by_conf}


def flops_per_token(cfg: dict, context: int = 0) -> int:
    """Forward FLOPs per token from an HF config.json dict: 2 * (every layer's matmul weights + the LM
    head), plus 4 * layers * heads * head_dim * context for attention scores and values."""
    h, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // nh
    layer = h * nh * d * 2 + h * nkv * d * 2 + 3 * h * cfg["intermediate_size"]
    return 2 * (L * layer + h * V) + 4 * L * nh * d * context


def load_hf(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.no_grad()
def evaluate_pair(target, draft, windows: torch.Tensor, batch: int = 8) -> dict:
    """HF models (input_ids -> .logits) on windows [n, T+1] -> summarize()'d metrics."""
    tot = None
    for i in range(0, len(windows), batch):
        x, y = windows[i:i + batch, :-1], windows[i:i + batch, 1:]
        m = pair_metrics(target(input_ids=x).logits, draft(input_ids=x).logits, y)
        tot = m if tot is None else {k: tot[k] + m[k] for k in tot}
    return summarize(tot)


def agreement_ceiling(metrics: dict, floor: float) -> float:
    """(2) if the draft agreed at every position where the target's top-1 probability is >= floor
    (a bin edge) and as measured elsewhere: what a better draft could gain where the target is sure."""
    total = 0.0
    for c in metrics["agreement_by_target_confidence"]:
        if c["share"]:
            total += c["share"] * (1.0 if c["target_top1"][0] >= floor else c["agreement"])
    return total


# ----------------------------------------------------------------------------------------------------
# Timing and sampling with the project's model

def median_ms(fn, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@torch.no_grad()
def time_pair(target_dir=TARGET_DIR, draft_dir=DRAFT_DIR, reps: int = 200, warmup: int = 20) -> dict:
    """One target forward over 8 tokens vs one draft forward over 1 token, one thread, float32."""
    from checkpoint import load_model
    torch.set_num_threads(1)
    target, _ = load_model(target_dir, device="cpu")
    draft, _ = load_model(draft_dir, device="cpu")
    g = torch.Generator().manual_seed(0)
    x8 = torch.randint(2, target.config.vocab_size, (1, 8), generator=g)
    x1 = x8[:, :1]
    t_ms = median_ms(lambda: target(x8), reps, warmup)
    d_ms = median_ms(lambda: draft(x1), reps, warmup)
    return {"target_8tok_ms": t_ms, "draft_1tok_ms": d_ms, "time_ratio": t_ms / d_ms}


@torch.no_grad()
def sample(target_dir=TARGET_DIR, prompt: str = "def ", max_new_tokens: int = 120, temperature: float = 0.7, seed: int = 0) -> str:
    """Plain (uncached) sampling from the target with the project's model; stops at EOS."""
    from checkpoint import load_model
    model, tok = load_model(target_dir, device="cpu")
    g = torch.Generator().manual_seed(seed)
    ids = [tok.bos_token_id] + tok(prompt, add_special_tokens=False)["input_ids"]
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids]))[0, -1]  # [V]
        nxt = torch.multinomial((logits / temperature).softmax(-1), 1, generator=g).item()
        if nxt == tok.eos_token_id:
            break
        ids.append(nxt)
    return tok.decode(ids[1:])


def distinct_ngram_ratio(tokens: list[int], n: int = 4) -> float:
    """Distinct n-grams / all n-grams of a token sequence: 1.0 never repeats, a loop of period p tends to
    p / len. A degenerate "the the the" continuation scores low; fluent code about 0.9-1."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def default_prompt_greedy(target_dir=TARGET_DIR, max_new_tokens: int = 128) -> list[int]:
    """What `python run.py` shows a new user: the README's default prompt, greedy, 128 tokens (target alone:
    SD and SSD emit the same tokens at temperature 0)."""
    from run import DEFAULT_PROMPT, generate
    return generate(DEFAULT_PROMPT, target=str(target_dir), mode="ar", max_new_tokens=max_new_tokens,
                    target_threads=1).tokens[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoints", default=str(TARGET_DIR.parent), help="dir holding tiny-target/ and tiny-draft/")
    ap.add_argument("--windows", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1, help="threads for (1)-(3); timing always uses 1")
    args = ap.parse_args()
    tdir, ddir = Path(args.checkpoints) / "tiny-target", Path(args.checkpoints) / "tiny-draft"
    if not (tdir / "model.safetensors").exists() or not (ddir / "model.safetensors").exists():
        raise SystemExit(f"no checkpoints in {args.checkpoints}: run scripts/train_tiny.py first")
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tdir)
    windows = heldout_windows(tok, args.seq_len, args.windows)
    t0 = time.time()
    target_hf, draft_hf = load_hf(tdir), load_hf(ddir)
    quality = evaluate_pair(target_hf, draft_hf, windows)
    print(f"held-out: {len(windows)} windows x {args.seq_len} positions ({time.time() - t0:.0f}s)")
    print(f"(1) loss  target {quality['target_loss']:.4f}  draft {quality['draft_loss']:.4f}  (nats/token)")
    print(f"(2) greedy agreement   {quality['greedy_agreement']:.4f}")
    print(f"(3) acceptance at T=1  {quality['acceptance_t1']:.4f}")

    cfg_t = json.loads((tdir / "config.json").read_text())
    cfg_d = json.loads((ddir / "config.json").read_text())
    flop_ratio = flops_per_token(cfg_t) / flops_per_token(cfg_d)
    timing = time_pair(tdir, ddir, args.reps)
    print(f"(4) 1 thread: target fwd 8 tok {timing['target_8tok_ms']:.3f} ms, draft fwd 1 tok "
          f"{timing['draft_1tok_ms']:.3f} ms, ratio {timing['time_ratio']:.1f}  "
          f"(medians of {args.reps}; FLOPs/token ratio from configs {flop_ratio:.2f})")
    text = sample(tdir)
    print("(5) sample, T=0.7, prompt 'def ':\n" + text)
    tokens = default_prompt_greedy(tdir)
    distinct4 = distinct_ngram_ratio(tokens)
    print(f"(6) run.py's default prompt, greedy, {len(tokens)} tokens: distinct 4-grams {distinct4:.3f}\n"
          + tok.decode(tokens))
    seen = evaluate_pair(target_hf, draft_hf, heldout_windows(tok, args.seq_len, args.windows, split=0))
    print(f"(7) training windows: loss target {seen['target_loss']:.4f} draft {seen['draft_loss']:.4f}, "
          f"greedy agreement {seen['greedy_agreement']:.4f}, acceptance {seen['acceptance_t1']:.4f}")
    print("(8) greedy agreement by the target's top-1 probability (its confidence):")
    for c in quality["agreement_by_target_confidence"]:
        lo, hi = c["target_top1"]
        agreement = "-" if c["agreement"] is None else f"{c['agreement']:.3f}"
        print(f"    [{lo:.1f}, {hi:.1f}{']' if hi == 1 else ')'}  share of positions {c['share']:.3f}  "
              f"agreement {agreement}")
    for floor in (0.3, 0.5):
        print(f"    if the draft agreed wherever the target's top-1 is >= {floor} (as now elsewhere): "
              f"{agreement_ceiling(quality, floor):.3f}")
    print(json.dumps({**quality, **timing, "flop_ratio": flop_ratio, "distinct4_default_prompt": distinct4,
                      "train_windows": seen}))


if __name__ == "__main__":
    main()
