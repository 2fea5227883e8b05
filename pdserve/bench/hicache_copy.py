"""The host KV tier's copy path alone: load (host → device) and backup (device → host) rates of N pages in
each `--hicache-mem-layout`, against one big copy of the same bytes (pinned on CUDA: the PCIe/C2C ceiling;
a memcpy on CPU). Device pages are taken in random order, host pages either as the allocator hands them out
(`contiguous`: long runs) or shuffled (`scattered`: every page its own run, the fragmented worst case).
Every case checks that the pages loaded back equal the pages backed up.

python -m pdserve.bench.hicache_copy --model-path DIR [--tokens 16384] [--dtype bfloat16] [--page-size 16] \
    [--repeats 5] [--out FILE.json] [--plot FILE.png]

Only the model's config.json is read (layers, KV heads, head dim); no weights are loaded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from random import Random

import torch

from pdserve.bench.cli import bench_parser
from pdserve.bench.plots import save_figure
from pdserve.mem_cache.host_pool import MEM_LAYOUTS, HostKVPool
from pdserve.mem_cache.kv_pool import KVLayout, KVPool
from pdserve.models.model_config import ModelConfig, resolve_dtype

HOST_ORDERS = ("contiguous", "scattered")


@dataclass(frozen=True, slots=True)
class CaseResult:
    mem_layout: str
    host_pages: str
    load_ms: float  # median
    backup_ms: float
    load_gbps: float
    backup_gbps: float
    load_fraction: float  # of the host → device ceiling
    backup_fraction: float  # of the device → host ceiling
    pages_stored: int
    pages_loaded: int
    pages_verified: int  # loaded pages equal to the device pages backed up
    staging_pages: int  # pages per chunk (the device staging buffer's size)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn, repeats: int) -> float:
    """Median seconds of fn() to completion on the device, after one untimed run."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_ceilings(nbytes: int, device: torch.device, repeats: int) -> dict:
    """GB/s of one copy of nbytes each way between (pinned) host memory and the device."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = _timed(device, lambda: dev.copy_(host, non_blocking=True), repeats)
    d2h = _timed(device, lambda: host.copy_(dev, non_blocking=True), repeats)
    return {"h2d_gbps": nbytes / h2d / 1e9, "d2h_gbps": nbytes / d2h / 1e9}


def kv_layout(model_path: str, dtype: str, page_size: int, num_pages: int, device: torch.device) -> KVLayout:
    cfg = ModelConfig.from_path(model_path)
    return KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, page_size, num_pages,
                    resolve_dtype(dtype, cfg.checkpoint_dtype, device))


def page_tensor(pool: KVPool, page: int) -> torch.Tensor:
    ps = pool.layout.page_size
    return pool.buffer[:, :, page * ps : (page + 1) * ps]


def run_case(pool: KVPool, reference: torch.Tensor, mem_layout: str, host_order: str, num_pages: int,
             repeats: int, ceilings: dict, rng: Random) -> CaseResult:
    device = pool.buffer.device
    host = HostKVPool(pool.layout, num_pages + 1, mem_layout, pin=device.type == "cuda")
    host_pages = host.allocator.alloc(num_pages)
    if host_order == "scattered":
        rng.shuffle(host_pages)
    src = rng.sample(range(1, num_pages + 1), num_pages)
    dst = rng.sample(range(1, num_pages + 1), num_pages)
    pool.buffer.copy_(reference)
    backup_s = _timed(device, lambda: host.save(pool, src, host_pages), repeats)
    load_s = _timed(device, lambda: host.load(pool, host_pages, dst), repeats)
    pool.buffer.zero_()
    host.load(pool, host_pages, dst)
    _sync(device)
    verified = sum(torch.equal(page_tensor(pool, d), reference[:, :, s * pool.layout.page_size:
                                                                 (s + 1) * pool.layout.page_size])
                   for s, d in zip(src, dst))
    nbytes = num_pages * host.page_nbytes
    load_gbps, backup_gbps = nbytes / load_s / 1e9, nbytes / backup_s / 1e9
    return CaseResult(mem_layout, host_order, load_s * 1e3, backup_s * 1e3, load_gbps, backup_gbps,
                      load_gbps / ceilings["h2d_gbps"], backup_gbps / ceilings["d2h_gbps"],
                      len(src), len(dst), int(verified), host.staging_pages)


def plot(result: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["cases"]
    labels = [f"{c['mem_layout']}\n{c['host_pages']}" for c in cases]
    xs = range(len(cases))
    fig, ax = plt.subplots(figsize=(1.6 * len(cases) + 2.5, 3.8))
    ax.bar([x - 0.2 for x in xs], [c["load_gbps"] for c in cases], 0.4, label="load (host → device)")
    ax.bar([x + 0.2 for x in xs], [c["backup_gbps"] for c in cases], 0.4, label="backup (device → host)")
    for key, color, style, label in (("h2d_gbps", "C0", "--", "host → device ceiling"),
                                     ("d2h_gbps", "C1", ":", "device → host ceiling")):
        ax.axhline(result["ceilings"][key], color=color, linestyle=style, linewidth=0.9, label=label)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("GB/s")
    ax.set_title(f"host KV tier, {result['pages']} pages of {result['page_nbytes'] / 2**20:.2f} MiB "
                 f"({result['device']})", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    return save_figure(fig, out)


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__)
    parser.add_argument("--model-path", required=True, help="a model directory (only config.json is read)")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of KV moved per transfer")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--dtype", default="auto", help="KV dtype: auto (bfloat16 on CUDA, float32 on CPU), ...")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="the device pool's device")
    parser.add_argument("--layouts", default=",".join(MEM_LAYOUTS), help="host pool layouts measured, comma-separated")
    parser.add_argument("--host-pages", default=",".join(HOST_ORDERS), help="contiguous, scattered or both")
    parser.add_argument("--repeats", type=int, default=5, help="timed transfers per case")
    parser.add_argument("--seed", type=int, default=0, help="seeds the KV contents and the scattered pages")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    parser.add_argument("--plot", type=Path, help="draw a PNG here")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, allowed in (("layouts", MEM_LAYOUTS), ("host_pages", HOST_ORDERS)):
        values = getattr(args, name).split(",")
        if not set(values) <= set(allowed):
            parser.error(f"--{name.replace('_', '-')} takes {', '.join(allowed)}, got {getattr(args, name)}")
        setattr(args, name, values)
    if args.tokens < args.page_size or args.repeats < 1:
        parser.error("--tokens must hold at least one page and --repeats be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    num_pages = args.tokens // args.page_size
    layout = kv_layout(args.model_path, args.dtype, args.page_size, num_pages + 1, device)
    pool = KVPool(layout, device)
    torch.manual_seed(args.seed)
    reference = torch.rand(pool.buffer.shape, device=device).to(layout.dtype)
    page_nbytes = 2 * layout.num_layers * layout.page_bytes
    nbytes = num_pages * page_nbytes
    print(f"{num_pages} pages x {page_nbytes / 2**20:.2f} MiB = {nbytes / 1e9:.3f} GB per transfer on {device}, "
          f"{str(layout.dtype).removeprefix('torch.')}", flush=True)
    ceilings = copy_ceilings(nbytes, device, args.repeats)
    print(f"ceiling: host→device {ceilings['h2d_gbps']:.2f} GB/s, device→host {ceilings['d2h_gbps']:.2f} GB/s",
          flush=True)
    rng = Random(args.seed)
    cases = []
    for mem_layout in args.layouts:
        for host_order in args.host_pages:
            case = run_case(pool, reference, mem_layout, host_order, num_pages, args.repeats, ceilings, rng)
            cases.append(asdict(case))
            print(f"{mem_layout:11s} {host_order:10s} load {case.load_gbps:7.2f} GB/s ({case.load_fraction:6.1%}) "
                  f"backup {case.backup_gbps:7.2f} GB/s ({case.backup_fraction:6.1%}), "
                  f"{case.pages_verified}/{case.pages_loaded} pages verified", flush=True)
    result = {"device": str(device), "dtype": str(layout.dtype).removeprefix("torch."),
              "tokens": num_pages * args.page_size, "pages": num_pages, "page_nbytes": page_nbytes, "bytes": nbytes, "repeats": args.repeats,
              "layout": layout.describe(), "ceilings": ceilings, "cases": cases}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)
    bad = [c for c in cases if c["pages_verified"] != c["pages_loaded"]]
    if bad:
        print(f"FAILED: pages loaded differ from the pages stored in {len(bad)} case(s)", file=sys.stderr)
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
