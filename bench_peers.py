"""The peers bench.py runs beside this engine, on the same models, prompts and cores: transformers'
generate() and assisted generation (`HF`: the peers of ar and sd), and llama.cpp on the target's
GGUF file (`llama_cpp_run`, through scripts/llama_cpp_peer.py in the Python that has
llama-cpp-python; optional). Each returns the counters bench.run_engine does, timings only.
"""
import json
import subprocess
import time
from pathlib import Path

import torch

from checkpoint import hf_over_target_vocab, resolve
from engine import default_devices


class HF:
    """The transformers peers; each model is loaded once (float32 on the CPU, bfloat16 on CUDA, as
    load_model)."""

    def __init__(self, a):
        self.a, self.models = a, {}
        self.device = default_devices()[0]

    def model(self, name):
        if name not in self.models:
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging
            logging.disable_progress_bar()
            dtype = torch.float32 if self.device == "cpu" else torch.bfloat16
            path = resolve(name)  # a GGUF file loads through transformers' own GGUF reader
            kw = dict(gguf_file=path.name) if path.is_file() else {}
            m = AutoModelForCausalLM.from_pretrained(path.parent if path.is_file() else path,
                                                     dtype=dtype, **kw).to(self.device).eval()
            m = hf_over_target_vocab(m)  # a draft with its own vocabulary speaks the target's
            self.models[name] = m
        return self.models[name]

    def generate(self, batch, n, cfg, seed):
        """transformers generate() on a left-padded batch, EOS ignored; returns seconds."""
        m = self.model(self.a.target)
        L = max(len(p) for p in batch)
        x = torch.tensor([[0] * (L - len(p)) + p for p in batch], device=self.device)
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in batch], device=self.device)
        if cfg.temperature > 0:
            kw = dict(do_sample=True, temperature=cfg.temperature, top_k=0, top_p=1.0)
        else:
            kw = dict(do_sample=False)
        if cfg.engine == "hf-assisted":
            d = self.model(self.a.draft)
            # up to K drafted tokens per round, as sd: a constant schedule, and sd's confidence
            # stop (transformers' assistant_confidence_threshold, which DraftSettings copies)
            d.generation_config.num_assistant_tokens = cfg.spec.K
            d.generation_config.num_assistant_tokens_schedule = "constant"
            d.generation_config.assistant_confidence_threshold = cfg.spec.confidence
            kw["assistant_model"] = d
        torch.manual_seed(seed)
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            m.generate(x, attention_mask=mask, max_new_tokens=n, eos_token_id=None, pad_token_id=0,
                       **kw)
        sync()
        return time.perf_counter() - t

    def run(self, cfg, batches, first=0):
        """One run of a bench.Config over `batches` -> the same counters as bench.run_engine
        (timings only)."""
        old = torch.get_num_threads()
        torch.set_num_threads(cfg.threads)
        try:
            tot = dict(new=0, first=0, decode_s=0.0, prefill_s=0.0)
            for i, batch in enumerate(batches):
                seed = self.a.seed + first + i
                t1 = self.generate(batch, 1, cfg, seed)   # prefill + the first token
                tn = self.generate(batch, self.a.max_new_tokens, cfg, seed)
                tot["new"] += self.a.max_new_tokens * len(batch)
                tot["first"] += len(batch)
                tot["prefill_s"] += t1
                tot["decode_s"] += max(tn - t1, 1e-9)
            return tot
        finally:
            torch.set_num_threads(old)


def peer_failure(res: subprocess.CompletedProcess, repack: bool) -> str:
    """One line for a llama.cpp peer that failed: its last word on stderr, or how it ended (a
    crash leaves none), and the way around the crash seen on Xeon guests."""
    last = res.stderr.strip().splitlines()[-1:]
    why = last[0] if last else (f"killed by signal {-res.returncode}" if res.returncode < 0
                                else f"exit status {res.returncode}")
    hint = ("; if its weight repacking crashes on this CPU (AMX on some Xeon guests), add "
            "--no-repack" if repack else "")
    return f"the llama.cpp peer failed ({why}){hint}"


def llama_cpp_run(cfg, batches, a) -> dict:
    """One run of the llama.cpp peer over `batches` (batch 1 each) -> the same counters as
    run_engine (timings only), through scripts/llama_cpp_peer.py in a.llama_cpp_python."""
    path = resolve(a.target)
    job = dict(model=str(path), threads=cfg.threads, max_new_tokens=a.max_new_tokens,
               repack=not a.no_repack,
               prompts=[p for batch in batches for p in batch],
               n_ctx=max(len(p) for batch in batches for p in batch) + a.max_new_tokens + 8)
    peer = Path(__file__).resolve().parent / "scripts" / "llama_cpp_peer.py"
    res = subprocess.run([a.llama_cpp_python, str(peer)], input=json.dumps(job), text=True,
                         capture_output=True)
    if res.returncode:
        raise RuntimeError(peer_failure(res, not a.no_repack))
    return json.loads(res.stdout.strip().splitlines()[-1])


def llama_cpp_problem(a) -> str | None:
    """Why the llama.cpp peer cannot run here (None: it can): it needs a GGUF target and a Python
    with llama_cpp."""
    if not resolve(a.target).is_file():
        return ("the llama.cpp peer runs GGUF files: give --target a GGUF file (e.g. "
                "smollm2-135m), or leave llama.cpp out of --modes")
    ok = subprocess.run([a.llama_cpp_python, "-c", "import llama_cpp"], capture_output=True)
    if ok.returncode:
        return (f"{a.llama_cpp_python} cannot import llama_cpp: pip install llama-cpp-python "
                f"there (it builds llama.cpp), or point --llama-cpp-python at a Python that has it")
    return None


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()
