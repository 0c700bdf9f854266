"""Where tensors live, checked on a CPU-only machine (issue 31): what a GPU would meet first.

A CPU run cannot see device mismatches (the host is the device), so the decode loops run here under
`torch.device("meta")` as the default device: a tensor made without naming its device lands on meta
and collides with the models' CPU tensors exactly where, on a GPU, a host tensor would meet CUDA ones
(host tensors say device="cpu"). Host-to-device crossings are counted with scripts/gpu_check.py's
HostToDevice (every tensor made from Python data must cross through devices.to_device, pinned and
without blocking); the speculator's and the tensor-parallel ranks' torch.cuda.set_device with a stub;
the prefill and decode clocks with a fake device whose work finishes only when the host waits for it;
graph captures with a fake capture that takes its time.
"""
import time

import pytest
import torch

import channel
import decode
import draft
import devices
import run
import speculator
import tp
import verify
from conftest import make_checkpoint, one_line
from draft import DraftConfig, DraftSettings
from devices import check_device, resolve_dtype
from graphs import StaticSteps
from model import Transformer
from run import generate
from scripts.gpu_check import HostToDevice

KW = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, eos_token_id=None,
          max_position_embeddings=256)
PROMPTS = [[1, 5, 7, 9, 11], [1, 3], [1, 8, 22, 33, 44, 55]]
# every mode, greedy and sampled; SSD with a fixed fan-out and backup: its tokens depend on no timing
RUNS = [("ar", {}), ("sd", {}), ("ssd", dict(parallel=False, fan_out=[2, 1, 1, 1], fallback="neural")),
        ("ssd", dict(parallel=False, fan_out=[2, 1, 1, 1], fallback="ngram"))]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("devices")
    return (make_checkpoint(root / "target", "llama", seed=0, **KW),
            make_checkpoint(root / "draft", "llama", seed=1, **{**KW, "num_hidden_layers": 1}))


def gen(pair, mode, prompts=PROMPTS, **kw):
    kw.setdefault("target_threads", 1)
    kw.setdefault("draft_threads", 1)
    return generate(prompts, target=str(pair[0]), draft=str(pair[1]), mode=mode, k=3, max_new_tokens=12,
                    ignore_eos=True, **kw)


# ----------------------------------------------------------------------------------------------------
# Items 1 and 2: no tensor of the decode loops is made where the models are not

@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("mode,kw", RUNS, ids=["ar", "sd", "ssd-neural", "ssd-ngram"])
def test_decode_loops_make_no_tensor_on_the_default_device(pair, mode, kw, temperature):
    """Under a meta default device every mode emits the tokens it emits without one: SD's and SSD's first
    round (n = 0 beside t0) and the prefill's draw at temperature > 0 (its `deterministic` flags) make
    their tensors on the models' device, or on the host by name."""
    ref = gen(pair, mode, temperature=temperature, **kw).tokens
    with torch.device("meta"):
        res = gen(pair, mode, temperature=temperature, **kw)
    assert res.tokens == ref


def test_two_process_ssd_makes_no_tensor_on_the_default_device(pair):
    """The verifier's side of the channel too (the speculator's process starts without the default)."""
    kw = dict(fan_out=[2, 1, 1, 1], fallback="neural", temperature=1.0)
    ref = gen(pair, "ssd", parallel=False, **kw).tokens
    with torch.device("meta"):
        assert gen(pair, "ssd", parallel=True, **kw).tokens == ref


# ----------------------------------------------------------------------------------------------------
# Item 5: host data crosses to the device only through devices.to_device

def crossings(pair, mode, batch, **kw):
    """(tensors made from Python data during decoding that did not cross through to_device, to_device calls
    per round)."""
    h2d, started = HostToDevice(), []

    def stream(row, tokens):  # the first token comes from the prefill: count from there
        if not started:
            started.append(h2d.mark())
    with h2d:
        res = gen(pair, mode, PROMPTS[:batch], stream=stream, **kw)
    return h2d.implicit(), h2d.n() / res.stats["rounds"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("mode,kw", RUNS, ids=["ar", "sd", "ssd-neural", "ssd-ngram"])
def test_host_data_crosses_only_through_to_device(pair, mode, kw, temperature):
    """Every tensor the decode loops build from Python data (a forward's plan, the rows a verification
    reads, the proposals of hits and misses put in row order, n-gram proposals, the guesses' fan-out)
    crosses through devices.to_device: none is made on the device from a list or indexes a device tensor
    with one (on a GPU each of those is a synchronous copy: the host waits for the device's queue). AR and
    SD cross as often per round at batch 1 as at batch 3."""
    implicit, per_round = crossings(pair, mode, 3, temperature=temperature, **kw)
    assert implicit == [], implicit
    if mode != "ssd":  # SSD's fan-out groups and hit/miss mixes vary with the batch
        assert crossings(pair, mode, 1, temperature=temperature, **kw)[1] == per_round


def test_host_to_device_counts_a_list_made_on_the_device(monkeypatch):
    """The counter itself: a device tensor indexed with a list, or a list made on the device, is named."""
    x = torch.arange(6)
    with HostToDevice() as h2d:
        devices.to_device(torch.tensor([1, 2], device="cpu"), "cpu")  # the way to cross
        x[[0, 2]]
        torch.tensor([3, 4], device=x.device)
    assert len(h2d.made) == 3 and len(h2d.implicit()) == 2 and h2d.n() == 1


# ----------------------------------------------------------------------------------------------------
# Item 3: devices are checked before anything starts; "cuda" gets its index

def test_a_missing_gpu_is_refused_before_any_process_starts(pair, monkeypatch):
    """On a machine without CUDA, a draft (or tensor-parallel) device on a GPU is one line naming it,
    raised before the speculator's process or any rank is started (not its traceback)."""
    monkeypatch.setattr(channel, "start_child", lambda *a: pytest.fail("a process was started"))
    monkeypatch.setattr(tp, "start_child", lambda *a: pytest.fail("a process was started"))
    with pytest.raises(ValueError) as e:
        gen(pair, "ssd", draft_device="cuda:3")
    one_line(e, "cuda:3", "CUDA is not available")
    with pytest.raises(ValueError) as e:
        gen(pair, "ar", target_devices=["cuda:0", "cuda:1"])
    one_line(e, "cuda:0", "CUDA is not available")


def test_cli_names_a_missing_gpu_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(channel, "start_child", lambda *a: pytest.fail("a process was started"))
    assert run.main(["--mode", "ssd", "--draft-device", "cuda:3", "--max-new-tokens", "4", "--json"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: device cuda:3") and "\n" not in err and "Traceback" not in err, err


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine with two visible GPUs, the current one being cuda:1; set_device calls are recorded and
    stop the caller right there (nothing else may touch the fake GPUs)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    calls = []

    def set_device(device):
        calls.append(device)
        raise RuntimeError("stub: stop after set_device")
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    return calls


def test_cuda_without_an_index_is_the_current_gpu(two_gpus):
    assert check_device("cuda") == torch.device("cuda", 1) and check_device("cuda:0") == torch.device("cuda", 0)
    assert check_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError) as e:
        check_device("cuda:2")
    one_line(e, "cuda:2", "2 GPUs")


def test_speculator_and_tp_ranks_set_an_indexed_device(two_gpus):
    """torch.cuda.set_device needs an index: given "cuda", the speculator's process and a tensor-parallel
    rank set the GPU it means (here the current one, cuda:1), not a device without an index."""
    cfg = DraftConfig("unused", "cuda", torch.bfloat16, DraftSettings(K=3), True, 0.0, 0, 64)

    class Errors(list):
        put = list.append
    errors = Errors()
    with pytest.raises(SystemExit):
        channel.speculator_main(cfg, None, None, None, errors)
    assert "stub: stop after set_device" in errors[0][1]
    with pytest.raises(RuntimeError, match="stub"):
        tp.tp_init(1, 2, None, "nccl", "cuda")
    assert [torch.device(d) for d in two_gpus] == [torch.device("cuda", 1)] * 2, two_gpus


# ----------------------------------------------------------------------------------------------------
# Items 6 and 8: what the clocks count on a GPU

PENDING_S = 1.0  # the fake device's prefill work, finished only when the host waits for it


@pytest.fixture
def slow_device(monkeypatch):
    """A device that runs a prefill's last chunk after the host has queued it: PENDING_S seconds that the
    first wait for the device (decode.sync, or a device-to-host read) pays."""
    pending = []

    def wait(real):
        def waited(*a, **kw):
            while pending:
                time.sleep(pending.pop())
            return real(*a, **kw)
        return waited
    real_prefill = Transformer.prefill

    def prefill(self, *a, **kw):
        out = real_prefill(self, *a, **kw)
        pending[:] = [PENDING_S]
        return out
    monkeypatch.setattr(Transformer, "prefill", prefill)
    monkeypatch.setattr(decode, "sync", wait(decode.sync))
    for m in (decode, draft, speculator, verify):
        monkeypatch.setattr(m, "to_host", wait(m.to_host))


@pytest.mark.parametrize("mode,kw", RUNS[:3], ids=["ar", "sd", "ssd"])
def test_prefill_clock_waits_for_the_device(pair, slow_device, mode, kw):
    """The prefill clock stops once the device has run the prefill, so its last chunk is prefill time, not
    the first round's."""
    s = gen(pair, mode, **kw).stats
    assert s["prefill_seconds"] >= PENDING_S > s["decode_seconds"], s


CAPTURE_S = 0.5  # a fake capture's seconds


@pytest.fixture
def slow_captures(monkeypatch):
    """The static-shape path on the CPU, with each new bucket's first step taking CAPTURE_S and timing it as
    StaticSteps.capture_graph does on CUDA."""
    real = StaticSteps.step

    def step(self, model, cache, seq_ids, tokens, T):
        n = len(self.buckets)
        out = real(self, model, cache, seq_ids, tokens, T)
        if len(self.buckets) > n:  # a new shape: on CUDA, a capture
            time.sleep(CAPTURE_S)
            self.captures += 1
            self.capture_seconds += CAPTURE_S
        return out
    monkeypatch.setattr(StaticSteps, "step", step)


@pytest.mark.parametrize("mode,kw", RUNS[:3], ids=["ar", "sd", "ssd"])
def test_graph_captures_are_not_decode_time(pair, slow_captures, mode, kw):
    """Captures (each new shape's first step) are reported apart from decoding: decode_seconds and the
    verifications' seconds leave them out."""
    s = gen(pair, mode, graphs=True, **kw).stats
    assert s["capture_seconds"] >= 2 * CAPTURE_S, s  # a bucket per power of two of the context
    assert s["decode_seconds"] < 2 * CAPTURE_S and s["verify_seconds"] < CAPTURE_S, s
    if mode == "ssd":
        assert s["verifier_wait_seconds"] < CAPTURE_S and s["draft_capture_seconds"] >= CAPTURE_S, s


# ----------------------------------------------------------------------------------------------------
# Item 7: bf16 on CUDA needs the float32-output GEMM (torch >= 2.8)

def test_cuda_bf16_without_the_float32_gemm_is_refused(monkeypatch):
    """Without aten::mm.dtype the LM head would be upcast to a float32 copy in every step and graph: such a
    torch is refused for bf16/fp16 on CUDA, in one line naming the fix; float32, and the CPU, still run."""
    monkeypatch.setattr(devices, "MM_FP32_OUT", ())
    for dtype in ("auto", "bfloat16", "float16"):
        with pytest.raises(ValueError) as e:
            resolve_dtype(dtype, "cuda:0")
        one_line(e, "torch >= 2.8", "--dtype float32")
    assert resolve_dtype("float32", "cuda:0") == torch.float32
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    monkeypatch.setattr(devices, "MM_FP32_OUT", ("cuda", "meta"))
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16


def test_a_copy_into_the_cpu_blocks(monkeypatch):
    """to_device copies into a GPU without blocking (from page-locked memory), never into the CPU:
    the host reads what lands there next (a CUDA draft's proposals for a CPU target), and a
    non-blocking copy out of CUDA may not have landed yet. scripts/gpu_check.py's greedy check
    runs that pair on a GPU."""
    from devices import to_device
    seen, real_to, real_copy = [], torch.Tensor.to, torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "to",
                        lambda self, *a, **kw: seen.append(kw["non_blocking"]) or real_to(self, *a))
    monkeypatch.setattr(torch.Tensor, "copy_",
                        lambda self, x, **kw: seen.append(kw["non_blocking"]) or real_copy(self, x))
    to_device(torch.ones(3), "cpu")
    to_device(torch.ones(3), "cpu", out=torch.zeros(3))
    assert seen == [False, False]


def test_a_device_type_the_engine_does_not_run_is_refused_in_one_line():
    from devices import check_device
    for name in ("mps", "xpu", "meta"):
        with pytest.raises(ValueError, match=f"device '{name}' is not supported: use cpu or cuda:N"):
            check_device(name)


def test_the_draft_defaults_to_a_gpu_the_target_does_not_use(monkeypatch):
    """The draft's default GPU is the first the target leaves free, whichever GPUs the target was
    given (it was cuda:N for N target GPUs: cuda:4 for a target on cuda:4..7, sharing rank 0's)."""
    import engine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert engine.default_devices() == ("cuda:0", "cuda:1")
    assert engine.default_devices(["cuda:4", "cuda:5", "cuda:6", "cuda:7"]) == ("cuda:4", "cuda:0")
    assert engine.default_devices(["cuda:0", "cuda:1"]) == ("cuda:0", "cuda:2")
    assert engine.default_devices(["cuda:1"]) == ("cuda:1", "cuda:0")
    assert engine.default_devices(["cpu", "cpu"]) == ("cpu", "cuda:0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert engine.default_devices(["cuda:1", "cuda:0"]) == ("cuda:1", "cuda:1")  # none free: shares
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine.default_devices(["cpu", "cpu"]) == ("cpu", "cpu")
