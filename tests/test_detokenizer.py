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
