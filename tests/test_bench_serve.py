"""bench_serve.py's arithmetic on made-up streams, and its --tool runs on made-up reports of guidellm
and aiperf (the servers themselves: tests/test_serve.py)."""
import json
import subprocess
import time
from pathlib import Path

import pytest

import bench_serve


def test_summarise_counts_each_token_of_a_chunk_its_share_of_the_wait():
    # request A: sent at 0, chunks of 1, 3 and 2 tokens at 0.1, 0.4, 0.6 s; request B: one token
    results = [(0.0, [(0.1, "a"), (0.4, "bcd"), (0.6, "ef")]), (0.2, [(0.5, "g")])]
    s = bench_serve.summarise(0.0, results, count_tokens=len)
    assert s["tokens"] == 7
    assert s["output_tok_s"] == pytest.approx(7 / 0.6)
    # TTFT: 0.1 and 0.3 s (nearest rank: p50 the first, p99 the second); ITL: 3 gaps of 0.1 s
    # (0.3 / 3) and 2 of 0.1 s (0.2 / 2)
    assert s["ttft_ms_p50"] == pytest.approx(100) and s["ttft_ms_p99"] == pytest.approx(300)
    assert s["itl_ms_p50"] == pytest.approx(100) and s["itl_ms_p99"] == pytest.approx(100)
    # A decodes 5 tokens after its first in 0.5 s; B has no second token
    assert s["decode_tok_s_median"] == pytest.approx(10)


def test_an_answer_counts_its_tokens_whole_however_it_was_chunked():
    """The same text sent one token a chunk (AR) or several (SD, SSD) counts the same tokens: a
    BPE tokenizer can merge across a chunk's tokens, so chunks re-tokenised apart sum to another
    count (SmolLM2's chat answers: 1,668 through SD against 1,679 through AR, the same texts)."""
    def count(text):  # "ab" is one token, any other character one
        return len(text) - text.count("ab")
    one_by_one = [(0.0, [(0.1, "a"), (0.2, "b"), (0.3, "c")])]
    merged = [(0.0, [(0.2, "ab"), (0.3, "c")])]  # (chunks counted apart: 3 and 2)
    assert bench_serve.summarise(0.0, one_by_one, count)["tokens"] == 2
    assert bench_serve.summarise(0.0, merged, count)["tokens"] == 2


def test_args():
    a = bench_serve.parse_args(["--servers", "ar,ssd", "--clients", "1,8", "--", "--budget", "4"])
    assert a.servers == ["ar", "ssd"] and a.clients == [1, 8] and a.serve_args == ["--budget", "4"]
    assert bench_serve.server_command("ssd", a, 8123)[-2:] == ["--budget", "4"]
    assert "--draft" not in bench_serve.server_command("ar", a, 8123)
    # K is serve.py's own (the draft's recorded settings) unless given
    assert "--k" not in bench_serve.server_command("ssd", a, 8123)
    a = bench_serve.parse_args(["--k", "3"])
    cmd = bench_serve.server_command("sd", a, 8123)
    assert cmd[cmd.index("--k") + 1] == "3"
    with pytest.raises(SystemExit):
        bench_serve.parse_args(["--servers", "vllm"])
    a = bench_serve.parse_args(["--shared-prefix", "1024", "--turns", "3"])
    assert (a.shared_prefix, a.turns) == (1024, 3)
    with pytest.raises(SystemExit):
        bench_serve.parse_args(["--turns", "0"])


# --tool: the reports guidellm 0.8.1 and aiperf 0.13.0 write, trimmed to what bench_serve reads,
# in their own nesting; the numbers are those of a real run (serve.py --mode ar, tiny pair,
# 1 stream, 4 requests of 128 prompt and 64 output tokens)
def guidellm_stats(mean, p50, p99, total_sum):
    """One of guidellm's distribution summaries (metrics.<name>.successful), trimmed."""
    return {"mean": mean, "median": p50, "count": 4, "total_sum": total_sum,
            "percentiles": {"p01": 0.0, "p50": p50, "p95": p99, "p99": p99}}


def guidellm_report(successful=4, errored=()):
    return {"metadata": {"version": 2, "guidellm_version": "0.8.1"}, "benchmarks": [{
        "type_": "generative_benchmark", "duration": 2.56,
        "metrics": {
            "request_totals": {"successful": successful, "errored": len(errored),
                               "incomplete": 0, "total": successful + len(errored)},
            "output_tokens_per_second": {"successful": guidellm_stats(99.97, 105.4, 121.4,
                                                                      25591.5)},
            "output_token_count": {"successful": guidellm_stats(64.0, 64.0, 64.0, 256.0)},
            "time_to_first_token_ms": {"successful": guidellm_stats(51.46, 47.03, 66.24, 205.8)},
            "inter_token_latency_ms": {"successful": guidellm_stats(9.27, 8.84, 10.52, 2336.8)}},
        "requests": {"successful": [], "errored": [{"info": {"error": e}} for e in errored]}}]}


def aiperf_report(errors=()):
    ms = lambda p50, p99: {"unit": "ms", "avg": p50, "p50": p50, "p90": p99, "p99": p99}
    return {"schema_version": "1.4", "aiperf_version": "0.13.0", "was_cancelled": False,
            "is_complete": True, "request_count": {"unit": "requests", "avg": 4.0},
            "output_token_throughput": {"unit": "tokens/sec", "avg": 61.51},
            "total_output_tokens": {"unit": "tokens", "avg": 256.0},
            "time_to_first_token": ms(96.97, 117.07), "inter_token_latency": ms(16.17, 20.21),
            "error_summary": [{"error_details": {"code": 400, "type": "Bad Request",
                                                 "message": e}, "count": 2} for e in errors]}


def test_a_guidellm_report_gives_the_rows_figures():
    f = bench_serve.guidellm_figures(guidellm_report())
    assert f["output_tok_s"] == 99.97 and f["tokens"] == 256 and f["requests"] == 4
    assert (f["ttft_ms_p50"], f["ttft_ms_p99"]) == (47.03, 66.24)
    assert (f["itl_ms_p50"], f["itl_ms_p99"]) == (8.84, 10.52)
    assert f["decode_tok_s_median"] is None  # not in the report: the table prints "-"
    assert "| ar | 1 | guidellm | 100.0 | 47 / 66 | 8.8 / 10.5 | - | - |" in bench_serve.table(
        [{"server": "ar", "clients": 1, "load": "guidellm", **f}])


def test_an_aiperf_report_gives_the_rows_figures():
    f = bench_serve.aiperf_figures(aiperf_report())
    assert f["output_tok_s"] == 61.51 and f["tokens"] == 256 and f["requests"] == 4
    assert (f["ttft_ms_p50"], f["ttft_ms_p99"]) == (96.97, 117.07)
    assert (f["itl_ms_p50"], f["itl_ms_p99"]) == (16.17, 20.21)


def test_a_failed_request_fails_the_row():
    """guidellm exits 0 with tables of zeros when every request failed (issue 53): the row is an
    error naming the first failure, not zeros."""
    e404 = "HTTPStatusError(\"Client error '404 Not Found' for url '.../v1/completions'\")"
    with pytest.raises(RuntimeError, match="guidellm: 0 of 3 requests succeeded.*404"):
        bench_serve.guidellm_figures(guidellm_report(successful=0, errored=[e404] * 3))
    with pytest.raises(RuntimeError, match="guidellm: 4 of 5"):
        bench_serve.guidellm_figures(guidellm_report(errored=[e404]))
    with pytest.raises(RuntimeError, match="aiperf: 2 requests failed.*stream_options"):
        bench_serve.aiperf_figures(aiperf_report(errors=["stream_options: not supported"]))


def test_the_tools_command_lines(tmp_path):
    for tool in ("guidellm", "aiperf"):  # a virtual environment's layout
        (tmp_path / "bin").mkdir(exist_ok=True)
        (tmp_path / "bin" / tool).write_text("#!/bin/sh\n")
        (tmp_path / "bin" / tool).chmod(0o755)
    a = bench_serve.parse_args(["--tool", "own,guidellm,aiperf", "--tool-bin", str(tmp_path),
                                "--requests", "32", "--max-tokens", "64", "--prompt-tokens",
                                "128"])
    assert a.tools == ["own", "guidellm", "aiperf"]
    a.tokenizer = "/ckpt/tiny-target"
    out, base = tmp_path / "out", "http://127.0.0.1:8000"
    g = bench_serve.guidellm_command(a.tool_exe["guidellm"], a, base, "tiny", 8, 3, out)
    assert g[:2] == [str(tmp_path / "bin" / "guidellm"), "run"]
    flags = dict(zip(g[2::2], g[3::2]))
    assert flags["--backend"] == ("kind=openai_http,target=http://127.0.0.1:8000,model=tiny,"
                                  "request_format=/v1/completions")
    assert flags["--profile"] == "kind=concurrent,streams=8"
    assert flags["--constraint"] == "kind=max_requests,count=32"
    assert flags["--data"] == "kind=synthetic_text,prompt_tokens=128,output_tokens=64"
    assert flags["--tokenizer"] == "kind=hf_auto,model=/ckpt/tiny-target"
    assert flags["--output"] == f"kind=json,path={out / 'guidellm.json'}"
    p = bench_serve.aiperf_command(a.tool_exe["aiperf"], a, base, "tiny", 8, 3, out)
    assert p[:2] == [str(tmp_path / "bin" / "aiperf"), "profile"] and "--streaming" in p
    for flag, value in [("--url", base), ("--endpoint-type", "completions"),
                        ("--concurrency", "8"), ("--request-count", "32"), ("--isl", "128"),
                        ("--isl-stddev", "0"), ("--osl", "64"),
                        ("--extra-inputs", "ignore_eos:true"), ("--artifact-dir", str(out)),
                        ("--tokenizer", "/ckpt/tiny-target")]:
        assert p[p.index(flag) + 1] == value
    a.chat = True
    assert "request_format=/v1/chat/completions" in " ".join(
        bench_serve.guidellm_command("g", a, base, "tiny", 1, 3, out))
    assert "chat" in bench_serve.aiperf_command("p", a, base, "tiny", 1, 3, out)


def test_run_tool_reads_the_report_the_tool_wrote(tmp_path, monkeypatch):
    """A stand-in for each tool writes its report where the real one does; run_tool reads it,
    and sets HF_HUB_OFFLINE for guidellm only (aiperf 0.13.0 offline cannot read a local
    tokenizer folder)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for tool, name, report in [("guidellm", "guidellm.json", guidellm_report()),
                               ("aiperf", "profile_export_aiperf.json", aiperf_report())]:
        (tmp_path / f"{tool}.json").write_text(json.dumps(report))
        exe = tmp_path / tool
        exe.write_text(f"#!/bin/sh\necho \"offline=$HF_HUB_OFFLINE\"\n"
                       f"cp {tmp_path / f'{tool}.json'} {name}\n")
        exe.chmod(0o755)
    a = bench_serve.parse_args(["--tool", "guidellm,aiperf", "--tool-bin", str(tmp_path)])
    a.tokenizer = "/ckpt/tiny-target"
    g = bench_serve.run_tool("guidellm", a, "http://x", "tiny", 1, tmp_path / "g")
    p = bench_serve.run_tool("aiperf", a, "http://x", "tiny", 1, tmp_path / "p")
    assert (g["output_tok_s"], p["output_tok_s"]) == (99.97, 61.51)
    assert (tmp_path / "g" / "log.txt").read_text() == "offline=1\n"
    assert (tmp_path / "p" / "log.txt").read_text() == "offline=\n"
    (tmp_path / "aiperf").write_text("#!/bin/sh\nexit 3\n")
    with pytest.raises(RuntimeError, match="aiperf exited with code 3 and no report"):
        bench_serve.run_tool("aiperf", a, "http://x", "tiny", 1, tmp_path / "p2")
    # past --tool-timeout: the tool and what it started (here a sleep) are ended
    (tmp_path / "aiperf").write_text("#!/bin/sh\nsleep 60 &\necho $! > child.pid\nwait\n")
    a.tool_timeout = 0.5
    with pytest.raises(subprocess.TimeoutExpired):
        bench_serve.run_tool("aiperf", a, "http://x", "tiny", 1, tmp_path / "p3")
    child = (tmp_path / "p3" / "child.pid").read_text().strip()
    for _ in range(100):  # killed: gone, or a zombie its new parent has not reaped yet
        stat = Path(f"/proc/{child}/stat")
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.02)
    else:
        pytest.fail(f"the tool's child {child} outlived --tool-timeout")


def test_a_missing_tool_is_one_line_naming_its_install(tmp_path):
    with pytest.raises(SystemExit, match=r"--tool aiperf: no aiperf executable in .*pip install "
                                         r"aiperf==0\.13\.0.*--tool-bin") as e:
        bench_serve.parse_args(["--tool", "aiperf", "--tool-bin", str(tmp_path)])
    assert "\n" not in str(e.value)
    with pytest.raises(SystemExit):
        bench_serve.parse_args(["--tool", "vegeta"])


def test_percentiles_are_nearest_rank():
    """p-th percentile: the smallest value with at least p% of the samples at or below it (a p99
    of 100 samples is the 99th, not the worst)."""
    assert bench_serve.percentile([10, 20], 50) == 10
    assert bench_serve.percentile(list(range(1, 101)), 99) == 99
    assert bench_serve.percentile([1, 2, 3, 4], 50) == 2
    assert bench_serve.percentile([4, 1, 3], 100) == 4 and bench_serve.percentile([4, 1, 3], 0) == 1
