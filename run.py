"""Generate text with autoregressive decoding (ar), speculative decoding (sd) or speculative
speculative decoding (ssd): the `generate()` API and the command line.

    python run.py                                   # the shipped tiny pair, SSD, a code prompt
    python run.py --mode sd --k 4 --temperature 0.7 --prompt "def fib(n):"
    python run.py --target llama-70b --draft llama-1b --chat --prompt "Write a haiku"

generate() checks the request, places the models (devices, dtypes, CPU threads, tensor-parallel
ranks), loads them and runs a decode loop from decode.py: where the algorithm is. In `ssd` mode the
speculator runs in a second process (channel.py) unless parallel=False.
"""
import argparse
import json
import os
import sys
import threading
import warnings
from dataclasses import dataclass, field

import torch

from channel import SpeculatorProcess
from decode import NoDraft, Output, SDRounds, SSDRounds
from draft import PRE_SPEC, DraftConfig, SSDConfig, load_draft
from fallback import POLICIES
from spec_cache import FAN_OUT_HELP, parse_fan_out
from checkpoint import load_config, load_model, load_tokenizer, resolve
from cpu_linear import use_forms
from devices import DTYPES, check_device, resolve_dtype
from model import Transformer
from scheduler import KVBudget, Request, Scheduler, cache_tokens
from tp import (TP_TIMEOUT_S, TorchrunEnv, TorchrunWorld, TPVerifier, TPWorkers,
                serve_torchrun_rank, torchrun_device, torchrun_env)
from verify import Verifier

# Ends where an editor leaves the cursor, at the body's indentation. The tiny pair's tokenizer
# splits "\n        self" as "\n       " + " self", so the first line comes out one space too deep;
# a bare final "\n" is worse: the tiny target ends the text at once. (Token healing would fix
# both.)
DEFAULT_PROMPT = "class Stack:\n    def __init__(self):\n        "


# generate() loads its models and tokenizers under this lock: transformers resolves its names on
# first use (a lazy module), which is not thread-safe: 8 threads calling generate() first thing in
# a process failed in 7 with "cannot import name 'AutoTokenizer' from 'transformers'". Loading is
# serialised; decoding is not.
LOADING = threading.Lock()


@dataclass
class GenerateResult:
    tokens: list[list[int]]  # new token ids per prompt
    text: list[str] | None   # decoded, when the target has a tokenizer
    stats: dict = field(default_factory=dict)


@dataclass
class Placement:
    """Where the models run: devices (every one checked, "cuda" given its index), dtypes, and the
    CPU threads of the target's process and of the speculator's."""
    target_device: str
    draft_device: str
    target_devices: list[str] | None  # the target's ranks on this machine, one per device
    target_dtype: torch.dtype
    draft_dtype: torch.dtype
    target_threads: int
    draft_threads: int | None
    cores: int
    torchrun: TorchrunEnv | None = None  # rank 0 of a torchrun world: its ranks span the nodes


@dataclass
class Started:
    """The processes one generate() call started: every path out of it (done, error, Ctrl-C) stops
    them (docs/design.md section 9)."""
    workers: TPWorkers | TorchrunWorld | None = None  # ranks 1.. of a tensor-parallel target
    speculator: object = None         # a SpeculatorProcess, or the Speculator in this process

    def stop(self):
        try:
            if isinstance(self.speculator, SpeculatorProcess):
                self.speculator.close()
        finally:
            if self.workers:
                self.workers.close()  # raises a worker's error, naming its rank


def generate(prompts, target="tiny", draft="tiny-draft", mode="sd", max_new_tokens=128,
             temperature=0.0, k=4, seed=0, ignore_eos=False, fan_out="geometric", budget=8,
             saguaro_c=1.0, fallback="auto", parallel=True, target_device=None, draft_device=None,
             target_threads=None, draft_threads=None, kv_tokens=None, block_size=16, chat=False,
             stream=None, target_devices: list[str] | None = None, tp_timeout: float = TP_TIMEOUT_S,
             dtype="auto", graphs: bool | None = None, pre_spec="always",
             tokenizer=None, torchrun: bool = False, fixed_budget=False) -> GenerateResult:
    """Generate up to max_new_tokens for each prompt (strings, or lists of token ids).

    mode: "ar" (target only), "sd" (speculative decoding, k draft tokens per round) or "ssd"
    (speculative speculative decoding with Saguaro: fan_out, budget B, fixed_budget (B kept, not
    adapted to the time), saguaro_c C, fallback policy; pre_spec "always" every round, "auto" only
    while that measures faster, "never" not at all (SD's schedule across two processes: what the
    split alone costs); parallel=False: the speculator in this process, same tokens for a seed).
    target_devices: two or more devices (["cuda:0", ..., "cuda:3"]) run the target tensor parallel,
    one rank per device (it replaces target_device); torchrun=True: this process is rank 0 of a
    torchrun world and the target runs over all its ranks, on every node (the others run
    tp.serve_torchrun_rank); tp_timeout: seconds a rank may wait in one collective. kv_tokens: the
    target's KV cache in tokens (default: sized for the request); the draft gets the same plus room
    for SSD's branches. dtype: both models' weights and activations, "auto" (bfloat16 on CUDA,
    float32 on the CPU), "float32", "bfloat16" or "float16"; logits are float32 in every dtype.
    graphs: None replays decode steps and verifications as CUDA graphs on CUDA (not with tensor
    parallelism) and runs them eagerly elsewhere; False turns graphs off; True pads them to the
    graphs' static shapes on any device (on the CPU, eagerly: the tests' check of that path).
    stream(row, tokens_so_far) is called as tokens are accepted. tokenizer: the target's, when the
    caller has it already (the CLI streams with it; a GGUF file's takes seconds to build), so it is
    not built twice. target may also be a model load_model() gave (on its device, in its dtype; not
    tensor parallel): calls that pass the same one (a bench sweep) load it once, and on a GPU replay
    the CUDA graphs they captured on its KV pool."""
    prompts = check_request(prompts, mode, k, temperature, max_new_tokens)
    K = k if mode != "ar" else 0
    ssd = (SSDConfig(K, fan_out, budget, saguaro_c, fallback, pre_spec=pre_spec,
                     fixed_budget=fixed_budget) if mode == "ssd" else None)
    two_processes = mode == "ssd" and parallel
    where = place(target, mode, two_processes, target_device, draft_device, target_devices, dtype,
                  target_threads, draft_threads, torchrun)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(where.target_threads)
    started = Started()
    try:
        with LOADING:
            tmodel, tok = load_target(target, where, started, tp_timeout, tokenizer, graphs)
        ids = [encode(tok, p, chat) for p in prompts]
        check_prompts(ids, tmodel.config, max_new_tokens, K)
        if mode != "ar":
            with LOADING:  # the draft's tokenizer
                check_pair(target, draft, tmodel.config, tok)
        kv_tokens, draft_kv = kv_sizes(ids, max_new_tokens, K, block_size, kv_tokens, ssd)
        settings = (temperature, seed, kv_tokens, block_size)
        # the CPU's product forms for the verifier's rows (b' <= b sequences x K + 1 tokens),
        # chosen before the decode clock starts (cpu_linear.py)
        use_forms(tmodel, [b * (K + 1) for b in range(1, len(ids) + 1)])
        verifier = (TPVerifier(tmodel, settings, started.workers) if started.workers
                    else Verifier(tmodel, *settings, reuse_cache=tmodel is target))
        dcfg = DraftConfig(draft, where.draft_device, where.draft_dtype, K, temperature, seed + 1,
                           draft_kv, block_size, ssd, graphs, tmodel.config.vocab_size)
        eos = [] if ignore_eos else eos_ids(tmodel.config, tok)
        out = Output(eos, K)
        requests = [Request(p, max_new_tokens, on_tokens=row_stream(stream, r))
                    for r, p in enumerate(ids)]
        stats = run_decode(mode, verifier, dcfg, requests, out, where, two_processes, started,
                           kv_tokens)
        stats.update({"k": K, "temperature": temperature, "target_threads": where.target_threads,
                      "draft_threads": where.draft_threads})
        return GenerateResult(out.tokens, detokenize(tok, out.tokens), stats)
    finally:
        torch.set_num_threads(old_threads)
        started.stop()


def check_request(prompts, mode, k, temperature, max_new_tokens) -> list:
    """The request's plain values, checked before anything loads; one prompt becomes a list of
    one."""
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
    return prompts


def check_loaded(model: Transformer, target_device, target_devices, torchrun) -> str:
    """The device of a target the caller loaded, which it runs on as it is."""
    if target_devices or torchrun or model.tp is not None:
        raise ValueError("a loaded target runs on its one device: for a tensor-parallel target "
                         "pass its name (with target_devices, or under torchrun)")
    if target_device is not None and check_device(target_device) != model.device:
        raise ValueError(f"the loaded target is on {model.device}, not {target_device}: load it "
                         f"there, or leave target_device out")
    return str(model.device)


def place(target, mode, two_processes, target_device, draft_device, target_devices, dtype,
          target_threads, draft_threads, torchrun=False) -> Placement:
    """Where each model runs. Every device is checked before anything loads or any process starts
    (a GPU missing here is one line naming it, not a traceback from the speculator's process), and
    "cuda" becomes the GPU it means, so that every process agrees."""
    if isinstance(target, Transformer):
        target_device = check_loaded(target, target_device, target_devices, torchrun)
    env = torchrun_rank0(target_devices) if torchrun else None
    if env:  # this node's ranks, rank 0 first: cuda:0..G-1 (the draft on the next GPU), or CPUs
        target_devices = [torchrun_device(target_device, r) for r in range(env.local_world)]
    dev_t, dev_d = default_devices(len(target_devices) if target_devices else 1)
    if target_devices:
        target_devices = [str(check_device(d)) for d in target_devices]
    target_device = (target_devices[0] if target_devices
                     else str(check_device(target_device or dev_t)))
    draft_device = str(check_device(draft_device or dev_d)) if mode != "ar" else dev_d
    target_dtype, draft_dtype = (resolve_dtype(dtype, target_device),
                                 resolve_dtype(dtype, draft_device))
    if two_processes and any(same_gpu(d, draft_device) for d in target_devices or [target_device]):
        warnings.warn(f"ssd: the draft shares {draft_device} with the target, so the verifier and "
                      f"speculator processes will time-slice one GPU with no overlap; give the "
                      f"draft its own GPU (--draft-device) or use --mode sd", stacklevel=3)
    cores = os.cpu_count() or 1
    target_threads, draft_threads = threads_of(two_processes, target_threads, draft_threads, cores)
    return Placement(target_device, draft_device, target_devices, target_dtype, draft_dtype,
                     target_threads, draft_threads, cores, env)


def threads_of(two_processes, target_threads, draft_threads, cores) -> tuple[int, int | None]:
    """CPU threads: (the target's, the speculator's); the two processes of parallel ssd split the
    cores (when on the CPU)."""
    if two_processes:
        ts, td = split_cores(cores)
        return target_threads or ts, draft_threads or td
    return target_threads or cores, None


def torchrun_rank0(target_devices) -> TorchrunEnv:
    """generate(torchrun=True): this process must be rank 0 of a torchrun world, whose ranks
    torchrun places (a process per rank, each on cuda:LOCAL_RANK or the CPU)."""
    env = torchrun_env()
    if env is None:
        raise ValueError("torchrun=True outside a torchrun world of two or more ranks: start the "
                         "script with torchrun (python -m torch.distributed.run), or drop torchrun")
    if env.rank != 0:
        raise ValueError(f"torchrun=True on rank {env.rank}: only rank 0 generates, the other "
                         f"ranks call tp.serve_torchrun_rank")
    refuse_target_devices(target_devices)
    return env


def refuse_target_devices(target_devices):
    if target_devices:  # every rank refuses them: torchrun's ranks place themselves
        raise ValueError("target devices under torchrun: torchrun places the ranks (cuda:LOCAL_RANK"
                         ", or the CPU); drop --target-devices")


def load_target(target, where: Placement, started: Started, tp_timeout, tokenizer, graphs):
    """-> (model, tokenizer): this process's target, or its rank-0 slices while the other ranks
    (spawned here, or torchrun's) load theirs. The caller's tokenizer, when given, is not built
    again."""
    if isinstance(target, Transformer):  # loaded by the caller
        target.use_graphs(graphs)
        return target, tokenizer
    tp = None
    if where.torchrun:  # torchrun started ranks 1..
        started.workers = TorchrunWorld(where.torchrun, target, where.target_device, tp_timeout)
        tp = started.workers.tp
    elif where.target_devices and len(where.target_devices) > 1:  # spawn ranks 1..
        started.workers = TPWorkers(target, list(where.target_devices), where.target_threads,
                                    tp_timeout, where.target_dtype)
        tp = started.workers.rank0
    tmodel, tok = load_model(target, device=where.target_device, dtype=where.target_dtype, tp=tp,
                             tokenizer=tokenizer is None)
    tmodel.use_graphs(graphs)
    return tmodel, tokenizer or tok


def row_stream(stream, row):
    """generate()'s stream(row, tokens) as one request's on_tokens."""
    return None if stream is None else lambda tokens: stream(row, tokens)


def run_decode(mode, verifier, dcfg: DraftConfig, requests, out: Output, where: Placement,
               two_processes, started: Started, kv_tokens: int) -> dict:
    """The mode's rounds (decode.py) with the draft they need, run by the scheduler as a static
    batch (every request submitted at once, so all join the first round); -> the run's stats."""
    rounds = make_rounds(mode, verifier, dcfg, out, where, two_processes, started, len(requests))
    sched = Scheduler(rounds, kv_budget(kv_tokens, dcfg, mode), max_batch=len(requests))
    for req in requests:
        sched.submit(req)
    prefill_s, decode_s = sched.run()
    stats = {}
    if mode == "ssd":
        spin = started.speculator.ch.spin if two_processes else 0.0
        stats = {**started.speculator.stats(), "verifier_wait_seconds": rounds.wait,
                 "fallback": dcfg.ssd.fallback, "parallel": two_processes, "spin_seconds": spin}
    return {**out.stats(mode, prefill_s, decode_s), **stats}


def make_rounds(mode, verifier, dcfg: DraftConfig, out: Output, where: Placement, two_processes,
                started: Started, max_batch: int):
    """decode.SDRounds (ar: NoDraft; sd: a Drafter) or SSDRounds (a Speculator here, or in its own
    process when two_processes: its channel holds max_batch rows)."""
    if mode == "ar":
        return SDRounds(verifier, NoDraft(), out)
    if mode == "sd":
        return SDRounds(verifier, load_draft(dcfg), out)
    spin = (spin_seconds(where.cores, len(where.target_devices or [where.target_device]),
                         where.target_threads, where.draft_threads, where.target_device,
                         where.draft_device) if two_processes else 0.0)
    started.speculator = (
        SpeculatorProcess(dcfg, max_batch, verifier.model.config.vocab_size, where.draft_threads,
                          pin=any_cuda(where.target_device, where.draft_device), spin=spin)
        if two_processes else load_draft(dcfg))
    return SSDRounds(verifier, started.speculator, out)


def kv_budget(kv_tokens: int, dcfg: DraftConfig, mode) -> KVBudget:
    """What the scheduler may reserve on the target's cache (kv_tokens) and the draft's (kv_sizes
    sized both; a row's share of SSD's branches is the one kv_sizes adds)."""
    bs = dcfg.block_size
    draft = None if mode == "ar" else cache_tokens(dcfg.kv_tokens, bs)
    branches = 0 if dcfg.ssd is None else dcfg.ssd.budget * (dcfg.K + 3 + 2 * bs)
    return KVBudget(cache_tokens(kv_tokens, bs), draft, bs, dcfg.K, branches)


@dataclass
class Engine:
    """A server's engine (serve.py): the scheduler over the mode's rounds, loaded once, and what
    the server needs to speak for it. Its rounds run in the thread that calls scheduler.serve."""
    scheduler: Scheduler
    tokenizer: object
    config: object      # the target's ModelConfig
    mode: str
    K: int
    temperature: float
    started: Started    # stop() it when the server ends


def load_engine(a: argparse.Namespace, max_batch: int) -> Engine:
    """Load the models of run.py's flags (a.kv_tokens: the target's cache, shared by every
    running request; default SERVE_KV_TOKENS) for up to max_batch rows per round."""
    kw = generate_kwargs(a)
    mode, temperature = kw["mode"], kw["temperature"]
    check_request([[1]], mode, kw["k"], temperature, kw["max_new_tokens"])
    K, block_size = (kw["k"] if mode != "ar" else 0), 16
    ssd = (SSDConfig(K, kw["fan_out"], kw["budget"], kw["saguaro_c"], kw["fallback"],
                     pre_spec=kw["pre_spec"]) if mode == "ssd" else None)
    two_processes = mode == "ssd" and kw["parallel"]
    where = place(kw["target"], mode, two_processes, kw["target_device"], kw["draft_device"],
                  kw["target_devices"], kw["dtype"], kw["target_threads"], kw["draft_threads"])
    torch.set_num_threads(where.target_threads)
    started = Started()
    try:
        tmodel, tok = load_target(kw["target"], where, started, kw["tp_timeout"], None,
                                  kw["graphs"])
        if mode != "ar":
            check_pair(kw["target"], kw["draft"], tmodel.config, tok)
        kv_tokens = kw["kv_tokens"] or SERVE_KV_TOKENS
        draft_kv = kv_tokens + (max_batch * ssd.budget * (K + 3 + 2 * block_size) if ssd else 0)
        settings = (temperature, kw["seed"], kv_tokens, block_size)
        verifier = (TPVerifier(tmodel, settings, started.workers) if started.workers
                    else Verifier(tmodel, *settings))
        dcfg = DraftConfig(kw["draft"], where.draft_device, where.draft_dtype, K, temperature,
                           kw["seed"] + 1, draft_kv, block_size, ssd, kw["graphs"])
        out = Output([] if kw["ignore_eos"] else eos_ids(tmodel.config, tok), K)
        rounds = make_rounds(mode, verifier, dcfg, out, where, two_processes, started, max_batch)
        sched = Scheduler(rounds, kv_budget(kv_tokens, dcfg, mode), max_batch, forget=True)
    except BaseException:
        started.stop()
        raise
    return Engine(sched, tok, tmodel.config, mode, K, temperature, started)


SERVE_KV_TOKENS = 16384  # a server's target KV cache by default, in tokens


def eos_ids(cfg, tok) -> list[int]:
    """The target's end-of-sequence ids: its config's, and its tokenizer's."""
    return sorted(set(cfg.eos_token_ids)
                  | ({tok.eos_token_id} if tok and tok.eos_token_id is not None else set()))


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
            raise ValueError(f"prompt token id {bad[0]} outside the vocabulary of size "
                             f"{cfg.vocab_size}")


def check_pair(target, draft, cfg, tok):
    """The draft must speak the target's tokens: where both come with a tokenizer, the same token
    behind every id (a draft of another family with a vocabulary of the same size would be
    accepted less, silently), and the same vocabulary size unless the tokenizers agree (embeddings
    padded to other sizes: the draft's law is then read over the target's vocabulary,
    config.ModelConfig.padded_rows)."""
    V_draft = load_config(draft).vocab_size
    same = not isinstance(target, Transformer) and resolve(draft) == resolve(target)
    draft_tok = None if tok is None or same else load_tokenizer(draft)
    if V_draft != cfg.vocab_size and draft_tok is None:
        raise ValueError(f"draft vocabulary ({V_draft}) differs from the target's "
                         f"({cfg.vocab_size}) and no pair of tokenizers says they share tokens: "
                         f"pick a draft from the same model family")
    if draft_tok is None:
        return  # a bare checkpoint (ids in, ids out): nothing more to compare
    ids = range(max(cfg.vocab_size, V_draft))
    for i, a, b in zip(ids, tok.convert_ids_to_tokens(ids), draft_tok.convert_ids_to_tokens(ids)):
        if a != b:
            raise ValueError(f"the draft's tokenizer differs from the target's (token {i} is "
                             f"{b!r} for the draft, {a!r} for the target): pick a draft made "
                             f"with the target's tokenizer (scripts/distill_draft.py makes one)")


def kv_sizes(ids, max_new_tokens, K, block_size, kv_tokens=None, ssd: SSDConfig | None = None):
    """KV cache sizes in tokens: (target's, draft's). A row holds its prompt, its output and, during
    a round, K + 1 more tokens, in whole blocks, and the cache keeps one block for the padding rows
    of static-shape steps (PagedKVCache.pad_block); the user's kv_tokens must cover that."""
    need = sum(-(-(len(p) + max_new_tokens + K + 1) // block_size) * block_size for p in ids)
    need += block_size
    if kv_tokens is not None and kv_tokens < need:
        raise ValueError(f"kv_tokens={kv_tokens} cannot hold {len(ids)} prompt(s) + max_new_tokens="
                         f"{max_new_tokens}: give at least {need} (--kv-tokens {need}) or leave it "
                         f"unset to size it automatically")
    # default: per row the longest prompt + output, K + 1 in flight plus the draft's K + 1 pending
    # and drafted tokens (2K + 4 covers both sides), two blocks of rounding, and the pad block
    b, longest = len(ids), max(len(p) for p in ids)
    per_row = longest + max_new_tokens + 2 * K + 4 + 2 * block_size
    kv_tokens = kv_tokens or b * per_row + block_size
    if ssd is None:
        return kv_tokens, kv_tokens
    # SSD's draft adds B branches per row: up to K + 1 private tokens (t, x'_1..x'_K once a hit
    # feeds x'_K) and two to spare, plus a copied partial block at the fork and one of rounding
    return kv_tokens, kv_tokens + b * ssd.budget * (K + 3 + 2 * block_size)


def default_devices(target_gpus=1):
    """The target on cuda:0 (..cuda:{target_gpus-1} when tensor parallel), the draft on the next
    GPU; with too few GPUs the draft shares cuda:0; without GPUs both on the CPU."""
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return "cuda:0", f"cuda:{target_gpus}" if n > target_gpus else "cuda:0"
    return "cpu", "cpu"


def same_gpu(a, b) -> bool:
    """Whether two device names are one CUDA device ("cuda" is cuda:0 in a fresh process)."""
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type == "cuda" and (a.index or 0) == (b.index or 0)


def any_cuda(*devices) -> bool:
    return any(torch.device(d).type == "cuda" for d in devices)


SPIN_S = 0.25  # ssd: seconds a side polls for the other before it sleeps (channel.wait_for)


def spin_seconds(cores, ranks, target_threads, draft_threads, target_device, draft_device) -> float:
    """SPIN_S when the verifier (all its ranks) and the speculator have CPU cores of their own, else
    0: a side that polls would take the core the other one computes on. A process on a GPU needs
    one core for its own thread."""
    def cores_of(device, threads):
        return threads if torch.device(device).type == "cpu" else 1
    used = ranks * cores_of(target_device, target_threads) + cores_of(draft_device, draft_threads)
    return SPIN_S if used <= cores else 0.0


def split_cores(cores: int) -> tuple[int, int]:
    """ssd on the CPU: (target threads, draft threads), the verifier taking the larger half."""
    return max(1, cores - cores // 2), max(1, cores // 2)


def encode(tokenizer, prompt, chat):
    if not isinstance(prompt, str):
        return list(prompt)
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer: pass prompts as lists of token ids")
    if chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise ValueError(f"prompt {prompt!r} tokenizes to no tokens: give a prompt with text")
    if tokenizer.bos_token_id is not None and (not ids or ids[0] != tokenizer.bos_token_id):
        ids = [tokenizer.bos_token_id] + ids
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
    add_algorithm_options(ap.add_argument_group("models and algorithm"))
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


def add_algorithm_options(g):
    g.add_argument("--target", default="tiny", metavar="MODEL",
                   help="target model: an HF directory, an HF hub id in the local cache, or an "
                        "alias (llama-70b, llama-8b, llama-1b, qwen-8b, tiny, ...; see README) "
                        "(default: %(default)s)")
    g.add_argument("--draft", default="tiny-draft", metavar="MODEL",
                   help="draft model (sd, ssd), same forms as --target; must share the target's "
                        "vocabulary (default: %(default)s)")
    g.add_argument("--mode", default="ssd", choices=["ar", "sd", "ssd"],
                   help="ar: target alone; sd: speculative decoding; ssd: speculative speculative "
                        "decoding (default: %(default)s)")
    g.add_argument("--k", type=int, default=4, metavar="K",
                   help="K: draft tokens proposed per round (sd, ssd) (default: %(default)s)")
    g.add_argument("--fan-out", default="geometric", metavar="F",
                   help="ssd: how the B guesses per sequence spread over the K+1 depths: "
                        f"{FAN_OUT_HELP} (default: %(default)s)")
    g.add_argument("--budget", type=int, default=8, metavar="B",
                   help="ssd: B, outcome guesses (branches) pre-speculated per sequence per round; "
                        "the ceiling of a budget that adapts to the measured time (default: "
                        "%(default)s)")
    g.add_argument("--fixed-budget", action="store_true",
                   help="ssd: keep B at --budget every round instead of adapting it to the "
                        "measured time (experiments: rules compared at equal B)")
    g.add_argument("--saguaro-c", type=float, default=1.0, metavar="C",
                   help="ssd at T > 0: Saguaro sampling's C in [0, 1]; the draft's law is scaled "
                        "by C on the cached guesses, so the target's rejections land on them more "
                        "often (1 = the plain law) (default: %(default)s)")
    g.add_argument("--fallback", default="auto", choices=POLICIES,
                   help="ssd: who proposes after a cache miss: the draft (neural), a cheap n-gram "
                        "or random speculator, or auto (the draft while the batch is below the "
                        "critical batch size b*, estimated from this run's timings, n-gram from b* "
                        "on) (default: %(default)s)")
    g.add_argument("--pre-spec", default="always", choices=PRE_SPEC,
                   help="ssd: always pre-speculate, as the paper does, auto: only while that "
                        "measures faster than letting the verifier work alone (on a CPU the "
                        "draft's work slows the verifier down), or never: SD's schedule with the "
                        "draft in its own process, the control (default: %(default)s)")
    g.add_argument("--no-parallel", action="store_true",
                   help="ssd: run the verifier and the speculator interleaved in one process "
                        "(same tokens, slower)")


def add_device_options(g):
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
                   help="CPU threads of the target (default: all cores; in parallel ssd the "
                        "larger half)")
    g.add_argument("--draft-threads", type=int, default=None, metavar="N",
                   help="CPU threads of the speculator process in parallel ssd (default: the "
                        "smaller half)")
    g.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="weights and activations of both models (the logits are float32 in every "
                        "dtype): auto is bfloat16 on CUDA and float32 on the CPU; bfloat16 runs on "
                        "the CPU too, slowly, to check a GPU's numerics there "
                        "(default: %(default)s)")
    g.add_argument("--no-graphs", action="store_true",
                   help="on CUDA, run decode steps and verifications eagerly instead of replaying "
                        "them as CUDA graphs (the CPU never uses graphs)")
    g.add_argument("--kv-tokens", type=int, default=None, metavar="TOKENS",
                   help="target KV cache size in tokens (default: sized for the prompt and "
                        "--max-new-tokens); the draft's cache gets the same plus room for ssd's "
                        "branches")


def add_output_options(g):
    g.add_argument("--json", action="store_true",
                   help="print one JSON line with the tokens, text and stats instead")


def generate_kwargs(a: argparse.Namespace) -> dict:
    """generate()'s arguments from the command line's (the prompt, stream and tokenizer aside)."""
    fan = parse_fan_out(a.fan_out)
    return dict(target=a.target, draft=a.draft, mode=a.mode, max_new_tokens=a.max_new_tokens,
                temperature=a.temperature, k=a.k, seed=a.seed, ignore_eos=a.ignore_eos,
                fan_out=fan, budget=a.budget, saguaro_c=a.saguaro_c, fallback=a.fallback,
                parallel=not a.no_parallel, pre_spec=a.pre_spec, fixed_budget=a.fixed_budget,
                target_device=a.target_device or a.device,
                draft_device=a.draft_device or a.device, target_threads=a.target_threads,
                draft_threads=a.draft_threads, kv_tokens=a.kv_tokens,
                tp_timeout=a.tp_timeout, dtype=a.dtype, graphs=False if a.no_graphs else None,
                target_devices=a.target_devices.split(",") if a.target_devices else None)


def text_printer(tokenizer):
    """A generate() stream that prints the first prompt's decoded text as it is accepted (nothing
    without a tokenizer)."""
    printed = 0

    def stream(row, tokens):
        nonlocal printed
        if row != 0 or tokenizer is None:
            return
        text = tokenizer.decode(tokens, skip_special_tokens=True)
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
            ("tokens/round", f"{s['mean_tokens_per_round']:.2f}"),
            ("acceptance", f"{s['acceptance_rate']:.2f}")]
    if s["mode"] == "ssd":
        rows += [("cache hit rate", f"{s['cache_hit_rate']:.2f}"),
                 ("fallback", f"{s['fallback']} (b*={s['b_star']})"),
                 ("mean budget B", f"{s['mean_budget']:.1f}"),
                 ("pre-spec stopped", f"{s['pre_speculation_stopped']} rounds"),
                 ("pre-spec skipped", f"{s['pre_speculation_skipped']} rounds"),
                 ("verifier wait",
                  f"{s['verifier_wait_seconds'] / max(s['decode_seconds'], 1e-9):.0%}")]
    for k_, v in rows:
        print(f"{k_:>16}  {v}")


def serve_rank(a: argparse.Namespace, env: TorchrunEnv):
    """Ranks 1.. of a torchrun world: this rank's slices of the target serve rank 0's verifier
    calls until it ends the run (every rank has the same flags: target, dtype, threads, timeout)."""
    refuse_target_devices(a.target_devices)
    device = str(check_device(torchrun_device(a.target_device or a.device, env.local_rank)))
    threads, _ = threads_of(a.mode == "ssd" and not a.no_parallel, a.target_threads,
                            a.draft_threads, os.cpu_count() or 1)
    serve_torchrun_rank(env, a.target, device, resolve_dtype(a.dtype, device), threads,
                        a.tp_timeout)


def main(argv=None):
    a = parser().parse_args(argv)
    tokenizer = None
    try:
        env = torchrun_env()
        if env and env.rank > 0:  # run.py under torchrun, rank 1..: serve rank 0
            serve_rank(a, env)
            return 0
        if env:
            print(f"run.py: rank 0 of a torchrun world of {env.world} ranks on {env.nodes} "
                  f"node(s): the target runs tensor parallel across all of them", file=sys.stderr)
        if not a.json:
            tokenizer = load_tokenizer(a.target)  # generate() uses it too: built once
            # a chat answer starts on its own line; a plain prompt is continued where it ends
            sys.stdout.write(a.prompt + ("\n\n" if a.chat else ""))
        res = generate([a.prompt], **generate_kwargs(a), chat=a.chat,
                       stream=text_printer(tokenizer),
                       tokenizer=tokenizer, torchrun=env is not None)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps({"tokens": res.tokens[0], "text": res.text[0] if res.text else None,
                          "stats": res.stats}))
        return 0
    print_stats(res.stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
