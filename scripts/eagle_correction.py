"""SSD with an EAGLE head, the correction of a hit's states on and off, side by side.

When an outcome arrives, eagle.EagleSpeculator follows the target's features of the tokens just
verified. A miss always does (its backup drafts from them). A hit's proposals were drafted from the
head's own states; with `correct_hits` its next pre-speculation first re-feeds the round's tokens
with the target's g (one more forward of the head a round, the proposals past them one at a time),
without it the head keeps its own states. This prints, for both, the cache hit rate, the per-token
acceptance a = accepted / trials, tokens a round and decode tok/s, interleaved in shuffled order,
medians of --repeats passes, on the same prompts and threads:

    python scripts/eagle_correction.py --target smollm2-135m --draft checkpoints/smollm2-135m-eagle \
        --chat --prompt-file scripts/apart_prompts.jsonl --prompts 4 --k 3
"""
import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import eagle  # noqa: E402
from bench import encode_prompts, file_prompts  # noqa: E402
from checkpoint import load_model  # noqa: E402
from run import generate  # noqa: E402


def one_pass(ids, target, a, correct: bool) -> dict:
    eagle.EagleSpeculator.correct_hits = correct  # a class setting: this script's two arms
    tot = {"tokens": 0, "seconds": 0.0, "hits": 0, "lookups": 0, "accepted": 0.0, "trials": 0,
           "rounds": 0}
    for i, prompt in enumerate(ids):
        s = generate([prompt], target=target, draft=a.draft, mode="ssd", k=a.k,
                     max_new_tokens=a.max_new_tokens, ignore_eos=True, seed=a.seed + i,
                     parallel=not a.no_parallel, compile=a.compile, target_threads=1,
                     draft_threads=1).stats
        tot["tokens"] += s["new_tokens"] - 1
        tot["seconds"] += s["decode_seconds"]
        tot["hits"] += s["hits"]
        tot["lookups"] += s["hits"] + s["misses"]
        tot["accepted"] += s["accepted_per_proposed"] * s["proposed_tokens"]
        tot["trials"] += s["acceptance_trials"]
        tot["rounds"] += s["rounds"]
    return {"tok/s": tot["tokens"] / tot["seconds"], "hit rate": tot["hits"] / tot["lookups"],
            "a": tot["accepted"] / max(1, tot["trials"]),
            "tokens/round": tot["tokens"] / tot["rounds"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", required=True, help="an EAGLE head's directory")
    ap.add_argument("--prompt-file", default="scripts/apart_prompts.jsonl")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-parallel", action="store_true", help="the speculator in this process")
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args(argv)
    if not eagle.is_head(Path(a.draft)):
        ap.error(f"--draft {a.draft} is not an EAGLE head's directory (scripts/train_eagle.py)")
    ids = encode_prompts(file_prompts(a.prompt_file, a.prompts), a.target, 4096, a.chat)
    target = load_model(a.target, tokenizer=False)[0]
    one_pass(ids[:1], target, a, True)  # warm-up: compiles, first-touch pages
    runs = {True: [], False: []}
    for rep in range(a.repeats):
        arms = [True, False]
        random.Random(rep).shuffle(arms)
        for arm in arms:
            runs[arm].append(one_pass(ids, target, a, arm))
    print(f"SSD with {a.draft} on {a.target}, K = {a.k}, {len(ids)} prompts x "
          f"{a.max_new_tokens} tokens, {'one process' if a.no_parallel else 'two processes'}, "
          f"medians of {a.repeats}")
    print(f"{'correct_hits':>12} | {'tok/s':>7} | {'hit rate':>8} | {'a':>6} | tokens/round")
    for arm in (True, False):
        med = {k: statistics.median(r[k] for r in runs[arm]) for k in runs[arm][0]}
        print(f"{str(arm):>12} | {med['tok/s']:7.1f} | {med['hit rate']:8.3f} | {med['a']:6.3f} "
              f"| {med['tokens/round']:.2f}")


if __name__ == "__main__":
    main()
