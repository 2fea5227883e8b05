"""Tensor parallelism: the rank group every sharded layer and the scheduler's broadcast go through."""

from pdserve.distributed.tensor_parallel import TPGroup, init_tp_group, kv_heads_per_rank

__all__ = ["TPGroup", "init_tp_group", "kv_heads_per_rank"]
