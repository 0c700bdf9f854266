"""The paged KV cache: one pool of fixed-size blocks for all sequences, a block table per
sequence, reference counts so that SSD's branches share their common prefix (fork), rollback
(truncate), prefix caching (requests whose prompts start alike share those blocks), and what
attention needs from it: each forward's plan (slots, positions, block tables, mask; `AttnMeta`)
and `paged_attention`, which writes and reads K/V through the block tables (on a CPU, in float32,
`paged_attention_cpu`: the same math in one C++ op of cpu_kernels.cpp).

Prefix caching (nano-vllm's and vLLM's scheme). A full block of a prompt is named by a hash of its
tokens and, through the previous block's hash, of every token before it (`block_hashes`): two
prompts that agree on their first i full blocks have the same first i hashes. After a prefill the
prompt's full blocks are registered under their hashes (`register`), and when a row leaves, the
full blocks of its prompt and output (a chat's next turn starts with them); a new sequence whose
prompt starts with registered blocks takes them as they are (`reuse_prefix`, a reference each) and
its prefill feeds only the rest: at least its last token, whose logits the prefill returns. Only
full blocks of committed tokens are shared: every sequence writes only past its length, and its
length never goes below its prompt (rollback truncates speculation only), so a shared block is
never written; the partial last block is always the sequence's own. A registered block that nobody
holds stays in the free list and findable until the pool needs it: the free list hands out blocks
without a hash first, then registered ones least recently freed first (a sequence frees its blocks
last to first, so a prefix's tail goes before its head). Prompts prefilled together that agree on a
block each compute it; `register` keeps one (the later ones take it and free theirs), so that a
hash names one block while anyone holds it: scheduler.py counts a running request's shared blocks
once by their hashes on that ground. Both caches do this alone, the target's and the draft's (in
its own process in two-process SSD), each with its own hashes: a lookup decides only which K/V are
computed again, never the tokens.
"""
import hashlib
import itertools
import math
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import cpu_kernels
from devices import to_device

# --------------------------------------------------------------------------------------------------
# The paged KV cache
#
# One pool for the whole model, kv[layer, block, slot, 0 or 1 (K or V), kv_head, head_dim], so that
# kv[l] is layer l's [num_blocks, block_size, 2, n_kv_heads, head_dim] pool, each token's K and V
# side by side: a forward writes both with one indexed copy and reads a sequence's K and V back
# with one gather (a kernel each on a GPU, not two). A sequence is a
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
    rows: torch.Tensor         # [N] each new token's row of block_table: query_index // T
    mask: torch.Tensor | None  # [b, 1, g * T, max_blocks * block_size]: 0 where a query may look,
                               #   -inf elsewhere; g = query heads per KV head (paged_attention).
                               #   None where the CPU kernel attends (cpu_kernel)
    T: int                     # most new tokens of any sequence in this batch
    last: torch.Tensor         # [b] index in [N] of each sequence's last new token
    ragged: bool               # rows with fewer than T new tokens (else the padded [b, T] is [N])
    cpu_kernel: bool = False   # attention by paged_attention_cpu (PagedKVCache.cpu_kernel)


def block_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    """The hash chain of the full blocks of `tokens`: block i's digest covers its tokens and the
    digest of block i - 1, so it names every token up to the block's end (128 bits: a collision
    is as likely as guessing a random 16-byte key)."""
    out, h = [], b""
    for i in range(len(tokens) // block_size):
        chunk = array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes()
        h = hashlib.blake2b(h + chunk, digest_size=16).digest()
        out.append(h)
    return out


def shareable_hashes(prompt: list[int], block_size: int) -> list[bytes]:
    """The hashes of the blocks a prompt can take from the cache (`reuse_prefix`): its full
    blocks, less the last prompt token's when it ends one (that token is always prefilled)."""
    return block_hashes(prompt[:-1], block_size)


class PagedKVCache:
    def __init__(self, cfg, num_tokens: int, block_size: int = 16, device="cpu",
                 dtype=torch.float32, prefix_caching: bool = False):
        """cfg: the model's ModelConfig (layers, heads, KV heads, head_dim): a pool for
        num_tokens tokens (rounded up to whole blocks) on `device`, in `dtype`. prefix_caching:
        prompts share the full blocks they start with (the module's docstring)."""
        if block_size < 1 or num_tokens < 1:
            raise ValueError(f"KV cache needs block_size >= 1 and num_tokens >= 1 "
                             f"(got {block_size}, {num_tokens})")
        self.block_size = block_size
        self.group = cfg.num_attention_heads // cfg.num_key_value_heads  # g: q heads per KV head
        self.num_blocks = -(-num_tokens // block_size)
        shape = (cfg.num_hidden_layers, self.num_blocks, block_size, 2, cfg.num_key_value_heads,
                 cfg.head_dim)
        try:
            self.kv = torch.zeros(shape, device=device, dtype=dtype)
        except RuntimeError as e:  # the allocator's own message names neither the cache nor a fix
            if "alloc" not in str(e).lower():
                raise
            gib = math.prod(shape) * dtype.itemsize / 2**30
            raise ValueError(f"a KV cache of {num_tokens} tokens ({gib:.1f} GiB) does not fit on "
                             f"{device}: give fewer --kv-tokens, or with SSD a smaller --budget "
                             f"(the draft's cache holds B branches a row)") from None
        # a float32 pool on a CPU is attended by cpu_kernels.cpp's op where it runs
        self.cpu_kernel = (self.kv.device.type == "cpu" and dtype == torch.float32
                           and cpu_kernels.available())
        self.refcount = [0] * self.num_blocks
        # the free blocks in the order they are handed out: those without a hash first (the last
        # freed first), then the registered ones, least recently freed first
        self.free_blocks = OrderedDict.fromkeys(range(self.num_blocks))
        self.seqs: dict[int, Seq] = {}
        self._next_id = 0
        self._pad_block = None  # pad_block()
        self.prefix_caching = prefix_caching
        self.cached: dict[bytes, int] = {}   # hash -> its block (held, or free until reused)
        self.hash_of: dict[int, bytes] = {}  # block -> its hash, for the registered blocks
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens looked up, and found

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
        b, _ = self.free_blocks.popitem(last=False)
        if b in self.hash_of:  # a registered block nobody holds, the least recently used: evicted
            del self.cached[self.hash_of.pop(b)]
        self.refcount[b] = 1
        return b

    def _hold(self, b: int):
        """One more holder of block b (a free registered block leaves the free list)."""
        if self.refcount[b] == 0:
            del self.free_blocks[b]
        self.refcount[b] += 1

    def _release(self, b: int):
        self.refcount[b] -= 1
        if self.refcount[b] == 0:
            self.free_blocks[b] = None  # at the end: a registered block, evicted last
            if b not in self.hash_of:
                self.free_blocks.move_to_end(b, last=False)

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

    # -- prefix caching
    def reuse_prefix(self, sid: int, prompt: list[int]) -> int:
        """An empty sequence about to be prefilled with `prompt` takes the registered blocks its
        prompt starts with (never the last token's: the prefill must feed at least that one).
        -> how many of the prompt's tokens it holds now (the prefill feeds the rest)."""
        s = self.seqs[sid]
        if not self.prefix_caching or s.length:
            return 0
        self.prefix_queries += len(prompt)
        for h in shareable_hashes(prompt, self.block_size):
            b = self.cached.get(h)
            if b is None:
                break
            self._hold(b)
            s.blocks.append(b)
        s.length = len(s.blocks) * self.block_size
        self.prefix_hits += s.length
        return s.length

    def register(self, sid: int, prompt: list[int]):
        """After its prefill: the full blocks of `prompt` (the sequence's first tokens) become
        findable by their hashes. A hash some block holds already (a prompt prefilled beside this
        one): the sequence takes that block and frees its own, so one block per hash."""
        if not self.prefix_caching:
            return
        s = self.seqs[sid]
        for i, h in enumerate(block_hashes(prompt, self.block_size)):
            b, mine = self.cached.get(h), s.blocks[i]
            if b is None:
                self.cached[h], self.hash_of[mine] = mine, h
            elif b != mine:
                self._hold(b)
                self._release(mine)
                s.blocks[i] = b

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
            self.copy_block(b, src.blocks[n_full], rem)
            blocks = blocks + [b]
        new = self.new_seq()
        self.seqs[new] = Seq(blocks, length)
        return new

    def copy_block(self, dst: int, src: int, n: int):
        """Copy the first n slots of block src into block dst (a fork's partial block, a copy on
        write); a cache that keeps more per slot (eagle.HeadCache) copies that too."""
        self.kv[:, dst, :n] = self.kv[:, src, :n]

    def truncate(self, sid: int, length: int):
        """Roll back to the first `length` tokens; blocks that become empty are freed, last
        first (prefix caching evicts a freed prefix's tail before its head)."""
        s = self.seqs[sid]
        if not 0 <= length <= s.length:
            raise ValueError(f"truncate length {length} outside [0, {s.length}]")
        keep = -(-length // self.block_size)
        for b in reversed(s.blocks[keep:]):
            self._release(b)
        del s.blocks[keep:]
        s.length = length

    def free(self, sid: int):
        self.truncate(sid, 0)
        del self.seqs[sid]

    def reset(self):
        """Free every sequence and forget every hash: the pool as new, at the same address (the
        pad block stays taken). Old K/V stay in the freed blocks; nothing reads them (attention
        masks past each length)."""
        for sid in list(self.seqs):
            self.free(sid)
        self.cached.clear()
        self.hash_of.clear()
        self.prefix_queries = self.prefix_hits = 0

    def holds(self, num_tokens: int, block_size: int) -> bool:
        """Whether this pool serves a request for a new cache of num_tokens tokens."""
        return block_size == self.block_size and self.num_blocks >= -(-num_tokens // block_size)

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
            self.copy_block(new, old, bs)
            self._release(old)
            s.blocks[first] = new
        elif s.length % bs and s.blocks[first] in self.hash_of:
            # a registered block truncated into and written again: its hash no longer names it
            # (no caller truncates below a prompt; kept true for any that would)
            del self.cached[self.hash_of.pop(s.blocks[first])]
        while len(s.blocks) * bs < s.length + n:
            s.blocks.append(self._alloc())
        slots = [s.blocks[p // bs] * bs + p % bs for p in range(s.length, s.length + n)]
        s.length += n
        return slots

    def prepare(self, seq_ids: list[int], counts: list[int], prompt: bool = False) -> AttnMeta:
        """Append counts[i] tokens to each sequence and build the metadata of one forward (every
        layer uses it): the host's plan, one copy to the device, the device's part. prompt: the
        forward is a prefill's (see meta)."""
        host, shape = self.plan(seq_ids, counts)
        return self.meta(to_device(host, self.kv.device), *shape, prompt=prompt)

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

    def meta(self, ints: torch.Tensor, b: int, T: int, max_blocks: int,
             prompt: bool = False) -> AttnMeta:
        """The device's half: split the plan's int64 tensor (already on the device) and, for SDPA,
        build the attention mask. No host values are read, so a CUDA graph can hold this.
        Attention runs in cpu_kernels.cpp's op where the cache allows it (cpu_kernel), except for
        a prefill's pieces (prompt; a piece of up to 16 tokens that takes the static path is a
        step there):
        SDPA, which multiplies blocks of queries by blocks of keys, is the faster for them
        (SmolLM2-135M in int4, one thread, 64 new tokens after 200: 303 ms against 342).
        The decode loops' forwards (steps, verifications, branches) all take the kernel, so
        a token's logits are the same bit for bit however they batch it."""
        N = (ints.numel() - b - b * max_blocks - b * T) // 3
        slots, positions, query_index, last, table, qpos = ints.split(
            [N, N, N, b, b * max_blocks, b * T])
        cpu_kernel = self.cpu_kernel and not prompt
        return AttnMeta(slots, positions, table.view(b, max_blocks), query_index,
                        query_index // T, None if cpu_kernel else self.mask(qpos, b, T, max_blocks),
                        T, last, ragged=N != b * T, cpu_kernel=cpu_kernel)

    def mask(self, qpos: torch.Tensor, b: int, T: int, max_blocks: int) -> torch.Tensor:
        """SDPA's mask (paged_attention) for queries at positions qpos [b * T]: causal within and
        across rounds, the rows repeated g times, one copy per query head of a KV head -> additive
        float [b, 1, g * T, L], built once per forward (SDPA would convert a bool mask per layer).
        The CPU kernel reads the positions themselves, so its forwards build none (their eight
        small ops took 0.1 ms of a 6 ms decode step)."""
        keys = torch.arange(max_blocks * self.block_size, device=qpos.device)
        qpos = qpos.view(b, 1, 1, T).expand(b, 1, self.group, T).reshape(b, 1, -1, 1)
        allowed = keys.view(1, 1, 1, -1) <= qpos
        mask = torch.zeros(allowed.shape, dtype=self.kv.dtype, device=qpos.device)
        return mask.masked_fill_(~allowed, float("-inf"))


def bucket(n: int) -> int:
    """The next power of two >= n."""
    return 1 << (n - 1).bit_length()


def paged_attention(q, k, v, kv_layer, meta: AttnMeta):
    """Reference paged attention: write the new K/V through the block table, gather each sequence's
    K/V back into a padded batch, and run SDPA with a mask. Works on any device and block size.
    q [N, nh, hd], k/v [N, nkv, hd] -> [N, nh, hd].

    Grouped-query attention is folded into the query length: the g = nh / nkv query heads that
    read one KV head become g * T queries of that head, so SDPA sees as many heads in q as in K/V
    and needs no `enable_gqa` (with which, and a mask, CUDA falls back to the math kernel that
    materialises every score); the mask is built for that layout (PagedKVCache.prepare)."""
    if meta.mask is None:
        raise ValueError("this forward's plan was made for the CPU kernel, which needs no mask: "
                         "attend with paged_attention_cpu, or plan on a cache with cpu_kernel off")
    nb, bs, _, nkv, hd = kv_layer.shape
    # one write of the new tokens' K and V, [N, 2, nkv, hd], into their slots
    kv_layer.view(nb * bs, 2, nkv, hd)[meta.slots] = torch.stack((k, v), 1).to(kv_layer.dtype)
    b, T, nh = meta.block_table.shape[0], meta.T, q.shape[1]
    # index_select copies whole blocks, K and V together: faster than indexing token by token
    # [b * max_blocks, bs, 2, nkv, hd] -> [b, L, 2, nkv, hd] -> K, V [b, nkv, L, hd]
    kv = kv_layer.index_select(0, meta.block_table.flatten()).view(b, -1, 2, nkv, hd)
    keys, vals = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    # rows with fewer than T new tokens are padded to [b, T]; a uniform step is that layout already
    qp = q.new_zeros(b * T, nh, hd).index_copy_(0, meta.query_index, q) if meta.ragged else q
    # [b*T, nh, hd] -> [b, T, nkv, g, hd] -> [b, nkv, g, T, hd] -> [b, nkv, g*T, hd]
    qp = qp.view(b, T, nkv, nh // nkv, hd).permute(0, 2, 3, 1, 4).reshape(b, nkv, -1, hd)
    y = F.scaled_dot_product_attention(qp, keys, vals, attn_mask=meta.mask)  # [b, nkv, g*T, hd]
    # [b, nkv, g*T, hd] -> [b, nkv, g, T, hd] -> [b, T, nkv, g, hd] -> [b*T, nh, hd]
    y = y.view(b, nkv, nh // nkv, T, hd).permute(0, 3, 1, 2, 4).reshape(b * T, nh, hd)
    return y[meta.query_index] if meta.ragged else y


def paged_attention_cpu(q, k, v, kv_layer, meta: AttnMeta):
    """paged_attention's math in one C++ op (cpu_kernels.cpp, float32 on a CPU): each new token's
    query heads read its sequence's K and V where they lie in the pool, up to its own position, so
    nothing is gathered or masked. A token's output is bit for bit the same whatever the tokens
    beside it (a decode step, a verification, a batch) and the thread count; it agrees with
    paged_attention to float rounding. Eager and compiled steps (model.compiled_body) both call it,
    where AttnMeta.cpu_kernel says so (PagedKVCache.meta). On SmolLM2-135M in int4 (one thread,
    100 tokens of context) it took 30 layers of attention from 2.05 ms to 0.66, the compiled step
    from 17.3 ms to 12.8 (docs/design.md, section 6). q [N, nh, hd], k/v [N, nkv, hd] ->
    [N, nh, hd]."""
    return torch.ops.ssd.paged_attention_cpu(q, k, v, kv_layer, meta.slots, meta.block_table,
                                             meta.rows, meta.positions)


# paged_attention as an operator that torch.compile calls as it is, without looking in: a compiled
# CPU step (model.compiled_body) holds a whole forward, and this op's write goes into the pool
# itself. Traced, a write into a slice of an input copies the whole input (the pool) and writes it
# back, every layer of every step. Its schema tells the compiler that it writes kv_layer. A
# torch.library definition, not torch.library.custom_op: that wrapper costs some 50 us a call here
# (one call a layer), this one about 5. Defined when a model first compiles its body, not at import:
# defined in every process, it held a tensor-parallel rank whose peer was killed for 60 s at exit.
OPS = []  # the Library that defines the op, once defined (it must stay alive)


def define_paged_attention_op():
    if OPS:
        return
    lib = torch.library.Library("ssd", "FRAGMENT")
    lib.define("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_layer, Tensor slots, "
               "Tensor block_table, Tensor query_index, Tensor mask) -> Tensor")
    lib.impl("paged_attention", _paged_attention, "CompositeExplicitAutograd")
    torch.library.register_fake("ssd::paged_attention", lambda q, *rest: q.new_empty(q.shape),
                                lib=lib)
    OPS.append(lib)


def paged_attention_op(q, k, v, kv_layer, meta: AttnMeta):
    """paged_attention through the operator (what a compiled forward calls). T and ragged are read
    back from the tensors' shapes inside it: passed as numbers, each T would compile a graph."""
    return torch.ops.ssd.paged_attention(q, k, v, kv_layer, meta.slots, meta.block_table,
                                         meta.query_index, meta.mask)


def _paged_attention(q, k, v, kv_layer, slots, block_table, query_index, mask):
    b, T = block_table.shape[0], mask.shape[2] // (q.shape[1] // k.shape[1])  # mask [b, 1, g*T, L]
    meta = AttnMeta(slots, None, block_table, query_index, None, mask, T, None, q.shape[0] != b * T)
    return paged_attention(q, k, v, kv_layer, meta).contiguous()  # the strides the fake promises
