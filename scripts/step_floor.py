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

`--prefill 512` also times the prefill of a prompt of that many tokens (the median of 3), and
`--llama-cpp-python PYTHON` runs llama.cpp (llama-cpp-python, scripts/llama_cpp_peer.py) on the
same GGUF file at each thread count of each round, after the engine: its eval of 1 and of R tokens
after the same context, every row's logits kept as a verification needs them, and its prefill.

`SSD_KERNELS_WITHOUT=amx_int8 python scripts/step_floor.py ...` builds cpu_kernels.cpp without the
instructions named (cpu_kernels.cpu_flags): the same bits by another form, so two runs compare
the forms.

    python scripts/step_floor.py --target smollm2-135m --quant auto --threads 1,2 --verify 2,3,4,5,8
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_peers import peer_failure  # noqa: E402
from checkpoint import load_model, resolve  # noqa: E402
from huge_pages import huge_page_slab  # noqa: E402
from quantize import weight_bytes  # noqa: E402

CONTEXT = 100  # tokens in the cache before the timed steps
CONTEXT_IDS = list(range(100, 100 + CONTEXT))  # their ids, the same for llama.cpp


def prompt_ids(n: int) -> list[int]:
    """The ids of the n-token prompt whose prefill is timed (the same for llama.cpp)."""
    return [1000 + i % 9000 for i in range(n)]


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


def prefill_seconds(model, cache, tokens: int) -> float:
    """The median of 3 prefills of a `tokens`-token prompt into a new sequence."""
    times = []
    for _ in range(3):
        seq = cache.new_seq()
        t0 = time.perf_counter()
        model.prefill(cache, [seq], [prompt_ids(tokens)])
        times.append(time.perf_counter() - t0)
        cache.free(seq)
    return statistics.median(times)


def llama_cpp(a, threads: int, sizes: list[int]) -> dict:
    """llama.cpp's forwards on the same file (scripts/llama_cpp_peer.py's "forwards" job) ->
    {"forward_ms": {R: ms}, "prefill_ms": ms or None}."""
    job = dict(model=str(resolve(a.target)), threads=threads, repack=not a.no_repack,
               n_ctx=CONTEXT + max(sizes) + a.prefill + 16, logits_all=True,
               forwards=dict(context=CONTEXT_IDS, sizes=sizes, steps=a.steps,
                             prefill=prompt_ids(a.prefill)))
    res = subprocess.run([a.llama_cpp_python, str(REPO / "scripts" / "llama_cpp_peer.py")],
                         input=json.dumps(job), text=True, capture_output=True)
    if res.returncode:
        sys.exit(peer_failure(res, not a.no_repack))
    out = json.loads(res.stdout.strip().splitlines()[-1])
    return dict(forward_ms={int(R): ms for R, ms in out["forward_ms"].items()},
                prefill_ms=out["prefill_ms"])


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
    ap.add_argument("--prefill", type=int, default=0, help="also time a prefill of this many "
                    "tokens (e.g. 512)")
    ap.add_argument("--llama-cpp-python", metavar="PYTHON", help="a Python with llama-cpp-python: "
                    "time llama.cpp's forwards on the same GGUF file beside the engine's")
    ap.add_argument("--no-repack", action="store_true", help="llama.cpp without its weight "
                    "repacking (use_extra_bufts=False; its AMX repacking crashes on some Xeons)")
    a = ap.parse_args(argv)
    verify = [int(r) for r in a.verify.split(",") if r]
    if a.llama_cpp_python and not resolve(a.target).is_file():
        sys.exit(f"llama.cpp runs GGUF files: --target {a.target} is not one (try smollm2-135m)")
    model, _ = load_model(a.target, quant=a.quant, tokenizer=False)
    model.use_graphs(True, compile=not a.no_compile)
    weights = weight_bytes(model)
    cache = model.new_cache(CONTEXT + 16 + max(verify, default=0) + a.prefill)
    seq = cache.new_seq()
    big = huge_page_slab(int(a.gib * 2**30)).view(torch.float32).fill_(1)  # whole 2 MB pages
    rows, threads = [], torch.get_num_threads()
    with torch.no_grad():
        model.prefill(cache, [seq], [CONTEXT_IDS])
        for tokens in [1, *verify]:
            step_seconds(model, cache, seq, 5, tokens)  # the first forwards of a size compile
        try:
            for r in range(a.rounds):
                for th in (int(t) for t in a.threads.split(",")):
                    torch.set_num_threads(th)
                    speed = read_speed(big)
                    step = step_seconds(model, cache, seq, a.steps)
                    row = dict(threads=th, round=r, read_gb_s=speed / 1e9,
                               floor_ms=weights / speed * 1e3, step_ms=step * 1e3,
                               ratio=step * speed / weights,
                               verify_ms={R: step_seconds(model, cache, seq, a.steps, R) * 1e3
                                          for R in verify})
                    if a.prefill:
                        row["prefill_ms"] = prefill_seconds(model, cache, a.prefill) * 1e3
                    if a.llama_cpp_python:
                        row["llama_cpp"] = llama_cpp(a, th, [1, *verify])
                    rows.append(row)
        finally:
            torch.set_num_threads(threads)
    out = dict(target=a.target, quant=a.quant, weight_mib=weights / 2**20, context=CONTEXT,
               compiled=not a.no_compile, rows=rows, median_ratio={}, verify_steps={},
               llama_cpp={})
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
        if a.prefill:
            ms = statistics.median(row["prefill_ms"] for row in rows if row["threads"] == th)
            out.setdefault("prefill_tok_s", {})[th] = a.prefill / ms * 1e3
            print(f"{th} thread(s): prefill of {a.prefill} tokens {ms:.1f} ms "
                  f"({a.prefill / ms * 1e3:.0f} tok/s, median)")
        if a.llama_cpp_python:
            out["llama_cpp"][th] = llama_cpp_summary(rows, th, verify, a.prefill)
    print(json.dumps(out))
    return out


def llama_cpp_summary(rows: list, th: int, verify: list, prefill: int) -> dict:
    """llama.cpp's medians at th threads over the rounds, printed beside the engine's: its step
    (an eval of 1 token), its evals of R tokens in its own steps, its prefill."""
    runs = [row["llama_cpp"] for row in rows if row["threads"] == th]
    step = statistics.median(r["forward_ms"][1] for r in runs)
    engine = statistics.median(row["step_ms"] for row in rows if row["threads"] == th)
    out = dict(step_ms=step, engine_step_ms=engine,
               verify_steps={R: statistics.median(r["forward_ms"][R] / r["forward_ms"][1]
                                                  for r in runs) for R in verify})
    line = f"{th} thread(s): llama.cpp step {step:.2f} ms (engine {engine:.2f})"
    if verify:
        line += ", R tokens in its steps: " + ", ".join(
            f"R = {R}: {v:.2f}" for R, v in out["verify_steps"].items())
    if prefill:
        ms = statistics.median(r["prefill_ms"] for r in runs)
        out["prefill_tok_s"] = prefill / ms * 1e3
        line += f"; prefill of {prefill} tokens {ms:.1f} ms ({prefill / ms * 1e3:.0f} tok/s)"
    print(line)
    return out


if __name__ == "__main__":
    main()
