"""Tensor-parallel target: over the devices of one machine (--target-devices, as the paper runs
Llama-3.1-70B on 4 GPUs), or over every rank of a torchrun world, across nodes.

Rank 0 is the verifier in the calling process: it loads its slice of the target, talks to the
speculator as in every other mode, and makes each Verifier call through
`TPVerifier.call(name, *args)`, which broadcasts the call to the other ranks and makes it locally.
Ranks 1..world-1, spawned here (`TPWorkers`) or started by torchrun (`serve_torchrun_rank`), load
their slices, then `serve()` rank 0's calls until "stop", making the same calls on their own
Verifiers, so the forwards run in lockstep and every rank keeps an identical KV cache. model.py
splits heads, MLP and vocabulary and does the all-reduces.
"""
import math
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from channel import exit_with_parent, parent_gone, quick_exit, start_child
from checkpoint import load_config, load_model
from devices import check_device, to_device, tp_backend
from model import TP
from verify import Verifier

# How long a rank waits for the others in one collective before it gives up (seconds;
# generate(tp_timeout=), --tp-timeout). A rank that stops answering (stopped, hung, its GPU wedged)
# ends the run after this long: gloo raises, NCCL's watchdog aborts. Neither loading the weights
# (TPWorkers.wait_ready) nor a worker's wait for the next call (tp_init) is under it; a prefill is.
TP_TIMEOUT_S = 120.0


def tp_store(world: int, timeout_s: float, port: int | None = None) -> dist.TCPStore:
    """The rendezvous of a tensor-parallel group on this machine: rank 0 serves it on a port the OS
    picks (port=None; the port is .port), the other ranks connect to that port."""
    return dist.TCPStore("127.0.0.1", port or 0, world, is_master=port is None,
                         wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


TP_TIMEOUT_MAX_S = 2_000_000  # 23 days, below 2**31 milliseconds


def check_start(target, world: int, timeout_s: float):
    """Before a rank starts: a timeout that can pass, a split the model allows (each rank checks
    before it loads any weight) and no process group of this process's own in the way."""
    if not 0 < timeout_s <= TP_TIMEOUT_MAX_S:  # gloo counts milliseconds in 32 bits
        raise ValueError(f"--tp-timeout {timeout_s} (tp_timeout=): give the seconds a rank may "
                         f"wait in a collective, in (0, {TP_TIMEOUT_MAX_S:,}]")
    load_config(target).check_tp(world)
    if dist.is_initialized():
        raise ValueError("this process already has a torch.distributed process group: the "
                         "tensor-parallel target needs its own (call generate() outside it)")


def tp_init(rank, world, store, backend, device, timeout_s=TP_TIMEOUT_S):
    """Join the process group; -> the gloo group rank 0's calls travel by (a wait on the CPU, not
    a spin on the GPU). A worker first marks itself in the store, so that rank 0 waits for every
    worker while watching that each lives (one dead before joining would leave it waiting)."""
    device = torch.device(device)
    if device.type == "cuda":
        # NCCL uses each rank's current device; set_device needs an index, which "cuda" lacks
        torch.cuda.set_device(check_device(device))
    if rank > 0:
        store.set(f"joined/{rank}", "1")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    # gloo's timeout is each process's own: ranks 1.. wait for a call as long as rank 0 has none (a
    # server between requests), rank 0's send fails after timeout_s when a rank stopped answering
    idle = timeout_s if rank == 0 else TP_TIMEOUT_MAX_S
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=idle))


# --------------------------------------------------------------------------------------------------
# Rank 0's handle on the workers

class Ranks:
    """What TPVerifier needs of rank 0's handle on the other ranks (TPWorkers, spawned here;
    TorchrunWorld, started by torchrun): busy() around each call, wait_ready() before the first."""
    idle = False  # True while every other rank waits for a call (only then can "stop" be sent)
    calls = None  # the process group the calls travel by (tp_init's)

    @contextmanager
    def busy(self):
        """Around one call on every rank. Only a call that completed leaves the others waiting for
        the next; after an error they may be anywhere inside it (close() must not send "stop")."""
        self.idle = False
        yield
        self.idle = True  # not reached when the call raised


class TPWorkers(Ranks):
    """Rank 0's handle on ranks 1..world-1: spawns them (they load their slices while rank 0 loads
    its own), joins their process group, watches that they live, and stops them in close() (a
    "stop" call when they wait for one, else terminate): Ctrl-C or an error leaves no process.

    A rank that dies: during start-up, rank 0 sees it in the rendezvous or the load and raises
    naming it; while decoding, gloo's next collective fails at once (the peer's socket is closed),
    and for NCCL, whose collectives would spin on the GPU, the watch thread aborts the process
    group. A rank that stops answering ends the run after timeout_s (the collective timeout)."""

    def __init__(self, target, devices: list[str], threads: int | None,
                 timeout_s: float = TP_TIMEOUT_S, dtype=None):
        self.world, self.device, self.timeout_s = len(devices), torch.device(devices[0]), timeout_s
        check_start(target, self.world, timeout_s)
        self.rank0, self.backend, self.closing = TP(0, self.world), tp_backend(devices), False
        self.store = tp_store(self.world, timeout_s)
        self.errors = mp.get_context("spawn").Queue()
        self.procs = [start_child(tp_worker_main,
                                  (r, self.world, self.store.port, self.backend, devices[r], target,
                                   dtype, threads, timeout_s, os.getpid(), self.errors))
                      for r in range(1, self.world)]
        try:
            self.wait(lambda: self.store.check([f"joined/{r}" for r in range(1, self.world)]),
                      "start-up")
            self.calls = tp_init(0, self.world, self.store, self.backend, self.device, timeout_s)
        except BaseException:
            self.close()
            raise
        threading.Thread(target=self.watch, daemon=True).start()

    def wait(self, done, stage):
        """Poll done() until true; a worker that failed or died meanwhile raises, naming it."""
        while not done():
            if not all(p.is_alive() for p in self.procs):
                time.sleep(0.2)  # let its error message reach the queue
                raise RuntimeError(self.failure() or f"a tensor-parallel rank died during {stage}")
            time.sleep(0.02)

    def watch(self):
        """While decoding: a dead worker leaves NCCL's peers spinning in a collective and this
        process blocked at its next host sync; aborting the group frees them (gloo fails alone)."""
        while not self.closing:
            if any(p.exitcode not in (0, None) for p in self.procs):
                if self.backend == "nccl" and dist.is_initialized():
                    dist.distributed_c10d._abort_process_group()
                return
            time.sleep(0.1)

    def wait_ready(self):
        """Block until every worker has loaded its slices (no time limit: a large checkpoint on a
        slow disk takes what it takes); a worker that fails or dies raises here."""
        for _ in self.procs:
            self.wait(lambda: not self.errors.empty(), "loading")
            kind, msg = self.errors.get()
            if kind == "error":
                raise RuntimeError(f"tensor-parallel {msg}")

    def failure(self, killed=()) -> str | None:
        """The first error a worker reported, else the first worker that died by itself, or None."""
        with suppress(queue.Empty):
            while True:
                kind, msg = self.errors.get_nowait()
                if kind == "error":
                    return f"tensor-parallel {msg}"
        for r, p in enumerate(self.procs, 1):
            if p.exitcode not in (0, None) and p not in killed:
                return f"tensor-parallel rank {r} died (exit code {p.exitcode})"
        return None

    def close(self):
        """Stop the workers and leave the process group; raise a worker's error (unless the user
        interrupted), or name the ranks that stopped answering when a collective timed out."""
        self.closing = True
        if self.idle:
            with suppress(Exception):  # a dead worker: reported below
                broadcast_header(("stop", [], {}), self.calls)
        # after an error, give a worker that is dying a moment to be seen dead (a SIGKILLed rank's
        # sockets close before its exit code shows): it is reported as dead, not killed by us
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
        self.calls = None  # the last reference to the calls' group: its gloo threads end
        self.store = None  # closes the rendezvous server
        error = sys.exc_info()[1]
        msg = self.failure(killed)
        if msg is None and killed and "timed out" in str(error).lower():  # alive, yet it timed out
            ranks = ", ".join(str(self.procs.index(p) + 1) for p in killed)
            msg = (f"tensor-parallel rank {ranks} did not answer within tp_timeout="
                   f"{self.timeout_s:g}s (stopped or hung; raise --tp-timeout if it was only slow)")
        if msg and not isinstance(error, KeyboardInterrupt):
            raise RuntimeError(msg) from None


# --------------------------------------------------------------------------------------------------
# The workers' process

def tp_worker_main(rank, world, port, backend, device, target, dtype, threads, timeout_s,
                   parent_pid, errors):
    """Rank 1..world-1: load this rank's slices of the target, then run rank 0's Verifier calls."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process; rank 0 stops us
    threading.Thread(target=exit_with_parent, args=(parent_pid,), daemon=True).start()
    try:
        if threads:
            torch.set_num_threads(threads)
        calls = tp_init(rank, world, tp_store(world, timeout_s, port), backend, device, timeout_s)
        model, _ = load_model(target, device=device, dtype=dtype, tp=TP(rank, world),
                              tokenizer=False)
        errors.put(("ready", rank))
        TPVerifier(model, calls=calls).serve()
        dist.destroy_process_group()
        errors.close()
        errors.join_thread()
        quick_exit(0)
    except BaseException as e:
        if isinstance(e, RuntimeError) and parent_gone(parent_pid):  # gloo's "closed by peer"
            os._exit(1)  # rank 0 was killed: no one to tell, and its end is not this rank's error
        traceback.print_exc()
        errors.put(("error", f"rank {rank} failed: {type(e).__name__}: {e}"))
        sys.exit(1)


# --------------------------------------------------------------------------------------------------
# The call protocol: a pickled header, then each tensor argument by itself

@dataclass(frozen=True)
class TensorArg:
    """A tensor argument's place in a call's header; its data follows with dist.broadcast."""
    shape: tuple
    dtype: torch.dtype


def broadcast_header(header=None, group=None):
    """Rank 0's (name, args) on every rank (the others pass None): a few hundred pickled bytes."""
    box = [header]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class TPVerifier:
    """One rank of a tensor-parallel verifier, with Verifier's methods (prefill, add, verify,
    release, leave).

    On rank 0 (the one given `workers`: TPWorkers or TorchrunWorld) each method is `call(name,
    *args, **kw)`: the call travels to ranks 1.., which receive it in serve(), and every rank makes
    it on its own Verifier. model.py all-gathers the logits onto every rank, so every rank
    runs accept_reject on the same numbers with an identically seeded generator, draws the same
    (n, t) and rolls its cache back the same way: only the arguments travel, never the outcome."""

    def __init__(self, model, settings=None, workers: Ranks | None = None, calls=None):
        self.model, self.workers, self.rank, self.dev = model, workers, model.tp.rank, model.device
        self.group, self.calls_given = model.tp.group, calls
        with workers.busy() if workers else nullcontext():  # loading, then taking the settings
            if workers:
                workers.wait_ready()
            # Verifier's arguments (temperature, seed, kv_tokens, ...): pickled once, not per call
            box = [settings]
            dist.broadcast_object_list(box, src=0, group=self.calls)
        self.verifier = Verifier(model, **box[0])

    @property
    def calls(self):
        """tp_init's group: rank 0's is its workers' (close() drops it, ending its threads)."""
        return self.workers.calls if self.workers else self.calls_given

    # -- rank 0: the calls the decode loops make, exactly as on a Verifier
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        return self.call("prefill", prompts)

    def add(self, prompts: list[list[int]], *, temps=None, seeds=None) -> torch.Tensor:
        return self.call("add", prompts, temps=temps, seeds=seeds)  # rows joining (scheduler.py)

    def verify(self, rows: list[int], tokens, q, deterministic, lengths: list[int]):
        # q=None (T = 0) does not travel; lengths, a list, goes in the header
        return self.call("verify", rows, tokens, q, deterministic, lengths)

    def release(self, rows):
        return self.call("release", rows) if len(rows) else None  # nothing to free, nothing to say

    def leave(self, rows, *, tokens=None):
        return self.call("leave", rows, tokens=tokens) if len(rows) else None

    @property
    def features(self):
        """Rank 0's Verifier.features: each layer's output is whole on every rank (all-reduced),
        so rank 0 alone gives an EAGLE draft the features (want_features on its model only)."""
        return self.verifier.features

    def used_blocks(self) -> int:
        return self.verifier.used_blocks()  # rank 0's: every rank's cache is laid out the same

    def prefix_tokens(self) -> tuple[int, int]:
        return self.verifier.prefix_tokens()  # rank 0's: every rank looks up the same

    def capture_seconds(self) -> float:
        return self.verifier.capture_seconds()  # 0: no CUDA graphs with tensor parallelism

    def call(self, name: str, *args, **kw):
        """Make the local Verifier's call `name` on every rank and return rank 0's result. Tensor
        arguments go by dist.broadcast (moved to this rank's device), the others (keyword
        arguments too) pickled."""
        with self.workers.busy():
            header = [TensorArg(tuple(a.shape), a.dtype) if torch.is_tensor(a) else a for a in args]
            broadcast_header((name, header, kw), self.calls)
            return self.run(name, [self.share(a, h) for a, h in zip(args, header)], kw)

    # -- ranks 1..world-1
    def serve(self):
        """Run rank 0's calls until it sends "stop"."""
        while True:
            name, header, kw = broadcast_header(group=self.calls)
            if name == "stop":
                return
            self.run(name, [self.share(None, h) for h in header], kw)

    # -- every rank
    def share(self, x, h):
        """Rank 0's argument x on every rank (the others pass None and receive a tensor's data)."""
        if not isinstance(h, TensorArg):
            return h  # it came in the header
        if self.rank == 0:
            buf = to_device(x, self.dev).contiguous()  # host arguments cross without blocking
        else:
            buf = torch.empty(h.shape, dtype=h.dtype, device=self.dev)
        if buf.numel():  # ar rounds have K = 0: empty tensors need no message
            dist.broadcast(buf, src=0, group=self.group)
        return buf

    def run(self, name, args, kw):
        """The local call, then a guard: if its outcome ever differed between ranks (a reduction not
        bitwise equal on every rank), their caches would drift apart silently; stop loudly."""
        out = getattr(self.verifier, name)(*args, **kw)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        bits = [x.detach().to(self.dev).contiguous().view(-1).view(torch.uint8)
                for x in outs if torch.is_tensor(x)]
        if bits:  # one tiny broadcast: the result's bytes (verify's (n, t), prefill's t0)
            mine = torch.cat(bits)
            ref = mine.clone()
            if mine.numel():
                dist.broadcast(ref, src=0, group=self.group)
            if not torch.equal(ref, mine):
                raise RuntimeError(f"rank {self.rank} drew a different verification outcome than "
                                   f"rank 0: ranks out of lockstep")
        return out


# --------------------------------------------------------------------------------------------------
# A world started by torchrun: every rank a process of its own, on any node

BEAT_S = 0.5     # each rank counts up its heartbeat in torchrun's store this often
SILENT_S = 5.0   # a rank whose heartbeat has not moved this long is gone (dead, stopped, cut off)
STORE_S = 10.0   # a store operation waits this long for the store before it counts as unreachable


@dataclass(frozen=True)
class TorchrunEnv:
    """This process's place in a torchrun world, from the variables torchrun sets."""
    rank: int
    world: int
    local_rank: int
    local_world: int   # ranks on this node
    node: int          # the node's rank (torchrun's --node-rank)
    nodes: int
    max_restarts: int


def torchrun_env(environ=None) -> TorchrunEnv | None:
    """The torchrun world this process is a rank of, when it has two or more ranks; else None."""
    env = os.environ if environ is None else environ
    if int(env.get("WORLD_SIZE", "1")) < 2:
        return None
    missing = [v for v in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if v not in env]
    if missing:
        raise ValueError(f"WORLD_SIZE={env['WORLD_SIZE']} but {', '.join(missing)} not set: "
                         f"start every rank with torchrun (python -m torch.distributed.run)")
    return TorchrunEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]),
                       int(env.get("LOCAL_WORLD_SIZE", "1")), int(env.get("GROUP_RANK", "0")),
                       int(env.get("GROUP_WORLD_SIZE", "1")),
                       int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")))


def torchrun_device(device, local_rank: int) -> str:
    """A torchrun rank's device: cuda:LOCAL_RANK where GPUs are visible (or device is "cuda"), else
    the CPU ("cpu" chooses it, and gloo, on a machine with GPUs too)."""
    if device is not None and torch.device(device).index is not None:
        raise ValueError(f"target device {device} under torchrun: each rank takes cuda:LOCAL_RANK; "
                         f"give cuda or cpu, or leave it out")
    kind = torch.device(device).type if device else "cuda" if torch.cuda.is_available() else "cpu"
    return f"cuda:{local_rank}" if kind == "cuda" else "cpu"


class PeerFailure(RuntimeError):
    """Another rank ended the run; the message names it."""


def store_client() -> dist.TCPStore:
    """A connection of our own to the store torchrun serves (its agent on node 0, or rank 0)."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=timedelta(seconds=STORE_S))


class Heartbeat:
    """A thread that counts up this rank's key in the store every BEAT_S and reads every rank's. A
    rank whose count stops moving is silent: dead, stopped, or its node cut off. Silence is judged
    on this thread's own reads, so a stall of this process never makes the others look silent."""

    def __init__(self, prefix: str, rank: int, world: int):
        self.store = dist.PrefixStore(prefix, store_client())
        self.rank, self.world, self.store_lost = rank, world, False
        self.counts, self.moved, self.last = [None] * world, [time.monotonic()] * world, 0.0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, name="ssd-heartbeat", daemon=True)
        self.thread.start()

    def run(self):
        keys = [f"beat/{r}" for r in range(self.world)]
        while not self.stopped.is_set():
            try:
                self.store.add(keys[self.rank], 1)
                counts = [self.store.add(k, 0) for k in keys]  # adding 0 reads without waiting
            except Exception:  # the store's node is down or unreachable
                self.store_lost = True
                return
            self.last = now = time.monotonic()
            for r, c in enumerate(counts):
                if c != self.counts[r]:
                    self.counts[r], self.moved[r] = c, now
            self.stopped.wait(BEAT_S)

    def stop(self):
        """End the thread and wait for it (at most STORE_S, a store call's limit). A thread still
        inside a store call when the interpreter exits aborts the process: the call releases the
        GIL, and taking it back during finalization ends the thread through C++ frames that
        cannot unwind ("terminate called without an active exception")."""
        self.stopped.set()
        self.thread.join()

    def silent(self, after: float) -> list[int]:
        """The ranks that beat, then stopped `after` seconds (gather() names those never seen)."""
        return [r for r in range(self.world) if r != self.rank and self.counts[r]
                and self.last - self.moved[r] > after]


class TorchrunWorld(Ranks):
    """This rank's handle on a torchrun world: the process group over every rank of every node,
    and a heartbeat in torchrun's store that names a rank that dies, stops or loses its node. Rank
    0's stands where TPWorkers stands in the spawned form (TPVerifier's `workers`); the other ranks
    run serve_torchrun_rank. Each world takes a fresh prefix in the store, so that a process can
    start one after another (a script under torchrun that calls generate() again)."""

    def __init__(self, env: TorchrunEnv, target, device: str, timeout_s: float = TP_TIMEOUT_S):
        if env.max_restarts:  # torchrun would start a new world, and a decode cannot resume there
            raise ValueError(f"torchrun --max-restarts={env.max_restarts}: a decode cannot resume "
                             f"on a new world; use --max-restarts 0 (torchrun's default)")
        check_start(target, env.world, timeout_s)
        self.env, self.timeout_s, self.backend = env, timeout_s, tp_backend([device])
        self.tp, self.closing = TP(env.rank, env.world), False
        self.patience = max(SILENT_S, timeout_s)  # while loading, which may hold the GIL long
        # torchrun's agent on node 0 serves the store (without that agent rank 0 serves it here)
        t = timedelta(seconds=timeout_s)
        self.rendezvous, _, _ = next(dist.rendezvous("env://", timeout=t))
        # every rank counts itself in before it joins the group, so all count the same world
        prefix = f"ssd-tp/{(self.rendezvous.add('ssd-tp/worlds', 1) - 1) // env.world}/"
        self.store = dist.PrefixStore(prefix, store_client())
        self.store.set(f"where/{env.rank}", f"node {env.node}, {socket.gethostname()}")
        self.beat = Heartbeat(prefix, env.rank, env.world)
        try:  # a rank that failed before (its checkpoint, its GPU) is named after tp_timeout
            self.gather("here", timeout_s)  # where the process group's own wait names no one
            self.calls = tp_init(env.rank, env.world, dist.PrefixStore(prefix, self.rendezvous),
                                 self.backend, device, timeout_s)
        except BaseException:
            self.close()  # raises the line naming another rank, when one failed first
            raise
        if self.backend == "nccl":
            threading.Thread(target=self.watch, daemon=True).start()

    def gather(self, stage: str, timeout_s: float = math.inf):
        """Mark this rank at `stage` and wait until every rank is. A rank that failed or fell
        silent on its way raises here, naming it; so do the ranks still missing after timeout_s."""
        keys = [f"{stage}/{r}" for r in range(self.env.world)]
        self.store.set(keys[self.env.rank], "1")
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            msg = self.peer_failure()
            if not msg and time.monotonic() > deadline:
                missing = ", ".join(str(r) for r, k in enumerate(keys) if not self.store.check([k]))
                msg = (f"tensor-parallel rank {missing} did not start within tp_timeout="
                       f"{timeout_s:g}s: see the output on its node")
            if msg:
                raise PeerFailure(msg)
            time.sleep(0.05)

    def wait_ready(self):
        """Mark this rank loaded and wait for every rank (no time limit: a large checkpoint on a
        slow disk takes what it takes)."""
        self.gather("ready")
        self.patience = SILENT_S

    def watch(self):
        """NCCL's collectives spin on the GPU when a peer is gone: abort them (gloo's fail by
        themselves when the peer's sockets close, or after tp_timeout)."""
        while not self.closing:
            if self.beat.silent(self.patience) or self.beat.store_lost:
                dist.distributed_c10d._abort_process_group()
                return
            time.sleep(BEAT_S)

    def peer_failure(self, timed_out=False) -> str | None:
        """The line naming another rank that ended the run: the error it posted, else the ranks
        that fell silent; None while none is seen."""
        lost = ("tensor-parallel rank 0 (node 0) stopped answering, and so did torchrun's store on "
                "its node: rank 0's process died or node 0 went down")
        if self.beat.store_lost:
            return lost
        try:
            for r in range(self.env.world):
                if r != self.env.rank and self.store.check([f"error/{r}"]):
                    return "tensor-parallel " + self.store.get(f"error/{r}").decode()
            silent = {r: self.store.get(f"where/{r}").decode()
                      for r in self.beat.silent(self.patience)}
        except Exception:  # dist.DistStoreError: the store is gone
            return lost
        if not silent:
            return None
        ranks = ", ".join(f"{r} ({where})" for r, where in silent.items())
        if timed_out:
            return (f"tensor-parallel rank {ranks} did not answer within tp_timeout="
                    f"{self.timeout_s:g}s (stopped, hung or cut off; raise --tp-timeout if it was "
                    f"only slow)")
        return (f"tensor-parallel rank {ranks} stopped answering: its process died or stopped, or "
                f"its node went down")

    def failure(self, error) -> str | None:
        """After `error` ended this rank's part: the line naming the rank to blame when it was
        another one, else None. A dead rank falls silent a while after a collective fails."""
        if isinstance(error, PeerFailure):
            return str(error)
        if not isinstance(error, dist.DistError) and "gloo" not in str(error):
            return None  # not a collective's failure: this rank's own (or none)
        timed_out = "timed out" in str(error).lower()
        deadline = time.monotonic() + self.patience + 2 * BEAT_S + 1
        while not (msg := self.peer_failure(timed_out)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if msg is None and timed_out:
            msg = (f"a tensor-parallel collective timed out after tp_timeout={self.timeout_s:g}s "
                   f"while every rank still beats: one is hung (raise --tp-timeout if it was only "
                   f"slow)")
        return msg

    def close(self):
        """Leave the world. Rank 0 sends "stop" when the others wait for a call. A rank that fails
        on its own posts its error in the store, where the others find it and name it; a rank that
        fails because another one did raises the line naming that one."""
        self.closing = True
        error = sys.exc_info()[1]
        if self.env.rank == 0 and self.idle:
            with suppress(Exception):  # a rank is gone: named below
                broadcast_header(("stop", [], {}), self.calls)
        msg = self.failure(error)
        if error is not None and msg is None:  # this rank's own error: tell the others
            first = (str(error).strip().splitlines() or [""])[0]
            line = (f"rank {self.env.rank} was interrupted" if isinstance(error, KeyboardInterrupt)
                    else f"rank {self.env.rank} failed: {type(error).__name__}: {first}")
            with suppress(Exception):  # the store is gone too: the others see this rank fall silent
                self.store.set(f"error/{self.env.rank}", line)
        self.beat.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.calls = None  # the last reference to the calls' group: its gloo threads end
        if msg:
            raise PeerFailure(msg) from None


def serve_torchrun_rank(env: TorchrunEnv, target, device: str, dtype=None, threads=None,
                        timeout_s: float = TP_TIMEOUT_S):
    """Ranks 1.. of a torchrun world (run.py on every rank but 0): load this rank's slices of the
    target, then make rank 0's Verifier calls until it ends the run. Raises one line naming the
    rank that ended it, when that was another one."""
    if threads:
        torch.set_num_threads(threads)
    world = TorchrunWorld(env, target, device, timeout_s)
    try:
        model, _ = load_model(target, device=device, dtype=dtype, tp=world.tp, tokenizer=False)
        world.wait_ready()
        TPVerifier(model, calls=world.calls).serve()
    finally:
        world.close()
