"""Static look at the split-KV decode kernel's main loop (no GPU needed): compiles it for sm_90 with Triton's own
ptxas at the engine's batch-64 config (block 128, 4 warps, 3 stages, llama-3.1-8b heads) for bf16 and FP8 pages,
and counts the SASS instructions of the loop (the longest backward branch).  python decode_sass.py"""

import collections
import inspect
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pdserve.kernels.attention import _decode_split_kernel

NAMES = list(inspect.signature(_decode_split_kernel.fn).parameters)


def compile_sass(kv: str) -> str:
    ptrs = dict(Q="*bf16", K=f"*{kv}", V=f"*{kv}", PageTable="*i32", SeqLens="*i32", Out="*bf16", PartialO="*fp32",
                PartialLse="*fp32")
    consts = dict(GROUP=4, BLOCK_H=16, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=128, MAX_SPLITS=2, MIN_SPLIT_LEN=256,
                  FP16_DOTS=kv != "bf16")
    sig = {n: ptrs.get(n, "constexpr" if n in consts else "fp32" if n in ("sm_scale_log2", "v_scale") else "i32")
           for n in NAMES}
    aligned = [n for n in NAMES if n in ptrs or (n.startswith("stride") and n != "stride_pb")]  # as launches see them
    src = ASTSource(fn=_decode_split_kernel, signature=sig,
                    constexprs={(NAMES.index(k),): v for k, v in consts.items()},
                    attrs={(NAMES.index(n),): [["tt.divisibility", 16]] for n in aligned})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([triton.__path__[0] + "/backends/nvidia/bin/cuobjdump", "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout


def loop_opcodes(sass: str) -> collections.Counter:
    ins = [(int(m[1], 16), m[2]) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    back = [(int(m[1], 16), a) for a, t in ins if (m := re.search(r"BRA 0x([0-9a-f]+)", t)) and int(m[1], 16) < a]
    start, end = max(back, key=lambda b: b[1] - b[0])
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for a, t in ins if start <= a <= end)


for kv in ("bf16", "fp8e4nv"):
    ops = loop_opcodes(compile_sass(kv))
    shown = {k: v for k, v in sorted(ops.items()) if k.startswith(("LDGSTS", "LDS", "F2FP", "HMMA", "IMAD", "MUFU"))}
    print(f"{kv}: {sum(ops.values())} instructions a loop iteration (128 tokens): {shown}")
