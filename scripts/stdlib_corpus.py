"""The tiny pair's corpus: the running Python's standard library, split by file into training and
held-out files. train_tiny.py trains on one side, eval_tiny.py and bench.py measure on the other;
each imports the split from here (so that the two scripts need not import each other).
"""
import hashlib
import sysconfig
from pathlib import Path

HELDOUT_PERCENT = 5
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_files(root=None):
    """-> (train_paths, heldout_paths): sorted absolute Paths of the stdlib's .py files, without
    site-packages and test suites. A file is held out iff md5(relative path) % 100 < 5, so the split
    does not depend on which other files exist."""
    root = Path(root) if root is not None else stdlib_root()
    train, heldout = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        parts = rel.split("/")
        if EXCLUDED_DIRS.intersection(parts[:-1]) or parts[0].startswith("config-"):
            continue
        if not path.is_file():
            continue
        h = int(hashlib.md5(rel.encode()).hexdigest(), 16)
        (heldout if h % 100 < HELDOUT_PERCENT else train).append(path)
    return train, heldout


def read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")
