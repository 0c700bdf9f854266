"""scripts/gpu_check.py works before a GPU exists: `--device cpu --quick` runs every check at tiny sizes and
writes the report (issue 13). What the checks measure is only meaningful on a GPU; here each must run and pass
its own criterion on the CPU's stand-in figures."""
import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts import gpu_check  # noqa: E402


def test_gpu_check_quick_on_cpu(tmp_path, capsys):
    out = tmp_path / "report.json"
    threads = torch.get_num_threads()
    try:
        rc = gpu_check.main(["--device", "cpu", "--quick", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    assert report["command"] == "python scripts/gpu_check.py --device cpu --quick"  # no machine's path
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == {"versions", "load", "step:llama-1b", "step:llama-8b", "attention", "attention_speed", "host_syncs",
                           "greedy", "sampling", "ssd:cpu+cpu", "long_prefill",
                           "quant_step:llama-8b:int8", "quant_step:llama-8b:int4"}
    failed = {n: c for n, c in checks.items() if not c["ok"]}
    assert rc == 0 and not failed, failed
    assert 0.99 < checks["load"]["peak_over_weights"] < 1.15
    assert checks["step:llama-8b"]["weight_bytes"] > checks["step:llama-1b"]["weight_bytes"]
    assert checks["step:llama-1b"]["attention_ops"], checks["step:llama-1b"]  # the profiler saw SDPA
    # the quantized steps: int4 stores fewer bytes than int8, the default path computes eager's logits
    q = {n: checks[f"quant_step:llama-8b:{n}"] for n in ("int8", "int4")}
    assert q["int4"]["weight_bytes"] < q["int8"]["weight_bytes"] < checks["step:llama-8b"]["weight_bytes"]
    assert all(c["default_vs_eager_max_abs"] < 1e-3 and c["default_decode_ms"] > 0 for c in q.values()), q
    for shape in ("step:llama-1b", "step:llama-8b"):  # the padded static-shape step (a graph on CUDA) = eager
        step = checks[shape]
        assert step["graph_vs_eager_same_argmax"] and step["graph_vs_eager_max_abs"] < 1e-3, step
        assert step["graph_decode_ms"] > 0 and step["graph_captures"] == 0  # no capture on the CPU
    # decode rounds only (counting starts at the first streamed token): exactly tests/test_generate.py's numbers
    syncs = checks["host_syncs"]
    assert syncs["ar_per_round"] == 2 and syncs["sd_per_round"] == 4 and syncs["ssd_per_round"] <= 7
    # ... and every host-to-device crossing through devices.to_device (issue 31)
    assert all(syncs[f"{m}_h2d_implicit"] == [] and syncs[f"{m}_h2d_per_round"] > 0 for m in ("ar", "sd", "ssd"))
    assert min(checks["greedy"][k] for k in ("sd", "ssd_one_process", "ssd_two_processes")) >= 0.9
    law = checks["sampling"]  # temperature 1, every mode, under the sampling-noise bound
    assert {k for k in law if k.endswith("_tv")} == {"ar_tv", "sd_tv", "ssd_one_process_tv", "ssd_two_processes_tv"}
    assert checks["ssd:cpu+cpu"]["tokens_equal"]
    assert max(checks["attention"][f"{x}_max_abs"] for x in ("decode", "verify", "prefill_chunk")) < 0.05
    prefill = checks["long_prefill"]  # below one chunk's scores, the limit a materialising kernel exceeds
    assert prefill["largest_alloc_bytes"] < prefill["chunk_scores_bytes"] == 8 * 64 * 256 * 2
    table = capsys.readouterr().out
    assert all(name in table for name in checks) and "report written" in table


# ----------------------------------------------------------------------------------------------------
# The checks that could not fail before (issue 31, items 9-11): each must fail where the GPU would be wrong

def quick():
    return argparse.Namespace(device="cpu", quick=True, bandwidth_gbs=None)


def materialising_sdpa(q, k, v, attn_mask=None):
    """Attention as a math kernel computes it: every score of the chunk in memory at once."""
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + attn_mask
    return scores.softmax(-1) @ v


def test_long_prefill_fails_when_attention_materialises_its_scores(monkeypatch):
    assert gpu_check.check_long_prefill(quick(), gpu_check.QUICK_SHAPES)["ok"]
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", materialising_sdpa)
    res = gpu_check.check_long_prefill(quick(), gpu_check.QUICK_SHAPES)
    assert not res["ok"] and res["largest_alloc_bytes"] >= res["chunk_scores_bytes"], res


@pytest.mark.parametrize("wrong", ["no mask", "other KV head", "scale"])
def test_attention_check_fails_on_a_wrong_kernel(monkeypatch, wrong):
    real = torch.nn.functional.scaled_dot_product_attention
    kernels = {"no mask": lambda q, k, v, attn_mask=None: real(q, k, v),
               "other KV head": lambda q, k, v, attn_mask=None: real(q, k.flip(1), v.flip(1), attn_mask=attn_mask),
               "scale": lambda q, k, v, attn_mask=None: real(q, k, v, attn_mask=attn_mask,
                                                             scale=0.9 * q.shape[-1] ** -0.5)}
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", kernels[wrong])
    assert not gpu_check.check_attention(quick(), gpu_check.QUICK_SHAPES)["ok"]


def test_bandwidth_floor_counts_what_a_decode_step_reads():
    """A decode step reads one row of the embedding table per token, not the table: the floor leaves it out,
    unless the LM head is that table (tied, as Llama-3.2-1B's)."""
    untied = gpu_check.random_model(gpu_check.QUICK_SHAPES["llama-8b"], "cpu")
    table = untied.model.embed_tokens.weight
    assert gpu_check.step_read_bytes(untied) == gpu_check.weight_bytes(untied) - table.numel() * table.element_size()
    tied = gpu_check.random_model(gpu_check.QUICK_SHAPES["llama-1b"], "cpu")
    assert gpu_check.step_read_bytes(tied) == gpu_check.weight_bytes(tied)
    res = gpu_check.check_step(argparse.Namespace(device="cpu", quick=True, bandwidth_gbs=100.0), "llama-8b",
                               gpu_check.QUICK_SHAPES["llama-8b"])
    kv = 2 * 4 * 64 * 2 * 32 * 2  # K and V, 4 layers, 64 tokens of context, 2 KV heads x 32, bf16
    assert res["floor_ms"] == pytest.approx(1000 * (gpu_check.step_read_bytes(untied) + kv) / 100e9)
