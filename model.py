"""A hand-written Llama-3 / Qwen3 / Qwen2 forward pass: tensor-parallel slices, the layers and
`Transformer`, called on ragged batches through a paged KV cache (kv_cache.py). What each
architecture is (ARCHS) and the config (ModelConfig) are config.py's.

Read top to bottom: tensor parallelism, the layers, the model (two ways to call it).

Both the target and the draft of speculative decoding are instances of `Transformer`. The engine
calls `model.forward_cached` on a *ragged batch*: every sequence adds its own number of new tokens
(the whole prompt at prefill, 1 per decode step, K+1 when verifying) at its own positions, and K/V
are read and written through each sequence's block table in a `PagedKVCache`. Loading a checkpoint
into it is checkpoint.py's job; static shapes and CUDA graphs are graphs.py's; how a CPU computes a
product of a few rows fastest, cpu_linear.py's.
"""
import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from config import ModelConfig
from devices import matmul_fp32, to_device
from graphs import StaticSteps
from kv_cache import (AttnMeta, PagedKVCache, define_paged_attention_op, paged_attention,
                      paged_attention_cpu, paged_attention_op)
from quantize import QuantLinear, renamed


# --------------------------------------------------------------------------------------------------
# Tensor parallelism (Megatron style): rank r of `world` holds 1/world of the q/k/v heads, of the
# MLP's intermediate units and of the vocabulary. Column-split layers (q, k, v, gate, up) need no
# communication; the row-split ones (o_proj, down_proj) give partial sums that one all-reduce per
# layer adds up. The caller has set up the process group (NCCL on CUDA, gloo on CPU); see tp.py.
# The sizes a model splits into: config.ModelConfig.tp_sizes; each checkpoint tensor's split:
# checkpoint.TP_SPLIT (the loader reads only this rank's slice).

@dataclass
class TP:
    rank: int
    world: int
    group: object = None  # a torch.distributed process group; None is the default group


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
        # q_proj, k_proj and v_proj fused into one GEMM, rows [q | k | v]: one kernel instead of
        # three; the loader fills each part from the checkpoint's own tensor (checkpoint.PARTS)
        self.sizes = [self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd]
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.sizes), bias=cfg.arch.qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        if cfg.arch.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def qkv(self, x, cos, sin):
        # x [..., hidden] -> q [..., nh, hd], k and v [..., nkv, hd], RoPE applied to q and k
        q, k, v = self.qkv_proj(x).split(self.sizes, -1)
        q = q.unflatten(-1, (self.nh, self.hd))
        k, v = k.unflatten(-1, (self.nkv, self.hd)), v.unflatten(-1, (self.nkv, self.hd))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q, k, v, kv_layer=None, meta=None):
        if kv_layer is None:
            # full forward: q [B, T, nh, hd], k/v [B, T, nkv, hd]; plain causal attention
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True,
                                               enable_gqa=True)  # [B, nh, T, hd]
            return y.transpose(1, 2)  # [B, T, nh, hd]
        # paged: the new tokens of all sequences back to back, q [N, nh, hd] -> [N, nh, hd]
        if meta.cpu_kernel:  # a float32 pool on a CPU: cpu_kernels.cpp's op, eager or compiled
            return paged_attention_cpu(q, k, v, kv_layer, meta)
        if torch.compiler.is_compiling():  # a compiled step (compiled_body): the op, not traced
            return paged_attention_op(q, k, v, kv_layer, meta)
        return paged_attention(q, k, v, kv_layer, meta)

    def out(self, y):
        # y [..., nh, hd] -> [..., hidden]
        return all_reduce(self.o_proj(y.flatten(-2)), self.tp)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TP | None = None):
        super().__init__()
        self.tp = tp
        self.inter = cfg.intermediate_size // (tp.world if tp else 1)  # TP: this rank's units
        # rows [gate | up] fused into one GEMM
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=False)

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
        self.one_call = None  # the weights of cpu_kernels.cpp's one-call layer (use_one_call)

    def use_one_call(self) -> bool:
        """Run this layer's eager CPU steps as one C++ call (ssd::int4_layer) where it computes
        what forward does: float32, on a CPU where cpu_kernels.cpp runs, the four products int4 in
        its layout (quantize.pack_layers), no biases, no q/k norms (Qwen3), no tensor parallelism.
        From Python the layer is some 40 small operations, a dispatch and an allocation each:
        SmolLM2-135M in int4 on a 2-core EPYC, one thread, an eager step took 23 ms where the
        compiled one (model.compiled_body) took 7. Prefill pieces keep the Python layer (their
        attention is not the C++ op's, PagedKVCache.meta)."""
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        norms = (self.input_layernorm.weight, self.post_attention_layernorm.weight)
        fits = (all(getattr(m, "kernel", None) == "cpu" and m.packed is not None and m.bias is None
                    for m in linears)
                and not hasattr(attn, "q_norm") and attn.tp is None and mlp.tp is None
                and all(w.dtype == torch.float32 and w.device.type == "cpu" for w in norms))
        self.one_call = [norms[0], *linears[0].stored(), *linears[1].stored(), norms[1],
                         *linears[2].stored(), *linears[3].stored()] if fits else None
        return fits

    def forward(self, x, cos, sin, kv_layer=None, meta=None, halves=None):
        """halves: (pre_attention, post_attention) compiled (compiled_halves, which the static
        path's graphs.StaticSteps holds), else these two as they are. An eager step on a CPU runs
        the layer in one call of cpu_kernels.cpp where it can (one_call)."""
        if (self.one_call is not None and meta is not None and meta.cpu_kernel and halves is None
                and not torch.compiler.is_compiling()):
            return torch.ops.ssd.int4_layer(x, cos, sin, self.one_call, self.input_layernorm.eps,
                                            self.self_attn.nh, self.self_attn.nkv, kv_layer,
                                            meta.slots, meta.block_table, meta.rows,
                                            meta.positions)
        pre, post = halves or (Block.pre_attention, Block.post_attention)
        q, k, v = pre(self, x, cos, sin)
        return post(self, x, self.self_attn.attend(q, k, v, kv_layer, meta))

    # A layer's two halves around attention, which writes the KV cache. torch.compile fuses each
    # half's elementwise work into few kernels; the cache write stays outside, in the pool itself.
    def pre_attention(self, x, cos, sin):
        return self.self_attn.qkv(self.input_layernorm(x), cos, sin)

    def post_attention(self, x, y):
        x = x + self.self_attn.out(y)
        return x + self.mlp(self.post_attention_layernorm(x))


def compiled_halves(tag: str):
    """Block.pre_attention and Block.post_attention through torch.compile (Inductor): a layer's
    norms, RoPE, SiLU and residual adds fused into a few kernels around its GEMMs, where eager
    PyTorch launches one kernel per operation (a GPU's decode step is mostly launches and their
    gaps). One compiled graph serves every layer of a model (the layer is an argument). The first
    step compiles for its token count; the second count seen compiles once more with that count
    symbolic (torch.compile's automatic dynamic shapes), which every later bucket reuses, while
    the model's own sizes stay constants. Compiling takes seconds, when a step's bucket first
    comes up (on CUDA inside the graph capture, timed apart from decoding: graphs.StaticSteps).

    torch.compile keeps at most 8 graphs per function (recompile_limit; a new dtype or CPU thread
    count compiles again too) and records which sizes varied per function name: each model
    compiles copies of the two functions named apart by `tag`, so that the other models of its
    process (a draft, a sweep's) spend none of its graphs and turn none of its sizes symbolic."""
    opts = dict(fullgraph=True)
    return (torch.compile(renamed(Block.pre_attention, tag), **opts),
            torch.compile(renamed(Block.post_attention, tag), **opts))


def compiled_body(tag: str):
    """The CPU's compiled step: Transformer.logits (embedding, every layer, the final norm and the
    LM head) through torch.compile as one graph, the paged attention inside it an operator called
    as it is (kv_cache.py). On the CPU nothing replays a step, so compiled halves still pay Python,
    dispatch and torch.compile's guards twice a layer (SmolLM2-135M in int4, one thread: a step
    25.8 ms, eager 24.7); one graph pays them once a step (19 ms). With the head in it too, the
    final norm and the head's call no longer run eagerly after the graph (the same model, two
    copies interleaved in one process, both load orders: a step in 0.93-0.98x the time on one
    thread, 0.94-0.95x on two; the same logits, bit for bit). A quantized head's product stays
    an operator of its own there (QuantLinear.product).
    Its first graph takes the sizes that vary as symbolic (graphs.symbolic_sizes), so a model
    compiles about three: one row of one token, one row of more, several rows. A row's logits agree
    across them to float rounding, not bit for bit as on the eager path: Inductor fuses each graph
    into its own loops, so a last bit can differ, and the quantized kernels' 16-bit inputs carry it
    on (tests/test_graphs.py: within 1e-3, the same argmax). So a compiled SD or SSD verifies with
    logits that can differ from a compiled AR step's in their last bits: where two tokens nearly
    tie, greedy decoding could pick the other one (the eager path has no such difference)."""
    # Each model compiles its own copy (tag) and only that model calls it (its StaticSteps), so
    # the guards on its modules' attributes and parameters can go: they cost 0.7 ms a call for 30
    # layers. Inductor's checks of each op's output strides go too (580 a step). The wrapper that
    # calls the graph's kernels is C++ (cpp_wrapper), not Python: a step of SmolLM2-135M in int4,
    # two copies interleaved in one process, 17.0 ms against 18.3 on one thread, 11.5 against 12.9
    # on two; it takes longer to compile the first time (Inductor caches it on disk).
    define_paged_attention_op()
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
               "size_asserts": False, "cpp_wrapper": True}
    return torch.compile(renamed(Transformer.logits, tag), fullgraph=True, options=options)


# A draft's own vocabulary (ModelConfig.token_ids): ids in as rows, logits out over the vocabulary

def vocab_maps(token_ids: list[int], V: int, device=None):
    """-> (token_of [rows - 1]: row -> token id, row_of [V]: token id -> row, the last row for every
    token outside token_ids)."""
    token_of = torch.tensor(token_ids, dtype=torch.long, device=device)
    row_of = torch.full((V,), len(token_ids), dtype=torch.long, device=device)
    row_of[token_of] = torch.arange(len(token_ids), device=device)
    return token_of, row_of


def over_vocab(own, token_of, V: int):
    """A draft's logits over its rows [..., rows] -> over the V-token vocabulary [..., V]: row r's
    at token token_of[r], -inf (never written) elsewhere; the last row, which only reads, drops."""
    logits = own.new_full((*own.shape[:-1], V), -math.inf)
    logits[..., token_of] = own[..., :-1]
    return logits


# --------------------------------------------------------------------------------------------------
# Tokens per prefill forward (Transformer.prefill): long prompts go in pieces of this size
PREFILL_CHUNK = 2048


# --------------------------------------------------------------------------------------------------
# The model

class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TP | None = None):
        super().__init__()
        self.config = cfg  # the whole model's; with TP the layers hold 1/world of the split dims
        self.tp = tp if tp is not None and tp.world > 1 else None
        if self.tp:
            cfg.check_tp(self.tp.world)
            if cfg.rows != cfg.vocab_size:
                raise ValueError("a draft with its own vocabulary (target_token_ids) or padded "
                                 "rows is not implemented with tensor parallelism: run it on one "
                                 "device")
        vocab = cfg.rows // (self.tp.world if self.tp else 1)  # TP: this rank's vocab rows
        self.model = nn.Module()  # HF nests the body under "model."; keep its parameter names
        # no random init (weights are always loaded): normal_ on the meta device imports
        # torch._dynamo, seconds in every freshly spawned process (speculator, TP ranks)
        self.model.embed_tokens = nn.Embedding(vocab, cfg.hidden_size,
                                               _weight=torch.empty(vocab, cfg.hidden_size))
        self.model.layers = nn.ModuleList(Block(cfg, self.tp)
                                          for _ in range(cfg.num_hidden_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.static: StaticSteps | None = None  # set by use_graphs
        self.kv_pool: PagedKVCache | None = None  # the cache new_cache(reuse=True) hands back
        self.feature_layers: list[int] | None = None  # set by want_features
        self.init_buffers()

    def want_features(self, layers: list[int] | None):
        """Make every cached forward also give the outputs of these layers at every position it
        computes (an EAGLE draft reads them: eagle.py): forward_cached, run and prefill then return
        (logits, features [N, len(layers), hidden]). None: logits alone, and nothing extra is
        computed (AR, a draft model). Set it before use_graphs: a compiled step is traced with
        it."""
        if layers is not None and not all(0 <= l < self.config.num_hidden_layers for l in layers):
            raise ValueError(f"feature layers {layers}: this model has layers 0.."
                             f"{self.config.num_hidden_layers - 1}")
        layers = None if layers is None else list(layers)
        if layers != self.feature_layers and self.static is not None:
            compiled = self.static.compiled
            self.feature_layers, self.static = layers, None
            self.use_graphs(True, compiled)  # a step's outputs change: its graphs are made anew
        self.feature_layers = layers

    def use_graphs(self, graphs: bool | None, compile: bool | None = None):
        """graphs=None: CUDA graphs where the model is on CUDA (and not tensor parallel), the
        dynamic eager path elsewhere (unless compile=True); True: decode steps and verifications
        padded to static shapes (StaticSteps, below), each shape captured once as a CUDA graph and
        replayed on CUDA, run uncaptured on the CPU; False: dynamic shapes, eager.
        compile: on that static path, torch.compile: on CUDA every layer's halves (compiled_halves),
        which the graphs replay; on the CPU, which replays nothing, the whole body as one graph
        (compiled_body). None: where graphs are captured (CUDA); True on the CPU turns the static
        path on with it."""
        on_cuda = self.device.type == "cuda"
        if compile and self.tp is not None:
            raise ValueError("compiled steps are not implemented with tensor parallelism: run "
                             "with --no-compile (compile=False)")
        if graphs is None:
            graphs = (on_cuda or compile is True) and self.tp is None
        if graphs and self.tp is not None:
            raise ValueError("CUDA graphs are not implemented with tensor parallelism: run with "
                             "--no-graphs (graphs=False)")
        compile = on_cuda and graphs if compile is None else compile
        if compile and not graphs:
            raise ValueError("compile=True compiles the static-shape steps that CUDA graphs "
                             "replay: leave graphs on, or turn compiling off (--no-compile)")
        if not graphs:
            self.static = None
        elif (self.static is None or self.static.capture != on_cuda
              or self.static.compiled != compile):
            tag = f"{id(self):x}"
            self.static = StaticSteps(capture=on_cuda,
                                      halves=compiled_halves(tag) if compile and on_cuda else None,
                                      body=compiled_body(tag) if compile and not on_cuda else None)
        else:  # a model loaded once and decoded with again (generate(target=model), a bench
            # sweep) replays the graphs captured on its reused KV pool (new_cache(reuse=True))
            self.static.keep(self.kv_pool)

    def init_buffers(self):
        # not parameters: recomputed after loading (a model built on the meta device holds no
        # data), on the CPU: arithmetic on the meta device imports torch._dynamo (seconds)
        cfg, device = self.config, self.device
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(cfg)
            if cfg.token_ids is not None:
                token_of, row_of = vocab_maps(cfg.token_ids, cfg.vocab_size)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        if cfg.token_ids is not None:
            self.register_buffer("row_of", row_of.to(device), persistent=False)
            self.register_buffer("token_of", token_of.to(device), persistent=False)

    @property
    def device(self):
        return self.model.norm.weight.device

    @property
    def dtype(self):
        """The activations' (and float weights') dtype; a quantized layer stores its own."""
        return self.model.norm.weight.dtype

    def capture_seconds(self) -> float:
        """Seconds this model has spent capturing CUDA graphs (StaticSteps.capture_graph)."""
        return self.static.capture_seconds if self.static is not None else 0.0

    def new_cache(self, num_tokens: int, block_size: int = 16, reuse: bool = False,
                  prefix_caching: bool = False) -> PagedKVCache:
        """A paged KV cache for num_tokens tokens on this model's device, in its dtype. reuse: the
        pool of this model's last reuse=True call, emptied, when it holds num_tokens (its address,
        and with it every CUDA graph captured on it, stays valid), else a new one that replaces it
        (the graphs of the old one dropped): for a caller that owns the model, one cache at a time
        (the Verifier of generate(); its previous user must be done with the pool).
        prefix_caching: prompts share the full blocks they start with (kv_cache.py)."""
        if reuse and self.kv_pool is not None and self.kv_pool.holds(num_tokens, block_size):
            cache = self.kv_pool
            cache.reset()
        else:
            cache = self.new_pool(num_tokens, block_size)
        if reuse and cache is not self.kv_pool:
            if self.static is not None:
                self.static.keep(cache)  # the old pool's graphs go with it
            self.kv_pool = cache
        cache.prefix_caching = prefix_caching
        return cache

    def new_pool(self, num_tokens: int, block_size: int) -> PagedKVCache:
        cfg = self.config
        if self.tp:  # each rank caches only its own KV heads (and serves its own q heads)
            cfg = replace(cfg, num_key_value_heads=cfg.num_key_value_heads // self.tp.world,
                          num_attention_heads=cfg.num_attention_heads // self.tp.world)
        return PagedKVCache(cfg, num_tokens, block_size, self.device, self.dtype)

    def embed(self, tokens):
        if self.config.token_ids is not None:  # a draft's own vocabulary: its rows
            return self.model.embed_tokens(self.row_of[tokens])
        if self.config.padded_rows is not None:  # a token past the draft's rows reads its last
            return self.model.embed_tokens(tokens.clamp(max=self.config.rows - 1))
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
        if h.dtype == torch.float32 or isinstance(self.lm_head, QuantLinear):  # float32 out
            logits = self.lm_head(h)
        else:
            logits = matmul_fp32(h, self.lm_head.weight)
        if self.tp is not None:
            # every rank gathers the full logits (not only rank 0), so the ranks all run the
            # same accept/reject on the same numbers with identically seeded generators: lockstep
            parts = [torch.empty_like(logits) for _ in range(self.tp.world)]
            dist.all_gather(parts, logits.contiguous(), group=self.tp.group)
            logits = torch.cat(parts, -1)  # [..., V], rank order = vocabulary order
        if self.config.token_ids is not None:  # a draft's own rows, back over the vocabulary
            logits = over_vocab(logits, self.token_of, self.config.vocab_size)
        elif self.config.padded_rows is not None:  # -inf past its rows, or its extra rows dropped
            V = self.config.vocab_size
            logits = F.pad(logits[..., :V], (0, V - min(V, logits.shape[-1])), value=-math.inf)
        return logits.float()

    def forward(self, tokens, layers: list[int] | None = None):
        """Plain full forward without a cache: tokens [B, T] -> float32 logits [B, T, V]; with
        `layers`, (logits, the residual stream after each of them [B, T, len(layers), hidden])."""
        x, states = self.residual(tokens, len(self.model.layers), layers or [])
        return self.head(x) if layers is None else (self.head(x), states)

    def layer_states(self, tokens, layers: list[int]):
        """Plain forward without a cache, up to the highest of `layers` only: tokens [B, T] -> the
        residual stream after each listed layer, [B, T, len(layers), hidden] (the features an
        EAGLE head reads: eagle.py)."""
        return self.residual(tokens, max(layers) + 1, layers)[1]

    def residual(self, tokens, n_layers: int, layers: list[int]):
        """The first n_layers layers on tokens [B, T] without a cache -> (the residual stream after
        them [B, T, hidden], after each of `layers` [B, T, len(layers), hidden] or None)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.dtype)
        x, out = self.embed(tokens), {}
        for l, layer in enumerate(self.model.layers[:n_layers]):
            x = layer(x, cos, sin)
            if l in layers:  # only those: a plain forward keeps no layer's output
                out[l] = x
        return x, torch.stack([out[l] for l in layers], -2) if layers else None

    def forward_cached(self, cache: PagedKVCache, seq_ids: list[int], tokens, counts: list[int],
                       last_only: bool = False, prompt: bool = False):
        """Ragged cached forward. tokens: LongTensor [N] (or a list), the new tokens of each
        sequence in seq_ids back to back, counts[i] of them for sequence i; their K/V are appended
        to the cache. Returns float32 logits [N, V], or [b, V] (each sequence's last token) if
        last_only. A step whose rows all add the same few tokens (decode, verification) takes the
        static-shape path when it is on (`self.static`, below); the others plan and run here.
        prompt: a prefill's piece (PagedKVCache.meta: how its attention runs)."""
        if not torch.is_tensor(tokens):  # a list (prompts, a draft's pending tokens)
            tokens = to_device(torch.tensor(tokens, dtype=torch.long, device="cpu"), self.device)
        elif tokens.device != self.device:
            tokens = to_device(tokens, self.device)
        if self.static is not None and self.static.fits(counts):
            out = self.static.step(self, cache, seq_ids, tokens, counts[0])  # [b * T, V]
            if not last_only:
                return out
            last = lambda x: x.view(len(seq_ids), counts[0], -1)[:, -1]  # noqa: E731
            return (last(out[0]), out[1]) if self.feature_layers else last(out)
        return self.run(cache, tokens, cache.prepare(seq_ids, counts, prompt), last_only)

    def run(self, cache: PagedKVCache, tokens, meta: AttnMeta, last_only: bool = False,
            halves=None, body=None):
        """The device's part of a cached forward, given its plan's metadata: tokens [N] -> float32
        logits [N, V] ([b, V] if last_only). It reads no host values (a CUDA graph can hold it).
        halves: every layer's compiled halves (Block.forward); body: `logits` compiled whole, the
        head in it (compiled_body). With feature_layers: (logits, features [N, layers, hidden]),
        the features of every token even when last_only."""
        if body is not None:
            out = body(self, cache, tokens, meta, halves)
            if not last_only:
                return out
            return (out[0][meta.last], out[1]) if self.feature_layers else out[meta.last]
        x = Transformer.body(self, cache, tokens, meta, halves)
        x, features = x if self.feature_layers else (x, None)
        logits = self.head(x[meta.last] if last_only else x)
        return logits if features is None else (logits, features)

    def logits(self, cache: PagedKVCache, tokens, meta: AttnMeta, halves=None):
        """body, then head: tokens [N] -> float32 logits [N, V] (what compiled_body compiles);
        with feature_layers (logits, features)."""
        x = Transformer.body(self, cache, tokens, meta, halves)
        if self.feature_layers:
            return self.head(x[0]), x[1]
        return self.head(x)

    def body(self, cache: PagedKVCache, tokens, meta: AttnMeta, halves=None):
        """Embedding and layers: tokens [N] -> hidden states [N, hidden]; with feature_layers
        (hidden states, the listed layers' outputs [N, len(feature_layers), hidden])."""
        cos, sin = rope_cos_sin(self.inv_freq, meta.positions, self.dtype)
        x = self.embed(tokens)  # [N, hidden]
        kept = {}
        for l, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache.kv[l], meta, halves)
            if self.feature_layers and l in self.feature_layers:
                kept[l] = x
        if self.feature_layers:
            return x, torch.stack([kept[l] for l in self.feature_layers], -2)
        return x

    def prefill(self, cache: PagedKVCache, seq_ids: list[int], prompts: list[list[int]],
                chunk: int = PREFILL_CHUNK):
        """Cache every prompt token; returns float32 logits [b, V] after each prompt's last token.
        Forwards take at most `chunk` new tokens (a longer prompt goes in pieces, in order), so a
        forward's mask and attention work stay [chunk x context]: one 16k-token prompt in one
        forward would build a 16k x 16k mask per query head of a KV head. With prefix caching on
        (kv_cache.py), an empty sequence first takes the blocks its prompt starts with from the
        cache and feeds only the rest; its full blocks are registered once all are cached.
        With feature_layers: (logits, a list of each prompt's features [its tokens fed, layers,
        hidden])."""
        fresh = [cache.length(s) == 0 for s in seq_ids]
        done = [cache.reuse_prefix(s, p) for s, p in zip(seq_ids, prompts)]
        feats = [[] for _ in prompts]  # each prompt's pieces' features (feature_layers)
        pieces = {i: [p[s:s + chunk] for s in range(c, len(p), chunk)]
                  for i, (p, c) in enumerate(zip(prompts, done))}
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
                                         [len(pieces[i][0]) for i in rows], last_only=True,
                                         prompt=True)
            if self.feature_layers:
                logits, f = logits
                for i, part in zip(rows, f.split([len(pieces[i][0]) for i in rows])):
                    feats[i].append(part)
            for i, row_logits in zip(rows, logits):
                pieces[i].pop(0)
                if not pieces[i]:
                    del pieces[i]
                    last[i] = row_logits
        for s, p, f in zip(seq_ids, prompts, fresh):
            if f:
                cache.register(s, p)
        if self.feature_layers:
            return torch.stack(last), [torch.cat(f) for f in feats]
        return torch.stack(last)
