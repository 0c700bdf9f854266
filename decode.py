"""The decode loops, one round per function: start reading here.

    sd_round    the draft (draft.Drafter) proposes up to K tokens, the target verifies them in
                one forward (accept/reject plus a bonus token), the draft follows the outcome. AR
                is the same round with K = 0.
    ssd_round   the previous round's outcome arrives (cache hit: proposals ready; miss: fallback),
                the speculator (speculator.Speculator) pre-speculates the next round for guessed
                outcomes, the target verifies.

`SDRounds` and `SSDRounds` run these rounds over a batch whose rows join (`join`: their prompts
prefilled, their first token emitted) and leave (`leave`: their KV freed) between rounds;
scheduler.py decides who, and when (a static batch, generate()'s, joins once). In SSD's
two-process form the speculator is channel.SpeculatorProcess: the same methods, run across the
channel in another process, so `pre_speculate` there overlaps `verify` here. engine.py builds
both loops (which speculator, how many rows b, the processes' cores). Used here before the reading
order shows them: `verifier.features`, the target's layer outputs an EAGLE head drafts from
(verify.py; eagle.py says what they are), and `Proposals` (draft.py).

Reading order (the same in the README and docs/design.md; tests/test_docs.py keeps it so):
    a round     decode.py, draft.py, speculator.py, verify.py, spec_cache.py, spec_policy.py,
                saguaro_sample.py, fallback.py
    drafts      eagle.py
    around it   channel.py, scheduler.py, tp.py, engine.py, run.py
    the model   config.py, model.py, kv_cache.py, graphs.py, devices.py, quantize.py,
                huge_pages.py, cpu_kernels.py, cpu_linear.py, checkpoint.py, gguf_format.py
    serving     serve.py, protocol.py, metrics.py
    measuring   bench.py, bench_peers.py, bench_report.py, bench_serve.py
"""
from __future__ import annotations  # the rounds come first; what they record, Output, after

import time

import torch

from draft import Proposals
from devices import device_index, sync, to_device, to_host
from spec_cache import acceptance_trials


# --------------------------------------------------------------------------------------------------
# Speculative decoding (and AR)

def sd_round(verifier, drafter, rows):
    """One SD round for `rows`; returns the proposals, the outcome (n, t) and the seconds the
    verification took."""
    p = drafter.draft(rows)  # 1. the draft proposes up to K tokens, one step at a time (the
    #    target waits)
    # 2. one target forward over [r, x_1..x_L] gives p_0..p_L; accept x_1..x_n, draw the bonus t
    captures, start = Captures(verifier), time.perf_counter()
    n, t = verifier.verify(rows, p.tokens, p.q, p.deterministic, p.lengths)
    # verify reads n on the host: the device is done; a graph it captured is not verification
    verify_s = time.perf_counter() - start - captures.take()
    # 3. the draft follows: its cache keeps the accepted prefix (an EAGLE head also reads the
    #    target's features of the tokens just verified)
    drafter.commit(rows, n, t, verifier.features)
    return p, n, t, verify_s


class NoDraft:
    """Autoregressive decoding is SD with K = 0: no proposals, the bonus token is the next token."""

    def add(self, prompts, *, first=None, temps=None, seeds=None):
        return None

    def draft(self, rows) -> Proposals:
        b = len(rows)
        return Proposals(torch.zeros(b, 0, dtype=torch.long, device="cpu"), None,
                         torch.ones(b, dtype=torch.bool, device="cpu"),
                         torch.zeros(b, dtype=torch.bool, device="cpu"), [0] * b)

    def commit(self, rows, n, t, features=None):
        pass

    def leave(self, rows):
        pass

    def used_blocks(self) -> int:
        return 0

    def prefix_tokens(self):
        return None

    def capture_seconds(self) -> float:
        return 0.0


class SDRounds:
    """ar (drafter: NoDraft) and sd over a batch whose rows change between rounds: the draft and
    the target take turns in this process. scheduler.py decides who joins and leaves; a static
    batch joins once, at the start."""

    def __init__(self, verifier, drafter, out: Output):
        self.verifier, self.drafter, self.out = verifier, drafter, out
        self.rows: list[int] = []  # the rows the next round runs
        self.captures = Captures(verifier, drafter)

    def join(self, prompts, max_new_tokens: list[int], temps=None, seeds=None,
             eos_after=None) -> list[int]:
        """Prefill new rows (round 0: no proposals, its outcome is (0, t0)) and emit their first
        tokens; they run from the next round on. temps, seeds: each row's own (None: the sides'
        defaults, saguaro_sample.row_settings); eos_after: Output.add's. -> their row numbers."""
        new = self.out.add(max_new_tokens, eos_after)
        q0 = self.drafter.add(prompts, first=new[0], temps=temps, seeds=seeds)
        t0 = self.verifier.add(prompts, temps=temps, seeds=seeds)
        wait_for_devices(q0, t0)
        # n = 0, on t0's device; the features of the prompts' tokens (an EAGLE head's)
        self.drafter.commit(new, torch.zeros_like(t0), t0, self.verifier.features)
        self.out.first(new, t0)
        self.rows += new
        self.captures.take()  # a prefill's captures are not decoding's
        return new

    def leave(self, rows, tokens=None):
        """Rows that ended (EOS, max_new_tokens, a stop string, cancelled): KV freed now. tokens:
        each one's prompt and output (prefix caching registers the blocks they fill)."""
        gone = set(rows)
        self.drafter.leave(rows)
        self.verifier.leave(rows, tokens=tokens)
        self.rows = [r for r in self.rows if r not in gone]

    def kv_used(self) -> tuple[int, int]:
        """KV blocks in use: (the target's, the draft's)."""
        return self.verifier.used_blocks(), self.drafter.used_blocks()

    def prefix_tokens(self) -> tuple:
        """Prompt tokens looked up in each prefix cache and found: (the target's (looked up,
        found), the draft's or None)."""
        return self.verifier.prefix_tokens(), self.drafter.prefix_tokens()

    def check(self):
        """Nothing to check: both sides run in this process."""

    def round(self):
        p, n, t, verify_s = sd_round(self.verifier, self.drafter, self.rows)
        self.out.verify_s += verify_s
        self.out.round(self.rows, p, n, t)
        self.out.capture_s += self.captures.take()


# --------------------------------------------------------------------------------------------------
# Speculative speculative decoding

def ssd_round(verifier, speculator, rows, n, t, features, round_s):
    """One SSD round for `rows` (speculator: a speculator.Speculator, or its process), given the
    previous round's outcome (n, t) with the target's features of its tokens (an EAGLE head's; else
    None) and the seconds the verifier spent on that round (verification and bookkeeping: the time
    pre-speculation had). Returns the proposals, the new outcome (n, t), the seconds the verifier
    waited for the speculator, and the time this verification started; the new features are
    verifier.features.

    In two processes (channel.SpeculatorProcess) the same three steps overlap:
        verifier:     post (n, t) | wait | verify round k+1 ..................| post (n, t) ...
        speculator:   ........... | answer (hit or fallback) | pre-speculate round k+2 | answer
    `respond` posts the outcome and waits for the answer; the speculator's process sends the
    proposals, then pre-speculates (its `pre_speculate` here is a no-op) while this process
    verifies, and stops early if the next outcome arrives first."""
    start = time.perf_counter()
    # 1. the outcome arrives: a hit answers from the branch pre-drafted for it, a miss asks the
    #    fallback
    p = speculator.respond(rows, n, t, features=features, round_seconds=round_s)
    # 2. guess this round's outcomes and draft the next round for each (in the two-process form this
    #    runs in the speculator's process, during step 3)
    speculator.pre_speculate(rows)
    wait_s, start = time.perf_counter() - start, time.perf_counter()
    n, t = verifier.verify(rows, p.tokens, p.q, p.deterministic, p.lengths)  # 3. as in SD
    return p, n, t, wait_s, start


class SSDRounds:
    """ssd over a batch whose rows change between rounds, one process (a Speculator) or two (a
    SpeculatorProcess). The outcome (n, t) of each running row's last round is kept for the next
    ssd_round; a joining row's is (0, t0)."""

    def __init__(self, verifier, speculator, out: Output):
        self.verifier, self.speculator, self.out = verifier, speculator, out
        self.rows: list[int] = []
        self.n = self.t = None  # [len(rows)] the last outcome of each running row
        self.features = None    # per running row, the target's features of its last outcome's
                                #   tokens (a draft that reads them, eagle.py), else None
        self.verify_start, self.wait = None, 0.0  # wait: seconds the verifier waited for proposals
        self.ours, self.theirs = Captures(verifier), Captures(speculator)

    def join(self, prompts, max_new_tokens: list[int], temps=None, seeds=None,
             eos_after=None) -> list[int]:
        new = self.out.add(max_new_tokens, eos_after)
        # None in two processes: the speculator prefills over there
        q0 = self.speculator.add(prompts, first=new[0], temps=temps, seeds=seeds)
        if not self.rows:  # a batch starting from empty: round 0's outcome is (0, t0), guess t0
            self.speculator.pre_speculate(new)
        t0 = self.verifier.add(prompts, temps=temps, seeds=seeds)
        wait_for_devices(q0, t0)
        if self.verifier.features is not None:  # the prompts': the first outcome brings them
            self.features = (self.features or []) + self.verifier.features
        n0 = torch.zeros_like(t0)
        self.n = n0 if self.n is None else torch.cat([self.n, n0])
        self.t = t0 if self.t is None else torch.cat([self.t, t0])
        self.rows, self.verify_start = self.rows + new, None  # the next round_s is not a round's
        self.out.first(new, t0)
        self.ours.take(), self.theirs.take()  # a prefill's captures are not decoding's
        return new

    def leave(self, rows, tokens=None):
        gone = set(rows)
        self.verifier.leave(rows, tokens=tokens)
        self.speculator.leave(rows)
        keep = [i for i, r in enumerate(self.rows) if r not in gone]
        if len(keep) < len(self.rows):  # the outcome of the rows still running, on its device
            idx = device_index(keep, self.n.device)
            self.rows = [self.rows[i] for i in keep]
            self.n, self.t = self.n.index_select(0, idx), self.t.index_select(0, idx)
            if self.features is not None:
                self.features = [self.features[i] for i in keep]

    def kv_used(self) -> tuple[int, int]:
        """KV blocks in use: (the target's, the draft's: in two processes, as of its last
        message)."""
        return self.verifier.used_blocks(), self.speculator.used_blocks()

    def prefix_tokens(self) -> tuple:
        """As SDRounds' (the draft's: in two processes, as of its last message)."""
        return self.verifier.prefix_tokens(), self.speculator.prefix_tokens()

    def check(self):
        """Raise if the speculator's process has died (a server checks while idle, too)."""
        self.speculator.check()

    def restart(self, speculator):
        """A new speculator (its process died; engine.restart_speculator): the verifier frees every
        row it runs (their requests have ended with the error), the next join starts a batch."""
        self.verifier.leave(self.rows)
        self.speculator, self.rows, self.n, self.t = speculator, [], None, None
        self.features = None
        self.verify_start, self.theirs = None, Captures(speculator)

    def round(self):
        round_s = time.perf_counter() - self.verify_start if self.verify_start else None
        p, self.n, self.t, wait_s, self.verify_start = ssd_round(
            self.verifier, self.speculator, self.rows, self.n, self.t, self.features, round_s)
        self.features = self.verifier.features
        # the speculator's captures held the verifier up only while it waited (in two processes a
        # capture can also overlap a verification); the verifier's own are all its time
        stalled, own = min(wait_s, self.theirs.take()), self.ours.take()
        self.wait, self.out.capture_s = (self.wait + wait_s - stalled,
                                         self.out.capture_s + stalled + own)
        self.out.verify_s += time.perf_counter() - self.verify_start - own
        self.out.round(self.rows, p, self.n, self.t)


# --------------------------------------------------------------------------------------------------
# What the rounds record: tokens, counters, and the clocks

class Output:
    """Every mode's output: tokens per row, cut at EOS (kept) or the row's max_new_tokens inside a
    round. Rows are added as they join (`add`); a row's number is its place in every side's lists.
    A row's EOS ends it only once the row is longer than its eos_after (a server's min_tokens, or
    max_new_tokens for ignore_eos): before, the EOS is kept and the row goes on. Which tokens are
    drawn never changes: only where the row stops, so SD and SSD stay exact as they are.
    stream(row, tokens_so_far) is called as tokens are accepted; it may return True to end the row
    there (a stop string)."""

    def __init__(self, eos_ids, K, stream=None):
        self.tokens, self.done, self.max_new, self.eos_after = [], [], [], []
        self.eos, self.stream = set(eos_ids), stream
        self.rounds, self.row_rounds, self.accepted, self.proposed = 0, 0, 0, 0
        self.trials = 0  # spec_cache.acceptance_trials summed: accepted / trials is a's estimate
        self.new_tokens = 0  # every row's, including rows whose tokens were dropped (`forget`)
        self.hist = [0] * (K + 1)  # rounds that accepted n = 0..K tokens (K: the most proposed)
        self.tok_hit = self.rounds_hit = self.tok_miss = self.rounds_miss = 0
        self.verify_s = 0.0  # the target's verifications (the theory's c against SD's and AR's)
        self.capture_s = 0.0  # CUDA graph captures, left out of the decode time (Captures)

    def add(self, max_new_tokens: list[int], eos_after: list[int] | None = None) -> list[int]:
        """New rows, one per max_new_tokens (eos_after: each row's, default 0); -> their
        numbers."""
        first = len(self.tokens)
        self.tokens += [[] for _ in max_new_tokens]
        self.done += [False] * len(max_new_tokens)
        self.max_new += list(max_new_tokens)
        self.eos_after += list(eos_after or [0] * len(max_new_tokens))
        return list(range(first, len(self.tokens)))

    def forget(self, row):
        """Drop a row's tokens once its reader has them (a server runs for ever)."""
        self.tokens[row] = None

    def ended_at_eos(self, row, tokens) -> bool:
        """Whether an EOS ends the row whose tokens (so far) these are."""
        return bool(tokens) and tokens[-1] in self.eos and len(tokens) > self.eos_after[row]

    def emit(self, row, new) -> bool:
        """Append tokens to a row; returns True when the row is done."""
        out = self.tokens[row]
        for x in new:
            out.append(x)
            self.new_tokens += 1
            if self.ended_at_eos(row, out) or len(out) >= self.max_new[row]:
                self.done[row] = True
                break
        if self.stream and self.stream(row, out):
            self.done[row] = True
        return self.done[row]

    def first(self, rows, t0) -> list[int]:
        """Emit the new rows' first tokens (from the verifier's prefill); returns the rows done."""
        return [r for r, t in zip(rows, to_host(t0)) if self.emit(r, [t])]

    def round(self, rows, p: Proposals, n, t) -> list[int]:
        """Record one verified round (x_1..x_n and t per row; p: its proposals); returns the rows
        that finished."""
        self.rounds += 1
        # one read of the round's outcome and proposals: [b, 2 + W] = n, t, x_1..x_W per row
        host = to_host(torch.cat([n[:, None], t[:, None], to_device(p.tokens, n.device)], 1))
        hit = p.hit.tolist()  # a host tensor (SSD's; all False in SD)
        finished = []
        for i, (r, L) in enumerate(zip(rows, p.lengths)):
            n_i, t_i, x = host[i][0], host[i][1], host[i][2:]
            self.row_rounds += 1
            self.accepted += n_i
            self.proposed += L
            self.trials += acceptance_trials(n_i, L)
            self.hist[n_i] += 1
            before = self.new_tokens
            if self.emit(r, x[:n_i] + [t_i]):
                finished.append(r)
            got = self.new_tokens - before  # n_i + 1, or fewer where max_new_tokens cut the row
            if hit[i]:
                self.tok_hit, self.rounds_hit = self.tok_hit + got, self.rounds_hit + 1
            else:
                self.tok_miss, self.rounds_miss = self.tok_miss + got, self.rounds_miss + 1
        return finished

    def stats(self, mode, prefill_s, decode_s):
        b, new = len(self.tokens), self.new_tokens
        s = {"mode": mode, "batch": b, "new_tokens": new, "prefill_seconds": prefill_s,
             "decode_seconds": decode_s,
             # the first token of each row comes from the prefill; decode speed counts the rest
             "decode_tok_s": (new - b) / decode_s if decode_s > 0 else 0.0,
             "rounds": self.rounds, "verify_seconds": self.verify_s,
             "capture_seconds": self.capture_s,
             "mean_tokens_per_round": (new - b) / self.row_rounds if self.row_rounds else 0.0,
             # two ratios of the accepted tokens: over those proposed, and a, over the trials
             # (spec_cache.acceptance_trials: a proposal stopped at the first rejection), the
             # per-token acceptance that the fan-out and the docs call a
             "accepted_per_proposed": self.accepted / self.proposed if self.proposed else 0.0,
             "acceptance": self.accepted / self.trials if self.trials else 0.0,
             "proposed_tokens": self.proposed, "acceptance_trials": self.trials,
             "accept_len_histogram": self.hist}
        if mode == "ssd":
            s["tokens_per_round_hit"] = self.tok_hit / self.rounds_hit if self.rounds_hit else 0.0
            s["tokens_per_round_miss"] = (self.tok_miss / self.rounds_miss if self.rounds_miss
                                          else 0.0)
            # the sums behind them (bench adds them over batches): row-rounds that hit, and the
            # others (misses, and rounds that pre-speculated nothing)
            s["row_rounds_hit_miss"] = [self.rounds_hit, self.rounds_miss]
            s["tokens_hit_miss"] = [self.tok_hit, self.tok_miss]
        return s


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
