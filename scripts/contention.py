"""What does splitting SD across two processes cost the verifier? SSD's gain over SD depends on it.

SSD runs the verifier (target) and the speculator (draft) at the same time, each on its own device
(two GPUs, or two sets of CPU cores), and they wait for each other twice a round. The paper's speed
model charges a verification the same time in SSD as in SD. Where that fails, every SSD round pays
the difference and only cache hits win it back; at batch 4 and more a round hits only if every row
hits, which is rare, so there SSD runs at about SD's speed less this difference.

This script measures the two ways a verification can get dearer, apart from the rest of the engine.
Each times the target's verification forward (b rows x K + 1 tokens, then the rollback):

(1) beside: while a second process, on the draft's device with the draft's threads, idles, polls a
    flag without sleeping (a side of SSD waiting), or drafts b x B branches K steps at a time (SSD's
    pre-speculation). draft / idle above 1: the two devices slow each other (shared caches, memory
    bus; two processes on one GPU).
(2) after: in one process, right after SD's K draft steps for the b rows, or right after a wait as
    long as those steps take, polled or slept (SSD's verifier, whose proposals come from the other
    process). poll / draft above 1: a forward after a wait runs slower than one after other work.

The arms alternate in a shuffled order, `--repeats` times, and the medians are reported.

    python scripts/contention.py                        # the tiny pair, 1 + 1 CPU threads
    python scripts/contention.py --target llama-8b --draft llama-1b \\
        --target-device cuda:0 --draft-device cuda:1
"""
import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # so `python scripts/contention.py` finds model.py
    sys.path.insert(0, str(REPO))

import torch
import torch.multiprocessing as mp

from channel import start_child
from checkpoint import load_model, resolve
from cpu_linear import ROWS, use_forms
from engine import split_cores
from scripts.gpu_check import sync

MODES = ("idle", "poll", "draft")  # what the draft's process does during the verification
GAPS = ("draft", "poll", "sleep")   # what this process did right before it


def rows_with_context(model, b, context, seed):
    """A KV cache holding b sequences of `context` random tokens -> (cache, seq ids)."""
    g = torch.Generator().manual_seed(seed)
    cache = model.new_cache(b * (context + 64))
    seqs = [cache.new_seq() for _ in range(b)]
    prompts = torch.randint(model.config.vocab_size, (b, context), generator=g).tolist()
    model.prefill(cache, seqs, prompts)
    return cache, seqs


def drafter_main(draft, device, threads, rows, K, context, mode, ready, passes):
    """The second process: load the draft, then do what `mode` says until it is -1, counting its
    drafting passes in `passes` (a crash here must not pass for an idle neighbour)."""
    if threads:
        torch.set_num_threads(threads)
    model, _ = load_model(draft, device=device, tokenizer=False)
    use_forms(model, ROWS)  # as draft.load_draft does
    with torch.inference_mode():
        cache, seqs = rows_with_context(model, rows, context, seed=1)
        ready.value = 1
        V = model.config.vocab_size
        while mode.value >= 0:
            if MODES[mode.value] == "draft":  # K batched steps over every branch, then roll back
                for _ in range(K):
                    model.forward_cached(cache, seqs, torch.randint(V, (rows,), device=device),
                                         [1] * rows, last_only=True)
                sync(device)
                for s in seqs:
                    cache.truncate(s, context)
                passes.value += 1
            elif MODES[mode.value] == "poll":
                time.perf_counter()
            else:
                time.sleep(0.001)


def verification(model, b, a):
    """-> verify(): one timed verification forward of b rows x K + 1 random tokens over `context`
    cached tokens, rolled back after (seconds)."""
    cache, seqs = rows_with_context(model, b, a.context, seed=0)
    V, T, device = model.config.vocab_size, a.k + 1, a.target_device

    def verify():
        tokens = torch.randint(V, (b * T,), device=device)
        sync(device)
        start = time.perf_counter()
        model.forward_cached(cache, seqs, tokens, [T] * b)
        sync(device)
        for s in seqs:
            cache.truncate(s, a.context)
        return time.perf_counter() - start
    return verify


def beside(a, b, model) -> dict:
    """The verification at batch b while the draft's process idles, polls or drafts (MODES)."""
    ctx = mp.get_context("spawn")
    mode, ready, passes = ctx.Value("i", 0), ctx.Value("i", 0), ctx.Value("i", 0)
    proc = start_child(drafter_main, (a.draft, a.draft_device, a.draft_threads, b * a.budget, a.k,
                                      a.context, mode, ready, passes))
    times = {m: [] for m in MODES}
    try:
        verify = verification(model, b, a)
        while not ready.value:
            if not proc.is_alive():
                raise RuntimeError("the draft's process died while loading (see above)")
            time.sleep(0.01)
        for _ in range(a.warmup):
            verify()
        for _ in range(a.repeats):
            for m in random.sample(range(len(MODES)), len(MODES)):
                mode.value = m
                time.sleep(0.02)  # let the other process switch
                times[MODES[m]] += [verify() for _ in range(a.per_mode)]
    finally:
        mode.value = -1
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
    if proc.exitcode != 0 or passes.value == 0:
        raise RuntimeError(f"the draft's process failed (exit code {proc.exitcode}, "
                           f"{passes.value} drafting passes): see its error above")
    med = {m: 1e3 * statistics.median(times[m]) for m in MODES}
    return {"ms": med, "draft_over_idle": med["draft"] / med["idle"],
            "poll_over_idle": med["poll"] / med["idle"], "draft_passes": passes.value}


def after(a, b, model, draft) -> dict:
    """The verification at batch b right after one of GAPS, all in this process: SD's K draft
    steps, or a wait of the same length (SSD's verifier waiting for proposals)."""
    cache, seqs = rows_with_context(draft, b, a.context, seed=1)
    V = draft.config.vocab_size

    def draft_steps():
        start = time.perf_counter()
        for _ in range(a.k):
            draft.forward_cached(cache, seqs, torch.randint(V, (b,), device=a.draft_device),
                                 [1] * b, last_only=True)
        sync(a.draft_device)
        for s in seqs:
            cache.truncate(s, a.context)
        return time.perf_counter() - start

    def poll(seconds):
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            pass

    verify = verification(model, b, a)
    for _ in range(a.warmup):
        draft_steps(), verify()
    gap = statistics.median(draft_steps() for _ in range(a.per_mode))
    gaps = {"draft": draft_steps, "poll": lambda: poll(gap), "sleep": lambda: time.sleep(gap)}
    times = {g: [] for g in GAPS}
    for _ in range(a.repeats):
        for g in random.sample(GAPS, len(GAPS)):
            for _ in range(a.per_mode):
                gaps[g]()
                times[g].append(verify())
    med = {g: 1e3 * statistics.median(times[g]) for g in GAPS}
    return {"gap_ms": 1e3 * gap, "ms": med, "poll_over_draft": med["poll"] / med["draft"],
            "sleep_over_draft": med["sleep"] / med["draft"]}


def measure(a, b) -> dict:
    """Both measurements at batch b."""
    torch.set_num_threads(a.target_threads)
    model, _ = load_model(a.target, device=a.target_device, tokenizer=False)
    use_forms(model, [b * (a.k + 1)])  # as run.py does: the CPU's product forms, chosen at load
    with torch.inference_mode():
        side = beside(a, b, model)
        draft, _ = load_model(a.draft, device=a.draft_device, tokenizer=False)
        use_forms(draft, ROWS)  # as draft.load_draft does
        return {"batch": b, "tokens": b * (a.k + 1), "branches": b * a.budget,
                "beside": side, "after": after(a, b, model, draft)}


def parse(argv=None):
    threads = split_cores(os.cpu_count() or 1)  # run.py's split for ssd on the CPU
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="tiny", help="target checkpoint or alias (default: tiny)")
    ap.add_argument("--draft", default="tiny-draft", help="draft checkpoint or alias")
    ap.add_argument("--target-device", default="cpu", help="the verifier's device")
    ap.add_argument("--draft-device", default="cpu", help="the speculator's device")
    ap.add_argument("--target-threads", type=int, default=threads[0],
                    help="CPU threads of the verifier (default: run.py's split of the cores)")
    ap.add_argument("--draft-threads", type=int, default=threads[1],
                    help="CPU threads of the speculator")
    ap.add_argument("--batch-sizes", default="1,4,8",
                    help="rows b per verification, comma-separated")
    ap.add_argument("--k", type=int, default=4,
                    help="K: a verification checks K + 1 tokens per row")
    ap.add_argument("--budget", type=int, default=4,
                    help="B: branches per row the draft steps over (default 4, the adaptive "
                         "budget's typical size at batch 4-8 on 2 CPU cores)")
    ap.add_argument("--context", type=int, default=256, help="tokens already in each row's cache")
    ap.add_argument("--repeats", type=int, default=20, help="shuffled passes over the three modes")
    ap.add_argument("--per-mode", type=int, default=10,
                    help="timed verifications per mode and pass")
    ap.add_argument("--warmup", type=int, default=10, help="untimed verifications first")
    a = ap.parse_args(argv)
    try:
        a.batch_sizes = [int(x) for x in a.batch_sizes.split(",")]
    except ValueError:
        ap.error(f"--batch-sizes {a.batch_sizes!r}: give integers like 1,4,8")
    if min(a.batch_sizes + [a.k, a.budget, a.context, a.repeats, a.per_mode]) < 1:
        ap.error("--batch-sizes, --k, --budget, --context, --repeats and --per-mode must be >= 1")
    return a


def main(argv=None) -> list[dict]:
    a = parse(argv)
    resolve(a.target), resolve(a.draft)  # a wrong name fails here, in one line
    results = [measure(a, b) for b in a.batch_sizes]
    print(f"A verification of b x {a.k + 1} tokens on {a.target_device} ({a.target_threads} "
          f"threads), medians of {a.repeats} x {a.per_mode}, ms.")
    print(f"(1) Beside it, the draft's process on {a.draft_device} ({a.draft_threads} threads) "
          f"idles, polls, or drafts b x {a.budget} branches K = {a.k} steps at a time:")
    print(f"{'batch':>7} {'idle':>8} {'poll':>8} {'draft':>8} {'poll/idle':>10} {'draft/idle':>11}")
    for r in results:
        ms = r["beside"]["ms"]
        print(f"{r['batch']:>7} {ms['idle']:>8.2f} {ms['poll']:>8.2f} {ms['draft']:>8.2f} "
              f"{r['beside']['poll_over_idle']:>10.3f} {r['beside']['draft_over_idle']:>11.3f}")
    print(f"(2) Right before it, in the same process: SD's K = {a.k} draft steps for the b "
          f"rows, or a wait as long as they take, polled or slept (SSD's verifier waiting):")
    print(f"{'batch':>7} {'gap':>8} {'draft':>8} {'poll':>8} {'sleep':>8} {'poll/draft':>11} "
          f"{'sleep/draft':>12}")
    for r in results:
        x = r["after"]
        ms = x["ms"]
        print(f"{r['batch']:>7} {x['gap_ms']:>8.2f} {ms['draft']:>8.2f} {ms['poll']:>8.2f} "
              f"{ms['sleep']:>8.2f} {x['poll_over_draft']:>11.3f} {x['sleep_over_draft']:>12.3f}")
    print(json.dumps({"settings": vars(a), "results": results}))
    return results


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # bad model, device, child failed
        sys.exit(f"contention.py: {e}")
