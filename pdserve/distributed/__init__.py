"""Tensor parallelism: `tensor_parallel.TPGroup`, the rank group every sharded layer and the scheduler's
message broadcast go through, on a port `pdserve.ports.free_port` picks."""
