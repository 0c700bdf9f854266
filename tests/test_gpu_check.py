"""scripts/gpu_check.py works before a GPU exists: `--device cpu --quick` runs every check at tiny sizes and
writes the report (issue 13). What the checks measure is only meaningful on a GPU; here each must run and pass
its own criterion on the CPU's stand-in figures."""
import json
import sys
from pathlib import Path

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
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == {"versions", "load", "step:llama-1b", "step:llama-8b", "host_syncs", "greedy",
                           "ssd:cpu+cpu", "long_prefill"}
    failed = {n: c for n, c in checks.items() if not c["ok"]}
    assert rc == 0 and not failed, failed
    assert 0.99 < checks["load"]["peak_over_weights"] < 1.15
    assert checks["step:llama-8b"]["weight_bytes"] > checks["step:llama-1b"]["weight_bytes"]
    assert checks["step:llama-1b"]["attention_ops"], checks["step:llama-1b"]  # the profiler saw SDPA
    for shape in ("step:llama-1b", "step:llama-8b"):  # the padded static-shape step (a graph on CUDA) = eager
        step = checks[shape]
        assert step["graph_vs_eager_same_argmax"] and step["graph_vs_eager_max_abs"] < 1e-3, step
        assert step["graph_decode_ms"] > 0 and step["graphs_captured"] == 0  # no capture on the CPU
    # decode rounds only (counting starts at the first streamed token): exactly tests/test_generate.py's numbers
    syncs = checks["host_syncs"]
    assert syncs["ar_per_round"] == 2 and syncs["sd_per_round"] == 4 and syncs["ssd_per_round"] <= 7
    # ... and every host-to-device crossing through model.to_device (issue 31)
    assert all(syncs[f"{m}_h2d_implicit"] == [] and syncs[f"{m}_h2d_per_round"] > 0 for m in ("ar", "sd", "ssd"))
    assert min(checks["greedy"][k] for k in ("sd", "ssd_one_process", "ssd_two_processes")) >= 0.9
    assert checks["ssd:cpu+cpu"]["tokens_equal"]
    table = capsys.readouterr().out
    assert all(name in table for name in checks) and "report written" in table
