"""A CPU decode step against its bandwidth floor: the time a step needs at least, reading the
model's weights once at the speed this machine reads memory, beside the time it takes.

The speed is `x.sum()` over a float32 tensor far larger than the caches (1 GiB by default), in
2 MB pages where Linux gives them, as huge_pages.into_huge_pages lays a quantized model's weights
(on a 2-core EPYC one core read 4 KB pages at 25.7 GB/s, 2 MB pages at 31.4): the
fastest of 3 sums. The step is the compiled 1-token forward after 100 tokens of context (the
engine's decode path), the median of `--steps`. The two are measured in turn at each thread count,
`--rounds` times in one process, because this kind of machine's speed drifts from minute to
minute: each ratio compares a step with the floor measured beside it. The floor counts the
weights alone; the step also reads its K and V (100 tokens: 2.3 MB for SmolLM2-135M, 2% of its
94 MiB of weights).

`--verify 2,3,4,5,8` also times a verification of R tokens (one forward of R new tokens after the
same context, what SD's and SSD's verifier runs for K = R - 1) beside each step: it reads the same
weights, so its floor is the step's, and verify / step says what the rows past the first cost.

    python scripts/step_floor.py --target smollm2-135m --quant auto --threads 1,2 --verify 2,3,4,5,8
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from checkpoint import load_model  # noqa: E402
from huge_pages import huge_page_slab  # noqa: E402
from quantize import weight_bytes  # noqa: E402

CONTEXT = 100  # tokens in the cache before the timed steps


def read_speed(x: torch.Tensor, tries: int = 3) -> float:
    """Bytes a second that x.sum() reads x at: the fastest of `tries`."""
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best


def step_seconds(model, cache, seq, steps: int, tokens: int = 1) -> float:
    """The median time of a forward of `tokens` new tokens at CONTEXT tokens (a decode step, or a
    verification of that many), each forward's tokens dropped again."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        model.forward_cached(cache, [seq], torch.tensor([5] * tokens), [tokens])
        times.append(time.perf_counter() - t0)
        cache.truncate(seq, CONTEXT)
    return statistics.median(times)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--quant", default="auto", help="none, int8, int4 or auto (a file's own)")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=5, help="floor-then-step measurements a count")
    ap.add_argument("--steps", type=int, default=60, help="timed steps a round")
    ap.add_argument("--gib", type=float, default=1.0, help="size of the tensor summed, GiB")
    ap.add_argument("--no-compile", action="store_true", help="eager steps (no torch.compile)")
    ap.add_argument("--verify", default="", help="token counts R of verifications timed beside "
                    "each step, comma-separated (e.g. 2,3,4,5,8)")
    a = ap.parse_args(argv)
    verify = [int(r) for r in a.verify.split(",") if r]
    model, _ = load_model(a.target, quant=a.quant, tokenizer=False)
    model.use_graphs(True, compile=not a.no_compile)
    weights = weight_bytes(model)
    cache = model.new_cache(CONTEXT + 16 + max(verify, default=0))
    seq = cache.new_seq()
    big = huge_page_slab(int(a.gib * 2**30)).view(torch.float32).fill_(1)  # whole 2 MB pages
    rows, threads = [], torch.get_num_threads()
    with torch.no_grad():
        model.prefill(cache, [seq], [list(range(100, 100 + CONTEXT))])
        for tokens in [1, *verify]:
            step_seconds(model, cache, seq, 5, tokens)  # the first forwards of a size compile
        try:
            for r in range(a.rounds):
                for th in (int(t) for t in a.threads.split(",")):
                    torch.set_num_threads(th)
                    speed = read_speed(big)
                    step = step_seconds(model, cache, seq, a.steps)
                    rows.append(dict(threads=th, round=r, read_gb_s=speed / 1e9,
                                     floor_ms=weights / speed * 1e3, step_ms=step * 1e3,
                                     ratio=step * speed / weights,
                                     verify_ms={R: step_seconds(model, cache, seq, a.steps, R) * 1e3
                                                for R in verify}))
        finally:
            torch.set_num_threads(threads)
    out = dict(target=a.target, quant=a.quant, weight_mib=weights / 2**20, context=CONTEXT,
               compiled=not a.no_compile, rows=rows, median_ratio={}, verify_steps={})
    print(f"{a.target} ({a.quant}): {weights / 2**20:.1f} MiB of weights, 1-token step at "
          f"{CONTEXT} tokens of context")
    print("threads  read GB/s  floor ms  step ms  step / floor"
          + "".join(f"  verify {R} ms" for R in verify))
    for row in rows:
        print(f"{row['threads']:7d}  {row['read_gb_s']:9.1f}  {row['floor_ms']:8.2f}  "
              f"{row['step_ms']:7.2f}  {row['ratio']:12.2f}"
              + "".join(f"  {row['verify_ms'][R]:11.2f}" for R in verify))
    for th in sorted({row["threads"] for row in rows}):
        ratios = [row["ratio"] for row in rows if row["threads"] == th]
        out["median_ratio"][th] = statistics.median(ratios)
        print(f"{th} thread(s): step / floor median {statistics.median(ratios):.2f} "
              f"[{min(ratios):.2f}-{max(ratios):.2f}] over {len(ratios)} rounds")
        # each verification over the step measured beside it, the median over the rounds
        out["verify_steps"][th] = {R: statistics.median(row["verify_ms"][R] / row["step_ms"]
                                                        for row in rows if row["threads"] == th)
                                   for R in verify}
        if verify:
            print(f"{th} thread(s): a verification of R tokens in decode steps (median): "
                  + ", ".join(f"R = {R}: {v:.2f}" for R, v in out["verify_steps"][th].items()))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
