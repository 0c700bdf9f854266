"""The GPU check: one command that measures what only a GPU can show, with no network.

    python scripts/gpu_check.py                          # on a GPU: about 3 minutes (an H200)
    python scripts/gpu_check.py --device cpu --quick     # every check at tiny sizes (CI runs it)

Random-weight bf16 models shaped like Llama-3.2-1B and Llama-3.1-8B (built here, nothing is
downloaded), and the shipped tiny pair for the token checks. Each check adds one entry to a JSON
report {"checks": [{"name", "ok", ...figures}], ...} (--out; default docs/gpu_check_<device>.json)
and one line to the table printed at the end:

  versions        torch, CUDA, the device; on CUDA, torch's float32-output bf16 GEMM (>= 2.8)
  load            load_model's peak memory over the weights' bytes (1B shape, from a checkpoint
                  written here): parameters are allocated once, in bf16
  step:<shape>    decode-step and verification ms (batch 1, T = 1 and T = K + 1), eager,
                  replayed as CUDA graphs, and as CUDA graphs of the torch.compile'd layers (the
                  engine's default on CUDA), beside the step's memory-bandwidth floor (the bytes a
                  step reads: weights but the embedding table, + KV; over the bandwidth) and issue
                  14's targets (the engine's step <= 2x the floor for 1B, 1.3x for 8B); each
                  path's logits against eager's; kernels per step, their own time and the five
                  longest (eager and compiled), the attention kernel SDPA chose (torch.profiler)
  attention       the device's paged attention (the kernel SDPA picks there) against a float32
                  reference on the CPU written out by hand: decode, verification and prefill-chunk
                  shapes of the 1B model, ragged rows (graph vs eager and AR vs SD run one kernel)
  host_syncs      host-device synchronisations per AR, SD and SSD round (CUDA's sync debug mode;
                  a graph capture's own syncs are counted apart); on the CPU, the decode loop's
                  device-to-host reads (devices.to_host) and its host-to-device crossings, none of
                  which may bypass devices.to_device
  greedy          AR, SD and SSD (one process and two) emit the same greedy tokens in bf16; on a
                  GPU also SD with the target on the CPU and the draft on the GPU (the proposals
                  cross to the host: devices.to_device's blocking copy)
  sampling        temperature 1: the joint law of the first 3 tokens from AR, SD and SSD (one
                  process and two) against the exact law (a 4-token vocabulary, enumerated on the
                  CPU), within the sampling noise of N rows (float32)
  ssd:<devices>   two-process SSD on one GPU (time-sliced) and on two when there are two: tok/s
                  beside AR's and SD's (tiny pair, graphs on; graph captures timed apart), hit rate,
                  verifier wait
  long_prefill    memory of one long prompt's prefill (1B shape, in chunks as the engine does it):
                  the peak on a GPU, the largest allocation on the CPU, below one chunk's attention
                  scores (what a kernel that materialised them would allocate)

A check that fails records its error and the run goes on. The exit status is 1 if any check is
not ok. Whenever a GPU is at hand: run it, commit the report under docs/, act on what it shows.
"""
import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from checkpoint import checkpoint_params, load_model, materialize
from devices import MM_FP32_OUT, sync
from kv_cache import PagedKVCache, paged_attention
from config import ModelConfig
from graphs import StaticSteps
from model import PREFILL_CHUNK, Transformer
from quantize import QuantLinear, pack_layers, quantize_layers, weight_bytes
from run import generate  # noqa: E402

# HF config fields of the shapes (Llama-3.2-1B and Llama-3.1-8B), and their --quick stand-ins
SHAPES = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                     vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
}
QUICK_SHAPES = {
    # 4 KV heads as the 1B's 8: the CPU's attention copies its mask (g x chunk x context) to
    # float32, which with 2 would be as large as one chunk's bf16 scores (long_prefill's limit)
    "llama-1b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=8, vocab_size=512,
                     tie_word_embeddings=True, rope_theta=500000.0),
    "llama-8b": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
                     tie_word_embeddings=False, rope_theta=500000.0),
}
# HBM bandwidth in GB/s by a substring of the device name (datasheet figures)
# quantized steps (quantize.py): these shapes in int8 and int4, and Llama-3.1-70B in int4, which
# takes about 50 GB in this layout: the README's headline target on one H200
QUANT_SHAPES = {**{f"{n}:{q}": (f, q) for n, f in SHAPES.items() for q in ("int8", "int4")},
                "llama-70b:int4": (dict(hidden_size=8192, intermediate_size=28672,
                                        num_hidden_layers=80, num_attention_heads=64,
                                        num_key_value_heads=8, head_dim=128, vocab_size=128256,
                                        tie_word_embeddings=False, rope_theta=500000.0), "int4")}
# --quick checks the script, and each quantized shape compiles its products afresh (seconds a shape on
# a CI machine's CPU): the 8B stand-in alone, in int8 and in int4
QUICK_QUANT_SHAPES = {f"llama-8b:{q}": (QUICK_SHAPES["llama-8b"], q) for q in ("int8", "int4")}
BANDWIDTH_GBS = {"H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "L4": 300, "4090": 1008,
                 "A10": 600}
K = 4  # verification steps check T = K + 1


def hf_config(fields: dict) -> dict:
    return {"model_type": "llama", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "bos_token_id": 0, "eos_token_id": 1, **fields}


def random_model(fields: dict, device, dtype=torch.bfloat16, seed=0) -> Transformer:
    """A model of this shape with random weights (logits of order 1), built in place."""
    cfg = ModelConfig.from_hf(hf_config(fields))
    with torch.device("meta"):
        model = Transformer(cfg)
    materialize(model, device, dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.fill_(1.0)
        else:
            p.normal_(0, p.shape[1] ** -0.5, generator=g)
    model.init_buffers()
    return model.eval().requires_grad_(False)


def random_quant_model(fields: dict, device, quant: str, dtype=torch.bfloat16, seed=0):
    """A model of this shape in quant's layout (the head and embedding in int8, as load_model
    quantizes them), its codes and scales random (logits of order 1), built in place: no float
    copy, so a 70B shape fits one GPU."""
    cfg = ModelConfig.from_hf(hf_config(fields))
    with torch.device("meta"):
        model = Transformer(cfg)
    bits = 8 if quant == "int8" else 4
    layouts = {name: (8, None, False) if name == "lm_head" else (bits, None, bits == 4)
               for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    quantize_layers(model, {**layouts, "model.embed_tokens": (8, None, False)}, device, dtype)
    materialize(model, device, dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.qweight.view(torch.uint8).random_(0, 256, generator=g)
            # weights of spread ~ in^-1/2: int8 codes up to 127, int4 codes 0..15 about 8
            m.scales.fill_(m.in_features ** -0.5 / (73 if m.bits == 8 else 4.6))
            if m.mins is not None:
                m.mins.copy_(-7.5 * m.scales)
    for p in model.parameters():
        p.data.fill_(1.0)
    model.init_buffers()
    return model.eval().requires_grad_(False)


def write_checkpoint(model, fields: dict, path: Path) -> Path:
    """Save a model as an HF-format directory (config.json, model.safetensors) at `path`."""
    path.mkdir(exist_ok=True)
    state = checkpoint_params(model)  # HF names; a tied head is left out
    save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps({**hf_config(fields), "torch_dtype": dtype}))
    return path


def step_read_bytes(model) -> int:
    """The weight bytes a decode step reads: every parameter but the embedding table, of which it
    reads one row per token, unless the LM head is that table (tied embeddings)."""
    table = model.model.embed_tokens.weight
    tied = model.lm_head.weight is table
    return weight_bytes(model) - (0 if tied else table.numel() * table.element_size())


class Allocations(TorchDispatchMode):
    """Logs every tensor an aten op returns in fresh storage on a real device (factory ops, copies,
    arithmetic; views and in-place ops reuse their input's storage): (op, dtype, numel, bytes).
    The CPU has no allocator counters: the total bounds the peak from above, and the largest one
    shows a materialised score matrix. tests/test_dtype.py and tests/test_model.py use it too."""

    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {x.untyped_storage().data_ptr() for x in tree_leaves((args, kwargs))
                  if self.counted(x)}
        for x in tree_leaves(out):
            if self.counted(x):
                s = x.untyped_storage()
                if s.nbytes() and s.data_ptr() not in inputs:
                    self.log.append((str(func), x.dtype, x.numel(), s.nbytes()))
        return out

    @staticmethod
    def counted(x) -> bool:
        """A tensor with storage of its own: not on the meta device, and strided (an MKL packed
        weight, cpu_linear.mkl_pack, is opaque: made once per row count, not per forward)."""
        return (isinstance(x, torch.Tensor) and x.device.type != "meta"
                and x.layout == torch.strided)

    @property
    def total(self) -> int:
        return sum(a[3] for a in self.log)

    @property
    def largest(self) -> int:
        return max((a[3] for a in self.log), default=0)


@contextmanager
def peak_bytes(device):
    """-> a dict: "bytes", the peak allocated during the block beyond what was there before (CUDA)
    or the bytes of all tensors allocated during it (CPU, an upper bound), and "largest", the
    largest single allocation (CPU only)."""
    res = {}
    if torch.device(device).type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield res
        sync(device)
        res["bytes"] = torch.cuda.max_memory_allocated(device) - base
    else:
        with Allocations() as mode:
            yield res
        res["bytes"], res["largest"] = mode.total, mode.largest


# --------------------------------------------------------------------------------------------------
# The checks: each returns a dict of figures with "ok"

def check_versions(a):
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": a.device,
            "cuda": torch.version.cuda, "ok": True}
    if torch.device(a.device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(a.device)
        info["gpus"] = torch.cuda.device_count()
        info["cudnn"] = torch.backends.cudnn.version()
        # without it the engine refuses bf16 on CUDA (devices.resolve_dtype): install torch >= 2.8
        info["fp32_out_gemm"] = info["ok"] = "cuda" in MM_FP32_OUT
    return info


def check_load(a, shapes, work: Path):
    """Write a random 1B-shaped bf16 checkpoint, load it, compare the peak with its weights."""
    fields = shapes["llama-1b"]
    model = random_model(fields, "cpu")
    path = write_checkpoint(model, fields, work / "llama-1b")
    wbytes = weight_bytes(model)
    del model
    start = time.perf_counter()
    with peak_bytes(a.device) as peak:
        loaded, _ = load_model(path, device=a.device, dtype="bfloat16", tokenizer=False)
    seconds = time.perf_counter() - start
    ratio = peak["bytes"] / wbytes
    del loaded
    # the weights once, plus at most one tensor's staging copy and the RoPE buffer
    return {"weight_bytes": wbytes, "peak_bytes": peak["bytes"], "peak_over_weights": ratio,
            "seconds": seconds, "ok": ratio < 1.15}


def time_steps(model, cache, seq, T, n, device):
    """Median ms of n cached forwards of T tokens (rolled back after each)."""
    L = cache.length(seq)
    tokens = torch.randint(model.config.vocab_size, (T,), device=device)
    times = []
    for i in range(n + 3):
        sync(device)
        t = time.perf_counter()
        model.forward_cached(cache, [seq], tokens, [T], last_only=T == 1)
        sync(device)
        if i >= 3:  # warm-up
            times.append(time.perf_counter() - t)
        cache.truncate(seq, L)
    return 1000 * statistics.median(times)


class ComputeOps(TorchDispatchMode):
    """The aten ops a CPU step dispatches that compute or copy data (views and empty allocations
    left out): the CPU's stand-in for a GPU's kernels per step."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]  # aten.mm.default -> mm
        if not func.is_view and name not in ("empty", "empty_strided", "lift_fresh", "detach"):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def profile_step(model, cache, seq, device, halves=None):
    """Kernels launched by one decode step, eager or with these compiled layers (not captured:
    each launch seen), on CUDA; ComputeOps on the CPU; and the attention kernel names
    (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.device(device).type == "cuda"
    model.use_graphs(False)
    if halves is not None:
        model.static = StaticSteps(capture=False, halves=halves)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    L = cache.length(seq)
    tok = torch.randint(model.config.vocab_size, (1,), device=device)
    model.forward_cached(cache, [seq], tok, [1], last_only=True)  # warm-up: a new bucket's buffers
    cache.truncate(seq, L)
    ops = ComputeOps()
    with profile(activities=acts) as prof, (nullcontext() if cuda else ops):
        model.forward_cached(cache, [seq], tok, [1], last_only=True)
        sync(device)
    cache.truncate(seq, L)
    model.use_graphs(False)
    events = prof.events()
    gpu = [e for e in events if e.device_type.name == "CUDA"]
    attn = sorted({e.name for e in events
                   if any(s in e.name.lower() for s in ("flash", "efficient", "cudnn_attention",
                                                        "_scaled_dot_product", "fmha"))})
    if not cuda:
        return {"kernels": len(ops.ops), "attention_ops": attn}
    # where a step's device time goes: the kernels' own time, and the five that take most of it
    by_name = {}
    for e in gpu:
        by_name[e.name[:80]] = by_name.get(e.name[:80], 0.0) + e.time_range.elapsed_us()
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:5]
    return {"kernels": len(gpu), "attention_ops": attn,
            "kernel_ms": sum(by_name.values()) / 1000, "top_kernels_us": top}


# the targets for a graph-replayed decode step, over its bandwidth floor (H200)
FLOOR_TARGETS = {"llama-1b": 2.0, "llama-8b": 1.3}


def check_step(a, name, fields):
    """Eager and graph-replayed (padded, static-shape) steps of one shape: ms beside the floor,
    and the two paths' logits compared on the same step."""
    model = random_model(fields, a.device)
    ctx = 64 if a.quick else 1024
    cache = model.new_cache(ctx + K + 8 + 16, block_size=16)  # + the static path's pad block
    seq = cache.new_seq()
    model.forward_cached(cache, [seq], torch.randint(fields["vocab_size"], (ctx,),
                                                     device=a.device), [ctx], last_only=True)
    n = 5 if a.quick else 30
    out = {"shape": name, "context": ctx, "weight_bytes": weight_bytes(model),
           "step_read_bytes": step_read_bytes(model)}
    logits = {}
    tok = torch.randint(fields["vocab_size"], (K + 1,), device=a.device)
    cuda = torch.device(a.device).type == "cuda"
    # eager; graphs of the eager layers; graphs of the compiled layers (the engine's default on
    # CUDA; on the CPU tests/test_graphs.py checks that path, compiling here would only be slow)
    # (compiled_<candidate>: the same with a CANDIDATES kernel for SDPA, compiled)
    runs = [("eager", False, False), ("graph", True, False)] + (
        [("compiled", True, True)] + [(f"compiled_{c}", True, True) for c in CANDIDATES]
        if cuda else [])
    halves = None
    for label, graphs, compiled in runs:
        model.static = None  # each run captures its own graphs
        kernel = CANDIDATES.get(label.removeprefix("compiled_"))
        L = cache.length(seq)
        try:
            with (mock.patch.object(F, "scaled_dot_product_attention",
                                    torch.compile(kernel, fullgraph=True))
                  if kernel else nullcontext()):
                model.use_graphs(graphs, compiled)  # on the CPU: the padded path, run eagerly
                halves = halves or (model.static.halves if compiled else None)
                logits[label] = model.forward_cached(cache, [seq], tok, [K + 1]).float()
                cache.truncate(seq, L)
                out[f"{label}_decode_ms"] = time_steps(model, cache, seq, 1, n, a.device)
                out[f"{label}_verify_ms"] = time_steps(model, cache, seq, K + 1, n, a.device)
        except Exception as e:  # noqa: BLE001 (a candidate's failure is recorded, not the check's)
            if kernel is None:
                raise
            out[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            cache.truncate(seq, L)
            continue
        if graphs:
            out[f"{label}_captures"] = model.static.captures
            out[f"{label}_capture_ms_per_graph"] = (1000 * model.static.capture_seconds
                                                    / max(1, model.static.captures))
    prof = profile_step(model, cache, seq, a.device)
    out["kernels_per_step"], out["attention_ops"] = prof["kernels"], prof["attention_ops"]
    if cuda:  # the kernels' own time (no launch gaps), and the compiled step's, launched one by one
        out["eager_kernel_ms"] = prof["kernel_ms"]
        out["eager_top_kernels_us"] = prof["top_kernels_us"]
        prof = profile_step(model, cache, seq, a.device, halves)
        out["kernels_per_compiled_step"] = prof["kernels"]
        out["compiled_kernel_ms"] = prof["kernel_ms"]
        out["compiled_top_kernels_us"] = prof["top_kernels_us"]  # (profile_step leaves graphs off)
    for label in list(logits)[1:]:
        diff = (logits[label] - logits["eager"]).abs().max().item()
        same_argmax = torch.equal(logits[label].argmax(-1), logits["eager"].argmax(-1))
        out[f"{label}_vs_eager_max_abs"] = diff
        out[f"{label}_vs_eager_same_argmax"] = same_argmax
        # ok: each path computes what eager computes. bf16 logits of order 1 over 128k random
        # tokens: a padded batch or a fused kernel rounds in another order (compiled: up to 0.1 on
        # an H200), and the top two are often closer than that, so the argmax is reported, not
        # judged; a wrong layer (a lost residual, RoPE or mask) is off by 1 or more. Speed is
        # reported, not judged here.
        out.setdefault("ok", True)
        out["ok"] &= diff < 0.25
    best = "compiled" if cuda else "graph"  # what the engine replays by default
    cfg = model.config
    kv_bytes = (2 * cfg.num_hidden_layers * ctx * cfg.num_key_value_heads * cfg.head_dim
                * model.lm_head.weight.element_size())
    bw = bandwidth(a)
    if bw:
        floor = 1000 * (out["step_read_bytes"] + kv_bytes) / (bw * 1e9)
        out["floor_ms"] = floor
        for label, *_ in runs:
            if f"{label}_decode_ms" in out:
                out[f"{label}_over_floor"] = out[f"{label}_decode_ms"] / floor
        if name in FLOOR_TARGETS and not a.quick:
            out["target_over_floor"] = FLOOR_TARGETS[name]
            out["meets_target"] = out[f"{best}_over_floor"] <= FLOOR_TARGETS[name]
    return out


def check_quant_step(a, name, fields, quant):
    """A quantized model's decode step and verification (K + 1 tokens), eager and on the engine's
    default path (CUDA graphs of compiled layers; the CPU: eager), against the bandwidth floor of
    its quantized bytes; the two paths' logits compared on the same step. In bfloat16 on a GPU; on
    the CPU as load_model runs a quantized model there, in float32 through cpu_kernels.cpp's
    products (pack_layers), where bfloat16 would compile a product for every shape and row count:
    25 s of CI."""
    on_cpu = torch.device(a.device).type == "cpu"
    model = random_quant_model(fields, a.device, quant,
                               dtype=torch.float32 if on_cpu else torch.bfloat16)
    if on_cpu:
        pack_layers(model, a.device)
    ctx = 64 if a.quick else 1024
    cache = model.new_cache(ctx + K + 8 + 16, block_size=16)
    seq = cache.new_seq()
    model.forward_cached(cache, [seq], torch.randint(fields["vocab_size"], (ctx,),
                                                     device=a.device), [ctx], last_only=True)
    n = 5 if a.quick else 30
    out = {"shape": name, "quant": quant, "context": ctx, "weight_bytes": weight_bytes(model)}
    tok = torch.randint(fields["vocab_size"], (K + 1,), device=a.device)
    paths = [("eager", False), ("default", None)]
    if quant == "int4" and torch.device(a.device).type == "cuda":
        # the same weights in CUDA's tinygemm (quantize.pack_layers), on the default path:
        # not the engine's default on CUDA until these numbers say it is faster
        paths.append(("tinygemm", None))
    logits = {}
    for label, graphs in paths:
        if label == "tinygemm":
            out["tinygemm_layers"] = pack_layers(model, a.device, cuda=True)
            out["tinygemm_weight_bytes"] = weight_bytes(model)
        model.static = None
        model.use_graphs(graphs)
        L = cache.length(seq)
        logits[label] = model.forward_cached(cache, [seq], tok, [K + 1]).float()
        cache.truncate(seq, L)
        out[f"{label}_decode_ms"] = time_steps(model, cache, seq, 1, n, a.device)
        out[f"{label}_verify_ms"] = time_steps(model, cache, seq, K + 1, n, a.device)
    for label in logits.keys() - {"eager"}:
        out[f"{label}_vs_eager_max_abs"] = (logits[label] - logits["eager"]).abs().max().item()
    out["ok"] = all(out[f"{label}_vs_eager_max_abs"] < 0.25 for label in logits.keys() - {"eager"})
    cfg = model.config
    kv_bytes = (2 * cfg.num_hidden_layers * ctx * cfg.num_key_value_heads * cfg.head_dim
                * model.dtype.itemsize)
    bw = bandwidth(a)
    if bw:
        table = 0 if cfg.tie_word_embeddings else model.model.embed_tokens.nbytes()
        floor_ms = lambda weights: 1000 * (weights - table + kv_bytes) / (bw * 1e9)  # noqa: E731
        out["floor_ms"] = floor_ms(out["weight_bytes"])
        for label, _ in paths:  # each against the bytes its layout reads
            weights = out.get(f"{label}_weight_bytes", out["weight_bytes"])
            out[f"{label}_over_floor"] = out[f"{label}_decode_ms"] / floor_ms(weights)
    return out


def bandwidth(a):
    if a.bandwidth_gbs:
        return a.bandwidth_gbs
    if torch.device(a.device).type != "cuda":
        return None
    gpu = torch.cuda.get_device_name(a.device)
    return next((v for k, v in BANDWIDTH_GBS.items() if k in gpu), None)


def attention_reference(q, pool, blocks, length, T, scale):
    """One row's attention in float32 on the CPU, written out (no SDPA): q [T, nh, hd] are the
    last T of its `length` tokens, whose K/V the pool [num_blocks, block_size, 2, nkv, hd] holds at
    its blocks. Token i sees the keys up to its own position. -> [T, nh, hd]."""
    kv = pool[blocks].flatten(0, 1)[:length].float().movedim(1, 0)     # [2, length, nkv, hd]
    g = q.shape[1] // kv.shape[2]
    k, v = kv[0].repeat_interleave(g, 1), kv[1].repeat_interleave(g, 1)  # [length, nh, hd]
    scores = torch.einsum("thd,lhd->htl", q.float(), k) * scale          # [nh, T, length]
    seen = torch.arange(length)[None, :] <= torch.arange(length - T, length)[:, None]
    probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("htl,lhd->thd", probs, v)


def check_attention(a, shapes):
    """The engine's paged attention on the device (SDPA's kernel there) against
    attention_reference: the 1B model's heads in bf16, three ragged rows, a decode step, a
    verification and a prefill chunk on top of their contexts."""
    cfg = ModelConfig.from_hf(hf_config({**shapes["llama-1b"], "num_hidden_layers": 1}))
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    contexts = [40, 17, 100] if a.quick else [1000, 333, 3000]
    chunk = 32 if a.quick else 512
    cache = PagedKVCache(cfg, sum(contexts) + 3 * (chunk + K + 1) + 64, 16, a.device,
                         torch.bfloat16)
    seqs = [cache.new_seq() for _ in contexts]
    g = torch.Generator(device=a.device).manual_seed(0)

    def step(counts):  # random q, k, v for `counts` new tokens per row through paged_attention
        N = sum(counts)
        q, k, v = (torch.randn(N, h, hd, generator=g, device=a.device).to(torch.bfloat16)
                   for h in (nh, nkv, nkv))
        q = q * 3  # peaked attention: its output is of order 1, not a mean near 0 of many values
        return q, paged_attention(q, k, v, cache.kv[0], cache.prepare(seqs, counts))

    step(contexts)  # the rows' contexts
    out = {"contexts": contexts}
    for label, T in (("decode", 1), ("verify", K + 1), ("prefill_chunk", chunk)):
        q, y = step([T] * len(seqs))
        pool, q, y = cache.kv[0].cpu(), q.cpu(), y.float().cpu()
        ref = torch.cat([attention_reference(q[i * T:(i + 1) * T], pool, cache.seqs[s].blocks,
                                             cache.length(s), T, hd ** -0.5)
                         for i, s in enumerate(seqs)])
        out[f"{label}_max_abs"] = (y - ref).abs().max().item()
        out[f"{label}_ref_mean_abs"] = ref.abs().mean().item()
    # outputs of order 1 from bf16 inputs: the CPU's kernel is within 0.01 of the reference; a
    # wrong mask or head mapping is off by 1-4, a wrong scale (0.9x) by 0.15-0.3
    out["ok"] = max(out[f"{x}_max_abs"] for x in ("decode", "verify", "prefill_chunk")) < 0.05
    return out


def matmul_attention(q, k, v, attn_mask=None):
    """Attention as two batched products around a float32 softmax: SDPA's contract for the engine's
    calls (q [b, h, n, hd], k/v [b, h, L, hd], an additive mask). A candidate for few queries (a
    decode step's g x T per KV head), where a fused kernel's tile of 64 or more queries runs
    mostly empty and one block per head walks all L keys alone. The scores are float32, as in
    SDPA's kernels: bf16 products into a float32 result on CUDA (aten::bmm.dtype). (Measured on an
    H200 with its scores rounded to bf16 first, and FlexAttention with a score_mod reading the
    mask, slower than either: docs/models.md.)"""
    b, h, n, hd = q.shape
    if q.device.type in MM_FP32_OUT and q.dtype != torch.float32:
        scores = torch.bmm(q.reshape(b * h, n, hd), k.transpose(-1, -2).reshape(b * h, hd, -1),
                           out_dtype=torch.float32).view(b, h, n, -1)       # [b, h, n, L]
    else:
        scores = q.float() @ k.float().transpose(-1, -2)                      # [b, h, n, L]
    probs = (scores * hd ** -0.5 + attn_mask).softmax(-1)
    return probs.to(v.dtype) @ v                                              # [b, h, n, hd]


# candidates for paged_attention's SDPA call, timed by attention_speed and in whole steps (step)
CANDIDATES = {"matmul": matmul_attention}


def attention_kernels(a):
    """The attention kernels the speed check times: name -> a context manager that makes
    paged_attention's SDPA call that kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    compiled = torch.compile(matmul_attention, fullgraph=True)
    kernels = {"sdpa": nullcontext, "matmul": lambda: mock.patch.object(
        F, "scaled_dot_product_attention", matmul_attention)}
    if torch.device(a.device).type == "cuda":
        kernels.update({
            "sdpa_efficient": lambda: sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]),
            "sdpa_math": lambda: sdpa_kernel([SDPBackend.MATH]),
            "matmul_compiled": lambda: mock.patch.object(F, "scaled_dot_product_attention",
                                                         compiled)})
    return kernels


def check_attention_speed(a, shapes):
    """Paged attention's time per layer (its K/V write, the gather and the kernel), replayed in a
    CUDA graph of 16 calls, for each of attention_kernels: decode and verification at 1 and 8
    rows, 1k and 4k tokens of context, the 1B model's heads and the 8B's (head_dim 128); each
    kernel's output against SDPA's. Where the decode step's attention goes (step: its kernels)."""
    cases = [("1b", 1024, 1, 1), ("1b", 1024, K + 1, 1), ("1b", 4096, 1, 1), ("1b", 1024, 1, 8),
             ("8b", 1024, 1, 1)]
    if a.quick:
        cases = [("1b", 64, 1, 1), ("1b", 64, K + 1, 2)]
    out, kernels, worst = {}, attention_kernels(a), 0.0
    for shape, ctx, T, rows in cases:
        cfg = ModelConfig.from_hf(hf_config({**shapes[f"llama-{shape}"], "num_hidden_layers": 1}))
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        cache = PagedKVCache(cfg, rows * (ctx + 64), 16, a.device, torch.bfloat16)
        seqs = [cache.new_seq() for _ in range(rows)]
        cache.kv.normal_()
        for s_ in seqs:
            cache.append(s_, ctx)
        q, k, v = (torch.randn(rows * T, h, hd, device=a.device, dtype=torch.bfloat16)
                   for h in (nh, nkv, nkv))
        meta = cache.prepare(seqs, [T] * rows)  # one step's plan, replayed (same slots each call)
        ys = {}
        for name, use in kernels.items():
            try:
                with use():
                    ys[name] = paged_attention(q, k, v, cache.kv[0], meta).float()
                    us = 1000 * time_replays(lambda: paged_attention(q, k, v, cache.kv[0], meta),
                                             a.device, calls=16, n=5 if a.quick else 20) / 16
            except Exception as e:  # noqa: BLE001 (a candidate's failure is recorded)
                if name == "sdpa":
                    raise
                out[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                continue
            out[f"{shape}_ctx{ctx}_T{T}_b{rows}_{name}_us"] = us
            worst = max(worst, (ys[name] - ys["sdpa"]).abs().max().item())
    out["max_abs_vs_sdpa"] = worst
    out["ok"] = worst < 0.05
    return out


def time_replays(fn, device, calls: int, n: int) -> float:
    """Median ms of `calls` calls of fn: replayed as one CUDA graph on CUDA, eagerly elsewhere."""
    times = []
    if torch.device(device).type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        run = graph.replay
    else:
        def run():
            for _ in range(calls):
                fn()
    for i in range(n + 2):
        sync(device)
        t = time.perf_counter()
        run()
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


class SyncCounter:
    """Host-device synchronisations seen since `mark()` (or since counting began), less those of
    CUDA graph captures (set-up, which the decode clock leaves out too), counted apart."""

    def __init__(self, is_sync=lambda event: True, crossings: "HostToDevice | None" = None):
        self.events, self.since = [], 0  # CUDA: the warnings caught; CPU: one entry per read
        self.is_sync = is_sync
        self.captures = []  # (first, end): the events logged during each graph capture
        self.crossings = crossings  # the CPU's host-to-device crossings, marked along

    def mark(self):
        self.since = len(self.events)
        if self.crossings is not None:
            self.crossings.mark()

    def in_captures(self) -> int:
        inside = {i for first, end in self.captures for i in range(max(first, self.since), end)}
        return sum(self.is_sync(self.events[i]) for i in inside)

    def n(self) -> int:
        return sum(map(self.is_sync, self.events[self.since:])) - self.in_captures()


def engine_line() -> str:
    """file:line of the innermost engine frame calling into torch (for HostToDevice's log)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if path.parent == REPO:
            return f"{path.name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class HostToDevice(TorchDispatchMode):
    """The CPU's stand-in for host-to-device copies, which a CPU run cannot see (the host is the
    device): every tensor made from Python data (aten's lift_fresh: torch.tensor or as_tensor of a
    list, a list used as an index) with the engine line that made it, and devices.to_device's calls.
    The engine's host data crosses through to_device (on CUDA from page-locked memory, without
    blocking); one that never reaches it was made on the device or indexes a device tensor, which
    on a GPU is a synchronous copy: implicit() names them."""

    MODULES = ("devices", "kv_cache", "graphs", "model", "decode", "draft", "speculator", "verify",
               "spec_cache", "fallback", "channel", "tp")

    def __init__(self):
        super().__init__()
        # (tensor, engine line) per tensor made from Python data, kept alive so that no later
        # tensor gets the storage address of a freed one
        self.made = []
        self.crossed = []  # the storage address of each tensor passed to to_device
        self.since = (0, 0)
        self.saved = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default):
            self.made.append((out, engine_line()))
        return out

    def __enter__(self):
        for name in self.MODULES:
            module = sys.modules.get(name) or __import__(name)
            if hasattr(module, "to_device"):
                self.saved[module] = module.to_device
                module.to_device = self.counted(module.to_device)
        return super().__enter__()

    def __exit__(self, *exc):
        for module, real in self.saved.items():
            module.to_device = real
        return super().__exit__(*exc)

    def counted(self, real):
        def to_device(host, device, out=None):
            self.crossed.append(host.untyped_storage().data_ptr())
            return real(host, device, out)
        return to_device

    def mark(self):
        self.since = (len(self.made), len(self.crossed))

    def n(self) -> int:
        """to_device's calls since mark()."""
        return len(self.crossed) - self.since[1]

    def implicit(self) -> list[str]:
        """Where tensors made from Python data since mark() never went through to_device."""
        crossed = set(self.crossed)
        return [line for x, line in self.made[self.since[0]:]
                if x.untyped_storage().data_ptr() not in crossed]


@contextmanager
def count_host_syncs(device):
    """-> a SyncCounter for the block; call its mark() when decoding starts (loading and prefill
    sync too). CUDA's sync debug mode on a GPU (a graph capture's syncs counted apart); on the CPU,
    the decode loop's device-to-host reads (devices.to_host, each a sync on a GPU; other syncs,
    which the GPU's count shows, are not seen) and its host-to-device crossings (HostToDevice)."""
    from graphs import StaticSteps
    if torch.device(device).type == "cuda":
        counter = SyncCounter(lambda w: "synchroniz" in str(w.message))  # not other warnings
        real = StaticSteps.capture_graph

        def capture_graph(steps, bk, run):
            first = len(counter.events)
            try:
                return real(steps, bk, run)
            finally:
                counter.captures.append((first, len(counter.events)))
        StaticSteps.capture_graph = capture_graph
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                counter.events = caught  # the list catch_warnings appends to
                yield counter
        finally:
            torch.cuda.set_sync_debug_mode(0)
            StaticSteps.capture_graph = real
        return
    import decode
    import draft
    import speculator
    import verify
    counter = SyncCounter(crossings=HostToDevice())
    modules = (decode, draft, speculator, verify)
    saved = [m.to_host for m in modules]

    def counted(real):
        def to_host(x):
            counter.events.append(True)
            return real(x)
        return to_host
    for m, real in zip(modules, saved):
        m.to_host = counted(real)
    try:
        with counter.crossings:
            yield counter
    finally:
        for m, real in zip(modules, saved):
            m.to_host = real


def tiny_run(a, mode, prompts, **kw):
    return generate(prompts, target="tiny", draft="tiny-draft", mode=mode, k=K,
                    target_device=kw.pop("target_device", a.device),
                    draft_device=kw.pop("draft_device", a.device),
                    dtype="bfloat16", ignore_eos=True, target_threads=threads(a), **kw)


def threads(a) -> int | None:
    """The target's CPU threads: on the CPU those main gave this process (one side's share, as
    in SSD; the tiny pair gains nothing from more, and a busy machine slows every extra thread
    down), on a GPU generate's default."""
    return torch.get_num_threads() if a.device == "cpu" else None


# syncs per decode round the loop is designed for (tests/test_generate.py counts them on the CPU)
SYNCS_PER_ROUND = {"ar": 2.5, "sd": 4.5, "ssd": 7.5}


def check_host_syncs(a, prompts):
    out = {}
    new = 16 if a.quick else 64
    for mode in ("ar", "sd", "ssd"):
        with count_host_syncs(a.device) as c:
            started = []  # the first token is streamed after the prefill: count from there

            def stream(row, tokens):
                if not started:
                    started.append(c.mark())
            res = tiny_run(a, mode, prompts[:1], max_new_tokens=new, parallel=False,
                           stream=stream)
            rounds = max(1, res.stats["rounds"])
            out[f"{mode}_per_round"] = c.n() / rounds
            out[f"{mode}_in_captures"] = c.in_captures()
            if c.crossings is not None:  # the CPU: every crossing through devices.to_device
                out[f"{mode}_h2d_per_round"] = c.crossings.n() / rounds
                out[f"{mode}_h2d_implicit"] = sorted(set(c.crossings.implicit()))
    out["ok"] = (all(out[f"{m}_per_round"] <= v for m, v in SYNCS_PER_ROUND.items())
                 and not any(out.get(f"{m}_h2d_implicit") for m in SYNCS_PER_ROUND))
    return out


def agreement(ref, toks) -> float:
    """The share of the reference's tokens matched before each row's first difference."""
    same = sum(next((i for i, (x, y) in enumerate(zip(r, t)) if x != y), len(r))
               for r, t in zip(ref, toks))
    return same / sum(len(x) for x in ref)


def check_greedy(a, prompts):
    new = 16 if a.quick else 64
    ref = tiny_run(a, "ar", prompts, max_new_tokens=new).tokens
    out = {}
    for label, mode, kw in [("sd", "sd", {}), ("ssd_one_process", "ssd", {"parallel": False}),
                            ("ssd_two_processes", "ssd", {"parallel": True})]:
        out[label] = agreement(ref, tiny_run(a, mode, prompts, max_new_tokens=new, **kw).tokens)
    if a.device != "cpu":  # a CPU target beside a GPU draft: its proposals cross to the host
        ref = tiny_run(a, "ar", prompts, max_new_tokens=new, target_device="cpu").tokens
        out["sd_cpu_target_gpu_draft"] = agreement(ref, tiny_run(
            a, "sd", prompts, max_new_tokens=new, target_device="cpu").tokens)
    # bf16 near-ties may part sequences legitimately (tests/test_dtype.py); most must agree
    out["ok"] = min(out.values()) >= 0.9
    return out


# The sampling check's pair: 4 tokens, peaked next-token laws that differ between the two
LAW_FIELDS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, vocab_size=4, tie_word_embeddings=False,
                  rope_theta=10000.0, max_position_embeddings=64)
LAW_PROMPT, LAW_TOKENS = [0, 3, 1], 3


def law_pair(work: Path) -> tuple[Path, Path]:
    """A target and a draft of LAW_FIELDS with random weights (LM heads scaled up: far from
    uniform), written as float32 checkpoints."""
    paths = []
    for name, seed in (("law-target", 10), ("law-draft", 11)):
        model = random_model(LAW_FIELDS, "cpu", torch.float32, seed)
        model.lm_head.weight.mul_(2.5)
        paths.append(write_checkpoint(model, LAW_FIELDS, work / name))
    return paths[0], paths[1]


def exact_law(path: Path, prompt, n: int) -> dict:
    """The model's law of its first n tokens after `prompt` at temperature 1, by enumerating the
    V^n continuations through its plain (uncached) forward in float32 on the CPU."""
    model, _ = load_model(path, device="cpu", dtype="float32", tokenizer=False)
    V, L = model.config.vocab_size, len(prompt)
    conts = torch.cartesian_prod(*[torch.arange(V)] * n).view(-1, n)           # [V^n, n]
    x = torch.cat([torch.tensor(prompt).expand(len(conts), -1), conts], 1)     # [V^n, L + n]
    logp = torch.log_softmax(model(x)[:, L - 1:L - 1 + n].double(), -1)        # [V^n, n, V]
    logp = logp.gather(-1, conts[..., None]).squeeze(-1).sum(-1)               # [V^n]
    return {tuple(c): p for c, p in zip(conts.tolist(), logp.exp().tolist())}


def tv(p: dict, q: dict) -> float:
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


def tv_bound(law: dict, N: int, delta: float = 1e-6) -> float:
    """TV between the empirical law of N rows and `law` stays below this with probability
    1 - delta (the mean by Jensen per cell, McDiarmid around it: tests/test_generate.py)."""
    mean = 0.5 * sum(math.sqrt(p * (1 - p) / N) for p in law.values())
    return mean + math.sqrt(math.log(1 / delta) / (2 * N))


def check_sampling(a, work: Path):
    """Temperature 1 on the device: the joint law of the first LAW_TOKENS tokens of N rows, from
    AR, SD and SSD in one process and in two, against the exact law (float32, so that the CPU's
    enumeration computes the same law)."""
    target, draft = law_pair(work)
    law = exact_law(target, LAW_PROMPT, LAW_TOKENS)
    N = 1000 if a.quick else 8000
    out = {"rows": N, "tv_bound": tv_bound(law, N)}
    for label, mode, kw in [("ar", "ar", {}), ("sd", "sd", {}),
                            ("ssd_one_process", "ssd", {"parallel": False}),
                            ("ssd_two_processes", "ssd", {"parallel": True})]:
        res = generate([LAW_PROMPT] * N, target=str(target), draft=str(draft), mode=mode, k=2,
                       budget=3, temperature=1.0, max_new_tokens=LAW_TOKENS, seed=1,
                       target_device=a.device, draft_device=a.device, dtype="float32",
                       ignore_eos=True, target_threads=threads(a), **kw)
        counts = {}
        for row in res.tokens:
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
        out[f"{label}_tv"] = tv({k: c / N for k, c in counts.items()}, law)
    out["ok"] = all(v < out["tv_bound"] for k, v in out.items() if k.endswith("_tv"))
    return out


def check_ssd(a, prompts, draft_device):
    new = 16 if a.quick else 128
    ar = tiny_run(a, "ar", prompts[:1], max_new_tokens=new)
    sd = tiny_run(a, "sd", prompts[:1], max_new_tokens=new)
    ssd = tiny_run(a, "ssd", prompts[:1], max_new_tokens=new, draft_device=draft_device)
    s = ssd.stats
    return {"draft_device": draft_device, "ar_tok_s": ar.stats["decode_tok_s"],
            "sd_tok_s": sd.stats["decode_tok_s"],
            "ssd_tok_s": s["decode_tok_s"], "ssd_over_sd": s["decode_tok_s"]
            / sd.stats["decode_tok_s"], "hit_rate": s["cache_hit_rate"],
            "verifier_wait_pct": 100 * s["verifier_wait_seconds"] / s["decode_seconds"],
            "mean_budget": s["mean_budget"], "tokens_equal": ssd.tokens == sd.tokens,
            # graph captures, left out of decode time (decode.Captures): seconds per mode
            "capture_s": {m: r.stats["capture_seconds"] for m, r in
                          (("ar", ar), ("sd", sd), ("ssd", ssd))},
            "ok": ssd.tokens == sd.tokens}


def check_long_prefill(a, shapes):
    """One long prompt (16k tokens; 256 with --quick) through the 1B shape, in chunks of 2048 (64)
    as the engine prefills. An attention kernel that materialised its scores would allocate, at
    the last chunk, [heads, chunk, L] of them in the model's dtype (2.1 GB at 16k), more in
    float32; one that streams over the keys needs the mask (1 / KV heads of that) and a few
    [chunk, intermediate] activations."""
    fields = shapes["llama-1b"]
    model = random_model(fields, a.device)
    L, chunk = (256, 64) if a.quick else (16384, PREFILL_CHUNK)
    cache = model.new_cache(L + 16)
    seq = cache.new_seq()
    cfg = model.config
    tokens = torch.randint(cfg.vocab_size, (L,)).tolist()
    start = time.perf_counter()
    with peak_bytes(a.device) as peak:
        model.prefill(cache, [seq], [tokens], chunk=chunk)
    scores = cfg.num_attention_heads * chunk * L * model.lm_head.weight.element_size()
    out = {"prompt_tokens": L, "chunk": chunk, "weight_bytes": weight_bytes(model),
           "kv_cache_bytes": cache.kv.numel() * cache.kv.element_size(),
           "prefill_bytes": peak["bytes"], "largest_alloc_bytes": peak.get("largest"),
           "chunk_scores_bytes": scores, "seconds": time.perf_counter() - start}
    biggest = peak["bytes"] if torch.device(a.device).type == "cuda" else peak["largest"]
    out["ok"] = biggest < scores
    return out


# --------------------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks the script itself")
    ap.add_argument("--out", default=None, help="JSON report (default docs/gpu_check_<dev>.json)")
    ap.add_argument("--bandwidth-gbs", type=float, default=None,
                    help="memory bandwidth for the floor (default: by GPU name)")
    ap.add_argument("--only", default=None, help="comma-separated check names (default: all)")
    a = ap.parse_args(argv)
    if torch.device(a.device).type == "cuda" and not torch.cuda.is_available():
        print(f"error: device {a.device} requested but CUDA is not available: use --device cpu",
              file=sys.stderr)
        return 2
    if a.device == "cpu":  # the two SSD processes split the cores, as run.py does
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    shapes = QUICK_SHAPES if a.quick else SHAPES
    prompts = [[0] + list(range(100, 100 + n)) for n in (12, 20, 7, 30)]
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    checks = [("versions", lambda: check_versions(a)),
              ("load", lambda: check_load(a, shapes, work))]
    checks += [(f"step:{n}", lambda n=n, f=f: check_step(a, n, f)) for n, f in shapes.items()]
    checks += [(f"quant_step:{n}", lambda n=n, f=f, q=q: check_quant_step(a, n, f, q))
               for n, (f, q) in (QUICK_QUANT_SHAPES if a.quick else QUANT_SHAPES).items()]
    checks += [("attention", lambda: check_attention(a, shapes)),
               ("attention_speed", lambda: check_attention_speed(a, shapes)),
               ("host_syncs", lambda: check_host_syncs(a, prompts)),
               ("greedy", lambda: check_greedy(a, prompts)),
               ("sampling", lambda: check_sampling(a, work))]
    draft_devices = [a.device]
    if torch.device(a.device).type == "cuda" and torch.cuda.device_count() > 1:
        draft_devices.append("cuda:1")
    checks += [(f"ssd:{a.device}+{d}", lambda d=d: check_ssd(a, prompts, d))
               for d in draft_devices]
    checks.append(("long_prefill", lambda: check_long_prefill(a, shapes)))
    only = set(a.only.split(",")) if a.only else None
    report = {"command": command(argv or sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "checks": []}
    out = Path(a.out or REPO / "docs" / f"gpu_check_{a.device.replace(':', '')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, fn in checks:
        if only and name.split(":")[0] not in only:
            continue
        start = time.perf_counter()
        try:
            res = fn()
        except Exception as e:  # noqa: BLE001 (recorded; the other checks still run)
            traceback.print_exc()
            res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        res = {"name": name, **res, "check_seconds": time.perf_counter() - start}
        report["checks"].append(res)
        print(f"{'ok ' if res['ok'] else 'FAIL'} {name:<22} {summary(res)}", flush=True)
        # written after every check: a run cut short (a machine lent for minutes) keeps its part
        out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"report written to {out}")
    return 0 if all(c["ok"] for c in report["checks"]) else 1


def command(args: list[str]) -> str:
    """The command as run, less --out: where one machine wrote its report is not what it measured
    (and a path of that machine means nothing in the repository)."""
    kept, after_out = [], False
    for x in args:
        if not (after_out or x == "--out" or x.startswith("--out=")):
            kept.append(x)
        after_out = x == "--out"
    return " ".join(["python scripts/gpu_check.py", *kept])


def summary(res: dict) -> str:
    skip = {"name", "ok", "check_seconds", "attention_ops"}
    parts = []
    for k, v in res.items():
        if k in skip:
            continue
        parts.append(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
