"""cpu_linear.py: the CPU's choice of form for a product of 2..16 rows.

1. Every form computes the same product as nn.Linear (with and without a bias), and a forward never
   times: a row count that was not chosen runs plain.
2. The timing (choose_forms) sweeps the whole model in forward order, one choice per weight shape,
   within a byte budget; the lowest median wins; a weight in training is timed without the packed
   form; the caller's random stream is left alone.
3. Once per machine: use_forms writes its choices to the cache file ($SSD_CACHE_DIR, a temporary
   directory in the tests: conftest.py) and a second load of the model reads them there without
   timing; another thread count is timed again; an unreadable file is timed again and rewritten.
4. MKL's packed copies follow the weight, step aside for training and for a machine short of
   memory, and the allocation log of scripts/gpu_check.py reads a packed product.
"""
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import make_checkpoint

import cpu_linear
from checkpoint import checkpoint_params, load_model
from cpu_linear import FORMS, FormLinear, choose_forms, form_layers, use_forms
from scripts.gpu_check import Allocations

HERE_FORMS = FORMS if cpu_linear.MKL_PACK else FORMS[:2]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def form_linear(bias: bool, form: str | None = None, rows=(3, 4)) -> FormLinear:
    lin = FormLinear(nn.Linear(8, 16, bias=bias).requires_grad_(False), {})
    if form:
        lin.forms.update({(M, torch.get_num_threads()): form for M in rows})
    return lin


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("form", HERE_FORMS)
def test_every_form_computes_the_same_product(form, bias):
    lin = form_linear(bias, form)
    for shape in ((3, 8), (4, 8), (1, 4, 8), (1, 8), (32, 8)):  # chosen for 3 and 4 rows only
        x = torch.randn(shape)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5,
                                   rtol=1e-5)
    assert sorted(lin.packs) == ([3, 4] if form == "packed" else [])


def test_a_forward_never_times(monkeypatch):
    monkeypatch.setattr(cpu_linear, "choose_forms", lambda *a, **k: pytest.fail("timed"))
    lin = form_linear(True)
    x = torch.randn(5, 8)  # no form chosen for 5 rows: plain
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))


def test_fastest_form_is_the_lowest_median():
    assert cpu_linear.fastest({"plain": [2, 9, 2], "transposed": [1, 1, 9],
                               "packed": [3, 3, 0]}) == "transposed"
    assert cpu_linear.fastest({"plain": [1.0] * 3, "transposed": [1.0] * 3}) == "plain"  # a tie


class FakeLinear:
    """What choose_forms reads of a layer: its shape's `forms`, in_features, weight, packs, and a
    product that records its call and spends `cost` of a fake clock (`now`)."""

    def __init__(self, name, forms, in_features, mb, calls, cost=None, now=None):
        self.name, self.forms, self.in_features = name, forms, in_features
        self.calls, self.cost, self.now = calls, cost, now
        self.weight = torch.empty(mb << 18)  # mb MiB of float32
        self.packs = {3: "stale"}

    def pack(self, M):
        return "a pack"

    def product(self, x, form):
        self.calls.append((self.name, form, tuple(x.shape)))
        if self.cost:
            self.now[0] += self.cost[self.name[0], form]


def test_forms_are_timed_in_sweeps_over_the_model_as_a_forward_streams_it():
    # two weight shapes, A and B, in forward order a1 b1 a2 b2: every timing runs all four in one
    # form, and each shape's choice comes from its own layers' time in those sweeps
    cost = {("a", "plain"): 2, ("a", "transposed"): 3, ("a", "packed"): 1,  # A: packed
            ("b", "plain"): 1, ("b", "transposed"): 3, ("b", "packed"): 2}  # B: plain
    calls, A, B, now = [], {}, {}, [0.0]
    layers = [FakeLinear(n, f, d, 1, calls, cost, now)
              for n, f, d in (("a1", A, 4), ("b1", B, 6), ("a2", A, 4), ("b2", B, 6))]
    choose_forms(layers, 3, reps=2, clock=lambda: now[0])
    threads = torch.get_num_threads()
    assert A == {(3, threads): "packed"} and B == {(3, threads): "plain"}
    assert [(n, f) for n, f, _ in calls] == [(n, f) for _ in range(2) for f in FORMS
                                             for n in ("a1", "b1", "a2", "b2")]
    assert {(n[0], s) for n, _, s in calls} == {("a", (3, 4)), ("b", (3, 6))}
    # a shape that chose another form drops its packed copies for that row count
    assert [layer.packs for layer in layers] == [{3: "stale"}, {}, {3: "stale"}, {}]


def test_a_sweep_stops_after_its_byte_budget_but_times_every_shape():
    calls, A, B, H = [], {}, {}, {}
    layers = [FakeLinear(n, f, 4, 1, calls) for n, f in
              (("a1", A), ("b1", B), ("a2", A), ("b2", B), ("a3", A), ("b3", B), ("h", H))]
    names = [layer.name for layer in cpu_linear.sweep_of(layers, budget=3 << 20)]
    assert names == ["a1", "b1", "a2", "h"]  # 3 MiB of weights, then the head's shape
    assert [layer.name for layer in cpu_linear.sweep_of(layers)] == [layer.name for layer in layers]


def test_a_weight_in_training_is_timed_without_the_packed_form(monkeypatch):
    lin = FormLinear(nn.Linear(8, 16), {})  # requires_grad, grad enabled: no backward if packed
    timed = []
    monkeypatch.setattr(cpu_linear, "fastest", lambda times: timed.append(sorted(times)) or "plain")
    choose_forms([lin], 3)
    assert timed == [sorted(FORMS[:2])] and lin.packs == {}
    with torch.no_grad():  # the same weight, not training: packing allowed where MKL has it
        choose_forms([lin], 4)
    assert timed[1] == sorted(HERE_FORMS)
    state = torch.get_rng_state()
    choose_forms([lin], 5)  # the timing's inputs leave the caller's random stream alone
    assert torch.equal(torch.get_rng_state(), state)


def test_the_tests_never_read_the_users_cache():
    path = cpu_linear.forms_file()
    assert path.parent == Path(os.environ["SSD_CACHE_DIR"])
    assert Path.home() / ".cache" not in path.parents


def test_timed_once_per_machine_across_model_loads(ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_CACHE_DIR", str(tmp_path))
    path = tmp_path / "cpu_linear_forms.json"
    timed = []
    real = cpu_linear.choose_forms
    monkeypatch.setattr(cpu_linear, "choose_forms",
                        lambda layers, M: timed.append(M) or real(layers, M))
    m, _ = load_model(ckpt)
    params = checkpoint_params(m)
    assert use_forms(m, [1, 3, 6, 40]) > 0 and timed == [3, 6]  # only 2..16 rows have a choice
    layers = form_layers(m)
    shapes = {(tuple(lin.weight.shape), id(lin.forms)) for lin in layers}
    assert len(layers) > len(shapes) == len({s for s, _ in shapes})  # one `forms` per shape
    assert layers[-1] is m.lm_head and checkpoint_params(m).keys() == params.keys()
    chosen = {tuple(lin.weight.shape): dict(lin.forms) for lin in layers}
    record = json.loads(path.read_text())
    assert len(record) == 2 * len(shapes) and set(record.values()) <= set(FORMS)
    # a second load (a new process, a new generate() call) reads the choice: no timing
    m2, _ = load_model(ckpt)
    assert use_forms(m2, [3, 6]) == 0.0 and timed == [3, 6]
    assert {tuple(lin.weight.shape): dict(lin.forms) for lin in form_layers(m2)} == chosen
    assert use_forms(m2, [3]) == 0.0 and len(form_layers(m2)) == len(layers)  # swapped once
    # the same rows under another thread count are timed again, and recorded beside
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        use_forms(m2, [3])
    finally:
        torch.set_num_threads(threads)
    assert timed == [3, 6, 3] and len(json.loads(path.read_text())) == 3 * len(shapes)
    # an unreadable record is timed again and rewritten
    path.write_text("{not json")
    use_forms(load_model(ckpt)[0], [3])
    assert timed == [3, 6, 3, 3] and len(json.loads(path.read_text())) == len(shapes)


def test_forms_keep_the_models_logits(ckpt, tmp_path):
    m, _ = load_model(ckpt)
    tokens = torch.randint(0, 100, (1, 3))
    with torch.no_grad():
        plain = m(tokens)
        use_forms(m, [3], tmp_path / "forms.json")
        for lin in form_layers(m):
            for form in HERE_FORMS:
                lin.forms[3, torch.get_num_threads()] = form
            torch.testing.assert_close(m(tokens), plain, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not cpu_linear.MKL_PACK, reason="this torch build has no MKL packed GEMM")
def test_a_packed_weight_follows_the_weight_and_steps_aside_for_training(monkeypatch):
    lin = FormLinear(nn.Linear(8, 16, bias=False), {})  # requires_grad: packed only under no_grad
    lin.forms[(4, torch.get_num_threads())] = "packed"
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), x @ lin.weight.t(), atol=1e-5, rtol=1e-5)
        packed = lin.packs[4][1]
        lin.weight.copy_(torch.randn(16, 8))  # a new checkpoint loaded in place, an optimiser step
        torch.testing.assert_close(lin(x), x @ lin.weight.t(), atol=1e-5, rtol=1e-5)
        assert lin.packs[4][1] is not packed
    # training: the packed GEMM has no backward, so a weight that needs a gradient gets F.linear
    lin(x).sum().backward()
    torch.testing.assert_close(lin.weight.grad, x.sum(0).expand(16, 8))
    # no room for a copy of the weight: the product is still computed, without one
    monkeypatch.setattr(cpu_linear, "room_for", lambda nbytes: False)
    lin.packs.clear()
    with torch.no_grad():
        torch.testing.assert_close(lin(x), x @ lin.weight.t(), atol=1e-5, rtol=1e-5)
    assert lin.packs[4][1] is None
    # a model loaded under torch.inference_mode: its weights keep no version counter
    monkeypatch.undo()
    with torch.inference_mode():
        lin = FormLinear(nn.Linear(8, 16, bias=False), {})
        lin.forms[(4, torch.get_num_threads())] = "packed"
        torch.testing.assert_close(lin(x), x @ lin.weight.t(), atol=1e-5, rtol=1e-5)
        assert lin.packs[4][1] is not None


@pytest.mark.skipif(not cpu_linear.MKL_PACK, reason="this torch build has no MKL packed GEMM")
def test_the_allocation_log_reads_a_packed_product():
    # a packed weight is an opaque tensor (no storage): scripts/gpu_check.Allocations, which
    # tests use to bound what a forward allocates, must skip it, not fail on it
    lin = form_linear(False, "packed", rows=(4,))
    with Allocations() as log:
        y = lin(torch.randn(4, 8))
    assert lin.packs[4][1] is not None and y.shape == (4, 16)
    assert ("mkl._mkl_linear.default", torch.float32, 64, 256) in log.log
