"""Generate text with autoregressive decoding (ar), speculative decoding (sd) or speculative speculative
decoding (ssd); the `generate()` API and the command line.

    python run.py                                   # the tiny pair shipped in checkpoints/, SSD, a code prompt
    python run.py --mode sd --k 4 --temperature 0.7 --prompt "def fib(n):"
    python run.py --target llama-70b --draft llama-1b --chat --prompt "Write a haiku"

In `ssd` mode the verifier (target model) runs in this process and the speculator (draft model) in a
second one started with torch.multiprocessing (spawn), each on its own device, talking through
preallocated shared tensors (pinned when a device is CUDA) and two events per round, never pickling on
the per-round path. `parallel=False` runs the same two sides interleaved in one process and emits the
same tokens for the same seed.
"""
import argparse
import json
import os
import queue
import signal
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from draft import Drafter, Proposals, SSDConfig, Speculator
from model import DTYPES, TP, check_tp, load_config, load_model, load_tokenizer, resolve_dtype
from channel import start_child, wait_for
from verify import Verifier

# Ends where an editor leaves the cursor, at the body's indentation. Prompts that end mid-word or mid-indent meet
# a token boundary the model rarely saw: the tiny pair's tokenizer splits "\n        self" as "\n       " + " self",
# so the first line comes out one space too deep; a bare final "\n" (the token before a column-0 line) is worse:
# the tiny target ends the text at once. (Token healing would fix both; this engine does not do it.)
DEFAULT_PROMPT = "class Stack:\n    def __init__(self):\n        "


@dataclass
class GenerateResult:
    tokens: list[list[int]]  # new token ids per prompt
    text: list[str] | None   # decoded, when the target has a tokenizer
    stats: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------
# Output bookkeeping shared by every mode: EOS and max_new_tokens cut inside a round

class Output:
    def __init__(self, b, max_new_tokens, eos_ids, K, stream=None):
        self.tokens = [[] for _ in range(b)]
        self.done = [False] * b
        self.max_new, self.eos, self.stream = max_new_tokens, set(eos_ids), stream
        self.rounds, self.row_rounds, self.accepted, self.proposed = 0, 0, 0, 0
        self.hist = [0] * (K + 1)
        self.tok_hit = self.rounds_hit = self.tok_miss = self.rounds_miss = 0

    def emit(self, row, new) -> bool:
        """Append new tokens to a row, stopping at EOS (kept) or max_new_tokens. Returns True when done."""
        out = self.tokens[row]
        for x in new:
            out.append(x)
            if x in self.eos or len(out) >= self.max_new:
                self.done[row] = True
                break
        if self.stream:
            self.stream(row, out)
        return self.done[row]

    def round(self, rows, tokens, n, t, hit=None) -> list[int]:
        """Record one verified round; returns the rows that finished in it."""
        self.rounds += 1
        K = tokens.shape[1]
        finished = []
        for i, r in enumerate(rows):
            n_i = int(n[i])
            self.row_rounds += 1
            self.accepted += n_i
            self.proposed += K
            self.hist[n_i] += 1
            if hit is not None:
                if hit[i]:
                    self.tok_hit, self.rounds_hit = self.tok_hit + n_i + 1, self.rounds_hit + 1
                else:
                    self.tok_miss, self.rounds_miss = self.tok_miss + n_i + 1, self.rounds_miss + 1
            if self.emit(r, tokens[i, :n_i].tolist() + [int(t[i])]):
                finished.append(r)
        return finished

    def active(self):
        return [r for r, d in enumerate(self.done) if not d]

    def stats(self, mode, prefill_s, decode_s, b):
        new = sum(len(x) for x in self.tokens)
        return {"mode": mode, "batch": b, "new_tokens": new, "prefill_seconds": prefill_s, "decode_seconds": decode_s,
                # the first token of each row comes from the prefill; decode speed counts the rest
                "decode_tok_s": (new - b) / decode_s if decode_s > 0 else 0.0,
                "rounds": self.rounds,
                "mean_tokens_per_round": (new - b) / self.row_rounds if self.row_rounds else 0.0,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                "accept_len_histogram": self.hist}


# ----------------------------------------------------------------------------------------------------
# The decode loops

def decode_ar_sd(verifier, drafter, prompts, out, K):
    """ar (drafter None) and sd: the draft and the target take turns in this process."""
    t_start = time.perf_counter()
    if drafter:
        drafter.prefill(prompts)
    t0 = verifier.prefill(prompts)
    prefill_s = time.perf_counter() - t_start
    start = time.perf_counter()
    finished = [r for r in range(len(prompts)) if out.emit(r, [int(t0[r])])]
    rows = out.active()
    if drafter:
        drafter.commit(range(len(prompts)), torch.zeros(len(prompts), dtype=torch.long), t0)
        drafter.finish(finished)
    verifier.finish(finished)
    V = verifier.model.config.vocab_size
    while rows:
        if drafter:
            p = drafter.draft(rows)
        else:  # autoregressive: a round with no proposals
            b = len(rows)
            p = Proposals(torch.zeros(b, 0, dtype=torch.long), torch.zeros(b, 0, V), torch.ones(b, dtype=torch.bool),
                          torch.zeros(b, dtype=torch.bool))
        n, t = verifier.verify(rows, p.tokens, p.q, p.deterministic)
        finished = out.round(rows, p.tokens, n, t)
        if drafter:
            drafter.commit(rows, n, t)
            drafter.finish(finished)
        verifier.finish(finished)
        rows = out.active()
    return prefill_s, time.perf_counter() - start


def decode_ssd_serial(verifier, spec, prompts, out):
    """ssd with parallel=False: the same two sides, interleaved in one process."""
    t_start = time.perf_counter()
    b = len(prompts)
    spec.prefill(prompts)
    spec.pre_speculate(list(range(b)))
    t0 = verifier.prefill(prompts)
    prefill_s = time.perf_counter() - t_start
    start = time.perf_counter()
    finished = [r for r in range(b) if out.emit(r, [int(t0[r])])]
    rows, n, t, verify_s, wait = list(range(b)), torch.zeros(b, dtype=torch.long), t0, None, 0.0
    while True:
        verifier.finish(finished)
        spec.finish(finished)
        done = set(finished)
        keep = [i for i, r in enumerate(rows) if r not in done]
        rows, n, t = [rows[i] for i in keep], n[keep], t[keep]
        if not rows:
            break
        w = time.perf_counter()
        p = spec.respond(rows, n, t, verify_s)
        spec.pre_speculate(rows)  # in the parallel run this overlaps the verification below
        wait += time.perf_counter() - w
        v = time.perf_counter()
        n, t = verifier.verify(rows, p.tokens, p.q, p.deterministic)
        verify_s = time.perf_counter() - v
        finished = out.round(rows, p.tokens, n, t, p.hit)
    return prefill_s, time.perf_counter() - start, wait


class Channel:
    """The shared tensors between the verifier and the speculator, allocated once before the spawn."""

    def __init__(self, b, K, V, pin):
        self.n = torch.zeros(b, dtype=torch.long)
        self.t = torch.zeros(b, dtype=torch.long)
        self.active = torch.zeros(b, dtype=torch.bool)
        self.ctl = torch.zeros(3, dtype=torch.float64)  # [round id, stop flag, verify seconds of the round]
        self.tokens = torch.zeros(b, K, dtype=torch.long)
        self.q = torch.zeros(b, K, V)
        self.det = torch.zeros(b, dtype=torch.bool)
        self.hit = torch.zeros(b, dtype=torch.bool)
        for x in self.tensors():
            x.share_memory_()
        ctx = mp.get_context("spawn")
        self.outcome_ready, self.proposals_ready = ctx.Event(), ctx.Event()
        self.loaded = ctx.Event()  # the speculator has its model: start the clocks only then
        self.pin = pin

    def tensors(self):
        return [self.n, self.t, self.active, self.ctl, self.tokens, self.q, self.det, self.hit]

    def pin_here(self):
        """Page-lock the shared buffers in this process so copies to and from the GPU are fast."""
        if self.pin and torch.cuda.is_available():
            cudart = torch.cuda.cudart()
            for x in self.tensors():
                cudart.cudaHostRegister(x.data_ptr(), x.numel() * x.element_size(), 0)


def speculator_main(draft, draft_device, dtype, threads, prompts, K, temperature, seed, kv_tokens, block_size, ssd,
                    ch, errors):
    """The speculator process: load the draft, pre-speculate round 0, then answer each outcome."""
    try:
        if threads:
            torch.set_num_threads(threads)
        ch.pin_here()
        model, _ = load_model(draft, device=draft_device, dtype=dtype, tokenizer=False)
        spec = Speculator(model, K, temperature, seed + 1, kv_tokens, ssd, block_size)
        b = len(prompts)
        ch.loaded.set()
        spec.prefill(prompts)
        spec.pre_speculate(list(range(b)))
        parent = mp.parent_process()
        rows = list(range(b))
        while True:
            wait_for(ch.outcome_ready, parent.is_alive, "verifier")
            if ch.ctl[1] > 0:  # stop
                break
            active = ch.active.nonzero().flatten().tolist()
            spec.finish(sorted(set(rows) - set(active)))
            rows = active
            if not rows:
                break
            p = spec.respond(rows, ch.n[rows], ch.t[rows], float(ch.ctl[2]) or None)
            ch.tokens[rows] = p.tokens.cpu()
            if temperature > 0:
                ch.q[rows] = p.q.cpu()
            ch.det[rows], ch.hit[rows] = p.deterministic.cpu(), p.hit.cpu()
            ch.proposals_ready.set()
            spec.pre_speculate(rows)
        errors.put(("stats", spec.stats()))
        errors.close()
        errors.join_thread()
        os._exit(0)  # done: skip the interpreter's slow teardown of torch, which the verifier would wait for
    except KeyboardInterrupt:
        pass
    except BaseException as e:  # reaches the user as one line; the traceback goes to stderr for debugging
        traceback.print_exc()
        errors.put(("error", f"{type(e).__name__}: {e}"))
        sys.exit(1)


def decode_ssd_parallel(verifier, prompts, out, K, args):
    """ssd with two processes: the verifier here, the speculator in a spawned child."""
    b, V = len(prompts), verifier.model.config.vocab_size
    ch = Channel(b, K, V, pin=any(str(d).startswith("cuda") for d in (args["draft_device"], verifier.model.device)))
    ch.pin_here()
    errors = mp.get_context("spawn").Queue()
    proc = start_child(speculator_main, (
        args["draft"], args["draft_device"], args["draft_dtype"], args["draft_threads"], prompts, K,
        args["temperature"], args["seed"], args["draft_kv_tokens"], args["block_size"], args["ssd"], ch, errors))
    try:
        s = time.perf_counter()
        wait_for(ch.loaded, proc.is_alive, "speculator")  # process start-up and model load: not decode time
        startup_s = time.perf_counter() - s
        t_start = time.perf_counter()
        t0 = verifier.prefill(prompts)
        prefill_s = time.perf_counter() - t_start
        start = time.perf_counter()
        finished = [r for r in range(b) if out.emit(r, [int(t0[r])])]
        verifier.finish(finished)
        rows, wait = out.active(), 0.0
        ch.t[:] = t0.cpu()
        ch.active[rows] = True
        ch.outcome_ready.set()
        while rows:
            w = time.perf_counter()
            wait_for(ch.proposals_ready, proc.is_alive, "speculator")
            wait += time.perf_counter() - w
            v = time.perf_counter()
            tokens = ch.tokens[rows]  # [b, K]: read the shared buffer once per round
            n, t = verifier.verify(rows, tokens, ch.q[rows], ch.det[rows])
            ch.ctl[2] = time.perf_counter() - v
            finished = out.round(rows, tokens, n, t, ch.hit[rows])
            verifier.finish(finished)
            ch.n[rows], ch.t[rows] = n.cpu(), t.cpu()
            ch.active[finished] = False
            rows = out.active()
            ch.outcome_ready.set()
        decode_s = time.perf_counter() - start
        kind, child_stats = errors.get(timeout=30)  # read before join: a full pipe would block the child's exit
        if kind == "error":
            raise RuntimeError(f"speculator failed: {child_stats}")
        proc.join(timeout=30)
        child_stats["startup_seconds"] = startup_s
        return prefill_s, decode_s, wait, child_stats
    except BaseException:
        ch.ctl[1] = 1
        ch.outcome_ready.set()
        raise
    finally:
        if proc.is_alive():
            proc.join(timeout=2)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=2)
        if proc.exitcode not in (0, None):
            msg = None
            while not errors.empty():
                kind, val = errors.get()
                if kind == "error":
                    msg = val
            if msg and sys.exc_info()[0] is not KeyboardInterrupt:
                raise RuntimeError(f"speculator failed: {msg}") from None


# ----------------------------------------------------------------------------------------------------
# Tensor-parallel target (--target-devices, as the paper runs Llama-3.1-70B on 4 GPUs)
#
# Rank 0 is the verifier in this process and talks to the speculator as in every other mode; ranks
# 1..world-1 are spawned workers holding the other slices of the target (model.py splits heads, MLP and
# vocabulary and does the all-reduces). For each Verifier call rank 0 broadcasts the arguments as tensors and
# every rank makes the same call, so the forwards run in lockstep and all ranks keep identical KV caches.

# How long a rank waits for the others in one collective before it gives up (seconds; generate(tp_timeout=),
# --tp-timeout). A rank that stops answering (stopped, hung, its GPU wedged) ends the run after this long:
# gloo raises, NCCL's watchdog aborts. Loading the weights is not under it (see TPWorkers.wait_ready), but
# a prefill is, and so is a worker's wait for rank 0's next command.
TP_TIMEOUT_S = 120.0
PREFILL, VERIFY, FINISH, STOP = 1, 2, 3, 4  # rank 0's commands


def tp_backend(devices: list[str]) -> str:
    """NCCL over distinct GPUs, gloo over CPUs."""
    kinds = {torch.device(d).type for d in devices}
    if kinds == {"cpu"}:
        return "gloo"
    if kinds != {"cuda"}:
        raise ValueError(f"target_devices={devices}: use only cuda:N devices (NCCL) or only cpu (gloo), not a mix")
    idx = [torch.device(d).index or 0 for d in devices]
    if len(set(idx)) != len(idx):
        raise ValueError(f"target_devices={devices} repeats a GPU: tensor parallelism needs one GPU per rank")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if max(idx) >= visible:
        raise ValueError(f"target_devices={devices}: only {visible} GPUs are visible")
    return "nccl"


def tp_store(world: int, timeout_s: float, port: int | None = None) -> dist.TCPStore:
    """The rendezvous of a tensor-parallel group on this machine: rank 0 serves it on a port the OS picks
    (port=None; the port is .port), the other ranks connect to that port."""
    t = timedelta(seconds=timeout_s)
    if port is None:
        return dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=t)
    return dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=t)


def tp_init(rank, world, store, backend, device, timeout_s=TP_TIMEOUT_S):
    """Join the process group. A worker first marks itself in the store, so rank 0 can wait for every worker
    while watching that each is alive (a rank that dies before joining must not leave rank 0 waiting)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL uses the current device of each rank
    if rank > 0:
        store.set(f"joined/{rank}", "1")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


class TPWorkers:
    """Rank 0's handle on ranks 1..world-1: spawns them (they load their slices while rank 0 loads its own),
    joins their process group, watches that they live, and stops them in close(): a STOP command when they
    wait for one, else terminate, so Ctrl-C or an error anywhere leaves no process behind.

    A rank that dies: during start-up, rank 0 sees it in the rendezvous or the load and raises naming it; while
    decoding, gloo's next collective fails at once (the peer's socket is closed), and for NCCL, whose
    collectives would spin on the GPU, the watch thread aborts the process group. A rank that stops answering
    ends the run after timeout_s (the collective timeout)."""

    def __init__(self, target, devices: list[str], threads: int | None, timeout_s: float = TP_TIMEOUT_S, dtype=None):
        if not timeout_s > 0:
            raise ValueError(f"tp_timeout={timeout_s}: give the seconds a rank may wait in a collective, > 0")
        self.world, self.device, self.timeout_s = len(devices), torch.device(devices[0]), timeout_s
        check_tp(load_config(target), self.world)
        backend = tp_backend(devices)
        if dist.is_initialized():
            raise ValueError("this process already has a torch.distributed process group: a tensor-parallel "
                             "target needs its own (call generate() outside torch.distributed jobs)")
        self.rank0, self.backend = TP(0, self.world), backend
        self.idle = False  # True while every worker waits for a command (only then can a STOP be sent)
        self.closing = False
        self.store = tp_store(self.world, timeout_s)
        self.errors = mp.get_context("spawn").Queue()
        self.procs = [start_child(tp_worker_main, (r, self.world, self.store.port, backend, devices[r], target,
                                                   dtype, threads, timeout_s, os.getpid(), self.errors))
                      for r in range(1, self.world)]
        try:
            self.wait(lambda: self.store.check([f"joined/{r}" for r in range(1, self.world)]), "start-up")
            tp_init(0, self.world, self.store, backend, self.device, timeout_s)
        except BaseException:
            self.close()
            raise
        threading.Thread(target=self.watch, daemon=True).start()

    def wait(self, done, stage):
        """Poll done() until it is true; a worker that failed or died meanwhile raises, naming it."""
        while not done():
            if not all(p.is_alive() for p in self.procs):
                time.sleep(0.2)  # let its error message reach the queue
                raise RuntimeError(self.failure() or f"a tensor-parallel rank died during {stage}")
            time.sleep(0.02)

    def watch(self):
        """While decoding: a worker that dies leaves NCCL peers spinning in a collective, and this process
        blocked in its next host sync; aborting the process group releases them with an error (gloo fails
        by itself, its peers' sockets close)."""
        while not self.closing:
            if any(p.exitcode not in (0, None) for p in self.procs):
                if self.backend == "nccl" and dist.is_initialized():
                    dist.distributed_c10d._abort_process_group()
                return
            time.sleep(0.1)

    def wait_ready(self):
        """Block until every worker has loaded its slices (no time limit: a large checkpoint on a slow disk
        takes what it takes); a worker that fails or dies raises here."""
        ready = 0
        while ready < len(self.procs):
            try:
                kind, msg = self.errors.get(timeout=0.1)
            except queue.Empty:
                if not all(p.is_alive() for p in self.procs):
                    raise RuntimeError(self.failure() or "a tensor-parallel rank died while loading")
                continue
            if kind == "error":
                raise RuntimeError(f"tensor-parallel {msg}")
            ready += 1

    def failure(self, killed=()) -> str | None:
        """The first error a worker reported, else the first worker that died on its own, else None."""
        while True:
            try:
                kind, msg = self.errors.get_nowait()
            except queue.Empty:
                break
            if kind == "error":
                return f"tensor-parallel {msg}"
        for r, p in enumerate(self.procs, 1):
            if p.exitcode not in (0, None) and p not in killed:
                return f"tensor-parallel rank {r} died (exit code {p.exitcode})"
        return None

    def close(self):
        """Stop the workers and leave the process group; raise a worker's error (unless the user interrupted),
        or name the ranks that stopped answering when a collective timed out."""
        self.closing = True
        if self.idle:
            try:
                dist.broadcast(torch.tensor([STOP, 0, 0, 0], device=self.device), src=0)
            except Exception:  # a dead worker: reported below
                pass
        # after an error, give a worker that is dying a moment to be seen dead (a SIGKILLed rank's sockets
        # close before its exit code shows): it is reported as dead, not killed by us
        deadline = time.time() + (30 if self.idle else 1)
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.time()))
        killed = [p for p in self.procs if p.is_alive()]
        for p in killed:
            p.terminate()
        for p in killed:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store = None  # closes the rendezvous server
        error = sys.exc_info()[1]
        msg = self.failure(killed)
        if msg is None and killed and "timed out" in str(error).lower():  # alive, yet a collective timed out
            ranks = ", ".join(str(self.procs.index(p) + 1) for p in killed)
            msg = (f"tensor-parallel rank {ranks} did not answer within tp_timeout={self.timeout_s:g}s (stopped or "
                   f"hung; raise --tp-timeout if it was only slow)")
        if msg and not isinstance(error, KeyboardInterrupt):
            raise RuntimeError(msg) from None


def exit_with_parent(parent_pid):
    """Workers poll for rank 0's process: if it was killed too hard to stop them, they exit on their own."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


def tp_worker_main(rank, world, port, backend, device, target, dtype, threads, timeout_s, parent_pid, errors):
    """Rank 1..world-1: load this rank's slices of the target, then run rank 0's Verifier calls."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process of the terminal; rank 0 stops us
    threading.Thread(target=exit_with_parent, args=(parent_pid,), daemon=True).start()
    try:
        if threads:
            torch.set_num_threads(threads)
        tp_init(rank, world, tp_store(world, timeout_s, port), backend, device, timeout_s)
        model, _ = load_model(target, device=device, dtype=dtype, tp=TP(rank, world), tokenizer=False)
        errors.put(("ready", rank))
        TPVerifier(model).serve()
        dist.destroy_process_group()
        # done: skip the interpreter's teardown of torch (seconds), which rank 0 would wait for in close()
        errors.close()
        errors.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except BaseException as e:
        traceback.print_exc()
        errors.put(("error", f"rank {rank} failed: {type(e).__name__}: {e}"))
        sys.exit(1)


class TPVerifier:
    """One rank of a tensor-parallel verifier, with Verifier's methods (prefill, verify, finish).

    On rank 0 (the one given `workers`) each call first broadcasts its arguments; ranks 1.. receive them in
    serve() and make the same call. model.py all-gathers the logits onto every rank, so every rank runs
    accept_reject on the same numbers with an identically seeded generator, draws the same (n, t) and rolls
    its cache back the same way: only the arguments travel, never the outcome."""

    def __init__(self, model, settings: tuple | None = None, workers: TPWorkers | None = None):
        self.model, self.workers, self.rank, self.dev = model, workers, model.tp.rank, model.device
        if workers:
            workers.wait_ready()
        box = [settings]  # Verifier's (temperature, seed, kv_tokens, block_size): pickled once, not per round
        dist.broadcast_object_list(box, src=0)
        self.verifier = Verifier(model, *box[0])
        if workers:
            workers.idle = True

    # -- rank 0: the calls the decode loops make, exactly as on a Verifier
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        lengths = [len(p) for p in prompts]
        self._send(PREFILL, len(prompts), sum(lengths))
        t0 = self._prefill(len(prompts), sum(lengths), torch.tensor(lengths), torch.tensor([x for p in prompts for x in p]))
        self.workers.idle = True
        return t0

    def verify(self, rows: list[int], tokens, q, deterministic):
        (b, K), send_q = tokens.shape, self.verifier.temperature > 0
        self._send(VERIFY, b, K, int(send_q))
        ints = torch.cat([torch.tensor(list(rows))[:, None], tokens.cpu().long(),
                          deterministic.cpu().long()[:, None]], 1)  # [b, K+2]: row, x_1..x_K, deterministic
        n, t = self._verify(b, K, send_q, ints, q)
        self.workers.idle = True
        return n, t

    def finish(self, rows):
        rows = list(rows)
        if rows:  # nothing to free, nothing to say
            self._send(FINISH, len(rows))
            self._finish(len(rows), torch.tensor(rows))
            self.workers.idle = True

    # -- ranks 1..world-1
    def serve(self):
        """Run rank 0's commands until it sends STOP."""
        while True:
            op, a, b, c = self._share(None, (4,)).tolist()
            if op == STOP:
                return
            if op == PREFILL:
                self._prefill(a, b)
            elif op == VERIFY:
                self._verify(a, b, bool(c))
            elif op == FINISH:
                self._finish(a)
            else:
                raise RuntimeError(f"unknown command {op} from rank 0")

    # -- every rank: receive (or, on rank 0, send) the arguments, then make the local call
    def _send(self, op, a=0, b=0, c=0):
        self.workers.idle = False
        self._share(torch.tensor([op, a, b, c]), (4,))

    def _share(self, x, shape, dtype=torch.long):
        """Rank 0's tensor x, on every rank (the others pass None and receive it)."""
        if self.rank == 0:
            buf = x.to(self.dev, dtype).contiguous()
        else:
            buf = torch.empty(shape, dtype=dtype, device=self.dev)
        if buf.numel():  # ar rounds have K = 0: empty tensors need no message
            dist.broadcast(buf, src=0, group=self.model.tp.group)
        return buf

    def _prefill(self, b, total, lengths=None, tokens=None):
        lengths = self._share(lengths, (b,)).tolist()
        tokens = self._share(tokens, (total,)).cpu()
        return self.verifier.prefill([p.tolist() for p in tokens.split(lengths)])

    def _verify(self, b, K, send_q, ints=None, q=None):
        ints = self._share(ints, (b, K + 2))  # [b, K+2]: row, x_1..x_K, deterministic flag
        V = self.model.config.vocab_size
        # at temperature 0 the test reads only the tokens (greedy), so q, [b, K, V], need not travel
        q = self._share(q, (b, K, V), torch.float32) if send_q else torch.zeros((), device=self.dev).expand(b, K, V)
        n, t = self.verifier.verify(ints[:, 0].tolist(), ints[:, 1:K + 1], q, ints[:, K + 1].bool())
        # A guard, one tiny broadcast per round: if the ranks' outcomes ever differed (a reduction that is not
        # bitwise equal on every rank), their caches would drift apart silently; stop loudly instead.
        mine = torch.stack([n, t])  # [2, b]
        if not torch.equal(self._share(mine if self.rank == 0 else None, (2, b)), mine):
            raise RuntimeError(f"rank {self.rank} drew a different verification outcome than rank 0: ranks out of lockstep")
        return n, t

    def _finish(self, b, rows=None):
        self.verifier.finish(self._share(rows, (b,)).tolist())


# ----------------------------------------------------------------------------------------------------
# generate()

def default_devices(target_gpus=1):
    """The target on cuda:0 (..cuda:{target_gpus-1} when tensor parallel) and the draft on the next GPU;
    with too few GPUs the draft shares cuda:0; without GPUs both on the CPU."""
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return "cuda:0", f"cuda:{target_gpus}" if n > target_gpus else "cuda:0"
    return "cpu", "cpu"


def same_gpu(a, b) -> bool:
    """Whether two device names are one CUDA device ("cuda" is cuda:0, a fresh process's current device)."""
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type == "cuda" and (a.index or 0) == (b.index or 0)


def split_cores(cores: int) -> tuple[int, int]:
    """ssd on the CPU: (target threads, draft threads), the verifier taking the larger half."""
    return max(1, cores - cores // 2), max(1, cores // 2)


def encode(tokenizer, prompt, chat):
    if not isinstance(prompt, str):
        return list(prompt)
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer: pass prompts as lists of token ids")
    if chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    ids = tokenizer(prompt)["input_ids"]
    if tokenizer.bos_token_id is not None and (not ids or ids[0] != tokenizer.bos_token_id):
        ids = [tokenizer.bos_token_id] + ids
    return ids


def generate(prompts, target="tiny", draft="tiny-draft", mode="sd", max_new_tokens=128, temperature=0.0, k=4,
             seed=0, ignore_eos=False, fan_out="geometric", budget=8, saguaro_c=1.0, fallback="auto",
             parallel=True, target_device=None, draft_device=None, target_threads=None, draft_threads=None,
             kv_tokens=None, block_size=16, chat=False, stream=None,
             target_devices: list[str] | None = None, tp_timeout: float = TP_TIMEOUT_S, dtype="auto") -> GenerateResult:
    """Generate up to max_new_tokens for each prompt (strings, or lists of token ids).

    mode: "ar" (target only), "sd" (speculative decoding, K draft tokens per round) or "ssd" (speculative
    speculative decoding with Saguaro: fan_out, budget B, saguaro_c C, fallback policy, parallel).
    target_devices: two or more devices (e.g. ["cuda:0", ..., "cuda:3"]) run the target tensor parallel, one
    rank per device (it replaces target_device); tp_timeout: seconds a rank may wait in one collective before
    the run fails. kv_tokens: the target's KV cache in tokens (default: sized for the prompts and
    max_new_tokens); the draft's cache gets the same plus room for SSD's branches. dtype: both models' weights and
    activations, "auto" (bfloat16 on CUDA, float32 on the CPU, per model), "float32", "bfloat16" or "float16"
    (or a torch dtype); logits are float32 in every dtype. stream(row, tokens_so_far) is called as tokens are
    accepted."""
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
    K = k if mode != "ar" else 0
    dev_t, dev_d = default_devices(len(target_devices) if target_devices else 1)
    target_device, draft_device = target_device or dev_t, draft_device or dev_d
    target_device = target_devices[0] if target_devices else target_device
    target_dtype, draft_dtype = resolve_dtype(dtype, target_device), resolve_dtype(dtype, draft_device)
    if mode == "ssd" and parallel and any(same_gpu(d, draft_device) for d in target_devices or [target_device]):
        # the two processes would take turns on one GPU: SSD's drafting would not overlap the verification
        warnings.warn(f"ssd: the draft shares {draft_device} with the target, so the verifier and speculator processes "
                      f"will time-slice one GPU with no overlap; give the draft its own GPU (--draft-device) or use "
                      f"--mode sd", stacklevel=2)
    cores = os.cpu_count() or 1
    if mode == "ssd" and parallel:  # the two processes split the cores (when on the CPU)
        ts, td = split_cores(cores)
        target_threads, draft_threads = target_threads or ts, draft_threads or td
    else:
        target_threads = target_threads or cores
    old_threads = torch.get_num_threads()
    torch.set_num_threads(target_threads)
    workers = None  # ranks 1.. of a tensor-parallel target
    try:
        if target_devices and len(target_devices) > 1:
            workers = TPWorkers(target, list(target_devices), target_threads, tp_timeout, target_dtype)
        tmodel, tok = load_model(target, device=target_device, dtype=target_dtype,
                                 tp=workers.rank0 if workers else None)
        cfg = tmodel.config
        ids = [encode(tok, p, chat) for p in prompts]
        for p in ids:
            if not p:
                raise ValueError("empty prompt: give at least one token")
            if len(p) + max_new_tokens + K + 1 > cfg.max_position_embeddings:
                raise ValueError(f"prompt of {len(p)} tokens + max_new_tokens={max_new_tokens} exceeds the target's "
                                 f"context of {cfg.max_position_embeddings}: shorten the prompt or max_new_tokens")
            bad = [x for x in p if not 0 <= x < cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} outside the vocabulary of size {cfg.vocab_size}")
        if mode != "ar":
            dcfg = load_config(draft)
            if dcfg.vocab_size != cfg.vocab_size:
                raise ValueError(f"draft vocabulary ({dcfg.vocab_size}) differs from the target's ({cfg.vocab_size}): "
                                 f"pick a draft from the same model family")
        eos = [] if ignore_eos else sorted(set(cfg.eos_token_ids) | ({tok.eos_token_id} if tok and tok.eos_token_id is not None else set()))
        b, longest = len(ids), max(len(p) for p in ids)
        # the verifier holds each row's prompt, its output and, during a round, K + 1 more tokens
        need = sum(-(-(len(p) + max_new_tokens + K + 1) // block_size) * block_size for p in ids)
        if kv_tokens is not None and kv_tokens < need:
            raise ValueError(f"kv_tokens={kv_tokens} cannot hold {b} prompt(s) + max_new_tokens={max_new_tokens}: "
                             f"give at least {need} (--kv-tokens {need}) or leave it unset to size it automatically")
        kv_tokens = kv_tokens or b * (longest + max_new_tokens + 2 * K + 4 + 2 * block_size)
        settings = (temperature, seed, kv_tokens, block_size)
        verifier = TPVerifier(tmodel, settings, workers) if workers else Verifier(tmodel, *settings)
        out = Output(b, max_new_tokens, eos, K, stream)
        stats = {}
        if mode in ("ar", "sd"):
            drafter = None
            if mode == "sd":
                dmodel, _ = load_model(draft, device=draft_device, dtype=draft_dtype, tokenizer=False)
                drafter = Drafter(dmodel, K, temperature, seed + 1, kv_tokens, block_size)
            prefill_s, decode_s = decode_ar_sd(verifier, drafter, ids, out, K)
        else:
            ssd = SSDConfig(fan_out=fan_out, budget=budget, saguaro_c=saguaro_c, fallback=fallback)
            validate_ssd(ssd, K)
            # the draft holds each row's main sequence plus B branches of at most K + 2 private tokens
            draft_kv = kv_tokens + b * ssd.budget * (K + 3 + 2 * block_size)
            if parallel:
                prefill_s, decode_s, wait, stats = decode_ssd_parallel(verifier, ids, out, K, dict(
                    draft=draft, draft_device=draft_device, draft_dtype=draft_dtype, draft_threads=draft_threads,
                    temperature=temperature, seed=seed, draft_kv_tokens=draft_kv, block_size=block_size, ssd=ssd))
            else:
                dmodel, _ = load_model(draft, device=draft_device, dtype=draft_dtype, tokenizer=False)
                spec = Speculator(dmodel, K, temperature, seed + 1, draft_kv, ssd, block_size)
                prefill_s, decode_s, wait = decode_ssd_serial(verifier, spec, ids, out)
                stats = spec.stats()
            stats["verifier_wait_seconds"] = wait
            stats["tokens_per_round_hit"] = out.tok_hit / out.rounds_hit if out.rounds_hit else 0.0
            stats["tokens_per_round_miss"] = out.tok_miss / out.rounds_miss if out.rounds_miss else 0.0
            stats["fallback"] = fallback
            stats["parallel"] = parallel
        stats = {**out.stats(mode, prefill_s, decode_s, b), **stats, "k": K, "temperature": temperature,
                 "target_threads": target_threads, "draft_threads": draft_threads if mode == "ssd" and parallel else None}
        # the text a user reads: special tokens (an end-of-turn <|im_end|>, </s>) stay in .tokens only
        text = [tok.decode(x, skip_special_tokens=True) for x in out.tokens] if tok is not None else None
        return GenerateResult(out.tokens, text, stats)
    finally:
        torch.set_num_threads(old_threads)
        if workers:
            workers.close()


def validate_ssd(ssd: SSDConfig, K: int):
    if ssd.budget < 1:
        raise ValueError(f"budget={ssd.budget}: the fan-out budget B must be >= 1")
    if not 0 <= ssd.saguaro_c <= 1:
        raise ValueError(f"saguaro_c={ssd.saguaro_c}: C must be in [0, 1]")
    if ssd.fallback not in ("auto", "neural", "ngram", "random"):
        raise ValueError(f"fallback={ssd.fallback!r}: use auto, neural, ngram or random")
    if isinstance(ssd.fan_out, (list, tuple)):
        if len(ssd.fan_out) != K + 1 or min(ssd.fan_out) < 0:
            raise ValueError(f"fan_out={list(ssd.fan_out)}: give K+1 = {K + 1} non-negative integers F_0..F_K")
        ssd.budget = sum(ssd.fan_out)
    elif ssd.fan_out not in ("geometric", "uniform"):
        raise ValueError(f"fan_out={ssd.fan_out!r}: use geometric, uniform or a list of K+1 integers")


# ----------------------------------------------------------------------------------------------------
# The command line

def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Generate text with autoregressive decoding (ar), speculative decoding (sd) or speculative "
                    "speculative decoding (ssd, Saguaro). Streams the text of the prompt's continuation, then "
                    "prints speed and acceptance statistics.")
    g = ap.add_argument_group("what to generate")
    g.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt text (default: a Python class header the tiny pair continues)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template (instruct models)")
    g.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="stop after N new tokens (default: %(default)s)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 is greedy (argmax) (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="random seed of the sampling (same seed, same tokens) (default: %(default)s)")
    g = ap.add_argument_group("models and algorithm")
    g.add_argument("--target", default="tiny", metavar="MODEL",
                   help="target model: an HF directory, an HF hub id in the local cache, or an alias "
                        "(llama-70b, llama-8b, llama-1b, qwen-8b, tiny, ...; see README) (default: %(default)s)")
    g.add_argument("--draft", default="tiny-draft", metavar="MODEL",
                   help="draft model (sd, ssd), same forms as --target; must share the target's vocabulary (default: %(default)s)")
    g.add_argument("--mode", default="ssd", choices=["ar", "sd", "ssd"],
                   help="ar: target alone; sd: speculative decoding; ssd: speculative speculative decoding (default: %(default)s)")
    g.add_argument("--k", type=int, default=4, metavar="K", help="K: draft tokens proposed per round (sd, ssd) (default: %(default)s)")
    g.add_argument("--fan-out", default="geometric", metavar="F",
                   help="ssd: how the B guesses per sequence spread over the K+1 depths: geometric, uniform, "
                        "or comma-separated integers F_0,...,F_K (default: %(default)s)")
    g.add_argument("--budget", type=int, default=8, metavar="B",
                   help="ssd: B, outcome guesses (branches) pre-speculated per sequence per round (default: %(default)s)")
    g.add_argument("--saguaro-c", type=float, default=1.0, metavar="C",
                   help="ssd at T > 0: Saguaro sampling's C in [0, 1]; the draft's law is scaled by C on the "
                        "cached guesses, so the target's rejections land on them more often (1 = the plain law) (default: %(default)s)")
    g.add_argument("--fallback", default="auto", choices=["auto", "neural", "ngram", "random"],
                   help="ssd: who proposes after a cache miss: the draft (neural), a cheap n-gram or random "
                        "speculator, or auto (the draft while the batch is below the critical batch size b*, "
                        "estimated from this run's timings, n-gram from b* on) (default: %(default)s)")
    g.add_argument("--no-parallel", action="store_true",
                   help="ssd: run the verifier and the speculator interleaved in one process (same tokens, slower)")
    g = ap.add_argument_group("devices and memory")
    g.add_argument("--device", default=None,
                   help="device for both models, e.g. cpu or cuda:0 (default: target on cuda:0 and draft on the "
                        "next GPU if there are GPUs, else cpu)")
    g.add_argument("--target-device", default=None, help="device of the target (overrides --device)")
    g.add_argument("--draft-device", default=None, help="device of the draft (overrides --device)")
    g.add_argument("--target-devices", default=None, metavar="DEV,DEV,...",
                   help="tensor-parallel target, one rank per device: cuda:0,cuda:1,cuda:2,cuda:3 (NCCL) or "
                        "cpu,cpu (gloo)")
    g.add_argument("--tp-timeout", type=float, default=TP_TIMEOUT_S, metavar="SECONDS",
                   help="tensor parallel: a rank waiting longer than this in one collective (a stopped or hung "
                        "peer) ends the run with an error naming the rank (default: %(default)s)")
    g.add_argument("--target-threads", type=int, default=None, metavar="N",
                   help="CPU threads of the target (default: all cores; in parallel ssd the larger half)")
    g.add_argument("--draft-threads", type=int, default=None, metavar="N",
                   help="CPU threads of the speculator process in parallel ssd (default: the smaller half)")
    g.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="weights and activations of both models (the logits are float32 in every dtype): auto is "
                        "bfloat16 on CUDA and float32 on the CPU; bfloat16 runs on the CPU too, slowly, to check a "
                        "GPU's numerics there (default: %(default)s)")
    g.add_argument("--kv-tokens", type=int, default=None, metavar="TOKENS",
                   help="target KV cache size in tokens (default: sized for the prompt and --max-new-tokens); "
                        "the draft's cache gets the same plus room for ssd's branches")
    g = ap.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print one JSON line with the tokens, text and stats instead")
    a = ap.parse_args(argv)
    fan = [int(x) for x in a.fan_out.split(",")] if "," in a.fan_out or a.fan_out.isdigit() else a.fan_out
    printed = [0]

    def stream(row, tokens):  # print the decoded text of the first prompt as it is accepted
        if row != 0 or a.json or tokenizer[0] is None:
            return
        text = tokenizer[0].decode(tokens, skip_special_tokens=True)
        sys.stdout.write(text[printed[0]:])
        sys.stdout.flush()
        printed[0] = len(text)

    tokenizer = [None]
    try:
        if not a.json:
            tokenizer[0] = load_tokenizer(a.target)  # the one load_model loads; only for streaming
            sys.stdout.write(a.prompt)
        res = generate([a.prompt], target=a.target, draft=a.draft, mode=a.mode, max_new_tokens=a.max_new_tokens,
                       temperature=a.temperature, k=a.k, seed=a.seed, ignore_eos=a.ignore_eos, fan_out=fan,
                       budget=a.budget, saguaro_c=a.saguaro_c, fallback=a.fallback, parallel=not a.no_parallel,
                       target_device=a.target_device or a.device, draft_device=a.draft_device or a.device,
                       target_threads=a.target_threads, draft_threads=a.draft_threads, kv_tokens=a.kv_tokens,
                       chat=a.chat, stream=stream, tp_timeout=a.tp_timeout, dtype=a.dtype,
                       target_devices=a.target_devices.split(",") if a.target_devices else None)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps({"tokens": res.tokens[0], "text": res.text[0] if res.text else None, "stats": res.stats}))
        return 0
    s = res.stats
    print("\n")
    rows = [("mode", s["mode"]), ("new tokens", s["new_tokens"]), ("prefill s", f"{s['prefill_seconds']:.3f}"),
            ("decode tok/s", f"{s['decode_tok_s']:.1f}"), ("rounds", s["rounds"]),
            ("tokens/round", f"{s['mean_tokens_per_round']:.2f}"), ("acceptance", f"{s['acceptance_rate']:.2f}")]
    if s["mode"] == "ssd":
        rows += [("cache hit rate", f"{s['cache_hit_rate']:.2f}"), ("fallback", f"{s['fallback']} (b*={s['b_star']})"),
                 ("verifier wait", f"{s['verifier_wait_seconds'] / max(s['decode_seconds'], 1e-9):.0%}")]
    for k_, v in rows:
        print(f"{k_:>16}  {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
