"""How far a quantized model is from the float one, and its draft from it (docs/models.md).

For each held-out chat prompt (the draft's, checkpoints/smollm2-135m-draft/heldout_prompts.jsonl):
the float target's greedy answer (--tokens new tokens) is teacher-forced through every model, and
over the answer's positions we report, for each target quant against the float target (for a GGUF
file: the file dequantised, so "stored" is the same weights, and "auto" those weights in the form
the engine runs them: cpu_kernels.cpp's kernels on an AVX2 / AVX-512 CPU, and "torch-kernel" with
torch's int4 kernel), and for each draft quant against the
float draft (safetensors: a float model against its quantized self): the logits' max and mean
absolute difference and top-1 agreement; and for each (target quant, draft quant)
pair the draft's top-1 agreement with that target (the draft's greedy agreement, as
distill_draft.py measures it, over these answers).

    python scripts/quant_accuracy.py --prompts 12 --tokens 64
"""
import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from checkpoint import load_model  # noqa: E402
from quantize import QuantLinear  # noqa: E402
from run import encode  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="smollm2-135m-draft")
    ap.add_argument("--prompt-file", default=str(REPO / "checkpoints" / "smollm2-135m-draft"
                                                 / "heldout_prompts.jsonl"))
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    torch.set_num_threads(2)
    texts = [json.loads(line)["prompt"] for line in open(a.prompt_file)][:a.prompts]
    ref, tok = load_model(a.target, quant="none")
    # "auto" as the engine loads it (its int4 layers in cpu_kernels.cpp's kernel on an AVX2 / AVX-512
    # CPU, 16-bit integer activations) and "stored": the same file's weights in quantize.py's own
    # layout
    targets = {q: load_model(a.target, tokenizer=False, quant=q)[0] for q in ("auto", "int8")}
    targets["stored"] = load_model(a.target, tokenizer=False, compile_quant=False)[0]
    # the int4 layers in torch's int4 kernel instead (where cpu_kernels.cpp does not build)
    targets["torch-kernel"] = load_model(a.target, tokenizer=False, compile_quant=False)[0]
    for m in targets["torch-kernel"].model.layers.modules():
        if isinstance(m, QuantLinear) and m.bits == 4:
            m.pack("torch")
    drafts = {q: load_model(a.draft, tokenizer=False, quant=q, vocab_size=ref.config.vocab_size)[0]
              for q in ("none", "int8", "int4")}
    stats = {}
    with torch.no_grad():
        for text in texts:
            ids = encode(tok, text, True)
            seq = list(ids)
            for _ in range(a.tokens):  # the float target's greedy answer
                seq.append(int(ref(torch.tensor([seq]))[0, -1].argmax()))
            x = torch.tensor([seq])
            span = slice(len(ids) - 1, len(seq) - 1)  # the positions that predict the answer
            want = ref(x)[0, span]
            top = {}
            for q, m in targets.items():
                got = m(x)[0, span]
                top[q] = got.argmax(-1)
                s = stats.setdefault(f"target {q}", dict(max=0.0, sum=0.0, n=0, agree=0))
                s["max"] = max(s["max"], (got - want).abs().max().item())
                s["sum"] += (got - want).abs().mean().item() * len(got)
                s["n"] += len(got)
                s["agree"] += (top[q] == want.argmax(-1)).sum().item()
            top["none"] = want.argmax(-1)
            dref = drafts["none"](x)[0, span]
            for dq, d in drafts.items():
                logits = d(x)[0, span]
                guess = logits.argmax(-1)
                if dq != "none":  # a float model (safetensors) against its quantized self
                    seen = torch.isfinite(dref)  # a draft's own vocabulary: -inf elsewhere
                    s = stats.setdefault(f"draft {dq} vs draft none",
                                         dict(max=0.0, sum=0.0, n=0, agree=0))
                    diff = (logits - dref)[seen].abs()
                    s["max"] = max(s["max"], diff.max().item())
                    s["sum"] += diff.mean().item() * len(guess)
                    s["n"] += len(guess)
                    s["agree"] += (guess == dref.argmax(-1)).sum().item()
                for tq in ("none", "auto", "stored", "int8"):
                    s = stats.setdefault(f"draft {dq} vs target {tq}", dict(agree=0, n=0))
                    s["agree"] += (guess == top[tq]).sum().item()
                    s["n"] += len(guess)
    print(f"{len(texts)} chat prompts of {Path(a.prompt_file).name}, the float target's greedy "
          f"answers of {a.tokens} tokens, teacher-forced:")
    for name, s in stats.items():
        extra = (f"  logits max |diff| {s['max']:.3f}, mean {s['sum'] / s['n']:.4f}"
                 if "max" in s else "")
        print(f"  {name:<28} top-1 agreement {s['agree'] / s['n']:.3f}{extra}")


if __name__ == "__main__":
    main()
