"""Offline batch generation: `LLM(model_path, **engine_args).generate(prompts, sampling_params)`."""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import weakref
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import torch
from tqdm import tqdm

from pdserve.config import ServerArgs
from pdserve.distributed.tensor_parallel import CLOSE_TIMEOUT, FollowerWatch, TPGroup, abort_group
from pdserve.engine.model_runner import load_runner
from pdserve.hub import with_local_model
from pdserve.ports import free_port
from pdserve.messages import TokenizedGenerateReq, TokenOut, encode
from pdserve.process_setup import stop_children
from pdserve.sampling_params import SamplingParams, check_prompt
from pdserve.scheduler.request import Req
from pdserve.scheduler.scheduler import Scheduler
from pdserve.scheduler_main import run_scheduler_process, scheduler_process_name
from pdserve.scheduler.warmup import warm_up
from pdserve.tokenizer import load_tokenizer


@dataclass(slots=True)
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: dict
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None
    cached_tokens: int = 0


class LLM:
    """With `tp_size` N > 1 this process is rank 0 and N - 1 scheduler processes are spawned for the other
    ranks; each step's new requests are broadcast to them first, as the server's leader rank does."""

    def __init__(self, model_path: str, **engine_args):
        self.args = with_local_model(ServerArgs.from_kwargs(model_path, **engine_args))
        if self.args.tp_size > 1 and self.args.nccl_port is None:
            self.args = self.args.replace(nccl_port=free_port())
        self.tokenizer = load_tokenizer(self.args)
        followers = _spawn_followers(self.args)
        try:
            with FollowerWatch(followers):  # a follower's death fails the start at once, naming the rank
                self.scheduler = Scheduler(self.args, load_runner(self.args), tokenizer=self.tokenizer)
                # every rank warms up the same way (scheduler/process.py's run_scheduler_process), then meets here
                self.warmup = None if self.args.skip_server_warmup else warm_up(self.scheduler)
                self.scheduler.runner.tp.barrier()
        except BaseException:
            abort_group()  # a follower may be gone: leave without waiting for it
            stop_children(followers)
            raise
        self._shutdown = weakref.finalize(self, _stop_ranks, followers, self.scheduler.runner.tp)
        self._outbox: list[bytes] = []  # requests the other ranks get before the next step
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the other ranks' processes, leave the group (also done when the LLM is garbage-collected) and give
        the engine's device memory back, so another engine fits in this process; the LLM cannot generate after."""
        self._shutdown()
        del self.scheduler
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        prompt_list = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else prompts
        params = sampling_params or SamplingParams()
        param_list = params if isinstance(params, list) else [params] * len(prompt_list)
        if len(param_list) != len(prompt_list):
            raise ValueError(f"{len(prompt_list)} prompts but {len(param_list)} sampling params")
        reqs = [self._make_req(p, sp) for p, sp in zip(prompt_list, param_list)]
        for req in reqs:
            self.scheduler.validate(req)
        for req in reqs:
            self.scheduler.add_request(req)
            self._outbox.append(encode(TokenizedGenerateReq(req.rid, req.input_ids, req.sampling_params.to_dict())))
        pending = {r.rid for r in reqs}
        with tqdm(total=len(reqs), desc="Generating", disable=not use_tqdm, unit="req") as bar:
            while pending:
                for out in self._step():
                    if out.finish_reason is not None and out.rid in pending:
                        pending.discard(out.rid)
                        bar.update(1)
            while self.scheduler.has_work():  # read back the last launched batch, release its pages
                self._step()
        return [self._make_output(r) for r in reqs]

    def _step(self) -> list[TokenOut]:
        self.scheduler.runner.tp.broadcast_messages(self._outbox)
        self._outbox = []
        return self.scheduler.step()

    def _make_req(self, prompt: str | list[int], params: SamplingParams) -> Req:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = SamplingParams.from_dict(params.to_dict())
        check_prompt(ids, params, self.scheduler.model_config.vocab_size, self.scheduler.context_len)
        return Req.of(f"offline-{next(self._ids)}", ids, params)

    def _make_output(self, req: Req) -> RequestOutput:
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=req.sampling_params.skip_special_tokens)
        reason = req.finish_reason
        if reason is not None and reason.type == "stop" and isinstance(reason.matched, str):
            text = text[: text.find(reason.matched)] if reason.matched in text else text
        return RequestOutput(
            prompt_token_ids=req.input_ids,
            token_ids=req.output_ids,
            text=text,
            finish_reason=reason.to_dict() if reason else {"type": "abort"},
            logprobs=req.output_logprobs if req.return_logprob else None,
            top_logprobs=req.output_top_logprobs if req.return_logprob else None,
            prompt_logprobs=req.input_logprobs if req.logprob_start_len >= 0 else None,
            cached_tokens=req.num_prefix_hit,
        )


def _stop_ranks(followers: list[BaseProcess], tp: TPGroup) -> None:
    """Close the group with the followers (they leave it and exit), then stop any that did not exit in time."""
    try:
        tp.close()
    finally:
        for process in followers:
            process.join(CLOSE_TIMEOUT.total_seconds())
        stop_children(followers)


def _spawn_followers(args: ServerArgs) -> list[BaseProcess]:
    ctx = multiprocessing.get_context("spawn")
    followers = [ctx.Process(target=run_scheduler_process, args=(args.replace(tp_rank=rank),),
                             name=scheduler_process_name(rank), daemon=True) for rank in range(1, args.tp_size)]
    for process in followers:
        process.start()
    return followers
