"""Sampling for the draft and the verifier: logits -> probabilities, greedy and seeded sampling, and Saguaro
sampling (the paper's Definition 14), which moves probability off the cached guesses so rejections land on them.

Pure functions on torch tensors, batched over any leading dims ([..., V]), float32 math, randomness only from an
explicit torch.Generator (never the global RNG), so a run is reproducible from its seed.
"""
import numbers

import torch


def probs_from_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float32, [..., V]. T = 0 gives the one-hot of argmax (ties -> lowest index, as
    torch.argmax), so greedy decoding is the temperature-0 case of the same code path."""
    if not (isinstance(temperature, numbers.Real) and temperature >= 0):
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    logits = logits.float()  # bf16 logits: softmax over 150k tokens needs float32 to keep small masses
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits / temperature, dim=-1)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim: LongTensor [...] (ties -> lowest index)."""
    return logits.argmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of probs [..., V] (rows need not be normalised, only >= 0 with a positive sum),
    drawn with `generator` (on the same device as probs). Returns LongTensor [...].

    torch.multinomial rather than a hand-written inverse CDF: with one sample it is the exponential race
    argmax(probs / E), E ~ Exp(1) i.i.d., which draws exactly from probs / sum(probs), never picks a
    zero-probability token and needs no cumulative sum. A float32 inverse CDF over 150k tokens can do both
    wrong by round-off (a GPU parallel scan is not guaranteed flat across zero entries, and u * total can round
    up to total, past the last token). multinomial also rejects NaN/inf/negative rows (asynchronously on GPU,
    no host sync) instead of silently returning a token. Deterministic given the generator's state, on CPU
    and CUDA; it consumes V random numbers per row, which is cheap next to a forward pass."""
    V = probs.shape[-1]
    flat = probs.reshape(-1, V)  # [rows, V]
    if flat.shape[0] == 0:
        return torch.empty(probs.shape[:-1], dtype=torch.long, device=probs.device)
    return torch.multinomial(flat.float(), 1, generator=generator).view(probs.shape[:-1])


def saguaro(q: torch.Tensor, f, c: float) -> torch.Tensor:
    """Saguaro sampling distribution q' from the draft's own distribution q [..., V] (Definition 14):
    the top f+1 tokens of q get their probability multiplied by C, then renormalise:
    q'(x) = C q(x) / Z on the top-(f+1) set S, q(x) / Z elsewhere. f = F_j, an int or an integer tensor of
    shape q.shape[:-1] (one F per row); C in [0, 1]. Returns float32 [..., V] (q itself when C = 1).

    Why f+1: the cached bonus guesses at depth j are the top F_j tokens EXCLUDING the drafted token (a rejected
    token has zero residual mass, so it can never be the bonus), and the drafted token is normally one of the
    top F_j+1. Scaling the top F_j+1 lowers q' exactly where the guesses are, which raises the residual
    max(p - q', 0) there, so a rejection's bonus more often lands on a cached guess. Lossless because the
    verifier tests the token with this q', not q. f = 0 scales just the top token.

    The set is chosen with torch.topk on q, the same call (and so the same tie order) spec_cache uses to pick
    the guesses from the same q_raw."""
    if not (isinstance(c, numbers.Real) and 0 <= c <= 1):
        raise ValueError(f"Saguaro constant C must be a number in [0, 1] (1 = plain sampling), got {c!r}")
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
    top = q.topk(k, dim=-1).indices                                              # [..., k] descending
    if isinstance(f, torch.Tensor):
        # Rows with a smaller F scale only their first f+1 of the k candidates.
        in_set = torch.arange(k, device=q.device) < (f.to(q.device).unsqueeze(-1) + 1)   # [..., k]
        scale = torch.where(in_set, c, 1.0)
    else:
        scale = c
    scaled = q.scatter(-1, top, q.gather(-1, top) * scale)                      # [..., V]
    Z = scaled.sum(-1, keepdim=True)                                             # [..., 1]
    # Z = 0 only when C = 0 and q has no mass outside S (or C q underflows): q' is undefined (0/0). Keep q for
    # that row: the draft samples from the returned distribution and the verifier tests with the same one,
    # so exactness holds whatever we return, and q is the natural limit of q' as C -> 0 in this case.
    return torch.where(Z > 0, scaled / torch.where(Z > 0, Z, 1.0), q)
