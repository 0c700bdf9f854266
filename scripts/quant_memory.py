"""Resident memory of quantized models on the CPU (docs/models.md): each case runs in a fresh
process, which loads a model, decodes a few tokens, and reports from /proc/self/status:
  RssAnon  the process's own memory (weights, KV cache, activations), after load and after decoding
  VmHWM    its peak resident set, file pages included (a safetensors or GGUF file is memory-mapped
           while it loads; those pages belong to the page cache and are reclaimable)
and the weights' bytes as stored (quantize.weight_bytes).

    python scripts/quant_memory.py                 # the SmolLM2 pair and the 8B shape, every quant
    python scripts/quant_memory.py --cases smollm2-135m:int4 8b:int4

Cases: MODEL:QUANT with MODEL smollm2-135m (its Q4_1 GGUF file), smollm2-135m-draft
(safetensors), smollm2-135m-st (the GGUF file's weights written once as float32 safetensors to a
temporary directory, so that quantizing at load is measured on a 540 MB checkpoint), or 8b (a
Llama-3.1-8B-shaped model with random weights, built in its quantized layout directly: no 8B
checkpoint fits this machine's disk budget, and the layout's bytes are what is measured).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

DEFAULT_CASES = [f"{m}:{q}" for m in ("smollm2-135m", "smollm2-135m-draft")
                 for q in ("none", "int8", "int4")] + ["smollm2-135m-st:int4", "8b:int4"]
def status() -> dict:
    """MiB of RssAnon, RssFile and VmHWM from /proc/self/status."""
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def one(case: str, st_dir: str | None) -> dict:
    """Load, decode 4 tokens, measure (runs in the child process)."""
    import torch
    from checkpoint import load_model
    from quantize import pack_layers, weight_bytes
    torch.set_num_threads(1)
    name, quant = case.split(":")
    if name == "8b":  # built in place in its layout (no checkpoint), float32 as on the CPU
        from gpu_check import SHAPES, random_quant_model
    before = status()
    t0 = time.perf_counter()
    if name == "8b":
        model = random_quant_model(SHAPES["llama-8b"], "cpu", quant, dtype=torch.float32)
        pack_layers(model, "cpu")  # as load_model does: an int4 kernel where fast
    else:
        model = load_model(st_dir if name == "smollm2-135m-st" else name, tokenizer=False,
                           quant=quant)[0]
    load_s = time.perf_counter() - t0
    loaded = status()
    cache = model.new_cache(256)
    sid = cache.new_seq()
    with torch.no_grad():
        logits = model.prefill(cache, [sid], [[1, 2, 3, 4, 5, 6, 7, 8]])
        for _ in range(4):
            tok = logits.argmax(-1).tolist()
            logits = model.forward_cached(cache, [sid], tok, [1], last_only=True)
    decoded = status()
    return dict(case=case, weights_mib=weight_bytes(model) / 2**20, load_s=load_s,
                start_anon_mib=before["RssAnon"], loaded_anon_mib=loaded["RssAnon"],
                decoding_anon_mib=decoded["RssAnon"], peak_hwm_mib=decoded["VmHWM"])


def write_float_safetensors(folder: Path):
    """The GGUF file's SmolLM2 weights as one float32 safetensors checkpoint (for -st cases)."""
    from safetensors.torch import save_file
    from checkpoint import checkpoint_params, load_model
    model = load_model("smollm2-135m", tokenizer=False, quant="none")[0]
    save_file({k: v.contiguous() for k, v in checkpoint_params(model).items()},
              folder / "model.safetensors")
    cfg = model.config
    hf = dict(architectures=["LlamaForCausalLM"], model_type="llama",
              vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
              intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
              num_attention_heads=cfg.num_attention_heads,
              num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
              rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
              max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
              bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_ids[0])
    (folder / "config.json").write_text(json.dumps(hf))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=DEFAULT_CASES)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--st-dir", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one(a.child, a.st_dir)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if any(c.startswith("smollm2-135m-st:") for c in a.cases):
            write_float_safetensors(Path(tmp))
        print(f"{'case':<26} {'weights':>8} {'load s':>7} {'anon: start':>11} {'loaded':>7} "
              f"{'decoding':>8} {'peak (HWM)':>10}   (MiB)")
        for case in a.cases:
            res = subprocess.run([sys.executable, __file__, "--child", case, "--st-dir", tmp],
                                 capture_output=True, text=True, env=os.environ)
            if res.returncode:
                print(f"{case:<26} failed: {res.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(res.stdout.strip().splitlines()[-1])
            print(f"{case:<26} {r['weights_mib']:>8.0f} {r['load_s']:>7.1f} "
                  f"{r['start_anon_mib']:>11.0f} {r['loaded_anon_mib']:>7.0f} "
                  f"{r['decoding_anon_mib']:>8.0f} {r['peak_hwm_mib']:>10.0f}", flush=True)


if __name__ == "__main__":
    main()
