"""GGUF files: metadata -> HF config, tokenizer and generation defaults; tensors -> float weights
under HF names (dequantized with the gguf package, llama.cpp's Q/K row order undone)."""

from __future__ import annotations

import math
import pathlib
import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # imported where tensors are made: reading a file's metadata needs no torch
    import torch

from ember.errors import ModelLoadError
from ember.loaders.gguf_header import GGUF_MAGIC, read_header
from ember.loaders.source import check_architecture, supported_architectures
from ember.tokenization.fallback_templates import BY_GGUF_ARCHITECTURE


# GGUF general.architecture -> HF model_type (Mistral GGUFs are written as "llama").
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                      "gemma3": "gemma3_text"}
_HF_ARCHITECTURE_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                          "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                          "gemma3_text": "Gemma3ForCausalLM"}
_PERMUTED_QK = {"llama"}  # llama.cpp's converter interleaves q/k rows for these
MMPROJ_ARCHITECTURE = "clip"  # what llama.cpp writes as the architecture of every mmproj file

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixtures of experts: the router, the experts stacked (experts, out, in), a shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Gemma 3 has four norms a layer: llama.cpp's ffn_norm is the one before its MLP
_ARCH_LAYER_NAMES = {"gemma3": {"ffn_norm": "pre_feedforward_layernorm",
                                "post_attention_norm": "post_attention_layernorm",
                                "post_ffw_norm": "post_feedforward_layernorm"}}
# llama.cpp's converter adds this to the norm weights of Gemma, whose norms scale by (1 + w)
_NORM_SHIFT = {"gemma3": 1.0}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_REQUIRED_LAYER_TENSORS = ("attn_norm.weight", "ffn_norm.weight", "attn_q.weight", "attn_k.weight",
                           "attn_v.weight", "attn_output.weight")
_DENSE_FFN = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
_EXPERT_FFN = ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
_EXPERT_ARCHITECTURES = {"qwen3moe"}  # the only ones whose files may hold router and expert tensors
_EXPERT_PARTS = {"ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp",
                 "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp"}
_EXTRA_REQUIRED = {
    "llama": _DENSE_FFN,
    "qwen2": _DENSE_FFN + ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "qwen3": _DENSE_FFN + ("attn_q_norm.weight", "attn_k_norm.weight"),
    "qwen3moe": _EXPERT_FFN + ("attn_q_norm.weight", "attn_k_norm.weight"),
    "gemma3": _DENSE_FFN + ("attn_q_norm.weight", "attn_k_norm.weight", "post_attention_norm.weight",
                            "post_ffw_norm.weight"),
}
_HALF_TYPES = {"F16": "float16", "BF16": "bfloat16"}  # torch dtype names
_NOT_WEIGHTS = {"rope_freqs.weight"}  # folded into the config's rope_scaling
_QUANT_SUFFIX = re.compile(r"[.\-_](?:(?:UD-)?I?Q\d\w*|F16|F32|BF16|FP16|FP32)$", re.IGNORECASE)
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def is_gguf_file(path: pathlib.Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def model_name_from_file(path: pathlib.Path) -> str:
    """'SmolLM2-135M-Instruct.Q4_1.gguf' -> 'SmolLM2-135M-Instruct'."""
    stem = path.name[:-5] if path.name.lower().endswith(".gguf") else path.name
    return _QUANT_SUFFIX.sub("", stem) or stem


class GGUFFile:
    """An opened GGUF file of any kind: its metadata as plain values and its tensors by name,
    checked to lie within the file."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        if not is_gguf_file(path):
            raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the GGUF "
                                 f"magic bytes)", param="model", code="invalid_model")
        try:
            header = read_header(path)
        except (ValueError, OSError) as exc:  # GGUFFormatError among them
            raise ModelLoadError(f"{path} is not a readable GGUF file (truncated or corrupt: "
                                 f"{_first_line(exc)})", param="model", code="invalid_model") from None
        self.metadata: dict[str, Any] = header.metadata
        self.tensors = header.tensors

    def torch_shape(self, name: str) -> tuple[int, ...]:
        # GGUF lists dimensions fastest-first (ne[0] = columns); torch wants them slowest-first.
        return tuple(int(n) for n in reversed(self.tensors[name].shape.tolist()))

    def tensor_type(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def dequantize(self, name: str) -> torch.Tensor:
        """The named GGUF tensor as float32, in torch's shape and GGUF's row order."""
        import gguf
        import torch

        tensor = self.tensors[name]
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(f"{self.path.name}: tensor {name} has type "
                                 f"{tensor.tensor_type.name}, which ember cannot dequantize",
                                 param="model", code="invalid_model") from None
        array = np.asarray(values, dtype=np.float32).reshape(self.torch_shape(name))
        if not array.flags.writeable or not array.flags.owndata:
            array = array.copy()  # never hand out a view of the memory-mapped file
        return torch.from_numpy(array)


class GGUFModel(GGUFFile):
    """An opened, validated GGUF file of a language model."""

    def __init__(self, path: pathlib.Path) -> None:
        super().__init__(path)
        arch = self.metadata.get("general.architecture")
        if arch == MMPROJ_ARCHITECTURE:
            raise ModelLoadError(f"{path.name} is a vision model's projector (an mmproj file), not a language "
                                 f"model: serve its language model's GGUF with --mmproj {path.name}",
                                 param="model", code="invalid_model")
        if arch not in GGUF_ARCHITECTURES:
            raise ModelLoadError(
                f"{path.name}: GGUF architecture {arch!r} is not supported by ember (supported: "
                f"{', '.join(supported_architectures())})", param="model",
                code="unsupported_architecture")
        self.arch: str = arch
        self.model_type = GGUF_ARCHITECTURES[arch]
        check_architecture(self.model_type, path.name)
        self._check_tensor_names()
        template = BY_GGUF_ARCHITECTURE.get(arch)
        if template is not None and not self.metadata.get("tokenizer.chat_template"):
            self.metadata["tokenizer.chat_template"] = template

    # ---- metadata -> config -------------------------------------------------------------------

    def _arch_value(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)

    def _required(self, key: str) -> Any:
        value = self._arch_value(key)
        if value is None:
            raise ModelLoadError(f"{self.path.name} lacks the GGUF metadata key {self.arch}.{key}",
                                 param="model", code="invalid_model")
        if isinstance(value, list):
            raise ModelLoadError(f"{self.path.name}: per-layer values for {self.arch}.{key} are "
                                 f"not supported", param="model", code="invalid_model")
        return value

    def hf_config(self, eos_token_ids: list[int]) -> dict[str, Any]:
        """A config.json-shaped dict for this model."""
        num_layers = int(self._required("block_count"))
        hidden = int(self._required("embedding_length"))
        heads = int(self._required("attention.head_count"))
        kv_heads = int(self._arch_value("attention.head_count_kv") or heads)
        head_dim = int(self._arch_value("attention.key_length") or hidden // heads)
        rotary = self._arch_value("rope.dimension_count")
        if rotary is not None and int(rotary) != head_dim:
            raise ModelLoadError(f"{self.path.name}: partial rotary embeddings ({rotary} of "
                                 f"{head_dim} dims) are not supported", param="model",
                                 code="invalid_model")
        embed_shape = self.torch_shape("token_embd.weight")
        tokens = self.metadata.get("tokenizer.ggml.tokens") or []
        vocab_size = embed_shape[0]
        if tokens and len(tokens) > vocab_size:
            raise ModelLoadError(f"{self.path.name}: the tokenizer has {len(tokens)} tokens but the "
                                 f"embedding only {vocab_size} rows", param="model",
                                 code="invalid_model")
        theta = float(self._arch_value("rope.freq_base", 10000.0))
        config: dict[str, Any] = {
            "architectures": [_HF_ARCHITECTURE_CLASS[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": vocab_size,
            "hidden_size": hidden,
            "intermediate_size": int(self._arch_value("feed_forward_length") or 0
                                     or self._required("expert_feed_forward_length")),
            "num_hidden_layers": num_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": shortest_float32(self._arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": shortest_float32(theta),
            "rope_scaling": self._rope_scaling(theta, head_dim),
            "max_position_embeddings": int(self._arch_value("context_length") or 2048),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "bos_token_id": self.metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": eos_token_ids,
        }
        if self.metadata.get("tokenizer.ggml.padding_token_id") is not None:
            config["pad_token_id"] = self.metadata["tokenizer.ggml.padding_token_id"]
        if self._arch_value("pooling_type") is not None:  # an embedding model's (loaders.pooling_config)
            config["gguf_pooling_type"] = int(self._arch_value("pooling_type"))
        if self.model_type == "qwen2":
            config["use_sliding_window"] = False
        if self._arch_value("expert_count"):
            config.update(self._expert_config())
        if self.arch == "gemma3":
            config.update(self._gemma3_config(num_layers, hidden, heads, head_dim))
        return config

    def _gemma3_config(self, num_layers: int, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
        """What llama.cpp fixes for Gemma 3 rather than storing: every sixth layer global, a local
        rotary base of 10000, queries scaled by head_dim ** -0.5 (hidden / heads for the 62-layer
        27B)."""
        window = self._arch_value("attention.sliding_window")
        return {"sliding_window": int(window) if window else None, "sliding_window_pattern": 6,
                "rope_local_base_freq": 10000.0, "hidden_activation": "gelu_pytorch_tanh",
                "query_pre_attn_scalar": hidden // heads if num_layers == 62 else head_dim}

    def _expert_config(self) -> dict[str, Any]:
        """Qwen3-MoE's config fields; llama.cpp renormalises the chosen experts' weights unless
        the file says otherwise."""
        config = {"num_experts": int(self._required("expert_count")),
                  "num_experts_per_tok": int(self._required("expert_used_count")),
                  "moe_intermediate_size": int(self._required("expert_feed_forward_length")),
                  "norm_topk_prob": bool(self._arch_value("expert_weights_norm", True))}
        shared = self._arch_value("expert_shared_feed_forward_length")
        if shared:
            config["shared_expert_intermediate_size"] = int(shared)
        return config

    def _rope_scaling(self, theta: float, head_dim: int) -> dict[str, Any] | None:
        kind = self._arch_value("rope.scaling.type")
        factor = self._arch_value("rope.scaling.factor")
        original = self._arch_value("rope.scaling.original_context_length")
        if "rope_freqs.weight" in self.tensors:
            if kind not in (None, "none"):
                raise ModelLoadError(f"{self.path.name} has both rope_freqs and rope scaling "
                                     f"type {kind!r}", param="model", code="invalid_model")
            return self._llama3_rope_scaling(theta, head_dim, original)
        if kind in (None, "none") or factor in (None, 1.0, 0.0):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(factor)}
        if kind == "yarn":
            scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
            if original:
                scaling["original_max_position_embeddings"] = int(original)
            for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"),
                              ("rope.scaling.yarn_beta_slow", "beta_slow"),
                              ("rope.scaling.attn_factor", "attention_factor")):
                if self._arch_value(key) is not None:
                    scaling[name] = float(self._arch_value(key))
            return scaling
        raise ModelLoadError(f"{self.path.name}: rope scaling type {kind!r} is not supported "
                             f"(supported: linear, yarn, llama3 rope_freqs)", param="model",
                             code="invalid_model")

    def _llama3_rope_scaling(self, theta: float, head_dim: int,
                             original: int | None) -> dict[str, Any] | None:
        """llama.cpp stores Llama 3.1-style scaling as a per-frequency factor tensor; find the
        HF parameters that reproduce it."""
        factors = self.dequantize("rope_freqs.weight").numpy().astype(np.float64).reshape(-1)
        factor = float(factors.max())
        if factor <= 1.0:
            return None
        for low, high, context in ((1.0, 4.0, int(original or 8192)),):
            expected = llama3_rope_factors(theta, head_dim, factor, low, high, context)
            if expected.shape == factors.shape and np.allclose(expected, factors, rtol=1e-4):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                        "high_freq_factor": high, "original_max_position_embeddings": context}
        raise ModelLoadError(f"{self.path.name}: its rope_freqs tensor matches no known Llama 3 "
                             f"rope scaling", param="model", code="invalid_model")

    def generation_config(self, eos_token_ids: list[int]) -> dict[str, Any]:
        config: dict[str, Any] = {"eos_token_id": eos_token_ids}
        if self.metadata.get("tokenizer.ggml.bos_token_id") is not None:
            config["bos_token_id"] = self.metadata["tokenizer.ggml.bos_token_id"]
        for key, name in _SAMPLING_KEYS.items():
            if self.metadata.get(key) is not None:
                value = self.metadata[key]
                config[name] = int(value) if name == "top_k" else shortest_float32(value)
        return config

    # ---- tensors ------------------------------------------------------------------------------

    def _check_tensor_names(self) -> None:
        num_layers = self._arch_value("block_count")
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ModelLoadError(f"{self.path.name} lacks a valid {self.arch}.block_count",
                                 param="model", code="invalid_model")
        required = ["token_embd.weight", "output_norm.weight"]
        per_layer = _REQUIRED_LAYER_TENSORS + _EXTRA_REQUIRED.get(self.arch, ())
        required += [f"blk.{i}.{name}" for i in range(num_layers) for name in per_layer]
        missing = [name for name in required if name not in self.tensors]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ModelLoadError(f"{self.path.name} is missing tensors ({shown}); the file is "
                                 f"incomplete or not a {self.arch} model", param="model",
                                 code="invalid_model")
        has_experts = self.arch in _EXPERT_ARCHITECTURES
        unknown = [name for name in self.tensors
                   if name not in _NOT_WEIGHTS and (hf_tensor_name(name, num_layers, self.arch) is None
                                                    or (_is_expert_tensor(name) and not has_experts))]
        if unknown:
            raise ModelLoadError(f"{self.path.name} has tensors ember does not know for "
                                 f"{self.arch}: {', '.join(unknown[:5])}", param="model",
                                 code="invalid_model")

    def weights(self, hf_config: Mapping[str, Any], *, keep_half: bool = False,
                skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor) for every weight not named in skip, Q/K rows back in HF order.
        With keep_half, F16 and BF16 tensors stay in their own (exact) dtype instead."""
        import torch

        num_layers = hf_config["num_hidden_layers"]
        heads = hf_config["num_attention_heads"]
        kv_heads = hf_config["num_key_value_heads"]
        norm_shift = _NORM_SHIFT.get(self.arch)
        for name in self.tensors:
            if name in _NOT_WEIGHTS:
                continue
            hf_name = hf_tensor_name(name, num_layers, self.arch)
            if hf_name in skip:
                continue
            tensor = dequantize_tensor(self, name)
            if norm_shift is not None and name.endswith("norm.weight"):
                tensor = tensor - norm_shift
            if keep_half and self.tensor_type(name) in _HALF_TYPES:
                tensor = tensor.to(getattr(torch, _HALF_TYPES[self.tensor_type(name)]))
            if self.arch in _PERMUTED_QK:
                if ".attn_q." in name:
                    tensor = unpermute_qk_rows(tensor, heads, name)
                elif ".attn_k." in name:
                    tensor = unpermute_qk_rows(tensor, kv_heads, name)
            yield hf_name, tensor


def dequantize_tensor(model: GGUFModel, name: str) -> torch.Tensor:
    """One tensor to float32 (the one place the loader dequantizes; tests count calls here)."""
    return model.dequantize(name)


def hf_tensor_name(name: str, num_layers: int, arch: str = "") -> str | None:
    """GGUF tensor name -> HF checkpoint name, or None when it is not one ember knows."""
    base, _, kind = name.rpartition(".")
    if base in _GLOBAL_NAMES and kind == "weight":
        return f"{_GLOBAL_NAMES[base]}.weight"
    match = _LAYER_TENSOR.fullmatch(name)
    if match is None:
        return None
    layer, part, kind = int(match.group(1)), match.group(2), match.group(3)
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if layer >= num_layers or part not in names:
        return None
    return f"model.layers.{layer}.{names[part]}.{kind}"


def _is_expert_tensor(name: str) -> bool:
    match = _LAYER_TENSOR.fullmatch(name)
    return match is not None and match.group(2) in _EXPERT_PARTS


def unpermute_qk_rows(tensor: torch.Tensor, num_heads: int, name: str = "") -> torch.Tensor:
    """Undo llama.cpp's q/k permutation. Within each head it stores rows in the order
    (pair, half) where HF has (half, pair): rotary pairs interleaved instead of split in halves."""
    rows = tensor.shape[0]
    if rows % num_heads or (rows // num_heads) % 2:
        raise ModelLoadError(f"tensor {name} has {rows} rows, which do not split into {num_heads} "
                             f"heads of even size", param="model", code="invalid_model")
    head_dim = rows // num_heads
    rest = tensor.shape[1:]
    return (tensor.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2)
            .reshape(rows, *rest).contiguous())


def llama3_rope_factors(theta: float, head_dim: int, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_context: int) -> np.ndarray:
    """The per-frequency divisors Llama 3 rope scaling applies (as llama.cpp's rope_freqs)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / freqs
    low_wavelen = original_context / low_freq_factor
    high_wavelen = original_context / high_freq_factor
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = 1.0 / ((1.0 - smooth) / factor + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, factor, blended))


def shortest_float32(value: Any) -> float:
    """GGUF stores float32; 9.999999747378752e-06 reads back as the 1e-05 that was written."""
    return float(str(np.float32(value)))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
