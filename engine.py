"""The engine's wiring: where the models run, loading them, the scheduler over the mode's rounds.

run.generate() (a static batch) and serve.py (requests as they come) build their engine here, in
the same two steps: `load_target` places the models (devices, dtypes, CPU threads,
tensor-parallel ranks) and loads the target; `build_engine` checks the pair and wires the verifier,
the draft side (here, or the speculator's process: channel.py) and decode.py's rounds under a
scheduler.py Scheduler. Between the two the caller sizes the KV caches: generate() for its prompts
(kv_sizes), a server for its flags (load_engine). What an engine is (EngineConfig) is
generate()'s parameters less the request's, so a setting cannot reach one caller and not the other.
"""
import functools
import numbers
import os
import threading
import warnings
from dataclasses import dataclass

import torch

from channel import SpeculatorProcess
from checkpoint import load_model, load_tokenizer
from cpu_linear import ROWS, use_forms
from quantize import check_quant, products, warm_up
from decode import NoDraft, Output, SDRounds, SSDRounds
from devices import check_device, resolve_dtype
from draft import DraftConfig, DraftSettings, draft_kind, load_draft
from model import Transformer
from scheduler import KVBudget, Scheduler, cache_tokens
from tp import TorchrunEnv, TorchrunWorld, TPVerifier, TPWorkers, torchrun_device, torchrun_env
from verify import Verifier

# Models and tokenizers load under this lock: transformers resolves its names on first use (a
# lazy module), which is not thread-safe: 8 threads calling generate() first thing in a process
# failed in 7 with "cannot import name 'AutoTokenizer' from 'transformers'". Loading is
# serialised; decoding is not.
LOADING = threading.Lock()

SERVE_KV_TOKENS = 16384  # a server's target KV cache by default, in tokens


@dataclass
class EngineConfig:
    """What an engine is: generate()'s parameters (its docstring says what each does) less the
    request's (prompts, max_new_tokens, chat, stream, tokenizer); serve.py has them from its flags
    (run.generate_kwargs). Checked here, before anything loads."""
    target: object          # a name, or a model load_model() gave
    draft: str
    mode: str               # "ar", "sd" or "ssd"
    temperature: float
    spec: DraftSettings     # how the draft proposes (K, the confidence stop, SSD's knobs)
    seed: int
    ignore_eos: bool
    parallel: bool
    target_device: str | None
    draft_device: str | None
    target_threads: int | None
    draft_threads: int | None
    kv_tokens: int | None   # the user's; None: sized by the caller
    target_devices: list[str] | None
    tp_timeout: float
    dtype: str
    graphs: bool | None
    block_size: int = 16
    torchrun: bool = False
    compile: bool | None = None  # torch.compile the graphs' layers (Transformer.use_graphs)
    quant: str = "auto"        # the target's weights (checkpoint.load_model, quantize.py)
    draft_quant: str = "auto"  # the draft's
    # both caches share prompts' full blocks (kv_cache.py); None: on, but for a draft that reads
    # the target's features (an EAGLE head), which needs them at every prompt token
    prefix_caching: bool | None = None
    # CPU cores left to other work on this machine: serve.py leaves one to its HTTP side (the
    # event loop, and clients here): a target computing on every core stalls whenever they run
    reserve_cores: int = 0

    def __post_init__(self):
        if self.mode not in ("ar", "sd", "ssd"):
            raise ValueError(f"unknown mode {self.mode!r}: use 'ar', 'sd' or 'ssd'")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        check_quant(self.quant)
        check_quant(self.draft_quant, "draft_quant")
        if not (isinstance(self.seed, numbers.Integral) and not isinstance(self.seed, bool)
                and -2**63 <= self.seed < 2**64):  # what a torch.Generator takes
            raise ValueError(f"seed={self.seed!r}: use an integer in [-2**63, 2**64) (--seed)")
        if self.reserve_cores < 0:
            raise ValueError(f"reserve_cores={self.reserve_cores} must be >= 0")
        reads_target = self.mode != "ar" and draft_kind(self.draft).feature_layers is not None
        if self.prefix_caching and reads_target:
            raise ValueError("prefix caching with an EAGLE draft is not implemented (the head "
                             "needs the target's features at every prompt token): leave it off "
                             "(--no-prefix-caching, prefix_caching=False)")
        if self.prefix_caching is None:
            self.prefix_caching = not reads_target

    @property
    def K(self) -> int:
        """The most draft tokens per round: 0 for ar."""
        return self.spec.K if self.mode != "ar" else 0

    @property
    def branch_budget(self) -> int:
        """The most SSD branches per row and round (the budget B's ceiling): 0 without SSD."""
        return self.spec.budget if self.mode == "ssd" else 0

    @property
    def two_processes(self) -> bool:
        """ssd with the speculator in its own process (channel.py)."""
        return self.mode == "ssd" and self.parallel


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
    """The processes one engine started: every path out of it (done, error, Ctrl-C) stops them
    (docs/design.md section 9)."""
    workers: TPWorkers | TorchrunWorld | None = None  # ranks 1.. of a tensor-parallel target
    speculator: object = None         # a SpeculatorProcess, or the Speculator in this process
    respawn: object = None            # two processes: starts a new SpeculatorProcess like this one

    def stop(self):
        try:
            if isinstance(self.speculator, SpeculatorProcess):
                self.speculator.close()
        finally:
            if self.workers:
                self.workers.close()  # raises a worker's error, naming its rank


@dataclass
class Loaded:
    """The target, loaded where place() put it, and the processes started for it."""
    model: Transformer
    tokenizer: object   # the target's (None: a bare checkpoint, token ids in and out)
    where: Placement
    started: Started


@dataclass
class Engine:
    """The scheduler over the mode's rounds, and what its callers need to speak for it: generate()
    runs it as a static batch, serve.py as requests come. Its rounds run in the thread that calls
    scheduler.run or scheduler.serve."""
    scheduler: Scheduler
    tokenizer: object
    config: object      # the target's ModelConfig
    settings: EngineConfig
    where: Placement
    started: Started    # stop() it when done
    products: dict      # which product the target's quantized layers run (quantize.products)

    @property
    def mode(self) -> str:
        return self.settings.mode

    @property
    def K(self) -> int:
        return self.settings.K

    @property
    def temperature(self) -> float:
        return self.settings.temperature

    def restart_speculator(self) -> str:
        """After the speculator's process died (a server's engine: the requests in flight have
        ended with the error): stop what is left of it, start a new one with the same settings
        and go on in SSD from an empty batch; the target keeps its model and frees the rows it
        held. Returns what the old process said, if anything. Only SSD in two processes has a
        process to restart: anything else raises, as a bug in this process would."""
        if self.started.respawn is None:
            raise RuntimeError(f"{self.mode} in one process has no speculator process to restart")
        said = ""
        try:
            self.started.speculator.close()
        except RuntimeError as e:  # its own error, if it had time to send one
            said = str(e)
        self.started.speculator = self.started.respawn()
        self.scheduler.rounds.restart(self.started.speculator)
        return said

    def stats(self, prefill_s: float, decode_s: float) -> dict:
        """A run's speed and acceptance (decode.Output.stats), the speculator's, and the settings
        they were measured at."""
        c, spec = self.settings, self.started.speculator
        s = self.scheduler.out.stats(c.mode, prefill_s, decode_s)
        if c.mode == "ssd":
            s.update({**spec.stats(), "verifier_wait_seconds": self.scheduler.rounds.wait,
                      "fallback": c.spec.fallback, "parallel": c.two_processes,
                      "spin_seconds": spec.ch.spin if c.two_processes else 0.0})
        s.update({"k": c.K, "confidence": c.spec.confidence, "temperature": c.temperature,
                  "target_threads": self.where.target_threads,
                  "draft_threads": self.where.draft_threads, "target_products": self.products})
        return s


# --------------------------------------------------------------------------------------------------
# Step 1: place the models and load the target

def load_target(cfg: EngineConfig, started: Started, tokenizer=None) -> Loaded:
    """Place the models (place), give this process the target's CPU threads, and load the target:
    this process's, or its rank-0 slices while the other ranks (spawned here, or torchrun's) load
    theirs. The caller's tokenizer, when given, is not built again. The caller stops `started` on
    every path out."""
    where = place(cfg)
    torch.set_num_threads(where.target_threads)
    if isinstance(cfg.target, Transformer):  # loaded by the caller
        cfg.target.use_graphs(cfg.graphs, cfg.compile)
        return Loaded(cfg.target, tokenizer, where, started)
    with LOADING:
        tp = None
        if where.torchrun or len(where.target_devices or []) > 1:
            # the tokenizer before the process group exists: through transformers it imports
            # torch modules (FSDP's) that bind the group as a default argument when first imported
            # while it exists; destroy_process_group could not free it then, its gloo threads
            # would live into the interpreter's exit, and one releasing a tensor there aborts
            tokenizer = tokenizer or load_tokenizer(cfg.target)
        if where.torchrun:  # torchrun started ranks 1..
            started.workers = TorchrunWorld(where.torchrun, cfg.target, where.target_device,
                                            cfg.tp_timeout)
            tp = started.workers.tp
        elif where.target_devices and len(where.target_devices) > 1:  # spawn ranks 1..
            started.workers = TPWorkers(cfg.target, list(where.target_devices),
                                        where.target_threads, cfg.tp_timeout, where.target_dtype)
            tp = started.workers.rank0
        model, tok = load_model(cfg.target, device=where.target_device, dtype=where.target_dtype,
                                tp=tp, tokenizer=tokenizer is None, quant=cfg.quant)
    model.use_graphs(cfg.graphs, cfg.compile)
    return Loaded(model, tokenizer or tok, where, started)


def place(cfg: EngineConfig) -> Placement:
    """Where each model runs. Every device is checked before anything loads or any process starts
    (a GPU missing here is one line naming it, not a traceback from the speculator's process), and
    "cuda" becomes the GPU it means, so that every process agrees."""
    target_device, target_devices = cfg.target_device, cfg.target_devices
    if isinstance(cfg.target, Transformer):
        target_device = check_loaded(cfg.target, target_device, target_devices, cfg.torchrun)
    env = torchrun_rank0(target_devices) if cfg.torchrun else None
    if env:  # this node's ranks, rank 0 first: cuda:0..G-1 (the draft on the next GPU), or CPUs
        target_devices = [torchrun_device(target_device, r) for r in range(env.local_world)]
    if (env or len(target_devices or []) > 1) and cfg.mode != "ar" \
            and draft_kind(cfg.draft).feature_layers:
        raise ValueError("a tensor-parallel target with a draft that reads its features (an "
                         "EAGLE head) is not implemented: its embedding is split across the "
                         "ranks; run the target on one device")
    dev_t, dev_d = default_devices(target_devices or ([target_device] if target_device else None))
    if target_devices:
        target_devices = [str(check_device(d)) for d in target_devices]
    target_device = (target_devices[0] if target_devices
                     else str(check_device(target_device or dev_t)))
    draft_device = (str(check_device(cfg.draft_device or dev_d)) if cfg.mode != "ar" else dev_d)
    target_dtype, draft_dtype = (resolve_dtype(cfg.dtype, target_device),
                                 resolve_dtype(cfg.dtype, draft_device))
    if cfg.two_processes and any(same_gpu(d, draft_device)
                                 for d in target_devices or [target_device]):
        warnings.warn(f"ssd: the draft shares {draft_device} with the target, so the verifier and "
                      f"speculator processes will time-slice one GPU with no overlap; give the "
                      f"draft its own GPU (--draft-device) or use --mode sd", stacklevel=4)
    cores = os.cpu_count() or 1
    target_threads, draft_threads = threads_of(cfg.two_processes, cfg.target_threads,
                                               cfg.draft_threads,
                                               max(1, cores - cfg.reserve_cores))
    ranks = sum(torch.device(d).type == "cpu" for d in target_devices or [])  # TP on the CPU
    target_threads = rank_threads(target_threads, ranks, cfg.target_threads)
    if target_threads * max(1, ranks) + (draft_threads or 0) > cores:
        each = f"{ranks} ranks x " if ranks > 1 else ""
        warnings.warn(f"{each}{target_threads} target + {draft_threads or 0} draft threads on "
                      f"{cores} cores: threads past the cores take turns and slow every step; "
                      f"give fewer (--target-threads, --draft-threads)", stacklevel=4)
    return Placement(target_device, draft_device, target_devices, target_dtype, draft_dtype,
                     target_threads, draft_threads, cores, env)


def check_loaded(model: Transformer, target_device, target_devices, torchrun) -> str:
    """The device of a target the caller loaded, which it runs on as it is."""
    if target_devices or torchrun or model.tp is not None:
        raise ValueError("a loaded target runs on its one device: for a tensor-parallel target "
                         "pass its name (with target_devices, or under torchrun)")
    if target_device is not None and check_device(target_device) != model.device:
        raise ValueError(f"the loaded target is on {model.device}, not {target_device}: load it "
                         f"there, or leave target_device out")
    return str(model.device)


def threads_of(two_processes, target_threads, draft_threads, cores) -> tuple[int, int | None]:
    """CPU threads: (the target's, the speculator's); the two processes of parallel ssd split the
    cores (when on the CPU)."""
    if two_processes:
        ts, td = split_cores(cores)
        return target_threads or ts, draft_threads or td
    return target_threads or cores, None


def rank_threads(threads: int, ranks: int, given) -> int:
    """A target split over `ranks` processes on one machine's CPU: each takes its share of the
    target's threads, unless the user gave the number (then it is each rank's)."""
    return threads if given or ranks < 2 else max(1, threads // ranks)


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


# --------------------------------------------------------------------------------------------------
# Step 2: the pair checked, the verifier, the draft side, the rounds and the scheduler

def build_engine(cfg: EngineConfig, loaded: Loaded, kv_tokens: int, draft_kv: int,
                 max_batch: int, forget: bool = False) -> Engine:
    """An engine around a loaded target for up to max_batch rows per round: the target's KV cache
    holds kv_tokens, the draft's draft_kv (kv_sizes); forget: a server's scheduler, which keeps no
    finished row."""
    model, tok, where, started = loaded.model, loaded.tokenizer, loaded.where, loaded.started
    kind = draft_kind(cfg.draft) if cfg.mode != "ar" else None
    if kind is not None:
        with LOADING:  # the draft's tokenizer
            kind.check(cfg.target, model.config, tok)
    # a draft that reads the target's hidden states (an EAGLE head) has every forward give them
    model.want_features(kind.feature_layers if kind is not None else None)
    # the CPU's product forms for the verifier's rows (b <= max_batch sequences x K + 1 tokens, or
    # any width up to it when rows may stop early; those in cpu_linear.ROWS have a choice), chosen
    # before any decode clock starts
    widths = range(1, cfg.K + 2) if cfg.mode != "ar" and cfg.spec.confidence else [cfg.K + 1]
    rows = sorted({b * w for b in range(1, max_batch + 1) for w in widths})
    use_forms(model, [r for r in rows if r in ROWS])
    warm_up(model, [1, *rows])  # quantized layers' compiled products (quantize.py)
    settings = dict(temperature=cfg.temperature, seed=cfg.seed, kv_tokens=kv_tokens,
                    block_size=cfg.block_size, prefix_caching=cfg.prefix_caching)
    # a model the caller loaded keeps one pool for its runs one after another (its graphs stay
    # captured); a server's engine runs beside others, so it owns its pool
    verifier = (TPVerifier(model, settings, started.workers) if started.workers
                else Verifier(model, **settings, reuse_cache=model is cfg.target and not forget))
    dcfg = DraftConfig(cfg.draft, where.draft_device, where.draft_dtype, cfg.spec,
                       cfg.mode == "ssd", cfg.temperature, cfg.seed + 1, draft_kv, cfg.block_size,
                       cfg.graphs, model.config.vocab_size,  # a draft padded to another size
                       cfg.compile, cfg.draft_quant, cfg.prefix_caching,  # reads ours
                       kind.target_parts(model) if kind is not None else None)
    out = Output([] if cfg.ignore_eos else eos_ids(model.config, tok), cfg.K)
    rounds = make_rounds(cfg, verifier, dcfg, out, where, started, max_batch, per_row=forget)
    sched = Scheduler(rounds, kv_budget(kv_tokens, dcfg, cfg), max_batch, forget=forget)
    return Engine(sched, tok, model.config, cfg, where, started, products(model))


def load_engine(cfg: EngineConfig, max_batch: int) -> Engine:
    """A server's engine, loaded once for up to max_batch rows per round: the target's KV cache
    (cfg.kv_tokens, default SERVE_KV_TOKENS) is shared by every running request; the draft's adds
    each row's room for SSD's branches."""
    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch}: a server needs room for at least one row a "
                         f"round (serve.py --max-batch >= 1)")
    kv_tokens = SERVE_KV_TOKENS if cfg.kv_tokens is None else cfg.kv_tokens
    if kv_tokens < cfg.block_size:
        raise ValueError(f"kv_tokens={kv_tokens} holds no KV block of {cfg.block_size} tokens: "
                         f"give --kv-tokens at least the longest prompt + max_tokens")
    started = Started()
    try:
        loaded = load_target(cfg, started)
        draft_kv = kv_tokens + max_batch * branch_tokens(cfg.branch_budget, cfg.K, cfg.block_size)
        return build_engine(cfg, loaded, kv_tokens, draft_kv, max_batch, forget=True)
    except BaseException:
        started.stop()
        raise


def check_pair(target, draft, cfg, tok):
    """The draft must pair with the target: its kind says how (draft.CheckpointDraft.check: the
    same tokens; eagle.EagleDraft.check: the same width and vocabulary). target: its name or
    model; cfg, tok: its config and tokenizer."""
    draft_kind(draft).check(target, cfg, tok)


def eos_ids(cfg, tok) -> list[int]:
    """The target's end-of-sequence ids: its config's, and its tokenizer's."""
    return sorted(set(cfg.eos_token_ids)
                  | ({tok.eos_token_id} if tok and tok.eos_token_id is not None else set()))


def make_rounds(cfg: EngineConfig, verifier, dcfg: DraftConfig, out: Output, where: Placement,
                started: Started, max_batch: int, per_row: bool = False):
    """decode.SDRounds (ar: NoDraft; sd: a Drafter) or SSDRounds (a Speculator here, or in its own
    process when two_processes: its channel holds max_batch rows, and the laws q whenever a row
    may sample: per_row, a server's rows bring their own temperatures)."""
    if cfg.mode == "ar":
        return SDRounds(verifier, NoDraft(), out)
    if cfg.mode == "sd":
        return SDRounds(verifier, load_draft(dcfg), out)
    spin = (spin_seconds(where.cores, len(where.target_devices or [where.target_device]),
                         where.target_threads, where.draft_threads, where.target_device,
                         where.draft_device) if cfg.two_processes else 0.0)
    if cfg.two_processes:
        started.respawn = functools.partial(
            SpeculatorProcess, dcfg, max_batch, verifier.model.config.vocab_size,
            where.draft_threads, pin=any_cuda(where.target_device, where.draft_device), spin=spin,
            per_row=per_row, feature_size=len(verifier.model.feature_layers or [])
            * verifier.model.config.hidden_size)
    started.speculator = started.respawn() if cfg.two_processes else load_draft(dcfg)
    return SSDRounds(verifier, started.speculator, out)


# --------------------------------------------------------------------------------------------------
# KV cache sizes

def kv_sizes(ids, max_new_tokens, K, block_size, kv_tokens=None, branch_budget=0):
    """KV cache sizes in tokens for a static batch of prompts: (target's, draft's). A row holds its
    prompt, its output and, during a round, K + 1 more tokens, in whole blocks, and the cache keeps
    one block for the padding rows of static-shape steps (PagedKVCache.pad_block); the user's
    kv_tokens must cover that."""
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
    return kv_tokens, kv_tokens + b * branch_tokens(branch_budget, K, block_size)


def branch_tokens(branch_budget: int, K, block_size) -> int:
    """The draft's room for one row's SSD branches: up to B of them (branch_budget, 0 without
    SSD), each up to K + 1 private tokens (t, x'_1..x'_K once a hit feeds x'_K) and two to spare,
    plus a copied partial block at the fork and one of rounding."""
    return branch_budget * (K + 3 + 2 * block_size)


def kv_budget(kv_tokens: int, dcfg: DraftConfig, cfg: EngineConfig) -> KVBudget:
    """What the scheduler may reserve on the target's cache (kv_tokens) and the draft's (a row's
    share of SSD's branches included)."""
    bs = dcfg.block_size
    draft = None if cfg.mode == "ar" else cache_tokens(dcfg.kv_tokens, bs)
    return KVBudget(cache_tokens(kv_tokens, bs), draft, bs, cfg.K,
                    branch_tokens(cfg.branch_budget, cfg.K, bs), dcfg.prefix_caching)


# --------------------------------------------------------------------------------------------------
# Devices and cores

def default_devices(target_devices: list[str] | None = None) -> tuple[str, str]:
    """(The target's device, the draft's) where the caller gives none: the target on cuda:0 (or
    on `target_devices`), the draft on the first GPU the target does not use, sharing the target's
    first when none is free; without GPUs both on the CPU."""
    if not torch.cuda.is_available():
        return "cpu", "cpu"
    target = [torch.device(d) for d in target_devices or ["cuda:0"]]
    used = {d.index or 0 for d in target if d.type == "cuda"}
    free = [i for i in range(torch.cuda.device_count()) if i not in used]
    return str(target[0]), f"cuda:{free[0] if free else target[0].index or 0}"


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


def one_line_warnings():
    """The command lines (run.py, serve.py, bench.py) show the engine's warnings as one line each,
    as they show its errors, not with the file and line that warned."""
    warnings.formatwarning = lambda message, *_, **__: f"warning: {message}\n"
