"""Continuous batching over a paged KV pool; a `Scheduler` holds a role (`role.py`), the PD roles live in `pdserve.disagg`."""
