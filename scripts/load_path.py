"""How a model's load walks through the engine's files, as a reader following the code would:
each function read once (the first time it is called; later calls are not followed again), files
outside the repository's top level (torch, the standard library) passed through.

  python scripts/load_path.py [model ...] [--quant auto] [--show]

For each model, checkpoint.load_model's path: the files it reads (files), the stays (maximal runs
of functions in one file, in reading order) and the climbs (returns to a different file, higher on
the stack). --show prints the stays.
"""
import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def walk(fn):
    """Run fn() and return the files the reader stands in, one entry per call and return, with the
    function entered or returned to."""
    seen, stack, steps = set(), [], []  # stack: (file, function) of the repository's frames
    skipping = [0]  # depth inside a function already read (its calls are not followed again)
    names = {}  # a code's file as Python recorded it (tests/../model.py) -> model.py, or None

    def repo_file(filename):
        if filename not in names:
            path = Path(filename).resolve()  # "<frozen os>" resolves into the cwd: not a file
            names[filename] = path.name if path.parent == REPO and path.is_file() else None
        return names[filename]

    def profile(frame, event, arg):
        if event not in ("call", "return"):
            return
        code = frame.f_code
        name = repo_file(code.co_filename)
        if name is None:
            return
        if event == "call":
            if skipping[0] or code in seen:
                skipping[0] += 1
                return
            seen.add(code)
            stack.append((name, code.co_name))
            steps.append(("call", *stack[-1]))
        elif skipping[0]:
            skipping[0] -= 1
        elif stack:
            stack.pop()
            if stack:
                steps.append(("return", *stack[-1]))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return steps


def count(steps):
    """-> (files, stays [(file, first function)], climbs)."""
    stays, climbs, here = [], 0, None
    for event, file, function in steps:
        if file != here:
            stays.append((file, function))
            climbs += event == "return"
            here = file
    return sorted({f for f, _ in stays}), stays, climbs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*", default=["smollm2-135m", "tiny"])
    p.add_argument("--quant", default="auto")
    p.add_argument("--show", action="store_true")
    args = p.parse_args(argv)
    import checkpoint
    import engine  # noqa: F401  (every module imported before the walk: imports are not followed)
    for name in args.models:
        checkpoint.load_model(name, quant=args.quant)  # once first: built kernels, saved tokenizer
        files, stays, climbs = count(walk(lambda: checkpoint.load_model(name, quant=args.quant)))
        print(f"{name} (quant={args.quant}): {len(stays)} stays in {len(files)} files, "
              f"{climbs} climbs: {', '.join(files)}")
        if args.show:
            print("  " + " > ".join(f"{f}:{fn}" for f, fn in stays))


if __name__ == "__main__":
    main()
