"""A server with two tensor-parallel ranks (gloo on the CPU): it answers as HF does, and the death of any rank
takes the whole server down; a head count the TP size does not divide fails at start."""

from __future__ import annotations

import os
import re
import signal

import torch
from cluster_util import still_alive
from server_util import ServerProcess, api_server
from test_lifecycle import run_cli
from transformers import AutoModelForCausalLM

PROMPT = [5, 17, 99, 4, 250, 31, 8]
MAX_NEW = 8


def hf_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def tp2_server(model: str, log_path) -> ServerProcess:
    server = api_server(model, log_path)
    server.argv += ["--tp-size", "2", "--dtype", "float32"]
    return server.start()


def started_pid(log: str, process: str) -> int:
    return int(re.search(rf"started the {process} process \(pid (\d+)\)", log).group(1))


def test_tp2_server_matches_hf_and_dies_with_a_rank(tiny_model, tmp_path):
    server = tp2_server(tiny_model, tmp_path / "server.log")
    try:
        reply = server.post("/generate", {"input_ids": PROMPT, "sampling_params": {
            "temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}})
        assert reply.status == 200, reply.body
        assert reply.json()["output_ids"] == hf_greedy(tiny_model, PROMPT, MAX_NEW)
        assert server.get("/get_server_info").json()["tp_size"] == 2
        children = server.descendants()
        follower = started_pid(server.log(), "scheduler-tp1")
        os.kill(follower, signal.SIGKILL)
        assert server.proc.wait(30) == 1
        assert f"the scheduler-tp1 process (pid {follower}) exited with code -9" in server.log()
        assert still_alive(children) == []
    finally:
        server.stop()


def test_head_count_the_tp_size_does_not_divide_fails_at_start(tiny_model, tmp_path):
    result = run_cli("--model-path", tiny_model, "--device", "cpu", "--tp-size", "3", "--port", "0", timeout=180)
    assert result.returncode != 0
    assert "--tp-size 3 does not divide this model's num_attention_heads 4" in result.stderr, result.stderr[-2000:]
