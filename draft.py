"""The draft side of speculative decoding (SD): draft up to K tokens, follow the verifier's outcome.

Read in this order: `Proposals` (what a round hands the verifier), `DraftSettings` (how the draft
proposes) and `recorded_settings` (those a draft's checkpoint records), `Drafted` and `draft_k`
(its inner loop), `Row` (all the draft keeps about one sequence), `Drafter` (plain SD: prefill,
draft, follow the outcome), then `DraftConfig`, `load_draft` and the kinds of draft it dispatches
on (`draft_kind`, `CheckpointDraft`), whose build makes a Drafter or, for SSD,
speculator.Speculator. SSD's speculator (`Branches`, `Speculator`, `in_row_order`) lives in
speculator.py, read next: it builds on this file (a Drafter that pre-speculates), so this file
imports it only inside `CheckpointDraft.build`.

Invariant: a row's KV cache holds a prefix of its committed tokens + its proposals under
verification; the rest is unfed (`Row.unfed`: the last bonus t, the last proposal, a fast
backup's tokens), and the next forward feeds it first.

Used here before the reading order shows them: `draw`, `exp_noise`, `row_seed` and the rows'
settings (saguaro_sample.py), the model's `forward_cached`, `prefill`, `new_cache` and
`use_graphs` (model.py), the cache's `length`, `truncate`, `new_seq`, `register` and `free`
(kv_cache.py), `to_host` and `device_index` (devices.py).
"""
import dataclasses
import json
import numbers
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fallback import FAST_BACKUPS, POLICIES
from checkpoint import ALIASES, load_config, load_model, load_tokenizer, resolve
from cpu_linear import ROWS, use_forms
from devices import device_index, to_host
from kv_cache import PagedKVCache
from model import Transformer
from quantize import warm_up
from saguaro_sample import (draw, exp_noise, guess_probs_from_logits, row_seed,
                            row_settings, row_temperatures)
from spec_cache import check_fan_out
from spec_policy import PRE_SPEC


@dataclass
class Proposals:
    """One round's proposals for b rows: what the verifier needs to test them exactly. Row i
    proposes lengths[i] <= K tokens (K when every row drafts to the end; fewer where the draft
    stopped early, DraftSettings.confidence); its tokens past that are padding, never tested."""
    tokens: torch.Tensor         # [b, W] x_1..x_W, W = the longest row's length (<= K)
    q: torch.Tensor | None       # [b, W, V] the law each x_i was drawn from (q or Saguaro's q');
                                 #   None when every row is greedy: the test reads the tokens
    deterministic: torch.Tensor  # [b] bool: not drawn from q (greedy, n-gram, random): one-hot test
    hit: torch.Tensor            # [b] bool: answered from the speculation cache
    lengths: list[int]           # each row's proposal length (host data: it crosses as a list)


# row_seed's streams of a row's draft-side draws (verify.py's is 0): the draft's noise
# (Drafter.noise) and a random backup's tokens (speculator.py), numbered together to stay apart
NOISE_STREAM, RANDOM_STREAM = 1, 2


@dataclass(frozen=True)
class DraftSettings:
    """How the draft side proposes: generate()'s draft parameters in one object, handed unchanged
    to the Drafter or Speculator (speculator.py), the speculator's process and bench.py (which
    sweeps any field by name). Checked once, here. The fields from fan_out on are SSD's."""
    K: int = 4                  # the most draft tokens a round proposes (a row may stop sooner)
    # stop a row's proposal after the first token the draft gives a probability below this (its
    # law at T > 0, the T = 1 softmax at T = 0), as assisted generation's assistant_confidence_
    # threshold does; 0: always K. Exact: the draft's side decides, the verifier tests what came
    confidence: float = 0.0
    fan_out: str | list = "geometric"  # the rule (spec_cache.FAN_OUTS), or F_0..F_K given
    budget: int = 8             # the ceiling of B = sum_j F_j, branches per row per round: B
                                # adapts below it to the time a round has (SpecPolicy)
    saguaro_c: float = 1.0      # C: Saguaro's down-weighting of the likely bonus tokens
    fallback: str = "auto"      # on a miss: "neural", "ngram", "random" or "auto" (by b*)
    fast_fallback: str = "ngram"  # the backup "auto" switches to at batch sizes >= b*
    pre_spec: str = "always"    # "auto": only while it measures faster (PreSpecGate);
                                # "never": SD's schedule across the two processes (with
                                # fallback "auto"; a named backup proposes each round)
    fixed_budget: bool = False  # B stays `budget` (experiments); else it adapts to time

    def __post_init__(self):
        for ok, problem in (
                (isinstance(self.K, numbers.Integral) and 1 <= self.K <= 64,
                 f"k={self.K} is impossible: use 1 <= k <= 64 draft tokens per round"),
                (0 <= self.confidence < 1, f"confidence={self.confidence}: use a probability in "
                                           f"[0, 1) (0: the draft always proposes K tokens)"),
                (self.budget >= 1, f"budget={self.budget}: the fan-out budget B must be >= 1"),
                (0 <= self.saguaro_c <= 1, f"saguaro_c={self.saguaro_c}: C must be in [0, 1]"),
                (self.fallback in POLICIES, f"fallback={self.fallback!r}: use {POLICIES}"),
                (self.fast_fallback in FAST_BACKUPS,
                 f"fast_fallback={self.fast_fallback!r}: use {FAST_BACKUPS} (no draft model)"),
                (self.pre_spec in PRE_SPEC, f"pre_spec={self.pre_spec!r}: use {PRE_SPEC}")):
            if not ok:
                raise ValueError(problem)
        fan_out = check_fan_out(self.fan_out, self.K)
        object.__setattr__(self, "fan_out", fan_out)  # normalised once (frozen: never after)
        if isinstance(fan_out, list):
            object.__setattr__(self, "budget", sum(fan_out))  # an explicit one is its own budget


# The settings measured best for a draft with its target, which its checkpoint records in
# config.json under "speculation": DraftSettings' fields (K, confidence, ...) and "quant", the
# draft's weights (checkpoint.load_model's quant). generate() and run.py start from them, a value
# given still wins, and a draft that records none gets DraftSettings' defaults.
def recorded_settings(name) -> tuple[dict, str | None]:
    """The "speculation" entry of the local draft checkpoint `name` (a directory or an alias of
    one) -> ({DraftSettings field: value}, its "quant" or None); ({}, None) for anything else (a
    GGUF file, a model object, no entry)."""
    if not isinstance(name, (str, Path)):
        return {}, None
    config = Path(str(ALIASES.get(str(name), name))).expanduser() / "config.json"
    if not config.is_file():
        return {}, None
    settings = json.loads(config.read_text()).get("speculation", {})
    fields = {f.name for f in dataclasses.fields(DraftSettings)} | {"quant"}
    if not isinstance(settings, dict) or set(settings) - fields:
        raise ValueError(f"{config}: its \"speculation\" entry must map fields of "
                         f"draft.DraftSettings or \"quant\" to values, not {settings!r}")
    quant = settings.pop("quant", None)  # the draft's weights, not a DraftSettings field
    return settings, quant


@dataclass
class Drafted:
    """Draft steps so far for a batch of sequences. Step i feeds each sequence still drafting one
    token (its `first` tokens at i = 0, then x_i) and draws x_{i+1}; a proposal's last token is left
    to the caller's next forward. A sequence stops after K tokens or sooner (`stopped_at`)."""
    tokens: list = field(default_factory=list)  # per step i: x_{i+1} [b] (0 where stopped)
    q: list = field(default_factory=list)       # per step i: the law x_{i+1} came from [b, V]
    guess_probs: list = field(default_factory=list)  # per step i: `draw`'s guess_probs [b, V]
    stopped_at: list = field(default_factory=list)  # per sequence: the proposal length it
                                                    #   stopped at, early; None while drafting

    @property
    def steps(self) -> int:
        return len(self.tokens)

    def drafting(self) -> list[int]:
        """The sequences still drafting."""
        return [s for s, e in enumerate(self.stopped_at) if e is None]

    def lengths(self) -> list[int]:
        """Each sequence's proposal length so far."""
        return [self.steps if e is None else e for e in self.stopped_at]

    def rows(self, idx, which: list[int]) -> "Drafted":
        """These sequences' steps (idx: their positions as a device index, which: on the host)."""
        return Drafted([x[idx] for x in self.tokens], [x[idx] for x in self.q],
                       [x[idx] for x in self.guess_probs], [self.stopped_at[s] for s in which])

    def stack(self):
        """-> tokens [b, W], q [b, W, V], guess_probs [b, W, V], lengths (b ints), W the longest
        length: the steps these sequences took (SSD's hits: fewer than their batch of branches
        took, whose every step rows() keeps; a step past W would be verified as padding)."""
        lengths = self.lengths()
        W = max(lengths)
        return (torch.stack(self.tokens[:W], 1), torch.stack(self.q[:W], 1),
                torch.stack(self.guess_probs[:W], 1), lengths)


def draft_k(model: Transformer, cache: PagedKVCache, seqs, first, K, temperature, noise, *,
            F=None, c=1.0, confidence=0.0, stop=None, done: Drafted | None = None,
            of=None) -> Drafted:
    """Feed each sequence its `first` tokens (a list per row, e.g. [t] or [x_K, t]), then draft up
    to K tokens a step at a time, the sequences still drafting together. temperature: one float, or
    a tensor [b]; noise [n, K, V]: step i's is noise[:, i] (None when greedy), its row of[s] for
    sequence s (SSD's branches share their row's; None: row s). With F (K ints) and C < 1, step i
    samples Saguaro's q' (its set: the top F[i] + 1 tokens). confidence > 0: a sequence stops after
    a token its guess_probs give less (a host read per step). stop(step) -> True ends the drafting
    before that step (SSD: the outcome arrived); done continues an earlier call's steps."""
    d = done if done is not None else Drafted(stopped_at=[None] * len(seqs))
    while d.steps < K and d.drafting() and not (stop is not None and stop(d.steps)):
        i, live = d.steps, d.drafting()
        every = len(live) == len(seqs)
        at = None if every else device_index(live, model.device)  # the live rows' positions
        if i == 0:
            step_in, counts = [x for f in first for x in f], [len(f) for f in first]
        else:
            step_in, counts = d.tokens[i - 1], [1] * len(live)
            step_in = step_in if every else step_in.index_select(0, at)
        logits = model.forward_cached(cache, [seqs[s] for s in live], step_in, counts,
                                      last_only=True)                          # [live, V]
        e = None if noise is None else noise[:, i]                             # [n, V]
        e = e.index_select(0, of) if e is not None and of is not None else e    # [b, V]
        T = temperature
        if not every:
            e = None if e is None else e.index_select(0, at)                   # [live, V]
            T = T.index_select(0, at) if isinstance(T, torch.Tensor) else T
        x, q, probs = draw(logits, T, e, None if F is None else F[i], c)
        if not every:  # back to one slot per sequence; the stopped ones' are never read
            x = x.new_zeros(len(seqs)).index_copy_(0, at, x)
            q = q.new_zeros(len(seqs), q.shape[-1]).index_copy_(0, at, q)
            probs = probs.new_zeros(len(seqs), probs.shape[-1]).index_copy_(0, at, probs)
        d.tokens.append(x), d.q.append(q), d.guess_probs.append(probs)
        if confidence > 0 and i + 1 < K:
            sure = to_host(probs.gather(1, x[:, None]).squeeze(1) >= confidence)
            for s in live:
                d.stopped_at[s] = None if sure[s] else i + 1
    return d


@dataclass
class Row:
    """One sequence on the draft side: all the draft keeps about it, so a row can join or leave
    the batch alone (docs/design.md section 3 traces one; tests/test_speculator.py runs that
    trace). Its KV cache always holds a prefix of history + proposed; the rest is unfed
    (`unfed`), and the next forward feeds it first."""
    seq: int | None        # its sequence in the draft's KV cache (None once released)
    history: list[int]     # committed tokens: prompt + output
    proposed: list[int] = field(default_factory=list)  # x_1..x_L being verified ([] in between)
    # SSD only: q_0..q_m, the draft's guess_probs after history + x_1..x_j for every j whose
    # prefix the cache has fed (m = cached tokens - len(history); all `depths` of them, m = L,
    # once pre-speculation has fed the rest: `fed`): what its guesses at depth j rank by. None
    # while the cache lacks a committed token (after a fast backup proposed)
    guess_probs: torch.Tensor | None = None
    fast_backup: bool = False  # a fast backup (n-gram, random) proposed: it sets a for the fan-out
    temperature: float = 0.0   # the row's own
    seed: int = 0              # the row's own: its draws are keyed to it (Drafter.noise)
    drafts: int = 0            # proposal sets made for it so far: the next one's index d
    gen: torch.Generator | None = None  # reseeded for each of its draws (Drafter.noise)

    def unfed(self, cached: int) -> list[int]:
        """The tokens its KV cache lacks when the cache holds the first `cached` of history +
        proposed: the committed ones past them, then the proposals past them (no copy of all)."""
        return self.history[cached:] + self.proposed[max(0, cached - len(self.history)):]

    @property
    def depths(self) -> int:
        """L + 1: the depths j = 0..L its round can end at (x_1..x_j accepted). Once its cache
        has fed all its proposals, SSD holds one guess law per depth: guess_probs [L+1, V]."""
        return len(self.proposed) + 1

    def fed(self, laws: torch.Tensor):
        """SSD: its unfed tokens were just fed, laws [u, V] the draft's guess_probs after each.
        Appended to the laws it holds, the last `depths` are kept: q_0..q_L."""
        held = laws if self.guess_probs is None else torch.cat([self.guess_probs, laws])
        self.guess_probs = held[-self.depths:]

    def take(self, proposed: list[int], guess_probs=None, fast_backup=False):
        """New proposals for the round about to be verified (the draft's, a branch's or a fast
        backup's), with the guess_probs the cache now has for them."""
        self.proposed, self.guess_probs, self.fast_backup = proposed, guess_probs, fast_backup
        self.drafts += 1

    def commit(self, n: int, t: int):
        """The outcome (n accepted, bonus t): history grows by x_1..x_n, t; nothing is proposed."""
        self.history += self.proposed[:n] + [t]
        self.proposed = []


class Drafter:
    """Plain speculative decoding's draft: prefill, draft up to K tokens, follow the verifier's
    outcome."""

    def __init__(self, model: Transformer, spec: DraftSettings, temperature: float, seed: int,
                 kv_tokens: int, *, block_size=16, prefix_caching=False):
        self.model, self.spec, self.K, self.temperature = model, spec, spec.K, temperature
        # its own prefix cache (kv_cache.py): a prompt's blocks the draft has, whatever the target's
        self.cache = model.new_cache(kv_tokens, block_size, prefix_caching=prefix_caching)
        self.seeds = torch.Generator().manual_seed(seed)  # of rows that give no seed
        self.V = model.config.vocab_size
        self.rows: list[Row] = []

    def add(self, prompts: list[list[int]], *, first: int | None = None, temps=None, seeds=None):
        """Rows joining (at a round boundary: scheduler.py): cache their prompts; they are numbered
        on from the rows here, or from `first` (a speculator started anew after one died never saw
        the rows before it). temps, seeds: each row's (saguaro_sample.row_settings). Returns the
        draft's next-token probabilities [len(prompts), V] for them."""
        new = self.new_rows(prompts, first=first, temps=temps, seeds=seeds)
        logits = self.model.prefill(self.cache, [row.seq for row in new], prompts)
        self.rows += new
        return guess_probs_from_logits(logits, row_temperatures([r.temperature for r in new],
                                                                logits.device))

    def new_rows(self, prompts, *, first=None, temps=None, seeds=None) -> list[Row]:
        """The joining rows, each with an empty sequence in the cache (add's arguments); rows
        before `first` that this side never saw are None."""
        if first is not None:
            self.rows += [None] * (first - len(self.rows))
        temps, seeds = row_settings(len(prompts), temps, seeds, self.temperature, self.seeds)
        return [Row(self.cache.new_seq(), list(p), temperature=T, seed=s,
                    gen=torch.Generator(device=self.model.device))
                for p, T, s in zip(prompts, temps, seeds)]

    def unfed(self, row: Row) -> list[int]:
        """The tokens the row's KV cache lacks (Row.unfed), the next forward's first input."""
        return row.unfed(self.cache.length(row.seq))

    def keep_prefix(self, row: Row, tokens: int):
        """Cut the row's cache back to the first `tokens` of history + proposed (all it holds, if
        fewer): what it lacks of them is unfed, fed first by the next forward."""
        self.cache.truncate(row.seq, min(tokens, self.cache.length(row.seq)))

    def temperature_of(self, rows):
        """The temperature argument for these rows (saguaro_sample.row_temperatures)."""
        return row_temperatures([self.rows[r].temperature for r in rows], self.model.device)

    def noise(self, rows):
        """The Exp(1) noise [b, K, V] the rows' next proposals are drawn with (None when all are
        greedy): row r's from its seed and proposal index d alone (row_seed(seed, NOISE_STREAM, d)),
        so its tokens do not depend on the batch, and SSD's branch for the outcome that happens
        draws what its fallback would have."""
        if all(self.rows[r].temperature == 0 for r in rows):
            return None
        gens = [self.rows[r].gen.manual_seed(row_seed(self.rows[r].seed, NOISE_STREAM,
                                                      self.rows[r].drafts)) for r in rows]
        return exp_noise((len(rows), self.K, self.V), gens)

    def draft_rows(self, rows, *, F=None) -> Drafted:
        """Up to K tokens for each of the rows, from their committed tokens (what they have not fed
        goes in first), with their noise; F: Saguaro's sets (SSD)."""
        return draft_k(self.model, self.cache, [self.rows[r].seq for r in rows],
                       [self.unfed(self.rows[r]) for r in rows], self.K, self.temperature_of(rows),
                       self.noise(rows), F=F, c=self.spec.saguaro_c,
                       confidence=self.spec.confidence)

    def draft(self, rows: list[int]) -> Proposals:
        """Draft up to K tokens for the given rows (in SD the verifier waits for this)."""
        tok, q, _, lengths = self.draft_rows(rows).stack()
        for r, proposed, L in zip(rows, to_host(tok), lengths):
            self.rows[r].take(proposed[:L])
        greedy_rows = [self.rows[r].temperature == 0 for r in rows]
        return Proposals(tok, None if all(greedy_rows) else q,
                         torch.tensor(greedy_rows, device="cpu"),
                         torch.zeros(len(rows), dtype=torch.bool, device="cpu"), lengths)

    def commit(self, rows, n, t, features=None):
        """Follow the outcome (n accepted, bonus t): the committed sequence grows by x_1..x_n, t.
        The cache keeps the committed prefix it holds; the committed tokens it lacks (t, and the
        last proposal when all were accepted, since drafting never fed it) are unfed. features:
        the target's (Verifier.features), which only a draft that reads them uses (eagle.py)."""
        for r, (n_r, t_r) in zip(rows, to_host(torch.stack([n, t], 1))):
            row = self.rows[r]
            self.keep_prefix(row, len(row.history) + n_r)  # history, x_1..x_n
            row.commit(n_r, t_r)

    def release(self, rows):
        """Free the KV of rows that ended, after registering the full blocks of the committed tokens
        it holds (prefix caching: a chat's next turn starts with them)."""
        for r in rows:
            row = self.rows[r]
            self.cache.register(row.seq, row.history[:self.cache.length(row.seq)])
            self.cache.free(row.seq)
            row.seq = None

    def capture_seconds(self) -> float:
        """Seconds the draft has spent capturing CUDA graphs (decode.Captures)."""
        return self.model.capture_seconds()

    # -- continuous batching (scheduler.py): rows leave a running batch

    def leave(self, rows):
        """Rows that left (done or cancelled): their KV freed now, their history dropped."""
        self.release([r for r in rows
                      if self.rows[r] is not None and self.rows[r].seq is not None])
        for r in rows:
            self.rows[r] = None

    def used_blocks(self) -> int:
        """KV blocks in use (the server's /metrics)."""
        return self.cache.num_blocks - self.cache.num_free_blocks()

    def prefix_tokens(self) -> tuple[int, int]:
        """Prompt tokens looked up in the prefix cache, and found (the server's /metrics)."""
        return self.cache.prefix_queries, self.cache.prefix_hits


# --------------------------------------------------------------------------------------------------
# One loader for every mode

@dataclass
class DraftConfig:
    """What builds the draft side, here or in the speculator's process (it is pickled there)."""
    name: str                   # checkpoint directory, alias or GGUF file
    device: str
    dtype: torch.dtype
    spec: DraftSettings
    ssd: bool                   # a speculator.Speculator (SSD); else a Drafter (SD)
    temperature: float
    seed: int
    kv_tokens: int
    block_size: int = 16
    graphs: bool | None = None    # static shapes / CUDA graphs (Transformer.use_graphs)
    vocab_size: int | None = None  # the target's: a draft padded to another size is read over it
    compile: bool | None = None   # torch.compile the graphs' layers (Transformer.use_graphs)
    quant: str = "auto"           # its weights (checkpoint.load_model, quantize.py)
    prefix_caching: bool = False  # its cache's (kv_cache.py)
    # what the draft needs of the target (its kind's target_parts: an EAGLE head reads tokens
    # through the target's embedding module): the target's own tensors, which the speculator's
    # process receives in shared memory, not copied
    target_parts: dict | None = None


def load_draft(c: DraftConfig, *, arrived=None) -> Drafter:
    """The draft side c describes, built by its kind (draft_kind): a Drafter for SD, a
    speculator.Speculator for SSD (arrived: its)."""
    return draft_kind(c.name).build(c, arrived=arrived)


# --------------------------------------------------------------------------------------------------
# What a draft is: one object per kind that the engine, the speculator's process and bench ask
# (which target features it reads, whether it pairs with a target, what it needs of the target's
# weights, how its draft side is built). A new kind of draft is a class with these four members,
# and a line in draft_kind.

def draft_kind(name: str):
    """The kind of the draft `name` names: an EAGLE head's directory (eagle.EagleDraft), else a
    checkpoint of a small language model (CheckpointDraft)."""
    import eagle  # eagle.py builds on this file's Drafter
    try:
        path = resolve(name)
    except FileNotFoundError as e:  # say which of the two models it is
        raise FileNotFoundError(f"draft: {e}") from None
    return eagle.EagleDraft(name) if eagle.is_head(path) else CheckpointDraft(name)


@dataclass(frozen=True)
class CheckpointDraft:
    """A draft that is a language model of its own (HF directory, GGUF file, alias): it reads
    tokens only."""
    name: str
    feature_layers = None  # it reads none of the target's hidden states

    def target_parts(self, target) -> None:
        """Nothing of the target's weights: it has its own."""

    def check(self, target, cfg, tok):
        """It must speak the target's tokens: where both come with a tokenizer, the same token
        behind every id (a draft of another family with a vocabulary of the same size would be
        accepted less, silently), and the same vocabulary size unless the tokenizers agree
        (embeddings padded to other sizes: the draft's law is then read over the target's
        vocabulary, config.ModelConfig.padded_rows). target: its name or model; cfg, tok: its
        config and tokenizer."""
        V_draft = load_config(self.name).vocab_size
        same = not isinstance(target, Transformer) and resolve(self.name) == resolve(target)
        draft_tok = None if tok is None or same else load_tokenizer(self.name)
        if V_draft != cfg.vocab_size and draft_tok is None:
            raise ValueError(f"draft vocabulary ({V_draft}) differs from the target's "
                             f"({cfg.vocab_size}) and no pair of tokenizers says they share "
                             f"tokens: pick a draft from the same model family")
        if draft_tok is None:
            return  # a bare checkpoint (ids in, ids out): nothing more to compare
        ids = range(max(cfg.vocab_size, V_draft))
        for i, a, b in zip(ids, tok.convert_ids_to_tokens(ids),
                           draft_tok.convert_ids_to_tokens(ids)):
            if a != b:
                raise ValueError(f"the draft's tokenizer differs from the target's (token {i} is "
                                 f"{b!r} for the draft, {a!r} for the target): pick a draft made "
                                 f"with the target's tokenizer (scripts/distill_draft.py makes "
                                 f"one)")

    def build(self, c: DraftConfig, *, arrived=None) -> Drafter:
        model, _ = load_model(c.name, device=c.device, dtype=c.dtype, tokenizer=False,
                              vocab_size=c.vocab_size, quant=c.quant)
        use_forms(model, ROWS)  # the CPU's product forms for any rows a round drafts
        warm_up(model, range(1, c.spec.K + 2))  # quantized products: a step to a catch-up (K + 1)
        model.use_graphs(c.graphs, c.compile)
        kw = dict(block_size=c.block_size, prefix_caching=c.prefix_caching)
        if not c.ssd:
            return Drafter(model, c.spec, c.temperature, c.seed, c.kv_tokens, **kw)
        from speculator import Speculator  # it imports this file: imported here, no cycle
        return Speculator(model, c.spec, c.temperature, c.seed, c.kv_tokens, arrived=arrived,
                          **kw)
