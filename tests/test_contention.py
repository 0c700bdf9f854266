"""scripts/contention.py: the verifier's forward timed while the draft's process idles, polls or
drafts, and right after draft steps or a wait. Its numbers are the machine's; here it must run end
to end, really draft in the other process, and say so when that process fails."""
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from scripts import contention  # noqa: E402

QUICK = ["--batch-sizes", "1,2", "--context", "16", "--repeats", "2", "--per-mode", "2",
         "--warmup", "1", "--target-threads", "1", "--draft-threads", "1"]


@pytest.fixture(autouse=True)
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_contention_measures_every_arm_with_a_drafting_neighbour(capsys):
    results = contention.main(QUICK)
    assert [r["batch"] for r in results] == [1, 2]
    for r in results:
        assert r["tokens"] == r["batch"] * 5 and r["branches"] == r["batch"] * 4
        beside, after = r["beside"], r["after"]
        assert all(beside["ms"][m] > 0 for m in contention.MODES), r
        assert beside["draft_passes"] > 0  # the other process drafted while the verifier was timed
        assert beside["draft_over_idle"] == pytest.approx(beside["ms"]["draft"] /
                                                          beside["ms"]["idle"])
        assert after["gap_ms"] > 0 and all(after["ms"][g] > 0 for g in contention.GAPS), r
        assert after["poll_over_draft"] == pytest.approx(after["ms"]["poll"] / after["ms"]["draft"])
    out = capsys.readouterr().out
    assert "draft/idle" in out and "poll/draft" in out


def test_a_failing_draft_process_is_reported_not_measured_as_idle(tmp_path):
    # a draft that resolves (config.json) but cannot load (no weights) fails in the other process
    (tmp_path / "config.json").write_text((REPO / "checkpoints/tiny-draft/config.json").read_text())
    with pytest.raises(RuntimeError, match="draft's process"):
        contention.main(QUICK + ["--batch-sizes", "1", "--draft", str(tmp_path)])


def test_a_wrong_model_name_fails_before_anything_starts():
    with pytest.raises(FileNotFoundError, match="not found"):
        contention.main(QUICK + ["--draft", "no/such/checkpoint"])


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        contention.parse(["--batch-sizes", "1,x"])
    with pytest.raises(SystemExit):
        contention.parse(["--k", "0"])
