"""Train the tiny Llama target/draft pair shipped in checkpoints/ (tiny-target, tiny-draft).

Data: the .py files of the running interpreter's standard library (site-packages and test suites
excluded), ~5% of the files held out by a hash of their relative path (see `split_files`).
Steps, all resumable from --work-dir (a scratch dir outside the repo):
  1. a byte-level BPE tokenizer (4096 tokens, <s> = BOS, </s> = EOS) on the training files;
  2. the TARGET, a 8-layer Llama (GQA, RoPE, SwiGLU, RMSNorm, tied embeddings), ~14M params, trained
     with cross-entropy on random 256-token crops of BOS+file+EOS concatenated;
  3. the DRAFT, a small Llama (1 layer by default; the shipped one has 2) with the same tokenizer and
     < 1/10 of the target's FLOPs per token,
     distilled from the target's softmax (KL(p_target || q_draft); --ce-weight mixes in CE on the data);
  4. held-out evaluation, then both models saved in bf16 as HF dirs into --out.

Four runs made the shipped pair (checkpoints/README.md has the schedules, logs and numbers):
  1. from scratch, fp32, the defaults below (370 target / 400 draft steps; the first pair, whose schedule
     was changed mid-run, so a fresh run is deterministic but not bit-identical to it):
       python scripts/train_tiny.py --out checkpoints
  2. continued from run 1's pair (--resume-from reads both models' weights and the tokenizer; the steps,
     the optimizer and the LR schedule start anew, warmup then cosine; the draft is distilled again from
     the new target, starting from its old weights), with bf16 autocast, about 1.5 hours of a 2-core CPU:
       python scripts/train_tiny.py --resume-from checkpoints --target-steps 1800 --draft-steps 1200 \
           --autocast bf16 --out checkpoints
     (the weights are read at the start and written at the end, so --out may be the --resume-from dir).
  4. the draft run 7 started from: run 2's target unchanged (--target-steps 0), the draft grown to
     2 layers (2 query heads of 64, SwiGLU 384; grow_draft) and distilled again, 45 minutes:
       python scripts/train_tiny.py --resume-from checkpoints --target-steps 0 --draft-steps 2600 \
           --draft-layers 2 --draft-heads 2 --draft-intermediate 384 --autocast bf16 --out <out>
  7. the shipped pair: run 2's target fine-tuned against greedy loops (sequence-level unlikelihood,
     train_unlikelihood), then run 4's draft distilled from it with half of each batch the target's own
     greedy continuations (--on-policy), 28 minutes:
       python scripts/train_tiny.py --resume-from checkpoints --target-steps 0 --ul-steps 150 \
           --draft-steps 0 --seed 6 --autocast bf16 --out <ul out>
       python scripts/train_tiny.py --resume-from <ul out> --target-steps 0 --draft-steps 600 \
           --draft-lr 1e-3 --on-policy 0.5 --seed 7 --autocast bf16 --out <out>
  (Runs 3 and 5 continued the target's CE training, run 6 was run 7's first stage with the draft
  distilled on training text only; none was shipped, and checkpoints/README.md says why. Its (7) also
  records short --distill-temp runs: a sharper target law lowered greedy agreement.)
A run is resumable after a kill: run the same command again with the same --work-dir.
"""
import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # so `python scripts/train_tiny.py` can import scripts.eval_tiny
    sys.path.insert(0, str(REPO))

from scripts.stdlib_corpus import read_text, split_files  # noqa: E402  (after the path is set)

SEED = 1234
VOCAB_SIZE = 4096
BOS, EOS = "<s>", "</s>"

TARGET_ARCH = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
                   num_attention_heads=6, num_key_value_heads=2)
DRAFT_ARCH = dict(hidden_size=192, intermediate_size=768, num_hidden_layers=1,
                  num_attention_heads=3, num_key_value_heads=1, head_dim=64)


# ----------------------------------------------------------------------------------------------------
# Data: which files, the tokenizer, the token stream

def train_tokenizer(paths, out_dir: Path):
    """Byte-level BPE with BOS/EOS specials, saved as a transformers fast tokenizer -> the tokenizer.
    It puts BOS before a text itself (as a Llama's does): the models are trained on BOS + file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((read_text(p) for p in paths), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, tok.token_to_id(BOS))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)
    fast.save_pretrained(out_dir)
    return fast


def encode_files(tok, paths):
    """-> LongTensor: BOS + tokens + EOS of every file, concatenated in the given order."""
    import torch
    ids = []
    for p in paths:
        ids.append(tok.bos_token_id)
        ids.extend(tok(read_text(p), add_special_tokens=False)["input_ids"])
        ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.int16 if len(tok) < 2**15 else torch.int32)


def prepare_data(work: Path, tok=None):
    """Tokenizer and token streams, cached in work/data -> (tokenizer, train_ids, heldout_ids).
    tok: an existing tokenizer to encode with (a resumed run keeps the shipped one); None trains one."""
    import torch
    from transformers import PreTrainedTokenizerFast
    data = work / "data"
    if not (data / "train.pt").exists():
        t0 = time.time()
        train, heldout = split_files()
        print(f"data: {len(train)} train files, {len(heldout)} held-out files", flush=True)
        data.mkdir(parents=True, exist_ok=True)
        if tok is None:
            tok = train_tokenizer(train, data / "tokenizer")
        else:
            tok.save_pretrained(data / "tokenizer")
        torch.save(encode_files(tok, heldout), data / "heldout.pt")
        torch.save(encode_files(tok, train), data / "train.pt")
        print(f"data: tokenizer + encoding took {time.time() - t0:.0f}s", flush=True)
    tok = PreTrainedTokenizerFast.from_pretrained(data / "tokenizer")
    train_ids, heldout_ids = torch.load(data / "train.pt").long(), torch.load(data / "heldout.pt").long()
    print(f"data: {len(train_ids)} train tokens, {len(heldout_ids)} held-out tokens", flush=True)
    return tok, train_ids, heldout_ids


def get_batch(ids, batch_size, seq_len, step, seed):
    """Random crops; the generator is seeded by the step so a resumed run draws the same batches."""
    import torch
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(ids) - seq_len - 1, (batch_size,), generator=g)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]  # [B, T+1]
    chunk = ids[idx]
    return chunk[:, :-1], chunk[:, 1:]


def heldout_batches(ids, seq_len, max_windows):
    """Deterministic, non-overlapping windows from the start of the held-out stream -> [N, T+1]."""
    n = min(max_windows, (len(ids) - 1) // seq_len)
    return [ids[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)]


# ----------------------------------------------------------------------------------------------------
# Models

def make_config(arch, tok, seq_len):
    from transformers import LlamaConfig
    arch = dict(arch)
    head_dim = arch.pop("head_dim", arch["hidden_size"] // arch["num_attention_heads"])
    return LlamaConfig(vocab_size=len(tok), max_position_embeddings=2048, rms_norm_eps=1e-5,
                       hidden_act="silu", attention_bias=False, mlp_bias=False, tie_word_embeddings=True,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=None,
                       head_dim=head_dim, rope_theta=10000.0,
                       **arch)


def flop_params(cfg) -> int:
    """Matmul parameters touched per token (every layer + the LM head; not the embedding lookup).
    Forward FLOPs per token ~= 2 * this (plus attention over the context, which favours the draft)."""
    h, i, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    d = cfg.head_dim
    attn = h * cfg.num_attention_heads * d * 2 + h * cfg.num_key_value_heads * d * 2
    return L * (attn + 3 * h * i) + h * V


def grow_draft(old, new):
    """Initialise `new` (a draft with more layers, other head counts and/or another MLP width) from
    a trained draft `old`: tensors of the same shape are copied; a narrower MLP keeps the hidden
    units whose gate/up rows and down column carry the most weight (a wider one keeps them all);
    fewer query heads keep the first ones (their q_proj rows and o_proj columns), more keep all the
    old ones; the parts and layers `old` lacks keep their random init.
    Distillation then starts from the old draft's knowledge instead of from scratch."""
    import torch
    old_sd, new_sd = old.state_dict(), new.state_dict()  # new_sd's tensors share new's storage
    with torch.no_grad():
        for name, p in new_sd.items():
            if name not in old_sd:
                continue  # a new layer
            o = old_sd[name]
            if o.shape == p.shape:
                p.copy_(o)
            elif name.endswith(("up_proj.weight", "gate_proj.weight")):
                continue  # a narrower MLP's input side goes with its down_proj, below
            elif name.endswith("mlp.down_proj.weight"):  # [hidden, intermediate]
                prefix = name[: -len("down_proj.weight")]
                up, gate = old_sd[prefix + "up_proj.weight"], old_sd[prefix + "gate_proj.weight"]
                n = min(p.shape[1], o.shape[1])  # a wider MLP keeps every old unit, the rest random
                keep = (o.norm(dim=0) * up.norm(dim=1) * gate.norm(dim=1)).topk(n).indices.sort().values
                p[:, :n].copy_(o[:, keep])
                new_sd[prefix + "up_proj.weight"][:n].copy_(up[keep])
                new_sd[prefix + "gate_proj.weight"][:n].copy_(gate[keep])
            elif name.endswith("q_proj.weight"):  # [heads * head_dim, hidden]: the first heads
                n = min(p.shape[0], o.shape[0])
                p[:n].copy_(o[:n])
            elif name.endswith("o_proj.weight"):  # [hidden, heads * head_dim]
                n = min(p.shape[1], o.shape[1])
                p[:, :n].copy_(o[:, :n])
            else:
                raise ValueError(f"grow_draft: cannot map {name} {tuple(o.shape)} -> {tuple(p.shape)}")


def lr_at(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model, lr):
    import torch
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


# ----------------------------------------------------------------------------------------------------
# Training loops (each resumes from work/<name>.pt)

def save_state(path: Path, model, opt, step):
    import torch
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def train_loop(name, model, opt, total_steps, peak_lr, loss_fn, train_ids, args, heldout_loss=None):
    """Generic loop: resume, step with warmup+cosine LR and grad clipping, checkpoint every few minutes.
    Forward passes run under bf16 autocast when args.autocast == "bf16" (fp32 master weights and
    optimizer state; about 2x faster per step on a CPU with AVX512-BF16). heldout_loss(), if given, is
    printed every args.eval_every steps, so overfitting shows in the log."""
    import torch
    from tqdm import tqdm
    state_path = Path(args.work_dir) / f"{name}.pt"
    start = 0
    if state_path.exists():
        st = torch.load(state_path, map_location=args.device)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        start = st["step"]
        print(f"{name}: resumed at step {start}", flush=True)
    model.train()
    last_save, ema = time.time(), None
    bar = tqdm(range(start, total_steps), desc=name, mininterval=30, file=sys.stdout)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total_steps, peak_lr, args.warmup)
        x, y = get_batch(train_ids, args.batch_size, args.seq_len, step, args.seed + hash_name(name))
        with torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16, enabled=args.autocast == "bf16"):
            loss = loss_fn(x.to(args.device), y.to(args.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}", refresh=False)
        if step % 50 == 0:
            print(f"{name} step {step}/{total_steps} loss {ema:.4f} lr {opt.param_groups[0]['lr']:.2e}", flush=True)
        if heldout_loss is not None and ((step + 1) % args.eval_every == 0 or step + 1 == total_steps):
            model.eval()
            print(f"{name} step {step + 1} held-out {heldout_loss():.4f}", flush=True)
            model.train()
        if time.time() - last_save > args.save_every_s or step + 1 == total_steps:
            save_state(state_path, model, opt, step + 1)
            last_save = time.time()
    bar.close()
    model.eval()


def hash_name(name: str) -> int:
    return int(hashlib.md5(name.encode()).hexdigest()[:6], 16)


def lm_loss(model, x, y):
    """Mean next-token cross-entropy of `model` on x [B, T] against y [B, T]."""
    import torch.nn.functional as F
    logits = model(input_ids=x).logits  # [B, T, V]
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def heldout_logger(model, heldout, args):
    """heldout: [N, T+1] windows -> a function train_loop calls to log their mean loss (None: none)."""
    import torch
    if heldout is None:
        return None
    return torch.no_grad()(lambda: lm_loss(model, heldout[:, :-1].to(args.device),
                                           heldout[:, 1:].to(args.device)).item())


def train_target(target, train_ids, args, heldout=None):
    """Cross-entropy. heldout: [N, T+1] windows whose mean loss is logged during training (or None)."""
    opt = make_optimizer(target, args.target_lr)
    train_loop("target", target, opt, args.target_steps, args.target_lr,
               lambda x, y: lm_loss(target, x, y), train_ids, args, heldout_logger(target, heldout, args))


def greedy_continuations(target, prefix, n_new: int):
    """prefix [R, P] -> [R, P + n_new]: each row continued greedily by the target, the text a draft
    has to predict when the engine decodes at temperature 0 (on-policy data)."""
    import torch
    with torch.no_grad():
        return target.generate(prefix, max_new_tokens=n_new, do_sample=False, eos_token_id=None,
                               pad_token_id=0)


def repeated_ngram_mask(seq, n: int, start: int):
    """seq [B, L] tokens -> bool [B, L]: True at each position i >= start whose token completes an n-gram
    that already occurred earlier in its row (a loop in the making)."""
    import torch
    mask = torch.zeros(seq.shape, dtype=torch.bool)
    for r, row in enumerate(seq.tolist()):
        seen = {tuple(row[i - n + 1:i + 1]) for i in range(n - 1, start)}
        for i in range(max(start, n - 1), len(row)):
            gram = tuple(row[i - n + 1:i + 1])
            mask[r, i] = gram in seen
            seen.add(gram)
    return mask


def train_unlikelihood(target, train_ids, args, heldout=None):
    """Sequence-level unlikelihood (Welleck et al., 2020): the target continues the first args.ul_prefix
    tokens of half the batch's crops greedily for args.ul_len tokens, and each continuation token that
    repeats a 4-gram already in its row gets -log(1 - p(token)); cross-entropy on the crops keeps the
    language. Greedy decoding of a small model loops; this trains the loop's tokens down."""
    import torch
    import torch.nn.functional as F
    opt = make_optimizer(target, args.ul_lr)

    def loss_fn(x, y):
        seq = greedy_continuations(target, x[: len(x) // 2, : args.ul_prefix], args.ul_len)  # [B/2, P + L]
        mask = repeated_ngram_mask(seq, 4, args.ul_prefix)[:, 1:].to(seq.device)
        logp = F.log_softmax(target(input_ids=seq[:, :-1]).logits.float(), dim=-1)  # [B/2, L-1, V]
        p = logp.gather(-1, seq[:, 1:, None]).squeeze(-1).exp()
        ul = -(torch.log1p(-p.clamp(max=1 - 1e-5)) * mask).sum() / mask.sum().clamp(min=1)
        return lm_loss(target, x, y) + args.ul_weight * ul

    train_loop("unlikelihood", target, opt, args.ul_steps, args.ul_lr, loss_fn, train_ids, args,
               heldout_logger(target, heldout, args))


def distill_kl(draft, target, x, start: int = 0, temp: float = 1.0):
    """Mean forward KL(p_target || q_draft) over the positions t >= start of x [B, T] (the position
    t predicts token t + 1), and the draft's log-probabilities [B, T, V] for a CE term. temp < 1
    sharpens p (softmax of logits / temp) toward its argmax, the token greedy decoding checks; at 0
    the loss is the cross-entropy of the target's argmax (hard labels)."""
    import torch
    import torch.nn.functional as F
    with torch.no_grad():
        logits = target(input_ids=x).logits.float()  # [B, T, V]
    logq = F.log_softmax(draft(input_ids=x).logits.float(), dim=-1)
    if temp == 0:
        kl = -logq.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1)  # [B, T]
    else:
        logp = F.log_softmax(logits / temp, dim=-1)
        kl = (logp.exp() * (logp - logq)).sum(-1)  # [B, T]
    return kl[:, start:].mean(), logq


def train_draft(draft, target, train_ids, args):
    """Distillation: forward KL(p || q) per position to the target's softmax, plus args.ce_weight * CE.
    With args.on_policy > 0 that share of the batch's rows is replaced by the target's own greedy
    continuations of the rows' first args.ul_prefix tokens (args.ul_len new tokens each), and the
    loss mixes the KL on those continuations in with the same weight."""
    import torch.nn.functional as F
    opt = make_optimizer(draft, args.draft_lr)
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)

    def loss_fn(x, y):
        r = round(len(x) * args.on_policy)
        kl, logq = distill_kl(draft, target, x[r:], temp=args.distill_temp)
        ce = F.nll_loss(logq.flatten(0, 1), y[r:].flatten())
        loss = (1 - args.ce_weight) * kl + args.ce_weight * ce
        if r == 0:
            return loss
        seq = greedy_continuations(target, x[:r, :args.ul_prefix], args.ul_len)  # [r, P + L]
        kl_on, _ = distill_kl(draft, target, seq[:, :-1], start=args.ul_prefix - 1,
                              temp=args.distill_temp)
        return (1 - args.on_policy) * loss + args.on_policy * kl_on
    train_loop("draft", draft, opt, args.draft_steps, args.draft_lr, loss_fn, train_ids, args)


# ----------------------------------------------------------------------------------------------------
# Evaluation and export

def export(model, tok, out_dir: Path):
    import torch
    from transformers import GenerationConfig
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    model.float()
    tok.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, do_sample=True,
                     temperature=0.7, max_new_tokens=128).save_pretrained(out_dir)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "checkpoints"))
    ap.add_argument("--work-dir", default=None,
                    help="scratch dir for resumable state, outside the repo (default: train_tiny, or "
                         "train_tiny_resumed with --resume-from, in the system's temporary directory)")
    ap.add_argument("--device", default=None, help="default: cuda if available else cpu")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--target-steps", type=int, default=370)
    ap.add_argument("--draft-steps", type=int, default=400)
    ap.add_argument("--target-lr", type=float, default=2e-3)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--seed", type=int, default=SEED,
                    help="seeds the training crops (weights are initialised from the fixed seed); a continued "
                         "run with a new seed reads other crops than the run it continues")
    ap.add_argument("--ce-weight", type=float, default=0.0)
    ap.add_argument("--distill-temp", type=float, default=1.0,
                    help="the target's softmax temperature in the distillation KL: 1 plain, < 1 sharper "
                         "(toward greedy agreement), 0 the CE of the target's argmax")
    ap.add_argument("--ul-steps", type=int, default=0,
                    help="unlikelihood steps on the target after its CE steps (train_unlikelihood; 0: none)")
    ap.add_argument("--ul-lr", type=float, default=3e-4)
    ap.add_argument("--ul-weight", type=float, default=1.0)
    ap.add_argument("--ul-prefix", type=int, default=64, help="tokens of each crop the greedy continuation starts from")
    ap.add_argument("--ul-len", type=int, default=64, help="greedy tokens generated per crop and step")
    ap.add_argument("--on-policy", type=float, default=0.0,
                    help="share of each distillation batch replaced by the target's greedy continuations "
                         "(--ul-prefix tokens of a crop continued for --ul-len tokens; train_draft)")
    ap.add_argument("--save-every-s", type=float, default=180)
    ap.add_argument("--eval-windows", type=int, default=128)
    ap.add_argument("--eval-every", type=int, default=250, help="log the target's held-out loss (16 windows) every N steps")
    ap.add_argument("--autocast", choices=["bf16", "none"], default="none",
                    help="bf16: forward passes under bf16 autocast (fp32 master weights); none: plain fp32")
    # the draft's shape: by default DRAFT_ARCH's from scratch, the resumed draft's with --resume-from
    ap.add_argument("--draft-layers", type=int, default=None)
    ap.add_argument("--draft-heads", type=int, default=None, help="the draft's query heads (of head_dim 64)")
    ap.add_argument("--draft-intermediate", type=int, default=None,
                    help="the draft's SwiGLU width; with --resume-from, a draft of another shape is grown "
                         "from the shipped one (grow_draft)")
    ap.add_argument("--resume-from", default=None, metavar="DIR",
                    help="continue from a shipped pair: DIR/tiny-target and DIR/tiny-draft (weights and tokenizer) "
                         "instead of a new tokenizer and random weights; the step counts and LR schedule start anew")
    args = ap.parse_args()
    if args.distill_temp < 0:
        ap.error(f"--distill-temp {args.distill_temp}: give a temperature >= 0")
    if not 0 <= args.on_policy < 1:  # 1 would leave no data rows, whose KL the loss also averages
        ap.error(f"--on-policy {args.on_policy}: give a share in [0, 1)")

    import torch
    from transformers import LlamaForCausalLM
    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # a resumed run keeps its state apart: its step counts would otherwise resume the from-scratch run's
    args.work_dir = args.work_dir or os.path.join(tempfile.gettempdir(),
                                                  "train_tiny_resumed" if args.resume_from else "train_tiny")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    print(f"args: {vars(args)}", flush=True)
    base = DRAFT_ARCH
    if args.resume_from:
        base = json.loads((Path(args.resume_from) / "tiny-draft" / "config.json").read_text())
    shape_args = {"num_hidden_layers": args.draft_layers, "intermediate_size": args.draft_intermediate,
                  "num_attention_heads": args.draft_heads}
    draft_arch = dict(DRAFT_ARCH, **{k: base[k] if v is None else v for k, v in shape_args.items()})

    if args.resume_from:
        from transformers import PreTrainedTokenizerFast
        src = Path(args.resume_from)
        tok, train_ids, heldout_ids = prepare_data(work, PreTrainedTokenizerFast.from_pretrained(src / "tiny-target"))
        # the shipped files are bf16; training continues in fp32 master weights
        target = LlamaForCausalLM.from_pretrained(src / "tiny-target", torch_dtype=torch.float32).to(args.device)
        draft = LlamaForCausalLM.from_pretrained(src / "tiny-draft", torch_dtype=torch.float32).to(args.device)
        shape = lambda c: (c["num_hidden_layers"], c["intermediate_size"], c["num_attention_heads"])
        if shape(draft.config.to_dict()) != shape(draft_arch):
            torch.manual_seed(SEED + 1)
            grown = LlamaForCausalLM(make_config(draft_arch, tok, args.seq_len)).to(args.device)
            grow_draft(draft, grown)
            draft = grown
            print(f"draft grown to (layers, intermediate, heads) = {shape(draft_arch)}", flush=True)
        print(f"resumed weights and tokenizer from {src}", flush=True)
    else:
        tok, train_ids, heldout_ids = prepare_data(work)
        torch.manual_seed(SEED)
        target = LlamaForCausalLM(make_config(TARGET_ARCH, tok, args.seq_len)).to(args.device)
        torch.manual_seed(SEED + 1)
        draft = LlamaForCausalLM(make_config(draft_arch, tok, args.seq_len)).to(args.device)
    ft, fd = flop_params(target.config), flop_params(draft.config)
    print(f"target: {sum(p.numel() for p in target.parameters())/1e6:.2f}M params, draft: "
          f"{sum(p.numel() for p in draft.parameters())/1e6:.2f}M params, FLOP ratio {ft / fd:.2f}", flush=True)

    t0 = time.time()
    heldout16 = torch.stack(heldout_batches(heldout_ids, args.seq_len, 16))
    train_target(target, train_ids, args, heldout16)
    print(f"target training: {time.time() - t0:.0f}s", flush=True)
    if args.ul_steps:
        t0 = time.time()
        train_unlikelihood(target, train_ids, args, heldout16)
        print(f"target unlikelihood: {time.time() - t0:.0f}s", flush=True)
    t0 = time.time()
    train_draft(draft, target, train_ids, args)
    print(f"draft distillation: {time.time() - t0:.0f}s", flush=True)

    from scripts.eval_tiny import evaluate_pair  # the same metrics eval_tiny.py reports for the shipped pair
    windows = torch.stack(heldout_batches(heldout_ids, args.seq_len, args.eval_windows)).to(args.device)
    metrics = evaluate_pair(target, draft, windows)
    metrics["train_seconds"] = round(time.time() - t_start)
    print("held-out: " + json.dumps(metrics), flush=True)
    (work / "metrics.json").write_text(json.dumps(metrics, indent=1))
    out = Path(args.out)
    export(target, tok, out / "tiny-target")
    export(draft, tok, out / "tiny-draft")
    print(f"saved to {out}; total {time.time() - t_start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
