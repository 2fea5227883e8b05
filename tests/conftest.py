from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from cluster_util import (SHARED_COLOCATED_ARGS, SHARED_PREFILL_ARGS, PDCluster, decode_server, free_port,
                          prefill_server, release_after_last_user, releases_due, router, server, start_with_router,
                          stop_all)

from pdserve.tools.make_model import make_model


@pytest.hookimpl(tryfirst=True)  # before `-m gpu` selects: the fp8_gpu and multi_gpu tests carry the gpu mark by then
def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` (see pyproject.toml) are skipped where torch sees no CUDA device, those marked `fp8_gpu`
    also where the GPU has no FP8 tensor cores (before sm89), those marked `multi_gpu` where it sees fewer than two;
    those marked `tuner_sweep` unless the `-m` expression names them."""
    from pdserve.quantization.fp8 import has_fp8_gemm

    cuda = torch.cuda.is_available()
    fp8 = cuda and has_fp8_gemm(torch.device("cuda"))
    gpus = torch.cuda.device_count() if cuda else 0
    sweeps = "tuner_sweep" in (config.getoption("markexpr") or "")
    for item in items:
        if "tuner_sweep" in item.keywords and not sweeps:
            item.add_marker(pytest.mark.skip(reason="an exhaustive sweep: select it with -m tuner_sweep"))
        if "fp8_gpu" in item.keywords or "multi_gpu" in item.keywords:
            item.add_marker(pytest.mark.gpu)
        if "fp8_gpu" in item.keywords and not fp8:
            item.add_marker(pytest.mark.skip(reason="needs FP8 tensor cores (sm89+)"))
        elif "multi_gpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two GPUs (nvidia-h200-x2)"))
        elif "gpu" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


class TinyModels(dict):
    """Folder of each random-weight preset (seed 0; the tiny ones, or an exact shape for GPU tests), built once,
    on first use."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, preset: str) -> str:
        self[preset] = str(make_model(preset, self.root / preset, seed=0))
        return self[preset]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_model(tiny_models) -> str:
    """The tiny qwen3 model most tests serve."""
    return tiny_models["qwen3-tiny"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test's teardown, stop the session fixtures (`release_after_last_user`) no later test uses."""
    yield
    for stop in releases_due(item):
        stop()


@pytest.fixture(scope="session")
def shared_servers(request, tiny_model) -> Iterator[dict]:
    """One colocated server and one tcp prefill + decode pair behind a router, real processes on loopback, started
    in one parallel batch and shared by the bench, fuzz and PD tests (each used to start its own set): the tests
    leave every pool free. Stopped after the last test that uses them."""
    colocated = server("colocated", tiny_model, *SHARED_COLOCATED_ARGS)
    bootstrap = free_port()
    prefill = prefill_server(tiny_model, "tcp", bootstrap, *SHARED_PREFILL_ARGS)
    decode = decode_server(tiny_model, "tcp")
    servers = [colocated, prefill, decode]
    pd_router = start_with_router(servers, lambda: router([(prefill, bootstrap)], [decode], name="router-tcp"))
    stop = release_after_last_user(request, lambda: stop_all([pd_router, *servers]))
    yield {"colocated": colocated, "tcp": PDCluster("tcp", prefill, bootstrap, decode, pd_router)}
    stop()
