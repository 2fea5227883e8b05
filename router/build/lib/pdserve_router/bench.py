"""Router overhead benchmark: stub prefill/decode servers on loopback, the router pinned to one core.

Phase "latency": `--streams` concurrent clients each run streaming requests back to back against stubs that pace
`--tokens` tokens `--token-interval-s` apart; the time to first token (TTFT) is measured directly (the client sends
both halves itself) and through the router. Added latency = router TTFT - direct TTFT, per percentile.
Phase "single": the same with one client (`--single-requests` streams of `--single-tokens` tokens): the cost of the
extra hop without queueing.
Phase "throughput": `--throughput-clients` closed-loop clients send 1-token streams as fast as they can for
`--duration-s`; the router's sustained request rate and its CPU use are reported.

    python -m pdserve_router.bench --plot docs/img/router-overhead.png
    # a host with 16+ idle cores: router alone on core 0, stubs and 4 client processes on cores 2-9
    python -m pdserve_router.bench --router-cpu 0 --stub-cpu 2-9 --client-procs 4 --per-stream 20

The last lines printed are a Markdown table with the rows of docs/benchmarks.md; `--json` writes everything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import aiohttp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def parse_cpus(spec: str) -> set[int]:
    """A taskset-style CPU list: "0", "2,3", "2-9", "0,4-7"."""
    cpus: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def pinned(cmd: list[str], cpu: str | None) -> list[str]:
    return ["taskset", "-c", cpu, *cmd] if cpu is not None and shutil.which("taskset") else cmd


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    prefill_url: str | None = None


@dataclass
class PhaseResult:
    target: str
    requests: int
    seconds: float
    ttft_ms: list[float]

    @property
    def rate(self) -> float:
        return self.requests / self.seconds

    @staticmethod
    def merge(parts: list[PhaseResult]) -> PhaseResult:
        return PhaseResult(parts[0].target, sum(p.requests for p in parts), sum(p.seconds for p in parts),
                           [t for p in parts for t in p.ttft_ms])


async def wait_up(session: aiohttp.ClientSession, url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with session.get(url) as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{url} did not come up")


async def drain(session: aiohttp.ClientSession, url: str, body: dict) -> None:
    async with session.post(url, json=body) as resp:
        await resp.read()


async def one_stream(session: aiohttp.ClientSession, target: Target, prompt: str, tokens: int) -> float:
    """TTFT in ms of one streaming /generate; reads the stream to its end. A direct target also gets the prefill
    half sent by the client itself, so that the stubs do the same work with and without the router."""
    started = time.perf_counter()
    body = {"text": prompt, "stream": True, "sampling_params": {"max_new_tokens": tokens}}
    prefill = None
    if target.prefill_url:
        body.update(bootstrap_host="127.0.0.1", bootstrap_port=8998, bootstrap_room=random.getrandbits(63))
        prefill = asyncio.ensure_future(drain(session, target.prefill_url + "/generate", body))
    async with session.post(target.url + "/generate", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{target.url}: HTTP {resp.status}: {await resp.text()}")
        await resp.content.readany()
        ttft = time.perf_counter() - started
        while await resp.content.readany():
            pass
    if prefill is not None:
        await prefill
    return ttft * 1000


async def drive_here(target: Target, clients: int, tokens: int, per_client: int | None, duration_s: float | None,
                     stagger_s: float = 0.0) -> PhaseResult:
    """`clients` loops of back-to-back streams: `per_client` each, or until `duration_s` has passed; each loop
    starts after a random delay of up to `stagger_s`."""
    ttfts: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.perf_counter()
        stop_at = started + duration_s if duration_s else float("inf")
        total = clients * per_client if per_client else None

        async def client(index: int) -> None:
            await asyncio.sleep(random.uniform(0, stagger_s))  # steady state, not 100 requests in the same instant
            n = 0
            while (per_client is None or n < per_client) and time.perf_counter() < stop_at:
                ttfts.append(await one_stream(session, target, f"client {index} says hello number {n}", tokens))
                n += 1
                if total and len(ttfts) % max(1, total // 4) == 0:
                    print(f"  [{target.name}] {len(ttfts)}/{total} requests", flush=True)

        await asyncio.gather(*(client(i) for i in range(clients)))
        return PhaseResult(target.name, len(ttfts), time.perf_counter() - started, ttfts)


def drive_in_child(*spec) -> PhaseResult:
    return asyncio.run(drive_here(*spec))


class Driver:
    """Runs the client loops in this process, or split over `procs` processes so the clients are not the bottleneck."""

    def __init__(self, procs: int):
        self.procs = procs
        context = multiprocessing.get_context("spawn")
        self.pool = ProcessPoolExecutor(procs, mp_context=context) if procs > 1 else None

    async def drive(self, target: Target, clients: int, tokens: int, per_client: int | None,
                    duration_s: float | None, stagger_s: float = 0.0) -> PhaseResult:
        if self.pool is None:
            return await drive_here(target, clients, tokens, per_client, duration_s, stagger_s)
        loop = asyncio.get_running_loop()
        shares = [clients // self.procs + (i < clients % self.procs) for i in range(self.procs)]
        parts = await asyncio.gather(*(loop.run_in_executor(self.pool, drive_in_child, target, share, tokens,
                                                            per_client, duration_s, stagger_s)
                                        for share in shares if share))
        return PhaseResult(target.name, sum(p.requests for p in parts), max(p.seconds for p in parts),
                           [t for p in parts for t in p.ttft_ms])

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def summary(result: PhaseResult) -> dict:
    return {"target": result.target, "requests": result.requests, "req_per_s": round(result.rate, 1),
            **{f"ttft_p{q}_ms": round(percentile(result.ttft_ms, q), 3) for q in (50, 90, 99)}}


def plot(path: str, direct: PhaseResult, routed: PhaseResult, rates: dict, streams: int) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; no plot written", flush=True)
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for result in (direct, routed):
        values = sorted(result.ttft_ms)
        left.plot(values, [i / len(values) for i in range(len(values))], label=result.target)
    left.set(xlabel="time to first token (ms)", ylabel="fraction of requests",
             title=f"TTFT at {streams} concurrent streams", xscale="log")
    left.legend()
    left.grid(alpha=0.3)
    right.bar(list(rates), list(rates.values()), color=["tab:blue", "tab:orange"])
    right.set(ylabel="requests / s", title="sustained rate, 1-token streams (closed loop)")
    for i, value in enumerate(rates.values()):
        right.text(i, value, f"{value:.0f}", ha="center", va="bottom")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}", flush=True)


def histogram_quantiles(metrics_before: str, metrics_after: str, name: str, qs: tuple[int, ...]) -> dict:
    """Upper bucket bounds (ms) holding the q-th percentile of a histogram's observations between two scrapes."""
    def buckets(text: str) -> list[tuple[float, float]]:
        prefix = f"{name}_bucket{{le=\""
        return [(float(line[len(prefix):].split('"')[0]), float(line.rsplit(" ", 1)[1]))
                for line in text.splitlines() if line.startswith(prefix)]
    deltas = [(bound, after - before) for (bound, after), (_, before) in zip(buckets(metrics_after),
                                                                             buckets(metrics_before))]
    total = deltas[-1][1] if deltas else 0
    return {f"p{q}_ms_at_most": next((bound * 1000 for bound, count in deltas if count >= q / 100 * total), None)
            for q in qs} | {"observations": total}


async def scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as resp:
        return await resp.text()


async def compare(drive, args: argparse.Namespace, session: aiohttp.ClientSession, targets: tuple[Target, Target],
                  router_pid: int, clients: int, tokens: int, per_client: int, stagger_s: float) -> dict:
    """Direct, then through the router, `args.rounds` times (interleaved, so drift on a shared box hits both);
    TTFTs pooled over the rounds."""
    direct_target, router_target = targets
    direct, routed, cpu = [], [], 0.0
    before = await scrape(session, router_target.url)
    for _ in range(args.rounds):
        direct.append(await drive(direct_target, clients, tokens, per_client, None, stagger_s))
        cpu_before = cpu_seconds(router_pid)
        routed.append(await drive(router_target, clients, tokens, per_client, None, stagger_s))
        cpu += cpu_seconds(router_pid) - cpu_before
    internal = histogram_quantiles(before, await scrape(session, router_target.url),
                                   "pdserve_router_added_latency_seconds", (50, 99))
    direct_all, routed_all = PhaseResult.merge(direct), PhaseResult.merge(routed)
    added = {f"added_p{q}_ms": round(percentile(routed_all.ttft_ms, q) - percentile(direct_all.ttft_ms, q), 3)
             for q in (50, 90, 99)}
    return {"direct": summary(direct_all), "router": summary(routed_all), **added, "router_internal_added": internal,
            "router_cpu_fraction": round(cpu / routed_all.seconds, 2),
            "router_cpu_us_per_request": round(cpu / routed_all.requests * 1e6, 1),
            "_results": (direct_all, routed_all)}


async def run_phases(args: argparse.Namespace, prefill_url: str, decode_url: str, router_url: str,
                     router_pid: int) -> dict:
    targets = Target("direct", decode_url, prefill_url), Target("router", router_url)
    driver = Driver(args.client_procs)
    drive = driver.drive
    async with aiohttp.ClientSession() as session:
        await wait_up(session, decode_url + "/health")
        await wait_up(session, router_url + "/health")
        async with session.get(router_url + "/workers") as resp:
            event_loop = (await resp.json()).get("event_loop", "asyncio")
        print(f"router event loop: {event_loop}; warm-up", flush=True)
        await drive(Target("warmup", router_url), 10 * args.client_procs, args.tokens, 20, None)
        print(f"latency phase: {args.streams} concurrent streams x {args.per_stream} requests x {args.rounds} "
              "round(s)", flush=True)
        latency = await compare(drive, args, session, targets, router_pid, args.streams, args.tokens,
                                args.per_stream, args.tokens * args.token_interval_s)
        single = None
        if args.single_requests:
            print(f"single-stream phase: {args.single_requests} requests", flush=True)
            single = await compare(drive, args, session, targets, router_pid, 1, args.single_tokens,
                                   max(1, args.single_requests // args.rounds), 0.0)
    print(f"throughput phase: {args.throughput_clients} closed-loop clients for {args.duration_s:g} s", flush=True)
    direct_rate = await drive(targets[0], args.throughput_clients, 1, None, args.duration_s)
    cpu_before = cpu_seconds(router_pid)
    routed_rate = await drive(targets[1], args.throughput_clients, 1, None, args.duration_s)
    router_cpu = (cpu_seconds(router_pid) - cpu_before) / routed_rate.seconds
    driver.close()
    direct, routed = latency.pop("_results")
    results = {"latency": latency,
               "throughput": {"direct": summary(direct_rate), "router": summary(routed_rate),
                              "router_cpu_fraction": round(router_cpu, 2)},
               "router_event_loop": event_loop,
               "load_average": os.getloadavg(),
               "settings": {k: v for k, v in vars(args).items() if k not in ("plot", "json")}}
    if single is not None:
        single.pop("_results")
        results["single"] = single
    if args.plot:
        plot(args.plot, direct, routed, {"direct (client sends both halves)": direct_rate.rate,
                                         "through router": routed_rate.rate}, args.streams)
    return results


def table(results: dict) -> str:
    """The docs/benchmarks.md rows (ms unless said)."""
    lat, thr, settings = results["latency"], results["throughput"], results["settings"]

    def ms(block: dict, key: str) -> str:
        return " / ".join(f"{block[key][f'ttft_p{q}_ms']:.2f}" for q in (50, 90, 99))

    added = " / ".join(f"{lat[f'added_p{q}_ms']:.2f}" for q in (50, 90, 99))
    internal = lat["router_internal_added"]
    streams = settings["streams"]
    rate = lat["router"]["req_per_s"]
    events_k = rate * (settings["tokens"] + 1) / 1000
    rows = ["| metric | direct | through router | added |", "|---|---|---|---|",
            f"| TTFT p50 / p90 / p99 (ms), {streams} streams | {ms(lat, 'direct')} | {ms(lat, 'router')} | {added} |"]
    if "single" in results:
        one = results["single"]
        rows.append(f"| TTFT p50 (ms), 1 stream | {one['direct']['ttft_p50_ms']:.2f} | "
                    f"{one['router']['ttft_p50_ms']:.2f} | {one['added_p50_ms']:.2f} |")
    rows += [(f"| router internal p50 / p99 (ms), {streams} streams | | | ≤ {internal['p50_ms_at_most']:g} / "
              f"≤ {internal['p99_ms_at_most']:g} |"),
             (f"| router CPU at {streams} streams (≈{rate:.0f} req/s + {events_k:.1f}k events/s) | | "
              f"{lat['router_cpu_fraction']:.2f} core ({lat['router_cpu_us_per_request']:.0f} µs/request) | |"),
             (f"| sustained rate, 1-token streams (req/s) | {thr['direct']['req_per_s']:,.0f} | "
              f"{thr['router']['req_per_s']:,.0f} (router at {thr['router_cpu_fraction'] * 100:.0f} % of one "
              "core) | |")]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Measure the latency the router adds and the rate it sustains: stub prefill/decode servers, the "
                    "router pinned to its own core, streaming clients; prints JSON and then the docs/benchmarks.md "
                    "table.",
        epilog="On a host with 16+ idle cores (the documented clean run): --router-cpu 0 --stub-cpu 2-9 "
               "--client-procs 4 --per-stream 20. Keep the router's core (and its hyperthread sibling) free of "
               "everything else. --router-arg=--event-loop=asyncio measures without uvloop.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--streams", type=int, default=100, help="concurrent streams in the latency phase")
    parser.add_argument("--per-stream", type=int, default=10, help="requests per stream (per round) in the latency "
                        "phase")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per stub stream in the latency phase")
    parser.add_argument("--token-interval-s", type=float, default=0.02, help="stub pacing between tokens")
    parser.add_argument("--single-requests", type=int, default=200, help="requests of the one-stream phase (0: skip "
                        "it)")
    parser.add_argument("--single-tokens", type=int, default=2, help="tokens per stream in the one-stream phase")
    parser.add_argument("--rounds", type=int, default=1, help="direct/router alternations per latency phase, TTFTs "
                        "pooled (more rounds even out drift on a shared machine)")
    parser.add_argument("--throughput-clients", type=int, default=32, help="closed-loop clients of the throughput "
                        "phase")
    parser.add_argument("--duration-s", type=float, default=5.0, help="length of each throughput run")
    parser.add_argument("--client-procs", type=int, default=1, help="processes the clients are spread over (they "
                        "run on the --stub-cpu cores)")
    parser.add_argument("--router-cpu", default="0", help="core(s) for the router (taskset list); 'none' to not pin")
    parser.add_argument("--stub-cpu", default="1", help="cores for stubs and clients (taskset list such as 1 or 2-9 "
                        "or 2,3,4); 'none' to not pin")
    parser.add_argument("--router-arg", action="append", default=[], metavar="ARG", help="extra router flag, "
                        "repeatable (e.g. --router-arg=--event-loop=asyncio)")
    parser.add_argument("--plot", default=None, help="PNG path for the plot (needs matplotlib)")
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    router_cpu = None if args.router_cpu == "none" else args.router_cpu
    stub_cpu = None if args.stub_cpu == "none" else args.stub_cpu
    if stub_cpu is not None and hasattr(os, "sched_setaffinity") and shutil.which("taskset"):
        os.sched_setaffinity(0, parse_cpus(stub_cpu))
    prefill_port, decode_port, router_port = free_port(), free_port(), free_port()
    stub_cmd = [sys.executable, "-m", "pdserve_router.stub", "--prefill-ports", str(prefill_port), "--decode-ports",
                str(decode_port), "--no-couple", "--token-interval-s", str(args.token_interval_s)]
    router_cmd = [sys.executable, "-m", "pdserve_router", "--prefill", f"http://127.0.0.1:{prefill_port}",
                  "--decode", f"http://127.0.0.1:{decode_port}", "--port", str(router_port), "--log-level", "warning",
                  *args.router_arg]
    procs = [subprocess.Popen(pinned(stub_cmd, stub_cpu)), subprocess.Popen(pinned(router_cmd, router_cpu))]
    try:
        results = asyncio.run(run_phases(args, f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}",
                                         f"http://127.0.0.1:{router_port}", procs[1].pid))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(f"\nrouter event loop: {results['router_event_loop']}; load average before the end: "
          f"{' '.join(f'{x:.2f}' for x in results['load_average'])}")
    print(table(results), flush=True)


if __name__ == "__main__":
    main()
