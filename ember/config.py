"""Typed configuration: the model's shape and the engine's settings, validated on construction."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from ember.errors import ModelLoadError

logger = logging.getLogger("ember.config")


@dataclass(slots=True)
class ModelConfig:
    """The architecture hyper-parameters every model file reads, in Hugging Face's names."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # a sequence-classification checkpoint's labels (its score head's outputs, which replace the
    # LM head); 0 for a causal LM
    num_labels: int = 0
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # per layer: its sliding window (the keys a token sees, its own included), None where the layer
    # attends to the whole sequence; empty when every layer does
    layer_windows: list[int | None] = field(default_factory=list)
    # config.json as read (a multimodal config's text part): the fields only one architecture
    # uses (experts, soft-capping, ...) are read from it by that architecture's model file
    hf: dict[str, Any] = field(default_factory=dict, repr=False)
    # a multimodal checkpoint's whole config.json (its vision_config, image token and projector
    # settings, read by the model file); empty for a text-only model
    multimodal: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")

    def with_rope_scaling(self, scaling: dict[str, Any]) -> "ModelConfig":
        """This config with rotary positions stretched by `scaling`, as a user asks to serve a longer window.

        `factor` (above 1) stretches the model's trained length, or `original_max_position_embeddings`
        when given; the product becomes the new trained length. Types: linear (every frequency divided
        by the factor) and yarn (low frequencies interpolated, high ones kept, attention rescaled).
        EngineConfig has checked `scaling`.
        """
        kind = scaling.get("rope_type", scaling.get("type"))
        original = scaling.get("original_max_position_embeddings", self.max_position_embeddings)
        if self.rope_scaling:
            logger.warning("rope_scaling %s replaces the model's own %s", scaling, self.rope_scaling)
        scaled = {**scaling, "rope_type": kind, "factor": float(scaling["factor"]),
                  "original_max_position_embeddings": original}
        scaled.pop("type", None)
        return replace(self, rope_scaling=scaled, max_position_embeddings=int(original * scaled["factor"]))

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config.json dict. A multimodal config's text part shapes the
        model; its tie_word_embeddings is the outer config's where that names one (transformers ties
        by the top-level model's config)."""
        multimodal: dict[str, Any] = {}
        if "text_config" in hf and "hidden_size" not in hf:
            multimodal = dict(hf)
            hf = {**hf["text_config"], "model_type": hf.get("model_type")}
            if "tie_word_embeddings" in multimodal:
                hf["tie_word_embeddings"] = multimodal["tie_word_embeddings"]
        try:
            heads = hf["num_attention_heads"]
            eos = hf.get("eos_token_id")
            rope_scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
            rope_theta = hf.get("rope_theta")
            if rope_theta is None and isinstance(rope_scaling, dict):
                rope_theta = rope_scaling.get("rope_theta")
            if isinstance(rope_scaling, dict):
                kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
                rope_scaling = None if kind == "default" else {**rope_scaling, "rope_type": kind}
            if rope_scaling and "original_max_position_embeddings" not in rope_scaling and \
                    hf.get("original_max_position_embeddings"):  # Phi-3 keeps it beside the scaling
                rope_scaling["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
            max_positions = hf.get("max_position_embeddings", 2048)
            return cls(
                model_type=hf["model_type"],
                vocab_size=hf["vocab_size"],
                hidden_size=hf["hidden_size"],
                intermediate_size=hf["intermediate_size"],
                num_hidden_layers=hf["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=hf.get("num_key_value_heads") or heads,
                head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                rope_theta=rope_theta if rope_theta is not None else 10000.0,
                rope_scaling=rope_scaling,
                max_position_embeddings=max_positions,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=bool(hf.get("attention_bias", hf["model_type"] == "qwen2")),
                num_labels=classifier_labels(hf),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
                layer_windows=sliding_windows(hf, max_positions),
                hf=dict(hf),
                multimodal=multimodal,
            )
        except KeyError as missing:
            raise ModelLoadError(f"the model's config lacks the field {missing}") from None


def classifier_labels(hf: dict[str, Any]) -> int:
    """How many labels a sequence-classification checkpoint (`...ForSequenceClassification` in its
    architectures) scores, as transformers counts them (id2label, else num_labels, else 2); 0 for any
    other model."""
    if not any(str(name).endswith("ForSequenceClassification") for name in hf.get("architectures") or ()):
        return 0
    labels = hf.get("id2label")
    return len(labels) if isinstance(labels, dict) and labels else int(hf.get("num_labels", 2))


def sliding_windows(hf: dict[str, Any], max_positions: int) -> list[int | None]:
    """Each layer's sliding window from a config.json: layer_types where the config lists them
    (Gemma 3, and transformers' own configs), else Gemma 3's sliding_window_pattern, else Qwen2's
    max_window_layers (layers from there on are local), else every layer (Mistral, Phi-3). A window
    as wide as the context is no window."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    if not isinstance(window, int) or isinstance(window, bool) or not 0 < window < max_positions:
        return []
    num_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ModelLoadError(f"layer_types lists {len(types)} layers, the model has {num_layers}")
        windows = [window if kind == "sliding_attention" else None for kind in types]
    elif hf.get("sliding_window_pattern"):  # Gemma 3's first configs: every Nth layer global
        pattern = hf["sliding_window_pattern"]
        windows = [None if (i + 1) % pattern == 0 else window for i in range(num_layers)]
    elif hf.get("model_type") == "qwen2" and hf.get("max_window_layers") is not None:
        windows = [window if i >= hf["max_window_layers"] else None for i in range(num_layers)]
    else:
        windows = [window] * num_layers
    return windows if any(windows) else []


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding (ember.engine.spec): who drafts tokens for the model to verify.

    mode: off; ngram (prompt lookup: the tokens that followed the last earlier occurrence of the
    sequence's suffix); draft (a smaller model sharing the target's tokenizer, `draft_model`);
    auto (the draft model when one is named and loads, else n-gram).
    """

    mode: str = "off"
    draft_model: str | None = None
    draft_tokens: int | None = None  # tokens drafted per round, 1 to 8; None: tuned live, each step
    ngram_min: int = 1  # the shortest and longest suffixes n-gram lookup matches
    ngram_max: int = 4

    def __post_init__(self) -> None:
        if self.mode not in SPECULATION_MODES:
            raise ValueError(f"speculate must be one of {', '.join(SPECULATION_MODES)}, got {self.mode!r}")
        if self.draft_tokens is not None and (not isinstance(self.draft_tokens, int)
                                              or not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS):
            raise ValueError(f"draft_tokens must be 1 to {MAX_DRAFT_TOKENS}, got {self.draft_tokens!r}")
        if not (isinstance(self.ngram_min, int) and isinstance(self.ngram_max, int)
                and 1 <= self.ngram_min <= self.ngram_max <= 16):
            raise ValueError(f"ngram lengths must satisfy 1 <= min <= max <= 16, got {self.ngram_min}:{self.ngram_max}")
        if self.mode == "draft" and not self.draft_model:
            raise ValueError("speculate draft needs a draft model (--draft MODEL)")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


SPECULATION_MODES = ("off", "ngram", "draft", "auto")
MAX_DRAFT_TOKENS = 8  # --draft-tokens N
KV_DTYPES = ("auto", "bfloat16", "bf16", "float32", "fp32", "int8")  # EngineConfig.kv_dtype
MAX_TUNED_DRAFT_TOKENS = 32  # a tuned length goes this far (text being copied holds for long runs)...
BATCH_TUNED_DRAFT_TOKENS = 16  # ...and this far while other requests decode in the same step


@dataclass(slots=True)
class EngineConfig:
    """How the engine runs: memory, batch limits, caching, dtype and device."""

    max_model_len: int | None = None  # None: the model's trained length (as stretched by rope_scaling)
    # Overrides the model's rotary scaling, to serve past its trained length: e.g.
    # {"rope_type": "yarn", "factor": 4.0} (linear and yarn; see ModelConfig.with_rope_scaling)
    rope_scaling: dict[str, Any] | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit size of the paged KV cache
    kv_cache_tokens: int | None = None  # or: size it to hold this many tokens
    kv_cache_memory_gb: float | None = None  # or: size it from a memory budget (default 2 GiB on CPU)
    # What the KV cache stores: auto (the model's dtype), bfloat16 / bf16, float32 / fp32, or int8
    # (each key and value row quantized with its own scale: about half of bfloat16's bytes).
    kv_dtype: str = "auto"
    gpu_memory_utilization: float = 0.85  # CUDA, no size given: the pool's share of the memory left after the weights
    # Tiers behind the pool (engine.cache_tiers). Host memory for blocks the pool evicts, in MiB:
    # None sizes it (engine.pool.default_cache_ram_mb), 0 turns it off. Disk: a folder (None: off)
    # and the most it holds, in MiB.
    cache_ram_mb: float | None = None
    cache_disk_dir: str | None = None
    cache_disk_mb: float = 16384.0
    max_num_seqs: int = 64
    # A step's budget in token costs (engine.scheduler). None: 512 on the CPU, where that is a
    # step of about a quarter of a second for a small model (a bound on every stream's gap
    # between tokens while prompts prefill) and costs a few percent of prefill speed; 2048 on GPUs.
    max_num_batched_tokens: int | None = None
    # A token attending to c keys costs 1 + c / attention_cost_tokens in that budget, so steps
    # holding a long prompt's chunks take no longer than short ones. None: from the model's
    # shapes (engine.pool.attention_cost_tokens); 0: every token costs 1.
    attention_cost_tokens: int | None = None
    enable_prefix_caching: bool = True
    # The most of the KV pool that cache breakpoints may pin (engine.kv_cache), as a fraction.
    max_pinned_kv_share: float = 0.25
    # A background request (priority above 0) that has waited this many engine steps in all is
    # served as a foreground one from then on (engine.scheduler).
    background_wait_steps: int = 256
    # CPU: a request's bits never depend on its batch (row plans for the linears chosen by a
    # startup self-check, attention shapes independent of the neighbours; see engine.invariance).
    # Off: whole-batch matmuls and one padded decode batch; results may vary in the last bits.
    batch_invariant: bool = True
    # CPU: ember's compiled kernels (ember.kernels) for quantized linears and decode attention;
    # off, or where they cannot be built, the plain torch paths run instead.
    cpu_kernels: bool = True
    # Linear-layer weights on the CPU: auto keeps a GGUF file's own precision (its 4- and 8-bit
    # blocks) and bfloat16 otherwise; int4 / int8 quantize every layer (the LM head to 8 bits);
    # none dequantizes to the model dtype. Blocks need the CPU kernels (ember.kernels).
    quantization: str = "auto"
    dtype: str = "auto"  # auto: bfloat16 (batch-invariant and fastest on CPU and GPU)
    device: str = "auto"  # auto: the CPU (the CUDA path is chosen by name until a GPU check runs in the suite)
    seed: int | None = None  # of sampled requests that bring none; None: each draws a fresh one (SamplingParams.seeded)
    num_threads: int | None = None  # torch CPU threads; None: leave torch's choice (split between a launch's ranks)
    # Tensor parallelism (engine.parallel): the model split over this many ranks, which run as
    # processes of `nnodes` launches (nodes), tensor_parallel_size / nnodes each, meeting at
    # dist_init_addr ("HOST:PORT" of rank 0; a free localhost port when one launch holds them all).
    tensor_parallel_size: int = 1
    nnodes: int = 1
    dist_init_addr: str | None = None
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # A vision model's images (engine.images): read when on; its encoded images kept in this many MiB
    vision: bool = True
    # A GGUF model's vision part, llama.cpp's mmproj file (loaders.mmproj): its path; auto: an mmproj*.gguf
    # file beside the model (for a Hugging Face repo id, the repo's); none: the GGUF is a text model
    mmproj: str = "auto"
    image_cache_mb: float = 256.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_pinned_kv_share <= 1.0:
            raise ValueError(f"max_pinned_kv_share must be between 0 and 1, got {self.max_pinned_kv_share!r}")
        if not isinstance(self.background_wait_steps, int) or self.background_wait_steps < 0:
            raise ValueError(f"background_wait_steps must be a whole number of steps, got {self.background_wait_steps!r}")
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ValueError(f"num_threads must be a positive integer, got {self.num_threads!r}")
        if not isinstance(self.mmproj, str) or not self.mmproj:
            raise ValueError(f"mmproj must be a file's path, auto or none, got {self.mmproj!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be above 0 and at most 1, got {self.gpu_memory_utilization!r}")
        if self.cache_ram_mb is not None and self.cache_ram_mb < 0:
            raise ValueError(f"cache_ram_mb must be 0 or more, got {self.cache_ram_mb!r}")
        if self.cache_disk_mb <= 0:
            raise ValueError(f"cache_disk_mb must be positive, got {self.cache_disk_mb!r}")
        if self.tensor_parallel_size > 1 and (self.cache_ram_mb or self.cache_disk_dir):
            raise ValueError("the host and disk KV cache tiers are not supported under tensor parallelism yet: "
                             "leave --cache-ram and --cache-dir out")
        if self.image_cache_mb < 0:
            raise ValueError(f"image_cache_mb must be 0 or more, got {self.image_cache_mb!r}")
        if self.attention_cost_tokens is not None and (not isinstance(self.attention_cost_tokens, int)
                                                       or self.attention_cost_tokens < 0):
            raise ValueError(f"attention_cost_tokens must be 0 or more, got {self.attention_cost_tokens!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if name == "max_num_batched_tokens" and value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.quantization not in ("auto", "none", "int8", "int4"):
            raise ValueError(f"quantization must be auto, none, int8 or int4, got {self.quantization!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling)
        _check_parallel(self.tensor_parallel_size, self.nnodes, self.dist_init_addr)


def _check_parallel(size: int, nnodes: int, address: str | None) -> None:
    for name, value in (("tensor_parallel_size", size), ("nnodes", nnodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if size % nnodes:
        raise ValueError(f"tensor_parallel_size {size} must be a multiple of nnodes {nnodes} (ranks per node)")
    if nnodes > 1 and address is None:
        raise ValueError("several nodes need dist_init_addr (HOST:PORT of rank 0) to meet at")
    if address is not None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"dist_init_addr must be HOST:PORT, got {address!r}")


def _check_rope_scaling(scaling: Any) -> None:
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be a JSON object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("linear", "yarn"):
        raise ValueError(f"rope_scaling needs rope_type linear or yarn, got {kind!r}")
    factor = scaling.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 1:
        raise ValueError(f"rope_scaling needs a factor above 1, got {factor!r}")
    original = scaling.get("original_max_position_embeddings", 1)
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ValueError(f"rope_scaling original_max_position_embeddings must be a positive integer, got {original!r}")
