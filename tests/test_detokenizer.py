"""run.Detokenizer: text streamed a few tokens at a time equals the answer decoded whole, for
both shipped tokenizers, with multi-byte characters split across rounds."""
import random

import pytest

from checkpoint import load_tokenizer
from run import Detokenizer

TEXT = ("def f(x):\n    return x  # naïve café, 日本語 😀👍🏽 ünïcödé\n\n"
        "Tips: 1) feed it, 2) keep it warm — done. «quotes» and ‘smart’ ones.")


@pytest.mark.parametrize("name", ["tiny", "checkpoints/smollm2-135m-draft"])
def test_streamed_text_equals_whole_decode(name):
    tok = load_tokenizer(name)
    rng = random.Random(0)
    ids = tok.encode(TEXT, add_special_tokens=False)
    streams = [ids, [rng.randrange(len(tok)) for _ in range(300)]]  # real text; random ids
    for tokens in streams:
        whole = tok.decode(tokens, skip_special_tokens=True)
        for trial in range(5):
            detok, upto, seen = Detokenizer(tok), 0, ""
            while upto < len(tokens):
                upto += rng.randint(1, 5)  # a round's tokens
                text = detok.add(tokens[:upto], done=upto >= len(tokens))
                assert text.startswith(seen)  # what was sent is never taken back
                assert "\ufffd" not in text or upto >= len(tokens) or "\ufffd" in whole
                seen = text
            assert seen == whole, (name, trial)


def test_a_character_split_across_rounds_waits_for_its_last_byte():
    tok = load_tokenizer("checkpoints/smollm2-135m-draft")  # byte-level: 😀 is several tokens
    ids = tok.encode("ok 😀", add_special_tokens=False)
    detok = Detokenizer(tok)
    assert detok.add(ids[:1]) == "ok"
    assert detok.add(ids[:-1]) == "ok"  # the emoji's bytes are not all there yet: held back
    assert detok.add(ids) == "ok 😀"


def test_the_cli_prints_an_answer_that_ends_inside_a_character(capsys):
    """run.py's printer holds back a character's first bytes while more may come; an answer that
    ends there (max_new_tokens) prints them at the end, as the whole decode does."""
    from run import text_printer
    tok = load_tokenizer("checkpoints/smollm2-135m-draft")
    ids = tok.encode("ok 😀", add_special_tokens=False)[:-1]  # the emoji cut short
    printer = text_printer(tok)
    printer(0, ids[:1])
    printer(0, ids)
    assert capsys.readouterr().out == "ok"  # the emoji's bytes held back
    printer(0, ids, done=True)
    assert "ok" + capsys.readouterr().out == tok.decode(ids, skip_special_tokens=True)


def test_a_stream_callbacks_return_value_ends_no_row():
    """generate()'s stream is told the tokens; whatever it returns (here the list it keeps) does
    not stop a row, as a server's stop string does."""
    from run import generate
    seen = {}
    res = generate([[1, 5, 9], [2, 6]], target="tiny", draft="tiny-draft", mode="sd",
                   max_new_tokens=12, ignore_eos=True,
                   stream=lambda row, tokens: seen.setdefault(row, []).extend(tokens) or seen[row])
    assert [len(t) for t in res.tokens] == [12, 12]
