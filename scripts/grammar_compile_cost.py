"""Host CPU cost of compiling the constrained benchmark's 20-property schema for a preset's tokenizer, with no
server and no weights (the preset's tokenizer only):   python scripts/grammar_compile_cost.py [--preset P]

Prints the one-time tokenizer preparation (xgrammar's TokenizerInfo, paid by a server's warm-up), the first
20-property schema (cold: its rules are new to the compiler; most of it is the token masks of its 32-character string
bound's states, spread over the compile threads), and fresh schemas that differ from it in names only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from pdserve.bench.cli import bench_parser
from pdserve.bench.constrained import compile_schema
from pdserve.constrained.compiler import GrammarCompiler, GrammarSpec, compile_threads
from pdserve.tools.make_model import PRESETS, write_tokenizer


def since_ms(started: float) -> float:
    return 1000 * (time.perf_counter() - started)


def compile_ms(compiler: GrammarCompiler, nonce: str) -> float:
    started = time.perf_counter()
    compiler.compile(GrammarSpec("json_schema", json.dumps(compile_schema(nonce))))
    return since_ms(started)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-3.1-8b", help="whose tokenizer")
    parser.add_argument("--fresh", type=int, default=5, help="schemas compiled after the first one")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    with tempfile.TemporaryDirectory() as folder:
        write_tokenizer(preset, Path(folder))
        tokenizer = AutoTokenizer.from_pretrained(folder)
    started = time.perf_counter()
    compiler = GrammarCompiler(lambda: tokenizer, preset.vocab_size, [tokenizer.eos_token_id], any_whitespace=False)
    compiler.vocabulary.result()
    prepare = since_ms(started)
    first = compile_ms(compiler, "first")
    fresh = [compile_ms(compiler, f"fresh{index}") for index in range(args.fresh)]
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; preset {args.preset} "
          f"(vocab {preset.vocab_size}); {compile_threads()} compile threads")
    print(f"tokenizer preparation {prepare:.0f} ms; first 20-property schema {first:.1f} ms; "
          f"fresh names median {statistics.median(fresh):.1f} ms ({', '.join(f'{t:.1f}' for t in fresh)})")


if __name__ == "__main__":
    main()
