"""The tensor-parallel target under torchrun, across nodes (issue 30), on the CPU with gloo.

Each test starts real torchrun jobs on 127.0.0.1: two invocations, one per simulated node
(`--nnodes 2 --nproc-per-node 1 --node-rank R --rdzv-endpoint 127.0.0.1:PORT`), make one world of
two ranks, rank 0 the verifier, rank 1 serving it.
1. The world emits exactly the TP = 1 greedy tokens in ar, sd and ssd, on a small Llama and a small
   Qwen3: one job runs all six, rank 0 calling generate(torchrun=True) and rank 1
   tp.serve_torchrun_rank, one world after another (after a first world on the tiny pair, which
   loads a tokenizer); each world leaves no thread of its own behind on either rank (issue 53).
   run.py itself under torchrun: rank 0 says on stderr that it runs across the world and prints
   TP = 1's --json line; rank 1 prints nothing.
2. Killing the second node mid-decode ends the first with one line naming rank 1 and its node (on
   one node, torchrun stops rank 0 first: its line says a rank ended);
   Ctrl-C on the first node ends both, naming the interruption; no process is left behind.
3. A world size the heads cannot divide is refused on every rank before any weight loads (the
   checkpoint's weights are garbage: loading them would fail otherwise); so is a restart policy.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import hf_config, make_checkpoint, one_line
from safetensors.torch import load_file, save_file
from test_reliability import processes_with

from run import DEFAULT_PROMPT, generate
from tp import Heartbeat, TorchrunEnv, TorchrunWorld, torchrun_device, torchrun_env

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [[1, 5, 9, 23, 40, 7], [1, 77, 3]]
KW = dict(max_new_tokens=12, k=3, seed=5, ignore_eos=True, target_threads=1, draft_threads=1)
CLI = ["--target", "tiny", "--draft", "tiny-draft", "--target-threads", "1", "--draft-threads", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nodes:
    """Two torchrun invocations, node 0 and node 1 of one job, each running `args` (a script and its
    arguments); every process they start carries a marker in its environment, so that the test can
    check that none outlives the job (and end any that would)."""

    def __init__(self, args, nnodes=2, nproc=1):
        self.marker, port = f"SSD_TEST_{uuid.uuid4().hex}", free_port()
        env = {**os.environ, "PYTHONPATH": str(REPO), self.marker: "1"}
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
             "--nproc-per-node", str(nproc), "--node-rank", str(node), "--rdzv-endpoint",
             f"127.0.0.1:{port}", *map(str, args)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True) for node in range(nnodes)]
        # stdout and stderr lines, read as they come (by threads: a pipe left unread would block)
        self.out, self.err = [[] for _ in self.procs], [[] for _ in self.procs]
        self.readers = [threading.Thread(target=read_lines, args=(pipe, lines), daemon=True)
                        for p, out, err in zip(self.procs, self.out, self.err)
                        for pipe, lines in ((p.stdout, out), (p.stderr, err))]
        for t in self.readers:
            t.start()

    def wait(self, timeout=150) -> list[str]:
        """Every node's stderr, once every node ended (their stdout lines are in self.out)."""
        for p in self.procs:
            p.wait(timeout=timeout)
        for t in self.readers:
            t.join(timeout=10)  # the pipes close when the last process holding them ends
        return ["".join(lines) for lines in self.err]

    def worker(self, node: int) -> int:
        """The pid of the rank torchrun started on `node` (its agent's child)."""
        agent = self.procs[node].pid
        children = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
        return int(children[0])

    def close(self):
        """End what is left of the job (after a failed test): agents, then their workers."""
        for pid in [p.pid for p in self.procs if p.poll() is None] + processes_with(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            p.wait(timeout=30)

    def all_gone(self) -> bool:
        """Whether every process of the job ended with it (orphans notice within seconds)."""
        deadline = time.time() + 10
        while processes_with(self.marker) and time.time() < deadline:
            time.sleep(0.2)
        return not processes_with(self.marker)


def read_lines(pipe, lines: list):
    for line in pipe:
        lines.append(line)


@pytest.fixture
def start():
    """start(args, ...) -> Nodes; whatever the test leaves running is ended after it."""
    started = []

    def start_nodes(*args, **kw) -> Nodes:
        started.append(Nodes(*args, **kw))
        return started[-1]
    yield start_nodes
    for nodes in started:
        nodes.close()


def noisy_copy(target: Path, path: Path, noise: float) -> Path:
    """A draft that is the target with noise on every weight: it agrees sometimes, not always."""
    path.mkdir()
    shutil.copy(target / "config.json", path / "config.json")
    g = torch.Generator().manual_seed(4)
    weights = {k: w + noise * w.std() * torch.randn(w.shape, generator=g)
               for k, w in load_file(target / "model.safetensors").items()}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    out = {}
    for kind, noise in (("llama", 0.6), ("qwen3", 0.2)):  # (Qwen3's q/k norms: less noise)
        target = make_checkpoint(tmp_path_factory.mktemp(kind), kind, seed=3)
        out[kind] = (target, noisy_copy(target, tmp_path_factory.mktemp(kind) / "draft", noise))
    return out


# ----------------------------------------------------------------------------------------------------
# 1. The tokens of TP = 1

DRIVER = """
import json, os, sys, threading, time
from run import generate
from tp import serve_torchrun_rank, torchrun_env

def threads_left():
    # threads a world leaves behind: its process group's (gloo's, named by torch) or heartbeat
    tasks = "/proc/self/task"
    names = []
    for t in os.listdir(tasks):
        try:
            names.append(open(f"{tasks}/{t}/comm").read().strip())
        except FileNotFoundError:  # a thread that ended while we looked
            pass
    return [n for n in names if "gloo" in n] + [t.name for t in threading.enumerate()
                                                if t.name == "ssd-heartbeat"]

def left():
    # gloo's loop thread ends as its last reference goes, which on a busy machine can be a moment
    # after destroy_process_group returns: wait for it (10 s at most), then say what is left
    deadline = time.time() + 10
    while threads_left() and time.time() < deadline:
        time.sleep(0.05)
    return threads_left()

env = torchrun_env()
prompts, kw, jobs = json.loads(sys.argv[1])
for target, draft, mode in jobs:
    if env.rank == 0:
        res = generate(prompts, target=target, draft=draft, mode=mode, torchrun=True, **kw)
        print("RESULT", json.dumps([target, mode, res.tokens, res.stats]), flush=True)
    else:
        serve_torchrun_rank(env, target, "cpu", threads=1, timeout_s=60)
    print("LEFT", json.dumps(left()), flush=True)
"""


def test_two_nodes_emit_the_tokens_of_tp1(pairs, tmp_path, start):
    """Also: each world ends its threads once closed, on every rank (within seconds: gloo's loop
    thread goes with the group's last reference). The first world's target has a tokenizer, whose
    loading imports torch modules that, imported while the process group exists, would keep it
    (and its gloo threads, which abort the exit: issue 53) past close() for good."""
    jobs = [("tiny", "tiny-draft", "ar")]
    jobs += [(str(t), str(d), mode) for t, d in pairs.values() for mode in ("ar", "sd", "ssd")]
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    nodes = start([driver, json.dumps([PROMPTS, {**KW, "tp_timeout": 60}, jobs])])
    err = nodes.wait()
    results = [json.loads(x[len("RESULT "):]) for x in nodes.out[0] if x.startswith("RESULT ")]
    assert [p.returncode for p in nodes.procs] == [0, 0] and len(results) == 7, err
    assert "terminate called" not in err[0] + err[1]
    for out in nodes.out:
        assert [x for x in out if x.startswith("LEFT ")] == ["LEFT []\n"] * 7, out
    assert all(x.startswith("LEFT ") for x in nodes.out[1]), "rank 1 prints nothing"
    assert [len(x) for x in results[0][2]] == [12, 12]  # the tiny pair's world
    for kind, (target, draft) in pairs.items():
        ref = generate(PROMPTS, target=target, mode="ar", **KW).tokens
        assert [len(x) for x in ref] == [12, 12]
        for got_target, mode, tokens, stats in results:
            if got_target == str(target):
                assert tokens == ref, (kind, mode)
                if mode != "ar":  # rounds that accepted and rounds that rejected
                    assert 0 < stats["accepted_per_proposed"] < 1, (kind, mode, stats)
    assert nodes.all_gone()


def test_heartbeat_stop_ends_its_thread(monkeypatch):
    """A heartbeat thread still inside a store call when the interpreter exits aborts the process
    (issue 53): stop() returns only once the thread has ended."""
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    beat = Heartbeat("test/", 0, 1)
    deadline = time.time() + 10
    while beat.counts[0] is None and time.time() < deadline:
        time.sleep(0.01)
    assert beat.counts[0] == 1 and beat.thread.is_alive()
    beat.stop()
    assert not beat.thread.is_alive()


def test_run_py_under_torchrun(start):
    args = CLI + ["--mode", "ssd", "--max-new-tokens", "16", "--ignore-eos", "--json"]
    nodes = start([REPO / "run.py", *args])
    err = nodes.wait()
    assert [p.returncode for p in nodes.procs] == [0, 0], err
    got = json.loads(nodes.out[0][-1])
    ref = generate(DEFAULT_PROMPT, mode="ar", target="tiny", max_new_tokens=16, ignore_eos=True)
    assert got["tokens"] == ref.tokens[0] and got["text"] == ref.text[0]
    assert got["stats"]["mode"] == "ssd" and got["stats"]["parallel"] is True
    assert len(nodes.out[0]) == 1 and not nodes.out[1]  # one JSON line, from rank 0 only
    assert "rank 0 of a torchrun world of 2 ranks on 2 node(s)" in err[0], err[0]
    assert "torchrun world" not in err[1] and "error" not in err[0] + err[1]
    assert nodes.all_gone()


# ----------------------------------------------------------------------------------------------------
# 2. A node that dies, Ctrl-C

def decoding(nodes: Nodes, timeout=120):
    """Wait until rank 0 streams the answer (past the prompt's lines)."""
    deadline = time.time() + timeout
    while len(nodes.out[0]) < 4 and time.time() < deadline:
        assert all(p.poll() is None for p in nodes.procs), nodes.wait()
        time.sleep(0.05)
    assert len(nodes.out[0]) >= 4, "rank 0 did not start decoding"


LONG = CLI + ["--mode", "ar", "--max-new-tokens", "1900", "--ignore-eos", "--tp-timeout", "60"]


def test_second_node_killed_mid_decode(start):
    nodes = start([REPO / "run.py", *LONG])
    decoding(nodes)
    worker = nodes.worker(1)
    start = time.time()
    os.kill(worker, signal.SIGKILL)  # the node goes down: its rank, then its agent
    os.kill(nodes.procs[1].pid, signal.SIGKILL)
    err = nodes.wait()
    assert time.time() - start < 30  # SILENT_S for the silence to show, then the exit
    assert nodes.procs[0].returncode != 0
    errors = [x for x in err[0].splitlines() if x.startswith("error: ")]
    assert errors == [f"error: tensor-parallel rank 1 (node 1, {socket.gethostname()}) stopped "
                      f"answering: its process died or stopped, or its node went down"], err[0]
    assert 'File "' + str(REPO) not in err[0]  # no traceback of ours
    assert nodes.all_gone()


def test_a_rank_killed_on_a_single_node_is_named(start):
    """One node, two ranks, rank 1 killed mid-decode: torchrun's agent stops rank 0 with SIGTERM,
    and rank 0's line says a rank ended, not that it was interrupted, whichever comes first."""
    nodes = start([REPO / "run.py", *LONG], nnodes=1, nproc=2)
    decoding(nodes)
    agent = nodes.procs[0].pid
    workers = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
    rank1 = [int(w) for w in workers
             if b"\0RANK=1\0" in b"\0" + Path(f"/proc/{w}/environ").read_bytes()]
    os.kill(rank1[0], signal.SIGKILL)
    err = nodes.wait()[0]
    assert nodes.procs[0].returncode != 0
    ours = [x for x in err.splitlines() if x.startswith(("error: ", "interrupted"))]
    # with a core kept busy rank 0 can sit in a collective past torchrun's 30 s grace and be
    # killed with no line (seen once: noted, not fixed); any line it prints is one of these
    assert len(ours) <= 1, err  # rank 0 sees rank 1 gone first: the line names it
    assert all(x == "interrupted by torchrun: a rank ended (see below)" or
               x.startswith("error: tensor-parallel rank 1 ") for x in ours), err
    assert 'File "' + str(REPO) not in err  # no traceback of ours
    assert nodes.all_gone()


def test_ctrl_c_on_the_first_node_ends_the_job(start):
    nodes = start([REPO / "run.py", *LONG])
    decoding(nodes)
    start = time.time()
    os.kill(nodes.procs[0].pid, signal.SIGINT)  # the terminal's Ctrl-C reaches torchrun's agent
    err = nodes.wait()
    assert time.time() - start < 30
    assert all(p.returncode != 0 for p in nodes.procs), err
    assert "\ninterrupted\n" in err[0], err[0]
    errors = [x for x in err[1].splitlines() if x.startswith("error: ")]
    assert errors == ["error: tensor-parallel rank 0 was interrupted"], err[1]
    assert nodes.all_gone()


# ----------------------------------------------------------------------------------------------------
# 3. Refusals

def test_world_the_heads_cannot_divide_is_refused_before_loading(tmp_path, start):
    """3 query and KV heads cannot split over 2 ranks; the weights are garbage, so a rank that
    loaded them first would fail with another error."""
    hf_config("llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=3,
              intermediate_size=96, vocab_size=96).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a checkpoint")
    nodes = start([REPO / "run.py", "--target", tmp_path, "--mode", "ar", "--json"])
    err = nodes.wait()
    assert [p.returncode for p in nodes.procs] == [1, 1]
    for e in err:  # each rank refuses by itself, in one line
        errors = [x for x in e.splitlines() if x.startswith("error: ")]
        assert errors == ["error: tensor parallel size 2 must divide each of num_attention_heads=3, "
                          "num_key_value_heads=3, intermediate_size=96 and vocab_size=96: valid "
                          "TP sizes are 1, 3"], e
    assert not nodes.out[0] and not nodes.out[1]
    assert nodes.all_gone()


def test_torchrun_env_and_devices():
    assert torchrun_env({}) is None and torchrun_env({"WORLD_SIZE": "1"}) is None
    env = torchrun_env({"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "n0",
                        "MASTER_PORT": "29500", "TORCHELASTIC_MAX_RESTARTS": "0"})
    assert env == TorchrunEnv(rank=5, world=8, local_rank=1, local_world=4, node=1, nodes=2,
                              max_restarts=0)
    with pytest.raises(ValueError) as e:
        torchrun_env({"WORLD_SIZE": "2", "RANK": "0"})
    one_line(e, "LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set", "torchrun")
    assert torchrun_device("cpu", 3) == "cpu" and torchrun_device("cuda", 3) == "cuda:3"
    assert torchrun_device(None, 3) == ("cuda:3" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError) as e:
        torchrun_device("cuda:1", 3)
    one_line(e, "cuda:1", "cuda:LOCAL_RANK", "give cuda or cpu")


def test_refusals_before_anything_starts(pairs, monkeypatch):
    target, _ = pairs["llama"]
    with pytest.raises(ValueError) as e:  # torchrun would start a new world after a failure
        TorchrunWorld(TorchrunEnv(0, 2, 0, 1, 0, 2, max_restarts=3), target, "cpu")
    one_line(e, "--max-restarts=3", "cannot resume", "--max-restarts 0")
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError) as e:
        generate([[1, 2]], target=target, mode="ar", max_new_tokens=2, torchrun=True)
    one_line(e, "outside a torchrun world", "python -m torch.distributed.run")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for var, value in (("RANK", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "x"),
                       ("MASTER_PORT", "1")):
        monkeypatch.setenv(var, value)
    with pytest.raises(ValueError) as e:
        generate([[1, 2]], target=target, mode="ar", max_new_tokens=2, torchrun=True)
    one_line(e, "on rank 1", "serve_torchrun_rank")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError) as e:
        generate([[1, 2]], target=target, mode="ar", max_new_tokens=2, torchrun=True,
                 target_devices=["cpu", "cpu"])
    one_line(e, "--target-devices")
