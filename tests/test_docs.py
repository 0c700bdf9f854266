"""The repository documents itself (issue 11, items 4 and 5): every command-line option has a help text, no
file cites documents or paths that exist only outside the repository, and every "docs/design.md section N"
cited anywhere names a numbered section of docs/design.md.

The parsers are captured without running anything: `ArgumentParser.parse_args` is patched to raise with the
parser in hand, so `bench.parse_args` and `run.main` stop right after building it.
"""
import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DESIGN = REPO / "docs" / "design.md"


class Captured(BaseException):  # a BaseException: no `except Exception` in the entry points swallows it
    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def capture_parser(monkeypatch, entry) -> argparse.ArgumentParser:
    """The parser `entry()` builds, taken from its first parse_args call."""
    def parse_args(self, *args, **kwargs):
        raise Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    with pytest.raises(Captured) as e:
        entry()
    return e.value.parser


def check_every_option_has_help(parser: argparse.ArgumentParser):
    options = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    assert options, "the parser has no options: did capturing it go wrong?"
    missing = [a.option_strings[-1] for a in options if a.help is None or not str(a.help).strip()]
    assert not missing, f"options without a help text: {', '.join(missing)}"
    text = parser.format_help()  # also expands every %(default)s: a stray % fails here, not at the user's --help
    for a in options:
        assert a.option_strings[-1] in text


def test_bench_options_have_help(monkeypatch):
    import bench
    check_every_option_has_help(capture_parser(monkeypatch, lambda: bench.parse_args([])))


def test_run_options_have_help(monkeypatch):
    import run
    check_every_option_has_help(capture_parser(monkeypatch, lambda: run.main([])))


def test_bench_help_runs():
    """`python bench.py --help` as a user types it: exit 0, every option listed."""
    out = subprocess.run([sys.executable, "bench.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: bench.py")
    for opt in ("--target", "--modes", "--temperatures", "--saguaro-c", "--fallback", "--budget", "--cores"):
        assert opt in out.stdout


# ----------------------------------------------------------------------------------------------------
# The repository stands alone

def repo_files(*patterns) -> list[Path]:
    """The repository's files (tracked, plus new ones not ignored) matching the git pathspecs."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *patterns],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"git is not available ({type(e).__name__})")
    if out.returncode != 0:
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    return sorted({REPO / x for x in out.stdout.splitlines() if (REPO / x).is_file()})


# Built from pieces so that this file does not match itself.
OUTSIDE = [re.compile(re.escape("DESIGN" + ".md")),    # a design document that lives outside the repository
           re.compile(re.escape("shared" + "/")),      # a directory of the development machine
           re.compile(re.escape("/" + "work/")),       # an absolute path of the development machine
           re.compile(re.escape("/" + "tmp/"))]        # a scratch directory of one machine


def test_no_citation_outside_the_repository():
    files = repo_files("*.py", "*.md", "*.txt")  # .txt: the training log
    assert any(f.name == "bench.py" for f in files), files
    bad = []
    for f in files:
        for i, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if any(p.search(line) for p in OUTSIDE):
                bad.append(f"{f.relative_to(REPO)}:{i}: {line.strip()[:100]}")
    assert not bad, "cites something outside the repository (write it into the repo, or cite the paper):\n" + \
        "\n".join(bad)


CITATION = re.compile(r"docs/design\.md,?\s+sections?\s+(\d+(?:\.\d+)*(?:\s*(?:,|and|-|to)\s*\d+(?:\.\d+)*)*)")
HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s+\S", re.M)


def test_cited_design_sections_exist():
    assert DESIGN.is_file(), "docs/design.md is missing"
    sections = set(HEADING.findall(DESIGN.read_text(encoding="utf-8")))
    assert sections, "docs/design.md has no numbered section headings (## 1. Title)"
    cited, bad = 0, []
    for f in repo_files("*.py", "*.md"):
        text = f.read_text(encoding="utf-8", errors="replace")
        for m in CITATION.finditer(re.sub(r"\s*\n\s*#?\s*", " ", text)):  # a citation may wrap a line
            for n in re.findall(r"\d+(?:\.\d+)*", m.group(1)):
                cited += 1
                if n not in sections:
                    bad.append(f"{f.relative_to(REPO)}: section {n}")
    assert cited, "nothing cites docs/design.md sections (verify.py and bench.py should)"
    assert not bad, f"cited sections missing from docs/design.md (it has {sorted(sections)}): {bad}"


def test_engine_lines_fit_100_columns():
    """The engine's files (the top-level *.py and *.cpp) are read side by side: no line over 100
    columns."""
    files = sorted([*REPO.glob("*.py"), *REPO.glob("*.cpp")])
    assert any(f.name == "run.py" for f in files), files
    long = [f"{f.name}:{i} ({len(line)} columns)"
            for f in files
            for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > 100]
    assert not long, "lines over 100 columns:\n" + "\n".join(long)


# ----------------------------------------------------------------------------------------------------
# One reading order (issue 54): decode.py's docstring, the README and docs/design.md carry the same
# "Reading order:" block, the README's file table lists the files in that order, and every engine
# file (top-level *.py) has its place in it.

PY_NAME = re.compile(r"\b[a-z_][a-z0-9_]*\.py\b")


def reading_order(text: str, where: str) -> list[str]:
    """The *.py names of the block that starts at the line "Reading order..." and runs over the
    indented lines after it, in order."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("Reading order")), None)
    assert start is not None, f"{where} has no 'Reading order' block"
    names = []
    for line in lines[start + 1:]:
        if not line.startswith(" ") or not line.strip():
            break
        names += PY_NAME.findall(line)
    assert names, f"{where}'s 'Reading order' block names no file"
    return names


def readme_table_order(readme: str) -> list[str]:
    """The top-level *.py names in the first column of the README's file table, in order."""
    names = []
    for line in readme.splitlines():
        cells = line.split("|")
        if line.startswith("| `") and len(cells) > 2:
            names += PY_NAME.findall(cells[1])
    return names


def test_one_reading_order():
    import decode
    order = reading_order(decode.__doc__, "decode.py's docstring")
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert reading_order(readme, "README.md") == order
    assert reading_order(DESIGN.read_text(encoding="utf-8"), "docs/design.md") == order
    assert readme_table_order(readme) == order, "the README's file table is not in the reading order"
    assert len(set(order)) == len(order), f"a file is listed twice: {order}"
    files = {f.name for f in REPO.glob("*.py")}
    assert set(order) == files, (f"not in the reading order: {sorted(files - set(order))}; "
                                 f"listed but missing: {sorted(set(order) - files)}")
