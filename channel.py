"""SSD's two-process form: the verifier in this process, the speculator in a spawned one.

`SpeculatorProcess` has the Speculator's methods (add, pre_speculate, respond, leave, stats), so
decode.SSDRounds runs the same round with either. Here `respond` sends the outcome (n, t) across
the channel and waits for the proposals; the speculator's process answers from its cache or
fallback, sends the proposals, then pre-speculates the next round while this process verifies.

The channel is a set of tensors in shared memory, allocated once before the spawn (page-locked when
a device is CUDA, so copies to and from the GPUs are direct), and two signals per round: nothing is
pickled on the per-round path (rows joining or leaving send one control message each, with
the joining prompts). Each message fills the first b slots of the buffers. A side waiting
for the other polls its signal for a while before it sleeps (`wait_for`'s spin).
"""
import os
import queue
import signal
import sys
import threading
import time
import traceback

import torch
import torch.multiprocessing as mp

from draft import DraftConfig, Proposals, load_draft
from devices import check_device, to_device


class Channel:
    """The shared tensors between the verifier and the speculator (b rows at most)."""

    def __init__(self, b, K, V, send_q: bool, pin: bool, spin: float = 0.0, feature_size: int = 0):
        def host(*shape, dtype=torch.long):  # host memory, whatever the default device
            return torch.zeros(*shape, dtype=dtype, device="cpu")
        self.count = host(1)                              # rows in the current message
        self.rows = host(b)                               # the verifier's row ids
        self.n = host(b)                                  # outcome: accepted count
        self.t = host(b)                                  # outcome: bonus token
        self.round_seconds = host(1, dtype=torch.float64)  # the verifier's last round
        self.stop = host(1, dtype=torch.bool)
        # set with each outcome (and stop), cleared when the speculator reads it: pre-speculation
        # polls it between steps (a shared flag costs nothing to read)
        self.posted = host(1, dtype=torch.bool)
        # proposals x_1..x_W (W <= K) and their laws, flat: a message's [b, W] and [b, W, V] are
        # contiguous at the start of them (as copies to a GPU need)
        self.tokens = host(b * K)
        self.width = host(1)                              # W, the longest row's length
        self.lengths = host(b)                            # each row's proposal length
        # their laws (temperature 0: not needed)
        self.q = host(b * K * V, dtype=torch.float32) if send_q else None
        self.deterministic = host(b, dtype=torch.bool)
        self.hit = host(b, dtype=torch.bool)
        # with each outcome, the target's features of the tokens each row's cache gained, for a
        # draft that reads them (eagle.py; feature_size: floats per token, its layers x hidden):
        # r, x_1..x_n, at most K + 1 tokens a row, [b, K + 1, feature_size] (SmolLM2-135M's three
        # layers at K = 4: 34.6 KB a row). A longer run (a prompt's, a row's first outcome)
        # crosses as a control message before the outcome (SpeculatorProcess.respond)
        self.K, self.feature_size = K, feature_size
        self.features = host(b * (K + 1) * feature_size, dtype=torch.float32) \
            if feature_size else None
        self.feature_counts = host(b)
        # the speculator's CUDA graph captures so far, sent with each answer (decode.Captures)
        self.capture_seconds = host(1, dtype=torch.float64)
        # control messages sent so far (rows joining or leaving, by `inbox`): they share the
        # outcome's signal, and the speculator takes one whenever it has handled fewer
        self.V = V
        self.controls = host(1)
        self.draft_blocks = host(1)  # KV blocks the draft uses, after each answer and control
        self.draft_prefix = host(2)  # prompt tokens its prefix cache looked up, found: per control
        for x in self.tensors():
            x.share_memory_()
        # signals: semaphores, each released by one side and acquired by the other. Not events: an
        # mp.Event guards its flag with a lock, and a process killed while holding it (inside set()
        # or wait()) would leave the other side blocked forever; a semaphore holds no lock
        ctx = mp.get_context("spawn")
        self.outcome_ready, self.proposals_ready = ctx.Semaphore(0), ctx.Semaphore(0)
        self.loaded = ctx.Semaphore(0)  # the speculator has its model: start the clocks only then
        self.pin, self.pinned = pin, False
        self.spin = spin  # seconds each side polls a signal before it sleeps on it (wait_for)

    def tensors(self):
        return [x for x in vars(self).values() if isinstance(x, torch.Tensor)]

    def pin_here(self):
        """Page-lock the buffers in this process (each process registers its own mapping)."""
        if not (self.pin and torch.cuda.is_available()):
            return
        cudart = torch.cuda.cudart()
        for x in self.tensors():
            rc = cudart.cudaHostRegister(x.data_ptr(), x.numel() * x.element_size(), 0)
            if rc != cudart.cudaError.success:
                raise RuntimeError(f"cudaHostRegister failed ({rc}) for the SSD channel")
        self.pinned = True

    def unpin_here(self):
        if self.pinned:
            cudart = torch.cuda.cudart()
            for x in self.tensors():
                cudart.cudaHostUnregister(x.data_ptr())
            self.pinned = False

    # -- verifier -> speculator
    def send_outcome(self, rows, n, t, round_seconds, features=None):
        """features: per row, the target's [c, layers, hidden] (c <= K + 1) or None (a longer run,
        sent as a control), or None for a draft that reads none."""
        b = len(rows)
        self.count[0] = b
        for i, f in enumerate(features or []):
            self.feature_counts[i] = -1 if f is None else len(f)
            if f is not None:
                at = i * (self.K + 1) * self.feature_size
                self.features[at:at + f.numel()].copy_(f.flatten())
        self.rows[:b] = torch.tensor(rows, dtype=torch.long, device="cpu")
        put(self.n, n), put(self.t, t)
        self.round_seconds[0] = round_seconds or 0.0
        flush(n.device, t.device)
        self.posted[0] = True
        self.outcome_ready.release()

    def send_stop(self):
        self.stop[0] = True
        self.posted[0] = True
        self.outcome_ready.release()

    def outcome(self):
        """(rows, n [b], t [b], verify seconds or None), as the verifier sent them."""
        b = int(self.count[0])
        self.posted[0] = False
        return (self.rows[:b].tolist(), self.n[:b].clone(), self.t[:b].clone(),
                float(self.round_seconds[0]) or None)

    def features_of(self, b: int, long: dict) -> list:
        """The outcome's features per row [c, layers * hidden] (copies): from the buffer, or from
        `long` (row position -> the run sent as a control) where the buffer held none."""
        per_row = self.features[:b * (self.K + 1) * self.feature_size].view(b, self.K + 1, -1)
        return [long.pop(i) if c < 0 else per_row[i, :c].clone()
                for i, c in enumerate(self.feature_counts[:b].tolist())]

    # -- speculator -> verifier
    def send_proposals(self, p: Proposals, capture_seconds: float = 0.0):
        b, W = p.tokens.shape
        self.width[0] = W
        pairs = [(self.tokens[:b * W].view(b, W), p.tokens), (self.deterministic, p.deterministic),
                 (self.hit, p.hit)]
        self.lengths[:b] = torch.tensor(p.lengths, dtype=torch.long, device="cpu")
        # a round of greedy rows has no q: the verifier tests them one-hot, never reading the
        # buffer's stale laws
        if self.q is not None and p.q is not None:
            pairs.append((self.q[:p.q.numel()].view(p.q.shape), p.q))
        for buf, x in pairs:
            put(buf, x)
        self.capture_seconds[0] = capture_seconds
        flush(*(x.device for _, x in pairs))
        self.proposals_ready.release()

    def proposals(self, b, device) -> Proposals:
        """The proposals on `device` (the verifier's; `hit` stays on the host, which reads it).
        On a GPU they cross without blocking from the page-locked buffers, which the speculator
        rewrites only after the next outcome, sent once this round's verification has been read
        on the host (so after these copies). On the CPU tokens and flags are copied out (a
        caller may keep them past the next message); q is read during verify only."""
        W = int(self.width[0])
        tokens, deterministic = self.tokens[:b * W].view(b, W), self.deterministic[:b]
        q = None if self.q is None else self.q[:b * W * self.V].view(b, W, self.V)
        if device.type == "cpu":
            tokens, deterministic = tokens.clone(), deterministic.clone()
        else:
            tokens, deterministic = to_device(tokens, device), to_device(deterministic, device)
            q = None if q is None else to_device(q, device)
        return Proposals(tokens, q, deterministic, self.hit[:b].clone(), self.lengths[:b].tolist())


def put(buf, x):
    """Copy x into the first len(x) slots of a shared buffer (asynchronous from a GPU)."""
    buf[:len(x)].copy_(x, non_blocking=True)


def flush(*devices):
    """Wait for the asynchronous copies out of every device a message came from (its tensors may
    sit on several: round 1's n and t, proposals on the draft's GPU with flags on the host),
    before the other side is signalled."""
    for device in set(devices):
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


def start_child(target, args) -> mp.Process:
    """Start target(*args) in a new, spawned Python process (a daemon: it cannot outlive us) and
    return it.

    1. The user's script is not run again in the child. To rebuild `target`, spawn first re-runs the
       parent's __main__ in the child; a script or notebook cell without
       `if __name__ == "__main__":` would then call generate() again, inside the child. The child
       needs only this project's modules (which `target`'s pickle names), so __main__'s file is
       hidden while the child starts, unless `target` itself lives in __main__ (a script that
       defines its child's function, as scripts/contention.py does, and guards its top level).
    2. The child ignores Ctrl-C from its first instruction (a Python started with SIGINT ignored
       keeps it so): the terminal's Ctrl-C reaches every process, but only this one decides how to
       stop, and a child interrupted while still importing torch would print a traceback. Only the
       main thread may change signal handlers; from another thread the child starts with the
       default handler."""
    proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    main = sys.modules["__main__"]
    hide = target.__module__ != "__main__"
    saved = main.__dict__.get("__file__"), main.__spec__
    in_main_thread = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main_thread else None
    try:
        if hide:
            # multiprocessing.spawn reads __main__.__spec__, then __file__
            main.__dict__.pop("__file__", None)
            main.__spec__ = None
        proc.start()
    finally:
        if hide:
            main.__spec__ = saved[1]
            if saved[0] is not None:
                main.__file__ = saved[0]
        if in_main_thread:
            signal.signal(signal.SIGINT, old)
    return proc


def quick_exit(code: int = 0):
    """End a child that finished its work without the interpreter's teardown of torch (seconds,
    which the parent would wait for). First multiprocessing's own exit finalizers, which a child
    that returns runs too: a semaphore created in this process (tqdm's lock, which torch's compiler
    creates) is unlinked and unregistered, not reported at exit as leaked."""
    from multiprocessing import util
    util._run_finalizers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_with_parent(parent_pid):
    """A child (a tensor-parallel rank) polls for its parent: if the parent was killed too hard to
    stop it, the child exits."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


def parent_gone(parent_pid, wait_s=2.0) -> bool:
    """Whether the parent ended, waiting up to wait_s: a killed process's connections close (a call
    its child waits in breaks off) a moment before its children pass to another parent."""
    deadline = time.time() + wait_s
    while os.getppid() == parent_pid and time.time() < deadline:
        time.sleep(0.02)
    return os.getppid() != parent_pid


def wait_for(signal_, alive, what, timeout=None, spin=0.0):
    """Acquire a signal (a semaphore the other side releases) while checking that the other side is
    alive (a dead peer must not hang us).

    For the first `spin` seconds poll it without sleeping. A process that sleeps through a wait of
    a few milliseconds (a verification, a fallback's drafting) is woken late and runs its next
    forward slower; the two sides of SSD wait for each other twice a round. In a one-off A/B on this
    project's 2-core CPU machine (temperature 1, batch 1, 8 paired runs), SSD that never
    pre-speculates (SD's schedule across two processes) ran at 0.88x SD in one process with both
    sides sleeping, 1.00x polling. Polling costs the waiting side's core, so the engine spins only
    when each side has cores of its own (engine.spin_seconds)."""
    start = time.perf_counter()
    while time.perf_counter() - start < spin:
        if signal_.acquire(False):
            return
    while not signal_.acquire(timeout=0.05):
        if not alive():
            raise RuntimeError(f"the {what} process died")
        if timeout and time.perf_counter() - start > timeout:
            raise RuntimeError(f"timed out waiting for the {what}")


# --------------------------------------------------------------------------------------------------
# The two sides

class SpeculatorProcess:
    """The verifier's handle on the speculator's process: speculator.Speculator's methods across
    the channel. Starts the process and waits until its draft is loaded; close() stops it and raises
    its error."""

    def __init__(self, cfg: DraftConfig, b: int, V: int, threads: int | None, pin: bool,
                 spin: float = 0.0, per_row: bool = False, feature_size: int = 0):
        # q crosses when a row may sample: at a temperature > 0, or whenever rows bring their
        # own (per_row: a server's requests); feature_size: Channel's
        self.ch = Channel(b, cfg.spec.K, V, send_q=cfg.temperature > 0 or per_row, pin=pin,
                          spin=spin, feature_size=feature_size)
        ctx = mp.get_context("spawn")
        self.inbox, self.errors = ctx.Queue(), ctx.Queue()
        self.ch.pin_here()
        self.proc = start_child(speculator_main, (cfg, threads, self.ch, self.inbox, self.errors))
        self.startup_s = time.perf_counter()
        try:  # process start-up and model load: not decode time
            wait_for(self.ch.loaded, self.proc.is_alive, "speculator")
        except BaseException:
            self.close()
            raise
        self.startup_s = time.perf_counter() - self.startup_s

    def add(self, prompts, *, first, temps=None, seeds=None):
        """Rows joining, numbered from `first`, with their temperatures and seeds (None: the
        speculator's defaults): these cross once (pickled: per request, not per round); the
        speculator prefills them and, when they start a batch, pre-speculates their round 0."""
        self.control(("add", (prompts, first, temps, seeds)))

    def leave(self, rows):
        """Rows that left: the speculator frees their KV and branches now."""
        if rows:
            self.control(("leave", list(rows)))

    def control(self, message):
        self.inbox.put(message)
        self.ch.controls[0] += 1
        self.ch.outcome_ready.release()

    def pre_speculate(self, rows):
        pass  # runs in the speculator's process right after it sends proposals, during verify

    def used_blocks(self) -> int:
        return int(self.ch.draft_blocks[0])

    def prefix_tokens(self) -> tuple[int, int]:
        return tuple(self.ch.draft_prefix.tolist())

    def check(self):
        if not self.proc.is_alive():
            raise RuntimeError("the speculator process died")

    def respond(self, rows, n, t, *, features=None, round_seconds=None) -> Proposals:
        if features is not None:  # runs longer than the buffer holds cross first, pickled
            long = {i: f.flatten(1).to("cpu") for i, f in enumerate(features)
                    if len(f) > self.ch.K + 1}
            if long:
                self.control(("features", long))
            features = [None if i in long else f for i, f in enumerate(features)]
        self.ch.send_outcome(rows, n, t, round_seconds, features)
        wait_for(self.ch.proposals_ready, self.proc.is_alive, "speculator", spin=self.ch.spin)
        return self.ch.proposals(len(rows), n.device)  # on the verifier's device, as n is

    def capture_seconds(self) -> float:
        """The speculator's graph captures so far, as of its last answer (decode.Captures)."""
        return float(self.ch.capture_seconds[0])

    def stats(self) -> dict:
        """Stop the speculator and collect its counters."""
        self.ch.send_stop()
        # before join: a full pipe blocks the child's exit
        kind, stats = self.report()
        if kind == "error":
            raise RuntimeError(f"speculator failed: {stats}")
        self.proc.join(timeout=30)
        return {**stats, "startup_seconds": self.startup_s}

    def report(self, wait_s: float = 30.0):
        """The child's last message, ("stats", counters) or ("error", text): waited for while it
        lives (30 s at most), then a one-line error (it died without one: killed, out of memory)."""
        deadline = time.monotonic() + wait_s
        while True:
            alive = self.proc.is_alive()
            try:
                return self.errors.get(timeout=0.1 if alive else 1.0)  # the dead's last words
            except queue.Empty:
                if not alive or time.monotonic() > deadline:
                    raise RuntimeError(f"the speculator process {'died' if not alive else 'hung'}"
                                       f" before reporting its counters") from None

    def close(self):
        """Stop the process however the run ended; raise its error unless the user interrupted."""
        if self.proc.is_alive():
            self.ch.send_stop()
            self.proc.join(timeout=2)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=2)
        self.ch.unpin_here()
        if self.proc.exitcode not in (0, None):
            msg = None
            while not self.errors.empty():
                kind, val = self.errors.get()
                msg = val if kind == "error" else msg
            if msg and sys.exc_info()[0] is not KeyboardInterrupt:
                raise RuntimeError(f"speculator failed: {msg}") from None


def speculator_main(cfg: DraftConfig, threads, ch: Channel, inbox, errors):
    """The speculator's process: load the draft, then handle each message: rows joining or leaving
    (controls), or an outcome to answer, after which it pre-speculates the next round."""
    try:
        if threads:
            torch.set_num_threads(threads)
        if torch.device(cfg.device).type == "cuda":
            # first: pinning creates a context on the current GPU. "cuda" alone has no index,
            # which set_device needs: check_device names the GPU it means
            torch.cuda.set_device(check_device(cfg.device))
        ch.pin_here()
        # pre-speculation stops when the outcome arrives: the verifier must not wait for branches
        # it will not use (speculator.Speculator.respond completes the one that hit)
        speculator = load_draft(cfg, arrived=lambda step: bool(ch.posted[0]))
        ch.loaded.release()
        parent = mp.parent_process()
        rows, handled = [], 0  # the running rows; controls handled so far
        long = {}  # the next outcome's features that crossed as a control (row position -> run)
        while True:
            wait_for(ch.outcome_ready, parent.is_alive, "verifier", spin=ch.spin)
            if handled < int(ch.controls[0]):  # a control (sent before any later outcome)
                handled += 1
                rows = control(speculator, receive(inbox, parent), rows, long)
                ch.draft_blocks[0] = speculator.used_blocks()
                ch.draft_prefix[:] = torch.tensor(speculator.prefix_tokens())
                continue
            if ch.stop[0]:
                break
            rows, n, t, round_seconds = ch.outcome()
            features = None
            if ch.features is not None:  # [c, layers * hidden] -> [c, layers, hidden]
                features = [f.view(len(f), -1, speculator.model.config.hidden_size)
                            for f in ch.features_of(len(rows), long)]
            proposals = speculator.respond(rows, n, t, features=features,
                                           round_seconds=round_seconds)
            ch.send_proposals(proposals, speculator.capture_seconds())
            speculator.pre_speculate(rows)  # the next round, while the verifier verifies this one
            ch.draft_blocks[0] = speculator.used_blocks()
        errors.put(("stats", speculator.stats()))
        errors.close()
        errors.join_thread()
        ch.unpin_here()
        quick_exit(0)
    except KeyboardInterrupt:
        pass
    except BaseException as e:  # reaches the user as one line; a bug's traceback goes to stderr
        if not isinstance(e, ValueError):  # (bad input says what to do in its line)
            traceback.print_exc()
        errors.put(("error", f"{type(e).__name__}: {e}"))
        sys.exit(1)


def receive(inbox, parent):
    """The next control message (put before its signal was released: it is on its way)."""
    while True:
        try:
            return inbox.get(timeout=0.1)
        except queue.Empty:
            if not parent.is_alive():
                raise RuntimeError("the verifier process died") from None


def control(speculator, message, rows, long: dict) -> list[int]:
    """Rows join (prefilled; a batch starting from empty pre-speculates its round 0, as
    decode.SSDRounds.join does in one process) or leave (KV and branches freed), or the next
    outcome's features too long for the buffer arrive (kept in `long`). -> the running rows."""
    kind, arg = message
    if kind == "features":
        long.update(arg)
        return rows
    if kind == "add":
        prompts, first, temps, seeds = arg
        new = list(range(first, first + len(prompts)))
        speculator.add(prompts, first=first, temps=temps, seeds=seeds)
        if not rows:
            speculator.pre_speculate(new)
        return rows + new
    gone = set(arg)
    speculator.leave(arg)
    return [r for r in rows if r not in gone]
