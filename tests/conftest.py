"""Shared test helpers: tiny random Hugging Face checkpoints written to temporary directories.

make_checkpoint(dir, kind, sharded=False, **overrides) -> dir builds a random transformers model of one
of the KINDS, saves it with save_pretrained (float32, safetensors) and returns the directory:
  "llama"            Llama with GQA (4 query heads, 2 KV heads), untied head, rope_theta 500000
  "llama_tied_rope"  Llama with tied embeddings and Llama 3 RoPE scaling (original context 32, factor 8)
  "qwen3"            Qwen3 with q/k norm and an explicit head_dim (32) != hidden / heads (16)
  "qwen2"            Qwen2 (Qwen2.5) with q/k/v biases and tied embeddings
Overrides are config fields (e.g. num_hidden_layers=1). sharded=True splits the weights into several
files listed by model.safetensors.index.json. Every weight is re-drawn (norm scales too, so q_norm and
k_norm are not the identity) at a scale that gives logits of order 1, so that wrong code shows up well
above the 1e-4 tolerances of the tests.

The fixture `make_ckpt(kind="llama", sharded=False, **overrides)` does the same in a fresh temporary
directory; `hf_model(path)` loads the transformers reference model from such a directory.
"""
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
torch.set_num_threads(1)
# cpu_linear's record of the chosen product forms: a fresh one per test session (and its spawned
# processes), never the user's ~/.cache/ssd
os.environ["SSD_CACHE_DIR"] = tempfile.mkdtemp(prefix="ssd-test-cache-")

import cpu_kernels  # noqa: E402 (after the path above)

# tests of cpu_kernels.cpp's ops, skipped where they do not run
needs_cpu_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="cpu_kernels.cpp needs "
                                       "AVX2 and a C++ compiler (g++, or $CXX)")

TINY = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=256,
            bos_token_id=1, eos_token_id=2)
# transformers accepts the legacy rope_theta / rope_scaling keywords in every version (>= 5 converts them
# to rope_parameters), so the configs below work with both the 4.x and 5.x config formats
KINDS = {
    "llama": dict(model_type="llama", rope_theta=500000.0, tie_word_embeddings=False),
    "llama_tied_rope": dict(model_type="llama", rope_theta=10000.0, tie_word_embeddings=True,
                            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                              high_freq_factor=4.0, original_max_position_embeddings=32)),
    "qwen3": dict(model_type="qwen3", rope_theta=1000000.0, tie_word_embeddings=False, head_dim=32),
    "qwen2": dict(model_type="qwen2", rope_theta=1000000.0, tie_word_embeddings=True),
}


def hf_config(kind: str, **overrides):
    import transformers
    from config import ARCHS
    if kind not in KINDS:
        raise ValueError(f"unknown checkpoint kind {kind!r}; known: {', '.join(KINDS)}")
    kw = {**TINY, **KINDS[kind], **overrides}
    # LlamaForCausalLM -> LlamaConfig
    cls = getattr(transformers, ARCHS[kw.pop("model_type")].hf_class.replace("ForCausalLM", "Config"))
    return cls(**kw)


def make_checkpoint(path, kind: str = "llama", sharded: bool = False, seed: int = 0, **overrides) -> Path:
    """Write a random tiny HF checkpoint of `kind` into directory `path` and return it."""
    from transformers import AutoModelForCausalLM
    path = Path(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):  # Qwen2's q/k/v: large enough to matter
                p.normal_(0, 0.5)
            else:  # Linear [out, in] and embedding [vocab, hidden]: std 1/sqrt(dim 1) gives logits of order 1
                p.normal_(0, p.shape[1] ** -0.5)
    model.save_pretrained(path, max_shard_size="20KB" if sharded else "10GB")
    return path


def one_line(excinfo, *needles) -> str:
    """An error's message is one line holding every needle (errors name the problem and the fix)."""
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg
    return msg


def hf_model(path):
    """The transformers reference model for a checkpoint directory, float32, eval mode (a draft
    with its own vocabulary over the target's, as the engine runs it)."""
    from transformers import AutoModelForCausalLM
    from checkpoint import hf_over_target_vocab
    return hf_over_target_vocab(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
                                .eval())


@pytest.fixture
def make_ckpt(tmp_path_factory):
    """make_ckpt(kind="llama", sharded=False, **overrides) -> a fresh checkpoint directory."""
    def make(kind="llama", sharded=False, **overrides):
        return make_checkpoint(tmp_path_factory.mktemp(kind), kind, sharded, **overrides)
    return make


@pytest.fixture
def untimed_forms(monkeypatch):
    """cpu_linear's product forms chosen without timing them (timing every row count of a 135M
    model takes tens of seconds): "packed" for 3 rows (a verification at K = 2, as a Xeon chooses),
    "transposed" for any other count (as an EPYC does). Written to this session's forms file as a
    timed choice would be, so a spawned speculator reads them. For the real model's tests, whose
    tokens must not depend on the form: its shapes still run both non-plain forms.
    tests/test_cpu_linear.py tests the timing."""
    import cpu_linear

    def choose(layers, M, reps=3, clock=None):
        for layer in layers:
            layer.forms[M, torch.get_num_threads()] = "packed" if M == 3 else "transposed"
    monkeypatch.setattr(cpu_linear, "choose_forms", choose)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer, built once for the session from its GGUF file's metadata
    (seconds each build): tests/test_gguf.py and tests/test_real_pair.py."""
    from checkpoint import load_tokenizer
    return load_tokenizer("smollm2-135m")
