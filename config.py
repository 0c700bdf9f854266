"""What each architecture is, and a model's config: the one table (ARCHS) that the config, both
checkpoint formats (safetensors: checkpoint.py, GGUF: gguf_format.py), the layers (model.py) and
the tests read, and `ModelConfig`, built from an HF config.json by `from_hf`, which refuses in one
line anything the engine does not implement (and, with `check_tp`, a tensor-parallel size it does
not split into).

A new architecture is a row of ARCHS (and, if its layers differ in a way no field here says, the
layers in model.py); nothing else keys on model_type.
"""
import math
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Arch:
    """What one model_type is, for every place that differs by it."""
    hf_class: str         # transformers' class of it (the tests' reference)
    qkv_bias: bool        # q_proj, k_proj and v_proj add a bias (o_proj and the MLP never do)
    qk_norm: bool         # each head of q and k is RMS-normalised before RoPE
    gguf_name: str        # its GGUF files' general.architecture
    gguf_qk_permuted: bool  # llama.cpp's converter interleaved q/k rows (gguf_format.unpermute_qk)


# model_type -> what it is: the one table a new architecture goes into (ModelConfig.from_hf,
# the loaders and the tests read it)
ARCHS = {
    "llama": Arch("LlamaForCausalLM", qkv_bias=False, qk_norm=False, gguf_name="llama",
                  gguf_qk_permuted=True),   # Llama 2/3, SmolLM2, ...
    "qwen3": Arch("Qwen3ForCausalLM", qkv_bias=False, qk_norm=True, gguf_name="qwen3",
                  gguf_qk_permuted=False),
    "qwen2": Arch("Qwen2ForCausalLM", qkv_bias=True, qk_norm=False, gguf_name="qwen2",
                  gguf_qk_permuted=False),  # Qwen2, Qwen2.5
}


@dataclass
class ModelConfig:
    model_type: str  # a key of ARCHS
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # {"rope_type": "llama3", ...} (HF) or {"rope_type": "freq_factors", ...} (GGUF)
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # A draft with its own, smaller vocabulary (scripts/distill_draft.py --vocab): row r of its
    # embedding and head is token token_ids[r] of the target's vocabulary (vocab_size tokens), and
    # one more row reads every other token. Its logits come out over the target's vocabulary, -inf
    # on the tokens it never writes (probability 0: speculative decoding stays exact, as with any
    # draft law). The head over a 49k vocabulary is most of a small draft; this frees it for layers.
    token_ids: list[int] | None = None
    # A draft whose embedding and head are padded to another size than the target's vocabulary
    # (Qwen2.5-7B has 152,064 rows, its 0.5B 151,936), with the same tokenizer: row r is token r,
    # logits come out over the target's vocab_size: -inf on the tokens it has no row for, and rows
    # past the vocabulary dropped (their probability 0, the rest renormalised by the softmax: the
    # law the draft samples from and the verifier tests with). Set by over_target_vocab.
    padded_rows: int | None = None

    @property
    def arch(self) -> Arch:
        return ARCHS[self.model_type]

    @property
    def rows(self) -> int:
        """Rows of the embedding and the head: the vocabulary, or a draft's own (token_ids,
        padded_rows)."""
        if self.token_ids is not None:
            return len(self.token_ids) + 1
        return self.padded_rows or self.vocab_size

    def over_target_vocab(self, V: int) -> "ModelConfig":
        """This draft's config with its logits over a target's V tokens (padded_rows)."""
        if V == self.vocab_size or self.token_ids is not None:
            return self
        return replace(self, vocab_size=V, padded_rows=self.rows)

    def tp_sizes(self) -> list[int]:
        """The tensor-parallel sizes this model splits evenly into (model.py splits the heads, the
        MLP's intermediate units and the vocabulary: each must divide)."""
        g = math.gcd(self.num_attention_heads, self.num_key_value_heads, self.intermediate_size,
                     self.vocab_size)
        return [w for w in range(1, g + 1) if g % w == 0]

    def check_tp(self, world: int):
        if world not in self.tp_sizes():
            raise ValueError(f"tensor parallel size {world} must divide each of "
                             f"num_attention_heads={self.num_attention_heads}, num_key_value_heads="
                             f"{self.num_key_value_heads}, intermediate_size="
                             f"{self.intermediate_size} and vocab_size={self.vocab_size}: valid TP "
                             f"sizes are {', '.join(map(str, self.tp_sizes()))}")

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Build from a parsed HF config.json; refuse anything we do not implement, naming it."""
        mt = hf.get("model_type")
        if mt not in ARCHS:
            raise ValueError(f"unsupported model_type {mt!r}: this engine implements "
                             f"{', '.join(map(repr, ARCHS))} (config.ARCHS)")
        for key in ("attention_bias", "mlp_bias"):
            if hf.get(key):
                raise ValueError(f"unsupported config: {key}=true ({mt}); only bias-free "
                                 f"projections are implemented")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported config: hidden_act={hf['hidden_act']!r}; only 'silu' "
                             f"(SwiGLU) is implemented")
        if hf.get("use_sliding_window") or set(hf.get("layer_types") or []) - {"full_attention"}:
            raise ValueError("unsupported config: sliding-window attention (use_sliding_window / "
                             "layer_types); only full attention is implemented")
        if hf.get("pretraining_tp", 1) != 1:
            raise ValueError(f"unsupported config: pretraining_tp={hf['pretraining_tp']}; "
                             f"only 1 is implemented")
        # transformers >= 5 writes "rope_parameters"; released checkpoints rope_theta + rope_scaling
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_type {rope_type!r}; implemented: 'default' and "
                             f"'llama3'")
        eos = hf.get("eos_token_id")
        heads = hf["num_attention_heads"]
        token_ids, vocab = hf.get("target_token_ids"), hf["vocab_size"]
        if token_ids is not None:  # a draft's own vocabulary (see token_ids above)
            vocab = hf.get("target_vocab_size", 0)
            if (hf["vocab_size"] != len(token_ids) + 1 or len(set(token_ids)) != len(token_ids)
                    or not all(0 <= t < vocab for t in token_ids)):
                raise ValueError(f"config: target_token_ids must be vocab_size - 1 = "
                                 f"{hf['vocab_size'] - 1} distinct ids in [0, target_vocab_size="
                                 f"{vocab}), got {len(token_ids)}: re-export the draft")
        return cls(
            model_type=mt,
            vocab_size=vocab,
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=rope if rope_type == "llama3" else None,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            token_ids=None if token_ids is None else list(token_ids),
        )
