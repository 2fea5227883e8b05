"""Turns the last-position logits of a batch into next tokens (and logprobs), per-request parameters.

Logits arrive in the model's dtype (bf16 on a GPU); only what needs float32 casts: penalties (applied to a float32
copy) and logprobs (log-softmax of the rows that asked). Three ways to a token:
- all rows greedy: argmax of the logits as they are;
- no row filters (top-k / top-p / min-p): `gumbel_max_sample`, one read of the logits, greedy rows by argmax and
  the others by Gumbel-max over logits / T with counter-based Philox noise keyed by `gumbel_rng` = [seed, step] on
  the device, the step advanced on the device by every call. `ModelRunner.decode_tokens` runs it inside the decode
  CUDA graph (batches of greedy or temperature-only rows, the common case), so such a decode step samples with no
  [B, V] float32 intermediate and no launch outside the graph; on a CPU it runs the same sampling eagerly through
  the torch reference of the same random stream;
- rows with filters: the sort-free torch sampler (`kernels/sampling.py::sample`) with the torch generator.
Rows with their own seed then draw again with a generator of their own, so their tokens do not depend on the batch.
Both random states start from `--random-seed` and `reseed` puts them back (the warm-up does, before serving).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.forward_batch import to_device
from pdserve.kernels.sampling import gumbel_max_sample, sample
from pdserve.sampling_params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one request at this step."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    suppressed_ids: list[int]  # tokens that may not be sampled yet (EOS/stop before min_tokens)
    num_logprobs: int | None  # None: no logprobs; k >= 0: sampled token's logprob + top-k


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling parameters on the device, built once per batch composition (one host-to-device copy)."""

    temperatures: torch.Tensor  # [B] float32, 0 for greedy rows
    top_ks: torch.Tensor  # [B] int64, 0 for no limit
    top_ps: torch.Tensor  # [B] float32
    min_ps: torch.Tensor  # [B] float32
    all_greedy: bool
    any_filter: bool
    any_penalties: bool
    seeded_rows: list[int]  # rows sampled with their own seeded generator

    @property
    def temperature_only(self) -> bool:
        """Every row greedy or sampled from softmax(logits / T) alone: `gumbel_max_sample` draws the whole batch."""
        return not (self.any_filter or self.any_penalties or self.seeded_rows)

    @classmethod
    def of(cls, params: list[SamplingParams], device: torch.device) -> SamplingTensors:
        temps = [0.0 if p.is_greedy else p.temperature for p in params]
        top_ks = [float(max(p.top_k, 0)) for p in params]  # exact in float32 (vocab sizes < 2^24)
        packed = to_device([*temps, *top_ks, *(p.top_p for p in params), *(p.min_p for p in params)],
                           torch.float32, device).view(4, len(params))
        return cls(
            temperatures=packed[0], top_ks=packed[1].long(), top_ps=packed[2], min_ps=packed[3],
            all_greedy=all(p.is_greedy for p in params),
            any_filter=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params),
            any_penalties=any(p.has_penalties for p in params),
            seeded_rows=[i for i, p in enumerate(params) if p.seed is not None and not p.is_greedy],
        )


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), device=logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and row.output_ids:
            ids = torch.tensor(row.output_ids, device=logits.device)
            counts = torch.zeros(logits.shape[1], device=logits.device).index_add_(
                0, ids, torch.ones(len(row.output_ids), device=logits.device)
            )
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if row.suppressed_ids:
            logits[i, row.suppressed_ids] = float("-inf")


def _seeded_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * _SEED_MIX + step) % (2**63))
    return g


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.gumbel_rng = torch.zeros(2, dtype=torch.int64, device=device)  # [seed, step]; a CUDA graph reads it
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        """Both random states as they were at start with this seed."""
        self.generator.manual_seed(seed)
        self.gumbel_rng.copy_(torch.tensor([seed % 2**63, 0]))

    def sample_temperature_only(self, logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        """Next tokens [B] on the device for rows greedy (T <= 0) or sampled at temperature T, nothing else."""
        return gumbel_max_sample(logits, temperatures, self.gumbel_rng)

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow], tensors: SamplingTensors | None = None
               ) -> SampleResult:
        """logits: [B, V] in any float dtype, one row per request."""
        token_list = self.sample_tokens(logits, rows, tensors).tolist()
        return SampleResult(token_list, *self._logprobs(logits, token_list, rows))

    def sample_tokens(self, logits: torch.Tensor, rows: list[SamplingRow], tensors: SamplingTensors | None = None
                      ) -> torch.Tensor:
        """Next tokens as a device tensor [B]; no host sync. `tensors`: the rows' parameters already on the
        device (else they are uploaded now)."""
        penalties = tensors.any_penalties if tensors is not None else any(r.params.has_penalties for r in rows)
        if penalties or any(r.suppressed_ids for r in rows):
            logits = logits.to(torch.float32, copy=True)  # a copy: the caller's logits stay as they are
            apply_penalties(logits, rows)
        if tensors.all_greedy if tensors is not None else all(r.params.is_greedy for r in rows):
            return logits.argmax(dim=-1)
        return self._sample_random(logits, rows, tensors or SamplingTensors.of([r.params for r in rows], logits.device))

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow], t: SamplingTensors) -> torch.Tensor:
        if t.any_filter:
            tokens = sample(logits, t.temperatures, t.top_ks, t.top_ps, t.min_ps, generator=self.generator)
        else:
            tokens = self.sample_temperature_only(logits, t.temperatures)
        for i in t.seeded_rows:
            g = _seeded_generator(rows[i].params.seed, len(rows[i].output_ids), logits.device)
            one = slice(i, i + 1)
            tokens[i] = sample(logits[one], t.temperatures[one], t.top_ks[one], t.top_ps[one], t.min_ps[one],
                               generator=g)[0]
        return tokens

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: list[int], rows: list[SamplingRow]):
        wanted = [i for i, r in enumerate(rows) if r.num_logprobs is not None]
        if not wanted:
            return None, None
        logprobs: list[float] = [0.0] * len(rows)
        tops: list[list[tuple[int, float]]] = [[] for _ in rows]
        lp = torch.log_softmax(raw[wanted].float(), dim=-1)
        chosen = lp[torch.arange(len(wanted)), torch.tensor([tokens[i] for i in wanted])].tolist()
        max_k = max(rows[i].num_logprobs for i in wanted)
        top_vals, top_ids = lp.topk(max_k, dim=-1) if max_k else (None, None)
        for j, i in enumerate(wanted):
            logprobs[i] = chosen[j]
            k = rows[i].num_logprobs
            if k:
                tops[i] = list(zip(top_ids[j, :k].tolist(), top_vals[j, :k].tolist()))
        return logprobs, tops


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """The logprob of each prompt token `targets[j]` under logits row j, and that row's top `k` (token, logprob)
    pairs (empty lists when k is 0)."""
    lp = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None]).squeeze(1).tolist()
    if not k:
        return chosen, [[] for _ in chosen]
    tops = lp.topk(k, dim=-1)
    return chosen, [list(zip(ids, values)) for ids, values in zip(tops.indices.tolist(), tops.values.tolist())]
