"""Continuous batching over a paged KV pool; the PD roles extend `Scheduler` in `pdserve.disagg`."""
