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


# a commit named in the docs ("the engine of commit 248780e", "engine 6cca6c7"): 7-12 hex digits
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}\b")


def test_cited_commits_exist():
    """Every commit the docs name is in the history, so a reader can check out what was measured
    (a hash from before a rebase or an amend names nothing). Skipped in a shallow clone."""
    git = ["git", "-C", str(REPO)]
    try:
        shallow = subprocess.run([*git, "rev-parse", "--is-shallow-repository"],
                                 capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no git")
    if shallow.returncode or shallow.stdout.strip() != "false":
        pytest.skip("not a full clone")
    cited = {h for f in repo_files("*.md", "*.txt")
             for h in COMMIT.findall(f.read_text(encoding="utf-8", errors="replace"))}
    assert len(cited) > 20, cited  # the docs name dozens of engines they measured
    check = subprocess.run([*git, "cat-file", "--batch-check"], capture_output=True, text=True,
                           input="".join(f"{h}^{{commit}}\n" for h in sorted(cited)), timeout=60)
    missing = sorted(line.split()[0].removesuffix("^{commit}")
                     for line in check.stdout.splitlines() if line.endswith("missing"))
    assert not missing, f"the docs name commits that are not in the history: {missing}"


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


def test_engine_files_and_functions_stay_short():
    """A file is read top to bottom in one sitting and a function in one screen (issue 71, item
    7): every engine file (top-level *.py) at most 600 lines, every function at most 60, its
    docstring included."""
    import ast
    files = sorted(REPO.glob("*.py"))
    long = [f"{f.name} ({n} lines)" for f in files
            if (n := len(f.read_text(encoding="utf-8").splitlines())) > 600]
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long.append(f"{f.name}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "over 600 lines a file or 60 a function:\n" + "\n".join(long)


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


# ----------------------------------------------------------------------------------------------------
# No doc that disagrees with the code (issue 71): each statement below is read from its doc and held
# against what the code holds or computes, so a change to either side fails here.

README = REPO / "README.md"


def flat(text: str) -> str:
    """The text with each run of whitespace as one space: a statement may wrap."""
    return " ".join(text.split())


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def test_quantize_doc_states_the_scales_dtypes():
    """Our layouts keep scales in float32, cpu_kernels.cpp's int4 layout in float16."""
    import torch
    import quantize
    ours = {dtype_name(quantize.QuantLinear(64, 16, bits=b).scales.dtype) for b in (4, 8)}
    assert len(ours) == 1, ours
    ours = ours.pop()
    q, scales, mins = quantize.quantize_int4(torch.randn(16, 64))
    assert dtype_name(scales.dtype) == ours
    kernel = dtype_name(quantize.int4_to_cpu_kernel(q, scales, mins)[1].dtype)
    doc = flat(quantize.__doc__)
    assert f"scales {ours} [out, in / G]" in doc and f"scales and mins {ours} [out, in / 32]" in doc
    assert f"Our layouts hold scales in {ours}" in doc
    assert f"cpu_kernels.cpp's int4 layout (cpu_kernels.int4_to_cpu_kernel) holds them in {kernel}" in doc
    assert f"sm {kernel}" in flat(quantize.int4_to_cpu_kernel.__doc__)


def test_quantize_doc_says_which_product_a_prefill_runs(monkeypatch):
    """A layer on no kernel: more than ROW_BUCKETS[-1] rows (a prefill) go through
    dequantised_product, as do any rows with compiled=False."""
    import torch
    import quantize
    assert ("`product`: compiled up to ROW_BUCKETS[-1] rows, `dequantised_product` for more (a "
            "prefill; any number with compiled=False)") in flat(quantize.__doc__)
    rows, real = [], quantize.dequantised_product
    monkeypatch.setattr(quantize, "dequantised_product", lambda x, *a: rows.append(len(x)) or real(x, *a))
    layer = quantize.QuantLinear(64, 16, bits=8, group=32)  # compiled, on no kernel (no pack_layers)
    layer.rows(0, 16).copy_(torch.randn(16, 64))
    M = quantize.ROW_BUCKETS[-1] + 1
    with torch.no_grad():
        layer(torch.randn(M, 64))
        layer.compiled = False
        layer(torch.randn(1, 64))
    assert rows == [M, 1]


def test_the_budget_floor_is_as_documented():
    """The adaptive budget B never goes below next_budget's floor; a round without pre-speculation
    is the gate's choice. design.md and spec_policy's docstrings state that floor."""
    import spec_policy
    floor = min(spec_policy.next_budget(B, ceiling, T_p, stopped)
                for ceiling in (1, 2, 8, 40) for B in range(1, ceiling + 1)
                for T_p in (0.1, 0.8, 1.5, 10) for stopped in (False, True))
    m = re.search(r"never drops below (\d+) in `next_budget`", flat(DESIGN.read_text(encoding="utf-8")))
    assert m, "docs/design.md no longer states the budget's floor (section 3)"
    assert int(m.group(1)) == floor
    assert f"the budget B itself never drops below {floor}" in flat(spec_policy.PreSpecGate.__doc__)
    assert f"Never below {floor}:" in flat(spec_policy.next_budget.__doc__)


def test_the_default_b_star_is_as_documented():
    """design.md section 5's values of b* under the paper's defaults, from
    fallback.default_critical_batch_size."""
    from fallback import DEFAULT_K, choose_fallback, default_critical_batch_size as b_star
    doc = flat(DESIGN.read_text(encoding="utf-8"))
    at_0 = {b_star(K, 0) for K in range(3, 9)}
    assert len(at_0) == 1, at_0
    assert f"at {at_0.pop()} at temperature 0 for K = 3 to 8" in doc
    assert f"at temperature 1 it grows with K: {b_star(4, 1)} at K = 4, {b_star(6, 1)} at K = 6," in doc
    assert b_star(4, 1) < b_star(6, 1)
    assert "and none for K >= 7, the paper's K = 7 included" in doc and DEFAULT_K == 7
    assert all(b_star(K, 1) is None for K in range(7, 65))
    assert "At K = 4 that sent every early miss at batch 8 to the n-gram backup" in doc
    assert all(choose_fallback("auto", 8, b_star(4, T)) == "ngram" for T in (0, 1))


def test_n_ranges_over_the_rows_proposal_length():
    """n, the accepted tokens, is 0..L for a row that proposed L <= K: design.md's notation and
    verify.accept_reject say so, and a row of L < K proposals that all match accepts L."""
    import torch
    import verify
    assert "n of the row's L <= K proposed tokens accepted (0..L;" in flat(DESIGN.read_text(encoding="utf-8"))
    assert "n [b] long (accepted, 0..L)" in flat(verify.accept_reject.__doc__)
    K, V = 4, 8
    logits = torch.zeros(2, K + 1, V)
    logits[..., 3] = 5.0  # the target's argmax is token 3 everywhere, and every proposal is 3
    n, _ = verify.accept_reject(logits, torch.full((2, K), 3), None, torch.ones(2, dtype=torch.bool),
                                0.0, None, lengths=[2, K])
    assert n.tolist() == [2, K]


def test_one_cache_directory_rule(monkeypatch, tmp_path):
    """cpu_kernels.cache_dir is the rule for the files there (the kernels' library; cpu_linear's
    forms and the tokenizers built from GGUF files in records_dir, which $SSD_CACHE_DIR replaces,
    for the tests), as the README states."""
    import cpu_kernels
    import cpu_linear
    assert cpu_kernels.CACHE_DIR == cpu_kernels.cache_dir()
    monkeypatch.delenv("SSD_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cpu_kernels.cache_dir() == tmp_path / "ssd" == cpu_linear.forms_file().parent
    monkeypatch.delenv("XDG_CACHE_HOME")
    default = cpu_kernels.cache_dir()
    assert default == cpu_linear.forms_file().parent
    monkeypatch.setenv("SSD_CACHE_DIR", str(tmp_path / "tests"))
    assert cpu_linear.forms_file().parent == tmp_path / "tests" == cpu_kernels.records_dir()
    readme = flat(README.read_text(encoding="utf-8"))
    assert (f"cached in `$XDG_CACHE_HOME/ssd/`, by default `~/{default.relative_to(Path.home())}/`"
            in readme)
    assert "remembered in that directory (`use_forms`, called at load; `$SSD_CACHE_DIR` replaces it" in readme


def test_documented_default_modes():
    """generate() and the command line default to different modes; every doc that names a default
    names the right one."""
    import inspect
    import run
    gen = inspect.signature(run.generate).parameters["mode"].default
    cli = run.parser().get_default("mode")
    readme = README.read_text(encoding="utf-8")
    assert (f"(`generate()`'s mode defaults to `\"{gen}\"`, run.py's to `{cli}`)") in readme
    assert f"default \"{gen}\", while the command line's --mode defaults to \"{cli}\"" in \
        flat(run.generate.__doc__)
    # a bare `python run.py` line's comment names the mode it runs
    for where, text in (("README.md", readme), ("run.py's docstring", run.__doc__)):
        comments = re.findall(r"^\s*python run\.py\s+#(.*)$", text, re.M)
        assert comments, f"{where} shows no bare `python run.py`"
        for c in comments:
            assert {w for w in re.findall(r"\b[A-Z]+\b", c) if w.lower() in run.MODES} == {cli.upper()}, \
                (where, c)
    models = flat((REPO / "docs" / "models.md").read_text(encoding="utf-8"))
    assert f"the default mode, {cli.upper()}, runs the pair: `python run.py --target" in models


def test_readme_is_at_most_250_lines():
    """The README stays a page a reader finishes (issue 71, item 7): what grows goes to docs/."""
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= 250, f"README.md has {lines} lines: move detail to docs/"
