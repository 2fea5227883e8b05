"""Where one engine step's time goes on the GPU: kernels per decode step (or one prefill), their time, the gaps.

python -m pdserve.bench.step_profile --model-path DIR --batch-size 64 --context-len 1024 [--steps 8]
    [--prefill-len 8192] [--out DIR] [engine flags as --key value]

Profiles `--steps` decode steps of a static batch (greedy, after warm-up steps) through the scheduler as it
serves, and with `--prefill-len` one prefill of a prompt that long, with the torch profiler. Prints per kernel
the launches and microseconds per step, the share of the step, a category sum (GEMM, attention, norm, ...),
the step's wall time, the GPU's busy fraction and the idle gaps between kernels. `--out` keeps the table as
JSON and the Chrome trace (open it in Perfetto).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.cli import engine_bench_parser, parse_engine_bench_args
from pdserve.bench.one_batch import add_static_batch

# first matching pattern names a kernel's category (names as the CUDA runtime reports them)
CATEGORIES = (
    ("all_reduce", r"nccl|allreduce|all_reduce|allgather|all_gather|one_shot|two_shot|multimem"),  # TP collectives
    ("attention", r"decode_split|_extend_kernel|flash|fmha|attention|sdpa"),
    ("kv_store", r"store_kv|rope_store|kv_store"),
    ("gemm", r"gemm|gemv|xmma|cutlass|nvjet|matmul|splitk|dot_kernel|skinny"),
    ("norm", r"rmsnorm|layer_norm|norm_kernel"),
    ("rotary", r"rotary|rope"),
    ("activation", r"silu"),
    ("sampling", r"softmax|exponential|argmax|topk|cumsum|sort|sample|gather|reduce_kernel|distribution"),
    ("copy", r"memcpy|memset|copy|fill|cat|index"),
)


def category(name: str) -> str:
    lowered = name.lower()
    return next((cat for cat, pattern in CATEGORIES if re.search(pattern, lowered)), "elementwise/other")


@dataclass(slots=True)
class KernelRow:
    name: str
    category: str
    launches_per_step: float
    us_per_step: float
    share: float


@dataclass(slots=True)
class StepProfile:
    label: str
    steps: int
    wall_us_per_step: float
    kernel_us_per_step: float
    gpu_busy: float
    gaps_us_per_step: float
    gaps_over_5us_per_step: float
    launches_per_step: float
    categories: dict[str, float] = field(default_factory=dict)
    kernels: list[KernelRow] = field(default_factory=list)


def _short(name: str) -> str:
    name = re.sub(r"\(.*", "", name.replace("void ", ""))
    return name if len(name) <= 90 else name[:87] + "..."


def summarize(trace_path: Path, label: str, steps: int, wall_s: float) -> StepProfile:
    """Kernel table from a Chrome trace written by torch.profiler: GPU kernels and memcpy/memset only."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                     key=lambda e: e["ts"])
    per_name: dict[str, list[float]] = {}
    for e in kernels:
        per_name.setdefault(_short(e["name"]), []).append(e["dur"])
    busy = sum(e["dur"] for e in kernels)
    gaps, end = [], None
    for e in kernels:
        if end is not None and e["ts"] > end:
            gaps.append(e["ts"] - end)
        end = max(end or 0.0, e["ts"] + e["dur"])
    wall_us = 1e6 * wall_s
    rows = [KernelRow(name, category(name), len(durs) / steps, sum(durs) / steps, sum(durs) / max(busy, 1e-9))
            for name, durs in per_name.items()]
    rows.sort(key=lambda r: -r.us_per_step)
    cats: dict[str, float] = {}
    for r in rows:
        cats[r.category] = cats.get(r.category, 0.0) + r.us_per_step
    return StepProfile(
        label=label, steps=steps, wall_us_per_step=wall_us / steps, kernel_us_per_step=busy / steps,
        gpu_busy=busy / wall_us, gaps_us_per_step=sum(gaps) / steps,
        gaps_over_5us_per_step=sum(g > 5 for g in gaps) / steps, launches_per_step=len(kernels) / steps,
        categories=dict(sorted(cats.items(), key=lambda kv: -kv[1])), kernels=rows,
    )


def _profiled(fn, trace_path: Path) -> float:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    prof.export_chrome_trace(str(trace_path))
    return wall


def profile_decode(llm: LLM, bs: int, context_len: int, steps: int, out: Path) -> StepProfile:
    sched = llm.scheduler
    sched.flush_cache()
    add_static_batch(sched, bs, context_len, steps + 8, "d")
    while sched.waiting or sched.chunked:
        sched.step()
    for _ in range(4):
        sched.step()

    def run():
        for _ in range(steps):
            sched.step()

    trace = out / f"decode_bs{bs}_ctx{context_len}.json"
    wall = _profiled(run, trace)
    while sched.has_work():
        sched.step()
    return summarize(trace, f"decode bs={bs} ctx={context_len}", steps, wall)


def profile_prefill(llm: LLM, prompt_len: int, out: Path) -> StepProfile:
    sched = llm.scheduler

    def run():
        while sched.waiting or sched.chunked:
            sched.step()

    for tag in ("pw", "p"):  # the first run compiles the kernels for this shape
        sched.flush_cache()
        add_static_batch(sched, 1, prompt_len, 1, tag)
        trace = out / f"prefill_{prompt_len}.json"
        wall = _profiled(run, trace) if tag == "p" else run()
        while sched.has_work():
            sched.step()
    return summarize(trace, f"prefill {prompt_len}", 1, wall)


def print_profile(p: StepProfile, top: int) -> None:
    print(f"\n## {p.label}: wall {p.wall_us_per_step:.1f} us/step, kernels {p.kernel_us_per_step:.1f} us "
          f"(GPU busy {100 * p.gpu_busy:.0f}%), {p.launches_per_step:.0f} launches/step, "
          f"gaps {p.gaps_us_per_step:.1f} us/step ({p.gaps_over_5us_per_step:.0f} over 5 us)")
    print("categories (us/step): " + ", ".join(f"{k} {v:.1f}" for k, v in p.categories.items()))
    print(f"{'us/step':>9} {'share':>6} {'n/step':>7}  kernel")
    for r in p.kernels[:top]:
        print(f"{r.us_per_step:9.1f} {100 * r.share:5.1f}% {r.launches_per_step:7.1f}  [{r.category}] {r.name}")


def build_parser() -> argparse.ArgumentParser:
    parser = engine_bench_parser(__doc__, "folder for the traces and tables", Path("step_profile"))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64], help="decode batch sizes profiled")
    parser.add_argument("--context-len", type=int, default=1024, help="tokens in each request's context")
    parser.add_argument("--steps", type=int, default=8, help="decode steps profiled per batch size")
    parser.add_argument("--prefill-len", type=int, nargs="*", default=[], help="prefill lengths profiled too")
    parser.add_argument("--top", type=int, default=18, help="kernels listed per profile")
    return parser


def main(argv: list[str] | None = None) -> list[StepProfile]:
    parser = build_parser()
    args, engine_args = parse_engine_bench_args(parser, argv)
    if not torch.cuda.is_available():
        raise SystemExit("step_profile needs a CUDA device")
    args.out.mkdir(parents=True, exist_ok=True)
    llm = LLM(args.model_path, **engine_args)
    llm.generate(["Profile warm-up: "], SamplingParams(max_tokens=8), use_tqdm=False)
    profiles = [profile_decode(llm, bs, args.context_len, args.steps, args.out) for bs in args.batch_sizes]
    profiles += [profile_prefill(llm, n, args.out) for n in args.prefill_len]
    for p in profiles:
        print_profile(p, args.top)
    (args.out / "step_profile.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "model": args.model_path,
         "profiles": [asdict(p) for p in profiles]}, indent=2))
    return profiles


if __name__ == "__main__":
    main()
