"""GGUF files (llama.cpp, ollama, LM Studio): the header (metadata and the tensor index), the
metadata as a ModelConfig, llama.cpp's tensor names as ours, and each tensor read by name
(`gguf_checkpoint`): dequantised, or as the integers of its blocks, which quantize.py's layouts hold
as they are. It only reads: checkpoint.py places what it yields into the model, and nothing else
reads GGUF.

A GGUF file is a header (metadata key/values, then an index of tensors: name, shape, quantisation
type, offset) followed by the tensor data, 32-byte aligned. Each row of a weight is quantised on
its own, in blocks of 32 or 256 values along the row. We parse the header here and let the `gguf`
package dequantise the blocks, one tensor at a time, into the model's parameters. (gguf's
GGUFReader makes a numpy view of every vocabulary string and merge: seconds per read, and run.py
reads a model's config several times.) `gguf` is imported only when a GGUF file is read.
"""
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from config import ARCHS, ModelConfig

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
    model_type = next((mt for mt, a in ARCHS.items() if a.gguf_name == arch), None)
    if model_type is None:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {fname}: this engine "
                         f"implements {', '.join(repr(a.gguf_name) for a in ARCHS.values())} "
                         f"(config.ARCHS)")

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
    # end of text, and the end-of-turn / end-of-message tokens chat models stop at (Llama 3:
    # <|eot_id|>, <|eom_id|>)
    eos = {m[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                          "tokenizer.ggml.eom_token_id") if k in m}
    return ModelConfig(
        model_type=model_type,
        vocab_size=get("vocab_size", 0) or g.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=gguf_rope_scaling(g),
        max_position_embeddings=get("context_length"),
        tie_word_embeddings="output.weight" not in g.tensors,  # no head stored: it is the embedding
        bos_token_id=m.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=sorted(eos),
    )


def gguf_rope_scaling(g: GGUFFile) -> dict | None:
    """Llama 3.1+'s long-context RoPE rescaling, which GGUF stores as a tensor of per-frequency
    divisors (rope_freqs.weight); None when the file has none."""
    if "rope_freqs.weight" not in g.tensors:
        return None
    t = g.tensors["rope_freqs.weight"]
    factors = import_gguf().quants.dequantize(g.raw(t), t.qtype).reshape(-1)  # [head_dim / 2]
    return {"rope_type": "freq_factors", "factors": factors.tolist()}


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
    w [heads * head_dim, ...]: a weight's rows, or a quantized weight's stored rows."""
    per_head = w.reshape(-1, head_dim // 2, 2, *w.shape[1:])  # [heads, d/2, 2 (pair), in]
    # [heads, 2 (half), d/2, in] -> [heads * d, in] (any trailing dims: a quantized row's blocks)
    return per_head.transpose(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------------------------------
# The checkpoint: its config and each tensor by our name, read only when the loader asks

def gguf_checkpoint(path: Path):
    """-> (config, [(our name, GGUFWeight)] for every tensor but rope_freqs.weight (the config's),
    the header) of a GGUF file; nothing is read past the header until checkpoint.place asks."""
    g = read_gguf(path)
    cfg = gguf_config(g)
    # llama.cpp's converter interleaved the rows of q and k (unpermute_qk undoes it, head by head)
    qk = ("attn_q.weight", "attn_k.weight") if cfg.arch.gguf_qk_permuted else ()
    weights = [(gguf_param_name(t.name),
                GGUFWeight(t.name, g.path.name, t.shape, GGUF_INTEGERS.get(t.qtype.name), g, t,
                           cfg.head_dim if t.name.endswith(qk) else None))
               for t in g.tensors.values() if t.name != "rope_freqs.weight"]
    return cfg, weights, g


@dataclass
class GGUFWeight:
    """One tensor of a GGUF file, as checkpoint.place reads it: read() in float32 (whole, or a
    tensor-parallel rank's slice) and, where its block type has integers, integers()."""
    key: str                       # its name in the file (blk.3.attn_q.weight), for messages
    file: str                      # the file's name
    shape: tuple[int, ...]
    blocks: "BlockType | None"     # its block type, where it has integers (GGUF_INTEGERS)
    g: GGUFFile
    t: GGUFTensor
    head_dim: int | None           # its rows are in llama.cpp's q/k order, per head of this size

    def read(self, dim: int | None = None, lo: int = 0, n: int = 0) -> torch.Tensor:
        """The tensor dequantised to float32, or its part [lo, lo + n) along dim. Each row of a
        weight is quantised on its own, so a slice of rows dequantises those rows only; a slice of
        columns (blocks run along the row) or of a bias (one row) is cut from the whole."""
        t, rows = self.t, dim == 0 and len(self.t.shape) > 1
        raw = self.g.raw(t)  # [rows, bytes per row]
        if rows:
            raw = raw[lo:lo + n]
        try:
            w = import_gguf().quants.dequantize(raw, t.qtype)  # float32 [rows, in]
        except NotImplementedError:
            raise ValueError(f"tensor {t.name!r} in {self.file} is stored as {t.qtype.name}, which "
                             f"the gguf package cannot dequantise: pip install -U gguf, or use a "
                             f"file with common types (Q4_K_M, Q8_0, F16)") from None
        w = torch.from_numpy(w.copy() if not w.flags.writeable else w)  # F32/F16: views of the file
        if self.head_dim:
            w = unpermute_qk(w, self.head_dim)
        if rows:
            return w.reshape(n, *t.shape[1:])
        w = w.reshape(t.shape)
        return w if dim is None else w.narrow(dim, lo, n)

    def integers(self):
        """The integers of its blocks with their scales (and mins): gguf_integers, rows in ours."""
        parts = gguf_integers(self.g.raw(self.t), self.t.qtype.name)
        if self.head_dim:  # rows only: the scales and mins of a row move with it
            parts = [p if p is None else unpermute_qk(p, self.head_dim) for p in parts]
        return parts


# --------------------------------------------------------------------------------------------------
# GGUF's block types as integers: each block holds float16 fields and small integers, w = q * scale
# (+ min) per group of 16 or 32 inputs, so the integers and the scales computed from the fields
# (in float32, as gguf's own dequantisation does) are quantize.py's layouts exactly. Each function
# takes the blocks b (uint8 [rows, blocks, bytes per block]) and returns q [rows, blocks, values
# per block] (an integer type) with scales and mins (or None) [rows, blocks, groups per block].

def f16(b, lo: int):
    """The float16 at bytes [lo, lo + 2) of every block -> float32 [rows, blocks]."""
    return b[..., lo:lo + 2].contiguous().view(torch.float16)[..., 0].float()


def nibbles(b):
    """Bytes [..., n] -> [..., 2n]: their low nibbles, then their high ones."""
    return torch.cat((b & 15, b >> 4), -1)


def bits_of_bytes(b):
    """Bytes [..., n] -> their bits [..., 8n], bit i of byte j at 8j + i (little-endian)."""
    return ((b[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1).flatten(-2)


def q8_0(b):  # d, 32 int8
    return b[..., 2:].contiguous().view(torch.int8), f16(b, 0)[..., None], None


def q4_0(b):  # d, 16 bytes of nibbles: w = d (q - 8)
    return nibbles(b[..., 2:]).to(torch.int16) - 8, f16(b, 0)[..., None], None


def q4_1(b):  # d, m, 16 bytes of nibbles: w = d q + m
    return nibbles(b[..., 4:]), f16(b, 0)[..., None], f16(b, 2)[..., None]


def q5_0(b):  # d, 4 bytes of fifth bits, 16 of nibbles: w = d (q - 16)
    q = nibbles(b[..., 6:]).to(torch.int16) | (bits_of_bytes(b[..., 2:6]).to(torch.int16) << 4)
    return q - 16, f16(b, 0)[..., None], None


def q5_1(b):  # d, m, 4 bytes of fifth bits, 16 of nibbles: w = d q + m
    q = nibbles(b[..., 8:]) | (bits_of_bytes(b[..., 4:8]) << 4)
    return q, f16(b, 0)[..., None], f16(b, 2)[..., None]


def k_scales(b):
    """Q4_K / Q5_K: the 8 six-bit scales and mins packed in bytes 4..15 -> two uint8 [..., 8]:
    bytes 0-3 hold scales 0-3 (low 6 bits), 4-7 mins 0-3; scales and mins 4-7 are the nibbles of
    bytes 8-11 with their top two bits in the top bits of bytes 0-3 and 4-7."""
    s = b[..., 4:16]
    sc = torch.cat((s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)), -1)
    m = torch.cat((s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)), -1)
    return sc, m


def k_nibbles(qs):
    """Q4_K / Q5_K's 128 bytes of nibbles -> [..., 8, 32]: byte l of chunk c (32 bytes) holds
    element l of group 2c in its low nibble and of group 2c + 1 in its high one."""
    qs = qs.unflatten(-1, (4, 32))  # [..., chunk, 32]
    return torch.stack((qs & 15, qs >> 4), -2).flatten(-3, -2)  # [..., 8, 32]


def q4_k(b):  # d, dmin, scales, 128 bytes of nibbles: 8 groups of 32, w = d sc q - dmin m
    sc, m = k_scales(b)
    q = k_nibbles(b[..., 16:]).flatten(-2)
    return q, f16(b, 0)[..., None] * sc, -f16(b, 2)[..., None] * m


def q5_k(b):  # as Q4_K, plus 32 bytes of fifth bits (bit i of byte l: element l of group i)
    sc, m = k_scales(b)
    high = (b[..., 16:48, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # [..., l, i]
    q = k_nibbles(b[..., 48:]) | (high.transpose(-1, -2) << 4)  # [..., 8, 32]
    return q.flatten(-2), f16(b, 0)[..., None] * sc, -f16(b, 2)[..., None] * m


def q6_k(b):
    """128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per 16 values), d:
    w = d sc (q - 32). Of a half of 128 values, element 32k + l (k = 0..3) has the low (k < 2)
    or high nibble of ql byte 32 (k % 2) + l and the bit pair k of qh byte l."""
    ql = b[..., :128].unflatten(-1, (2, 2, 32))  # [..., half, k % 2, l]
    low = torch.stack((ql & 15, ql >> 4), -3).flatten(-3, -2)  # [..., half, k, l]
    qh = b[..., 128:192].unflatten(-1, (2, 1, 32))  # [..., half, 1, l]
    high = (qh >> torch.arange(0, 8, 2, dtype=torch.uint8)[:, None]) & 3  # [..., half, k, l]
    q = (low | (high << 4)).to(torch.int16).flatten(-3) - 32
    return q, f16(b, 208)[..., None] * b[..., 192:208].contiguous().view(torch.int8), None


@dataclass(frozen=True)
class BlockType:
    bits: int    # the layout that holds its integers (4: 0..15 or -8..7, 8: int8)
    group: int   # inputs per scale
    mins: bool   # w = q * scale + min (else q * scale)
    size: int    # bytes per block
    decode: object


GGUF_INTEGERS = {"Q8_0": BlockType(8, 32, False, 34, q8_0),
                 "Q6_K": BlockType(8, 16, False, 210, q6_k),
                 "Q5_K": BlockType(8, 32, True, 176, q5_k),
                 "Q5_1": BlockType(8, 32, True, 24, q5_1),
                 "Q5_0": BlockType(8, 32, False, 22, q5_0),
                 "Q4_K": BlockType(4, 32, True, 144, q4_k),
                 "Q4_1": BlockType(4, 32, True, 20, q4_1),
                 "Q4_0": BlockType(4, 32, False, 18, q4_0)}


def gguf_integers(raw, qtype: str):
    """A GGUF tensor's blocks (raw: uint8 [rows, bytes per row]) -> (q [rows, in] integers,
    scales [rows, in / group], mins [rows, in / group] or None): w = q * scale (+ min)."""
    kind = GGUF_INTEGERS[qtype]
    b = torch.from_numpy(raw.copy()).view(raw.shape[0], -1, kind.size)  # [rows, blocks, bytes]
    q, scales, mins = kind.decode(b)
    rows = raw.shape[0]
    return (q.reshape(rows, -1), scales.reshape(rows, -1),
            None if mins is None else mins.reshape(rows, -1))


