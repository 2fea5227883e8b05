"""Owns the model, the KV pool and the attention backend; runs one forward pass for a ForwardBatch."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from pdserve.attention import create_backend, resolve_backend_name
from pdserve.attention.base import ForwardContext
from pdserve.config import ServerArgs
from pdserve.distributed.tensor_parallel import init_tp_group, kv_heads_per_rank
from pdserve.engine.cuda_graph import CudaGraphRunner, capture_sizes
from pdserve.engine.sampler import Sampler, SamplingTensors
from pdserve.forward_batch import ForwardBatch
from pdserve.kernels import tuning_cache
from pdserve.kernels.parallel_compile import shared_workers
from pdserve.kernels.skinny import SkinnyTuner
from pdserve.layers.linear import ColumnParallelLinear, GateUpLinear, ParallelLMHead, QKVLinear, RowParallelLinear
from pdserve.mem_cache.kv_pool import KVLayout, KVPool
from pdserve.mem_cache.kv_quant import KVScales, cuda_support_problem, is_fp8, kv_cache_dtype
from pdserve.models.kv_scales import resolve_kv_scales
from pdserve.models.loader import checkpoint_files, load_model
from pdserve.models.model_config import ModelConfig, resolve_dtype
from pdserve.quantization.fp8 import tune_fp8_rows

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_TOKENS = 65536


def resolve_device(name: str, base_gpu_id: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was given but no CUDA device is visible")
        return torch.device("cuda", base_gpu_id)
    if name == "cpu":
        return torch.device("cpu")
    raise ValueError(f"--device must be auto, cuda or cpu, got {name!r}")


class ModelRunner:
    def __init__(self, args: ServerArgs, model_config: ModelConfig):
        self.args = args
        self.model_config = model_config = model_config.with_quantization(args.quantization, args.quantize_lm_head)
        model_config.check_tp_size(args.tp_size)
        self.device = resolve_device(args.device, args.base_gpu_id + args.tp_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            use_compute_stream(self.device)
            tuning_cache.configure(args.kernel_tuning_cache_dir)  # before any compile: it sets TRITON_CACHE_DIR
        self.tp = init_tp_group(args.tp_size, args.tp_rank, args.nccl_port, self.device)
        self.dtype = resolve_dtype(args.dtype, model_config.checkpoint_dtype, self.device)
        self.context_len = model_config.context_len(args.context_length)
        torch.manual_seed(args.random_seed)
        self.model = load_model(args.model_path, model_config, self.dtype, self.device, args.load_format == "dummy",
                                self.tp)
        self.kv_dtype = kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        capability = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
        if capability is not None and (problem := cuda_support_problem(self.kv_dtype, capability)) is not None:
            raise RuntimeError(problem)
        self.pool = KVPool(self._kv_layout(), self.device)
        self.backend_name = resolve_backend_name(args.attention_backend, self.device.type, model_config.head_dim,
                                                 args.page_size, capability, dtype_name(self.dtype),
                                                 dtype_name(self.kv_dtype))
        self.backend = create_backend(
            self.backend_name,
            num_heads=model_config.num_heads // args.tp_size, num_kv_heads=self.num_kv_heads,
            head_dim=model_config.head_dim,
            page_size=args.page_size, device=self.device, dtype=self.dtype, max_context_len=self.context_len,
        )
        self.forward_observers: list[Callable[[ForwardBatch], None]] = []  # each sees every batch before it runs
        self.sampler = Sampler(self.device, args.random_seed)
        self.graph_runner = None
        if self.device.type == "cuda":
            with shared_workers():  # the Triton kernels of the tuners and the graphs compiled ahead in one pool
                self._tune_and_capture(args)

        logger.info(
            "TP rank %d of %d: model %s on %s (%s), attention %s, KV cache %d tokens (%s) in pages of %d",
            args.tp_rank, args.tp_size, model_config.architecture, self.device, dtype_name(self.dtype),
            self.backend_name, self.pool.layout.num_slots, dtype_name(self.kv_dtype), args.page_size,
        )

    def _tune_and_capture(self, args: ServerArgs) -> None:
        """The linear layers' kernel choices for the decode batch sizes the graphs run (eager: the smallest), then
        the decode CUDA graphs."""
        graph_bs = min(args.cuda_graph_max_bs, args.max_running_requests)
        rows = range(1, 9) if args.disable_cuda_graph else capture_sizes(graph_bs)
        linears = self._linear_layers()
        SkinnyTuner(rows).tune([m.weight for m in linears if m.weight_scale is None])
        self._tune_fp8_rows(rows, [m for m in linears if m.weight_scale is not None])
        if self.backend.supports_cuda_graph and not args.disable_cuda_graph:
            self.graph_runner = CudaGraphRunner(self.model, self.backend, self.pool, graph_bs, self.context_len,
                                                self.device, self.sampler.sample_temperature_only)
            self.sampler.reseed(args.random_seed)  # the capture's warm-up runs drew

    def _tune_fp8_rows(self, rows: list[int], linears: list[nn.Module]) -> None:
        """The FP8 rows kernel's choices for the FP8 layers (gate_up also with its SiLU-and-mul, qkv with the
        rotary and the KV store after it, o and down also for rows with their amax in parts)."""
        if linears:
            tune_fp8_rows(rows, [(m.weight, m.weight_scale) for m in linears], self.dtype,
                          [m.weight for m in linears if isinstance(m, GateUpLinear)],
                          [(m.weight, m.num_q_heads, m.num_kv_heads, m.head_dim) for m in linears
                           if isinstance(m, QKVLinear) and m.fused_rotary], self.kv_dtype,
                          [(m.weight, m.amax_part) for m in linears
                           if isinstance(m, RowParallelLinear) and m.amax_part is not None])

    def _linear_layers(self) -> list[nn.Module]:
        linears = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
        return [m for m in self.model.modules() if isinstance(m, linears)]

    @property
    def num_kv_heads(self) -> int:
        """KV heads of this rank's pool."""
        return kv_heads_per_rank(self.model_config.num_kv_heads, self.args.tp_size)

    def _kv_scales(self) -> KVScales | None:
        """An FP8 pool's per-layer scales (models/kv_scales.py says where they come from); None for any other."""
        if not is_fp8(self.kv_dtype):
            return None
        args = self.args
        checkpoint = [] if args.load_format == "dummy" else checkpoint_files(Path(args.model_path))
        return resolve_kv_scales(self.model_config.num_layers, checkpoint, args.kv_cache_scales, args.kv_cache_dtype)

    def _kv_layout(self) -> KVLayout:
        cfg, ps = self.model_config, self.args.page_size
        layout = KVLayout(cfg.num_layers, self.num_kv_heads, cfg.head_dim, ps, 2, self.kv_dtype, self._kv_scales())
        if self.args.max_total_tokens is not None:
            tokens = self.args.max_total_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * self.args.mem_fraction_static - (total - free)
            tokens = self.tp.min_over_ranks(tokens_in_budget(budget, layout))
            if tokens < 16 * ps:
                raise RuntimeError(
                    f"--mem-fraction-static {self.args.mem_fraction_static} leaves room for only {max(tokens, 0)} "
                    "KV tokens after the weights; raise it or give --max-total-tokens"
                )
        else:
            tokens = CPU_DEFAULT_KV_TOKENS
        num_pages = tokens // ps + 1  # + the reserved padding page 0
        return dataclasses.replace(layout, num_pages=num_pages)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in the model's dtype (whoever needs float32 casts);
        `on_layer_done(i)` follows layer i (eager only)."""
        self._observe(batch)
        if on_layer_done is None and self._graphed(batch):
            return self.graph_runner.logits(batch)
        return self._run_model(batch, on_layer_done)

    @torch.inference_mode()
    def decode_tokens(self, batch: ForwardBatch, sampling: SamplingTensors) -> torch.Tensor | None:
        """The next token of every row [B] on the device, no host sync, when every row is greedy or samples at a
        temperature alone (`sampling.temperature_only`): drawn inside the decode CUDA graph, or eagerly after the
        forward where no graph runs. None otherwise (nothing ran): then `forward` and the `Sampler`. The caller
        checks what the sampling tensors do not carry: no row wants logprobs or has ids suppressed."""
        if not sampling.temperature_only:
            return None
        self._observe(batch)
        if self._graphed(batch):
            return self.graph_runner.tokens(batch, sampling.temperatures)
        return self.sampler.sample_temperature_only(self._run_model(batch), sampling.temperatures)

    def _observe(self, batch: ForwardBatch) -> None:
        for observe in self.forward_observers:
            observe(batch)

    def _graphed(self, batch: ForwardBatch) -> bool:
        return self.graph_runner is not None and self.graph_runner.can_run(batch)

    def _run_model(self, batch: ForwardBatch, on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        self.backend.init_forward_metadata(batch)
        return self.model(ForwardContext(batch, self.backend, self.pool, on_layer_done))


def tokens_in_budget(budget_bytes: float, layout: KVLayout) -> int:
    """KV tokens (every layer's K and V) that `budget_bytes` hold in `layout`'s dtype: twice as many in FP8 as in
    bf16."""
    return int(budget_bytes // (2 * layout.num_layers * layout.token_bytes))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def use_compute_stream(device: torch.device) -> torch.cuda.Stream:
    """Make a non-blocking stream of its own the calling thread's current stream, and return it.

    On the legacy default stream every forward would be ordered with all legacy-stream work of the process: a
    transfer engine's synchronous copies (mooncake's `nvlink_intra` issues a `cudaMemcpy` per span) from the KV
    writer thread would wait behind whatever forwards the scheduler had queued by then, so a prompt's KV landed
    one or more forwards after its first token (PD on one H100: writes of ~0.3 ms of copying took 46 ms each on
    average and landed 1.4 s after the first token at p90). The writer orders its copies after the forward that
    filled the pages by waiting on that forward's event on the host, so nothing relies on stream order across
    threads."""
    stream = torch.cuda.Stream(device)  # the pool's streams are created with cudaStreamNonBlocking
    torch.cuda.set_stream(stream)
    return stream


def load_runner(args: ServerArgs) -> ModelRunner:
    """The model runner of `args.model_path` (its config read from the checkpoint)."""
    return ModelRunner(args, ModelConfig.from_path(args.model_path))
