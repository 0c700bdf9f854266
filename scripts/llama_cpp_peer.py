"""llama.cpp as bench.py's peer (engine "llama.cpp"): decode the same token ids from the same GGUF
file, greedy, EOS ignored, and print the timings as one JSON line.

Runs in whichever Python has llama-cpp-python (bench.py --llama-cpp-python PATH; it is an optional
peer, often in a venv of its own, since it builds llama.cpp from source). Reads one JSON object on
stdin: {"model": path, "threads": n, "prompts": [[ids]...], "max_new_tokens": n, "n_ctx": n}.
Per prompt: the prompt's forward plus the first token is the prefill; each further token is one
decode step (llama_cpp.Llama.eval of one token), the greedy token the argmax of its logits, as
this engine's AR does.
"""
import json
import sys
import time

import numpy as np
from llama_cpp import Llama


def main():
    job = json.load(sys.stdin)
    llm = Llama(job["model"], n_threads=job["threads"], n_threads_batch=job["threads"],
                n_ctx=job["n_ctx"], logits_all=False, verbose=False)
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
