"""Raw KV write bandwidth, GPU0 -> GPU1, one process per GPU (spawned), written in place, packed and staged.

    python -m pdserve.bench.kv_transfer                      # every backend that loads
    python -m pdserve.bench.kv_transfer --backends mooncake --tokens 2048,8192 --patterns scattered,fragmented

Cases: flat single-span writes of --sizes-mib, and the KV of --tokens tokens of a llama-3.1-8b-shaped cache
(32 layers x 8 KV heads x 128 dims, bf16 = 128 KiB/token) in pages of each --page-sizes, placed on both sides
  contiguous   pages 1..n on both sides;
  scattered    n pages drawn at random on each side from a pool twice the KV (the worst case: one span per page,
               layer and K/V, packed or not: the destination's pages are scattered too);
  scattered-source
               the prefill's pages at random, the decode's contiguous (what packing is for: a prefill pool churned by
               its prefix cache, a decode whose allocator hands out runs);
  fragmented   the pages a real allocator (`PageAllocator`) hands out for the KV after traffic: requests of
               512-8,192 tokens (70% chat up to 2,048, 30% documents of 6-8k) allocated, grown page by page and
               freed at random until a pool of --traffic-pool-tokens has turned over --churn times at 97%
               occupancy, on each side.
Each KV case is written (--pack) in place (`off`: one span per run contiguous on both sides), packed (`on`: the
sender gathers its pages into the staging arena a prefill server has, then writes one span per destination run,
see pdserve/disagg/transfer/packing.py) and staged (`staged`: packed into a slot of the receiver's receive staging,
as with --disaggregation-staging-mb; the decode's unpack into its pages is timed apart, on the receiving GPU).
GB/s is KV bytes over the median write time; spans are those the engine was given per write; the ceiling is a
torch device-to-device copy GPU0 -> GPU1 measured here, and --link-gbps the nominal link (394 GB/s: two H200s).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.bench.cli import bench_parser, write_result
from pdserve.disagg.transfer import KVRegion, coalesce_page_runs, make_transfer_engine
from pdserve.disagg.transfer.base import StagedDestination
from pdserve.disagg.transfer.packing import MAX_STAGING_BYTES, KVMover, KVPiece, kv_words
from pdserve.mem_cache.kv_pool import KVLayout, PageAllocator

NOMINAL_LINK_GBPS = 394.0
MIB = 1 << 20
LLAMA8B_LAYERS = 32
TRAFFIC_OCCUPANCY = 0.97  # of the pool, before each new request of the fragmented pattern's traffic
TRAFFIC_GROWTH = 16  # requests that grow by one page after each new one


def llama8b_layout(page_size: int, max_tokens: int) -> KVLayout:
    return KVLayout(num_layers=LLAMA8B_LAYERS, num_kv_heads=8, head_dim=128, page_size=page_size,
                    num_pages=2 * max_tokens // page_size + 1, dtype=torch.bfloat16)


@dataclass(frozen=True, slots=True)
class Case:
    label: str
    nbytes: int
    page_size: int = 0  # 0: one flat span of nbytes
    tokens: int = 0
    pattern: str = ""
    how: str = "in place"  # or "packed", "staged"


def build_cases(args) -> list[Case]:
    cases = [Case(f"flat {s} MiB", s * MIB) for s in args.sizes_mib]
    for ps in args.page_sizes:
        for tokens in args.tokens:
            nbytes = tokens * llama8b_layout(ps, 1).token_bytes * 2 * LLAMA8B_LAYERS
            for pattern in args.patterns:
                for how in args.pack:
                    cases.append(Case(f"kv {tokens} tok p{ps} {pattern} {how}", nbytes, ps, tokens, pattern, how))
    return cases


def buffer_bytes(args) -> int:
    kv = max(llama8b_layout(ps, max(args.tokens)).num_slots * llama8b_layout(ps, 1).token_bytes * 2 * LLAMA8B_LAYERS
             for ps in args.page_sizes)
    return max(max(args.sizes_mib) * MIB, kv)


def pages_after_traffic(num_pages: int, page_size: int, want: int, churn: float, rng: random.Random) -> list[int]:
    """The `want` pages a `PageAllocator` of `num_pages` hands out after a mixed load turned it over `churn`
    times (module docstring)."""
    allocator = PageAllocator(num_pages)
    live: list[list[int]] = []
    target, allocated = TRAFFIC_OCCUPANCY * allocator.capacity, 0
    while allocated < churn * allocator.capacity:
        tokens = rng.randint(512, 2048) if rng.random() < 0.7 else rng.randint(6144, 8192)
        need = -(-tokens // page_size)
        while live and (allocator.capacity - allocator.num_free + need > target or allocator.num_free < need):
            allocator.free(live.pop(rng.randrange(len(live))))
        pages = allocator.alloc(need)
        if pages is None:
            continue
        live.append(pages)
        allocated += need
        for request in rng.sample(live, min(len(live), TRAFFIC_GROWTH)):  # decoding requests grow page by page
            more = allocator.alloc(1)
            if more is not None:
                request.extend(more)
    while allocator.num_free < want:
        allocator.free(live.pop(rng.randrange(len(live))))
    return allocator.alloc(want)


def page_lists(case: Case, max_tokens: int, args, rng: random.Random) -> tuple[list[int], list[int]]:
    layout = llama8b_layout(case.page_size, max_tokens)
    n = case.tokens // case.page_size
    if case.pattern == "contiguous":
        return list(range(1, n + 1)), list(range(1, n + 1))
    if case.pattern == "scattered":
        return rng.sample(range(1, layout.num_pages), n), rng.sample(range(1, layout.num_pages), n)
    if case.pattern == "scattered-source":
        return rng.sample(range(1, layout.num_pages), n), list(range(1, n + 1))
    pool_pages = args.traffic_pool_tokens // case.page_size
    src, dst = (compacted(pages_after_traffic(pool_pages, case.page_size, n, args.churn, rng)) for _ in range(2))
    return src, dst


def compacted(pages: list[int]) -> list[int]:
    """The same pages renumbered into 1..2n, ids consecutive before still consecutive and no others: a page list of
    a large pool mapped into the benchmark's buffer without changing the runs a transfer sees."""
    new_id: dict[int, int] = {}
    next_free = 1
    for p in sorted(pages):
        if new_id and p - 1 not in new_id:
            next_free += 1  # a gap between runs
        new_id[p] = next_free
        next_free += 1
    return [new_id[p] for p in pages]


def receiver(backend: str, gpu: int, nbytes: int, args, conn) -> None:
    """Serves a KV buffer and a receive staging of the largest case's KV until told to stop; on ("unpack", ...)
    times the decode's unpack of that many tokens into scattered pages."""
    torch.cuda.set_device(gpu)
    device = f"cuda:{gpu}"
    engine = make_transfer_engine(backend, device, timeout_s=120)
    try:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        staging = torch.empty(max(args.tokens) * llama8b_layout(16, 1).token_bytes * 2 * LLAMA8B_LAYERS,
                              dtype=torch.uint8, device=device)
        engine.register(buf.data_ptr(), nbytes, device)
        engine.register(staging.data_ptr(), staging.numel(), device)
        conn.send({"session": engine.session_id(), "base": buf.data_ptr(), "staging": staging.data_ptr(),
                   "transport": engine.transport()})
        while conn.poll(3600):  # until the parent says stop (or goes away)
            command = conn.recv()
            if command == "stop":
                break
            conn.send({f"{tokens} tok p{ps}": unpack_seconds(buf, staging, ps, tokens, max(args.tokens))
                       for ps in args.page_sizes for tokens in args.tokens})
    finally:
        engine.close()


def unpack_seconds(buf: torch.Tensor, staging: torch.Tensor, page_size: int, tokens: int, max_tokens: int) -> float:
    """The decode's unpack (`ReceiveStaging.unpack`) of `tokens` tokens from staging into pages at random."""
    layout = llama8b_layout(page_size, max_tokens)
    n = tokens // page_size
    pool = kv_words(buf[: 2 * layout.num_layers * layout.layer_bytes], layout)
    staged = kv_words(staging[: 2 * layout.num_layers * n * layout.page_bytes], layout, n)
    index = torch.tensor(random.Random(1).sample(range(1, layout.num_pages), n), device=buf.device)

    def unpack() -> None:
        pool.index_copy_(2, index, staged)
        torch.cuda.synchronize(buf.device)

    return time_write(unpack, 5)


class SpanCounter:
    """An engine that counts the spans it is given, then writes them through the real one."""

    def __init__(self, engine):
        self.engine, self.spans, self.writes = engine, 0, 0

    def write(self, peer_session: str, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int]) -> None:
        self.spans += len(lengths)
        self.engine.write(peer_session, src_ptrs, dst_ptrs, lengths)

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


def time_write(write, iters: int) -> float:
    write()  # warm-up: connections, lazy NCCL channels
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        write()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def sender(backend: str, gpu: int, nbytes: int, hello: dict, cases: list[Case], args, conn) -> None:
    torch.cuda.set_device(gpu)
    device = f"cuda:{gpu}"
    engine = make_transfer_engine(backend, device, timeout_s=120)
    rng = random.Random(0)
    try:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        engine.register(buf.data_ptr(), nbytes, device)
        mover = KVMover(engine, device, MAX_STAGING_BYTES, timeout_s=120)
        mover.engine = counter = SpanCounter(engine)
        engine.connect(hello["session"])
        results, pages = [], {}
        for case in cases:
            if not case.page_size:
                spans = [buf.data_ptr()], [hello["base"]], [case.nbytes]
                seconds = time_write(lambda: engine.write(hello["session"], *spans), args.iters)
                results.append((case.label, case.nbytes, 1, seconds))
                continue
            key = (case.page_size, case.tokens, case.pattern)  # every way of writing moves the same pages
            if key not in pages:
                pages[key] = page_lists(case, max(args.tokens), args, rng)
            layout = llama8b_layout(case.page_size, max(args.tokens))
            runs = coalesce_page_runs(*pages[key])
            staged = StagedDestination(hello["staging"], len(pages[key][0])) if case.how == "staged" else None
            piece = KVPiece(KVRegion(buf.data_ptr(), layout), KVRegion(hello["base"], layout), runs,
                            range(layout.num_layers), staged=staged)
            counter.spans = 0
            pack = case.how != "in place"
            seconds = time_write(lambda: mover.write(hello["session"], [piece], pack=pack), args.iters)
            results.append((case.label, case.nbytes, counter.spans // (args.iters + 1), seconds))
        conn.send({"transport": engine.transport(), "results": results})
    except Exception as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        engine.close()


def copy_ceiling(src_gpu: int, dst_gpu: int, nbytes: int, conn) -> None:
    a = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src_gpu}")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst_gpu}")

    def copy() -> None:
        b.copy_(a)
        torch.cuda.synchronize(src_gpu)
        torch.cuda.synchronize(dst_gpu)

    conn.send(nbytes / time_write(copy, 10) / 1e9)


def run_backend(ctx, backend: str, args, cases: list[Case], nbytes: int) -> dict:
    rparent, rchild = ctx.Pipe()
    sparent, schild = ctx.Pipe()
    recv_proc = ctx.Process(target=receiver, args=(backend, args.dst_gpu, nbytes, args, rchild), daemon=True)
    recv_proc.start()
    send_proc = None
    try:
        if not rparent.poll(300):
            return {"error": "receiver did not start"}
        hello = rparent.recv()
        send_proc = ctx.Process(target=sender, daemon=True, args=(backend, args.src_gpu, nbytes, hello, cases, args,
                                                                  schild))
        send_proc.start()
        if not sparent.poll(args.timeout):
            return {"error": f"sender did not finish within {args.timeout}s"}
        out = sparent.recv()
        if "error" not in out and "staged" in args.pack:
            rparent.send("unpack")
            out["unpack_seconds"] = rparent.recv() if rparent.poll(args.timeout) else {}
        return out
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


def pack_modes(text: str) -> list[str]:
    modes = {"off": "in place", "on": "packed", "staged": "staged"}
    return [modes[x] for x in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__)
    parser.add_argument("--backends", default="mooncake,nccl,tcp", help="transfer backends measured, comma-separated")
    parser.add_argument("--sizes-mib", type=comma_ints, default=[256], help="flat transfer sizes, MiB, comma-separated")
    parser.add_argument("--tokens", type=comma_ints, default=[2048, 8192],
                        help="KV handoff sizes in tokens, comma-separated")
    parser.add_argument("--page-sizes", type=comma_ints, default=[16], help="KV page sizes, comma-separated")
    parser.add_argument("--patterns", type=lambda s: s.split(","),
                        default=["contiguous", "scattered", "scattered-source", "fragmented"],
                        help="page placements: contiguous, scattered, scattered-source, fragmented")
    parser.add_argument("--pack", type=pack_modes, default=["in place", "packed", "staged"],
                        help="how the KV cases are written: off (in place), on (packed), staged; comma-separated")
    parser.add_argument("--churn", type=float, default=4.0, help="pool turnovers before a fragmented case's pages")
    parser.add_argument("--traffic-pool-tokens", type=int, default=120_000,
                        help="the size of the pool whose traffic fragments a fragmented case's pages")
    parser.add_argument("--iters", type=int, default=5, help="timed transfers per case")
    parser.add_argument("--src-gpu", type=int, default=0, help="the sending GPU")
    parser.add_argument("--dst-gpu", type=int, default=1, help="the receiving GPU")
    parser.add_argument("--link-gbps", type=float, default=NOMINAL_LINK_GBPS, help="the nominal link, GB/s")
    parser.add_argument("--timeout", type=float, default=900.0, help="per backend, seconds")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
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
          f"({ceiling / args.link_gbps:.0%} of {args.link_gbps:.0f} GB/s)", flush=True)

    cases = build_cases(args)
    nbytes = buffer_bytes(args)
    report = {"copy_ceiling_gbps": ceiling, "link_gbps": args.link_gbps, "backends": {}}
    for backend in args.backends.split(","):
        out = report["backends"][backend] = run_backend(ctx, backend, args, cases, nbytes)
        if "error" in out:
            print(f"\n[{backend}] unavailable or failed: {out['error']}", flush=True)
            continue
        print(f"\n[{backend}] transport={out['transport']}")
        print(f"{'case':44s} {'MiB':>8s} {'spans':>7s} {'ms':>9s} {'GB/s':>8s} {'/copy':>6s} {'/link':>6s}")
        for label, size, spans, seconds in out["results"]:
            gbps = size / seconds / 1e9
            print(f"{label:44s} {size / MIB:8.1f} {spans:7d} {seconds * 1e3:9.2f} {gbps:8.1f} "
                  f"{gbps / ceiling:6.0%} {gbps / args.link_gbps:6.0%}", flush=True)
        for label, seconds in out.get("unpack_seconds", {}).items():
            print(f"the decode's unpack of a staged {label} KV into scattered pages: {seconds * 1e3:.2f} ms", flush=True)
    write_result(args.out, report)


if __name__ == "__main__":
    main()
