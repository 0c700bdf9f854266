"""Two-process SSD: the verifier here, the speculator in a spawned process, one shared channel between them.

(In progress: start_child and wait_for are shared with tp.py.)
"""
import signal
import sys
import threading
import time

import torch.multiprocessing as mp


def start_child(target, args) -> mp.Process:
    """Start target(*args) in a new, spawned Python process (a daemon: it cannot outlive us) and return it.

    1. The user's script is not run again in the child. To rebuild `target`, spawn first re-runs the parent's
       __main__ in the child; a script or notebook cell without `if __name__ == "__main__":` would then call
       generate() again, inside the child. The child needs only this project's modules (which `target`'s
       pickle names), so __main__'s file is hidden while the child starts, unless `target` itself lives in
       __main__ (run.py or bench.py run as scripts, whose top level is guarded).
    2. The child ignores Ctrl-C from its first instruction (a Python started with SIGINT ignored keeps it so):
       the terminal's Ctrl-C reaches every process, but only this one decides how to stop, and a child
       interrupted while still importing torch would print a traceback. Only the main thread may change
       signal handlers; from another thread the child starts with the default handler."""
    proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    main = sys.modules["__main__"]
    hide = target.__module__ != "__main__"
    saved = main.__dict__.get("__file__"), main.__spec__
    in_main_thread = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main_thread else None
    try:
        if hide:
            main.__dict__.pop("__file__", None)  # multiprocessing.spawn reads __main__.__spec__, then __file__
            main.__spec__ = None
        proc.start()
    finally:
        if hide:
            main.__spec__ = saved[1]
            if saved[0] is not None:
                main.__file__ = saved[0]
        if in_main_thread:
            signal.signal(signal.SIGINT, old)
    return proc


def wait_for(event, alive, what, timeout=None):
    """Wait on an event while checking that the other side is alive (a dead peer must not hang us)."""
    start = time.perf_counter()
    while not event.wait(0.05):
        if not alive():
            raise RuntimeError(f"the {what} process died")
        if timeout and time.perf_counter() - start > timeout:
            raise RuntimeError(f"timed out waiting for the {what}")
    event.clear()
