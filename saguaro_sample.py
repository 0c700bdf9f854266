"""Sampling for the draft and the verifier: logits -> probabilities, seeded sampling, Saguaro
sampling (the paper's Definition 14), which moves probability off the cached guesses so that
rejections land on them, and `draw`, one draft token per row with the law it came from.

Pure functions on torch tensors, batched over any leading dims ([..., V]), float32 math, randomness
only from explicit torch.Generators (never the global RNG): a run is reproducible from its seed.
Each row of a batch may have its own temperature (a tensor [b] instead of a float) and its own
generator (a list of b generators instead of one): a row's draws then come from its generator alone,
so a seeded request samples the same tokens whatever else is in the batch (docs/design.md
section 7, Serving).
"""
import math
import numbers

import numpy as np
import torch

from devices import to_device


def probs_from_logits(logits: torch.Tensor, temperature) -> torch.Tensor:
    """softmax(logits / T) in float32, [..., V]. T = 0 gives the one-hot of argmax (ties -> lowest
    index, as torch.argmax): greedy decoding is the temperature-0 case of the same code path.
    temperature: one float for every row, or a tensor [b] (b = logits.shape[0]), one T per row."""
    logits = logits.float()  # softmax over 150k tokens needs float32 to keep small masses
    if isinstance(temperature, torch.Tensor):
        if temperature.shape != logits.shape[:1] or not temperature.dtype.is_floating_point:
            raise ValueError(f"per-row temperatures must be a float tensor [b] = "
                             f"[{logits.shape[0]}], got {temperature.dtype} "
                             f"{list(temperature.shape)}")
        T = temperature.float().view(-1, *[1] * (logits.dim() - 1))           # [b, 1, ..]
        soft = torch.softmax(logits / torch.where(T > 0, T, 1.0), dim=-1)
        return torch.where(T > 0, soft, one_hot_argmax(logits))
    if not (isinstance(temperature, numbers.Real) and temperature >= 0):
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    if temperature == 0:
        return one_hot_argmax(logits)
    return torch.softmax(logits / temperature, dim=-1)


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1), the same index (the first largest; NaN counts as largest, as torch's), found
    by blocks on a CPU: torch's CPU argmax reads one element at a time (about 100 us for a row of
    49,152 on a Xeon core, 0.4 ms for a verification's 4 rows, 3-4% of it), while a max over
    blocks vectorises: the first block holding the largest, then the index inside it (30 and 75
    us). Elsewhere torch's, and on a CPU for rows under 16,384 or with no block of at least 64
    that divides them (there the blocks' extra calls cost more than they save)."""
    V = x.shape[-1]
    C = math.gcd(V, 512)  # the block: a power of two that divides V
    if x.device.type != "cpu" or V < 16384 or C < 64:
        return x.argmax(-1)
    blocks = x.unflatten(-1, (V // C, C))                                    # [..., V/C, C]
    first = blocks.amax(-1).argmax(-1)                                       # [...]
    inside = blocks.gather(-2, first[..., None, None].expand(*first.shape, 1, C))  # [..., 1, C]
    return first * C + inside.squeeze(-2).argmax(-1)


def row_temperatures(temps: list[float], device):
    """The temperature argument for rows at temps: the one float when they agree (every static
    batch: the same arithmetic as one temperature), else a tensor [b] on `device` (from the host
    without blocking)."""
    if len(set(temps)) <= 1:
        return temps[0] if temps else 0.0
    return to_device(torch.tensor(temps, dtype=torch.float32, device="cpu"), device)


def row_seed(seed: int, *stream: int) -> int:
    """A 63-bit seed for one stream of a row's draws (stream: which side, which round), from the
    row's seed: numpy's SeedSequence mixes them, so streams of nearby seeds are unrelated."""
    words = np.random.SeedSequence([seed % 2**64, *stream]).generate_state(2, np.uint32)
    return (int(words[0]) << 31 ^ int(words[1])) & (2**63 - 1)


def rows_of(shape, generator, draw) -> torch.Tensor:
    """`draw(tensor, generator)` filling a new float32 tensor of `shape`, on the generator's device:
    with one generator, all at once; with a list of shape[0] generators, row i from generator[i]."""
    if isinstance(generator, torch.Generator):
        return draw(torch.empty(shape, device=generator.device), generator)
    if len(generator) != shape[0]:
        raise ValueError(f"{len(generator)} generators for {shape[0]} rows: give one per row")
    if not generator:
        return torch.empty(shape, device="cpu")
    return torch.stack([draw(torch.empty(shape[1:], device=g.device), g) for g in generator])


def uniform(shape, generator) -> torch.Tensor:
    """U[0, 1) draws of `shape` (generator: one, or one per row)."""
    return rows_of(shape, generator, lambda x, g: x.uniform_(generator=g))


def exp_noise(shape, generator) -> torch.Tensor:
    """Exp(1) draws of `shape`, float32 (never exactly 0; generator: one, or one per row)."""
    e = rows_of(shape, generator, lambda x, g: x.exponential_(generator=g))
    return e.clamp_min_(torch.finfo(torch.float32).tiny)


def sample(probs: torch.Tensor, generator, noise=None) -> torch.Tensor:
    """One token per row of probs [..., V] (>= 0 with a positive sum, not necessarily normalised):
    argmax(probs / E) with E ~ Exp(1) i.i.d. per entry (the exponential race: token x wins with
    chance probs(x) / sum(probs); a zero-probability token never wins, so a one-hot row gives its
    token whatever E is). Returns LongTensor [...].

    noise: E, given (shape of probs) or drawn here with `generator` (one, or one per row). Drawn
    apart from probs, it lets the draft key its noise to a row's round (draft.Drafter.noise), so
    SSD's branches and its fallback draw a round's tokens alike."""
    if noise is None:
        noise = exp_noise(probs.shape, generator)
    return argmax(probs.float() / noise)


def saguaro(q: torch.Tensor, f, c: float) -> torch.Tensor:
    """Saguaro's q' from the draft's own distribution q [..., V] (Definition 14):

        q'(x) = C q(x) / Z on S = the top f+1 tokens of q,   q(x) / Z elsewhere,

    f = F_j (an int, or an integer tensor of shape q.shape[:-1], one F per row), C in [0, 1].
    Returns float32 [..., V] (q itself when C = 1). f+1: the F_j guesses exclude the drafted token,
    normally one of the top F_j+1. S comes from torch.topk, as spec_cache's guesses (same ties)."""
    if not (isinstance(c, numbers.Real) and 0 <= c <= 1):
        raise ValueError(f"Saguaro constant C must be a number in [0, 1] (1 = plain sampling), "
                         f"got {c!r}")
    if isinstance(f, torch.Tensor):
        if f.dtype.is_floating_point or f.dtype == torch.bool:
            raise ValueError(f"f (F_j per row) must be an integer tensor, got dtype {f.dtype}")
        if f.numel() and int(f.min()) < 0:
            raise ValueError("f (F_j per row) must be >= 0 in every row")
        f_max = int(f.max()) if f.numel() else 0
    elif isinstance(f, numbers.Integral) and not isinstance(f, bool):
        if f < 0:
            raise ValueError(f"f (F_j, guesses at this depth) must be >= 0, got {f}")
        f_max = int(f)
    else:
        raise ValueError(f"f (F_j) must be an int or an integer tensor, got {type(f).__name__}")
    if c == 1:
        return q
    q = q.float()
    V = q.shape[-1]
    k = min(f_max + 1, V)
    top = q.topk(k, dim=-1).indices                                      # [..., k] descending
    if isinstance(f, torch.Tensor):
        # rows with a smaller F scale only their first f+1 of the k candidates
        in_set = torch.arange(k, device=q.device) < (f.to(q.device).unsqueeze(-1) + 1)  # [..., k]
        scale = torch.where(in_set, c, 1.0)
    else:
        scale = c
    scaled = q.scatter(-1, top, q.gather(-1, top) * scale)              # [..., V]
    Z = scaled.sum(-1, keepdim=True)                                     # [..., 1]
    # Z = 0 (C = 0, no mass outside S): q' is 0/0; keep q, its limit as C -> 0. Exact either way:
    # the verifier tests with whatever law the draft sampled from.
    return torch.where(Z > 0, scaled / torch.where(Z > 0, Z, 1.0), q)


def row_settings(n: int, temps, seeds, temperature: float, seeder: torch.Generator):
    """n joining rows' (temperatures, seeds): each row's own where given (temps, seeds: lists with
    None for a row that gives none, or None for all), else the default `temperature` and a seed
    drawn from `seeder` (the side's own generator: a run stays reproducible from its seed)."""
    temps, seeds = temps or [None] * n, seeds or [None] * n
    if len(temps) != n or len(seeds) != n:
        raise ValueError(f"{len(temps)} temperatures and {len(seeds)} seeds for {n} rows")
    temps = [temperature if T is None else float(T) for T in temps]
    seeds = [int(s) if s is not None else
             int(torch.randint(2**62, (1,), generator=seeder, device="cpu")) for s in seeds]
    return temps, seeds


# --------------------------------------------------------------------------------------------------
# One draft token per row: what draft.draft_k draws at each step

def greedy(temperature) -> bool:
    """Every row at temperature 0 (temperature: one float, or a tensor [b] of them)."""
    return isinstance(temperature, numbers.Real) and temperature == 0


def guess_probs_from_logits(logits, temperature):
    """The probabilities SSD's guesses rank the tokens by (and SD's prefill returns): at
    temperature T > 0 the draft's own law q. At T = 0 the draft is greedy, its law one-hot, which
    ranks nothing after the top token: the temperature-1 softmax then, a ranking, not a law any
    token is drawn from. temperature: one float, or a tensor [b] of them."""
    if isinstance(temperature, torch.Tensor):
        return probs_from_logits(logits, torch.where(temperature > 0, temperature, 1.0))
    return probs_from_logits(logits, temperature if temperature > 0 else 1.0)


def draw(logits, temperature, noise, f=None, c=1.0):
    """One draft token per row: (token [b], q_drawn [b, V], guess_probs [b, V]). q_drawn is the law
    the token was drawn from (Saguaro's q' when f is set and C < 1; at T = 0 the token is the
    argmax and q_drawn unused), guess_probs what the guesses rank by (guess_probs_from_logits).
    temperature: one float, or a tensor [b]; noise [b, V]: the Exp(1) noise each row draws with
    (Drafter.noise; None when every row is greedy)."""
    probs = guess_probs_from_logits(logits, temperature)
    if greedy(temperature):
        return argmax(probs), probs, probs
    q = saguaro(probs, f, c) if f is not None and c < 1 else probs
    x = sample(q, None, noise)
    if isinstance(temperature, torch.Tensor):  # its rows at T = 0 are greedy (tested one-hot)
        x = torch.where(temperature > 0, x, argmax(probs))
    return x, q, probs
