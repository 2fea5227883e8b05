from __future__ import annotations

import numpy as np
import pytest
import torch


@pytest.fixture
def interpreted(monkeypatch):
    """Run the Triton kernels of pdserve.kernels on CPU tensors through Triton's interpreter.

    CPU-only: GPU runs test the real kernels (and Triton 3.6's interpreter and real compiles do not mix well in one
    process; seen on H200, 2026-11-21).
    """
    if torch.cuda.is_available():
        pytest.skip("interpreter tests run where there is no CUDA device")
    triton = pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    import triton.language as tl
    import triton.language.random as tl_random
    import triton.language.standard as tl_standard

    import pdserve.kernels.attention as attention
    import pdserve.kernels.fused as fused
    import pdserve.kernels.gumbel_sampling as gumbel_sampling
    import pdserve.kernels.pdl as pdl
    import pdserve.kernels.skinny_triton as skinny_triton
    import pdserve.quantization.fp8_triton as fp8_triton

    from triton.runtime import interpreter

    monkeypatch.setattr(triton.knobs.runtime, "interpret", True)
    # The interpreter holds scalars as 1-element arrays and int() of those fails on NumPy >= 2.4
    # (Triton 3.6 `for i in range(start, end)` with loaded bounds); index through the first element.
    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_tensor_index)

    # A @jit function called from a kernel patches triton.language for the interpreter and never restores it,
    # which breaks every later real compile in this process (tests/engine/test_compile_watch.py); restore on return.
    def device_call(self, *args, **kwargs):
        scope = interpreter._patch_lang(self.fn)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e
        finally:
            scope.restore()

    monkeypatch.setattr(interpreter.InterpretedFunction, "__call__", device_call)
    # Triton's own library functions (tl.cdiv, tl.sigmoid, tl.random.philox, ...) are jitted at import time as well.
    for module in (attention, fused, gumbel_sampling, pdl, skinny_triton, fp8_triton, tl, tl_random, tl_standard):
        for name, obj in list(vars(module).items()):
            if isinstance(obj, JITFunction):
                monkeypatch.setattr(module, name, interpreter.InterpretedFunction(obj.fn))


@pytest.fixture
def fp8_interpreted(interpreted, monkeypatch):
    """The interpreter rounds float -> FP8 wrong (Triton 3.6 adds the cut-off bit without carrying it into the
    exponent: 7.69 -> 4.0 in E5M2); the GPU's cvt.rn rounds to nearest even, as torch does, so cast through torch."""
    from triton.runtime import interpreter

    import triton.language as tl

    to_torch = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
    convert = interpreter._convert_float

    def convert_float(data, src, dst, rounding_mode):
        if dst in to_torch and src.primitive_bitwidth > 8:
            values = torch.from_numpy(np.asarray(data).astype(np.float32))
            return values.to(to_torch[dst]).view(torch.uint8).numpy().view(np.uint8).reshape(np.shape(data))
        return convert(data, src, dst, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert_float)
