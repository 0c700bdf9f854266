"""Train an EAGLE-3 head (eagle.py) for any target this engine loads: on a CPU in hours, resumable.

    python scripts/train_eagle.py --target smollm2-135m --out checkpoints/smollm2-135m-eagle \\
        --work-dir ~/.cache/ssd-eagle/data --prompts 4000 \\
        --prompt-source templates:0.4,self:0.3,code:0.3 --template-set 0 --greedy-share 1

Stages, each resumable from --work-dir (run the same command again after a kill: the answers and
features made are read back, training goes on from its last save, at most --save-every-s ago; Ctrl-C
saves first):

  1. data      the target's answers to chat, self-written and code prompts, and the held-out sets
               (chat, self, HumanEval), made by scripts/distill_draft.py's own stages: every flag
               this script does not know is one of distill_draft.py's data flags, and the same
               work dir shares the answers (a distillation's answers are read back, not made again).
  2. features  the target's three layers' outputs (eagle.default_layers, or --layers) at every
               position of every prompt and answer, computed once in bf16 (work/features, a file
               per 64 answers): one target forward per token, where training reads them for epochs.
               With --text-tokens, also text the target only reads (section 2b): the labels and
               the features of the standard library's code from one forward, about half an
               answer's price a token.
  3. train     training-time test (eagle.EagleHead.train_forward): --ttt steps, each on the head's
               own outputs of the step before; at every step the KL from the target's top-k law (the
               label distill_draft stored at each answer position) to the head's law over its own
               rows, the target's mass outside them as one bucket. AdamW, warm-up then cosine.
               Resumes from work/eagle.pt. Every --eval-every steps, on each held-out set: greedy
               SD at K = --eval-k simulated exactly on the target's greedy answers (the head drafts
               from the true prefix's features, then from itself, as in SD; accepted tokens are
               the target's): per-token acceptance a = accepted / trials, tokens a round, and the
               acceptance at each draft position.
  4. export    --out, at each evaluation whose mean held-out acceptance is the best so far:
               config.json and model.safetensors (eagle.save), train.json with the command, data,
               step, time and metrics.

The head starts from the target where the two share a space: its lm_head is the target's head rows
of the draft's vocabulary, its final norm the target's; fc and the layer start random.
"""
import argparse
import contextlib
import hashlib
import json
import os
import random
import signal
import sys
import sysconfig
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # so `python scripts/train_eagle.py` imports the engine
    sys.path.insert(0, str(REPO))

import eagle  # noqa: E402  (after the path is set)
from checkpoint import load_model  # noqa: E402
from quantize import QuantLinear  # noqa: E402
from scripts import distill_draft as dd  # noqa: E402
from scripts.prompt_sets import HUMANEVAL_SIZE, humaneval_installed  # noqa: E402
from scripts.train_tiny import lr_at  # noqa: E402


DEFAULT_VOCAB = 8192


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Any other flag is a data flag of scripts/distill_draft.py "
                                        "(--prompts, --prompt-source, --template-set, ...).")
    ap.add_argument("--target", required=True, help="any model run.py loads (alias, dir, GGUF)")
    ap.add_argument("--out", required=True, help="the head's directory")
    ap.add_argument("--work-dir", required=True, help="resumable state, shared with distill_draft")
    ap.add_argument("--device", default="cpu",
                    help="where the target and the head run: %(default)s")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--layers", type=dd.int_list, default=None,
                    help="the three target layers fused (default: eagle.default_layers)")
    ap.add_argument("--vocab", type=int, default=None,
                    help=f"rows of the head's vocabulary, at most the target's (default: "
                         f"{DEFAULT_VOCAB}, or all the target's where it has fewer)")
    ap.add_argument("--ttt", type=int, default=4, help="training-time test steps: %(default)s")
    ap.add_argument("--steps", type=int, default=2000, help="optimizer steps in all: %(default)s")
    ap.add_argument("--batch-tokens", type=int, default=4096, help="tokens a batch: %(default)s")
    ap.add_argument("--lr", type=float, default=1e-3,
                    help="peak learning rate (cosine decay): %(default)s")
    ap.add_argument("--warmup", type=int, default=50, help="steps of linear warm-up: %(default)s")
    ap.add_argument("--text-tokens", type=int, default=0,
                    help="tokens of text the target reads, beside the answers (section 2b): "
                         "%(default)s")
    ap.add_argument("--text-window", type=int, default=512,
                    help="tokens a text example: %(default)s")
    ap.add_argument("--eval-every", type=int, default=200,
                    help="steps between evaluations: %(default)s")
    ap.add_argument("--eval-k", type=int, default=4, help="K of the simulated SD: %(default)s")
    ap.add_argument("--save-every-s", type=float, default=120,
                    help="seconds between saves: %(default)s")
    ap.add_argument("--bf16", action="store_true",
                    help="bf16 autocast: on a GPU, and on a CPU with AMX (a step of the SmolLM2 "
                         "head in 0.67-0.7x float32's on a 2-core Xeon); not elsewhere (on a "
                         "2-core EPYC its backward took 25x float32's, so float32 is the default)")
    ap.add_argument("--seed", type=int, default=0,
                    help="the head's initialisation and the batches' order: %(default)s")
    args, data_argv = ap.parse_known_args(argv)
    if args.ttt < 1 or args.eval_k < 1:
        ap.error("--ttt and --eval-k: give at least 1")
    if args.layers is not None and len(args.layers) != 3:
        ap.error(f"--layers {','.join(map(str, args.layers))}: an EAGLE-3 head fuses three "
                 "layers of the target")
    dd.check_counts(ap, args, positive=("threads", "vocab", "steps", "batch_tokens", "lr",
                                        "eval_every", "save_every_s", "text_window"),
                   at_least_0=("warmup", "text_tokens"))
    return args, data_argv


# --------------------------------------------------------------------------------------------------
# 2. Features

FEATURE_CHUNK = 64


def chunks(examples: list[dict]):
    """(start, examples) runs of at most FEATURE_CHUNK from one answers file (distill_draft tags
    each answer with its file): a source's chunks stay whole wherever more prompts move them."""
    start = 0
    for i in range(1, len(examples) + 1):
        if (i == len(examples) or i - start == FEATURE_CHUNK
                or examples[i].get("chunk") != examples[start].get("chunk")):
            yield start, examples[start:i]
            start = i


def padded(seqs: list[list[int]]) -> torch.Tensor:
    """Token lists right-padded into [B, L] (causal: a position never sees the padding)."""
    x = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    for r, ids in enumerate(seqs):
        x[r, :len(ids)] = torch.tensor(ids)
    return x


def reader_of(target, args):
    """The model the features and the text's labels are read from: the target itself where its
    weights are float, a quantized target's weights dequantized to float32 (the same model to within
    the int4 kernels' 16-bit activations: SmolLM2-135M from its Q4_1 file, 2,048 tokens, relative
    difference 3e-4 at the three layers, KL 0.00000 at the logits, top-1 the same everywhere); at
    thousands of rows a float matrix product outruns the int4 kernels (2x on the 2-core Xeon, 4x
    in bf16 through AMX: --bf16)."""
    if not any(isinstance(m, QuantLinear) for m in target.modules()):
        return target
    return load_model(args.target, device=args.device, dtype="float32", tokenizer=False,
                      quant="none")[0]


@torch.no_grad()
def features(target, examples: list[dict], layers: list[int], work: Path, name: str,
             batch_tokens: int, bf16: bool = False) -> list[torch.Tensor]:
    """The target's layers' outputs at every position of prompt + answer, [L, 3, H] bf16 each, in
    chunk files named by the chunk's tokens and the layers (a changed set is computed anew).
    bf16: computed in bf16 autocast (0.4-0.8% relative difference at the three layers, about twice
    their bf16 storage's rounding; EAGLE's first paper adds larger noise to its features on
    purpose), the files' names unchanged: a work dir may hold both."""
    folder = work / "features"
    folder.mkdir(exist_ok=True)
    out = []
    # the files made so far, by their contents' key: a chunk is found wherever it stood (more
    # prompts move a source's answers along)
    made = {}
    for p in sorted(folder.glob(f"{name}_*_*.pt")):
        made.setdefault(p.stem.rsplit("_", 1)[1], p)
    for c, chunk in chunks(examples):
        seqs = [ex["prompt"] + ex["answer"] for ex in chunk]
        key = hashlib.md5(f"{layers} {seqs}".encode()).hexdigest()[:8]
        path = made.get(key, folder / f"{name}_{c:05d}_{key}.pt")
        if not path.exists():
            part = [None] * len(seqs)
            order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
            while order:  # batches of similar lengths, right-padded (causal: padding unseen)
                n = max(1, batch_tokens // len(seqs[order[0]]))
                rows, order = order[:n], order[n:]
                x = padded([seqs[i] for i in rows])
                with autocast(target.device, bf16):
                    h = target.layer_states(x.to(target.device), layers)
                h = h.to(torch.bfloat16).cpu()
                for r, i in enumerate(rows):
                    part[i] = h[r, :len(seqs[i])].clone()
            torch.save(part, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
        out += torch.load(path, mmap=True)  # read as batches need them, not all in memory
    return out


# --------------------------------------------------------------------------------------------------
# 2b. Text the target reads (--text-tokens)
#
# The answers cost a decode step a token, and a forward more for their features; a text the
# target only reads costs that forward alone (it gives the features and, from its logits, the
# label at every position): SmolLM2-135M on the 2-core EPYC, 4.1 ms a token against 7.3. EAGLE
# (the first paper) trained on fixed text, not on the target's own answers, and found its drafts
# barely worse: the label is the target's law at each position either way, only the context is the
# text's. The text: the Python standard library's modules inside its packages (email/, json/,
# asyncio/ ..., pydoc_data's prose: code and English, on every machine, no download), not the
# tests, not the codecs' tables (encodings/), not the package __init__.py files nor the top-level
# modules, whose docstrings the held-out chat prompts quote.

def text_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "encodings"}  # encodings: code tables
    files = [p for p in sorted(root.glob("*/**/*.py"))
             if p.name != "__init__.py" and not skip & set(p.relative_to(root).parts)]
    random.Random(0).shuffle(files)  # every package a little, in a fixed order
    return files


def text_windows(tok, n_tokens: int, window: int) -> list[list[int]]:
    """About n_tokens of the files' raw tokens, in windows of `window` (each file cut on its own;
    a file's last piece kept when it has at least 64 tokens)."""
    out, total = [], 0
    for path in text_files():
        ids = dd.encode_raw(tok, path.read_text(errors="replace"))
        for a in range(0, len(ids), window):
            piece = ids[a:a + window]
            if len(piece) >= 64 and total < n_tokens:
                out.append(piece)
                total += len(piece)
        if total >= n_tokens:
            break
    return out


@torch.no_grad()
def text_examples(target, tok, layers: list[int], work: Path, args, topk: int) -> list[dict]:
    """Examples of the answers' form from --text-tokens of text: prompt its first token, answer
    the rest, the label at each position the target's top-k law (log-probs), and the features,
    from one forward a batch (in bf16 autocast under --bf16: on SmolLM2-135M, 2,048 tokens of
    code, KL 0.0009 nats from float32's law on average and 0.015 at most: the top token moved at
    2.3% of the positions, all near-ties); in chunk files of 64 windows named by their tokens and
    the layers."""
    folder = work / "features"
    folder.mkdir(exist_ok=True)
    windows, out = text_windows(tok, args.text_tokens, args.text_window), []
    for c in range(0, len(windows), FEATURE_CHUNK):
        chunk = windows[c:c + FEATURE_CHUNK]
        key = hashlib.md5(f"{layers} {topk} {chunk}".encode()).hexdigest()[:8]
        path = folder / f"text_{c:05d}_{key}.pt"
        if not path.exists():
            t0, part = time.time(), []
            n = max(1, 2048 // args.text_window)  # the logits of 2,048 positions: 400 MB
            for b in range(0, len(chunk), n):
                rows = chunk[b:b + n]
                with autocast(target.device, args.bf16):
                    logits, h = target(padded(rows).to(target.device), layers)  # [B,T,V],[B,T,3,H]
                top = F.log_softmax(logits.float(), -1).topk(topk, -1)
                for r, ids in enumerate(rows):  # position i's law is the label of token i + 1
                    T = len(ids)
                    part.append({"prompt": ids[:1], "answer": ids[1:], "greedy": False,
                                 "top_ids": top.indices[r, :T - 1].to(torch.int32).cpu(),
                                 "top_logp": top.values[r, :T - 1].half().cpu(),
                                 "features": h[r, :T].to(torch.bfloat16).cpu().clone()})
            torch.save(part, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
            dd.log(work, f"text {c + len(chunk)}/{len(windows)} windows: "
                         f"{sum(map(len, chunk))} tokens in {time.time() - t0:.0f}s")
        out += torch.load(path, mmap=True)
    return out


# --------------------------------------------------------------------------------------------------
# 3. Training-time test

def collate(batch: list[dict], steps: int, row_of, device):
    """An example batch (each with its "features", main) -> tokens [B, L], features [B, L, 3, H],
    and for each step j: (the flat entry indices
    [N_j] into [B * L] whose prediction has a label, the label's top-k ids as the head's rows
    [N_j, k] (-1 outside its vocabulary), their log-probs [N_j, k]). Step j's entry i predicts
    x_{i+1+j}; answer token a (at sequence index P + a) has label row a."""
    L = max(len(ex["prompt"]) + len(ex["answer"]) for ex in batch)
    x = torch.zeros(len(batch), L, dtype=torch.long)
    f = torch.zeros(len(batch), L, *batch[0]["features"].shape[1:], dtype=torch.bfloat16)
    labels = []
    for j in range(steps):
        where, ids, logp = [], [], []
        for r, ex in enumerate(batch):
            P, A = len(ex["prompt"]), len(ex["answer"])
            a0 = max(0, j + 1 - P)  # entry i = P + a - 1 - j >= 0
            if a0 >= A:
                continue
            where.append(r * L + torch.arange(P + a0 - 1 - j, P + A - 1 - j))
            ids.append(ex["top_ids"][a0:].long())
            logp.append(ex["top_logp"][a0:].float())
        ids = row_of[torch.cat(ids)]
        labels.append((torch.cat(where).to(device), ids.to(device), torch.cat(logp).to(device)))
    for r, ex in enumerate(batch):
        seq = ex["prompt"] + ex["answer"]
        x[r, :len(seq)] = torch.tensor(seq)
        f[r, :len(seq)] = ex["features"]
    return x.to(device), f.to(device), labels


def topk_kl(own_logits, rows, top_logp):
    """KL(p || q) per position: p the target's law on its top-k tokens (rows -1: outside the
    head's vocabulary) plus the rest of its mass as one bucket, q the head's law over its rows
    coarsened the same way. -> [N]."""
    logq = F.log_softmax(own_logits.float(), -1)
    inside = rows >= 0
    logq_top = logq.gather(-1, rows.clamp_min(0))
    p_top = top_logp.exp() * inside
    q_rest = (1 - (logq_top.exp() * inside).sum(-1)).clamp_min(1e-8)
    p_rest = (1 - p_top.sum(-1)).clamp_min(1e-8)
    top = torch.where(inside & (p_top > 0), p_top * (top_logp - logq_top), 0.0)
    return top.sum(-1) + p_rest * (p_rest.log() - q_rest.log())


def own_logits(head, h, where):
    """The head's logits over its own rows at the labelled entries: h [B, L, H] -> [N, rows]."""
    return head.lm_head(head.norm(h.flatten(0, 1)[where]))


def sd_rounds(agree: torch.Tensor, P: int, K: int) -> tuple[int, int, int, list, list]:
    """Greedy SD at K over one answer, from the head's agreement agree [K, T] (agree[j, i]: step j
    of a round drafted after entry i gives x_{i+1+j}; T entries have a token to predict). The
    first round drafts after entry P, the prefill's token (the first answer token). -> (rounds,
    accepted, trials, reached [K], accepted at each draft position [K])."""
    T = agree.shape[1]
    rounds = accepted = trials = 0
    reached, hit = [0] * K, [0] * K
    i = P
    while i < T:
        n = 0
        while n < K and i + n < T and agree[n, i]:
            reached[n] += 1
            hit[n] += 1
            n += 1
        if n < K and i + n < T:  # a rejection was tried
            reached[n] += 1
            trials += 1
        rounds, accepted, trials = rounds + 1, accepted + n, trials + n
        i += n + 1
    return rounds, accepted, trials, reached, hit


@torch.no_grad()
def evaluate(head, examples, K: int, device, batch_tokens: int, bf16=False) -> dict:
    """Greedy SD at K simulated on the target's greedy answers (sd_rounds): per-token acceptance,
    tokens a round, the acceptance at each draft position; and step 0's top-1 agreement."""
    head.eval()
    tot = {"rounds": 0, "accepted": 0, "trials": 0, "agree": 0, "positions": 0, "emitted": 0}
    reached, hit = [0] * K, [0] * K
    token_of = head.token_of.to(device)
    for batch in dd.batches(examples, batch_tokens, random.Random(0)):
        x, f, _ = collate(batch, 0, None, device)
        with autocast(device, bf16):
            outs = head.train_forward(x, f, K)
            pred = torch.stack([token_of[head.lm_head(head.norm(h)).argmax(-1)] for h in outs])
        for r, ex in enumerate(batch):  # pred [K, B, L]
            P, L = len(ex["prompt"]), len(ex["prompt"]) + len(ex["answer"])
            truth = x[r]  # entry i (0..L-2) at step j predicts x_{i+1+j}: L - 1 - j of them
            agree = torch.stack([F.pad(pred[j, r, :max(L - 1 - j, 0)].eq(truth[1 + j:L]).cpu(),
                                       (0, min(j, L - 1))) for j in range(K)])  # [K, L - 1]
            ro, ac, tr, re, hi = sd_rounds(agree, P, K)
            tot["rounds"] += ro
            tot["accepted"] += ac
            tot["trials"] += tr
            tot["emitted"] += L - P - 1  # the rounds' tokens: the answer after the prefill's
            reached = [a + b for a, b in zip(reached, re)]
            hit = [a + b for a, b in zip(hit, hi)]
            tot["agree"] += agree[0, P:].sum().item()  # the positions SD drafts
            tot["positions"] += agree[0, P:].numel()
    head.train()
    return {"acceptance": tot["accepted"] / max(tot["trials"], 1),
            "tokens_per_round": tot["emitted"] / max(tot["rounds"], 1),
            "by_position": [round(h / max(r, 1), 3) for h, r in zip(hit, reached)],
            "agreement": tot["agree"] / max(tot["positions"], 1), "K": K}


def autocast(device, bf16: bool):
    return dd.autocast(device) if bf16 else contextlib.nullcontext()


def summary(metrics: dict) -> str:
    return "; ".join(f"{k} a {m['acceptance']:.3f} tok/round {m['tokens_per_round']:.2f} "
                     f"by position {m['by_position']}" for k, m in metrics.items())


def new_head(target, layers: list[int], token_ids: list[int], seed: int):
    """A head for the target: lm_head from the target's head rows, norm from its final norm."""
    torch.manual_seed(seed)
    head = eagle.head_for(target.config, layers, token_ids)
    with torch.no_grad():
        lm = target.lm_head  # nn.Linear, or a QuantLinear (the model as loaded: a GGUF's int8)
        w = lm.weight if isinstance(lm, torch.nn.Linear) else lm.dequantize()
        head.lm_head.weight.copy_(w[torch.tensor(token_ids)].float())
        head.norm.weight.copy_(target.model.norm.weight.float())
        head.fc.weight.mul_(0.5)
    return head


def resumed_state(path: Path, layers: list[int], args) -> dict | None:
    """The training state a kill left in the work dir, checked against this command before any
    data work: a head trained on other layers, rows or training-time test steps is not resumed as
    this one (states saved before these were recorded are taken as they are)."""
    if not path.exists():
        return None
    st = torch.load(path, map_location=args.device)
    for name, value in (("layers", layers), ("vocab", args.vocab), ("ttt", args.ttt)):
        if name in st and st[name] != value:
            was = ",".join(map(str, st[name])) if name == "layers" else st[name]
            raise ValueError(f"{path} holds a head trained with --{name} {was}: give another "
                             f"--work-dir, or --{name} {was}")
    return st


FIT_SET = 60  # the first training answers, measured as the held-out sets are: far above them,
# the head learns its answers rather than the target (2026-12-07, step 2700: 0.70-0.80 against
# 0.47-0.55: more data, not more steps)


def train(head, train_ex, heldout, args, work: Path, out: Path, info: dict, st, stop) -> int:
    """Training from `st` (or the start) to --steps, evaluating, exporting the best and saving
    as it goes; `stop` non-empty: save and end after the current step."""
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    state_path = work / "eagle.pt"
    step, epoch, epoch_start, spent, best = 0, 0, 0, 0.0, -1.0
    if st is not None:
        head.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, epoch, epoch_start, spent = st["step"], st["epoch"], st["epoch_start"], st["seconds"]
        best = st.get("best", -1.0)
        dd.log(work, f"eagle: resumed at step {step} (epoch {epoch}, {spent:.0f}s spent)")

    def save():
        tmp = state_path.with_suffix(".tmp")
        torch.save({"model": head.state_dict(), "opt": opt.state_dict(), "step": step,
                    "epoch": epoch, "epoch_start": epoch_start, "seconds": spent, "best": best,
                    "token_ids": head.token_of.tolist(), "layers": list(head.target_layers),
                    "vocab": args.vocab, "ttt": args.ttt}, tmp)
        os.replace(tmp, state_path)

    def measure():
        return {name: evaluate(head, ex, args.eval_k, args.device, args.batch_tokens, args.bf16)
                for name, ex in heldout.items()}

    row_of = torch.full((head.config.vocab_size,), -1, dtype=torch.long)
    row_of[head.token_of.cpu()] = torch.arange(len(head.token_of))
    metrics = {}
    t_last = t_save = time.time()
    while step < args.steps:
        epoch_batches = list(dd.batches(train_ex, args.batch_tokens,
                                        random.Random(args.seed + epoch)))
        for batch in epoch_batches[step - epoch_start:]:
            if step >= args.steps:
                break
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
            x, f, labels = collate(batch, args.ttt, row_of, args.device)
            with autocast(args.device, args.bf16):
                outs = head.train_forward(x, f, args.ttt)
                losses = [topk_kl(own_logits(head, h, where), rows, logp).mean()
                          for h, (where, rows, logp) in zip(outs, labels)]
            loss = sum(losses) / len(losses)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            step += 1
            now = time.time()
            spent, t_last = spent + now - t_last, now
            if step % 10 == 0:
                dd.log(work, f"eagle step {step} loss {loss.item():.3f} by step "
                             f"{[round(l.item(), 2) for l in losses]} ({spent:.0f}s)")
            if step % args.eval_every == 0 or step == args.steps:
                metrics = measure()
                score = sum(m["acceptance"] for m in metrics.values()) / len(metrics)
                kept = score > best
                fit = evaluate(head, train_ex[:FIT_SET], args.eval_k, args.device,
                               args.batch_tokens, args.bf16)["acceptance"]
                dd.log(work, f"eagle step {step}/{args.steps} epoch {epoch}: {summary(metrics)}"
                             f" (training answers a {fit:.3f})"
                             f"{' (best: exported)' if kept else ''}")
                if kept:  # the best mean held-out acceptance so far is what --out holds
                    best = score
                    export(head, out, {**info, "steps_done": step, "train_seconds": round(spent),
                                       "heldout": metrics})
                save()
                t_last = t_save = time.time()
            if stop:
                save()
                dd.log(work, f"eagle: interrupted at step {step}, saved: run the same command "
                             f"to go on")
                raise SystemExit(130)
            if now - t_save > args.save_every_s:
                save()
                t_save = time.time()
        if step < args.steps:
            epoch, epoch_start = epoch + 1, step
            save()
    if not (out / "train.json").exists():  # a finished work dir given a new --out (or its own
        metrics = measure()                 # removed): the head as it ends, not the best seen
        dd.log(work, f"eagle step {step}: {summary(metrics)} (exported: {out} had no head)")
        export(head, out, {**info, "steps_done": step, "train_seconds": round(spent),
                           "heldout": metrics})
    return step


@contextlib.contextmanager
def ctrl_c_after_the_step(work: Path):
    """A first Ctrl-C lets the current step (or evaluation) finish, then training saves and
    stops: an optimizer step cut halfway would be saved half done. A second one stops at once.
    Yields a list that is non-empty once Ctrl-C was pressed."""
    pressed = []
    if threading.current_thread() is not threading.main_thread():
        yield pressed  # only the main thread may handle signals
        return

    def handler(signum, frame):
        pressed.append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        dd.log(work, "eagle: Ctrl-C: saving after this step (Ctrl-C again stops at once)")
    old = signal.signal(signal.SIGINT, handler)
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, old)


def export(head, out: Path, info: dict):
    eagle.save(head, out, {"target": info["target"], "eval_k": info["eval_k"]})
    (out / "train.json").write_text(json.dumps(info, indent=1) + "\n")


def main(argv=None):
    args, data_argv = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    work, out = Path(args.work_dir).expanduser(), Path(args.out).expanduser()
    for flag, folder in (("--work-dir", work), ("--out", out)):  # now, not hours in
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"{flag} {folder}: {e.strerror}: give a folder that can be made")
        if not os.access(folder, os.W_OK):
            raise ValueError(f"{flag} {folder}: not writable: give a folder that is")
    command = ("python scripts/train_eagle.py " + " ".join(sys.argv[1:] if argv is None else argv)
               ).replace(str(Path.home()), "~")
    dd.log(work, command)
    dargs = dd.parse_args(["--target", args.target, "--out", str(out), "--device", args.device,
                           *data_argv])
    if dargs.humaneval is None:
        dargs.humaneval = HUMANEVAL_SIZE if humaneval_installed() else 0
    target, tok = dd.load_target(dargs)
    n = target.config.num_hidden_layers
    layers = args.layers or eagle.default_layers(n)
    if not all(0 <= i < n for i in layers):
        raise ValueError(f"--layers {','.join(map(str, layers))}: {args.target} has layers "
                         f"0..{n - 1}")
    V = target.config.vocab_size
    if args.vocab is not None and args.vocab > V:
        raise ValueError(f"--vocab {args.vocab}: {args.target} has {V} tokens: give at most {V}")
    args.vocab = args.vocab or min(DEFAULT_VOCAB, V)
    st = resumed_state(work / "eagle.pt", layers, args)
    heldout, heldout_prompts = dd.heldout_sets(target, tok, dargs, work)
    # the held-out self turns are no training turns, as in distill_draft.py
    train_ex = dd.training_answers(target, tok, dargs, work, heldout_prompts.get("self", []))
    t0, reader = time.time(), reader_of(target, args)
    sets = [("train", train_ex), *((f"heldout-{k}", ex) for k, ex in heldout.items())]
    for name, examples in sets:  # the held-out sets' in float32: what the engine's head reads
        for ex, f in zip(examples, features(reader, examples, layers, work, name,
                                            args.batch_tokens, args.bf16 and name == "train")):
            ex["features"] = f  # each example carries its own: batches and collate read them
    text_ex = text_examples(reader, tok, layers, work, args, dargs.topk) if args.text_tokens else []
    del reader
    dd.log(work, f"features: {sum(len(ex['features']) for ex in train_ex + text_ex)} training "
                 f"positions, layers {layers} ({time.time() - t0:.0f}s)")
    token_ids = st["token_ids"] if st else dd.draft_vocabulary(
        train_ex, args.vocab + 1, target.config.vocab_size, set(target.config.eos_token_ids))
    head = new_head(target, layers, token_ids, args.seed).to(args.device)
    head.attach(target.model.embed_tokens)
    head.train()
    dd.log(work, f"eagle head: {sum(p.numel() for p in head.parameters()) / 1e6:.1f}M parameters,"
                 f" layers {layers}, {len(token_ids)} rows")
    info = {"command": command, "target": args.target, "layers": layers, "vocab": len(token_ids),
            "ttt": args.ttt, "eval_k": args.eval_k, "train_answers": len(train_ex),
            "train_tokens": sum(len(e["answer"]) for e in train_ex),
            "text_tokens": sum(len(e["answer"]) for e in text_ex)}
    with ctrl_c_after_the_step(work) as stop:
        step = train(head, train_ex + text_ex, heldout, args, work, out, info, st, stop)
    kept = json.loads((out / "train.json").read_text())
    dd.log(work, f"trained to step {step}; {out} holds step {kept['steps_done']}'s head: "
                 f"{summary(kept['heldout'])}")


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # bad input, some found only once the target or work dir is read
        sys.exit(f"error: {e}")
