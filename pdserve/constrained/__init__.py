"""Constrained decoding (structured output) over xgrammar: grammar specs, a compile cache off the scheduler's
thread, per-request matchers and the token bitmask applied to the logits before sampling.

xgrammar is one of pdserve's dependencies; where it does not import, or with `--grammar-backend none`, a request
that asks for a grammar is refused with a message naming what is missing.
"""
