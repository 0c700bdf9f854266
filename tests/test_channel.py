"""The two-process channel (channel.py), without spawning: compact messages, no q at temperature 0,
and the page-locking calls a CUDA machine makes (checked against a fake cudart on the CPU)."""
import math
import os
import time
import pytest
import torch

import channel
from channel import Channel
from draft import Proposals

B, K, V = 4, 3, 11


def test_outcome_travels_for_a_subset_of_rows():
    ch = Channel(B, K, V, send_q=True, pin=False)
    ch.send_outcome([1, 3], torch.tensor([2, 0]), torch.tensor([7, 9]), 0.25)
    assert ch.outcome_ready.acquire(timeout=0) and not ch.outcome_ready.acquire(timeout=0)  # one signal
    rows, n, t, round_s = ch.outcome()
    assert rows == [1, 3] and n.tolist() == [2, 0] and t.tolist() == [7, 9] and round_s == 0.25
    ch.send_outcome([0, 1, 2], torch.tensor([1, 1, 1]), torch.tensor([4, 5, 6]), None)
    rows, n, t, round_s = ch.outcome()
    assert rows == [0, 1, 2] and t.tolist() == [4, 5, 6] and round_s is None  # round 0: not measured


def test_proposals_travel_and_are_not_aliased():
    ch = Channel(B, K, V, send_q=True, pin=False)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(V, (2, K), generator=g)
    q = torch.rand(2, K, V, generator=g)
    p = Proposals(tokens, q, torch.tensor([False, True]), torch.tensor([True, False]), [K, 1])
    ch.send_proposals(p)
    got = ch.proposals(2, torch.device("cpu"))
    assert torch.equal(got.tokens, tokens) and torch.equal(got.q, q)
    assert got.deterministic.tolist() == [False, True] and got.hit.tolist() == [True, False]
    assert got.lengths == [K, 1]
    ch.tokens.zero_()  # the next message must not change what the verifier already emitted
    assert torch.equal(got.tokens, tokens)
    # a narrower round (every row stopped early): [b, W] arrives as it left
    ch.send_proposals(Proposals(tokens[:, :2], q[:, :2], p.deterministic, p.hit, [2, 1]))
    got = ch.proposals(2, torch.device("cpu"))
    assert torch.equal(got.tokens, tokens[:, :2]) and torch.equal(got.q, q[:, :2])


def test_no_q_at_temperature_zero():
    """Greedy verification reads only the tokens: the [b, K, V] laws are neither allocated nor sent."""
    ch = Channel(B, K, V, send_q=False, pin=False)
    assert ch.q is None and all(x.numel() < B * K * V for x in ch.tensors())
    ch.send_proposals(Proposals(torch.ones(1, K, dtype=torch.long), None, torch.tensor([True]),
                                torch.tensor([False]), [K]))
    assert ch.proposals(1, torch.device("cpu")).q is None


class FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister; returns `rc` from register."""

    class cudaError:
        success = 0

    def __init__(self, rc=0):
        self.rc, self.registered, self.unregistered = rc, [], []

    def cudaHostRegister(self, ptr, size, flags):
        self.registered.append((ptr, size))
        return self.rc

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


def test_pinning_registers_every_buffer_once_and_unregisters(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    ch = Channel(B, K, V, send_q=True, pin=True)
    ch.pin_here()
    sizes = {x.data_ptr(): x.numel() * x.element_size() for x in ch.tensors()}
    assert dict(fake.registered) == sizes and len(fake.registered) == len(sizes)
    ch.unpin_here()
    ch.unpin_here()  # a second close unregisters nothing twice
    assert sorted(fake.unregistered) == sorted(sizes)


def test_pinning_failure_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(rc=1))
    with pytest.raises(RuntimeError, match="cudaHostRegister failed"):
        Channel(B, K, V, send_q=False, pin=True).pin_here()


def test_no_pinning_without_a_gpu_device(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    Channel(B, K, V, send_q=False, pin=False).pin_here()
    assert fake.registered == []


def test_flush_waits_only_for_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d: calls.append(d))
    channel.flush(torch.device("cpu"))
    assert calls == []


class Recorder:
    """Stands in for a message's tensors on a GPU (`put` is stubbed: only .device and len are read), for the
    CUDA streams (synchronize is logged) and for the signal (release is logged)."""

    def __init__(self, log, name, device=None, n=2, shape=None):
        self.log, self.name, self.device, self.n = log, name, device, n
        self.shape = shape or (n,)

    def numel(self):
        return math.prod(self.shape)

    def __len__(self):
        return self.n

    def synchronize(self):
        self.log.append(("synchronize", self.name))

    def release(self):
        self.log.append(("signal", self.name))


def test_an_outcome_is_signalled_only_after_every_device_it_came_from_is_flushed(monkeypatch):
    """Round 1's n (the zeros of round 0) and t (the verifier's t0) are copied out asynchronously; if they
    sat on different devices, waiting for n's alone would signal the speculator before t had arrived, and
    a spinning speculator would read a stale t0. Every device of the message is waited for first."""
    log = []
    monkeypatch.setattr(channel, "put", lambda buf, x: log.append(("put", x.name)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d: Recorder(log, str(d)))
    ch = Channel(B, K, V, send_q=False, pin=False)
    ch.outcome_ready = Recorder(log, "outcome")
    ch.send_outcome([0, 1], Recorder(log, "n", torch.device("cpu")), Recorder(log, "t", torch.device("cuda:0")),
                    None)
    assert log == [("put", "n"), ("put", "t"), ("synchronize", "cuda:0"), ("signal", "outcome")], log
    log.clear()
    ch.outcome_ready = Recorder(log, "outcome")
    ch.send_outcome([0, 1], Recorder(log, "n", torch.device("cuda:1")), Recorder(log, "t", torch.device("cuda:0")),
                    None)
    assert sorted(log[2:4]) == [("synchronize", "cuda:0"), ("synchronize", "cuda:1")] and log[4][0] == "signal"


def test_proposals_are_signalled_after_every_device_is_flushed(monkeypatch):
    log = []
    monkeypatch.setattr(channel, "put", lambda buf, x: log.append(("put", x.name)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d: Recorder(log, str(d)))
    ch = Channel(B, K, V, send_q=True, pin=False)
    ch.proposals_ready = Recorder(log, "proposals")
    host, gpu = torch.device("cpu"), torch.device("cuda:1")
    ch.send_proposals(Proposals(Recorder(log, "tokens", gpu, shape=(2, K)), Recorder(log, "q", gpu, shape=(2, K, V)),
                                Recorder(log, "det", host), Recorder(log, "hit", host), [K, K]),
                      capture_seconds=1.5)
    assert log[-2:] == [("synchronize", "cuda:1"), ("signal", "proposals")], log
    assert float(ch.capture_seconds[0]) == 1.5  # the speculator's graph captures travel with its answer


def test_proposals_arrive_on_the_verifiers_device():
    """Tokens, q and the deterministic flags cross to the verifier's device (meta stands in for a GPU here);
    the hit flags, which only the host reads, stay there."""
    ch = Channel(B, K, V, send_q=True, pin=False)
    ch.send_proposals(Proposals(torch.ones(2, K, dtype=torch.long), torch.rand(2, K, V), torch.tensor([True, False]),
                                torch.tensor([False, True]), [K, K]))
    got = ch.proposals(2, torch.device("meta"))
    assert got.tokens.device.type == got.q.device.type == got.deterministic.device.type == "meta"
    assert got.hit.device.type == "cpu" and got.hit.tolist() == [False, True]


class CountingSignal:
    """A semaphore stand-in that is released after `ready_after` polls and records how it is acquired."""

    def __init__(self, ready_after):
        self.ready_after, self.polls, self.sleeps = ready_after, 0, 0

    def acquire(self, block=True, timeout=None):
        if block:
            self.sleeps += 1  # a blocking call: the process would sleep here
        else:
            self.polls += 1
        return self.polls + self.sleeps > self.ready_after


def test_wait_for_polls_before_it_sleeps():
    """With a spin budget the signal is taken by polling and the process never sleeps; without one it
    sleeps at once (a blocking acquire with a timeout, so that a dead peer is noticed)."""
    sig = CountingSignal(ready_after=1000)
    channel.wait_for(sig, lambda: True, "test", spin=5.0)
    assert sig.polls == 1001 and sig.sleeps == 0
    sig = CountingSignal(ready_after=0)
    channel.wait_for(sig, lambda: True, "test")
    assert sig.polls == 0 and sig.sleeps == 1


def test_wait_for_notices_a_dead_peer_after_spinning():
    sig = CountingSignal(ready_after=10**12)
    with pytest.raises(RuntimeError, match="the test process died"):
        channel.wait_for(sig, lambda: False, "test", spin=0.01)
    assert sig.polls > 0 and sig.sleeps == 1


def test_spin_only_where_each_side_has_its_own_cores():
    from engine import SPIN_S, spin_seconds
    assert spin_seconds(2, 1, 1, 1, "cpu", "cpu") == SPIN_S > 0          # 1 + 1 threads on 2 cores
    assert spin_seconds(1, 1, 1, 1, "cpu", "cpu") == 0                   # one core: polling steals it
    assert spin_seconds(4, 1, 3, 2, "cpu", "cpu") == 0                   # oversubscribed
    assert spin_seconds(4, 2, 1, 1, "cpu", "cpu") == SPIN_S              # two CPU ranks + the draft
    assert spin_seconds(2, 1, 8, 8, "cuda:0", "cuda:1") == SPIN_S        # a thread each on the host


def child_that_makes_a_lock(names, quick):
    """A finished child as the speculator and the TP ranks end: a semaphore made here (as tqdm's lock,
    which torch's compiler creates in the speculator), its name sent home, then the quick exit."""
    import multiprocessing
    lock = multiprocessing.get_context("spawn").RLock()
    names.put(lock._semlock.name)
    names.close()
    names.join_thread()
    channel.quick_exit(0) if quick else os._exit(0)


@pytest.mark.parametrize("quick", [True, False])
def test_a_child_that_exits_quickly_leaves_no_semaphore_behind(quick):
    """quick_exit skips the interpreter's teardown but not multiprocessing's finalizers: a semaphore the
    child created is unlinked (else the resource tracker reports it leaked at exit). The control, a bare
    os._exit, leaves it to be found (and removed here)."""
    import _multiprocessing
    import multiprocessing
    names = multiprocessing.get_context("spawn").Queue()
    proc = channel.start_child(child_that_makes_a_lock, (names, quick))
    name = names.get(timeout=60)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    try:
        _multiprocessing.sem_unlink(name)  # succeeds only if the child left it
        left = True
    except FileNotFoundError:
        left = False
    if not quick:
        from multiprocessing import resource_tracker
        resource_tracker.unregister(name, "semaphore")  # the tracker need not report the control's
    assert left is not quick


def test_a_speculator_that_died_before_its_counters_is_one_error():
    """SpeculatorProcess.stats waits for the child's last message while it lives; one that died
    without it (killed, out of memory) is a one-line RuntimeError within a second or so, not 30 s
    and a queue.Empty traceback. A dead child's last message is still read."""
    import queue
    from types import SimpleNamespace
    from channel import SpeculatorProcess
    dead = SimpleNamespace(proc=SimpleNamespace(is_alive=lambda: False), errors=queue.Queue())
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="speculator process died before reporting"):
        SpeculatorProcess.report(dead)
    assert time.monotonic() - start < 5
    dead.errors.put(("stats", {"hits": 1}))
    assert SpeculatorProcess.report(dead) == ("stats", {"hits": 1})
