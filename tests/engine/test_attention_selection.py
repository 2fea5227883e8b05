"""Attention backend selection (no GPU needed): on CUDA a model whose head size the Triton kernels lack falls back
to torch_native with one log line, whether the backend was picked by `auto` or named; supported shapes keep the
fast backend; CPU always gets torch_native."""

from __future__ import annotations

import logging

import pytest

from pdserve.attention import selection
from pdserve.attention.selection import resolve_backend_name


@pytest.fixture
def triton_present(monkeypatch):
    monkeypatch.setattr(selection, "triton_installed", lambda: True)


@pytest.mark.parametrize("requested", ["auto", "sdpa", "triton"])
@pytest.mark.parametrize("head_dim", [80, 96, 256])
def test_unsupported_head_size_on_cuda_falls_back_with_one_log_line(requested, head_dim, triton_present, caplog):
    with caplog.at_level(logging.INFO, logger="pdserve.attention.selection"):
        assert resolve_backend_name(requested, "cuda", head_dim, 16) == "torch_native"
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert f"head_dim 64 and 128, the model has {head_dim}" in record.getMessage()
    assert "using torch_native" in record.getMessage()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_supported_head_size_on_cuda_keeps_the_triton_backends(head_dim, triton_present, caplog):
    assert resolve_backend_name("auto", "cuda", head_dim, 16) == "sdpa"
    assert resolve_backend_name("triton", "cuda", head_dim, 16) == "triton"
    assert not caplog.records


def test_page_size_that_is_not_a_power_of_two_falls_back(triton_present):
    assert resolve_backend_name("auto", "cuda", 128, 12) == "torch_native"


def test_missing_triton_falls_back(monkeypatch):
    monkeypatch.setattr(selection, "triton_installed", lambda: False)
    assert resolve_backend_name("auto", "cuda", 128, 16) == "torch_native"


@pytest.mark.parametrize("head_dim", [64, 80, 256])
def test_cpu_gets_torch_native_silently(head_dim, caplog):
    assert resolve_backend_name("auto", "cpu", head_dim, 16) == "torch_native"
    assert resolve_backend_name("torch_native", "cuda", head_dim, 16) == "torch_native"
    assert not caplog.records


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown attention backend 'flashinfer'"):
        resolve_backend_name("flashinfer", "cuda", 128, 16)
