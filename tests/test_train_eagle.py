"""scripts/train_eagle.py: an EAGLE-3 head trained end to end on a tiny random target (resumable,
exported, loadable), and its evaluation's rounds against distill_draft's greedy SD count."""
import json
import os
import random
import signal
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import eagle
from checkpoint import load_model
from scripts import distill_draft as dd
from scripts import train_eagle as te
from test_distill_draft import tiny_target

ARGS = ["--prompts", "10", "--heldout", "3", "--max-new-tokens", "10", "--gen-batch", "8",
        "--batch-tokens", "256", "--topk", "8", "--self-heldout", "0", "--humaneval", "0",
        "--layers", "0,1,1", "--vocab", "60", "--ttt", "2", "--eval-k", "3", "--steps", "4",
        "--eval-every", "2", "--lr", "3e-3", "--warmup", "1"]


def test_end_to_end_trains_exports_and_resumes(tmp_path):
    target = tiny_target(tmp_path / "target")
    out, work = tmp_path / "head", tmp_path / "work"
    te.main(["--target", str(target), "--out", str(out), "--work-dir", str(work), *ARGS])
    info = json.loads((out / "train.json").read_text())
    assert info["steps_done"] in (2, 4) and info["vocab"] == 60 and info["layers"] == [0, 1, 1]
    chat = info["heldout"]["chat"]
    assert 0 <= chat["acceptance"] <= 1 and 1 <= chat["tokens_per_round"] <= 4
    head = eagle.load(out)
    assert len(head.token_of) == 60 and head.target_layers == [0, 1, 1]
    log = (work / "log.txt").read_text()
    assert "eagle step 2/4" in log and "eagle step 4/4" in log
    # the same command again: nothing answered or computed again, training resumes at its end
    files = sorted(p.stat().st_mtime_ns for d in ("answers", "features")
                   for p in (work / d).iterdir())
    te.main(["--target", str(target), "--out", str(out), "--work-dir", str(work), *ARGS])
    assert sorted(p.stat().st_mtime_ns for d in ("answers", "features")
                  for p in (work / d).iterdir()) == files
    assert "eagle: resumed at step 4" in (work / "log.txt").read_text()
    # the finished work dir given a new --out: its head exported there (no best was seen there)
    te.main(["--target", str(target), "--out", str(tmp_path / "new"), "--work-dir", str(work),
             *ARGS])
    assert json.loads((tmp_path / "new" / "train.json").read_text())["steps_done"] == 4
    # ... but not with another setting of the head: one line, before any data work
    for flag, value in (("--layers", "1,1,1"), ("--ttt", "3"), ("--vocab", "50")):
        args = ARGS.copy()
        args[args.index(flag) + 1] = value
        with pytest.raises(ValueError, match=f"trained with {flag} .*another --work-dir"):
            te.main(["--target", str(target), "--out", str(out), "--work-dir", str(work), *args])


def test_bad_input_is_refused_before_the_data_work(tmp_path, capsys):
    target = tiny_target(tmp_path / "target")
    (tmp_path / "afile").write_text("")
    run = ["--target", str(target), "--work-dir", str(tmp_path / "work")]
    with pytest.raises(ValueError, match="--out .*afile/head: .*give a folder"):
        te.main([*run, "--out", str(tmp_path / "afile" / "head"), *ARGS])
    with pytest.raises(ValueError, match="--layers 0,1,9: .* has layers 0..1"):
        te.main([*run, "--out", str(tmp_path / "h"), *ARGS, "--layers", "0,1,9"])
    with pytest.raises(ValueError, match="--vocab 5000: .* has 4096 tokens: give at most 4096"):
        te.main([*run, "--out", str(tmp_path / "h"), *ARGS, "--vocab", "5000"])
    for flag, value in (("--steps", "0"), ("--layers", "0,1")):
        with pytest.raises(SystemExit):
            te.main([*run, "--out", str(tmp_path / "h"), *ARGS, flag, value])
        assert f"{flag} {value}:" in capsys.readouterr().err
    assert not (tmp_path / "work" / "answers").exists()


def test_ctrl_c_saves_after_the_step_and_the_same_command_goes_on(tmp_path, monkeypatch):
    """Ctrl-C during step 2's batch: step 2 finishes, is saved, the run ends with 130; the same
    command resumes at step 2 and ends where an uninterrupted run ends."""
    target = tiny_target(tmp_path / "target")
    args = ["--target", str(target), "--out", str(tmp_path / "h"), "--work-dir",
            str(tmp_path / "w"), *ARGS]
    collate, calls = te.collate, []

    def collate_then_ctrl_c(batch, steps, *a):
        calls.append(steps)
        if steps == 2 and calls.count(2) == 2:  # the second training batch (evaluations pass 0)
            os.kill(os.getpid(), signal.SIGINT)
        return collate(batch, steps, *a)
    monkeypatch.setattr(te, "collate", collate_then_ctrl_c)
    with pytest.raises(SystemExit) as e:
        te.main(args)
    assert e.value.code == 130
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # pytest's, put back
    log = (tmp_path / "w" / "log.txt").read_text()
    assert "interrupted at step 2, saved" in log
    monkeypatch.setattr(te, "collate", collate)
    te.main(args)
    log = (tmp_path / "w" / "log.txt").read_text()
    assert "eagle: resumed at step 2" in log and "eagle step 4/4" in log


def test_training_lowers_the_loss(tmp_path):
    """More steps on the same answers: the logged loss falls (the negative control is step 1's)."""
    target = tiny_target(tmp_path / "target")
    args = [a if a != "4" else "40" for a in ARGS]
    args[args.index("--eval-every") + 1] = "40"
    te.main(["--target", str(target), "--out", str(tmp_path / "h"), "--work-dir",
             str(tmp_path / "w"), *args])
    losses = [float(line.split(" loss ")[1].split()[0])
              for line in (tmp_path / "w" / "log.txt").read_text().splitlines()
              if "eagle step" in line and " loss " in line]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], losses


def test_sd_rounds_count_what_greedy_sd_takes():
    """With a head whose step j agrees exactly where teacher forcing would at the position it
    predicts, the rounds are distill_draft.greedy_sd_rounds' (which tests/test_distill_draft.py
    checks against the engine's SD)."""
    rng = random.Random(0)
    for _ in range(200):
        P, A, K = rng.randint(1, 6), rng.randint(2, 30), rng.randint(1, 5)
        a = [rng.random() < 0.6 for _ in range(A)]  # answer token p agrees
        T = P + A - 1  # entries with a token to predict
        agree = torch.zeros(K, T, dtype=torch.bool)
        for j in range(K):
            for i in range(T):
                p = i + j + 1 - P
                agree[j, i] = 0 <= p < A and a[p]
        rounds, accepted, trials, reached, hit = te.sd_rounds(agree, P, K)
        assert rounds == dd.greedy_sd_rounds(a, K)
        # every answer token after the first, once: a bonus token each round but the last, whose
        # accepted run may end the answer
        assert accepted + rounds in (A - 1, A)
        assert sum(hit) == accepted and sum(reached) == trials


def test_topk_kl_is_zero_for_the_same_law_and_counts_mass_outside_the_rows():
    torch.manual_seed(0)
    logits = torch.randn(5, 7)
    logp = torch.log_softmax(logits, -1)
    top = logp.topk(7, -1)
    kl = te.topk_kl(logits, top.indices, top.values)
    assert kl.abs().max() < 1e-5
    # a head without the row of each position's top token (the target's 7 tokens, the head's 6):
    # that mass can only fall in the rest bucket, where the head has none left
    keep = torch.stack([r[r != t] for r, t in zip(torch.arange(7).expand(5, 7), top.indices[:, 0])])
    own = logits.gather(-1, keep)  # [5, 6]: the head's rows are these tokens
    row_of = torch.full((5, 7), -1)
    row_of.scatter_(1, keep, torch.arange(6).expand(5, 6))
    rows = row_of.gather(1, top.indices)
    assert (rows[:, 0] == -1).all() and (rows[:, 1:] >= 0).all()
    assert (te.topk_kl(own, rows, top.values) > 0.1).all()
    # the same head with k covering only the head's rows: the missing token is in the rest bucket
    # of p, and the KL still sees it
    assert (te.topk_kl(own, rows[:, 1:], top.values[:, 1:]) > 0.1).all()


def test_text_examples_carry_the_targets_law_and_its_features(tmp_path, monkeypatch):
    """--text-tokens: each window's labels are the target's top-k law at each position (for the
    next token) and its features the chosen layers' outputs, as a forward of the window alone
    gives them; a second call reads them back."""
    model, tok = load_model(tiny_target(tmp_path / "target"))
    files = [tmp_path / "a.py", tmp_path / "b.py"]
    files[0].write_text("def add(a, b):\n    return a + b\n" * 20)
    files[1].write_text("Some English text, then some more of it.\n" * 30)
    monkeypatch.setattr(te, "text_files", lambda: files)
    args, work = SimpleNamespace(text_tokens=400, text_window=100, bf16=False), tmp_path / "w"
    work.mkdir()
    examples = te.text_examples(model, tok, [0, 1, 1], work, args, topk=8)
    assert sum(len(e["answer"]) + 1 for e in examples) >= 400 and len(examples) >= 4
    for e in examples[:3]:
        ids = e["prompt"] + e["answer"]
        assert len(ids) <= 100 and len(e["top_ids"]) == len(ids) - 1
        logits, h = model(torch.tensor([ids]), [0, 1, 1])
        top = torch.log_softmax(logits[0, :-1], -1).topk(8, -1)
        assert torch.equal(e["top_ids"][:, 0].long(), top.indices[:, 0])  # the argmax: no ties
        torch.testing.assert_close(e["top_logp"].float(), top.values, atol=2e-3, rtol=1e-2)
        torch.testing.assert_close(e["features"].float(), h[0].to(torch.bfloat16).float())
        torch.testing.assert_close(h[0], model.layer_states(torch.tensor([ids]), [0, 1, 1])[0])
    made = sorted(p.stat().st_mtime_ns for p in (work / "features").iterdir())
    again = te.text_examples(model, tok, [0, 1, 1], work, args, topk=8)
    assert sorted(p.stat().st_mtime_ns for p in (work / "features").iterdir()) == made
    assert [e["answer"] for e in again] == [e["answer"] for e in examples]


def test_text_files_leave_out_tests_and_what_the_held_out_prompts_quote():
    files = te.text_files()
    assert len(files) > 100 and all(f.suffix == ".py" and f.name != "__init__.py" for f in files)
    std = Path(sysconfig.get_paths()["stdlib"])  # in a package: no top-level module
    rel = [f.relative_to(std).parts for f in files]
    assert all(len(p) >= 2 and not {"test", "tests", "site-packages", "encodings"} & set(p)
               for p in rel)


def test_features_are_found_by_their_answers_when_more_prompts_move_them(tmp_path):
    """--prompts grown: a source's answers stand later in the training list (the templates' grow
    before them, by any number): their features are read back, not computed again."""
    model, _ = load_model(tiny_target(tmp_path / "target"), tokenizer=False)
    g = torch.Generator().manual_seed(0)
    ex = [{"prompt": torch.randint(2, 4096, (3,), generator=g).tolist(),
           "answer": torch.randint(2, 4096, (2,), generator=g).tolist()} for _ in range(192)]
    for i, e in enumerate(ex):  # three answers files of 50, 64 and 78 answers
        e["chunk"] = "abc"[(i >= 50) + (i >= 114)]
    work = tmp_path / "w"
    work.mkdir()
    first = te.features(model, ex[50:], [0, 1, 1], work, "train", 256)  # 3 chunks: 64, 64, 14
    made = {p.name: p.stat().st_mtime_ns for p in (work / "features").iterdir()}
    again = te.features(model, ex, [0, 1, 1], work, "train", 256)  # file a's 50 before them
    now = {p.name: p.stat().st_mtime_ns for p in (work / "features").iterdir()}
    assert len(made) == 3 and len(now) == 4 and all(now[n] == t for n, t in made.items())
    assert all(torch.equal(a, b) for a, b in zip(first, again[50:]))


def test_training_with_text_reads_it_beside_the_answers(tmp_path, monkeypatch):
    """--text-tokens through main(): the text's windows are made with the run's flags and counted
    beside the answers (the features line), and train.json records their tokens."""
    target = tiny_target(tmp_path / "target")
    (tmp_path / "a.py").write_text("def add(a, b):\n    return a + b\n" * 40)
    monkeypatch.setattr(te, "text_files", lambda: [tmp_path / "a.py"])
    work = tmp_path / "w"
    te.main(["--target", str(target), "--out", str(tmp_path / "h"), "--work-dir", str(work),
             *ARGS, "--text-tokens", "300", "--text-window", "64"])
    info = json.loads((tmp_path / "h" / "train.json").read_text())
    text = [ex for f in sorted((work / "features").glob("text_*")) for ex in torch.load(f)]
    assert info["text_tokens"] == sum(len(ex["answer"]) for ex in text) >= 250
    answers = [ex for f in sorted((work / "answers").glob("train_*")) for ex in torch.load(f)]
    positions = int((work / "log.txt").read_text().split("features: ")[1].split()[0])
    assert positions == sum(len(ex["prompt"]) + len(ex["answer"]) for ex in answers + text)
    assert info["steps_done"] in (2, 4) and info["train_answers"] == len(answers) == 10


def test_a_quantized_targets_features_are_read_from_its_own_weights_in_float():
    """reader_of: a GGUF target's int4 weights dequantized to float32 give the features the model
    as loaded gives (to within its kernels' 16-bit activations), not another model's; bf16
    autocast stays within about 1%; a float target is read as it is."""
    args = SimpleNamespace(target="smollm2-135m", device="cpu")
    target, _ = load_model(args.target, tokenizer=False)
    reader = te.reader_of(target, args)
    assert any(isinstance(m, te.QuantLinear) for m in target.modules())
    assert not any(isinstance(m, te.QuantLinear) for m in reader.modules())
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, target.config.vocab_size, (2, 64), generator=g)
    want = target.layer_states(x, [1, 14, 26])

    def rel(h):  # the largest relative difference of a position's features
        return ((h.float() - want).norm(dim=-1) / want.norm(dim=-1)).max().item()

    assert rel(reader.layer_states(x, [1, 14, 26])) < 2e-3
    with te.autocast("cpu", True):
        assert rel(reader.layer_states(x, [1, 14, 26])) < 0.03
    assert te.reader_of(reader, args) is reader  # float weights: nothing loaded again
    other, _ = load_model(args.target, tokenizer=False, quant="int8")  # not the file's model
    assert rel(other.layer_states(x, [1, 14, 26])) > 1e-2  # the bound above can fail
