"""Choosing the flash_attn backend (no GPU needed): every reason it cannot serve a model falls back to torch_native
with one log line naming it, `auto` takes it on a Hopper-or-newer GPU where FlashAttention-4 is installed and
`sdpa` on CUDA otherwise; the package is looked for without importing it, and one found that does not import is a
reason too."""

from __future__ import annotations

import logging
import sys

import pytest

from pdserve.attention import selection
from pdserve.attention.selection import flash_attn_import_error, flash_attn_installed, resolve_backend_name

HOPPER, BLACKWELL, AMPERE = (9, 0), (10, 0), (8, 0)
BF16 = "bfloat16"
FA4_DTYPES = "FlashAttention-4 computes in float16 or bfloat16"
FA4_HEAD_DIMS = "FlashAttention-4 supports head_dim multiples of 8 from 8 to 256"


@pytest.fixture
def kernels_present(monkeypatch):
    monkeypatch.setattr(selection, "triton_installed", lambda: True)
    monkeypatch.setattr(selection, "flash_attn_import_error", lambda: None)


def only_warning(caplog) -> str:
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert message.startswith("attention backend flash_attn cannot serve this model (")
    assert message.endswith("; using torch_native")
    return message


@pytest.mark.parametrize(
    "device_type,capability,dtype,head_dim,page_size,reason",
    [
        ("cpu", None, BF16, 128, 16, "FlashAttention-4 runs on CUDA GPUs only, the device is cpu"),
        ("cuda", None, BF16, 128, 16, "FlashAttention-4 needs the GPU's compute capability, which was not given"),
        ("cuda", AMPERE, BF16, 128, 16, "FlashAttention-4 needs compute capability 9.0 or newer, the GPU has 8.0"),
        ("cuda", (8, 9), BF16, 64, 16, "FlashAttention-4 needs compute capability 9.0 or newer, the GPU has 8.9"),
        ("cuda", HOPPER, "float32", 128, 16, f"{FA4_DTYPES}, the model runs in float32"),
        ("cuda", HOPPER, None, 128, 16, f"{FA4_DTYPES}, the model runs in None"),
        ("cuda", HOPPER, BF16, 36, 16, f"{FA4_HEAD_DIMS}, the model has 36"),
        ("cuda", HOPPER, BF16, 264, 16, f"{FA4_HEAD_DIMS}, the model has 264"),
        # FlashAttention-4 could, the Triton decode cannot
        ("cuda", HOPPER, BF16, 96, 16, "its Triton kernels support head_dim 64 and 128, the model has 96"),
        ("cuda", BLACKWELL, "float16", 256, 16, "its Triton kernels support head_dim 64 and 128, the model has 256"),
        ("cuda", HOPPER, BF16, 128, 12, "its Triton kernels need a power-of-two page size, got 12"),
    ],
)
def test_each_reason_falls_back_to_torch_native(device_type, capability, dtype, head_dim, page_size, reason,
                                                kernels_present, caplog):
    with caplog.at_level(logging.INFO, logger="pdserve.attention.selection"):
        assert resolve_backend_name("flash_attn", device_type, head_dim, page_size, capability, dtype) == "torch_native"
    assert f"({reason})" in only_warning(caplog)


def test_missing_flash_attn_falls_back_naming_the_extra(monkeypatch, caplog):
    monkeypatch.setattr(selection, "triton_installed", lambda: True)
    monkeypatch.setattr(selection, "flash_attn_installed", lambda: False)
    assert resolve_backend_name("flash_attn", "cuda", 128, 16, HOPPER, BF16) == "torch_native"
    assert "flash_attn.cute (FlashAttention-4) is not installed (pip install 'pdserve[flash-attn]')" in only_warning(
        caplog)


def test_flash_attn_that_does_not_import_falls_back(monkeypatch, caplog):
    monkeypatch.setattr(selection, "triton_installed", lambda: True)
    monkeypatch.setattr(selection, "flash_attn_import_error", lambda: "flash_attn.cute does not import: OSError()")
    assert resolve_backend_name("flash_attn", "cuda", 128, 16, HOPPER, BF16) == "torch_native"
    assert "(flash_attn.cute does not import: OSError())" in only_warning(caplog)
    assert resolve_backend_name("auto", "cuda", 128, 16, HOPPER, BF16) == "sdpa"


def test_missing_triton_falls_back(monkeypatch, caplog):
    monkeypatch.setattr(selection, "triton_installed", lambda: False)
    monkeypatch.setattr(selection, "flash_attn_import_error", lambda: None)
    assert resolve_backend_name("flash_attn", "cuda", 128, 16, HOPPER, BF16) == "torch_native"
    assert "(triton is not installed)" in only_warning(caplog)


@pytest.mark.parametrize("capability", [HOPPER, BLACKWELL])
@pytest.mark.parametrize("dtype", [BF16, "float16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_supported_models_keep_flash_attn_silently(capability, dtype, head_dim, page_size, kernels_present, caplog):
    assert resolve_backend_name("flash_attn", "cuda", head_dim, page_size, capability, dtype) == "flash_attn"
    assert resolve_backend_name("auto", "cuda", head_dim, page_size, capability, dtype) == "flash_attn"
    assert not caplog.records


@pytest.mark.parametrize(
    "device_type,capability,dtype,installed,chosen",
    [
        ("cuda", HOPPER, BF16, True, "flash_attn"),
        ("cuda", HOPPER, BF16, False, "sdpa"),
        ("cuda", AMPERE, BF16, True, "sdpa"),
        ("cuda", None, BF16, True, "sdpa"),
        ("cuda", HOPPER, "float32", True, "sdpa"),
        ("cpu", None, BF16, True, "torch_native"),
    ],
)
def test_auto_picks_flash_attn_only_where_it_runs(device_type, capability, dtype, installed, chosen, monkeypatch,
                                                  caplog):
    monkeypatch.setattr(selection, "triton_installed", lambda: True)
    monkeypatch.setattr(selection, "flash_attn_import_error", lambda: None if installed else "not installed")
    assert resolve_backend_name("auto", device_type, 128, 16, capability, dtype) == chosen
    assert not caplog.records


def test_auto_on_hopper_with_a_head_size_triton_lacks_falls_back(kernels_present, caplog):
    assert resolve_backend_name("auto", "cuda", 96, 16, HOPPER, BF16) == "torch_native"
    assert "the model has 96" in only_warning(caplog)


def test_unknown_backend_lists_flash_attn():
    with pytest.raises(ValueError, match="choose from auto, torch_native, triton, sdpa, flash_attn"):
        resolve_backend_name("flashinfer", "cuda", 128, 16, HOPPER, BF16)


@pytest.fixture
def import_path(tmp_path, monkeypatch):
    """An empty directory first on sys.path, and a clean slate for the `flash_attn` package."""
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    yield tmp_path
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        del sys.modules[name]


def test_flash_attn_cute_is_found_without_being_imported(import_path):
    cute = import_path / "flash_attn" / "cute"
    cute.mkdir(parents=True)
    (cute / "__init__.py").write_text("raise OSError('libcuda.so.13: cannot open shared object file')\n")
    assert flash_attn_installed()  # flash_attn is a namespace package, as in FA4's wheel
    assert "flash_attn.cute" not in sys.modules
    assert flash_attn_import_error() == (
        "flash_attn.cute (FlashAttention-4) does not import: OSError('libcuda.so.13: cannot open shared object file')")


def test_flash_attn_cute_that_imports(import_path):
    cute = import_path / "flash_attn" / "cute"
    cute.mkdir(parents=True)
    (cute / "__init__.py").write_text("def flash_attn_varlen_func(*args, **kwargs): ...\n")
    assert flash_attn_import_error() is None


def test_flash_attn_without_cute_is_not_flash_attention_4(import_path):
    (import_path / "flash_attn").mkdir()
    (import_path / "flash_attn" / "__init__.py").write_text("")  # FlashAttention 2's package has no cute
    assert not flash_attn_installed()


def test_no_flash_attn_package(import_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [str(import_path)])
    assert not flash_attn_installed()
    assert flash_attn_import_error() == (
        "flash_attn.cute (FlashAttention-4) is not installed (pip install 'pdserve[flash-attn]')")
