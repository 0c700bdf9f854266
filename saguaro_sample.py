"""Sampling for the draft and the verifier: logits -> probabilities, seeded sampling, and Saguaro
sampling (the paper's Definition 14), which moves probability off the cached guesses so that
rejections land on them.

Pure functions on torch tensors, batched over any leading dims ([..., V]), float32 math, randomness
only from an explicit torch.Generator (never the global RNG): a run is reproducible from its seed.
"""
import numbers

import torch


def probs_from_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float32, [..., V]. T = 0 gives the one-hot of argmax (ties -> lowest
    index, as torch.argmax): greedy decoding is the temperature-0 case of the same code path."""
    if not (isinstance(temperature, numbers.Real) and temperature >= 0):
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    logits = logits.float()  # softmax over 150k tokens needs float32 to keep small masses
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits / temperature, dim=-1)


def exp_noise(shape, generator: torch.Generator) -> torch.Tensor:
    """Exp(1) draws of `shape`, float32, on the generator's device (never exactly 0)."""
    e = torch.empty(shape, device=generator.device).exponential_(generator=generator)
    return e.clamp_min_(torch.finfo(torch.float32).tiny)


def sample(probs: torch.Tensor, generator: torch.Generator, noise=None) -> torch.Tensor:
    """One token per row of probs [..., V] (>= 0 with a positive sum, not necessarily normalised):
    argmax(probs / E) with E ~ Exp(1) i.i.d. per entry (the exponential race: token x wins with
    chance probs(x) / sum(probs); a zero-probability token never wins). Returns LongTensor [...].

    noise: E, given (shape of probs) or drawn here with `generator`. Drawn apart from probs, it
    lets SSD give a branch the noise it would have had in the full batch (draft.draft_k)."""
    if noise is None:
        noise = exp_noise(probs.shape, generator)
    return (probs.float() / noise).argmax(-1)


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
