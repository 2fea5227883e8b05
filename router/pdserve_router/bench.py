"""Router overhead benchmark: stub prefill/decode servers on loopback, the router pinned to one core.

Phase "latency": `--streams` concurrent clients each run streaming requests back to back against stubs that pace
`--tokens` tokens `--token-interval-s` apart; the time to first token (TTFT) is measured directly against a decode
stub and through the router. Added latency = router TTFT - direct TTFT, per percentile.
Phase "throughput": `--throughput-clients` closed-loop clients send short streams as fast as they can for
`--duration-s`; the router's sustained request rate and its CPU use are reported.

    python -m pdserve_router.bench --plot docs/img/router-overhead.png
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


async def run_phases(args: argparse.Namespace, prefill_url: str, decode_url: str, router_url: str,
                     router_pid: int) -> dict:
    direct_target, router_target = Target("direct", decode_url, prefill_url), Target("router", router_url)
    driver = Driver(args.client_procs)
    drive = driver.drive
    async with aiohttp.ClientSession() as session:
        await wait_up(session, decode_url + "/health")
        await wait_up(session, router_url + "/health")
        print("warm-up", flush=True)
        await drive(Target("warmup", router_url), 10 * args.client_procs, args.tokens, 20, None)
        print(f"latency phase: {args.streams} concurrent streams x {args.per_stream} requests", flush=True)
        stagger_s = args.tokens * args.token_interval_s
        direct = await drive(direct_target, args.streams, args.tokens, args.per_stream, None, stagger_s)
        before = await scrape(session, router_url)
        cpu_before = cpu_seconds(router_pid)
        routed = await drive(router_target, args.streams, args.tokens, args.per_stream, None, stagger_s)
        latency_cpu = (cpu_seconds(router_pid) - cpu_before) / routed.seconds
        internal = histogram_quantiles(before, await scrape(session, router_url),
                                       "pdserve_router_added_latency_seconds", (50, 99))
    print(f"throughput phase: {args.throughput_clients} closed-loop clients for {args.duration_s:g} s", flush=True)
    direct_rate = await drive(direct_target, args.throughput_clients, 1, None, args.duration_s)
    cpu_before = cpu_seconds(router_pid)
    routed_rate = await drive(router_target, args.throughput_clients, 1, None, args.duration_s)
    router_cpu = (cpu_seconds(router_pid) - cpu_before) / routed_rate.seconds
    driver.close()
    added = {f"added_p{q}_ms": round(percentile(routed.ttft_ms, q) - percentile(direct.ttft_ms, q), 3)
             for q in (50, 90, 99)}
    results = {"latency": {"direct": summary(direct), "router": summary(routed), **added,
                           "router_internal_added": internal, "router_cpu_fraction": round(latency_cpu, 2)},
               "throughput": {"direct": summary(direct_rate), "router": summary(routed_rate),
                              "router_cpu_fraction": round(router_cpu, 2)},
               "load_average": os.getloadavg(),
               "settings": {k: v for k, v in vars(args).items() if k not in ("plot", "json")}}
    if args.plot:
        plot(args.plot, direct, routed, {"direct (client sends both halves)": direct_rate.rate,
                                         "through router": routed_rate.rate}, args.streams)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Measure the latency the router adds and the rate it sustains.")
    parser.add_argument("--streams", type=int, default=100, help="concurrent streams in the latency phase")
    parser.add_argument("--per-stream", type=int, default=10, help="requests per stream in the latency phase")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per stub stream")
    parser.add_argument("--token-interval-s", type=float, default=0.02, help="stub pacing between tokens")
    parser.add_argument("--throughput-clients", type=int, default=32)
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--client-procs", type=int, default=1, help="processes the clients are spread over")
    parser.add_argument("--router-cpu", default="0", help="core for the router (taskset); 'none' to not pin")
    parser.add_argument("--stub-cpu", default="1", help="core for stubs and clients; 'none' to not pin")
    parser.add_argument("--plot", default=None, help="PNG path for the plot (needs matplotlib)")
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    router_cpu = None if args.router_cpu == "none" else args.router_cpu
    stub_cpu = None if args.stub_cpu == "none" else args.stub_cpu
    if stub_cpu is not None and hasattr(os, "sched_setaffinity") and shutil.which("taskset"):
        os.sched_setaffinity(0, {int(c) for c in stub_cpu.split(",")})
    prefill_port, decode_port, router_port = free_port(), free_port(), free_port()
    stub_cmd = [sys.executable, "-m", "pdserve_router.stub", "--prefill-ports", str(prefill_port), "--decode-ports",
                str(decode_port), "--no-couple", "--token-interval-s", str(args.token_interval_s)]
    router_cmd = [sys.executable, "-m", "pdserve_router", "--prefill", f"http://127.0.0.1:{prefill_port}",
                  "--decode", f"http://127.0.0.1:{decode_port}", "--port", str(router_port), "--log-level", "warning"]
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


if __name__ == "__main__":
    main()
