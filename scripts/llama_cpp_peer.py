"""llama.cpp as bench.py's peer (engine "llama.cpp"): decode the same token ids from the same GGUF
file, greedy, EOS ignored, and print the timings as one JSON line.

Runs in whichever Python has llama-cpp-python (bench.py --llama-cpp-python PATH; it is an optional
peer, often in a venv of its own, since it builds llama.cpp from source). Reads one JSON object on
stdin: {"model": path, "threads": n, "prompts": [[ids]...], "max_new_tokens": n, "n_ctx": n}.
Per prompt: the prompt's forward plus the first token is the prefill; each further token is one
decode step (llama_cpp.Llama.eval of one token), the greedy token the argmax of its logits, as
this engine's AR does.

{"forwards": {"context": [ids], "sizes": [R...], "steps": n, "prefill": [ids]}} in the job
times forwards instead (scripts/step_floor.py): the median of `steps` evals of R tokens after
the context, each dropped again (what a verification of R tokens costs; R = 1 is a decode step),
and the median of 3 evals of the prefill prompt from an empty cache. "logits_all": true keeps
every row's logits, as a verification needs them (the decode job keeps the last row's).

"repack": false turns llama.cpp's weight repacking off (use_extra_bufts=False): on some Xeon guests
its AMX repacked weights crash on a real prompt.
"""
import json
import statistics
import sys
import time

import llama_cpp.llama_cpp as lib
import numpy as np
from llama_cpp import Llama


def forwards(llm, context: list, sizes: list, steps: int, prefill: list) -> dict:
    """-> {"forward_ms": {R: median ms of an eval of R tokens after the context},
    "prefill_ms": median ms of the prefill prompt's eval from an empty cache}."""
    out = {"forward_ms": {}, "prefill_ms": None}
    llm.reset()
    llm.eval(context)
    for R in sizes:
        times = []
        for _ in range(steps + 3):  # the first 3 warm up
            llm.n_tokens = len(context)  # eval drops the cache past n_tokens before it writes
            t0 = time.perf_counter()
            llm.eval([5] * R)
            times.append(time.perf_counter() - t0)
        out["forward_ms"][R] = statistics.median(times[3:]) * 1e3
    if prefill:
        times = []
        for _ in range(3):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(prefill)
            times.append(time.perf_counter() - t0)
        out["prefill_ms"] = statistics.median(times) * 1e3
    return out


def without_repacking():
    """Llama() takes no use_extra_bufts (llama-cpp-python 0.3.36): its model parameters start from
    llama_model_default_params, so the defaults it reads are given with repacking off."""
    default = lib.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p
    lib.llama_model_default_params = params


def main():
    job = json.load(sys.stdin)
    if not job.get("repack", True):
        without_repacking()
    llm = Llama(job["model"], n_threads=job["threads"], n_threads_batch=job["threads"],
                n_ctx=job["n_ctx"], n_batch=max(512, job["n_ctx"]),
                logits_all=job.get("logits_all", False),
                verbose=False)
    if "forwards" in job:
        print(json.dumps(forwards(llm, **job["forwards"])))
        return
    out = dict(new=0, first=0, prefill_s=0.0, decode_s=0.0)
    for ids in job["prompts"]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t1 = time.perf_counter()
        for _ in range(job["max_new_tokens"] - 1):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t2 = time.perf_counter()
        out["new"] += job["max_new_tokens"]
        out["first"] += 1
        out["prefill_s"] += t1 - t0
        out["decode_s"] += t2 - t1
    print(json.dumps(out))


if __name__ == "__main__":
    main()
