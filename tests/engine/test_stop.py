"""StopChecker: the per-request StopCriteria path decides exactly what the direct reading of the parameters does."""

from __future__ import annotations

import random
from types import SimpleNamespace

from pdserve.sampling_params import SamplingParams, check_prompt
from pdserve.scheduler.request import FinishReason, Req
from pdserve.scheduler.stop import StopChecker

EOS = (2, 7)
CONTEXT_LEN = 40


class CharTokenizer:
    """Token t decodes to one letter, so stop strings can start and end inside any token."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + t % 4) for t in ids)


def reference_check(req: Req, tokenizer: CharTokenizer) -> FinishReason | None:
    """The conditions read straight from the request at every token (the checker before StopCriteria)."""
    p, out = req.sampling_params, req.output_ids
    if len(out) >= p.min_tokens:
        if not p.ignore_eos and out[-1] in EOS:
            return FinishReason("stop", matched=out[-1])
        if out[-1] in p.stop_token_ids:
            return FinishReason("stop", matched=out[-1])
        tail = out[-(max(map(len, p.stop), default=0) + 8) :]
        for stop in p.stop:
            if stop in tokenizer.decode(tail) and stop not in tokenizer.decode(tail[:-1]):
                return FinishReason("stop", matched=stop)
    if len(out) >= p.max_tokens or len(req.input_ids) + len(out) >= CONTEXT_LEN:
        return FinishReason("length")
    return None


def reference_suppressed(req: Req) -> list[int]:
    p = req.sampling_params
    if len(req.output_ids) >= p.min_tokens:
        return []
    return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(EOS)))


def random_params(rng: random.Random) -> SamplingParams:
    max_tokens = rng.randrange(0, 30)
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=rng.randrange(0, max_tokens + 1),
        ignore_eos=rng.random() < 0.3,
        stop_token_ids=rng.sample(range(12), rng.randrange(0, 3)),
        stop=["".join(rng.choice("abcd") for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(0, 3))],
    )


def test_criteria_path_equals_direct_reading_on_random_requests():
    tokenizer = CharTokenizer()
    checker = StopChecker(SimpleNamespace(), SimpleNamespace(eos_token_ids=EOS), tokenizer)
    rng = random.Random(0)
    stops = 0
    for case in range(3000):
        input_ids, params = [3] * rng.randrange(1, CONTEXT_LEN), random_params(rng)
        check_prompt(input_ids, params, vocab_size=12, context_len=CONTEXT_LEN)  # clamps max_tokens to the room
        req = Req(rid=str(case), input_ids=input_ids, sampling_params=params)
        while True:
            assert checker.suppressed_ids(req) == reference_suppressed(req)
            req.output_ids.append(rng.randrange(12))
            got, want = checker.check(req), reference_check(req, tokenizer)
            assert (got and got.to_dict()) == (want and want.to_dict()), (case, req.output_ids, req.sampling_params)
            if want is not None:
                stops += want.type == "stop"
                break
    assert stops > 1000  # stop ids, EOS and stop strings all end requests, not only lengths
