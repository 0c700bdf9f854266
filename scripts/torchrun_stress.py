"""Do two-node torchrun jobs exit cleanly? Runs `--runs` jobs in a row and counts those that did not.

Each job is the README's command for two nodes on this machine: two torchrun invocations, node 0
and node 1 (`--nnodes 2 --nproc-per-node 1 --rdzv-endpoint 127.0.0.1:PORT`), running run.py on the
tiny pair over gloo with --json, alternating --mode ar and sd. A job is clean when both torchrun
invocations exit 0, rank 0 printed its JSON line, and neither printed a traceback, "terminate
called" (a C++ thread aborting the process) or a failed exit. `--spin N` keeps N more processes
spinning at the lowest priority meanwhile: the abort this looks for (issue 53: a gloo thread taking
the GIL after the interpreter began to exit) needs a thread that is not scheduled for a while, which
a busy machine makes likely.

    python scripts/torchrun_stress.py --runs 30 --spin 2    # prints "unclean 0/30" when all exit 0
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SIGNS = ("Traceback", "terminate called", "ChildFailedError", "exitcode")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(mode: str, timeout: float) -> tuple[list[int], list[str], list[str]]:
    """One two-node job: each node's exit code, stdout and stderr."""
    port = free_port()
    args = ["run.py", "--target", "tiny", "--draft", "tiny-draft", "--target-threads", "1",
            "--draft-threads", "1", "--mode", mode, "--max-new-tokens", "16", "--ignore-eos",
            "--json"]
    files = [tempfile.TemporaryFile("w+") for _ in range(4)]  # pipes could fill and block a node
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}", *args],
        cwd=REPO, stdout=files[2 * node], stderr=files[2 * node + 1], text=True,
        start_new_session=True) for node in (0, 1)]
    codes = [p.wait(timeout=timeout) for p in procs]
    texts = []
    for f in files:
        f.seek(0)
        texts.append(f.read())
        f.close()
    return codes, texts[0::2], texts[1::2]


def unclean(codes, out, err) -> str | None:
    """Why a job did not exit cleanly, or None."""
    if codes != [0, 0]:
        return f"exit codes {codes}"
    if not out[0].strip() or "tokens" not in json.loads(out[0].splitlines()[-1]):
        return "no JSON line from rank 0"
    signs = [s for s in SIGNS for e in err if s in e]
    return f"printed {', '.join(sorted(set(signs)))}" if signs else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--spin", type=int, default=0, help="processes kept spinning meanwhile")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a job may take")
    a = ap.parse_args()
    spinners = [subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while 1: pass"])
                for _ in range(a.spin)]
    bad, start = 0, time.time()
    try:
        for i in range(a.runs):
            mode = ("ar", "sd")[i % 2]
            codes, out, err = job(mode, a.timeout)
            why = unclean(codes, out, err)
            bad += why is not None
            print(f"run {i + 1:3d} {mode}: {why or 'clean'}", flush=True)
            if why:
                print("".join(e[-2000:] for e in err), file=sys.stderr)
    finally:
        for p in spinners:
            p.send_signal(signal.SIGKILL)
            p.wait()
    print(f"unclean {bad}/{a.runs} ({time.time() - start:.0f} s, {a.spin} spinning, "
          f"load {os.getloadavg()[0]:.1f})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
