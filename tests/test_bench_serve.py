"""bench_serve.py's arithmetic on made-up streams (the servers themselves: tests/test_serve.py)."""
import pytest

import bench_serve


def test_summarise_counts_each_token_of_a_chunk_its_share_of_the_wait():
    # request A: sent at 0, chunks of 1, 3 and 2 tokens at 0.1, 0.4, 0.6 s; request B: one token
    results = [(0.0, [(0.1, "a"), (0.4, "bcd"), (0.6, "ef")]), (0.2, [(0.5, "g")])]
    s = bench_serve.summarise(0.0, results, count_tokens=len)
    assert s["tokens"] == 7
    assert s["output_tok_s"] == pytest.approx(7 / 0.6)
    # TTFT: 0.1 and 0.3 s; ITL: 3 gaps of 0.1 s (0.3 / 3) and 2 of 0.1 s (0.2 / 2)
    assert s["ttft_ms_p50"] == pytest.approx(300) and s["ttft_ms_p99"] == pytest.approx(300)
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
    with pytest.raises(SystemExit):
        bench_serve.parse_args(["--servers", "vllm"])
    a = bench_serve.parse_args(["--shared-prefix", "1024", "--turns", "3"])
    assert (a.shared_prefix, a.turns) == (1024, 3)
    with pytest.raises(SystemExit):
        bench_serve.parse_args(["--turns", "0"])
