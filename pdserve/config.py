"""One typed configuration shared by the offline `LLM` API, the server and both PD roles.

Every field is a launch flag: `max_total_tokens` is `--max-total-tokens`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from pdserve.sglang_compat import UnsupportedFlag, check_sglang_flags

DisaggMode = Literal["null", "prefill", "decode"]
KV_CACHE_DTYPE_CHOICES = ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2")  # pdserve.mem_cache.kv_quant's
TransferBackendName = Literal["auto", "mooncake", "nccl", "tcp", "fake"]


class ConfigError(ValueError):
    """A flag value or combination that cannot work; raised before anything starts."""


@dataclass(frozen=True, slots=True)
class ServerArgs:
    # model
    model_path: str
    tokenizer_path: str | None = None
    revision: str | None = None
    tokenizer_mode: Literal["auto", "slow"] = "auto"
    chat_template: str | None = None
    dtype: str = "auto"
    trust_remote_code: bool = False
    context_length: int | None = None
    served_model_name: str | None = None
    device: str = "auto"
    random_seed: int = 0
    load_format: Literal["auto", "dummy"] = "auto"
    quantization: str | None = None  # fp8 or compressed-tensors; an FP8 checkpoint needs none
    quantize_lm_head: bool = False
    # memory and scheduling
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.85
    chunked_prefill_size: int = 8192
    max_running_requests: int = 256
    max_prefill_tokens: int = 16384
    page_size: int = 16
    kv_cache_dtype: str = "auto"
    kv_cache_scales: str | None = None
    disable_radix_cache: bool = False
    schedule_conservativeness: float = 1.0
    # hierarchical KV cache
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: float = 0.0
    hicache_write_policy: str = "write_through"
    hicache_mem_layout: str = "page_first"
    hicache_storage_backend: str | None = None
    hicache_storage_backend_extra_config: str | None = None
    hicache_storage_dir: str | None = None
    hicache_storage_size: float = 0.0
    hicache_storage_prefetch_policy: str = "best_effort"
    # kernels
    attention_backend: str = "auto"
    cuda_graph_max_bs: int = 256
    disable_cuda_graph: bool = False
    disable_overlap_schedule: bool = False
    skip_server_warmup: bool = False
    kernel_tuning_cache_dir: str | None = None  # None: env PDSERVE_TUNING_CACHE_DIR, else ~/.cache
    # structured output
    grammar_backend: Literal["xgrammar", "none"] = "xgrammar"
    grammar_compile_timeout_s: float = 30.0
    grammar_any_whitespace: bool = False
    tool_call_parser: str | None = None  # qwen25 or llama3; None: picked from the chat template
    # parallelism
    tp_size: int = 1
    base_gpu_id: int = 0
    nccl_port: int | None = None
    # HTTP
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    log_level: str = "info"
    shutdown_drain_timeout_s: float = 30.0
    log_requests: bool = False
    log_requests_level: int = 2
    stream_interval: int = 1
    request_body_timeout_s: float = 30.0
    max_batch_items: int = 256
    request_timeline_log: str | None = None
    # disaggregation
    disaggregation_mode: DisaggMode = "null"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: TransferBackendName = "auto"
    disaggregation_ib_device: str | None = None
    disaggregation_advertise_host: str | None = None
    num_reserved_decode_tokens: int = 512
    disaggregation_bootstrap_timeout: float = 60.0
    disaggregation_waiting_timeout: float = 60.0
    disaggregation_heartbeat_interval: float = 2.0
    disaggregation_heartbeat_failures: int = 3
    disaggregation_fence_timeout: float = 600.0
    disaggregation_layerwise_min_tokens: int = 512
    disaggregation_prefill_ahead_share: float = 0.5
    disaggregation_link_gbps: float = 0.0
    disaggregation_staging_mb: int | None = None  # None: an eighth of the decode's KV pool, within [1, 2048] MiB
    disaggregation_staging_wait_ms: float = 50.0
    disaggregation_secret: str | None = None
    disaggregation_enable_kv_checksum: bool = False
    decode_local_prefill_chunk_size: int = 512
    decode_tpot_budget_ms: float = 0.0
    decode_tpot_burst_ms: float = 0.0  # off: measured to cost goodput (pdserve/scheduler/tpot_budget.py)
    disaggregation_decode_enable_radix_cache: bool = False
    enable_pd_role_switch: bool = False
    # internal: set by the launcher, not by users
    ipc_dir: str | None = field(default=None, metadata={"cli": False})
    tp_rank: int = field(default=0, metadata={"cli": False})
    sglang_flag_notes: tuple[str, ...] = field(default=(), metadata={"cli": False})  # SGLang flags accepted as-is

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        positive = {
            "chunked_prefill_size": self.chunked_prefill_size,
            "max_running_requests": self.max_running_requests,
            "max_prefill_tokens": self.max_prefill_tokens,
            "page_size": self.page_size,
            "tp_size": self.tp_size,
            "cuda_graph_max_bs": self.cuda_graph_max_bs,
            "max_batch_items": self.max_batch_items,
            "decode_local_prefill_chunk_size": self.decode_local_prefill_chunk_size,
            "stream_interval": self.stream_interval,
            "request_body_timeout_s": self.request_body_timeout_s,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"--{_flag(name)} must be positive, got {value}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ConfigError(
                f"--max-total-tokens ({self.max_total_tokens}) must hold at least one page "
                f"(--page-size {self.page_size})"
            )
        if self.context_length is not None and self.context_length <= 0:
            raise ConfigError(f"--context-length must be positive, got {self.context_length}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ConfigError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32"):
            raise ConfigError(f"--dtype {self.dtype!r} is not one of auto, float32, float16, bfloat16")
        if self.quantization not in (None, "fp8", "compressed-tensors"):
            raise ConfigError(f"--quantization {self.quantization} needs {self.quantization} quantized weights, which "
                              "pdserve does not implement (it serves fp8 and compressed-tensors FP8 weights)")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tensor-parallel rank {self.tp_rank} is outside --tp-size {self.tp_size}")
        if self.tokenizer_mode not in ("auto", "slow"):
            raise ConfigError(f"--tokenizer-mode must be auto or slow, got {self.tokenizer_mode!r}")
        if self.disaggregation_mode not in ("null", "prefill", "decode"):
            raise ConfigError(f"--disaggregation-mode must be null, prefill or decode, got {self.disaggregation_mode!r}")
        if self.disaggregation_transfer_backend not in ("auto", "mooncake", "nccl", "tcp", "fake"):
            raise ConfigError(
                "--disaggregation-transfer-backend must be auto, mooncake, nccl, tcp or fake, "
                f"got {self.disaggregation_transfer_backend!r}"
            )
        if self.disaggregation_mode == "prefill" and self.disaggregation_bootstrap_port == self.port:
            raise ConfigError(
                f"--disaggregation-bootstrap-port and --port are both {self.port}; give them different ports"
            )
        if self.disaggregation_advertise_host is not None and self.disaggregation_advertise_host in ("", "0.0.0.0", "::"):
            raise ConfigError("--disaggregation-advertise-host must name an address peers can reach, "
                              f"not {self.disaggregation_advertise_host!r}")
        self._validate_tpot_budget()
        self._validate_role_switch()
        if self.disaggregation_layerwise_min_tokens < 0:
            raise ConfigError("--disaggregation-layerwise-min-tokens must be >= 0")
        if not 0.0 <= self.disaggregation_prefill_ahead_share <= 1.0:
            raise ConfigError("--disaggregation-prefill-ahead-share must be in [0, 1]")
        if not self.disaggregation_link_gbps >= 0:
            raise ConfigError("--disaggregation-link-gbps must be >= 0")
        if self.disaggregation_staging_mb is not None and self.disaggregation_staging_mb < 0:
            raise ConfigError("--disaggregation-staging-mb must be >= 0")
        if not self.disaggregation_staging_wait_ms >= 0:
            raise ConfigError("--disaggregation-staging-wait-ms must be >= 0")
        if not 0 <= self.port < 65536 or not 0 <= self.disaggregation_bootstrap_port < 65536:
            raise ConfigError("ports must be in 0..65535")
        self._validate_hicache()
        self._validate_kv_cache_dtype()
        if self.grammar_backend not in ("xgrammar", "none"):
            raise ConfigError(f"--grammar-backend must be xgrammar or none, got {self.grammar_backend!r}")
        if self.tool_call_parser not in (None, "qwen25", "llama3"):
            raise ConfigError(f"--tool-call-parser must be qwen25 or llama3, got {self.tool_call_parser!r}")
        if not self.grammar_compile_timeout_s > 0:
            raise ConfigError("--grammar-compile-timeout-s must be > 0")

    def _validate_tpot_budget(self) -> None:
        if not 0 <= self.decode_tpot_budget_ms < math.inf:
            raise ConfigError(f"--decode-tpot-budget-ms must be >= 0 (0: off), got {self.decode_tpot_budget_ms}")
        if not 0 <= self.decode_tpot_burst_ms < math.inf:
            raise ConfigError(f"--decode-tpot-burst-ms must be >= 0 (0: no saved credit), "
                              f"got {self.decode_tpot_burst_ms}")
        if self.decode_tpot_budget_ms and self.tp_size > 1:
            raise ConfigError("--decode-tpot-budget-ms needs --tp-size 1: each rank would time its own steps and "
                              "the ranks' batches would part")

    def _validate_role_switch(self) -> None:
        if not self.enable_pd_role_switch:
            return
        if not self.is_pd or self.serves_role_alone:
            raise ConfigError("--enable-pd-role-switch needs --disaggregation-mode prefill or decode with a real "
                              "transfer backend (not fake)")
        if self.tp_size > 1:
            raise ConfigError("--enable-pd-role-switch needs --tp-size 1")
        if self.disaggregation_bootstrap_port == self.port:
            raise ConfigError(f"--disaggregation-bootstrap-port and --port are both {self.port}; a server that may "
                              "become a prefill needs its own bootstrap port")

    def _validate_kv_cache_dtype(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, "
                              f"got {self.kv_cache_dtype!r}")
        fp8 = self.kv_cache_dtype.startswith("fp8")
        if fp8 and self.attention_backend == "flash_attn":
            raise ConfigError(f"--attention-backend flash_attn cannot read a KV cache in {self.kv_cache_dtype} "
                              "(FlashAttention-4 reads K and V in the model's dtype); use auto, sdpa or triton")
        if self.kv_cache_scales is not None and not fp8:
            raise ConfigError("--kv-cache-scales needs --kv-cache-dtype fp8_e4m3 or fp8_e5m2")
        if self.kv_cache_scales is not None and not os.path.isfile(self.kv_cache_scales):
            raise ConfigError(f"--kv-cache-scales {self.kv_cache_scales}: no such file")

    def _validate_hicache(self) -> None:
        choices = {
            "hicache_write_policy": ("write_through", "write_back"),
            "hicache_mem_layout": ("page_first", "layer_first"),
            "hicache_storage_prefetch_policy": ("best_effort", "wait_complete", "timeout"),
            "hicache_storage_backend": (None, "file", "mooncake"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                names = ", ".join(a for a in allowed if a)
                raise ConfigError(f"--{_flag(name)} must be one of {names}, got {getattr(self, name)!r}")
        if self.hicache_ratio <= 0 or self.hicache_size < 0 or self.hicache_storage_size < 0:
            raise ConfigError("--hicache-ratio must be positive; --hicache-size and --hicache-storage-size >= 0")
        if self.hicache_storage_backend and not self.enable_hierarchical_cache:
            raise ConfigError("--hicache-storage-backend needs --enable-hierarchical-cache")
        extra = self.hicache_extra_config
        if self.hicache_storage_backend == "mooncake" and not extra.get("master_server_address"):
            raise ConfigError(
                "--hicache-storage-backend mooncake needs master_server_address in "
                "--hicache-storage-backend-extra-config, e.g. '{\"master_server_address\": \"10.0.0.1:50051\"}'"
            )

    @property
    def hicache_extra_config(self) -> dict:
        try:
            extra = json.loads(self.hicache_storage_backend_extra_config or "{}")
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--hicache-storage-backend-extra-config is not valid JSON: {exc}") from exc
        if not isinstance(extra, dict):
            raise ConfigError("--hicache-storage-backend-extra-config must be a JSON object")
        return extra

    @property
    def is_pd(self) -> bool:
        return self.disaggregation_mode != "null"

    @property
    def serves_role_alone(self) -> bool:
        """A PD server on the fake transfer backend: no peer on either side, every request served by this role
        alone (a prefill answers with the first token, a decode decodes over pages nobody filled)."""
        return self.is_pd and self.disaggregation_transfer_backend == "fake"

    @property
    def keeps_prefix_cache(self) -> bool:
        """Whether finished requests' pages stay in a radix cache (a decode server's only with its own flag)."""
        if self.disaggregation_mode == "decode" and not self.disaggregation_decode_enable_radix_cache:
            return False
        return not self.disable_radix_cache

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    def replace(self, **changes: Any) -> "ServerArgs":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, model_path: str, **kwargs: Any) -> "ServerArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model_path=model_path, **kwargs)

    @classmethod
    def from_cli(cls, argv: list[str] | None = None) -> "ServerArgs":
        parser = build_arg_parser()
        return exit_on_config_error(parser.prog, lambda: parse_server_cli(parser, argv)[1])

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "ServerArgs":
        values = {f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)}
        return cls(**values)


def parse_server_cli(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, ServerArgs]:
    """pdserve's flags, plus SGLang's flags pdserve accepts as they are; ConfigError for anything else."""
    ns, unknown = parser.parse_known_args(argv)
    try:
        notes = check_sglang_flags(unknown)
    except UnsupportedFlag as exc:
        raise ConfigError(str(exc)) from None
    return ns, ServerArgs.from_namespace(ns).replace(sglang_flag_notes=tuple(notes))


def exit_on_config_error(prog: str, parse: Any) -> Any:
    """`parse()`, or its ConfigError as one line on stderr and exit code 2 (argparse's, without the usage)."""
    try:
        return parse()
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        sys.exit(2)


class OneLineErrorParser(argparse.ArgumentParser):
    """Raises a bad command line as ConfigError (one line) instead of printing the usage."""

    def error(self, message: str) -> Any:
        raise ConfigError(message)


def _flag(name: str) -> str:
    return name.replace("_", "-")


_HELP: dict[str, tuple[str, str]] = {
    # field: (group, help)
    "model_path": ("model", "Folder of an HF-format model (config.json, safetensors, tokenizer), or a hub id "
                            "(org/name) found in, or downloaded to, the Hugging Face cache (HF_HOME; HF_HUB_OFFLINE=1: "
                            "the cache only)."),
    "tokenizer_path": ("model", "Tokenizer folder or hub id; defaults to --model-path."),
    "revision": ("model", "Hub revision (branch, tag or commit) of a --model-path given as a hub id."),
    "tokenizer_mode": ("model", "auto (the fast Rust tokenizer when the model has one) or slow (the Python one)."),
    "chat_template": ("model", "Chat template of /v1/chat/completions: a file of Jinja text, or the template itself; "
                               "defaults to the tokenizer's."),
    "dtype": ("model", "Weight and activation dtype: auto (the checkpoint's; float32 on CPU), float32, float16, bfloat16."),
    "trust_remote_code": ("model", "Let transformers run the tokenizer code of the model's repository; the model "
                                   "itself always runs on pdserve's own code."),
    "context_length": ("model", "Longest prompt + output in tokens; defaults to the model's max_position_embeddings."),
    "served_model_name": ("model", "Model name reported by /v1/models and expected in OpenAI requests."),
    "device": ("model", "cuda, cpu or auto (cuda when present)."),
    "random_seed": ("model", "Seed for sampling of requests that give none."),
    "load_format": ("model", "auto reads the safetensors; dummy fills random weights (benchmarks)."),
    "quantization": ("model", "fp8: FP8 (E4M3) linear weights with a scale per output channel, activations "
                              "quantized per token: a bf16/fp16/fp32 checkpoint is quantized at load; an FP8 "
                              "checkpoint (quantization_config fp8 or compressed-tensors) loads as it is, with or "
                              "without this flag. compressed-tensors: only names such a checkpoint's method."),
    "quantize_lm_head": ("model", "With FP8 weights, the LM head in FP8 too (by default it stays in the model dtype, "
                                  "as the embeddings and norms do)."),
    "max_total_tokens": ("memory", "KV-cache capacity in tokens; overrides --mem-fraction-static."),
    "mem_fraction_static": ("memory", "Fraction of device memory for weights plus KV cache."),
    "chunked_prefill_size": ("memory", "Longest prefill chunk in tokens; longer prompts are prefilled in chunks."),
    "max_running_requests": ("memory", "Most requests decoding at once."),
    "max_prefill_tokens": ("memory", "Token budget of one prefill batch."),
    "page_size": ("memory", "Tokens per KV-cache page."),
    "kv_cache_dtype": ("memory", "KV-cache storage: auto (the model's dtype), bf16 / bfloat16, or fp8_e4m3 / "
                                 "fp8_e5m2 (one byte per value: twice the tokens in the same memory, half the bytes "
                                 "per PD handoff), quantized with per-layer K and V scales: the checkpoint's "
                                 "k_scale/v_scale tensors, else --kv-cache-scales, else 1.0."),
    "kv_cache_scales": ("memory", "JSON file of per-layer FP8 KV scales, written by python -m "
                                  "pdserve.tools.calibrate_kv_scales; used where the checkpoint has none."),
    "disable_radix_cache": ("memory", "Turn off prefix reuse through the radix cache."),
    "schedule_conservativeness": ("memory", "Scale of the decode-token reservation used at admission (>1 admits fewer)."),
    "enable_hierarchical_cache": ("hicache", "Keep KV pages evicted from the device in host memory (and storage) and load them back on a prefix hit (off with --disable-radix-cache and on the decode role)."),
    "hicache_ratio": ("hicache", "Host KV pool size as a multiple of the device KV pool."),
    "hicache_size": ("hicache", "Host KV pool size in GB; overrides --hicache-ratio when > 0."),
    "hicache_write_policy": ("hicache", "write_through (copy pages to the host as they enter the cache) or write_back (on device eviction)."),
    "hicache_mem_layout": ("hicache", "Host pool layout: page_first (each page one contiguous block: one copy per run of host pages; the fastest) or layer_first (like the device pool: one copy per K/V layer slice of a run)."),
    "hicache_storage_backend": ("hicache", "Tier 3 shared by instances: file or mooncake (none when not given)."),
    "hicache_storage_backend_extra_config": ("hicache", "JSON settings of the storage backend (mooncake: master_server_address, ...; prefetch_timeout_base, prefetch_timeout_per_ki_token)."),
    "hicache_storage_dir": ("hicache", "Directory of the file backend (env SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR; default /tmp/hicache)."),
    "hicache_storage_size": ("hicache", "Bound of the file backend in GB, LRU-evicted past it (0: unbounded)."),
    "hicache_storage_prefetch_policy": ("hicache", "How long admission waits for a storage prefetch: best_effort, wait_complete or timeout."),
    "attention_backend": ("kernels", "auto, flash_attn, sdpa, triton or torch_native. auto: flash_attn (FlashAttention-4 prefill, Triton decode) on a Hopper or newer GPU where flash-attn-4 is installed, else sdpa on CUDA, torch_native elsewhere; a backend that cannot serve the model falls back to torch_native with a log line naming why."),
    "cuda_graph_max_bs": ("kernels", "Largest decode batch captured in a CUDA graph."),
    "disable_cuda_graph": ("kernels", "Run decode eagerly."),
    "grammar_backend": ("structured", "Constrained decoding (json_schema, regex, ebnf, structural_tag, "
                                      "response_format, tool_choice required/named): xgrammar (needs the xgrammar "
                                      "package) or none (such requests get a 400)."),
    "grammar_compile_timeout_s": ("structured", "A request whose grammar takes longer to compile fails with a 400."),
    "grammar_any_whitespace": ("structured", "Let JSON output put any whitespace between tokens (default: one "
                                             "fixed separator, so a weak model cannot fill max_tokens with blanks)."),
    "tool_call_parser": ("structured", "How tool_choice auto finds tool calls in the output: qwen25 "
                                       "(<tool_call>{...}</tool_call> blocks, Qwen 2.5/3 and Hermes) or llama3 (the "
                                       "output is JSON calls, {\"name\", \"parameters\"}, after an optional "
                                       "<|python_tag|>); default: llama3 where the chat template uses <|python_tag|>, "
                                       "else qwen25."),
    "disable_overlap_schedule": ("kernels", "Do not prepare the next batch while the GPU runs the current one."),
    "skip_server_warmup": ("kernels", "Report ready without the warm-up pass that compiles (or loads from the on-disk cache) the kernels of the prompt-length buckets and the samplers."),
    "kernel_tuning_cache_dir": ("kernels", "Directory where the skinny-GEMM and FP8 tuners keep their choices across starts (JSON, one file per GPU name, driver, CUDA, torch and Triton version; entries by shape and rows), and Triton its compiled kernels (triton/, unless TRITON_CACHE_DIR is set). Unset: env PDSERVE_TUNING_CACHE_DIR, else $XDG_CACHE_HOME/pdserve/tuning (~/.cache/pdserve/tuning); none: off."),
    "tp_size": ("parallelism", "Tensor-parallel size (alias --tensor-parallel-size)."),
    "base_gpu_id": ("parallelism", "First GPU index this server uses; rank r of --tp-size uses base + r."),
    "nccl_port": ("parallelism", "Port on 127.0.0.1 where the tensor-parallel ranks meet (default: a free one)."),
    "host": ("http", "Address to bind; 127.0.0.1 unless told otherwise."),
    "port": ("http", "HTTP port."),
    "api_key": ("http", "Require 'Authorization: Bearer KEY' on every route but /health."),
    "log_level": ("http", "debug, info, warning or error."),
    "shutdown_drain_timeout_s": ("http", "On SIGTERM or Ctrl-C: seconds the requests in flight get to finish while new ones get 503; the rest then end with an error (in-band on a stream). A second signal ends them at once."),
    "log_requests": ("http", "Log each request's id and token counts as it arrives and finishes."),
    "log_requests_level": ("http", "With --log-requests: 0 or 1 logs ids and counts, 2 also the prompt and output "
                                   "text cut to 2048 characters, 3 the whole text."),
    "stream_interval": ("http", "Streamed responses send an event every N output tokens (and at the end)."),
    "request_body_timeout_s": ("http", "Seconds a client may take to send a request body; a slower one gets 408."),
    "max_batch_items": ("http", "Most prompts in one batched request."),
    "request_timeline_log": ("http", "Append one JSON line per finished request to this file: its rid, role, arrival "
                                     "time and the seconds from arrival to each stage it passed (python -m "
                                     "pdserve.bench.timeline merges the router's and the servers' logs)."),
    "disaggregation_mode": ("disaggregation", "null (colocated), prefill or decode."),
    "disaggregation_bootstrap_port": ("disaggregation", "Prefill: port of the bootstrap server."),
    "disaggregation_transfer_backend": ("disaggregation", "KV transfer: auto (mooncake if importable, else tcp), mooncake, nccl, tcp, fake (no peer: the role serves every request alone, for benchmarking one role; see docs/pd.md)."),
    "disaggregation_ib_device": ("disaggregation", "RDMA device(s) for mooncake, e.g. mlx5_0 or mlx5_0,mlx5_1."),
    "disaggregation_advertise_host": ("disaggregation", "The address this server gives its PD peers (control channel, KV transfer engine) instead of --host: for NAT or several NICs. Unset: --host, or for 0.0.0.0 the address of the interface that routes to the peer."),
    "num_reserved_decode_tokens": ("disaggregation", "Decode: KV tokens reserved per request for its future output."),
    "disaggregation_bootstrap_timeout": ("disaggregation", "Seconds a request may wait for its peer's handshake."),
    "disaggregation_waiting_timeout": ("disaggregation", "Seconds the decode side waits for the KV to arrive."),
    "disaggregation_heartbeat_interval": ("disaggregation", "Seconds between decode heartbeats to each prefill bootstrap server."),
    "disaggregation_heartbeat_failures": ("disaggregation", "Missed heartbeats after which a prefill peer is declared dead."),
    "disaggregation_fence_timeout": ("disaggregation", "Decode: seconds at most that the pages of a failed handoff stay quarantined while its prefill may still write them (a frozen prefill resumes and writes late); they come back earlier once the prefill confirms the abort or its bootstrap port refuses connections."),
    "disaggregation_staging_mb": ("disaggregation", "Decode: MiB of receive staging: a handoff whose prefill runs the same TP size gets a slot, the prefill writes its KV there packed (two spans per layer, whatever the pages' placement) and the decode unpacks it into the pages before it commits the request; a handoff finding no room is written into its pages. Default: an eighth of the KV pool, within 1 to 2048 MiB, given up with a warning when it cannot be allocated or registered; 0: no staging."),
    "disaggregation_staging_wait_ms": ("disaggregation", "Prefill: how long a request's computed KV waits for the decode's answer to its receive-staging ask (asked when the request starts computing; the decode answers once its arena has room) before it is written into the decode's pages instead. The answer is normally there before the forward ends; a full arena makes it wait, and a direct write of scattered pages costs tens of ms (a 2k-token llama-3.1-8b KV, two H200s: 33 ms). Default 50."),
    "disaggregation_link_gbps": ("disaggregation", "Prefill: the bandwidth of its link to the decode servers, GB/s (a torch copy GPU to GPU; 0: unknown), for the metric pdserve_kv_transfer_link_efficiency."),
    "disaggregation_layerwise_min_tokens": ("disaggregation", "Prefill: a chunk of at least this many tokens pushes its KV layer by layer while the forward runs (0: only after the chunk)."),
    "disaggregation_prefill_ahead_share": ("disaggregation", "Prefill: the share of the KV pool that prompts may claim while they compute before their decode's page list came (0: a prompt waits for its page list before it is queued)."),
    "disaggregation_secret": ("disaggregation", "Cluster secret shared by prefill, decode and router (else env PDSERVE_DISAGGREGATION_SECRET, else --api-key): HMAC on control messages, KV writes, bootstrap routes and the router's bootstrap fields."),
    "disaggregation_enable_kv_checksum": ("disaggregation", "Decode: ask the prefill for a checksum of each request's KV pages (per KV head, computed on the device) and fail the request (502) on a mismatch."),
    "decode_local_prefill_chunk_size": ("disaggregation", "Decode: most prompt tokens of a locally prefilled request (one the router sent without a prefill peer) in one step; such steps alternate with decode steps, so the ITL of running requests grows by at most one chunk's forward."),
    "decode_tpot_budget_ms": ("disaggregation", "Mean inter-token time (ms) the running requests keep while prompts are prefilled beside them: prefill chunks are sized online from the measured step times so that they fit (Sarathi-style time slicing; a decode server's local prefills, and a colocated server's too). Replaces the alternation of --decode-local-prefill-chunk-size. 0: off."),
    "decode_tpot_burst_ms": ("disaggregation", "With --decode-tpot-budget-ms: the most prefill time (ms) one gap between two decode steps may take from saved credit. A lightly loaded server saves the credit its decode steps leave unused, up to this much, and prefills a long prompt at full speed in one gap; each running request's mean inter-token time stays within the budget, since a request may spend only what it banked while it ran (plus the steady credit of four budgets). /load reports the saved credit (local_prefill_burst_s) for the router's --local-prefill-by-load. 0 (the default): no saved credit beyond four budgets; 250 lets an H200 prefill a 7k-token prompt in one gap (lower TTFT tail at light load, less goodput under load, docs/benchmarks.md)."),
    "enable_pd_role_switch": ("disaggregation", "Let this PD server change role between prefill and decode without a restart (POST /pd_role_switch, or the router's --balance-roles): it drains, then takes the other role on the same weights and KV pool. Give it its own --disaggregation-bootstrap-port even when it starts as decode."),
    "disaggregation_decode_enable_radix_cache": ("disaggregation", "Decode: keep finished requests' prompt and output pages in a radix cache of its own; a request whose prefix this server already holds receives only the missing pages from the prefill."),
}

_ALIASES = {"tp_size": ["--tensor-parallel-size"], "model_path": ["--model"]}


def build_arg_parser(prog: str = "python -m pdserve.launch_server") -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog=prog, description="pdserve: an LLM server with prefill/decode disaggregation.",
        epilog="SGLang's other launch flags are accepted where pdserve already behaves as they ask (e.g. "
               "--enable-metrics, --dp-size 1) and otherwise refused in one line naming the missing feature.")
    groups: dict[str, argparse._ArgumentGroup] = {}
    defaults = ServerArgs.__dataclass_fields__
    for f in fields(ServerArgs):
        if f.metadata.get("cli", True) is False:
            continue
        group_name, help_text = _HELP[f.name]
        group = groups.get(group_name) or groups.setdefault(group_name, parser.add_argument_group(group_name))
        names = [f"--{_flag(f.name)}", *_ALIASES.get(f.name, [])]
        default = defaults[f.name].default
        if f.name == "model_path":
            group.add_argument(*names, dest=f.name, required=True, help=help_text)
        elif isinstance(default, bool):
            group.add_argument(*names, dest=f.name, action="store_true", help=help_text)
        else:
            kind = _field_type(f)
            group.add_argument(*names, dest=f.name, type=kind, default=default, help=f"{help_text} (default: {default})")
    return parser


def _field_type(f: dataclasses.Field) -> type:
    text = str(f.type)
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str
