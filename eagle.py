"""A draft that reads the target's hidden states: EAGLE-3's head (Li et al., "EAGLE-3: Scaling up
Inference Acceleration of Large Language Models via Training-Time Test", arXiv 2503.01840).

A separate small draft model (draft.py's checkpoints) sees only tokens, so it has to rebuild from
scratch what the target already knows about the text. EAGLE's head instead reads the target's own
hidden states: the target's forward that verifies a round has computed them anyway, so the draft
starts each round from the target's understanding of the prefix and only has to look a few tokens
further. EAGLE-3's form, which this file implements:

- **Features.** Three of the target's layers, a low, a middle and a high one (`default_layers`),
  give their outputs (the residual stream after the layer) at every position p: F_p = [h_low;
  h_mid; h_high], [3H]. `fc` fuses them into one vector of the target's width H: g_p = fc(F_p).
- **One decoder layer** (model.py's `Block`, the target's width and heads). Its entry at position p
  reads [norm(embed(x_p)); norm(g_{p-1})], [2H]: the token at p and the target's features at p - 1,
  which chose it (zero before the first token). Its residual stream starts from g_{p-1}, and its
  output h'_p plays the role of g_p: norm and `lm_head` turn it into the law of x_{p+1}. So the
  head is fed tokens at their positions as any draft model is; it also needs the features of the
  position before. The layer keeps a KV cache of its own (one layer of a paged cache).
- **Past the verified prefix it reads itself.** Drafting K tokens after position m: the first step
  uses the target's features g_{m-1}, each later step the head's own output h' of the step before,
  as if it were the target's. This is why EAGLE-3 trains with **training-time test** (TTT,
  `train_forward`): during training the head runs these later steps too, on its own outputs, so
  that what it sees in training is what it sees when it drafts.
- **A vocabulary of its own.** `lm_head` has rows for the target tokens the target's answers use
  most (`token_ids`; 8,192 of SmolLM2's 49,152); `logits` writes them back over the target's
  vocabulary, -inf elsewhere. A token the draft gives probability 0 can still come out of the
  verifier's residual law, so speculative decoding stays exact. The input embedding is the
  target's own over the whole vocabulary (`attach`), shared, not a copy.

What the paper's code does differently: its entry p reads x_{p+1} with g_p (the same pairs, one
position earlier; RoPE sees only relative positions) and has no entry for the first token; its
checkpoints map draft rows to target ids as offsets
(`d2t[r] = token_ids[r] - r`); `save`/`load` write and read that form too, so the same names load
here. Its fused features are taken before the chosen layers run (hidden_states[i] of transformers,
i.e. the output of layer i - 1); `default_layers` names the same three layers by the layer that
writes them. It trains on ShareGPT and UltraChat answered by the target on GPUs for days;
scripts/train_eagle.py trains on the target's answers to this repository's prompts, on a CPU.
"""
import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from checkpoint import checkpoint_params, materialize, resolve
from config import ModelConfig
from devices import to_device, to_host
from draft import Drafter
from kv_cache import PagedKVCache
from model import PREFILL_CHUNK, Block, RMSNorm, rope_cos_sin, rope_inv_freq
from quantize import QuantLinear, QuantRows, pack_layers, warm_up
from speculator import Speculator

EAGLE_TYPE = "eagle3"  # config.json's "model_type" of a head's directory


def default_layers(n_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers of an n-layer target (its code: hidden_states[2],
    [n // 2] and [n - 3] of transformers, which are the outputs of layers 1, n // 2 - 1 and
    n - 4). SmolLM2-135M (30 layers): 1, 14, 26."""
    return [1, n_layers // 2 - 1, n_layers - 4]


class EagleHead(nn.Module):
    """fc, one decoder layer over [embedding; features], a final norm and a head over the draft's
    own rows. Parameter names are EAGLE-3's checkpoints' (fc, midlayer.*, norm, lm_head)."""

    def __init__(self, cfg: ModelConfig, target_layers: list[int], token_ids: list[int]):
        super().__init__()
        if len(target_layers) != 3:
            raise ValueError(f"an EAGLE-3 head fuses 3 target layers, got {target_layers}")
        self.config, self.target_layers = cfg, list(target_layers)
        H = cfg.hidden_size
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = Block(cfg)
        attn = self.midlayer.self_attn  # its q, k and v read [embedding; features]: 2H wide
        attn.qkv_proj = nn.Linear(2 * H, sum(attn.sizes), bias=cfg.arch.qkv_bias)
        self.midlayer.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, len(token_ids), bias=False)
        with torch.device("cpu"):  # real data even in a head built on the meta device (load)
            self.register_buffer("token_of", torch.tensor(token_ids), persistent=False)
            self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        # the target's embedding, shared and not trained: a plain dict, so it is neither a
        # parameter of the head nor saved with it
        self.target_parts = {}

    def attach(self, embed_tokens: nn.Module):
        """Read tokens through the target's embedding (the target's module, or one loaded from its
        checkpoint in the speculator's process)."""
        self.target_parts["embed"] = embed_tokens

    @property
    def device(self):
        return self.norm.weight.device

    @property
    def dtype(self):
        return self.norm.weight.dtype

    def fuse(self, features):
        """The target's three layers' outputs [..., 3, H] -> g [..., H]."""
        return self.fc(features.flatten(-2).to(self.dtype))

    def layer_input(self, tokens, g):
        """[norm(embed(tokens)); norm(g)]: [..., 2H], what the layer's q, k and v read."""
        e = self.target_parts["embed"](tokens).to(self.dtype)
        return torch.cat([self.midlayer.input_layernorm(e), self.midlayer.hidden_norm(g)], -1)

    def logits(self, h):
        """The head's output hidden h' [..., H] -> float32 logits over the target's vocabulary
        [..., V]: its rows at token_of, -inf on every token it has no row for."""
        own = self.lm_head(self.norm(h)).float()
        out = own.new_full((*own.shape[:-1], self.config.vocab_size), -math.inf)
        out[..., self.token_of] = own
        return out

    def step(self, cache, tokens, g, meta):
        """The engine's cached forward: tokens [N] at the positions of `meta` (a plan of a one-layer
        paged cache), each with its g [N, H] (fused target features, or the head's own h' of the
        position before) -> h' [N, H]. Their K and V are appended to the cache."""
        cos, sin = rope_cos_sin(self.inv_freq, meta.positions, self.dtype)
        q, k, v = self.midlayer.self_attn.qkv(self.layer_input(tokens, g), cos, sin)
        y = self.midlayer.self_attn.attend(q, k, v, cache.kv[0], meta)
        return self.midlayer.post_attention(g, y)

    def train_forward(self, tokens, features, steps: int) -> list[torch.Tensor]:
        """Training-time test over whole sequences, no cache. tokens [B, L] (x_0..x_{L-1}),
        features [B, L, 3, H] (the target's at every position). Entry p reads token x_p and
        g_{p-1} (g_{-1} = 0: nothing comes before the first token), as the engine feeds it.
        Step 0: every entry reads the target's g, as the verified prefix does when the head
        drafts. Step j > 0: entry i reads token x_{i+j} and the head's own output of step j - 1
        at entry i, at position i + j, and attends to step 0's entries 0..i (the verified prefix)
        and to its own entries i of steps 1..j (the chain drafted so far): exactly what the head
        sees at its j-th draft step after position i, with the tokens the target accepted.
        -> h' of each step, [B, L, H]; step j's entry i predicts x_{i+1+j}."""
        B, L = tokens.shape
        attn = self.midlayer.self_attn
        g = self.fuse(features[:, :L - 1])  # [B, L - 1, H]: g_0..g_{L-2}
        g = torch.cat([g.new_zeros(B, 1, g.shape[-1]), g], 1)  # [B, L, H]: entry p's g_{p-1}
        pad = tokens.new_zeros(B, steps)  # tokens past the end: their entries carry no label
        x = torch.cat([tokens, pad], 1)
        base = torch.arange(L, device=tokens.device)
        keys, values, outs = [], [], []
        for j in range(steps):
            cos, sin = rope_cos_sin(self.inv_freq, base + j, self.dtype)
            q, k, v = attn.qkv(self.layer_input(x[:, j:j + L], g), cos, sin)
            keys.append(k)
            values.append(v)
            y = ttt_attention(q, keys, values)  # [B, L, nh, hd]
            g = self.midlayer.post_attention(g, y)
            outs.append(g)
        return outs


def ttt_attention(q, keys: list, values: list):
    """Attention of training-time test's step j = len(keys) - 1. q [B, T, nh, hd]; keys[0] /
    values[0] [B, T, nkv, hd] are step 0's entries (causal: entry i sees 0..i), keys[s] for s >= 1
    the chain's (entry i sees only its own, the diagonal). -> [B, T, nh, hd]."""
    B, T, nh, hd = q.shape
    rep = nh // keys[0].shape[2]  # GQA: each KV head serves rep query heads
    qh = q.transpose(1, 2)  # [B, nh, T, hd]

    def heads(t):  # [B, T, nkv, hd] -> [B, nh, T, hd]
        return t.repeat_interleave(rep, 2).transpose(1, 2)

    scale = 1.0 / math.sqrt(hd)
    scores = qh @ heads(keys[0]).transpose(-1, -2) * scale  # [B, nh, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, -math.inf)
    diag = [(qh * heads(k)).sum(-1, keepdim=True) * scale for k in keys[1:]]  # [B, nh, T, 1]
    p = torch.cat([scores, *diag], -1).float().softmax(-1).to(q.dtype)  # [B, nh, T, T + j]
    y = p[..., :T] @ heads(values[0])
    for s, v in enumerate(values[1:]):
        y = y + p[..., T + s:T + s + 1] * heads(v)
    return y.transpose(1, 2)  # [B, T, nh, hd]


# --------------------------------------------------------------------------------------------------
# A head's directory: config.json (the layer's shape as an HF Llama config of one layer, plus the
# head's own keys) and model.safetensors (EAGLE-3's names; d2t as its offsets)

def hf_config(cfg: ModelConfig) -> dict:
    """The layer's shape as the keys ModelConfig.from_hf reads."""
    return {"model_type": cfg.model_type, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "rope_scaling": cfg.rope_scaling,
            "max_position_embeddings": cfg.max_position_embeddings,
            "vocab_size": cfg.vocab_size, "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_ids}


def head_for(target_cfg: ModelConfig, target_layers: list[int], token_ids: list[int]):
    """A new head shaped for a target: its width, heads and MLP, one layer."""
    cfg = ModelConfig.from_hf(hf_config(target_cfg))
    return EagleHead(cfg, target_layers, token_ids)


def state_dict_out(head: EagleHead) -> dict:
    """The head's weights under EAGLE-3's checkpoint names: q/k/v and gate/up (weights and biases)
    apart, as checkpoint.checkpoint_params names a model's fused layers (views of them), and d2t."""
    out = checkpoint_params(head)
    rows = torch.arange(len(head.token_of))
    out["d2t"] = (head.token_of.cpu() - rows).long()  # EAGLE-3: target id = row + d2t[row]
    return out


def save(head: EagleHead, out: Path, extra: dict | None = None, dtype=torch.bfloat16):
    """Write the head's directory (config.json, model.safetensors). extra: keys for config.json
    (the target it reads, the settings measured best for the pair)."""
    from safetensors.torch import save_file
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**hf_config(head.config), "model_type": EAGLE_TYPE,
           "layer_model_type": head.config.model_type, "target_layers": head.target_layers,
           "draft_vocab_size": len(head.token_of), **(extra or {})}
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    tensors = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype, copy=True)
               for k, v in state_dict_out(head).items()}  # copies: q/k/v are views of one tensor
    save_file(tensors, str(out / "model.safetensors"))
    same_mode(out / "model.safetensors", like=out / "config.json")


def same_mode(path: Path, like: Path):
    """safetensors writes its file 0600 whatever the umask: give it the mode of a file this
    process wrote beside it (0644 under the usual umask), so that others can read the head."""
    path.chmod(like.stat().st_mode & 0o777)


def is_head(path) -> bool:
    """Is this directory an EAGLE-3 head's?"""
    f = Path(path) / "config.json"
    return f.is_file() and json.loads(f.read_text()).get("model_type") == EAGLE_TYPE


def load(path, device="cpu", dtype=torch.float32) -> EagleHead:
    """A head's directory -> EagleHead (not yet attached to a target's embedding)."""
    from safetensors.torch import load_file
    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    cfg = ModelConfig.from_hf({**hf, "model_type": hf["layer_model_type"]})
    sd = load_file(str(path / "model.safetensors"))
    token_ids = (torch.arange(len(sd["d2t"])) + sd.pop("d2t")).tolist()
    # built on the meta device: no initialisation of the weights the file replaces (seconds for a
    # large target's head), their memory allocated once, on `device` in `dtype`
    with torch.device("meta"):
        head = EagleHead(cfg, hf["target_layers"], token_ids)
    materialize(head, device, dtype)
    params = checkpoint_params(head)  # by EAGLE-3's names: q/k/v, gate/up views of the fused
    with torch.no_grad():
        for name, w in sd.items():
            if name not in params:
                raise ValueError(f"{path}: unexpected tensor {name!r} in an EAGLE-3 head")
            params[name].copy_(w)
    missing = sorted(set(params) - set(sd))
    if missing:
        raise ValueError(f"{path}: the head's tensor {missing[0]!r} is missing"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


def quantize(head: EagleHead, quant: str) -> EagleHead:
    """The head's linear layers in quant ("int8" or "int4"; "none" or "auto": as saved, float),
    as checkpoint.load_model quantizes a draft (quantize.py's layouts and kernels): in int4 the
    decoder layer's products, fc and lm_head in int8, as llama.cpp keeps a Q4 file's head. A
    draft step reads every weight once, so its bytes are its time: float32, SmolLM2-135M's head
    reads 39 MB a step (lm_head's 8,192 rows 19 MB of them), about half a step of the int4 target's
    94 MB."""
    if quant in ("none", "auto"):
        return head
    bits = {"int8": 8, "int4": 4}[quant]
    for name, module in list(head.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            b = bits if module is not head else 8  # fc and lm_head: int8
            layer = QuantLinear(child.in_features, child.out_features, b, None,
                                child.bias is not None, child.weight.device, child.weight.dtype,
                                mins=b == 4)
            QuantRows(layer, 0, child.out_features).copy_(child.weight)
            if child.bias is not None:
                layer.bias.copy_(child.bias)
            setattr(module, child_name, layer)
    head.lm_head.out_dtype = torch.float32
    pack_layers(head, head.device, blocks=head.midlayer)
    return head


# --------------------------------------------------------------------------------------------------
# Drafting with the head: to draft.py's loops it is a draft model that feeds tokens at their
# positions and gives the law of the next one; what each entry reads besides its token (g of the
# position before) lives in its cache

class HeadCache(PagedKVCache):
    """The head's paged KV cache (its one layer), and per slot g_p, what the entry after it reads:
    the head's own output h'_p once entry p is computed, replaced by the target's fused features
    of p once the target has verified p (`pend`). Forks and copies on write carry g with K and V,
    so an SSD branch forked after j drafted tokens reads the head's own state there.
    pending: the target's g for positions past the cache's end (verified tokens not yet fed), per
    sequence (first position, its pieces [n_i, H] in order: an outcome adds one, a forward that
    reads them joins them, `pending_g`); feeding those tokens reads them, and writes them to g."""

    def __init__(self, cfg, num_tokens: int, block_size: int, device, dtype):
        super().__init__(cfg, num_tokens, block_size, device, dtype)
        self.g = torch.zeros(self.num_blocks, block_size, cfg.hidden_size, device=device,
                             dtype=dtype)
        self.pending: dict[int, tuple[int, list[torch.Tensor]]] = {}

    def copy_block(self, dst: int, src: int, n: int):
        super().copy_block(dst, src, n)
        self.g[dst, :n] = self.g[src, :n]

    def slots(self, sid: int, start: int, n: int) -> list[int]:
        """Positions start..start+n-1 of sequence sid -> their slots in the pool."""
        bs, blocks = self.block_size, self.seqs[sid].blocks
        return [blocks[p // bs] * bs + p % bs for p in range(start, start + n)]

    def pend(self, sid: int, start: int, g):
        """The target's g [n, H] for positions start..start+n-1 of sid: written where the entries
        exist (the correction of what the head guessed there), kept for the rest."""
        here = max(0, min(len(g), self.length(sid) - start))
        self.g.view(-1, self.g.shape[-1])[self.slots(sid, start, here)] = g[:here]
        first, pieces = start + here, [g[here:]]
        p0, before = self.pending.get(sid, (None, []))
        if p0 is not None and p0 + sum(map(len, before)) == first:  # an earlier outcome's g, not
            first, pieces = p0, before + pieces  # fed yet, comes right before (no copy: while the
            # head does not run, a fast backup proposing, the run grows a piece a round)
        if len(pieces[-1]) or len(pieces) > 1:
            self.pending[sid] = (first, pieces)
        else:
            self.pending.pop(sid, None)

    def pending_g(self, sid: int) -> tuple[int | None, torch.Tensor | None]:
        """sid's pending run: (its first position, the target's g [n, H]), its pieces joined once;
        (None, None) if none."""
        if sid not in self.pending:
            return None, None
        first, pieces = self.pending[sid]
        if len(pieces) > 1:
            pieces = [torch.cat(pieces)]
            self.pending[sid] = (first, pieces)
        return first, pieces[0]

    def ready(self, sid: int, count: int) -> int:
        """How many of sid's next `count` tokens one forward can feed: each reads g of the position
        before, which is known for the first (its slot, or zero) and for the positions the target's
        pending g covers; past them a token reads the head's own output for the token before it,
        which the same forward has not made yet (a chain: one forward per token)."""
        start, g = self.pending_g(sid)
        return min(count, 1 + len(g)) if start == self.length(sid) else 1

    def g_before(self, sid: int, count: int):
        """g_{p-1} [count, H] for sid's next `count` tokens (positions L..L+count-1, L its length;
        count <= ready): slot L - 1 (zero before the first token), then the pending target g."""
        L = self.length(sid)
        first = (self.g.view(-1, self.g.shape[-1])[self.slots(sid, L - 1, 1)[0]] if L > 0
                 else self.g.new_zeros(self.g.shape[-1]))
        return torch.cat([first[None], self.pending_g(sid)[1][:count - 1]]) if count > 1 \
            else first[None]

    def wrote(self, sid: int, start: int, h):
        """Entries start.. of sid were computed with outputs h [n, H]: g there is h, or the
        pending target g where the target has verified those positions."""
        g, end = h, start + len(h)
        p0, pend = self.pending_g(sid)
        if p0 is not None and p0 < end:  # verified positions p0..: the target's g there, h else
            k = min(len(pend), end - p0)
            g = torch.cat([h[:p0 - start], pend[:k], h[p0 - start + k:]])
            if k < len(pend):
                self.pending[sid] = (end, [pend[k:]])
            else:
                del self.pending[sid]
        self.g.view(-1, self.g.shape[-1])[self.slots(sid, start, len(h))] = g

    def truncate(self, sid: int, length: int):
        if length < self.length(sid):  # what was pending followed the cut entries
            self.pending.pop(sid, None)
        super().truncate(sid, length)

    def free(self, sid: int):
        super().free(sid)
        self.pending.pop(sid, None)


class EagleModel:
    """An EagleHead as draft.py's loops (draft_k, Drafter, the Speculator) call a draft model:
    `forward_cached(cache, seqs, tokens, counts)` feeds each sequence's tokens at its next
    positions and returns the laws of the next tokens over the target's vocabulary; the g each
    entry reads comes from its HeadCache. config.vocab_size is the target's."""

    def __init__(self, head: EagleHead):
        self.head, self.config = head, head.config

    @property
    def device(self):
        return self.head.device

    @property
    def dtype(self):
        return self.head.dtype

    def new_cache(self, num_tokens: int, block_size: int = 16, reuse: bool = False,
                  prefix_caching: bool = False) -> HeadCache:
        if prefix_caching:
            raise ValueError("prefix caching with an EAGLE draft is not implemented: the head "
                             "needs the target's features of every prompt token; run without "
                             "prefix caching (--no-prefix-caching)")
        return HeadCache(self.head.config, num_tokens, block_size, self.device, self.dtype)

    def capture_seconds(self) -> float:
        return 0.0

    @torch.no_grad()
    def forward_cached(self, cache: HeadCache, seq_ids: list[int], tokens, counts: list[int],
                       last_only: bool = False):
        """tokens [N] (or a list): counts[i] new tokens of sequence seq_ids[i], back to back ->
        float32 logits [N, V] ([b, V] if last_only). Each forward feeds every sequence as many of
        its tokens as their g allows (HeadCache.ready): all of them, as a drafting step or a
        catch-up over verified tokens does, else those and then one at a time."""
        tokens = torch.as_tensor(tokens, device=self.device)
        parts, done = tokens.split(counts), [0] * len(seq_ids)
        h = [[] for _ in seq_ids]  # each sequence's outputs h', in pieces
        while live := [i for i, c in enumerate(counts) if done[i] < c]:
            # at most a prefill chunk a row a forward (model.PREFILL_CHUNK: its attention mask)
            take = [min(cache.ready(seq_ids[i], counts[i] - done[i]), PREFILL_CHUNK) for i in live]
            seqs = [seq_ids[i] for i in live]
            starts = [cache.length(s) for s in seqs]
            g = torch.cat([cache.g_before(s, k) for s, k in zip(seqs, take)])
            meta = cache.prepare(seqs, take)
            out = self.head.step(cache, torch.cat([parts[i][done[i]:done[i] + k]
                                                   for i, k in zip(live, take)]), g, meta)
            for i, s, L, k, part in zip(live, seqs, starts, take, out.split(take)):
                cache.wrote(s, L, part)
                h[i].append(part)
                done[i] += k
        h = [torch.cat(x) for x in h]
        return self.head.logits(torch.stack([x[-1] for x in h]) if last_only else torch.cat(h))


def follow_target(drafter, row, features):
    """After a round's outcome is committed to `row`, with the target's features [n, layers, H] of
    the tokens its cache gained (the prompt's at a join; r, x_1..x_n after a verification): cut the
    row's cache back to its last entry that read only the target's g (the one for the position
    before them) and pend their fused g. The next forward re-feeds the tokens after it, each with
    the target's g of the token before: the entries the head drafted from its own states are
    corrected. Its guess laws go with the entries they came from."""
    start = len(row.history) - 1 - len(features)  # features cover start..len(history) - 2
    drafter.cache.truncate(row.seq, min(drafter.cache.length(row.seq), start + 1))
    drafter.cache.pend(row.seq, start, drafter.model.head.fuse(to_device(features,
                                                                         drafter.model.device)))
    row.guess_probs = None


class EagleDrafter(Drafter):
    """SD's draft side with an EAGLE head (draft.Drafter's loop, model: EagleModel). A row joins
    without a prefill: the head needs the target's features of its prompt, which the verifier's
    prefill makes, and the first commit brings them. Each commit brings the features of the tokens
    the target verified (r, x_1..x_n), whose entries the head recomputes: the ones it drafted from
    its own states are corrected to the target's (follow_target)."""

    def add(self, prompts, *, first=None, temps=None, seeds=None):
        self.rows += self.new_rows(prompts, first=first, temps=temps, seeds=seeds)
        return None  # no law before the first features: SD drafts only after the first commit

    def commit(self, rows, n, t, features=None):
        """The outcome (n, t) and the target's features of the tokens its cache gained (per row:
        the prompt's at a join, r and x_1..x_n after a verification)."""
        if features is None:
            raise ValueError(NEEDS_FEATURES)
        for r, (n_r, t_r), f in zip(rows, to_host(torch.stack([n, t], 1)), features):
            self.rows[r].commit(n_r, t_r)
            follow_target(self, self.rows[r], f)


NEEDS_FEATURES = ("an EAGLE draft needs the target's features with every outcome: build the "
                  "verifier's model with want_features")


class EagleSpeculator(Speculator):
    """SSD's draft side with an EAGLE head (speculator.Speculator's rounds, model: EagleModel).
    Pre-speculation guesses the outcome of the round being verified, whose features the target
    has not given yet: a branch drafts from the head's own states past the verified prefix (a fork
    of its HeadCache carries them), as EAGLE drafts past the verified prefix anyway. When the
    outcome arrives with the target's features, `correct` follows them: a miss's neural backup
    then drafts from the target's features, and a hit's proposals (drafted from the head's own
    states) stand, while its next pre-speculation re-feeds the round's tokens with the target's g
    first (the paper's code calls this its glue step): one forward for the verified tokens, then
    one for each of the hit's L proposals, whose entries each read the head's own output before
    them. correct_hits=False leaves a hit's own states in place: one forward instead of those
    1 + L, guesses ranked by laws drawn from its own states.
    A row pre-speculates once the target's features of its prompt have arrived (its first
    outcome, round 0, is always a miss)."""
    correct_hits = True

    def add(self, prompts, **kw):
        self.policy.rows_joined()
        return EagleDrafter.add(self, prompts, **kw)  # no prefill: a row waits for its features

    def pre_speculate(self, rows):
        rows = [r for r in rows if self.cache.length(self.rows[r].seq) > 0
                or self.rows[r].seq in self.cache.pending]  # its prompt's features arrived
        if rows:
            super().pre_speculate(rows)

    def respond(self, rows, n, t, *, features=None, round_seconds=None):
        if features is None:
            raise ValueError(NEEDS_FEATURES)
        return super().respond(rows, n, t, features=features, round_seconds=round_seconds)

    def correct(self, rows, features, hit):
        keep = set() if self.correct_hits else set(hit)  # the rows that keep their own states
        for i, (r, f) in enumerate(zip(rows, features)):
            if i not in keep:
                follow_target(self, self.rows[r], f)


# --------------------------------------------------------------------------------------------------
# The kind of draft the engine dispatches on (draft.draft_kind)

@dataclass(frozen=True)
class EagleDraft:
    """A draft that is an EAGLE-3 head (a directory `save` wrote): it reads the target's hidden
    states at `feature_layers`, and tokens through the target's embedding."""
    name: str

    def config(self) -> dict:
        return json.loads((resolve(self.name) / "config.json").read_text())

    @property
    def feature_layers(self) -> list[int]:
        return self.config()["target_layers"]

    def check(self, target, cfg, tok):
        """The head reads this target's states and writes its tokens: the same width, the same
        vocabulary, layers the target has."""
        hf = self.config()
        if (hf["hidden_size"], hf["vocab_size"]) != (cfg.hidden_size, cfg.vocab_size) or \
                max(hf["target_layers"]) >= cfg.num_hidden_layers:
            raise ValueError(f"the EAGLE head {self.name} reads a target of width "
                             f"{hf['hidden_size']} with {hf['vocab_size']} tokens (layers "
                             f"{hf['target_layers']}), this one is {cfg.hidden_size} wide with "
                             f"{cfg.vocab_size} tokens and {cfg.num_hidden_layers} layers: train "
                             f"a head for it (scripts/train_eagle.py)")

    def target_parts(self, target) -> dict:
        """The target's embedding module: the head reads tokens through it."""
        return {"embed": target.model.embed_tokens}

    def build(self, c, *, arrived=None) -> Drafter:
        head = quantize(load(resolve(self.name), device=c.device, dtype=c.dtype), c.quant)
        warm_up(head, range(1, c.spec.K + 2))  # quantized products: a step to a catch-up
        embed = c.target_parts["embed"]
        if next(iter(embed.state_dict().values())).device != head.device:
            embed = copy.deepcopy(embed).to(head.device)  # a copy on the draft's device
        head.attach(embed)
        side = EagleSpeculator if c.ssd else EagleDrafter
        kw = dict(arrived=arrived) if c.ssd else {}
        return side(EagleModel(head), c.spec, c.temperature, c.seed, c.kv_tokens,
                    block_size=c.block_size, prefix_caching=c.prefix_caching, **kw)
