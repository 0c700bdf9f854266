"""Generate text with autoregressive decoding (ar), speculative decoding (sd) or speculative
speculative decoding (ssd): the `generate()` API and the command line.

    python run.py                                   # the shipped tiny pair, SSD, a code prompt
    python run.py --mode sd --k 4 --temperature 0.7 --prompt "def fib(n):"
    python run.py --target llama-70b --draft llama-1b --chat --prompt "Write a haiku"
    python run.py --mode auto                       # measures ar, sd and ssd here, runs the fastest

generate() checks the request, has engine.py place and load the models and wire the engine, and
runs its prompts as a static batch of decode.py's rounds, where the algorithm is. In `ssd` mode the
speculator runs in a second process (channel.py) unless parallel=False.
"""
import argparse
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from checkpoint import load_model, load_tokenizer
from devices import DTYPES, placement
from quantize import QUANTS
from draft import DraftSettings, recorded_settings
from spec_policy import PRE_SPEC
from engine import (LOADING, Engine, EngineConfig, Started, build_engine, default_devices,
                    kv_sizes, load_target, one_line_warnings, rank_threads,
                    refuse_target_devices, threads_of)
from fallback import POLICIES
from model import Transformer
from scheduler import Request
from spec_cache import FAN_OUT_HELP, parse_fan_out
from tp import TP_TIMEOUT_S, TorchrunEnv, serve_torchrun_rank, torchrun_device, torchrun_env

# Ends where an editor leaves the cursor, at the body's indentation. The tiny pair's tokenizer
# splits "\n        self" as "\n       " + " self" (the first line one space too deep); a bare
# final "\n" is worse: the tiny target ends the text at once. (Token healing would fix both.)
DEFAULT_PROMPT = "class Stack:\n    def __init__(self):\n        "

MODES = ("ar", "sd", "ssd")
SPEC = DraftSettings()  # the draft's defaults, which the command line's flags show
AUTO_WARM, AUTO_TOKENS = 8, 24  # mode="auto": tokens per prompt each mode decodes, then times


@dataclass
class GenerateResult:
    tokens: list[list[int]]  # new token ids per prompt
    text: list[str] | None   # decoded, when the target has a tokenizer
    stats: dict = field(default_factory=dict)


def generate(prompts, target="tiny", draft="tiny-draft", mode="sd", max_new_tokens=128,
             temperature=0.0, k=None, seed=0, ignore_eos=False, fan_out=None, budget=None,
             saguaro_c=None, fallback=None, parallel=True, target_device=None, draft_device=None,
             target_threads=None, draft_threads=None, kv_tokens=None, block_size=16, chat=False,
             stream=None, target_devices: list[str] | None = None, tp_timeout: float = TP_TIMEOUT_S,
             dtype="auto", graphs: bool | None = None, pre_spec=None,
             tokenizer=None, torchrun: bool = False, fixed_budget=None,
             compile: bool | None = None, quant="auto", draft_quant="auto",
             prefix_caching=None, confidence=None,
             draft_settings: DraftSettings | None = None) -> GenerateResult:
    """Generate up to max_new_tokens for each prompt (strings, or lists of token ids).

    mode: "ar" (target only), "sd" (speculative decoding, up to k draft tokens per round), "ssd"
    (speculative speculative decoding with Saguaro) or "auto" (the fastest of the three, measured
    on these prompts first: generate_auto); default "sd", while the command line's --mode
    defaults to "ssd". parallel=False: ssd's speculator in this process (design.md section 7).
    How the draft proposes is draft.DraftSettings, given whole as draft_settings or by its fields
    (None: the value the draft's checkpoint records, draft.recorded_settings, else DraftSettings'
    default): k (K), confidence (stop a row's proposal after a token the draft is less sure of),
    and ssd's fan_out, budget B, fixed_budget (B kept, not adapted to the time), saguaro_c C,
    fallback policy, pre_spec ("always" every round, "auto" only while that measures faster,
    "never" not at all: SD's schedule across two processes, what the split alone costs).
    target_devices: two or more devices (["cuda:0", ..., "cuda:3"]) run the target tensor parallel,
    one rank per device (it replaces target_device); torchrun=True: this process is rank 0 of a
    torchrun world and the target runs over all its ranks, on every node (the others run
    tp.serve_torchrun_rank); tp_timeout: seconds a rank may wait in one collective. kv_tokens: the
    target's KV cache in tokens (default: sized for the request); the draft gets the same plus room
    for SSD's branches. dtype: both models' weights and activations, "auto" (bfloat16 on CUDA,
    float32 on the CPU), "float32", "bfloat16" or "float16"; logits are float32 in every dtype.
    quant / draft_quant: the target's / the draft's linear weights, "auto" (the precision the
    draft's checkpoint records, else a GGUF file's own, float for safetensors), "none" (float),
    "int8" or "int4" (quantize.py); SD and SSD are exact with respect to the models as loaded.
    graphs, compile (model.Transformer.use_graphs has the details): graphs=None replays decode
    steps and verifications as CUDA graphs on CUDA (not with tensor parallelism), eagerly
    elsewhere; True pads them to static shapes on any device; False turns them off. compile=None
    compiles those graphs' layers (torch.compile) on CUDA only; True also on the CPU, each step's
    body as one graph (model.compiled_body). Compiling needs a C++ compiler and seconds per model,
    thread count and graph the first time (cached on disk), reported as `capture_seconds`.
    prefix_caching: a prompt that starts with full KV blocks another prompt cached reuses them, on
    the target's cache and the draft's (kv_cache.py); the tokens are the same either way. None: on,
    except with an EAGLE head (eagle.py), where it is not implemented.
    stream(row, tokens_so_far) is called as tokens are accepted; tokenizer: the target's, where the
    caller has it. target may also be a model load_model() gave (on its device, in its dtype, not
    tensor parallel): calls with the same one (a bench sweep) load it once, reuse its graphs."""
    if mode == "auto":
        return generate_auto(**locals())  # every parameter, as given
    prompts = check_request(prompts, max_new_tokens)
    recorded, recorded_quant = recorded_settings(draft)
    spec = settings_of(draft_settings, recorded, K=k, confidence=confidence, fan_out=fan_out,
                       budget=budget, saguaro_c=saguaro_c, fallback=fallback, pre_spec=pre_spec,
                       fixed_budget=fixed_budget)
    cfg = EngineConfig(target=target, draft=draft, mode=mode, temperature=temperature, spec=spec,
                       seed=seed, ignore_eos=ignore_eos, parallel=parallel,
                       target_device=target_device, draft_device=draft_device,
                       target_threads=target_threads, draft_threads=draft_threads,
                       kv_tokens=kv_tokens, target_devices=target_devices, tp_timeout=tp_timeout,
                       dtype=dtype, graphs=graphs, block_size=block_size, torchrun=torchrun,
                       compile=compile, quant=quant, prefix_caching=prefix_caching,
                       draft_quant=draft_quant_of(recorded_quant, draft_quant))
    return generate_with(cfg, prompts, max_new_tokens, chat, stream, tokenizer)


def generate_with(cfg: EngineConfig, prompts, max_new_tokens, chat, stream,
                  tokenizer) -> GenerateResult:
    """generate() once its settings are checked: load, size the KV caches for these prompts,
    decode them as one static batch, and stop whatever was started on every path out."""
    old_threads = torch.get_num_threads()
    started = Started()
    try:
        loaded = load_target(cfg, started, tokenizer)
        ids = [encode(loaded.tokenizer, p, chat) for p in prompts]
        check_prompts(ids, loaded.model.config, max_new_tokens, cfg.K)
        sizes = kv_sizes(ids, max_new_tokens, cfg.K, cfg.block_size, cfg.kv_tokens,
                         cfg.branch_budget)
        engine = build_engine(cfg, loaded, *sizes, max_batch=len(ids))
        requests = [Request(p, max_new_tokens, on_tokens=row_stream(stream, r))
                    for r, p in enumerate(ids)]
        stats = run_static(engine, requests)
        tokens = engine.scheduler.out.tokens
        return GenerateResult(tokens, detokenize(engine.tokenizer, tokens), stats)
    finally:
        torch.set_num_threads(old_threads)
        started.stop()


def generate_auto(prompts, mode, target, tokenizer, chat, stream, max_new_tokens,
                  **kw) -> GenerateResult:
    """generate(mode="auto"): load the target once, decode AUTO_WARM + AUTO_TOKENS tokens of each
    prompt in every mode and time the last AUTO_TOKENS (measure), say on stderr what each gave
    and which it chose, and generate in that mode. Each run builds its own engine, whose random
    streams start from the seed, so the answer is the chosen mode's for that seed at any
    temperature: the measurement draws from none of its streams. stats["auto_tok_s"]: the
    measured tokens/s per mode."""
    prompts = check_request(prompts, max_new_tokens)
    if kw["target_devices"] or kw["torchrun"]:
        raise ValueError("--mode auto measures each mode on a target loaded once, which a "
                         "tensor-parallel target cannot be: choose the mode (ar, sd or ssd)")
    if not isinstance(target, Transformer):
        with LOADING:
            target, tok = load_model(target, device=kw["target_device"] or default_devices()[0],
                                     dtype=kw["dtype"], tokenizer=tokenizer is None,
                                     quant=kw["quant"])
        tokenizer = tokenizer or tok
    rates = {m: measure(prompts, m, target, tokenizer, chat, kw) for m in MODES}
    chosen = max(rates, key=rates.get)
    print(f"mode auto: {', '.join(f'{m} {r:.1f}' for m, r in rates.items())} tok/s over "
          f"{AUTO_TOKENS} tokens per prompt -> {chosen}, the fastest here", file=sys.stderr)
    res = generate(prompts, target=target, mode=chosen, tokenizer=tokenizer, chat=chat,
                   stream=stream, max_new_tokens=max_new_tokens, **kw)
    res.stats["auto_tok_s"] = rates
    return res


def measure(prompts, mode, target, tokenizer, chat, kw) -> float:
    """Tokens/s of `mode` on the prompts (EOS ignored: a fixed length): every row's tokens from
    the AUTO_WARM-th on (the first rounds pay for first calls: a process starting, caches
    growing) over the seconds they took, clocked as the rounds hand them over."""
    marks, counts = [], {}  # (time, tokens so far over all rows) per handover; tokens per row

    def clock(row, tokens):
        counts[row] = len(tokens)
        marks.append((time.perf_counter(), sum(counts.values())))
    res = generate(prompts, target=target, mode=mode, tokenizer=tokenizer, chat=chat, stream=clock,
                   max_new_tokens=AUTO_WARM + AUTO_TOKENS, **{**kw, "ignore_eos": True,
                                                               "kv_tokens": None})
    (t0, n0), (t1, n1) = next(m for m in marks if m[1] >= AUTO_WARM * len(prompts)), marks[-1]
    return (n1 - n0) / (t1 - t0) if t1 > t0 else res.stats["decode_tok_s"]  # one round timed


def settings_of(given: DraftSettings | None, recorded: dict, **fields) -> DraftSettings:
    """generate()'s draft settings: the object given, or one from the fields given, a field not
    given (None) taken from those the draft's checkpoint records (`recorded`, from
    draft.recorded_settings), else DraftSettings' default; an object and fields at once is
    refused, as one would silently win."""
    fields = {name: v for name, v in fields.items() if v is not None}
    F, B = fields.get("fan_out"), fields.get("budget")
    if isinstance(F, (list, tuple)) and B is not None and sum(F) != B:  # one would silently win
        raise ValueError(f"fan_out={list(F)} makes B = {sum(F)} branches and budget={B} was given "
                         f"too: an explicit fan-out is its own budget, leave --budget out")
    if given is not None and fields:
        raise ValueError(f"draft_settings and {', '.join(f.lower() for f in fields)} given "
                         f"together: put {'them' if len(fields) > 1 else 'it'} in draft_settings")
    return given if given is not None else DraftSettings(**{**recorded, **fields})


def draft_quant_of(recorded_quant: str | None, quant: str) -> str:
    """The draft's weights: `quant` as given, or for "auto" the precision its checkpoint records
    with its settings (draft.recorded_settings), else "auto" (checkpoint.load_model: a GGUF file's
    own, float for safetensors)."""
    return (recorded_quant or "auto") if quant == "auto" else quant


def recorded_or(value) -> str:
    """What a draft-setting flag's help says its default is."""
    return f"the draft's recorded value, else {value}"


def check_request(prompts, max_new_tokens) -> list:
    """The request's plain values, checked before anything loads (the engine's: EngineConfig); one
    prompt becomes a list of one."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise ValueError("no prompts given")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    return prompts


def row_stream(stream, row):
    """generate()'s stream(row, tokens) as one request's on_tokens; what it returns is dropped (a
    true on_tokens would end the row as a server's stop string does)."""
    def on_tokens(tokens) -> bool:
        stream(row, tokens)
        return False
    return None if stream is None else on_tokens


def run_static(engine: Engine, requests: list[Request]) -> dict:
    """The requests as a static batch: every one submitted at once, so all join the first round
    and the scheduler runs until the last leaves; -> the run's stats."""
    for req in requests:
        engine.scheduler.submit(req)
    prefill_s, decode_s = engine.scheduler.run()
    return engine.stats(prefill_s, decode_s)


def detokenize(tok, tokens) -> list[str] | None:
    """The text a user reads: special tokens (<|im_end|>, </s>) stay in the token ids only."""
    return [tok.decode(x, skip_special_tokens=True) for x in tokens] if tok is not None else None


def check_prompts(ids, cfg, max_new_tokens, K):
    """Each prompt has tokens, fits the target's context with its output, and is in the
    vocabulary."""
    for p in ids:
        if not p:
            raise ValueError("empty prompt: give at least one token")
        if len(p) + max_new_tokens + K + 1 > cfg.max_position_embeddings:
            raise ValueError(f"prompt of {len(p)} tokens + max_new_tokens={max_new_tokens} "
                             f"exceeds the target's context of {cfg.max_position_embeddings}: "
                             f"shorten the prompt or max_new_tokens")
        bad = [x for x in p if not 0 <= x < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} outside the vocabulary ({cfg.vocab_size})")


def encode(tokenizer, prompt, chat):
    if not isinstance(prompt, str):
        return list(prompt)
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer: pass prompts as lists of token ids")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: leave --chat out")
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    # the tokenizer's own special tokens, as transformers adds them: a Llama's (and the tiny pair's)
    # put BOS first, SmolLM2's none (its "BOS" <|im_start|> opens a chat turn: raw text after one
    # is a turn with no role, which the model often ends at once)
    ids = tokenizer(prompt)["input_ids"]
    if not prompt or not ids:  # (a BOS alone is not a prompt)
        raise ValueError(f"prompt {prompt!r} tokenizes to no tokens: give a prompt with text")
    return ids


# --------------------------------------------------------------------------------------------------
# The command line

def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="Generate text with autoregressive decoding (ar), speculative decoding (sd) or "
                    "speculative speculative decoding (ssd, Saguaro). Streams the text of the "
                    "prompt's continuation, then prints speed and acceptance statistics.")
    g = ap.add_argument_group("what to generate")
    add_prompt_options(g)
    add_decoding_options(g)
    add_algorithm_options(ap.add_argument_group("models and algorithm"), auto=True)
    add_device_options(ap.add_argument_group("devices and memory"))
    add_output_options(ap.add_argument_group("output"))
    return ap


def add_prompt_options(g):
    g.add_argument("--prompt", default=DEFAULT_PROMPT,
                   help="the prompt text (default: a Python class header the tiny pair continues)")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the tokenizer's chat template (instruct models)")


def add_decoding_options(g):
    """How to decode (serve.py takes these too: its defaults for every request)."""
    g.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="stop after N new tokens (default: %(default)s)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep going past the end-of-sequence token")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 is greedy (argmax) (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0,
                   help="random seed of the sampling (same seed, same tokens) "
                        "(default: %(default)s)")


def add_algorithm_options(g, auto=False):
    """The models and the algorithm (serve.py takes these too, without auto: it has no prompt to
    measure on before it starts)."""
    g.add_argument("--target", default="tiny", metavar="MODEL",
                   help="target model: an HF directory, a GGUF file, an HF hub id (downloaded "
                        "if not cached), or an alias (llama-70b, llama-8b, llama-1b, qwen-8b, "
                        "smollm2-135m, tiny, ...; see README) (default: %(default)s)")
    g.add_argument("--draft", default="tiny-draft", metavar="MODEL",
                   help="draft model (sd, ssd), same forms as --target; must share the target's "
                        "vocabulary (default: %(default)s)")
    g.add_argument("--mode", default="ssd", choices=[*MODES, "auto"] if auto else MODES,
                   help="ar: target alone; sd: speculative decoding; ssd: speculative speculative "
                        "decoding" + ("; auto: decode a few tokens of the prompt in each, say on "
                                      "stderr what each gave, and go on in the fastest" if auto
                                      else "") + " (default: %(default)s)")
    g.add_argument("--k", type=int, default=None, metavar="K",
                   help="K: the most draft tokens proposed per round (sd, ssd) "
                        "(default: " + recorded_or(SPEC.K) + ")")
    g.add_argument("--confidence", type=float, default=None, metavar="P",
                   help="sd, ssd: a row's proposal stops after the first token the draft gives a "
                        "probability below P (exact either way; 0: always K) "
                        "(default: " + recorded_or(SPEC.confidence) + ")")
    g.add_argument("--fan-out", default=None, metavar="F",
                   help="ssd: how the B guesses per sequence spread over the K+1 depths: "
                        f"{FAN_OUT_HELP} (default: " + recorded_or(SPEC.fan_out) + ")")
    g.add_argument("--budget", type=int, default=None, metavar="B",
                   help="ssd: B, outcome guesses (branches) pre-speculated per sequence per round; "
                        "the ceiling of a budget that adapts to the measured time; an explicit "
                        "--fan-out is its own (default: " + recorded_or(SPEC.budget) + ")")
    g.add_argument("--fixed-budget", action="store_true", default=None,
                   help="ssd: keep B at --budget every round instead of adapting it to the "
                        "measured time (experiments: rules compared at equal B)")
    g.add_argument("--saguaro-c", type=float, default=None, metavar="C",
                   help="ssd at T > 0: Saguaro sampling's C in [0, 1]; the draft's law is scaled "
                        "by C on the cached guesses, so the target's rejections land on them more "
                        "often (1 = the plain law) (default: " + recorded_or(SPEC.saguaro_c) + ")")
    g.add_argument("--fallback", default=None, choices=POLICIES,
                   help="ssd: who proposes after a cache miss: the draft (neural), a cheap n-gram "
                        "or random speculator, or auto (the draft while the batch is below the "
                        "critical batch size b*, estimated from this run's timings, n-gram from b* "
                        "on) (default: " + recorded_or(SPEC.fallback) + ")")
    g.add_argument("--pre-spec", default=None, choices=PRE_SPEC,
                   help="ssd: always pre-speculate, as the paper does, auto: only while that "
                        "measures faster than letting the verifier work alone (on a CPU the "
                        "draft's work slows the verifier down), or never: SD's schedule with the "
                        "draft in its own process, the control "
                        "(default: " + recorded_or(SPEC.pre_spec) + ")")
    g.add_argument("--no-parallel", action="store_true",
                   help="ssd: run the verifier and the speculator interleaved in one process "
                        "(slower; the same tokens where no timing steers: T = 0, or a fixed "
                        "budget and fallback)")


def add_device_options(g, kv_default="sized for the prompt and --max-new-tokens",
                       threads_default="all cores"):
    """The device and memory flags (serve.py passes its own defaults' words)."""
    g.add_argument("--device", default=None,
                   help="device for both models, e.g. cpu or cuda:0 (default: target on cuda:0 "
                        "and draft on the next GPU if there are GPUs, else cpu)")
    g.add_argument("--target-device", default=None,
                   help="device of the target (overrides --device)")
    g.add_argument("--draft-device", default=None, help="device of the draft (overrides --device)")
    g.add_argument("--target-devices", default=None, metavar="DEV,DEV,...",
                   help="tensor-parallel target, one rank per device: cuda:0,cuda:1,cuda:2,cuda:3 "
                        "(NCCL) or cpu,cpu (gloo)")
    g.add_argument("--tp-timeout", type=float, default=TP_TIMEOUT_S, metavar="SECONDS",
                   help="tensor parallel: a rank waiting longer than this in one collective (a "
                        "stopped or hung peer) ends the run with an error naming the rank "
                        "(default: %(default)s)")
    g.add_argument("--target-threads", type=int, default=None, metavar="N",
                   help=f"CPU threads of the target (default: {threads_default}; in parallel "
                        f"ssd the larger half)")
    g.add_argument("--draft-threads", type=int, default=None, metavar="N",
                   help="CPU threads of the speculator process in parallel ssd (default: the "
                        "smaller half)")
    g.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="weights and activations of both models (the logits are float32 in every "
                        "dtype): auto is bfloat16 on CUDA and float32 on the CPU; bfloat16 runs on "
                        "the CPU too, slowly, to check a GPU's numerics there "
                        "(default: %(default)s)")
    g.add_argument("--quant", default="auto", choices=QUANTS,
                   help="the target's linear weights: auto keeps a GGUF file's own precision "
                        "(its 4-bit types as int4, its 5- to 8-bit ones as int8) and safetensors "
                        "in --dtype; none dequantises; int8 / int4 quantize at load, weight-only "
                        "(default: %(default)s)")
    g.add_argument("--draft-quant", default="auto", choices=QUANTS,
                   help="the same for the draft; auto: the precision its checkpoint records with "
                        "its settings, else as for --quant (default: %(default)s)")
    g.add_argument("--no-graphs", action="store_true",
                   help="on CUDA, run decode steps and verifications eagerly instead of replaying "
                        "them as CUDA graphs (on the CPU only --compile's steps run as graphs; "
                        "not with --no-graphs)")
    c = g.add_mutually_exclusive_group()
    c.add_argument("--no-compile", action="store_true",
                   help="on CUDA, replay the eager layers' kernels in the CUDA graphs instead of "
                        "compiling them first with torch.compile (seconds per new shape)")
    c.add_argument("--compile", action="store_true",
                   help="on the CPU too: each decode step and verification runs the model's body "
                        "as one torch.compile graph (needs a C++ compiler; some 20 s per model "
                        "and thread count the first time, reported apart from decoding)")
    g.add_argument("--kv-tokens", type=int, default=None, metavar="TOKENS",
                   help=f"target KV cache size in tokens (default: {kv_default}); the draft's "
                        f"cache gets the same plus room for ssd's branches")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="compute every prompt's KV anew, instead of reusing the full KV blocks "
                        "of a prompt with the same start (both caches; the tokens are the same)")


def add_output_options(g):
    g.add_argument("--json", action="store_true",
                   help="print one JSON line with the tokens, text and stats instead")
    g.add_argument("--explain", action="store_true",
                   help="after the stats, which product each of the target's quantized layers ran "
                        "(quantize.PRODUCTS) and how many layers ran a step as one C++ call")


def generate_kwargs(a: argparse.Namespace) -> dict:
    """generate()'s arguments from the command line's (the prompt, stream and tokenizer aside)."""
    if a.temperature < 0:  # (the rest is checked where generate() checks it)
        raise ValueError(f"--temperature {a.temperature} must be >= 0")
    recorded, recorded_quant = recorded_settings(a.draft)
    spec = settings_of(None, recorded, K=a.k, confidence=a.confidence,
                       fan_out=parse_fan_out(a.fan_out) if a.fan_out else None, budget=a.budget,
                       saguaro_c=a.saguaro_c, fallback=a.fallback, pre_spec=a.pre_spec,
                       fixed_budget=a.fixed_budget)
    return dict(target=a.target, draft=a.draft, mode=a.mode, max_new_tokens=a.max_new_tokens,
                temperature=a.temperature, draft_settings=spec, seed=a.seed,
                ignore_eos=a.ignore_eos, parallel=not a.no_parallel,
                target_device=a.target_device or a.device,
                draft_device=a.draft_device or a.device, target_threads=a.target_threads,
                draft_threads=a.draft_threads, kv_tokens=a.kv_tokens,
                tp_timeout=a.tp_timeout, dtype=a.dtype, graphs=False if a.no_graphs else None,
                quant=a.quant, draft_quant=draft_quant_of(recorded_quant, a.draft_quant),
                compile=False if a.no_compile else (True if a.compile else None),
                prefix_caching=False if a.no_prefix_caching else None,
                target_devices=a.target_devices.split(",") if a.target_devices else None)


class Detokenizer:
    """A growing token list to text, each token decoded about twice however long the answer gets
    (decoding all of it every round would cost the square of its length). Text is taken only from
    a window that starts a few tokens back, `prefix`, so that what the tokenizer does at the start
    of a decode (a dropped leading space) is the same in both decodes, and only once the window
    does not end inside a character (the replacement character U+FFFD)."""

    def __init__(self, tok):
        self.tok, self.text = tok, ""
        self.prefix = self.read = 0  # tokens[prefix:read] decode to the end of self.text

    def decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def add(self, tokens, done: bool = False) -> str:
        """The text of `tokens` (the same list, grown since the last call) -> all text so far."""
        before = self.decode(tokens[self.prefix:self.read])
        now = self.decode(tokens[self.prefix:])
        if len(now) > len(before) and (done or not now.endswith("\ufffd")):
            self.text += now[len(before):]
            self.prefix, self.read = self.read, len(tokens)
        return self.text


def text_printer(tokenizer):
    """A generate() stream printing the first prompt's text as it is accepted (nothing without a
    tokenizer); called again with the answer and done=True, it prints a held-back character."""
    detok, printed = Detokenizer(tokenizer), 0

    def stream(row, tokens, done=False):
        nonlocal printed
        if row != 0 or tokenizer is None:
            return
        text = detok.add(tokens, done=done)
        sys.stdout.write(text[printed:])
        sys.stdout.flush()
        printed = len(text)
    return stream


def print_stats(s: dict):
    """The run's speed and acceptance, one row each, after the text."""
    print("\n")
    rows = [("mode", s["mode"]), ("new tokens", s["new_tokens"]),
            ("prefill s", f"{s['prefill_seconds']:.3f}"),
            ("decode tok/s", f"{s['decode_tok_s']:.1f}"), ("rounds", s["rounds"]),
            ("tokens/round", f"{s['mean_tokens_per_round']:.2f}")]
    if s["mode"] != "ar":  # the draft's settings (its recorded ones unless a flag gave them)
        rows += [("K, confidence", f"{s['k']}, {s['confidence']}"),
                 ("acceptance a", f"{s['acceptance']:.2f} (accepted / proposed "
                                  f"{s['accepted_per_proposed']:.2f})")]
    if s["capture_seconds"] > 0:  # CUDA graph captures, compiles (--compile): not decoding
        rows.insert(3, ("set-up s", f"{s['capture_seconds']:.1f} (captures, compiles)"))
    if s["mode"] == "ssd":
        b_star = "none: neural at any batch" if s["b_star"] is None else s["b_star"]
        rows += [("cache hit rate", f"{s['cache_hit_rate']:.2f}"),
                 ("fallback", f"{s['fallback']} (b* {b_star})"),
                 ("mean budget B", f"{s['mean_budget']:.1f}"),
                 ("pre-spec stopped", f"{s['pre_speculation_stopped']} rounds"),
                 ("pre-spec skipped", f"{s['pre_speculation_skipped']} rounds"),
                 ("verifier wait",
                  f"{s['verifier_wait_seconds'] / max(s['decode_seconds'], 1e-9):.0%}")]
    for k_, v in rows:
        print(f"{k_:>16}  {v}")


def ssd_on_cpu_cores(a: argparse.Namespace) -> bool:
    """Whether SSD's speculator process takes CPU cores the target could use: the target and the
    draft both on the CPU. SSD's premise, a device for the draft that the target cannot use, then
    does not hold, and SD (the target on every core) may be faster."""
    if a.mode != "ssd" or a.no_parallel:
        return False
    targets = a.target_devices.split(",") if a.target_devices else None
    dev_t, dev_d = default_devices(targets)
    targets = targets or [a.target_device or a.device or dev_t]
    draft = a.draft_device or a.device or dev_d
    return all(d.split(":")[0] == "cpu" for d in [*targets, draft])


def serve_rank(a: argparse.Namespace, env: TorchrunEnv):
    """Ranks 1.. of a torchrun world (rank 0's flags): their slices serve rank 0's calls."""
    refuse_target_devices(a.target_devices)
    device, dtype = placement(torchrun_device(a.target_device or a.device, env.local_rank), a.dtype)
    threads, _ = threads_of(a.mode == "ssd" and not a.no_parallel, a.target_threads,
                            a.draft_threads, os.cpu_count() or 1)  # this node's ranks share them:
    threads = rank_threads(threads, env.local_world * (device.type == "cpu"), a.target_threads)
    serve_torchrun_rank(env, a.target, str(device), dtype, threads, a.tp_timeout)


def interrupt(signum, frame):
    """SIGTERM (kill, a scheduler, torchrun's agent) ends a run as Ctrl-C does: one line."""
    raise KeyboardInterrupt("SIGTERM")


def main(argv=None):
    a = parser().parse_args(argv)
    one_line_warnings()
    if threading.current_thread() is threading.main_thread():  # only it may set a handler
        signal.signal(signal.SIGTERM, interrupt)
    tokenizer = None
    try:
        env = torchrun_env()
        if env and env.rank > 0:  # run.py under torchrun, rank 1..: serve rank 0
            serve_rank(a, env)
            return 0
        kw = generate_kwargs(a)  # the flags checked before anything loads
        if env:
            print(f"run.py: rank 0 of a torchrun world of {env.world} ranks on {env.nodes} "
                  f"node(s): the target runs tensor parallel across all of them", file=sys.stderr)
        elif ssd_on_cpu_cores(a):
            print("run.py: ssd on the CPU: the speculator takes cores the target could use (SSD's "
                  "premise, a draft device the target cannot use, does not hold here); --mode sd "
                  "or --mode auto may be faster", file=sys.stderr)
        if not a.json:
            tokenizer = load_tokenizer(a.target)  # generate() uses it too: built once
            # a chat answer starts on its own line; a plain prompt is continued where it ends
            sys.stdout.write(a.prompt + ("\n\n" if a.chat else ""))
        printer = text_printer(tokenizer)
        res = generate([a.prompt], **kw, chat=a.chat, stream=printer, tokenizer=tokenizer,
                       torchrun=env is not None)
        printer(0, res.tokens[0], done=True)
    except KeyboardInterrupt as e:  # under torchrun a SIGTERM is its agent's: a rank ended
        by = e.args == ("SIGTERM",) and torchrun_env() and " by torchrun: a rank ended (see below)"
        print(f"\ninterrupted{by or ''}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (run.py | head): stop, with no word on a closed pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps({"tokens": res.tokens[0], "text": res.text[0] if res.text else None,
                          "stats": res.stats}))
        return 0
    print_stats(res.stats)
    if a.explain:
        for name, n in sorted(res.stats["target_products"].items()):
            print(f"{'target':>16}  {n} x {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
