"""SGLang's launch flags that pdserve has no field of its own for, in one table.

Each SGLang flag is implemented (a `ServerArgs` field), accepted because pdserve already behaves so (a debug line
says why), accepted at the values that ask for nothing pdserve lacks, or refused in one line naming the missing
feature. `tests/server/test_sglang_compat.py` checks the table against SGLang's flag names.
"""

from __future__ import annotations


class UnsupportedFlag(ValueError):
    """An SGLang flag (or value) asking for a feature pdserve does not implement, or a flag no one knows."""


# flag: why pdserve already behaves as asked, whatever the value
ALREADY_SO = {
    "enable-metrics": "metrics are always on at /metrics",
    "enable-metrics-for-all-schedulers": "the metrics at /metrics cover every scheduler rank",
    "log-level-http": "HTTP access lines follow --log-level (shown at debug)",
    "decode-log-interval": "the scheduler logs its throughput at its own interval",
    "disable-custom-all-reduce": "tensor parallelism always uses NCCL's all-reduce",
}

# flag: (the values at which pdserve behaves as asked, the feature any other value needs)
NEUTRAL_VALUES = {
    "dp-size": (("1",), "data parallelism (run one server per replica behind the router)"),
    "data-parallel-size": (("1",), "data parallelism (run one server per replica behind the router)"),
    "pp-size": (("1",), "pipeline parallelism"),
    "pipeline-parallel-size": (("1",), "pipeline parallelism"),
    "ep-size": (("1",), "expert parallelism"),
    "expert-parallel-size": (("1",), "expert parallelism"),
    "ep": (("1",), "expert parallelism"),
    "nnodes": (("1",), "one server spanning several machines"),
    "node-rank": (("0",), "one server spanning several machines"),
    "schedule-policy": (("fcfs",), "scheduling policies other than first-come first-served"),
    "tokenizer-worker-num": (("1",), "several tokenizer processes"),
    "detokenizer-worker-num": (("1",), "several detokenizer processes"),
}

# feature pdserve does not implement: the SGLang flags that ask for it
REFUSED = {
    "YAML config files (pass the flags on the command line)": "config",
    "reasoning-content parsing": "reasoning-parser",
    "LoRA adapters": """
        enable-lora lora-paths enable-lora-overlap-loading experts-shared-outer-loras lora-backend lora-drain-wait-threshold
        lora-eviction-policy lora-strict-loading lora-target-modules lora-use-virtual-experts max-loaded-loras
        max-lora-chunk-size max-lora-rank max-loras-per-batch
    """,
    "speculative decoding": """
        speculative-algorithm enable-multi-layer-eagle spec-trace-dir speculative-accept-threshold-acc
        speculative-accept-threshold-single speculative-adaptive speculative-adaptive-config
        speculative-attention-mode speculative-dflash-block-size speculative-domino-candidate-pool-size
        speculative-draft-attention-backend speculative-draft-kv-cache-dtype speculative-draft-load-format
        speculative-draft-model speculative-draft-model-path speculative-draft-model-quantization
        speculative-draft-model-revision speculative-draft-sink-size speculative-draft-window-size
        speculative-dsa-topk-backend speculative-dspark-align-verify-tokens-to-graph-tier
        speculative-dspark-block-size speculative-dspark-confidence-sts-path speculative-dspark-sps-table-path
        speculative-eagle-topk speculative-enable-w4a4-mxfp4-megamoe speculative-moe-a2a-backend
        speculative-moe-runner-backend speculative-ngram-capacity speculative-ngram-external-corpus-max-tokens
        speculative-ngram-external-corpus-path speculative-ngram-external-sam-budget
        speculative-ngram-match-type speculative-ngram-max-bfs-breadth speculative-ngram-max-trie-depth
        speculative-ngram-min-bfs-breadth speculative-num-draft-tokens speculative-num-steps
        speculative-token-map speculative-use-block-verification speculative-use-rejection-sampling
        uno-lora-path
    """,
    "multimodal input": """
        enable-multimodal allowed-media-domains disable-fast-image-processor enable-broadcast-mm-inputs-process
        enable-mm-global-cache enable-prefix-mm-cache image-processor-backend limit-mm-data-per-request
        media-url-max-file-size-mb mm-attention-backend mm-enable-dp-encoder mm-feature-transport
        mm-global-cache-backend mm-io-worker-num mm-preprocess-cache-size-mb mm-process-config
        mm-processor-worker-num trust-mm-content-hashes
    """,
    "data, pipeline, expert or context parallelism (pdserve has tensor parallelism: --tp-size)": """
        attention-context-parallel-size attention-data-parallel-size attn-cp-size attn-dp-size cp-strategy
        dcp-comm-backend dcp-replicate-q-proj dcp-size decode-context-parallel-size disable-attn-tp-gather
        dist-init-addr dist-timeout dwdp-size elastic-ep-initial-size elastic-ep-join-rank-offset
        enable-attn-tp-input-scattered enable-cp-decode-attn-tp enable-dense-mlp-attn-tp
        enable-dp-attention-local-control-broadcast enable-dp-lm-head enable-dsa-cache-layer-split
        enable-kv-cache-sharding enable-layernorm-sp enable-megamoe-for-layernorm-sp enable-p2p-check
        enable-prefill-cp enable-shared-experts-attn-tp enable-tp-lm-head-all-to-all gated-launch-port
        load-balance-method max-ep-size moe-data-parallel-size moe-dense-tp-size moe-dp-size nccl-init-addr
        pp-async-batch-depth pp-max-micro-batch-size shared-experts-tp-size
    """,
    "SGLang's scheduler controls (priorities, prefill delayer, queue limits, hybrid-model memory)": """
        abort-on-priority-when-disabled c128-page-size default-priority-value disable-chunked-prefix-cache
        disable-hybrid-swa-memory disable-priority-preemption enable-dynamic-chunking enable-prefill-delayer
        enable-priority-scheduling mamba-full-memory-ratio max-mamba-cache-size max-queued-requests
        min-free-slots-delay num-continuous-decode-steps prefill-decode-interval prefill-decode-interval-min-bs
        prefill-delayer-forward-passes-buckets prefill-delayer-max-delay-ms prefill-delayer-max-delay-passes
        prefill-delayer-queue-min-ratio prefill-delayer-token-usage-low-watermark
        prefill-delayer-wait-seconds-buckets prefill-max-requests prefill-only-disable-kv-cache
        priority-scheduling-preemption-threshold retraction-policy schedule-low-priority-values-first
        scheduler-recv-interval swa-full-tokens-ratio swa-prefix-tails
    """,
    "SGLang's serving extras (SSL, gRPC, HTTP/2, tokenizer workers, sessions, response store)": """
        admin-api-key allow-auto-truncate asr-max-buffer-seconds asr-max-concurrent-sessions batch-notify-size
        completion-template constrained-json-disable-any-whitespace constrained-json-max-whitespace-cnt
        constrained-json-whitespace-pattern default-chat-template-kwargs disable-tokenizer-batch-decode
        dynamic-batch-tokenizer-batch-size dynamic-batch-tokenizer-batch-timeout enable-cache-report
        enable-dynamic-batch-tokenizer enable-http-worker-reuseport enable-http2 enable-response-store
        enable-ssl-refresh enable-streaming-session enable-strict-thinking enable-tokenizer-batch-encode
        fastapi-root-path file-storage-path grpc-mode grpc-port grpc-response-timeout-secs hf-chat-template-name
        http2-initial-connection-window-size http2-max-concurrent-streams incremental-streaming-output
        preferred-sampling-params return-input-ids return-output-ids sampling-defaults sidecar sidecar-args
        skip-tokenizer-init smg-grpc-mode ssl-ca-certs ssl-certfile ssl-keyfile ssl-keyfile-password
        stream-response-default-include-usage strip-thinking-cache tokenizer-backend tool-server
        trust-request-chat-template warmups weight-version
    """,
    "SGLang's kernel, CUDA-graph, MoE, offload and torch.compile tuning": """
        bf16-gemm-backend boundary-reduction context-bucket cpu-offload-gb cuda-graph-backend-decode
        cuda-graph-backend-prefill cuda-graph-bs-decode cuda-graph-bs-prefill cuda-graph-config
        cuda-graph-max-bs-decode cuda-graph-max-bs-prefill cuda-graph-max-seq-len-prefill
        cuda-graph-prefill-max-context debug-cuda-graph decode-attention-backend deepep-config
        deepep-dispatcher-output-dtype deepep-mode deepep-v2-mode disable-aiter-allreduce-fusion-in-decode
        disable-aiter-allreduce-fusion-in-prefill disable-cuda-graph-padding disable-decode-cuda-graph
        disable-flashinfer-autotune disable-flashinfer-cutlass-moe-fp4-allgather disable-outlines-disk-cache
        disable-prefill-cuda-graph disable-shared-experts-fusion dllm-algorithm dllm-algorithm-config dllm-fdfo
        dsa-decode-backend dsa-paged-mqa-logits-backend dsa-prefill-backend dsa-topk-backend dsa-triton-union
        dsv4-attn-backend dsv4-prefill-backend elastic-ep-backend elastic-ep-join-mode elastic-ep-scale-timeout
        enable-aiter-allreduce-fusion enable-amd-monokernel enable-cudagraph-gc enable-custom-logit-processor
        enable-decoder-swa-bounded-replay enable-deepseek-v4-fp4-indexer enable-deterministic-inference
        enable-dp-attention enable-draft-weights-cpu-backup enable-dsa-fused-indexer
        enable-elastic-expert-backup enable-encoder-swa-bounded-replay enable-eplb
        enable-flashinfer-allreduce-fusion enable-fp32-lm-head enable-fused-moe-sum-all-reduce
        enable-fused-qk-norm-rope enable-int8-mamba-checkpoint enable-layerwise-nvtx-marker
        enable-lean-attention enable-linear-replayssm enable-linear-replayssm-spec
        enable-mamba-cache-stochastic-rounding enable-memory-saver enable-mis enable-mixed-chunk enable-mscclpp
        enable-nccl-nvls enable-nvidia-megakernel enable-paged-experts enable-precise-embedding-interpolation
        enable-profile-cuda-graph enable-quant-communications enable-return-aux-hidden-states
        enable-return-hidden-states enable-return-indexer-topk enable-return-routed-experts
        enable-scattered-sconv enable-single-batch-overlap enable-symm-mem enable-tf32-matmul
        enable-torch-compile enable-torch-compile-debug-mode enable-torch-symm-mem enable-two-batch-overlap
        enable-w4a4-mxfp4-megamoe enable-waterfill enable-watermark enable-weights-cpu-backup
        enforce-disable-flashinfer-allreduce-fusion enforce-shared-experts-fusion ep-dispatch-algorithm
        ep-num-redundant-experts eplb-algorithm eplb-min-rebalancing-utilization-threshold
        eplb-rebalance-layers-per-chunk eplb-rebalance-num-iterations expert-balancedness-report-mode
        expert-distribution-recorder-buffer-size expert-distribution-recorder-mode flashinfer-a2a-dispatch-type
        flashinfer-allreduce-fusion-backend flashinfer-autotune-skip-ops flashinfer-mla-disable-ragged
        flashinfer-mxfp4-moe-precision fp4-gemm-backend fp8-gemm-backend fuseep-mode init-expert-location
        int8-mamba-ckpt-size kt-cpuinfer kt-max-deferred-experts-per-token kt-method kt-num-gpu-experts
        kt-threadpool-count kt-weight-path kv-canary-real-data linear-attn-backend linear-attn-decode-backend
        linear-attn-prefill-backend linear-attn-verify-backend linear-replayssm-cache-len mamba-backend
        mamba-cache-philox-rounds mamba-max-states-per-path mamba-radix-cache-strategy mamba-ssm-dtype
        mamba-track-interval moe-a2a-backend moe-runner-backend monokernel-backend mooncake-ib-device
        offload-group-size offload-mode offload-num-in-group offload-prefetch-step paged-experts-num-resident
        ple-offload-backend ple-offload-dir ple-offload-embedding pre-warm-nccl prefill-attention-backend
        prefill-kv-cache-dequant-dtype return-aux-hidden-state-layer-ids return-hidden-states-mode
        rl-on-policy-target sampling-backend sampling-mask-max-tokens tbo-token-distribution-threshold
        torch-compile-max-bs triton-attention-num-kv-splits triton-attention-reduce-in-fp32
        triton-attention-split-tile-size watermark-config
    """,
    "SGLang's tracing, dumps and extra metric exports (pdserve serves Prometheus metrics at /metrics)": """
        bucket-e2e-request-latency bucket-inter-token-latency bucket-time-to-first-token crash-dump-folder
        debug-tensor-dump-input-file debug-tensor-dump-layers debug-tensor-dump-output-folder
        enable-forward-pass-metrics enable-mfu-metrics enable-request-time-stats-logging enable-trace
        export-metrics-to-file export-metrics-to-file-dir extra-metric-labels forward-hooks
        forward-pass-metrics-ipc-name forward-pass-metrics-worker-id gc-warning-threshold-secs
        generation-tokens-buckets grpc-http-sidecar-port kv-canary kv-canary-sweep-interval kv-events-config
        load-publish-endpoint load-snapshot-publish-interval log-requests-format log-requests-target
        msprobe-dump-config otlp-service-name otlp-traces-endpoint prompt-tokens-buckets show-time-cost
        smg-http-sidecar-port tokenizer-metrics-allowed-custom-labels tokenizer-metrics-custom-labels-header
        trace-modules uvicorn-access-log-exclude-prefixes
    """,
    "SGLang's model-loading options (quantization, remote weights, checksums)": """
        checkpoint-engine-wait-weights-before-ready custom-weight-loader decrypted-config-file
        decrypted-draft-config-file delete-ckpt-after-loading download-dir engine-info-bootstrap-port
        is-embedding json-model-override-args model-checksum model-config-parser model-impl
        model-loader-extra-config modelexpress-config modelopt-checkpoint-restore-path
        modelopt-checkpoint-save-path modelopt-export-path modelopt-quant qsa-indexer-dtype
        quantization-param-path quantize-and-serve remote-instance-weight-loader-backend
        remote-instance-weight-loader-seed-instance-ip remote-instance-weight-loader-seed-instance-service-port
        remote-instance-weight-loader-send-weights-group-ports
        remote-instance-weight-loader-start-seed-via-transfer-engine rl-quant-profile startup-weight-load-mode
        weight-cache-mode weight-cache-socket weight-cache-timeout weight-loader-disable-mmap
        weight-loader-drop-cache-after-load weight-loader-prefetch-checkpoints
        weight-loader-prefetch-num-threads
    """,
    "SGLang's encoder, PD-multiplexing and decode-offload disaggregation options": """
        decoupled-spec-bind-endpoint decoupled-spec-connect-endpoints decoupled-spec-rank decoupled-spec-role
        disaggregation-decode-allocation-policy disaggregation-decode-enable-offload-kvcache
        disaggregation-decode-extra-slots disaggregation-decode-host-receive-threshold
        disaggregation-decode-polling-interval disaggregation-decode-retraction-backup
        enable-adaptive-dispatch-to-encoder enable-pdmux encoder-bootstrap-port
        encoder-only encoder-register-urls encoder-transfer-backend encoder-urls language-model-only
        language-only optimistic-prefill-attempts pdmux-config-path sm-group-num
    """,
    "SGLang's other cache tiers and layouts (pdserve has --enable-hierarchical-cache)": """
        enable-flexkv enable-hicache enable-hisparse enable-linker-mla-dedup enable-lmcache
        enable-page-major-kv-layout enable-session-radix-cache enable-unified-cache-external-linker
        enable-unified-memory flexkv-config-file hicache-host-memory-fraction hicache-host-memory-mode
        hicache-io-backend hicache-storage-prefetch-retry-max-attempts
        hicache-storage-prefetch-retry-poll-interval hierarchical-sparse-attention-extra-config hisparse-config
        lmcache-config-file radix-cache-backend radix-eviction-policy radix-eviction-policy-config
        unified-cache-external-linker-backend unified-cache-external-linker-config
    """,
    "SGLang's watchdog, NUMA, Ray and GC controls": """
        gc-threshold gpu-id-step mlx-enable-sampling numa-node sleep-on-idle soft-watchdog-timeout use-ray
        watchdog-timeout
    """,
}
REFUSED_FLAGS = {flag: feature for feature, flags in REFUSED.items() for flag in flags.split()}


def check_sglang_flags(words: list[str]) -> list[str]:
    """Check the command-line words argparse did not know; the notes of the flags accepted as they are, or
    UnsupportedFlag naming the first refused one."""
    return [_check_flag(flag, value) for flag, value in _flag_values(words)]


def _flag_values(words: list[str]) -> list[tuple[str, str | None]]:
    """(flag without dashes, value or None) for `--flag=value`, `--flag value` and a bare `--flag`."""
    pairs: list[tuple[str, str | None]] = []
    index = 0
    while index < len(words):
        word = words[index]
        if not word.startswith("--"):
            raise UnsupportedFlag(f"unrecognized argument {word!r} (see --help)")
        name, has_value, value = word[2:].partition("=")
        if not has_value and index + 1 < len(words) and not words[index + 1].startswith("--"):
            index += 1
            value, has_value = words[index], "="
        pairs.append((name, value if has_value else None))
        index += 1
    return pairs


def _check_flag(name: str, value: str | None) -> str:
    shown = f"--{name}" if value is None else f"--{name} {value}"
    if name in ALREADY_SO:
        return f"{shown}: accepted, {ALREADY_SO[name]}"
    if name in NEUTRAL_VALUES:
        values, feature = NEUTRAL_VALUES[name]
        if value is not None and value.lower() in values:
            return f"{shown}: accepted, pdserve behaves so"
        raise UnsupportedFlag(f"{shown} needs {feature}, which pdserve does not implement")
    if name in REFUSED_FLAGS:
        raise UnsupportedFlag(f"{shown} needs {REFUSED_FLAGS[name]}, which pdserve does not implement")
    raise UnsupportedFlag(f"unrecognized argument --{name} (see --help)")
