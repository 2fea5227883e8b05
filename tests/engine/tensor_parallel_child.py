"""One engine's greedy run in a process of its own (`run_engine`, for tests/engine/test_tensor_parallel_gpu.py): a
hang or abort in it (NCCL's teardown among them) fails the test with this process's output instead of taking pytest
down. The process:

    python tests/engine/tensor_parallel_child.py REQUEST_JSON RESULT_JSON

REQUEST_JSON: {"model": path, "engine": {LLM keyword arguments}, "prompts": [[token ids]], "max_new": n}.
RESULT_JSON: the outputs, the prompt logprobs, whether the KV pool was free, the shutdown's seconds and the exit
codes of the follower ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OUTPUT_TAIL_CHARS = 6000


def run_engine(model: str, engine: dict, prompts: list[list[int]], max_new: int, folder: Path, limit_s: float) -> dict:
    """This file's process on `prompts` under `limit_s`; its result, or the test fails with its output's end."""
    folder.mkdir(parents=True, exist_ok=True)
    request, result = folder / "request.json", folder / "result.json"
    request.write_text(json.dumps({"model": model, "engine": engine, "prompts": prompts, "max_new": max_new}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:  # on the limit the child is killed; its followers die with it (PR_SET_PDEATHSIG)
        done = subprocess.run([sys.executable, __file__, str(request), str(result)], capture_output=True, text=True,
                              timeout=limit_s, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{engine} did not finish in {limit_s} s; its output ends:\n{_tail(exc.stdout, exc.stderr)}")
    if done.returncode != 0 or not result.exists():
        pytest.fail(f"{engine} exited {done.returncode}; its output ends:\n{_tail(done.stdout, done.stderr)}")
    return json.loads(result.read_text())


def _tail(*streams: str | bytes | None) -> str:
    text = "".join(s.decode(errors="replace") if isinstance(s, bytes) else (s or "") for s in streams)
    return text[-OUTPUT_TAIL_CHARS:]


def exit_with(code: int) -> None:
    """A follower rank that dies before it reaches the rendezvous (spawned by the start-up watch's tests)."""
    os._exit(code)


def join_then_exit(port: int, code: int) -> None:
    """A follower rank that joins the gloo group, then dies before the leader's first collective."""
    import torch

    from pdserve.distributed.tensor_parallel import init_tp_group

    init_tp_group(2, 1, port, torch.device("cpu"))
    os._exit(code)


def main(request_path: str, result_path: str) -> None:
    from pdserve import LLM, SamplingParams

    request = json.loads(Path(request_path).read_text())
    llm = LLM(request["model"], **request["engine"])
    followers = llm._shutdown.peek()[2][0]  # _stop_ranks's arguments: the follower processes, the group
    params = SamplingParams(temperature=0, max_tokens=request["max_new"], ignore_eos=True, prompt_logprobs=0,
                            logprob_start_len=0)
    try:
        outs = llm.generate(request["prompts"], params, use_tqdm=False)
        pool_free = bool(llm.scheduler.kv_pool_is_fully_free())
    finally:
        start = time.monotonic()
        llm.shutdown()
        shutdown_s = time.monotonic() - start
    Path(result_path).write_text(json.dumps({
        "outputs": [o.token_ids for o in outs],
        "prompt_logprobs": [[lp for lp in o.prompt_logprobs if lp is not None] for o in outs],
        "pool_free": pool_free,
        "shutdown_s": shutdown_s,
        "follower_exit_codes": [p.exitcode for p in followers],
    }))


if __name__ == "__main__":
    main(*sys.argv[1:])
