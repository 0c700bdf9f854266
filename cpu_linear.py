"""How a CPU computes a linear layer's product for a few rows: the fastest of three forms, chosen
by timing once per machine and remembered on disk.

model.py's layers are plain nn.Linear. On the CPU, 2..16 rows (a verification, a few branches)
can go three ways, the same product summed in other orders: "plain" y = x W^T; "transposed"
y^T = W x^T; "packed", MKL's GEMM on a copy of W laid out once for that row count (mkl_pack).
Which is fastest depends on the machine, the row count and the threads: W x^T wins on a 2-core
AMD EPYC (SmolLM2-135M verifying 3 tokens on one thread: 61-73 ms against 124-138 ms plain) and
is 2-3x slower on an AVX-512 Intel Xeon, whose BLAS multiplies 4 rows from memory in 1.6x the time
of 3 unless W is packed (SmolLM2-135M's 3072 x 576 weights, one thread: 0.72 ms for 3 rows; 1.08
plain, 0.74 packed for 4). docs/benchmarks.md, "The CPU's product forms", has the measurements.

use_forms(model, rows) is called where a model is loaded for a run (engine.build_engine for the
verifier, draft.load_draft for the draft), outside any decode clock: it swaps the model's
nn.Linear layers for FormLinear (the same parameters), and for each row count in `rows` reads each
weight shape's form from this machine's cache file (forms_file) or, where one is missing, times
the forms over the whole model (choose_forms, 1-3 s for SmolLM2-135M) and writes the choice
there. A row count it was not given runs plain: a forward never times.
"""
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import cpu_kernels

ROWS = range(2, 17)  # the row counts with a choice; 1 row and long prefills run plain
FORMS = ("plain", "transposed", "packed")


class FormLinear(nn.Linear):
    """An nn.Linear (the model's own weight and bias, not copies) whose products of 2..16 rows go
    in the form chosen for its weight shape: `forms`, shared by the model's layers of one shape,
    (row count M, threads) -> form; plain where none was chosen. Each layer packs its own weight
    for a row count that chose "packed" (use_forms does it at load)."""

    def __init__(self, linear: nn.Linear, forms: dict):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.forms = forms
        self.packs = {}  # M -> (the weight's identity when packed, its packed copy or None)

    def forward(self, x):
        if torch.compiler.is_compiling():  # a compiled layer (model.compiled_halves): Inductor's
            return F.linear(x, self.weight, self.bias)  # own product, traced as one op
        rows = x.reshape(-1, x.shape[-1])                                            # [M, in]
        form = self.forms.get((rows.shape[0], torch.get_num_threads()), "plain")
        if x.device.type != "cpu" or form == "plain":
            return F.linear(x, self.weight, self.bias)
        return self.product(rows, form).reshape(*x.shape[:-1], -1)

    def product(self, rows, form: str):
        """rows [M, in] @ W^T + b -> [M, out] in `form` (plain where a pack cannot be made)."""
        if form == "packed" and (pack := self.pack(rows.shape[0])) is not None:
            return mkl_linear(rows, pack, self.weight, self.bias)
        if form == "transposed":
            y = linear_transposed(rows, self.weight)
            return y if self.bias is None else y + self.bias
        return F.linear(rows, self.weight, self.bias)

    def pack(self, M: int):
        """This layer's weight packed by MKL for M rows, made on first use and again after the
        weight changed (loaded, trained); None where it cannot be: no MKL, not float32, a weight
        that is training (the packed GEMM has no backward), or no room for the copy."""
        w = self.weight
        if not MKL_PACK or w.dtype != torch.float32 or (w.requires_grad
                                                        and torch.is_grad_enabled()):
            return None
        # _version counts in-place writes (copy_, optimisers); a tensor made under
        # torch.inference_mode keeps none, and is not written after loading
        identity = (w.data_ptr(), None if w.is_inference() else w._version)
        if self.packs.get(M, (None,))[0] != identity:
            self.packs[M] = (identity, mkl_pack(w, M) if room_for(w.nbytes) else None)
        return self.packs[M][1]


def linear_transposed(x, w):
    """x [M, in] @ w [out, in]^T computed as (W x^T)^T -> [M, out], contiguous."""
    return (w @ x.t()).t().contiguous()  # [out, M] -> [M, out]


# MKL's packed GEMM (cblas_sgemm_pack, the kernel torch.compile's CPU backend uses for frozen fp32
# linears), in torch builds with MKL: x86 wheels, not Apple silicon
MKL_PACK = torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def mkl_pack(w, M: int):
    """w [out, in] float32 copied into MKL's layout for products with M rows."""
    return torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), M)


def mkl_linear(x, packed, w, bias=None):
    """x [M, in] @ w^T (+ bias) through w packed for M rows (mkl_pack) -> [M, out]."""
    return torch.ops.mkl._mkl_linear(x, packed, w, bias, x.shape[0])


def room_for(nbytes: int) -> bool:
    """Whether this machine keeps a quarter of its memory available after allocating nbytes
    (Linux's /proc/meminfo; False where it cannot tell): a packed copy per row count must never
    be what makes a large model run out of memory on a CPU."""
    try:
        info = dict(line.split(":") for line in open("/proc/meminfo"))
        available, total = (int(info[k].split()[0]) * 1024 for k in ("MemAvailable", "MemTotal"))
    except (OSError, KeyError, ValueError):
        return False
    return available - nbytes >= total // 4


# --------------------------------------------------------------------------------------------------
# Timing the forms

# A timing sweep streams at most about this many bytes of weights (then one layer of each shape
# not reached yet, the head): more than any CPU cache, so a model too large to sweep whole is timed
# from memory as its forward runs (an 8B model in float32: its first 1 GiB and its 2 GB head, 9
# sweeps in about the time of one 32 GB forward)
SWEEP_BYTES = 1 << 30


def sweep_of(layers: list, budget: int = SWEEP_BYTES) -> list:
    """The layers a timing sweep runs: `layers` (a model's Linears in forward order) while their
    weights come to less than `budget` bytes, then the first layer of each weight shape (`forms`)
    not reached yet."""
    out, nbytes, shapes = [], 0, set()
    for layer in layers:
        if nbytes < budget or id(layer.forms) not in shapes:
            out.append(layer)
            nbytes += layer.weight.nbytes
            shapes.add(id(layer.forms))
    return out


def choose_forms(layers: list, M: int, reps: int = 3, clock=time.perf_counter):
    """Time the forms for M rows and store each weight shape's fastest in its `forms`, under (M,
    threads). A timing is a sweep: every layer of sweep_of(layers) in turn, all in one form, as a
    forward streams them, so each product finds its weight where a forward finds it (in memory, or
    in the cache when the whole model fits). Timing each shape's layers alone, over and over, kept
    them in the Xeon's large cache: 8 of SmolLM2-135M's 3072 x 576 weights (56 MB) timed plain and
    packed equal for 4 rows, which cost 1.08 and 0.74 ms a weight in a forward, and the choice
    flipped from run to run (a 4-token verification 1.25 or 1.66 AR steps). `reps` sweeps per form,
    interleaved (a slow moment hits all); per shape the lowest median wins (fastest)."""
    sweep = sweep_of(layers)
    forms = FORMS[:2]
    # asked as the caller runs (a training weight under autograd gets no pack); the others
    # pack on first use
    if all(layer.pack(M) is not None for layer in sweep):
        forms = FORMS
    w = sweep[0].weight
    gen = torch.Generator(device=w.device).manual_seed(0)  # the caller's global RNG untouched
    x = {n: torch.randn(M, n, generator=gen, device=w.device).to(w.dtype)
         for n in sorted({layer.in_features for layer in sweep})}
    shapes = {id(layer.forms): layer.forms for layer in sweep}  # one shared `forms` per shape
    times = {(shape, form): [] for shape in shapes for form in forms}  # seconds per sweep
    with torch.no_grad():
        for _ in range(reps):
            for form in forms:
                spent = dict.fromkeys(shapes, 0.0)
                for layer in sweep:
                    t0 = clock()
                    layer.product(x[layer.in_features], form)
                    spent[id(layer.forms)] += clock() - t0
                for shape, seconds in spent.items():
                    times[shape, form].append(seconds)
    key = (M, torch.get_num_threads())
    for shape, shared in shapes.items():
        shared[key] = fastest({form: times[shape, form] for form in forms})
    for layer in layers:
        if layer.forms.get(key) != "packed":  # copies of the weights that no row count uses
            layer.packs.pop(M, None)


def fastest(times: dict) -> str:
    """The form (name -> its timings) with the lowest median; the first one on a tie."""
    return min(times, key=lambda name: sorted(times[name])[len(times[name]) // 2])


# --------------------------------------------------------------------------------------------------
# Once per machine: the choices on disk, and where a model takes them

def forms_file() -> Path:
    """This user's record of the chosen forms: cpu_linear_forms.json in
    cpu_kernels.records_dir()."""
    return cpu_kernels.records_dir() / "cpu_linear_forms.json"


def machine() -> str:
    """What a choice holds for: the CPU's model name and the torch build (its BLAS)."""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    return f"{cpu} | torch {torch.__version__}"


def form_key(here: str, layer: FormLinear, M: int, threads: int) -> str:
    """A choice's name in the file: the machine (here), threads, weight dtype and shape, rows."""
    w = layer.weight
    return f"{here} | {threads} threads | {str(w.dtype)[6:]} {w.shape[0]}x{w.shape[1]} | {M} rows"


def read_forms(path: Path) -> dict:
    """key -> form from the file; empty when it is missing or unreadable (then timed again)."""
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return {}


def write_forms(path: Path, new: dict):
    """Add `new` to the file: re-read and replaced whole (two processes may write at once; the
    last one wins and a lost entry is timed again). A cache that cannot be written is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**read_forms(path), **new}, indent=0, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass


def form_layers(model: nn.Module) -> list[FormLinear]:
    """The model's linear layers as FormLinear, in forward order (swapped in on the first call);
    the layers of one weight shape and dtype share one `forms`."""
    shared = {}
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                w = child.weight
                setattr(module, name, FormLinear(child, shared.setdefault((w.shape, w.dtype), {})))
            elif isinstance(child, FormLinear):
                shared.setdefault((child.weight.shape, child.weight.dtype), child.forms)
    return [m for m in model.modules() if isinstance(m, FormLinear)]


def use_forms(model: nn.Module, rows, path: Path | None = None) -> float:
    """Give a CPU model the fastest form for each row count of `rows` in 2..16, from this
    machine's cache file or timed now (then written there), and pack the weights that chose
    "packed": all before decoding starts. Returns the seconds spent timing (0.0 on a cache hit).
    A model on another device, or tensor-parallel, stays plain."""
    rows = sorted(set(rows) & set(ROWS))
    if (not rows or next(model.parameters()).device.type != "cpu"
            or getattr(model, "tp", None) is not None):
        return 0.0  # nn.Linear as it is: no layer pays FormLinear's lookup (AR's 1-row steps)
    layers, threads, path = form_layers(model), torch.get_num_threads(), path or forms_file()
    known, new, spent, here = read_forms(path), {}, 0.0, machine()
    for M in rows:
        for layer in layers:
            key = form_key(here, layer, M, threads)
            if (M, threads) not in layer.forms and known.get(key) in FORMS:
                layer.forms[M, threads] = known[key]
        if any((M, threads) not in layer.forms for layer in layers):
            t0 = time.perf_counter()
            choose_forms(layers, M)
            spent += time.perf_counter() - t0
            new.update({form_key(here, layer, M, threads): layer.forms[M, threads]
                        for layer in layers})
        with torch.no_grad():
            for layer in layers:
                if layer.forms[M, threads] == "packed":
                    layer.pack(M)
    if new:
        write_forms(path, new)
    return spent
