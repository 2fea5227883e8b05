"""A transfer peer in its own process: owns a KV pool and a receive staging of 4 MiB, registers both, and answers
"dump", "zero" (then dump), ("stage", room, pages) (a staging slot's address), ("unpack", room, page list) (then
dump) and "stop"."""

from __future__ import annotations

import multiprocessing as mp

import torch

from pdserve.disagg.transfer import layout_from_description, make_transfer_engine
from pdserve.disagg.transfer.receive_staging import ReceiveStaging
from pdserve.mem_cache.kv_pool import KVLayout, KVPool


def serve_kv(backend: str, device: str, layout_desc: dict, conn) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    engine = make_transfer_engine(backend, device)
    try:
        pool = KVPool(layout_from_description(layout_desc), device)
        engine.register(pool.data_ptr, pool.nbytes, device)
        staging = ReceiveStaging(engine, pool, 4 << 20)
        conn.send({"session": engine.session_id(), "base": pool.data_ptr, "transport": engine.transport()})
        while conn.poll(120):
            cmd = conn.recv()
            if cmd == "stop":
                break
            if cmd == "zero":
                pool.buffer.zero_()
            elif cmd[0] == "stage":
                staging.offer(cmd[1], cmd[2])
                staging.ask(cmd[1])
                staging.grant()
                conn.send(staging.destination(cmd[1], staging.base).base)
                continue
            elif cmd[0] == "unpack":
                staging.unpack(cmd[1], cmd[2])
                staging.collect()
            conn.send(kv_bytes(pool))
    finally:
        engine.close()


def kv_bytes(pool: KVPool) -> bytes:
    return pool.buffer.view(torch.uint8).cpu().numpy().tobytes()


def start_peer(backend: str, device: str, layout: KVLayout):
    """(process, pipe, hello) for a peer serving a zeroed KV pool of `layout`."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=serve_kv, args=(backend, device, layout.describe(), child), daemon=True)
    proc.start()
    if not parent.poll(120):
        proc.kill()
        raise TimeoutError(f"{backend} peer did not start")
    return proc, parent, parent.recv()


def stop_peer(proc, conn) -> None:
    try:
        conn.send("stop")
    except (BrokenPipeError, OSError):
        pass
    proc.join(30)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
