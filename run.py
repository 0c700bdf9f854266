"""Generate text with autoregressive decoding (ar), speculative decoding (sd) or speculative speculative
decoding (ssd); the `generate()` API and the command line.

    python run.py                                   # the tiny pair shipped in checkpoints/, SSD, a code prompt
    python run.py --mode sd --k 4 --temperature 0.7 --prompt "def fib(n):"
    python run.py --target llama-70b --draft llama-1b --chat --prompt "Write a haiku"

In `ssd` mode the verifier (target model) runs in this process and the speculator (draft model) in a
second one started with torch.multiprocessing (spawn), each on its own device, talking through
preallocated shared tensors (pinned when a device is CUDA) and two events per round, never pickling on
the per-round path. `parallel=False` runs the same two sides interleaved in one process and emits the
same tokens for the same seed.
"""
import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp

from draft import Drafter, Proposals, SSDConfig, Speculator
from model import ModelConfig, load_model, resolve
from verify import Verifier

DEFAULT_PROMPT = "def binary_search(items, target):\n    \"\"\"Return the index of target in the sorted list items.\"\"\"\n"


@dataclass
class GenerateResult:
    tokens: list[list[int]]  # new token ids per prompt
    text: list[str] | None   # decoded, when the target has a tokenizer
    stats: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------
# Output bookkeeping shared by every mode: EOS and max_new_tokens cut inside a round

class Output:
    def __init__(self, b, max_new_tokens, eos_ids, K, stream=None):
        self.tokens = [[] for _ in range(b)]
        self.done = [False] * b
        self.max_new, self.eos, self.stream = max_new_tokens, set(eos_ids), stream
        self.rounds, self.row_rounds, self.accepted, self.proposed = 0, 0, 0, 0
        self.hist = [0] * (K + 1)
        self.tok_hit = self.rounds_hit = self.tok_miss = self.rounds_miss = 0

    def emit(self, row, new) -> bool:
        """Append new tokens to a row, stopping at EOS (kept) or max_new_tokens. Returns True when done."""
        out = self.tokens[row]
        for x in new:
            out.append(x)
            if x in self.eos or len(out) >= self.max_new:
                self.done[row] = True
                break
        if self.stream:
            self.stream(row, out)
        return self.done[row]

    def round(self, rows, tokens, n, t, hit=None) -> list[int]:
        """Record one verified round; returns the rows that finished in it."""
        self.rounds += 1
        K = tokens.shape[1]
        finished = []
        for i, r in enumerate(rows):
            n_i = int(n[i])
            self.row_rounds += 1
            self.accepted += n_i
            self.proposed += K
            self.hist[n_i] += 1
            if hit is not None:
                if hit[i]:
                    self.tok_hit, self.rounds_hit = self.tok_hit + n_i + 1, self.rounds_hit + 1
                else:
                    self.tok_miss, self.rounds_miss = self.tok_miss + n_i + 1, self.rounds_miss + 1
            if self.emit(r, tokens[i, :n_i].tolist() + [int(t[i])]):
                finished.append(r)
        return finished

    def active(self):
        return [r for r, d in enumerate(self.done) if not d]

    def stats(self, mode, prefill_s, decode_s, b):
        new = sum(len(x) for x in self.tokens)
        return {"mode": mode, "batch": b, "new_tokens": new, "prefill_seconds": prefill_s, "decode_seconds": decode_s,
                # the first token of each row comes from the prefill; decode speed counts the rest
                "decode_tok_s": (new - b) / decode_s if decode_s > 0 else 0.0,
                "rounds": self.rounds,
                "mean_tokens_per_round": (new - b) / self.row_rounds if self.row_rounds else 0.0,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                "accept_len_histogram": self.hist}


# ----------------------------------------------------------------------------------------------------
# The decode loops

def decode_ar_sd(verifier, drafter, prompts, out, K):
    """ar (drafter None) and sd: the draft and the target take turns in this process."""
    t_start = time.perf_counter()
    if drafter:
        drafter.prefill(prompts)
    t0 = verifier.prefill(prompts)
    prefill_s = time.perf_counter() - t_start
    start = time.perf_counter()
    finished = [r for r in range(len(prompts)) if out.emit(r, [int(t0[r])])]
    rows = out.active()
    if drafter:
        drafter.commit(range(len(prompts)), torch.zeros(len(prompts), dtype=torch.long), t0)
        drafter.finish(finished)
    verifier.finish(finished)
    V = verifier.model.config.vocab_size
    while rows:
        if drafter:
            p = drafter.draft(rows)
        else:  # autoregressive: a round with no proposals
            b = len(rows)
            p = Proposals(torch.zeros(b, 0, dtype=torch.long), torch.zeros(b, 0, V), torch.ones(b, dtype=torch.bool),
                          torch.zeros(b, dtype=torch.bool))
        n, t = verifier.verify(rows, p.tokens, p.q, p.deterministic)
        finished = out.round(rows, p.tokens, n, t)
        if drafter:
            drafter.commit(rows, n, t)
            drafter.finish(finished)
        verifier.finish(finished)
        rows = out.active()
    return prefill_s, time.perf_counter() - start


def decode_ssd_serial(verifier, spec, prompts, out):
    """ssd with parallel=False: the same two sides, interleaved in one process."""
    t_start = time.perf_counter()
    b = len(prompts)
    spec.prefill(prompts)
    spec.pre_speculate(list(range(b)))
    t0 = verifier.prefill(prompts)
    prefill_s = time.perf_counter() - t_start
    start = time.perf_counter()
    finished = [r for r in range(b) if out.emit(r, [int(t0[r])])]
    rows, n, t, verify_s, wait = list(range(b)), torch.zeros(b, dtype=torch.long), t0, None, 0.0
    while True:
        verifier.finish(finished)
        spec.finish(finished)
        keep = [i for i, r in enumerate(rows) if r not in finished]
        rows, n, t = [rows[i] for i in keep], n[keep], t[keep]
        if not rows:
            break
        w = time.perf_counter()
        p = spec.respond(rows, n, t, verify_s)
        spec.pre_speculate(rows)  # in the parallel run this overlaps the verification below
        wait += time.perf_counter() - w
        v = time.perf_counter()
        n, t = verifier.verify(rows, p.tokens, p.q, p.deterministic)
        verify_s = time.perf_counter() - v
        finished = out.round(rows, p.tokens, n, t, p.hit)
    return prefill_s, time.perf_counter() - start, wait


class Channel:
    """The shared tensors between the verifier and the speculator, allocated once before the spawn."""

    def __init__(self, b, K, V, pin):
        self.n = torch.zeros(b, dtype=torch.long)
        self.t = torch.zeros(b, dtype=torch.long)
        self.active = torch.zeros(b, dtype=torch.bool)
        self.ctl = torch.zeros(3, dtype=torch.float64)  # [round id, stop flag, verify seconds of the round]
        self.tokens = torch.zeros(b, K, dtype=torch.long)
        self.q = torch.zeros(b, K, V)
        self.det = torch.zeros(b, dtype=torch.bool)
        self.hit = torch.zeros(b, dtype=torch.bool)
        for x in self.tensors():
            x.share_memory_()
        ctx = mp.get_context("spawn")
        self.outcome_ready, self.proposals_ready = ctx.Event(), ctx.Event()
        self.pin = pin

    def tensors(self):
        return [self.n, self.t, self.active, self.ctl, self.tokens, self.q, self.det, self.hit]

    def pin_here(self):
        """Page-lock the shared buffers in this process so copies to and from the GPU are fast."""
        if self.pin and torch.cuda.is_available():
            cudart = torch.cuda.cudart()
            for x in self.tensors():
                cudart.cudaHostRegister(x.data_ptr(), x.numel() * x.element_size(), 0)


def wait_for(event, alive, what, timeout=None):
    """Wait on an event while checking that the other side is alive (a dead peer must not hang us)."""
    start = time.perf_counter()
    while not event.wait(0.05):
        if not alive():
            raise RuntimeError(f"the {what} process died")
        if timeout and time.perf_counter() - start > timeout:
            raise RuntimeError(f"timed out waiting for the {what}")
    event.clear()


def speculator_main(draft, draft_device, threads, prompts, K, temperature, seed, kv_tokens, block_size, ssd, ch,
                    errors):
    """The speculator process: load the draft, pre-speculate round 0, then answer each outcome."""
    try:
        if threads:
            torch.set_num_threads(threads)
        ch.pin_here()
        model, _ = load_model(draft, device=draft_device)
        spec = Speculator(model, K, temperature, seed + 1, kv_tokens, ssd, block_size)
        b = len(prompts)
        spec.prefill(prompts)
        spec.pre_speculate(list(range(b)))
        parent = mp.parent_process()
        rows = list(range(b))
        while True:
            wait_for(ch.outcome_ready, parent.is_alive, "verifier")
            if ch.ctl[1] > 0:  # stop
                break
            active = ch.active.nonzero().flatten().tolist()
            spec.finish([r for r in rows if r not in active])
            rows = active
            if not rows:
                break
            p = spec.respond(rows, ch.n[rows], ch.t[rows], float(ch.ctl[2]) or None)
            ch.tokens[rows] = p.tokens.cpu()
            if temperature > 0:
                ch.q[rows] = p.q.cpu()
            ch.det[rows], ch.hit[rows] = p.deterministic.cpu(), p.hit.cpu()
            ch.proposals_ready.set()
            spec.pre_speculate(rows)
        errors.put(("stats", spec.stats()))
    except KeyboardInterrupt:
        pass
    except BaseException as e:  # reaches the user as one line; the traceback goes to stderr for debugging
        traceback.print_exc()
        errors.put(("error", f"{type(e).__name__}: {e}"))
        sys.exit(1)


def decode_ssd_parallel(verifier, prompts, out, K, args):
    """ssd with two processes: the verifier here, the speculator in a spawned child."""
    b, V = len(prompts), verifier.model.config.vocab_size
    ch = Channel(b, K, V, pin=any(str(d).startswith("cuda") for d in (args["draft_device"], verifier.model.device)))
    ch.pin_here()
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    proc = ctx.Process(target=speculator_main, daemon=True, args=(
        args["draft"], args["draft_device"], args["draft_threads"], prompts, K, args["temperature"], args["seed"],
        args["draft_kv_tokens"], args["block_size"], args["ssd"], ch, errors))
    proc.start()
    child_stats = {}
    try:
        t_start = time.perf_counter()
        t0 = verifier.prefill(prompts)
        prefill_s = time.perf_counter() - t_start
        start = time.perf_counter()
        finished = [r for r in range(b) if out.emit(r, [int(t0[r])])]
        verifier.finish(finished)
        rows, wait = out.active(), 0.0
        ch.t[:] = t0.cpu()
        ch.active[rows] = True
        ch.outcome_ready.set()
        while rows:
            w = time.perf_counter()
            wait_for(ch.proposals_ready, proc.is_alive, "speculator")
            wait += time.perf_counter() - w
            v = time.perf_counter()
            n, t = verifier.verify(rows, ch.tokens[rows], ch.q[rows], ch.det[rows])
            ch.ctl[2] = time.perf_counter() - v
            hit = ch.hit[rows].clone()
            finished = out.round(rows, ch.tokens[rows], n, t, hit)
            verifier.finish(finished)
            ch.n[rows], ch.t[rows] = n.cpu(), t.cpu()
            ch.active[finished] = False
            rows = out.active()
            ch.outcome_ready.set()
        decode_s = time.perf_counter() - start
        proc.join(timeout=30)
        while not errors.empty():
            kind, val = errors.get()
            if kind == "stats":
                child_stats = val
        return prefill_s, decode_s, wait, child_stats
    except BaseException:
        ch.ctl[1] = 1
        ch.outcome_ready.set()
        raise
    finally:
        if proc.is_alive():
            proc.join(timeout=2)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=2)
        if proc.exitcode not in (0, None):
            msg = None
            while not errors.empty():
                kind, val = errors.get()
                if kind == "error":
                    msg = val
            if msg and sys.exc_info()[0] is not KeyboardInterrupt:
                raise RuntimeError(f"speculator failed: {msg}") from None


# ----------------------------------------------------------------------------------------------------
# generate()

def default_devices():
    """Two or more GPUs: target cuda:0, draft cuda:1; one GPU: both on it; else the CPU."""
    if torch.cuda.is_available():
        return ("cuda:0", "cuda:1") if torch.cuda.device_count() >= 2 else ("cuda:0", "cuda:0")
    return "cpu", "cpu"


def encode(tokenizer, prompt, chat):
    if not isinstance(prompt, str):
        return list(prompt)
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer: pass prompts as lists of token ids")
    if chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    ids = tokenizer(prompt)["input_ids"]
    if tokenizer.bos_token_id is not None and (not ids or ids[0] != tokenizer.bos_token_id):
        ids = [tokenizer.bos_token_id] + ids
    return ids


def generate(prompts, target="tiny", draft="tiny-draft", mode="sd", max_new_tokens=128, temperature=0.0, k=4,
             seed=0, ignore_eos=False, fan_out="geometric", budget=8, saguaro_c=1.0, fallback="auto",
             parallel=True, target_device=None, draft_device=None, target_threads=None, draft_threads=None,
             kv_tokens=None, block_size=16, chat=False, stream=None) -> GenerateResult:
    """Generate up to max_new_tokens for each prompt (strings, or lists of token ids).

    mode: "ar" (target only), "sd" (speculative decoding, K draft tokens per round) or "ssd" (speculative
    speculative decoding with Saguaro: fan_out, budget B, saguaro_c C, fallback policy, parallel).
    stream(row, tokens_so_far) is called as tokens are accepted."""
    if mode not in ("ar", "sd", "ssd"):
        raise ValueError(f"unknown mode {mode!r}: use 'ar', 'sd' or 'ssd'")
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise ValueError("no prompts given")
    if mode != "ar" and not 1 <= k <= 64:
        raise ValueError(f"k={k} is impossible: use 1 <= k <= 64 draft tokens per round")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    K = k if mode != "ar" else 0
    dev_t, dev_d = default_devices()
    target_device, draft_device = target_device or dev_t, draft_device or dev_d
    cores = os.cpu_count() or 1
    if mode == "ssd" and parallel:  # the two processes split the cores (when on the CPU)
        target_threads = target_threads or max(1, cores - cores // 2)
        draft_threads = draft_threads or max(1, cores // 2)
    else:
        target_threads = target_threads or cores
    old_threads = torch.get_num_threads()
    torch.set_num_threads(target_threads)
    try:
        tmodel, tok = load_model(target, device=target_device)
        cfg = tmodel.config
        ids = [encode(tok, p, chat) for p in prompts]
        for p in ids:
            if not p:
                raise ValueError("empty prompt: give at least one token")
            if len(p) + max_new_tokens + K + 1 > cfg.max_position_embeddings:
                raise ValueError(f"prompt of {len(p)} tokens + max_new_tokens={max_new_tokens} exceeds the target's "
                                 f"context of {cfg.max_position_embeddings}: shorten the prompt or max_new_tokens")
            if max(p) >= cfg.vocab_size or min(p) < 0:
                raise ValueError(f"prompt token id {max(p)} outside the vocabulary of size {cfg.vocab_size}")
        if mode != "ar":
            dcfg = ModelConfig.from_hf(json.loads((resolve(draft) / "config.json").read_text()))
            if dcfg.vocab_size != cfg.vocab_size:
                raise ValueError(f"draft vocabulary ({dcfg.vocab_size}) differs from the target's ({cfg.vocab_size}): "
                                 f"pick a draft from the same model family")
        eos = [] if ignore_eos else sorted(set(cfg.eos_token_ids) | ({tok.eos_token_id} if tok and tok.eos_token_id is not None else set()))
        b, longest = len(ids), max(len(p) for p in ids)
        per_row = longest + max_new_tokens + 2 * K + 4 + 2 * block_size
        verifier = Verifier(tmodel, temperature, seed, kv_tokens or b * per_row, block_size)
        out = Output(b, max_new_tokens, eos, K, stream)
        stats = {}
        if mode in ("ar", "sd"):
            drafter = None
            if mode == "sd":
                dmodel, _ = load_model(draft, device=draft_device)
                drafter = Drafter(dmodel, K, temperature, seed + 1, kv_tokens or b * per_row, block_size)
            prefill_s, decode_s = decode_ar_sd(verifier, drafter, ids, out, K)
        else:
            ssd = SSDConfig(fan_out=fan_out, budget=budget, saguaro_c=saguaro_c, fallback=fallback)
            validate_ssd(ssd, K)
            # the draft holds each row's main sequence plus B branches of at most K + 2 private tokens
            draft_kv = kv_tokens or b * (per_row + budget * (K + 3 + 2 * block_size))
            if parallel:
                prefill_s, decode_s, wait, stats = decode_ssd_parallel(verifier, ids, out, K, dict(
                    draft=draft, draft_device=draft_device, draft_threads=draft_threads, temperature=temperature,
                    seed=seed, draft_kv_tokens=draft_kv, block_size=block_size, ssd=ssd))
            else:
                dmodel, _ = load_model(draft, device=draft_device)
                spec = Speculator(dmodel, K, temperature, seed + 1, draft_kv, ssd, block_size)
                prefill_s, decode_s, wait = decode_ssd_serial(verifier, spec, ids, out)
                stats = spec.stats()
            stats["verifier_wait_seconds"] = wait
            stats["tokens_per_round_hit"] = out.tok_hit / out.rounds_hit if out.rounds_hit else 0.0
            stats["tokens_per_round_miss"] = out.tok_miss / out.rounds_miss if out.rounds_miss else 0.0
            stats["fallback"] = fallback
            stats["parallel"] = parallel
        stats = {**out.stats(mode, prefill_s, decode_s, b), **stats, "k": K, "temperature": temperature,
                 "target_threads": target_threads, "draft_threads": draft_threads if mode == "ssd" and parallel else None}
        text = [tok.decode(x) for x in out.tokens] if tok is not None else None
        return GenerateResult(out.tokens, text, stats)
    finally:
        torch.set_num_threads(old_threads)


def validate_ssd(ssd: SSDConfig, K: int):
    if ssd.budget < 1:
        raise ValueError(f"budget={ssd.budget}: the fan-out budget B must be >= 1")
    if not 0 <= ssd.saguaro_c <= 1:
        raise ValueError(f"saguaro_c={ssd.saguaro_c}: C must be in [0, 1]")
    if ssd.fallback not in ("auto", "neural", "ngram", "random"):
        raise ValueError(f"fallback={ssd.fallback!r}: use auto, neural, ngram or random")
    if isinstance(ssd.fan_out, (list, tuple)):
        if len(ssd.fan_out) != K + 1 or min(ssd.fan_out) < 0:
            raise ValueError(f"fan_out={list(ssd.fan_out)}: give K+1 = {K + 1} non-negative integers F_0..F_K")
        ssd.budget = sum(ssd.fan_out)
    elif ssd.fan_out not in ("geometric", "uniform"):
        raise ValueError(f"fan_out={ssd.fan_out!r}: use geometric, uniform or a list of K+1 integers")


# ----------------------------------------------------------------------------------------------------
# The command line

def main(argv=None):
    ap = argparse.ArgumentParser(description="Generate with AR, SD or SSD (Saguaro).")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--draft", default="tiny-draft")
    ap.add_argument("--mode", default="ssd", choices=["ar", "sd", "ssd"])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fan-out", default="geometric", help="geometric, uniform, or comma-separated F_0..F_K")
    ap.add_argument("--budget", type=int, default=8, help="B: branches per sequence per round")
    ap.add_argument("--saguaro-c", type=float, default=1.0)
    ap.add_argument("--fallback", default="auto", choices=["auto", "neural", "ngram", "random"])
    ap.add_argument("--no-parallel", action="store_true", help="run ssd's two sides interleaved in one process")
    ap.add_argument("--device", default=None, help="device for both models (default: GPUs if any, else cpu)")
    ap.add_argument("--target-device", default=None)
    ap.add_argument("--draft-device", default=None)
    ap.add_argument("--target-threads", type=int, default=None)
    ap.add_argument("--draft-threads", type=int, default=None)
    ap.add_argument("--kv-tokens", type=int, default=None, help="KV cache token budget (default: sized automatically)")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template (instruct models)")
    ap.add_argument("--json", action="store_true", help="print one JSON line with tokens and stats")
    a = ap.parse_args(argv)
    fan = [int(x) for x in a.fan_out.split(",")] if "," in a.fan_out or a.fan_out.isdigit() else a.fan_out
    printed = [0]

    def stream(row, tokens):  # print the decoded text of the first prompt as it is accepted
        if row != 0 or a.json or tokenizer[0] is None:
            return
        text = tokenizer[0].decode(tokens)
        sys.stdout.write(text[printed[0]:])
        sys.stdout.flush()
        printed[0] = len(text)

    tokenizer = [None]
    try:
        if not a.json:
            from transformers import AutoTokenizer  # the same files load_model reads; only for streaming
            p = resolve(a.target)
            if (p / "tokenizer_config.json").exists() or (p / "tokenizer.json").exists():
                tokenizer[0] = AutoTokenizer.from_pretrained(p)
            sys.stdout.write(a.prompt)
        res = generate([a.prompt], target=a.target, draft=a.draft, mode=a.mode, max_new_tokens=a.max_new_tokens,
                       temperature=a.temperature, k=a.k, seed=a.seed, ignore_eos=a.ignore_eos, fan_out=fan,
                       budget=a.budget, saguaro_c=a.saguaro_c, fallback=a.fallback, parallel=not a.no_parallel,
                       target_device=a.target_device or a.device, draft_device=a.draft_device or a.device,
                       target_threads=a.target_threads, draft_threads=a.draft_threads, kv_tokens=a.kv_tokens,
                       chat=a.chat, stream=stream)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps({"tokens": res.tokens[0], "text": res.text[0] if res.text else None, "stats": res.stats}))
        return 0
    s = res.stats
    print("\n")
    rows = [("mode", s["mode"]), ("new tokens", s["new_tokens"]), ("prefill s", f"{s['prefill_seconds']:.3f}"),
            ("decode tok/s", f"{s['decode_tok_s']:.1f}"), ("rounds", s["rounds"]),
            ("tokens/round", f"{s['mean_tokens_per_round']:.2f}"), ("acceptance", f"{s['acceptance_rate']:.2f}")]
    if s["mode"] == "ssd":
        rows += [("cache hit rate", f"{s['cache_hit_rate']:.2f}"), ("fallback", f"{s['fallback']} (b*={s['b_star']})"),
                 ("verifier wait", f"{s['verifier_wait_seconds'] / max(s['decode_seconds'], 1e-9):.0%}")]
    for k_, v in rows:
        print(f"{k_:>16}  {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
