"""The decode loops, one round per function: start reading here.

    sd_round    the draft proposes K tokens, the target verifies them in one forward (accept/reject
                plus a bonus token), the draft follows the outcome. AR is the same round with K = 0.
    ssd_round   the previous round's outcome arrives (cache hit: proposals ready; miss: fallback),
                the speculator pre-speculates the next round for guessed outcomes, the target
                verifies.

`decode_sd` and `decode_ssd` run rounds until every row is done. In SSD's two-process form the
speculator is channel.SpeculatorProcess: the same methods, run across the channel in another
process, so `pre_speculate` there overlaps `verify` here. The pieces: draft.py (Drafter,
Speculator), verify.py (Verifier, accept_reject), spec_cache.py (guesses), fallback.py (misses).
"""
import time

import torch

from draft import Proposals
from devices import device_index, sync, to_device, to_host


class Output:
    """Every mode's output: tokens per row, cut at EOS (kept) or max_new_tokens inside a round."""

    def __init__(self, b, max_new_tokens, eos_ids, K, stream=None):
        self.tokens = [[] for _ in range(b)]
        self.done = [False] * b
        self.max_new, self.eos, self.stream = max_new_tokens, set(eos_ids), stream
        self.rounds, self.row_rounds, self.accepted, self.proposed = 0, 0, 0, 0
        self.hist = [0] * (K + 1)  # rounds that accepted n = 0..K tokens
        self.tok_hit = self.rounds_hit = self.tok_miss = self.rounds_miss = 0
        self.verify_s = 0.0  # the target's verifications (the theory's c against SD's and AR's)
        self.capture_s = 0.0  # CUDA graph captures, left out of the decode time (Captures)

    def emit(self, row, new) -> bool:
        """Append tokens to a row; returns True when the row is done."""
        out = self.tokens[row]
        for x in new:
            out.append(x)
            if x in self.eos or len(out) >= self.max_new:
                self.done[row] = True
                break
        if self.stream:
            self.stream(row, out)
        return self.done[row]

    def first(self, t0) -> list[int]:
        """Emit each row's first token (from the verifier's prefill); returns the rows done."""
        return [r for r, t in enumerate(to_host(t0)) if self.emit(r, [t])]

    def round(self, rows, tokens, n, t, hit=None) -> list[int]:
        """Record one verified round (x_1..x_n and t per row); returns the rows that finished."""
        self.rounds += 1
        K = tokens.shape[1]
        # one read of the round's outcome and proposals: [b, 2 + K] = n, t, x_1..x_K per row
        host = to_host(torch.cat([n[:, None], t[:, None], to_device(tokens, n.device)], 1))
        hit = None if hit is None else hit.tolist()  # a host tensor
        finished = []
        for i, r in enumerate(rows):
            n_i, t_i, x = host[i][0], host[i][1], host[i][2:]
            self.row_rounds += 1
            self.accepted += n_i
            self.proposed += K
            self.hist[n_i] += 1
            if hit is not None and hit[i]:
                self.tok_hit, self.rounds_hit = self.tok_hit + n_i + 1, self.rounds_hit + 1
            elif hit is not None:
                self.tok_miss, self.rounds_miss = self.tok_miss + n_i + 1, self.rounds_miss + 1
            if self.emit(r, x[:n_i] + [t_i]):
                finished.append(r)
        return finished

    def active(self):
        return [r for r, d in enumerate(self.done) if not d]

    def stats(self, mode, prefill_s, decode_s):
        b, new = len(self.tokens), sum(len(x) for x in self.tokens)
        s = {"mode": mode, "batch": b, "new_tokens": new, "prefill_seconds": prefill_s,
             "decode_seconds": decode_s,
             # the first token of each row comes from the prefill; decode speed counts the rest
             "decode_tok_s": (new - b) / decode_s if decode_s > 0 else 0.0,
             "rounds": self.rounds, "verify_seconds": self.verify_s,
             "capture_seconds": self.capture_s,
             "mean_tokens_per_round": (new - b) / self.row_rounds if self.row_rounds else 0.0,
             "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
             "accept_len_histogram": self.hist}
        if mode == "ssd":
            s["tokens_per_round_hit"] = self.tok_hit / self.rounds_hit if self.rounds_hit else 0.0
            s["tokens_per_round_miss"] = (self.tok_miss / self.rounds_miss if self.rounds_miss
                                          else 0.0)
        return s


# --------------------------------------------------------------------------------------------------
# The clocks: what counts as prefill and as decoding on a GPU

def wait_for_devices(*results):
    """Wait until the devices of the prefills' results (None: a side with nothing here) have run
    them: GPU kernels run after the host queued them, and the prefill clock must not stop first."""
    for x in results:
        if x is not None:
            sync(x.device)


class Captures:
    """The seconds some sides (verifier, drafter, speculator; each has capture_seconds()) spent
    capturing CUDA graphs, read as increments. Each new shape's first step captures one (an eager
    run, the capture, syncs, the allocator's cache emptied): set-up, slower than many steps, which
    the decode clock leaves out and Output reports apart."""

    def __init__(self, *sides):
        self.sides = sides
        self.seen = self.total()

    def total(self) -> float:
        return sum(side.capture_seconds() for side in self.sides)

    def take(self) -> float:
        """The seconds captured since the last take (or since this was made)."""
        total = self.total()
        new, self.seen = total - self.seen, total
        return new


# --------------------------------------------------------------------------------------------------
# Speculative decoding (and AR)

def sd_round(verifier, drafter, rows):
    """One SD round for `rows`; returns the proposals, the outcome (n, t) and the seconds the
    verification took."""
    p = drafter.draft(rows)  # 1. the draft proposes x_1..x_K, one step at a time (the target waits)
    # 2. one target forward over [r, x_1..x_K] gives p_0..p_K; accept x_1..x_n, draw the bonus t
    captures, start = Captures(verifier), time.perf_counter()
    n, t = verifier.verify(rows, p.tokens, p.q, p.deterministic)
    # verify reads n on the host: the device is done; a graph it captured is not verification
    verify_s = time.perf_counter() - start - captures.take()
    drafter.commit(rows, n, t)  # 3. the draft follows: its cache keeps the accepted prefix
    return p, n, t, verify_s


class NoDraft:
    """Autoregressive decoding is SD with K = 0: no proposals, the bonus token is the next token."""

    def prefill(self, prompts):
        return None

    def draft(self, rows) -> Proposals:
        b = len(rows)
        return Proposals(torch.zeros(b, 0, dtype=torch.long, device="cpu"), None,
                         torch.ones(b, dtype=torch.bool, device="cpu"),
                         torch.zeros(b, dtype=torch.bool, device="cpu"))

    def commit(self, rows, n, t):
        pass

    def finish(self, rows):
        pass

    def capture_seconds(self) -> float:
        return 0.0


def decode_sd(verifier, drafter, prompts, out: Output):
    """ar (drafter: NoDraft) and sd: the draft and the target take turns in this process.
    Returns (prefill seconds, decode seconds)."""
    start = time.perf_counter()
    q0 = drafter.prefill(prompts)
    t0 = verifier.prefill(prompts)  # round 0: no proposals, its outcome is (0, t0)
    wait_for_devices(q0, t0)
    prefill_s, start = time.perf_counter() - start, time.perf_counter()
    captures = Captures(verifier, drafter)
    all_rows = list(range(len(prompts)))
    drafter.commit(all_rows, torch.zeros_like(t0), t0)  # n = 0, on t0's device
    finished = out.first(t0)
    while True:
        drafter.finish(finished)
        verifier.finish(finished)
        rows = out.active()
        if not rows:
            out.capture_s += captures.take()
            return prefill_s, time.perf_counter() - start - out.capture_s
        p, n, t, verify_s = sd_round(verifier, drafter, rows)
        out.verify_s += verify_s
        finished = out.round(rows, p.tokens, n, t)


# --------------------------------------------------------------------------------------------------
# Speculative speculative decoding

def ssd_round(verifier, speculator, rows, n, t, round_s):
    """One SSD round for `rows`, given the previous round's outcome (n, t) and the seconds the
    verifier spent on that round (verification and bookkeeping: the time pre-speculation had).
    Returns the proposals, the new outcome (n, t), the seconds the verifier waited for the
    speculator, and the time this verification started."""
    start = time.perf_counter()
    # 1. the outcome arrives: a hit answers from the branch pre-drafted for it, a miss asks the
    #    fallback
    p = speculator.respond(rows, n, t, round_s)
    # 2. guess this round's outcomes and draft the next round for each (in the two-process form this
    #    runs in the speculator's process, during step 3)
    speculator.pre_speculate(rows)
    wait_s, start = time.perf_counter() - start, time.perf_counter()
    n, t = verifier.verify(rows, p.tokens, p.q, p.deterministic)  # 3. as in sd_round
    return p, n, t, wait_s, start


def decode_ssd(verifier, speculator, prompts, out: Output):
    """ssd, one process (a Speculator) or two (a SpeculatorProcess).
    Returns (prefill seconds, decode seconds, seconds the verifier waited for proposals)."""
    start = time.perf_counter()
    b = len(prompts)
    q0 = speculator.prefill(prompts)  # None in two processes: the speculator prefills over there
    speculator.pre_speculate(list(range(b)))  # round 0's outcome is (0, t0): guess t0
    t0 = verifier.prefill(prompts)
    wait_for_devices(q0, t0)
    prefill_s, start = time.perf_counter() - start, time.perf_counter()
    ours, theirs = Captures(verifier), Captures(speculator)
    rows, n, t, verify_start, wait = list(range(b)), torch.zeros_like(t0), t0, None, 0.0
    finished = out.first(t0)
    while True:
        verifier.finish(finished)
        speculator.finish(finished)
        keep = [i for i, r in enumerate(rows) if not out.done[r]]
        if not keep:
            out.capture_s += ours.take()
            return prefill_s, time.perf_counter() - start - out.capture_s, wait
        if len(keep) < len(rows):  # the outcome of the rows still running, on its device
            idx = device_index(keep, n.device)
            rows, n, t = [rows[i] for i in keep], n.index_select(0, idx), t.index_select(0, idx)
        round_s = time.perf_counter() - verify_start if verify_start else None
        p, n, t, wait_s, verify_start = ssd_round(verifier, speculator, rows, n, t, round_s)
        # the speculator's captures held the verifier up only while it waited (in two processes a
        # capture can also overlap a verification); the verifier's own are all its time
        stalled, own = min(wait_s, theirs.take()), ours.take()
        wait, out.capture_s = wait + wait_s - stalled, out.capture_s + stalled + own
        out.verify_s += time.perf_counter() - verify_start - own
        finished = out.round(rows, p.tokens, n, t, p.hit)
