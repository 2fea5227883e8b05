"""Raw transfer-engine write bandwidth, GPU0 -> GPU1, one process per GPU (spawned).

    python -m pdserve.bench.kv_transfer                      # every backend that loads
    python -m pdserve.bench.kv_transfer --backends nccl --sizes-mib 64,1024 --iters 10

Cases: flat single-span writes of --sizes-mib, and the KV of --tokens tokens of a llama-3.1-8b-shaped
cache (32 layers x 8 KV heads x 128 dims, bf16 = 128 KiB/token) in page runs of each --page-sizes,
with pages either contiguous on both sides or scattered at random (the fragmented worst case: about one
span per page per layer per K/V). The ceiling is a torch device-to-device copy GPU0 -> GPU1 measured here.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import time
from dataclasses import dataclass

import torch

from pdserve.bench.cli import bench_parser
from pdserve.disagg.transfer import KVRegion, coalesce_page_runs, kv_write_requests, make_transfer_engine
from pdserve.mem_cache.kv_pool import KVLayout

NOMINAL_CEILING_GBPS = 394.0
MIB = 1 << 20


def llama8b_layout(page_size: int, max_tokens: int) -> KVLayout:
    return KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, page_size=page_size,
                    num_pages=2 * max_tokens // page_size + 1, dtype=torch.bfloat16)


@dataclass(frozen=True, slots=True)
class Case:
    label: str
    nbytes: int
    page_size: int = 0  # 0: one flat span of nbytes
    tokens: int = 0
    pattern: str = ""


def build_cases(args) -> list[Case]:
    cases = [Case(f"flat {s} MiB", s * MIB) for s in args.sizes_mib]
    for ps in args.page_sizes:
        for tokens in args.tokens:
            for pattern in args.patterns:
                nbytes = tokens * llama8b_layout(ps, 1).token_bytes * 2 * 32
                cases.append(Case(f"kv {tokens} tok p{ps} {pattern}", nbytes, ps, tokens, pattern))
    return cases


def buffer_bytes(args) -> int:
    kv = max(llama8b_layout(ps, max(args.tokens)).num_slots * llama8b_layout(ps, 1).token_bytes * 64
             for ps in args.page_sizes)
    return max(max(args.sizes_mib) * MIB, kv)


def spans_for(case: Case, src_base: int, dst_base: int, max_tokens: int, rng: random.Random):
    if not case.page_size:
        return [src_base], [dst_base], [case.nbytes]
    layout = llama8b_layout(case.page_size, max_tokens)
    n = case.tokens // case.page_size
    if case.pattern == "contiguous":
        src_pages, dst_pages = list(range(1, n + 1)), list(range(1, n + 1))
    else:
        src_pages = rng.sample(range(1, layout.num_pages), n)
        dst_pages = rng.sample(range(1, layout.num_pages), n)
    runs = coalesce_page_runs(src_pages, dst_pages)
    return kv_write_requests(KVRegion(src_base, layout), KVRegion(dst_base, layout), runs)


def receiver(backend: str, gpu: int, nbytes: int, conn) -> None:
    torch.cuda.set_device(gpu)
    device = f"cuda:{gpu}"
    engine = make_transfer_engine(backend, device, timeout_s=120)
    try:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        engine.register(buf.data_ptr(), nbytes, device)
        conn.send({"session": engine.session_id(), "base": buf.data_ptr(), "transport": engine.transport()})
        conn.poll(3600)  # serve until the parent says stop (or goes away)
    finally:
        engine.close()


def sender(backend: str, gpu: int, nbytes: int, hello: dict, cases: list[Case], iters: int, max_tokens: int,
           conn) -> None:
    torch.cuda.set_device(gpu)
    device = f"cuda:{gpu}"
    engine = make_transfer_engine(backend, device, timeout_s=120)
    rng = random.Random(0)
    try:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        engine.register(buf.data_ptr(), nbytes, device)
        engine.connect(hello["session"])
        results = []
        for case in cases:
            batch = spans_for(case, buf.data_ptr(), hello["base"], max_tokens, rng)
            engine.write(hello["session"], *batch)  # warm-up: connections, lazy NCCL channels
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                engine.write(hello["session"], *batch)
                times.append(time.perf_counter() - t0)
            results.append((case.label, case.nbytes, len(batch[0]), sorted(times)[len(times) // 2]))
        conn.send({"transport": engine.transport(), "results": results})
    except Exception as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        engine.close()


def copy_ceiling(src_gpu: int, dst_gpu: int, nbytes: int, conn) -> None:
    a = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src_gpu}")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst_gpu}")
    b.copy_(a)
    torch.cuda.synchronize(src_gpu)
    torch.cuda.synchronize(dst_gpu)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(src_gpu)
        torch.cuda.synchronize(dst_gpu)
        times.append(time.perf_counter() - t0)
    conn.send(nbytes / sorted(times)[len(times) // 2] / 1e9)


def run_backend(ctx, backend: str, args, cases: list[Case], nbytes: int) -> dict:
    rparent, rchild = ctx.Pipe()
    sparent, schild = ctx.Pipe()
    recv_proc = ctx.Process(target=receiver, args=(backend, args.dst_gpu, nbytes, rchild), daemon=True)
    recv_proc.start()
    send_proc = None
    try:
        if not rparent.poll(300):
            return {"error": "receiver did not start"}
        hello = rparent.recv()
        send_proc = ctx.Process(target=sender, daemon=True, args=(backend, args.src_gpu, nbytes, hello, cases,
                                                                  args.iters, max(args.tokens), schild))
        send_proc.start()
        if not sparent.poll(args.timeout):
            return {"error": f"sender did not finish within {args.timeout}s"}
        return sparent.recv()
    except EOFError:
        return {"error": "a peer process died (see its stderr)"}
    finally:
        rparent.send("stop")
        for proc in (send_proc, recv_proc):
            if proc is not None:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()


def comma_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__)
    parser.add_argument("--backends", default="mooncake,nccl,tcp", help="transfer backends measured, comma-separated")
    parser.add_argument("--sizes-mib", type=comma_ints, default=[64, 256, 1024],
                        help="contiguous transfer sizes, MiB, comma-separated")
    parser.add_argument("--tokens", type=comma_ints, default=[1024, 4096, 16384],
                        help="KV handoff sizes in tokens, comma-separated")
    parser.add_argument("--page-sizes", type=comma_ints, default=[16, 64], help="KV page sizes, comma-separated")
    parser.add_argument("--patterns", type=lambda s: s.split(","), default=["contiguous", "scattered"],
                        help="page placements: contiguous, scattered")
    parser.add_argument("--iters", type=int, default=5, help="timed transfers per case")
    parser.add_argument("--src-gpu", type=int, default=0, help="the sending GPU")
    parser.add_argument("--dst-gpu", type=int, default=1, help="the receiving GPU")
    parser.add_argument("--timeout", type=float, default=900.0, help="per backend, seconds")
    return parser


def main() -> None:
    args = build_parser().parse_args()

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=copy_ceiling, args=(args.src_gpu, args.dst_gpu, max(args.sizes_mib) * MIB, child))
    proc.start()
    ceiling = parent.recv()
    proc.join()
    print(f"torch copy GPU{args.src_gpu}->GPU{args.dst_gpu}: {ceiling:.1f} GB/s "
          f"({ceiling / NOMINAL_CEILING_GBPS:.0%} of {NOMINAL_CEILING_GBPS:.0f} GB/s)", flush=True)

    cases = build_cases(args)
    nbytes = buffer_bytes(args)
    for backend in args.backends.split(","):
        out = run_backend(ctx, backend, args, cases, nbytes)
        if "error" in out:
            print(f"\n[{backend}] unavailable or failed: {out['error']}", flush=True)
            continue
        print(f"\n[{backend}] transport={out['transport']}")
        print(f"{'case':32s} {'MiB':>9s} {'spans':>7s} {'ms':>9s} {'GB/s':>8s} {'/copy':>6s} {'/394':>6s}")
        for label, size, spans, seconds in out["results"]:
            gbps = size / seconds / 1e9
            print(f"{label:32s} {size / MIB:9.1f} {spans:7d} {seconds * 1e3:9.2f} {gbps:8.1f} "
                  f"{gbps / ceiling:6.0%} {gbps / NOMINAL_CEILING_GBPS:6.0%}", flush=True)


if __name__ == "__main__":
    main()
