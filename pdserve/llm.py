"""Offline batch generation: `LLM(model_path, **engine_args).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from tqdm import tqdm

from pdserve.config import ServerArgs
from pdserve.sampling_params import SamplingParams, check_prompt
from pdserve.scheduler.request import Req
from pdserve.scheduler.scheduler import Scheduler
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
    def __init__(self, model_path: str, **engine_args):
        self.args = ServerArgs.from_kwargs(model_path, **engine_args)
        self.tokenizer = load_tokenizer(self.args)
        self.scheduler = Scheduler(self.args, tokenizer=self.tokenizer)
        self.warmup = None if self.args.skip_server_warmup else warm_up(self.scheduler)
        self._ids = itertools.count()

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
        pending = {r.rid for r in reqs}
        with tqdm(total=len(reqs), desc="Generating", disable=not use_tqdm, unit="req") as bar:
            while pending:
                for out in self.scheduler.step():
                    if out.finish_reason is not None and out.rid in pending:
                        pending.discard(out.rid)
                        bar.update(1)
            while self.scheduler.has_work():  # read back the last launched batch, release its pages
                self.scheduler.step()
        return [self._make_output(r) for r in reqs]

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
