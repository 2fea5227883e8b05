"""Tensor parallelism: `tensor_parallel.TPGroup`, the rank group every sharded layer and the scheduler's
message broadcast go through; `rendezvous` (torch-free) picks where the ranks meet."""
