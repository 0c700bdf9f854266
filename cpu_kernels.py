"""The CPU's own kernels: cpu_kernels.cpp's C++ ops (torch.ops.ssd.int4_mm, int8_mm: quantize.py's
products; paged_attention_cpu: kv_cache.py's attention), built here at first use and loaded.

They are built with the C++ compiler that torch.compile uses ($CXX, or g++) against the installed
torch's headers, into a library cached per source, flags and torch version (CACHE_DIR), so a second
process loads it in milliseconds. Where they cannot run (a CPU without AVX2, no compiler), one
warning says why, and PyTorch's own forms run instead: slower, the same model.
"""
import hashlib
import os
import subprocess
import threading
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
KERNEL_CPUS = ("AVX2", "AVX512")  # torch's name for the vector instructions the kernels use


def cache_dir() -> Path:
    """Where this user's ssd files live, the one rule for all of them (this library; the records
    of records_dir() by default): $XDG_CACHE_HOME/ssd, or ~/.cache/ssd where it is unset."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ssd"


def records_dir() -> Path:
    """Where the engine keeps what it learnt or built for this user (cpu_linear's forms, the
    tokenizers built from GGUF files): cache_dir(), or $SSD_CACHE_DIR where set (the tests' own,
    so that they never read a user's records; the kernels' library, a pure build product, stays
    in cache_dir())."""
    return Path(os.environ.get("SSD_CACHE_DIR") or cache_dir())


CACHE_DIR = cache_dir()  # the library's, fixed at import (tests point it elsewhere)
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-std=c++20", "-shared", "-fPIC"]


# The instructions beyond AVX2 that cpu_kernels.cpp takes where the CPU has them: /proc/cpuinfo's
# name for each, and the compiler's flags. AVX-VNNI multiplies and adds 16-bit pairs in one
# instruction (dot_pairs); AVX-512 (BW for its 16-bit integers) the int4 product two units of the
# weights at a time (tiles512), with its own VNNI, which VL gives to 256-bit registers too
# (dot_pairs on a CPU without AVX-VNNI); AMX's tiles the int4 product of 16 and more rows, 7 rows
# a multiply (tiles_amx: prefills). Every form gives the same bits.
EXTRA_FLAGS = {"avx_vnni": ["-mavxvnni"], "avx512bw": ["-mavx512f", "-mavx512bw"],
               "avx512vl": ["-mavx512vl"], "avx512_vnni": ["-mavx512vnni"],
               "amx_int8": ["-mamx-tile", "-mamx-int8"]}


def cpu_flags() -> tuple[str, ...]:
    """The EXTRA_FLAGS of the instructions this CPU has, less those named in $SSD_KERNELS_WITHOUT
    (comma-separated /proc/cpuinfo names, e.g. amx_int8): a guest that lists an instruction it
    runs badly, or a comparison of two forms (the same bits either way)."""
    cpuinfo = Path("/proc/cpuinfo")
    have = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    without = set(filter(None, os.environ.get("SSD_KERNELS_WITHOUT", "").split(",")))
    if unknown := without - set(EXTRA_FLAGS):
        raise ValueError(f"SSD_KERNELS_WITHOUT names {', '.join(sorted(unknown))}: the "
                         f"instructions it can leave out are {', '.join(EXTRA_FLAGS)}")
    return tuple(flag for name, flags in EXTRA_FLAGS.items() if name in have - without
                 for flag in flags)


# available()'s answer once found (a process loads the library once), and the lock that makes
# threads loading models at once build and load it once
LOADED = {}
LOCK = threading.Lock()


def available() -> bool:
    """Whether cpu_kernels.cpp's ops run here: built on first use (seconds) and loaded. False on a
    CPU without AVX2, or where they do not build (a warning says why)."""
    with LOCK:
        if "ok" not in LOADED:
            LOADED["ok"] = (torch.backends.cpu.get_cpu_capability() in KERNEL_CPUS
                            and build_and_load(SOURCE, cpu_flags()))
        return LOADED["ok"]


def build_and_load(source: Path, extra: tuple[str, ...] = ()) -> bool:
    """available()'s work: compile `source` with FLAGS and `extra` (cpu_flags()) into CACHE_DIR
    unless it is there, and load it. A compiler that does not know an extra flag (GCC before 11
    and -mavxvnni) builds the AVX2 form instead."""
    # here, not at import: it imports setuptools, which a script that imported pip first cannot
    # import again (its distutils check), and `import model` needs none of it
    from torch.utils import cpp_extension
    cmd = [os.environ.get("CXX", "g++"), *FLAGS, *extra,
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
           *(f"-I{p}" for p in cpp_extension.include_paths()), str(source),
           *(f"-L{p}" for p in cpp_extension.library_paths()), "-ltorch", "-ltorch_cpu", "-lc10"]
    key = hashlib.sha256(source.read_bytes() + " ".join(cmd + [torch.__version__]).encode())
    lib = CACHE_DIR / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not lib.exists():
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")  # two processes may build it at once
        try:
            lib.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(cmd + ["-o", str(tmp)], check=True, capture_output=True, text=True)
            os.replace(tmp, lib)
        except (OSError, subprocess.CalledProcessError) as e:
            tmp.unlink(missing_ok=True)
            if extra:
                return build_and_load(source)
            why = (getattr(e, "stderr", None) or str(e)).strip().splitlines()
            warnings.warn(f"{source.name} did not build ({why[-1] if why else cmd[0] + ' failed'}):"
                          f" quantized layers use torch's int4 kernel and compiled int8 products,"
                          f" attention PyTorch's SDPA, slower; install g++ (or set CXX) to use it")
            return False
    torch.ops.load_library(str(lib))
    # what torch.compile needs to trace a call without running it: the output's shape
    torch.library.register_fake("ssd::int4_mm")(
        lambda x, packed, sm: x.new_empty(x.shape[0], packed.shape[0] * sm.shape[-1]))
    torch.library.register_fake("ssd::int8_mm")(
        lambda x, q, scales, mins: x.new_empty(x.shape[0], q.shape[0]))
    torch.library.register_fake("ssd::paged_attention_cpu")(lambda q, *rest: q.new_empty(q.shape))
    return True


# --------------------------------------------------------------------------------------------------
# The ops from Python: the int4 layout they read, the products, and their math in float64 (tests)

BLOCK = 32     # inputs per int4 block (and per int8 group of a GGUF file): GGUF's block size
INT4_TILE = 8  # outputs per tile of the int4 layout


def int4_to_cpu_kernel(q, scales, mins):
    """Our int4 layout -> cpu_kernels.cpp's: (packed uint8 [out / 8, in / 32, 4, 32], sm float16
    [out / 8, in / 32, 2, 8]). Per tile of 8 outputs and block of 32 inputs, 4 units of 8 inputs,
    each 16 16-bit words: word 2 r + e holds output r's input 8 u + 2 j + e in its nibble j; then
    the tile's 8 scales and 8 mins for the block, in float16 (a Q4_0 / Q4_1 file's own d and m
    exactly)."""
    N, G = scales.shape
    T = N // INT4_TILE
    # [out, blocks, low | high, 16], a block's 32 inputs in order -> [tile, r, block, unit, j, e]
    ints = torch.stack((q & 15, q >> 4), -2).to(torch.int16).view(T, INT4_TILE, G, 4, 4, 2)
    words = ints[..., 0, :] | ints[..., 1, :] << 4 | ints[..., 2, :] << 8 | ints[..., 3, :] << 12
    packed = words.permute(0, 2, 3, 1, 4).contiguous()  # [tile, block, unit, r, e]
    sm = torch.stack((scales, mins)).view(2, T, INT4_TILE, G)  # [s | m, tile, r, block]
    return packed.view(torch.uint8).view(T, G, 4, 32), sm.permute(1, 3, 0, 2).contiguous().half()


def int4_cpu_weight(packed, sm):
    """The weight [out, in] that cpu_kernels.cpp's layout stores: q * s + m in float32."""
    T, G = packed.shape[:2]
    words = packed.view(torch.int16).view(T, G, 4, INT4_TILE, 2).to(torch.int32)  # [.., r, e]
    ints = torch.stack([words >> (4 * j) & 15 for j in range(4)], -2)  # [.., unit, r, j, e]
    ints = ints.permute(0, 3, 1, 2, 4, 5).reshape(T * INT4_TILE, G, BLOCK).float()
    s, m = sm.float().permute(2, 0, 3, 1).reshape(2, T * INT4_TILE, G, 1)
    return (ints * s + m).flatten(1)


def int4_cpu_product(x, packed, sm):
    """x [M, in] float @ the weight in cpu_kernels.cpp's layout^T -> [M, out] float32: each row
    of x turned into 16-bit integers per block of 32, multiplied by the 4-bit integers in integer
    arithmetic (cpu_kernels.cpp says how)."""
    return torch.ops.ssd.int4_mm(x.float().contiguous(), packed, sm)


def rows16(x):
    """x [M, in] as cpu_kernels.cpp turns each row into 16-bit integers, in float64 (for tests):
    per block of 32, p = round(x * (32767 / max|x|)) with scale d = max|x| / 32767, and the
    block's sum of x -> (p [M, blocks, 32], d [M, blocks], sums [M, blocks])."""
    M, n = x.shape
    xb = x.float().view(M, n // BLOCK, BLOCK)
    amax = xb.abs().amax(-1, keepdim=True)
    # a tensor divided, as C divides: torch computes 32767 / amax as 32767 * (1 / amax)
    inv = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros_like(amax))
    return (torch.round(xb * inv).double(), (amax / 32767).double()[..., 0],
            xb.sum(-1).double())


def int4_cpu_reference(x, q, scales, mins):
    """int4_cpu_product's math in float64 (slow; for tests), from our layout's q, scales and mins
    (as float16 rounds them): y = sum over blocks of s * d * (q . p) + m * sum(x)."""
    p, d, xsum = rows16(x)
    ints = torch.stack((q & 15, q >> 4), -2).flatten(-2).double()     # [out, blocks, 32]
    qp = torch.einsum("ogk,mgk->mog", ints, p)                        # [M, out, blocks]
    return (qp * scales.double() * d[:, None] + mins.double() * xsum[:, None]).sum(-1)


def int8_cpu_product(x, q, scales, mins=None):
    """x [M, in] float @ (q * scales (+ mins))^T -> [M, out] float32 through cpu_kernels.cpp's
    int8 kernel, on our own int8 layout: x in 16-bit integers per block of 32, as for int4."""
    return torch.ops.ssd.int8_mm(x.float().contiguous(), q, scales, mins)


def int8_cpu_reference(x, q, scales, mins=None):
    """int8_cpu_product's math in float64 (slow; for tests): y = sum over blocks of s * d * (q . p)
    + sum over groups of m * sum(x)."""
    p, d, xsum = rows16(x)
    per = q.shape[1] // scales.shape[1] // BLOCK                       # blocks a group
    qp = torch.einsum("ogk,mgk->mog", q.double().view(q.shape[0], -1, BLOCK), p)
    y = (qp * scales.double().repeat_interleave(per, 1) * d[:, None]).sum(-1)
    if mins is not None:
        y = y + xsum.view(len(x), -1, per).sum(-1) @ mins.double().T  # [M, groups] @ m^T
    return y
