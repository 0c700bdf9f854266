"""Weight-only quantization: linear layers (and the embedding) whose weights are stored in 8 or 4
bits, swapped in for nn.Linear when a model is loaded (checkpoint.load_model, `quant=`).

Why: a decode step reads every weight once, so on a CPU (and on a GPU at small batch) its time is
the weights' bytes over the memory's bandwidth. Stored in int8 a weight reads 4x fewer bytes than in
float32, in int4 about 6x fewer (with its scales); the activations stay in float (weight-only).

Two layouts, one per bit width. The common GGUF block types (Q8_0, Q6_K, Q5_K, Q5_0/1,
Q4_K, Q4_0/1) are integers with a scale (and a min) per group of 16 or 32 inputs, so they go into
these layouts exactly, without a float copy (gguf_format.gguf_integers, QuantRows.copy_integers):
  int8: qweight int8 [out, in] and scales float32 [out, in / G]: w = q * scale, one scale per G
        consecutive inputs of a row (G = in, one per output channel, for safetensors quantized
        here; G = 32 for GGUF's Q8_0, 16 for Q6_K). A layer that holds a GGUF type with a min
        (Q5_1, Q4_K, Q5_K in int8) also has mins float32 [out, in / G]: w = q * scale + min.
  int4: qweight uint8 [out, in / 32, 16], scales and mins float32 [out, in / 32]: w = q * scale +
        min with q in 0..15, per block of 32 inputs. Byte j of a block holds element j in its low
        nibble and element j + 16 in its high one (GGUF's Q4_0 / Q4_1 block; Q4_0's w = d (q - 8)
        is scale d, min -8 d).
Our layouts hold scales in float32, not the file's float16: converting them inside the product
cost more time than their bytes save (the LM head's 1-row product, one thread: 5.3 ms with float16
scales, 3.5 ms with float32). cpu_kernels.cpp's int4 layout (cpu_kernels.int4_to_cpu_kernel) holds
them in float16, which its kernel converts 8 at a time in registers (F16C).

The product x W^T for a few rows of x (a decode step, a verification) is a multiply-and-sum over
the stored weight: `int8_product` / `int4_product` write it as one reduction per row of x over the
dequantised expression, which torch.compile (Inductor) turns into one loop that reads each stored
byte once and converts it in registers: the float weight never exists in memory (dequantising,
then a matmul, writes and reads it: slower than float32 itself, as are torch's stock int8/int4
CPU kernels on float32 activations).
Each weight shape compiles once per row bucket (ROW_BUCKETS; a few seconds each, at load:
warm_up). Longer inputs (prefill) dequantise a slice of rows at a time and multiply: they are
bound by arithmetic, not bytes.

On a CPU with AVX2 (or AVX-512) the products then run in cpu_kernels.cpp's C++ ops, built at first
use with the compiler torch.compile uses (cpu_kernels.py; pack_layers): each row of x becomes 16-bit
integers per block of 32 and multiplies the 4- or 8-bit weights in integer arithmetic
(cpu_kernels.cpp explains it). An int4 layer of the model's blocks moves into the op's tiled layout
(`pack`); an int8 layer (the head) runs on ours. Where the ops do not build, torch's own int4
kernel (_weight_int4pack_mm_for_cpu) runs the int4 layers: half their speed (SmolLM2-135M's 120
layers, one thread: 8.2 ms a step against 4.1), in bfloat16 (docs/models.md measures both).
These kernels compute each row of the output on its own, bit for bit the same whatever the rows
beside it; a layer pack_layers put on one runs every product through it (decode steps,
verifications and prefill pieces agree on each row). A layer left in our layout (all on CUDA or
without AVX2, int8 ones where cpu_kernels.cpp does not build, any that fits no kernel) runs
`product`: compiled up to ROW_BUCKETS[-1] rows, `dequantised_product` for more (a prefill; any
number with compiled=False), whose rows need not match the compiled product's bit for bit.
The quantized model approximates the float one (docs/models.md measures how closely); speculative
decoding stays exact with respect to the model as loaded: the quantized target decides.
"""
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

import cpu_kernels
from cpu_kernels import (BLOCK, int4_cpu_product, int4_cpu_weight, int4_to_cpu_kernel,
                         int8_cpu_product)
from huge_pages import into_huge_pages

QUANTS = ("auto", "none", "int8", "int4")  # auto: a GGUF file's own precision, else none
ROW_BUCKETS = (1, 2, 3, 4, 8, 16)  # row counts the compiled product is built for (rows padded up)
DEQUANT_ELEMENTS = 1 << 23  # a longer product dequantises at most this many weights at a time


def check_quant(quant: str, name: str = "quant"):
    """A one-line error for a quant no loader takes."""
    if quant not in QUANTS:
        raise ValueError(f"unknown {name} {quant!r}: use one of {', '.join(QUANTS)}")


# --------------------------------------------------------------------------------------------------
# The math: quantize, dequantize, multiply (pure functions)

def quantize_int8(w, group: int):
    """w [out, in] float -> (q int8 [out, in], scales float32 [out, in / group]), symmetric:
    scale = max |w| / 127 over each group, q = round(w / scale)."""
    out, n = w.shape
    wg = w.float().reshape(out, n // group, group)
    scales = wg.abs().amax(-1) / 127
    q = torch.round(wg / scales.clamp(min=1e-30)[..., None]).clamp(-127, 127)
    return q.to(torch.int8).reshape(out, n), scales


def quantize_int4(w):
    """w [out, in] float -> (q uint8 [out, in / 32, 16], scales, mins float32 [out, in / 32]),
    asymmetric per block of 32: min = the block's smallest value, scale = (max - min) / 15,
    q = round((w - min) / scale) in 0..15, packed two to a byte (the module docstring)."""
    out, n = w.shape
    wb = w.float().reshape(out, n // BLOCK, BLOCK)
    mins, maxs = wb.amin(-1), wb.amax(-1)
    scales = (maxs - mins) / 15
    q = torch.round((wb - mins[..., None]) / scales.clamp(min=1e-30)[..., None]).clamp(0, 15)
    return pack_int4(q), scales, mins


def pack_int4(q):
    """Integers 0..15 [out, in] (any dtype) -> uint8 [out, in / 32, 16], two to a byte: element j
    of a block in byte j's low nibble, element j + 16 in its high one."""
    q = q.to(torch.uint8).reshape(q.shape[0], -1, 2, 16)  # [out, blocks, low | high, 16]
    return q[:, :, 0] | (q[:, :, 1] << 4)


def dequantize(q, scales, mins=None):
    """The float32 weights of stored rows (any leading dims): int8 q [..., in] with scales
    [..., in / G] (and mins, where the layer has them), or int4 q [..., in / 32, 16] with scales
    and mins [..., in / 32] -> [..., in]."""
    if q.dtype == torch.int8:
        G = q.shape[-1] // scales.shape[-1]
        w = q.unflatten(-1, (-1, G)).float() * scales[..., None]  # [..., in / G, G]
        return (w if mins is None else w + mins[..., None]).flatten(-2)
    halves = torch.stack((q & 15, q >> 4), -2).float()  # [..., blocks, 2, 16]: elements 0-15, 16-31
    w = halves * scales[..., None, None] + mins[..., None, None]
    return w.flatten(-3)


def int8_product(x, q, scales, mins=None):
    """x [M, in] float32 @ (q * scales (+ mins))^T -> [M, out]. One reduction per row of x over
    the same expression of the weight, so that Inductor's loop converts each weight once for all
    M rows."""
    G = q.shape[1] // scales.shape[1]
    w = q.view(q.shape[0], -1, G).to(x.dtype) * scales[:, :, None]  # [out, in / G, G]
    if mins is not None:
        w = w + mins[:, :, None]
    xg = x.view(x.shape[0], 1, -1, G)  # [M, 1, in / G, G]
    return torch.stack([(xg[i] * w).sum((-1, -2)) for i in range(x.shape[0])])


def int4_product(x, q, scales, mins):
    """x [M, in] float32 @ (the int4 weight)^T -> [M, out], the weight's low and high nibbles
    (elements 0-15 and 16-31 of each block) multiplied by the matching halves of x."""
    s, m = scales[:, :, None], mins[:, :, None]
    low = (q & 15).to(x.dtype) * s + m   # [out, blocks, 16]
    high = (q >> 4).to(x.dtype) * s + m
    xb = x.view(x.shape[0], -1, 2, 16)   # [M, blocks, low | high, 16]
    return torch.stack([(xb[i, :, 0] * low + xb[i, :, 1] * high).sum((-1, -2))
                        for i in range(x.shape[0])])


def int4_to_kernel(q, scales, mins):
    """Our int4 layout -> torch's int4 kernel's, on q's device: (packed, in the kernel's own order,
    which depends on the CPU (uint8 [out, in / 2]) or is CUDA tinygemm's (int32 tiles, 8 inner
    k-tiles); scales_and_zeros bfloat16 [in / 32, out, 2]). The kernel's weight is w = (q - 8) * s
    + z, so z = min + 8 * scale; s and z are rounded to bfloat16."""
    ints = torch.stack((q & 15, q >> 4), -2).flatten(1).to(torch.int32)  # [out, in], 0..15
    if q.device.type == "cuda":  # tinygemm takes the integers two to a byte, even ones high
        packed = torch.ops.aten._convert_weight_to_int4pack(
            (ints[:, ::2] << 4 | ints[:, 1::2]).to(torch.uint8), 8)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(ints, 1)
    sz = torch.stack((scales, mins + 8 * scales), -1).transpose(0, 1)  # [in / 32, out, 2]
    return packed, sz.contiguous().to(torch.bfloat16)


def int4_kernel_fits(out_features: int, in_features: int, device) -> bool:
    """Whether torch's int4 kernel takes a layer of this shape on this device."""
    if torch.device(device).type == "cuda":
        return out_features % 8 == 0 and in_features % 128 == 0
    return out_features % 16 == 0


def int4_kernel_product(x, packed, sz):
    """x [M, in] float @ the packed weight^T -> [M, out] bfloat16 through torch's int4 kernel: x
    rounded to bfloat16, products summed in float32, the result rounded to bfloat16."""
    mm = (torch.ops.aten._weight_int4pack_mm if x.device.type == "cuda"
          else torch.ops.aten._weight_int4pack_mm_for_cpu)
    return mm(x.to(torch.bfloat16).contiguous(), packed, BLOCK, sz)


def int4_kernel_weight(packed, sz):
    """The weight [out, in] in the packed layout, as the kernel multiplies by it, run on an
    identity matrix (slow; for checks). On the CPU its float32 path: that may fuse (q - 8) * s + z
    into one rounding, so it can differ from the bfloat16 path's weight by a float32 rounding; on
    CUDA, where tinygemm takes bfloat16 only, to bfloat16's rounding."""
    eye = torch.eye(sz.shape[0] * BLOCK, device=sz.device)
    if sz.device.type == "cuda":
        return int4_kernel_product(eye, packed, sz).float().T
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, BLOCK, sz.float()).T


def renamed(fn, tag: str):
    """A copy of fn under its own name: torch.compile keeps graphs (at most 8) and which sizes
    varied per function name, so each weight shape (or model) gets its own."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}",
                               co_qualname=f"{fn.__qualname__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name)


# The compiled products, one per weight layout and shape and CPU thread count: (bits, group, out,
# in, has mins, threads) -> the product through torch.compile, which keeps one graph per row
# bucket. Dynamo guards its graphs on the thread count too, so a process that runs at 1 and 2
# threads (bench.py) would give one function 2 x 6 buckets, past its limit of 8 graphs: each
# count gets its own. A memo of compiled code (as torch.compile's own caches are), shared by every
# model of the process.
KERNELS = {}


def product(x, q, scales, mins):
    """x [M, in] float32 @ the stored weight^T -> [M, out], any M: up to ROW_BUCKETS[-1] rows
    through the compiled product for the weight's shape (compiled on first use), the rows padded
    to a bucket; more (a prefill) by dequantised_product."""
    M, n = x.shape
    if M > ROW_BUCKETS[-1]:
        return dequantised_product(x, q, scales, mins)
    bits = 8 if q.dtype == torch.int8 else 4
    key = (bits, n // scales.shape[1], q.shape[0], n, mins is not None, torch.get_num_threads())
    if key not in KERNELS:
        fn = int8_product if bits == 8 else int4_product
        KERNELS[key] = torch.compile(renamed(fn, "_".join(map(str, key))), dynamic=False,
                                     fullgraph=True)
    bucket = next(b for b in ROW_BUCKETS if b >= M)
    if bucket > M:  # rows padded to the bucket the kernel was compiled for
        x = F.pad(x, (0, 0, 0, bucket - M))
    with torch.no_grad():  # one grad mode, or each mode compiles its own graphs
        return KERNELS[key](x, q, scales, mins)[:M]


def dequantised_product(x, q, scales, mins):
    """x [M, in] @ the stored weight^T, a slice of the weight's rows at a time dequantised to
    float and multiplied: for many rows (a prefill), which are bound by arithmetic, not bytes."""
    step = max(1, DEQUANT_ELEMENTS // x.shape[1])
    return torch.cat([F.linear(x, dequantize(*(t[lo:lo + step] for t in (q, scales, mins)
                                                if t is not None)))
                      for lo in range(0, q.shape[0], step)], -1)


@torch.library.custom_op("ssd::quant_product", mutates_args=())
def quant_product(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                  mins: torch.Tensor | None) -> torch.Tensor:
    """product() as an op that torch.compile does not look into: a compiled step
    (model.compiled_halves) calls the compiled product of a few rows as it is. Traced into the
    step's own loops, Inductor fused it worse (a 3-token verification of SmolLM2-135M in int4:
    108 ms against 46 ms for 1 token); a 1-row product it fuses well, and is traced
    (QuantLinear.forward)."""
    return product(x, q, scales, mins)


@quant_product.register_fake
def _(x, q, scales, mins):
    return x.new_empty(x.shape[0], q.shape[0])


# --------------------------------------------------------------------------------------------------
# The layers

class QuantLinear(nn.Module):
    """An nn.Linear whose weight is stored quantized (the layouts above): y = x W^T (+ bias), in
    x's dtype, or in float32 (out_dtype) for an LM head. mins: an int8 layer with a min per group
    (int4 always has them). compiled: a few rows' product through
    the compiled kernels (quant_product), else eager: dequantise and multiply (a test's reference,
    and where compiling is off)."""

    def __init__(self, in_features: int, out_features: int, bits: int, group: int | None = None,
                 bias: bool = False, device=None, dtype=torch.float32, compiled: bool = True,
                 mins: bool = False):
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"bits={bits}: quantized layers are int8 or int4")
        group = BLOCK if bits == 4 else (group or in_features)
        if in_features % group or (bits == 4 and group != BLOCK):
            raise ValueError(f"a {bits}-bit layer of {in_features} inputs cannot have groups of "
                             f"{group}: int4 needs inputs in blocks of {BLOCK}, int8 groups that "
                             f"divide the inputs; load this model with quant='none'")
        self.in_features, self.out_features, self.bits, self.group = (in_features, out_features,
                                                                      bits, group)
        self.out_dtype = None  # None: x's dtype
        self.compiled = compiled
        n = in_features // group
        if bits == 8:
            q = torch.empty(out_features, in_features, dtype=torch.int8, device=device)
        else:
            q = torch.empty(out_features, n, 16, dtype=torch.uint8, device=device)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", torch.empty(out_features, n, device=device))
        self.register_buffer("mins", torch.empty(out_features, n, device=device)
                             if bits == 4 or mins else None)
        # the kernel that runs the products, where pack_layers chose one (else None): "cpu"
        # cpu_kernels.cpp's (an int4 weight moved into its layout by pack(), an int8 one as it is),
        # "torch" torch's int4 kernel (CUDA's tinygemm, or its CPU form), moved there by pack()
        self.kernel = None
        self.register_buffer("packed", None)
        self.register_buffer("scales_and_zeros", None)
        self.bias = (nn.Parameter(torch.empty(out_features, device=device, dtype=dtype),
                                  requires_grad=False) if bias else None)

    def stored(self, lo: int = 0, hi: int | None = None):
        """(q, scales[, mins]) of rows [lo, hi); a packed layer's (packed, scales_and_zeros), whole:
        the kernel's order interleaves rows."""
        if self.packed is not None:
            if (lo, hi) != (0, None):
                raise ValueError("a layer in an int4 kernel's layout (pack) has no rows of its "
                                 "own: load the model with compile_quant=False to edit them")
            return self.packed, self.scales_and_zeros
        parts = (self.qweight, self.scales) + ((self.mins,) if self.mins is not None else ())
        return tuple(t[lo:hi] for t in parts)

    def dequantize(self, lo: int = 0, hi: int | None = None):
        """The float32 weight of rows [lo, hi) -> [rows, in]."""
        if self.packed is not None:
            weight = int4_cpu_weight if self.kernel == "cpu" else int4_kernel_weight
            return weight(self.packed, self.scales_and_zeros)[lo:hi]
        return dequantize(*self.stored(lo, hi))

    def pack(self, kernel: str = "torch"):
        """Move this int4 layer into an int4 kernel's layout: "cpu", cpu_kernels.cpp's
        (int4_to_cpu_kernel), or "torch", torch's own (int4_to_kernel). Every product from now
        on, of any number of rows, goes through that kernel. Our layout's tensors are released:
        the kernels' take 5 bits a weight (4 + two 16-bit numbers per 32), ours 6."""
        if self.packed is not None:
            return
        if self.bits != 4 or not int4_kernel_fits(self.out_features, self.in_features,
                                                  self.qweight.device):
            raise ValueError(f"the int4 kernels take int4 layers of a multiple of 16 outputs "
                             f"(CUDA: 8 outputs, 128 inputs), not {self}")
        to_kernel = int4_to_cpu_kernel if kernel == "cpu" else int4_to_kernel
        self.packed, self.scales_and_zeros = to_kernel(self.qweight, self.scales, self.mins)
        self.kernel = kernel
        self.qweight = self.scales = self.mins = None

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.stored())

    def path(self) -> str:
        """Which product this layer runs (a name of PRODUCTS, below), from what load chose: its
        kernel (pack, pack_layers) or its own layout, compiled or not."""
        if self.kernel is not None:
            return f"int{self.bits} {self.kernel}"
        return f"int{self.bits} {'compiled' if self.compiled else 'dequantised'}"

    def forward(self, x):
        y = PRODUCTS[self.path()](self, x.reshape(-1, self.in_features))  # [M, out]
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.out_dtype or x.dtype).view(*x.shape[:-1], self.out_features)

    def compiled_product(self, rows):
        """rows [M, in] float32 @ the weight in our layout^T -> [M, out] float32, compiled."""
        stored = (self.qweight, self.scales, self.mins)
        if torch.compiler.is_compiling():  # a compiled step (compiled_halves, compiled_body)
            # a layer's decode-step product, fused with the step's other work; not an LM head's
            # (out_dtype): traced with the final norm, SmolLM2-135M's int8 head made a step
            # without cpu_kernels.cpp 1.18x slower than through its own compiled product
            if rows.shape[0] == 1 and self.out_dtype is None:
                return (int8_product if self.bits == 8 else int4_product)(rows, *stored)
            return quant_product(rows, *stored)
        return product(rows, *stored)

    def rows(self, lo: int, hi: int) -> "QuantRows":
        return QuantRows(self, lo, hi)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int{self.bits}, group={self.group}"
                + (", mins" * (self.bits == 8 and self.mins is not None))
                + (f", {self.kernel} kernel" * (self.kernel is not None)))


# Which product a quantized layer runs, by QuantLinear.path: the one place that names them all.
# `run.py --explain` prints how many layers of the target run each (`products`). x: [M, in].
PRODUCTS = {
    "int4 cpu": lambda m, x: int4_cpu_product(x, m.packed, m.scales_and_zeros),  # cpu_kernels.cpp
    "int4 torch": lambda m, x: int4_kernel_product(x, m.packed, m.scales_and_zeros),  # torch's
    "int8 cpu": lambda m, x: int8_cpu_product(x, m.qweight, m.scales, m.mins),  # cpu_kernels.cpp
    # our layout, either width: compiled up to ROW_BUCKETS[-1] rows, dequantised past; or
    # dequantised always
    **{f"int{b} compiled": lambda m, x: m.compiled_product(x.float().contiguous()) for b in (4, 8)},
    **{f"int{b} dequantised": lambda m, x: dequantised_product(x.float(), m.qweight, m.scales,
                                                              m.mins) for b in (4, 8)},
}


def products(model: nn.Module) -> dict[str, int]:
    """How many of the model's quantized layers run each product (PRODUCTS), and how many of its
    decoder layers run an eager step as one C++ call (model.Block.use_one_call)."""
    count = {}
    for m in model.modules():
        name = (m.path() if isinstance(m, QuantLinear) and not isinstance(m, QuantEmbedding) else
                "layer in one call" if getattr(m, "one_call", None) is not None else None)
        if name is not None:
            count[name] = count.get(name, 0) + 1
    return count


class QuantRows:
    """Rows [lo, hi) of a QuantLinear, as a loader fills them (checkpoint.py): the float weight's
    shape; take a checkpoint's tensor, which goes through copy_ from a float tensor (quantized
    here, one tensor at a time) or copy_integers from integers with their scales (a GGUF file's
    blocks); copy_stored from the layout's tensors."""

    def __init__(self, layer: QuantLinear, lo: int, hi: int):
        self.layer, self.lo, self.hi = layer, lo, hi
        self.shape = torch.Size((hi - lo, layer.in_features))

    def quantize(self, w):
        """w [rows, in] float -> the layout's tensors for these rows (an int8 layer's mins 0)."""
        if self.layer.bits == 4:
            return quantize_int4(w)
        q, scales = quantize_int8(w, self.layer.group)
        return (q, scales) + ((torch.zeros_like(scales),) if self.layer.mins is not None else ())

    def copy_(self, w):
        self.copy_stored(*self.quantize(w.reshape(self.shape)))
        return self

    def take(self, w):
        """One tensor of a checkpoint (checkpoint.place): a GGUF file's integers as they are where
        this layout holds their block type (no float copy, no rounding), else read as float and
        quantized here."""
        kind = w.blocks
        if kind and self.holds(kind.bits, kind.group, kind.mins):
            self.copy_integers(*w.integers())
        else:
            self.copy_(w.read())

    def holds(self, bits: int, group: int, has_mins: bool) -> bool:
        """Whether integers of `bits` bits (4: 0..15 or -8..7; 8: -128..127) with a scale (and a
        min, has_mins) per `group` inputs go into this layer's layout exactly."""
        layer = self.layer
        if layer.bits == 4:
            return bits == 4 and group == BLOCK
        return group % layer.group == 0 and (layer.mins is not None or not has_mins)

    def copy_integers(self, q, scales, mins=None):
        """Rows as integers q [rows, in] with a scale (and a min) per group of consecutive inputs,
        w = q * scale (+ min), into this layer's layout without rounding (holds() says where it
        can): groups split to the layer's, a symmetric int4 q (-8..7) shifted to 0..15."""
        layer, split = self.layer, q.shape[1] // scales.shape[1] // self.layer.group
        scales = scales.repeat_interleave(split, 1)  # the same scale for each part of a group
        mins = None if mins is None else mins.repeat_interleave(split, 1)
        if layer.bits == 4:
            if mins is None:
                q, mins = q + 8, -8 * scales
            parts = pack_int4(q), scales, mins
        else:
            if mins is None and layer.mins is not None:
                mins = torch.zeros_like(scales)
            parts = (q.to(torch.int8), scales) + ((mins,) if mins is not None else ())
        self.copy_stored(*parts)

    def copy_stored(self, *parts):
        for dst, src in zip(self.layer.stored(self.lo, self.hi), parts):
            if tuple(dst.shape) != tuple(src.shape):
                raise ValueError(f"stored rows of shape {tuple(src.shape)} do not fit a "
                                 f"{self.layer} of {tuple(dst.shape)}")
            dst.copy_(src)


def split_rows(layer, sizes: list[int]) -> list:
    """A linear layer's weight rows in consecutive parts of `sizes` rows, as loaders fill a fused
    layer (q | k | v): views of an nn.Linear's weight, QuantRows of a QuantLinear."""
    if not isinstance(layer, QuantLinear):
        return list(layer.weight.split(sizes))
    ends = torch.tensor(sizes).cumsum(0).tolist()
    return [layer.rows(end - n, end) for n, end in zip(sizes, ends)]


class QuantEmbedding(QuantLinear):
    """An embedding [num_embeddings, dim] stored in a layout above, which dequantises only the
    rows it looks up, into `dtype`. A tied LM head's embedding shares the head's tensors (tied)."""

    def __init__(self, num_embeddings: int, dim: int, bits: int, group: int | None = None,
                 mins: bool = False, device=None, dtype=torch.float32):
        super().__init__(dim, num_embeddings, bits, group, device=device, compiled=False,
                         mins=mins)
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = num_embeddings, dim

    @staticmethod
    def tied(head: QuantLinear, dtype) -> "QuantEmbedding":
        emb = QuantEmbedding(head.out_features, head.in_features, head.bits, head.group,
                             head.mins is not None, "meta", dtype)
        emb.qweight, emb.scales, emb.mins = head.qweight, head.scales, head.mins
        return emb

    def forward(self, ids):
        return dequantize(*(t[ids] for t in self.stored())).to(self.dtype)


# --------------------------------------------------------------------------------------------------
# Swapping the layers of a model (built on the meta device, before its weights are loaded)

def quantize_model(model: nn.Module, quant: str, kinds: dict | None, device, dtype,
                   compiled: bool = True) -> bool:
    """Swap in the quantized layers that `quant` asks for (quantize_layers); -> whether any.
    model: built on the meta device; kinds: a GGUF file's block types by layer
    (checkpoint.block_kinds), None for safetensors.
    int8 is per output channel from safetensors, in groups of 32 (Q8_0's) from a GGUF file. With
    int4 the LM head and the embedding are int8, as llama.cpp's Q4 files keep them at 6 or 8 bits:
    the head decides every token and is where 4 bits cost agreement most.
    auto on a GGUF file: each layer in the layout that holds its tensors' block types exactly
    (gguf_format.GGUF_INTEGERS): int4 where all are 4-bit, else int8 in the smallest group among
    them (16 with Q6_K), with mins where one has a min; a layer with any other type stays float.
    Tensor parallelism slices float weights only: there auto stays float, int8 / int4 refuse."""
    check_quant(quant)
    if model.tp is not None and quant in ("int8", "int4"):
        raise ValueError(f"quant={quant!r} with tensor parallelism is not implemented: load "
                         f"the model with quant='none' (--quant none), or on one device")
    if quant == "none" or (quant == "auto" and (kinds is None or model.tp is not None)):
        return False
    if quant != "auto":  # a layer whose inputs do not split into int4 blocks refuses (QuantLinear)
        bits, group = (8 if quant == "int8" else 4), (BLOCK if kinds is not None else None)
        layouts = {name: (bits, group, bits == 4) for name, m in model.named_modules()
                   if type(m) is nn.Linear}
        layouts |= {"lm_head": (8, group, False), "model.embed_tokens": (8, group, False)}
    elif all(k is None for ks in kinds.values() for k in ks):
        return False  # a float file (F32 / F16 / BF16)
    else:
        layouts = {module: (4, BLOCK, True) if all(k.bits == 4 for k in ks)
                   else (8, min(k.group for k in ks), any(k.mins for k in ks))
                   for module, ks in kinds.items() if None not in ks}
    quantize_layers(model, layouts, device, dtype, compiled)
    return True


def quantize_layers(model: nn.Module, layouts: dict, device, dtype, compiled: bool = True):
    """Replace the model's nn.Linear layers (and its embedding) that `layouts` names with
    quantized ones whose storage is allocated on `device` (contents uninitialised: the loader
    fills them). layouts: {name: (bits, group, mins)} for "lm_head", "model.embed_tokens" and each
    layer's name (model.layers.3.self_attn.qkv_proj): 8 or 4 bits, the int8 group size (None: per
    output channel), whether an int8 layer has mins; a layer it does not name stays float.
    compiled: the CPU/GPU product through torch.compile (else eager)."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}".lstrip(".")
            if type(child) is not nn.Linear or (layout := layouts.get(full)) is None:
                continue
            bits, group, mins = layout
            layer = QuantLinear(child.in_features, child.out_features, bits, group,
                                child.bias is not None, device, dtype, compiled, mins)
            setattr(module, child_name, layer)
    head = getattr(model, "lm_head", None)
    if isinstance(head, QuantLinear):
        head.out_dtype = torch.float32  # logits in float32, as the float model's head gives
    emb = model.model.embed_tokens
    if model.config.tie_word_embeddings and isinstance(head, QuantLinear):
        model.model.embed_tokens = QuantEmbedding.tied(head, dtype)  # the head's rows, read back
    elif (layout := layouts.get("model.embed_tokens")) is not None:
        model.model.embed_tokens = QuantEmbedding(emb.num_embeddings, emb.embedding_dim,
                                                  *layout, device=device, dtype=dtype)


def pack_layers(model: nn.Module, device, cuda: bool = False,
                blocks: nn.Module | None = None) -> int:
    """Move the model's quantized layers into the kernels that run them fastest here. On a CPU
    with AVX2 or AVX-512 where cpu_kernels.cpp builds (cpu_kernels.available): the int4 layers of
    the model's blocks into its int4 kernel's layout (QuantLinear.pack), and every int8 layer of
    32-input blocks, the head included, onto its int8 kernel (which reads our own layout, so a tied
    embedding keeps sharing the head's rows). Where it does not build: the int4 layers into
    torch's int4 kernel (elsewhere the compiled product is faster than these kernels' scalar
    loops). On CUDA the compiled product stays the default until tinygemm is measured against
    it: scripts/gpu_check.py times both (`quant_step:*:int4`), calling this with cuda=True.
    blocks: where its int4 layers are (default: the model's decoder layers).
    With cpu_kernels.cpp's kernels, every quantized tensor then moves into memory of 2 MB pages
    (huge_pages.py). Returns how many layers it moved into a kernel."""
    device = torch.device(device)
    if device.type == "cpu" and torch.backends.cpu.get_cpu_capability() in cpu_kernels.KERNEL_CPUS:
        kernel = "cpu" if cpu_kernels.available() else "torch"
    elif device.type == "cuda" and cuda:
        kernel = "torch"
    else:
        return 0
    blocks = model.model.layers if blocks is None else blocks
    int4 = [m for m in blocks.modules() if isinstance(m, QuantLinear)
            and m.bits == 4 and int4_kernel_fits(m.out_features, m.in_features, device)]
    for m in int4:
        m.pack(kernel)
    int8 = [m for m in model.modules() if type(m) is QuantLinear and m.bits == 8
            and m.in_features % BLOCK == 0 and m.group % BLOCK == 0] if kernel == "cpu" else []
    for m in int8:
        m.kernel = "cpu"
    if kernel == "cpu":
        into_huge_pages([m for m in model.modules() if isinstance(m, QuantLinear)],
                        ("packed", "scales_and_zeros", "qweight", "scales", "mins"))
    return len(int4) + len(int8)


def warm_up(model: nn.Module, rows) -> int:
    """Compile every quantized layer's product for the row buckets that `rows` (row counts a run
    will multiply) fall in, before any decode clock starts. Returns how many products it ran."""
    layers = {(m.bits, m.group, m.out_features, m.in_features): m for m in model.modules()
              if isinstance(m, QuantLinear) and m.compiled and m.kernel is None}
    buckets = sorted({next(b for b in ROW_BUCKETS if b >= r) for r in rows
                      if 1 <= r <= ROW_BUCKETS[-1]})
    device = next(model.buffers()).device
    with torch.no_grad():
        for layer, M in ((layer, M) for layer in layers.values() for M in buckets):
            layer(torch.zeros(M, layer.in_features, device=device))
    return len(layers) * len(buckets)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as stored: parameters and quantized storage, each tensor once
    (a tied head and embedding share theirs)."""
    quant = [t for m in model.modules() if isinstance(m, QuantLinear) for t in m.stored()]
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *quant]}
    return sum(t.nbytes for t in tensors.values())
