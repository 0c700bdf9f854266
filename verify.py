"""Verification: the target tests the draft's proposed tokens and emits n accepted ones + a bonus.

Read top to bottom:
1. `accept_reject`: the standard speculative-decoding test (Leviathan et al. 2023; Chen et al. 2023)
   as a pure function of the target's logits and the proposals, batched over rows. Each token is
   tested with the law it was drawn from (q, Saguaro's q', or one-hot for deterministic proposals),
   so the output follows the target's law exactly, whatever the draft did
   (docs/design.md section 9). Its steps follow it: `check_round` (the arguments),
   `greedy_accept` (temperature 0), `stochastic_accept` (the test u q < p) and `bonus` (the draw
   from the residual, or from p_L after all L accepts).
2. `Verifier`: the target with its paged KV cache. A round is one forward over [r, x_1..x_W] for
   every row at once, `accept_reject`, then a rollback (`truncate`) of the rejected tokens' K/V.

A row proposes L <= K tokens (K when the draft never stops early); a round's tensors are as wide
as its longest row, W, and a row's tokens past its L are padding that no test reads: it is tested
as a round of L proposals, so n <= L and, after L accepts, the bonus comes from p_L.

Used here before the reading order shows them: the model's `new_cache`, `prefill`,
`forward_cached` and `feature_layers` (model.py), the cache's `new_seq`, `length`, `truncate`,
`register` and `free` (kv_cache.py).
"""
import numbers

import torch

from devices import device_index, to_device, to_host
from saguaro_sample import (argmax, probs_from_logits, row_seed, row_settings, row_temperatures,
                            sample, uniform)

VERIFY_STREAM = 0  # row_seed's stream of a row's verifier draws (draft.py's are 1 and 2)


def accept_reject(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs,
                  deterministic, temperature, generator, *, lengths=None):
    """One round's verification outcome (n, t) for b rows.

    target_logits [b, K+1, V]: the target's logits p_0..p_K (p_i: its next-token law after x_i).
    draft_tokens  [b, K] long: x_1..x_K.
    draft_probs   [b, K, V] or None: the exact laws x_1..x_K were drawn from (q, or Saguaro's q').
        None when no row needs it (temperature 0, or every row deterministic).
    deterministic [b] bool: rows whose proposals were not sampled (greedy, n-gram, random): tested
        with a one-hot q at x_i; their draft_probs are ignored (may be garbage).
    temperature: one float for all rows, or a tensor [b] (one T >= 0 per row). A row at T = 0 has
        p one-hot at argmax: the test then accepts x_{i+1} iff it is the argmax (u q < 1 always,
        u q < 0 never) and the bonus is the argmax (the residual's only mass, or p_K itself):
        greedy_accept's outcome, through the sampled path.
    generator: torch.Generator on the tensors' device (unused at temperature 0), or one per row
        (a list of b): each row's uniforms and bonus then come from its own.
    lengths: b ints, each row's proposal length L <= K; its x_{L+1}.. are padding (None: every
        row proposed K).
    Returns n [b] long (accepted, 0..L) and t [b] long (the bonus); the round emits x_1..x_n, t.
    """
    draft_probs = check_round(target_logits, draft_tokens, draft_probs, deterministic, temperature)
    x = draft_tokens.long()
    b, K = x.shape
    lengths = [K] * b if lengths is None else list(lengths)
    L, proposed = K, True  # every row proposed K (AR, SD without a stop): nothing to mask
    if any(n != K for n in lengths):  # then the lengths cross to the device, and mask i >= L
        L = to_device(torch.tensor(lengths, device="cpu"), x.device)           # [b]
        proposed = torch.arange(K, device=x.device) < L[:, None]               # [b, K]: i < L
    if isinstance(temperature, numbers.Real) and temperature == 0:
        return greedy_accept(target_logits, x, proposed)
    p = probs_from_logits(target_logits, temperature)                          # [b, K+1, V] float32
    u = round_uniforms(b, K, lengths, generator).to(p.device)                  # [b, K]
    n = stochastic_accept(p, x, draft_probs, deterministic, u, proposed)       # [b]
    return n, bonus(p, x, n, L, draft_probs, deterministic, generator)


def check_round(target_logits, draft_tokens, draft_probs, deterministic, temperature):
    """accept_reject's arguments checked (a ValueError names the one that does not fit) -> the
    draft_probs to read: as given, or zeros [b, K, V] that are never read when it is None."""
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [b, K+1, V], "
                         f"got shape {list(target_logits.shape)}")
    b, K1, V = target_logits.shape
    K = K1 - 1
    if draft_tokens.shape != (b, K):
        raise ValueError(f"draft_tokens must be [b, K] = [{b}, {K}] to match target_logits, "
                         f"got {list(draft_tokens.shape)}")
    if deterministic.shape != (b,) or deterministic.dtype != torch.bool:
        raise ValueError(f"deterministic must be a bool tensor [b] = [{b}], "
                         f"got {deterministic.dtype} {list(deterministic.shape)}")
    per_row = isinstance(temperature, torch.Tensor)
    if per_row and (temperature.shape != (b,) or not temperature.dtype.is_floating_point):
        raise ValueError(f"per-row temperatures must be a float tensor [b] = [{b}], "
                         f"got {temperature.dtype} {list(temperature.shape)}")
    if not per_row and not (isinstance(temperature, numbers.Real) and temperature >= 0):
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    if draft_probs is None:
        if (per_row or temperature > 0) and K > 0 and not bool(deterministic.all()):
            raise ValueError("draft_probs is None but some rows were sampled: pass their laws q")
        return target_logits.new_zeros(()).expand(b, K, V)  # never read
    if draft_probs.shape != (b, K, V):
        raise ValueError(f"draft_probs must be [b, K, V] = [{b}, {K}, {V}], "
                         f"got {list(draft_probs.shape)}")
    return draft_probs


def leading_accepts(accepted: torch.Tensor) -> torch.Tensor:
    """[b, K] bool -> [b]: how many accepted before the first rejection."""
    return accepted.long().cumprod(-1).sum(-1)


def greedy_accept(target_logits, x, proposed):
    """Temperature 0: accept while x_{i+1} == argmax p_i (and was proposed: proposed [b, K], or
    True for all); the bonus is argmax p_n (a one-hot q passes exactly these). -> (n, t)."""
    K = x.shape[1]
    best = argmax(target_logits)                                               # [b, K+1]
    n = leading_accepts((x == best[:, :K]) & proposed)
    return n, best.gather(1, n[:, None]).squeeze(1)


def round_uniforms(b, K, lengths, generator):
    """The round's uniforms [b, K]: with one generator all at once; with one per row, row i's first
    lengths[i] from its own generator and 0 for its padding, so that a row draws as many as it
    proposed whatever the width of the batch (its tokens do not depend on its neighbours)."""
    if isinstance(generator, torch.Generator) or all(L == K for L in lengths):
        return uniform((b, K), generator)
    pad = torch.nn.functional.pad
    return torch.stack([pad(uniform((1, L), [g])[0], (0, K - L)) if L else
                        torch.zeros(K, device=g.device) for L, g in zip(lengths, generator)])


def stochastic_accept(p, x, draft_probs, deterministic, u, proposed):
    """The sampled test, p [b, K+1, V] the target's laws -> n [b]: accept x_{i+1} with probability
    min(1, p_i(x_{i+1}) / q_i(x_{i+1})): where u < that ratio, u [b, K] the round's uniforms
    (round_uniforms, drawn by accept_reject); a deterministic proposal has q_i(x_{i+1}) = 1;
    padding (proposed [b, K] false) is never accepted."""
    b, K = x.shape
    px = p[:, :K].gather(-1, x[..., None]).squeeze(-1)                         # [b, K]
    qx = draft_probs.float().gather(-1, x[..., None]).squeeze(-1)              # [b, K]
    qx = torch.where(deterministic[:, None], 1.0, qx)
    # u < p/q, written u q < p so that q = 0 needs no division; n counts the accepts before the
    # first rejection
    return leading_accepts((u * qx < px) & proposed)


def bonus(p, x, n, L, draft_probs, deterministic, generator):
    """The bonus token t [b]: from the residual norm(max(p_n - q_n, 0)) after a rejection (n < L),
    from p_L if all L were accepted. Draws one sample per row."""
    b, K = x.shape
    V = p.shape[-1]
    rows = torch.arange(b, device=p.device)
    p_n = p[rows, n]                                                           # [b, V]
    if K > 0:
        at = n.clamp(max=K - 1)  # row's q_n; rows with n = L are masked to q = 0 below
        q_n = torch.where(deterministic[:, None],
                          torch.nn.functional.one_hot(x[rows, at], V).float(),
                          draft_probs[rows, at].float())                      # [b, V]
        q_n = torch.where((n < L)[:, None], q_n, 0.0)
        residual = (p_n - q_n).clamp(min=0)
    else:
        residual = p_n
    # An all-zero residual needs p_n <= q_n everywhere, i.e. p_n == q_n in exact arithmetic, where
    # the test accepts surely; it can only come from float round-off, with tiny probability. Then
    # p_n is the law to sample (it is the residual's limit and the target's own distribution).
    empty = residual.sum(-1, keepdim=True) == 0                                # [b, 1]
    return sample(torch.where(empty, p_n, residual), generator)                # [b]


# --------------------------------------------------------------------------------------------------
# The verifier: the target model, its paged KV cache, one forward per round

class Verifier:
    """The target side. Its KV cache holds every committed token except the last bonus token r,
    which each round feeds first: one forward over [r, x_1..x_W] gives p_0..p_W for the whole
    round."""

    def __init__(self, model, temperature: float, seed: int, kv_tokens: int, *,
                 block_size: int = 16, prefix_caching: bool = False, reuse_cache: bool = False):
        # temperature: a joining row's unless it gives its own; seed: of the seeds drawn for rows
        # that give none
        self.model, self.temperature = model, temperature
        self.seeds = torch.Generator().manual_seed(seed)
        # reuse_cache: the model's own pool (Transformer.new_cache), for a model decoded with
        # again; prefix_caching: prompts share the blocks they start with (kv_cache.py)
        self.cache = model.new_cache(kv_tokens, block_size, reuse=reuse_cache,
                                     prefix_caching=prefix_caching)
        self.seqs: list[int | None] = []  # per row: its sequence in the cache (None once finished)
        self.last = None                   # [b] per row: r, the last bonus token, not yet cached
        self.temps: list[float] = []       # per row: its temperature
        self.gens: list = []               # per row: its generator (None once finished)
        # with a model that gives features (Transformer.want_features: an EAGLE draft reads them),
        # per row of the last add or verify: the features of the tokens its cache gained there
        # ([m, layers, hidden]: a prompt's tokens, or r, x_1..x_n), in the rows' order
        self.features: list | None = None

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """A static batch: the first rows of an empty verifier (`add` to an empty one)."""
        self.seqs, self.last, self.temps, self.gens = [], None, [], []
        return self.add(prompts)

    def add(self, prompts: list[list[int]], *, temps=None, seeds=None) -> torch.Tensor:
        """Rows joining (continuous batching: scheduler.py): cache their prompt tokens and draw each
        one's first token t0 (round 0: no proposals). They are numbered on from the rows already
        here; temps, seeds: each row's (saguaro_sample.row_settings: None, the defaults). Every
        draw of a row comes from its own generator, seeded from its seed. Returns t0
        [len(prompts)] of the new rows."""
        temps, seeds = row_settings(len(prompts), temps, seeds, self.temperature, self.seeds)
        gens = [torch.Generator(device=self.model.device).manual_seed(row_seed(s, VERIFY_STREAM))
                for s in seeds]
        new = [self.cache.new_seq() for _ in prompts]
        logits = self.model.prefill(self.cache, new, prompts)  # [b, V]
        if self.model.feature_layers:
            logits, self.features = logits
        b, V = logits.shape
        none = torch.zeros(b, 0, dtype=torch.long, device=logits.device)
        every = torch.ones(b, dtype=torch.bool, device=logits.device)  # nothing was sampled
        _, t0 = accept_reject(logits[:, None, :], none, None, every,
                              row_temperatures(temps, logits.device), gens)
        self.seqs, self.temps, self.gens = self.seqs + new, self.temps + temps, self.gens + gens
        self.last = t0.clone() if self.last is None else torch.cat([self.last, t0])
        return t0

    def verify(self, rows: list[int], tokens, q, deterministic, lengths: list[int]):
        """One round for `rows`: tokens [b, W] are the proposals (row i's first lengths[i] of them)
        and q [b, W, V] (or None) the laws they were drawn from, on any device (decode.py passes a
        draft.Proposals' fields). Returns (n [b], t [b]); the cache keeps r, x_1..x_n."""
        b, W = tokens.shape
        seqs = [self.seqs[r] for r in rows]
        start = [self.cache.length(s) for s in seqs]
        # the inputs cross before the forward, without blocking (after it, a blocking copy would
        # wait for the whole verification)
        dev = self.last.device
        idx, tokens, deterministic = (device_index(rows, dev), to_device(tokens, dev),
                                      to_device(deterministic, dev))
        q = None if q is None else to_device(q, dev)
        inp = torch.cat([self.last.index_select(0, idx)[:, None], tokens], 1)        # [b, W+1]
        logits = self.model.forward_cached(self.cache, seqs, inp.flatten(), [W + 1] * b)
        features = None
        if self.model.feature_layers:
            logits, features = logits
        logits = logits.view(b, W + 1, -1)                                          # [b, W+1, V]
        n, t = accept_reject(logits, inp[:, 1:], q, deterministic,
                             row_temperatures([self.temps[r] for r in rows], dev),
                             [self.gens[r] for r in rows], lengths=lengths)
        accepted = to_host(n)
        for s, L, n_r in zip(seqs, start, accepted):
            self.cache.truncate(s, L + 1 + n_r)  # the rejected tokens never happened
        if features is not None:  # r, x_1..x_n's
            features = features.view(b, W + 1, *features.shape[1:])  # [b, W+1, layers, hidden]
            self.features = [f[:n_r + 1] for f, n_r in zip(features, accepted)]
        self.last.index_copy_(0, idx, t)
        return n, t

    def capture_seconds(self) -> float:
        """Seconds the target has spent capturing CUDA graphs (decode.Captures)."""
        return self.model.capture_seconds()

    def release(self, rows):
        """Free the KV of rows that ended (EOS or max_new_tokens)."""
        for r in rows:
            self.cache.free(self.seqs[r])
            self.seqs[r] = self.gens[r] = None

    def leave(self, rows, *, tokens=None):
        """Rows that left the batch (done or cancelled): their KV freed now. tokens: each one's
        prompt and output so far (None: unknown), whose full blocks the cache holds are
        registered first (prefix caching: a chat's next turn starts with them)."""
        tokens = tokens if tokens is not None else [None] * len(rows)
        live = [(r, toks) for r, toks in zip(rows, tokens) if self.seqs[r] is not None]
        for r, toks in live:  # a row already freed keeps no blocks, and takes no one's tokens
            if toks is not None:
                s = self.seqs[r]
                self.cache.register(s, toks[:self.cache.length(s)])
        self.release([r for r, _ in live])

    def used_blocks(self) -> int:
        """KV blocks in use (the server's /metrics)."""
        return self.cache.num_blocks - self.cache.num_free_blocks()

    def prefix_tokens(self) -> tuple[int, int]:
        """Prompt tokens looked up in the prefix cache, and found (the server's /metrics)."""
        return self.cache.prefix_queries, self.cache.prefix_hits
