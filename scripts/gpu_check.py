"""The GPU check: one command that measures what only a GPU can show, with no network.

    python scripts/gpu_check.py                          # on a GPU: about 10 minutes
    python scripts/gpu_check.py --device cpu --quick     # every check at tiny sizes (CI runs it)

Random-weight bf16 models shaped like Llama-3.2-1B and Llama-3.1-8B (built here, nothing is
downloaded), and the shipped tiny pair for the token checks. Each check adds one entry to a JSON
report {"checks": [{"name", "ok", ...figures}], ...} (--out; default docs/gpu_check_<device>.json)
and one line to the table printed at the end:

  versions        torch, CUDA, the device
  load            load_model's peak memory over the weights' bytes (1B shape, from a checkpoint
                  written here): parameters are allocated once, in bf16
  step:<shape>    decode-step and verification ms (batch 1, T = 1 and T = K + 1), eager and
                  replayed as CUDA graphs, beside the step's memory-bandwidth floor (weights + KV
                  bytes / bandwidth) and issue 14's targets (graph step <= 2x the floor for 1B,
                  1.3x for 8B); the graph's logits against eager's; kernels per eager step and the
                  attention kernel SDPA chose (torch.profiler)
  host_syncs      host-device synchronisations per AR, SD and SSD round (CUDA's sync debug mode);
                  on the CPU, the decode loop's device-to-host reads (model.to_host) and its
                  host-to-device crossings, none of which may bypass model.to_device
  greedy          AR, SD and SSD (one process and two) emit the same greedy tokens in bf16
  ssd:<devices>   two-process SSD on one GPU (time-sliced) and on two when there are two: tok/s
                  beside AR's and SD's (tiny pair, graphs on), hit rate, verifier wait
  long_prefill    memory of one long prompt's prefill (1B shape, in chunks as the engine does it):
                  the peak on a GPU, the largest allocation on the CPU, beside one layer's scores

A check that fails records its error and the run goes on. The exit status is 1 if any check is
not ok. Whenever a GPU is at hand: run it, commit the report under docs/, act on what it shows.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from model import PREFILL_CHUNK, ModelConfig, Transformer, load_model, materialize  # noqa: E402
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
    "llama-1b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                     tie_word_embeddings=True, rope_theta=500000.0),
    "llama-8b": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
                     tie_word_embeddings=False, rope_theta=500000.0),
}
# HBM bandwidth in GB/s by a substring of the device name (datasheet figures)
BANDWIDTH_GBS = {"H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "L4": 300, "4090": 1008,
                 "A10": 600}
K = 4  # verification steps check T = K + 1


def hf_config(fields: dict) -> dict:
    return {"model_type": "llama", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "bos_token_id": 0, "eos_token_id": 1, **fields}


def random_model(fields: dict, device, dtype=torch.bfloat16) -> Transformer:
    """A model of this shape with random weights (logits of order 1), built in place."""
    cfg = ModelConfig.from_hf(hf_config(fields))
    with torch.device("meta"):
        model = Transformer(cfg)
    materialize(model, device, dtype)
    g = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.fill_(1.0)
        else:
            p.normal_(0, p.shape[1] ** -0.5, generator=g)
    model.init_rope()
    return model.eval().requires_grad_(False)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


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
                  if isinstance(x, torch.Tensor) and x.device.type != "meta"}
        for x in tree_leaves(out):
            if isinstance(x, torch.Tensor) and x.device.type != "meta":
                s = x.untyped_storage()
                if s.nbytes() and s.data_ptr() not in inputs:
                    self.log.append((str(func), x.dtype, x.numel(), s.nbytes()))
        return out

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
    return info


def check_load(a, shapes, work: Path):
    """Write a random 1B-shaped bf16 checkpoint, load it, compare the peak with its weights."""
    fields = shapes["llama-1b"]
    model = random_model(fields, "cpu")
    state = model.checkpoint_params()  # HF names; a tied head is left out
    path = work / "llama-1b"
    path.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**hf_config(fields), "torch_dtype": "bfloat16"}))
    wbytes = weight_bytes(model)
    del model, state
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


def profile_step(model, cache, seq, device):
    """Kernels launched by one decode step (CUDA; ComputeOps on the CPU), and the attention
    kernel names (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.device(device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    L = cache.length(seq)
    tok = torch.randint(model.config.vocab_size, (1,), device=device)
    with profile(activities=acts) as prof, ComputeOps() as ops:
        model.forward_cached(cache, [seq], tok, [1], last_only=True)
        sync(device)
    cache.truncate(seq, L)
    events = prof.events()
    kernels = (len([e for e in events if e.device_type.name == "CUDA"]) if cuda
               else len(ops.ops))
    attn = sorted({e.name for e in events
                   if any(s in e.name.lower() for s in ("flash", "efficient", "cudnn_attention",
                                                        "_scaled_dot_product", "fmha"))})
    return kernels, attn


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
    out = {"shape": name, "context": ctx, "weight_bytes": weight_bytes(model)}
    logits = {}
    tok = torch.randint(fields["vocab_size"], (K + 1,), device=a.device)
    for label, graphs in (("eager", False), ("graph", True)):
        model.use_graphs(graphs)  # on the CPU: the padded path, run eagerly
        L = cache.length(seq)
        logits[label] = model.forward_cached(cache, [seq], tok, [K + 1]).float()
        cache.truncate(seq, L)
        out[f"{label}_decode_ms"] = time_steps(model, cache, seq, 1, n, a.device)
        out[f"{label}_verify_ms"] = time_steps(model, cache, seq, K + 1, n, a.device)
        if graphs:
            out["graphs_captured"] = model.static.captures
            out["capture_ms_per_graph"] = (1000 * model.static.capture_seconds
                                           / max(1, model.static.captures))
    model.use_graphs(False)
    out["kernels_per_step"], out["attention_ops"] = profile_step(model, cache, seq, a.device)
    diff = (logits["graph"] - logits["eager"]).abs().max().item()
    same_argmax = torch.equal(logits["graph"].argmax(-1), logits["eager"].argmax(-1))
    out.update(graph_vs_eager_max_abs=diff, graph_vs_eager_same_argmax=same_argmax)
    cfg = model.config
    kv_bytes = (2 * cfg.num_hidden_layers * ctx * cfg.num_key_value_heads * cfg.head_dim
                * model.lm_head.weight.element_size())
    bw = bandwidth(a)
    if bw:
        floor = 1000 * (out["weight_bytes"] + kv_bytes) / (bw * 1e9)
        out.update(floor_ms=floor, eager_over_floor=out["eager_decode_ms"] / floor,
                   graph_over_floor=out["graph_decode_ms"] / floor)
        if name in FLOOR_TARGETS and not a.quick:
            out["target_over_floor"] = FLOOR_TARGETS[name]
            out["meets_target"] = out["graph_over_floor"] <= FLOOR_TARGETS[name]
    # ok: the graph computes what eager computes (bf16 logits of order 1; a padded batch may sum
    # in another order). Speed is reported, not judged here.
    out["ok"] = diff < 0.25 and (same_argmax or diff < 0.05)
    return out


def bandwidth(a):
    if a.bandwidth_gbs:
        return a.bandwidth_gbs
    if torch.device(a.device).type != "cuda":
        return None
    gpu = torch.cuda.get_device_name(a.device)
    return next((v for k, v in BANDWIDTH_GBS.items() if k in gpu), None)


class SyncCounter:
    """Host-device synchronisations seen since `mark()` (or since counting began)."""

    def __init__(self, is_sync=lambda event: True, crossings: "HostToDevice | None" = None):
        self.events, self.since = [], 0  # CUDA: the warnings caught; CPU: one entry per read
        self.is_sync = is_sync
        self.crossings = crossings  # the CPU's host-to-device crossings, marked along

    def mark(self):
        self.since = len(self.events)
        if self.crossings is not None:
            self.crossings.mark()

    def n(self) -> int:
        return sum(map(self.is_sync, self.events[self.since:]))


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
    list, a list used as an index) with the engine line that made it, and model.to_device's calls.
    The engine's host data crosses through to_device (on CUDA from page-locked memory, without
    blocking); one that never reaches it was made on the device or indexes a device tensor, which
    on a GPU is a synchronous copy: implicit() names them."""

    MODULES = ("model", "decode", "draft", "verify", "spec_cache", "fallback", "channel", "tp")

    def __init__(self):
        super().__init__()
        self.made = []     # (tensor, engine line) per tensor made from Python data (kept alive:
        self.crossed = []  # a freed storage's address could come back)  to_device's storages
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
    sync too). CUDA's sync debug mode on a GPU; on the CPU, the decode loop's device-to-host reads
    (model.to_host, each a sync on a GPU; other syncs, which the GPU's count shows, are not seen)
    and its host-to-device crossings (HostToDevice)."""
    if torch.device(device).type == "cuda":
        counter = SyncCounter(lambda w: "synchroniz" in str(w.message))  # not other warnings
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                counter.events = caught  # the list catch_warnings appends to
                yield counter
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return
    import decode
    import draft
    import verify
    counter = SyncCounter(crossings=HostToDevice())
    modules = (decode, draft, verify)
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
                    target_device=a.device, draft_device=kw.pop("draft_device", a.device),
                    dtype="bfloat16", ignore_eos=True, **kw)


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
            if c.crossings is not None:  # the CPU: every crossing through model.to_device
                out[f"{mode}_h2d_per_round"] = c.crossings.n() / rounds
                out[f"{mode}_h2d_implicit"] = sorted(set(c.crossings.implicit()))
    out["ok"] = (all(out[f"{m}_per_round"] <= v for m, v in SYNCS_PER_ROUND.items())
                 and not any(out.get(f"{m}_h2d_implicit") for m in SYNCS_PER_ROUND))
    return out


def check_greedy(a, prompts):
    new = 16 if a.quick else 64
    ref = tiny_run(a, "ar", prompts, max_new_tokens=new).tokens
    out, total = {}, sum(len(x) for x in ref)
    for label, mode, kw in [("sd", "sd", {}), ("ssd_one_process", "ssd", {"parallel": False}),
                            ("ssd_two_processes", "ssd", {"parallel": True})]:
        toks = tiny_run(a, mode, prompts, max_new_tokens=new, **kw).tokens
        same = sum(next((i for i, (x, y) in enumerate(zip(r, t)) if x != y), len(r))
                   for r, t in zip(ref, toks))
        out[label] = same / total  # the share of AR's tokens matched before the first difference
    # bf16 near-ties may part sequences legitimately (tests/test_dtype.py); most must agree
    out["ok"] = min(out.values()) >= 0.9
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
            "ok": ssd.tokens == sd.tokens}


def check_long_prefill(a, shapes):
    """One long prompt (16k tokens; 256 with --quick) through the 1B shape. The score matrix of
    one layer, [heads, L, L] in fp32, would be 34 GB at 16k if attention materialised it."""
    fields = shapes["llama-1b"]
    model = random_model(fields, a.device)
    L = 256 if a.quick else 16384
    cache = model.new_cache(L + 16)
    seq = cache.new_seq()
    cfg = model.config
    tokens = torch.randint(cfg.vocab_size, (L,)).tolist()
    start = time.perf_counter()
    with peak_bytes(a.device) as peak:
        model.prefill(cache, [seq], [tokens], chunk=64 if a.quick else PREFILL_CHUNK)
    scores = 4 * cfg.num_attention_heads * L * L
    out = {"prompt_tokens": L, "weight_bytes": weight_bytes(model),
           "kv_cache_bytes": cache.kv.numel() * cache.kv.element_size(),
           "prefill_bytes": peak["bytes"], "largest_alloc_bytes": peak.get("largest"),
           "scores_bytes_if_materialised": scores, "seconds": time.perf_counter() - start}
    # an attention that streams over keys needs a few [L, intermediate] activations, not scores
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
    checks += [("host_syncs", lambda: check_host_syncs(a, prompts)),
               ("greedy", lambda: check_greedy(a, prompts))]
    draft_devices = [a.device]
    if torch.device(a.device).type == "cuda" and torch.cuda.device_count() > 1:
        draft_devices.append("cuda:1")
    checks += [(f"ssd:{a.device}+{d}", lambda d=d: check_ssd(a, prompts, d))
               for d in draft_devices]
    checks.append(("long_prefill", lambda: check_long_prefill(a, shapes)))
    only = set(a.only.split(",")) if a.only else None
    report = {"command": " ".join(["python scripts/gpu_check.py"] + (argv or sys.argv[1:])),
              "date": time.strftime("%Y-%m-%d"), "checks": []}
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
    out = Path(a.out or REPO / "docs" / f"gpu_check_{a.device.replace(':', '')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"report written to {out}")
    return 0 if all(c["ok"] for c in report["checks"]) else 1


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
