"""Test selection: the `gpu` marker is the one way GPU tests are chosen; they skip, with the reason,
where torch sees no CUDA GPU. Integration tests (`integration` marker) need HOLOSERVE_DATA_DIR."""
import importlib.util

import pytest


def _cuda() -> str | None:
    """None when a CUDA GPU is usable, else why not."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return f"needs a CUDA GPU: torch {torch.__version__} sees none on this machine"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    reason = _cuda()
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))


# tiny exported checkpoints, built once per test process (tests.helpers.serving.tiny_checkpoint)
@pytest.fixture(scope="module")
def sst2():
    from tests.helpers.serving import tiny_checkpoint

    return tiny_checkpoint("sst2")


@pytest.fixture(scope="module")
def mrpc():
    from tests.helpers.serving import tiny_checkpoint

    return tiny_checkpoint("mrpc")


@pytest.fixture(scope="module")
def stsb():
    from tests.helpers.serving import tiny_checkpoint

    return tiny_checkpoint("stsb")


def _build_kernels(tmp_path_factory, flavour: str):
    """(cache folder, library): one real build of the 2:4 kernels' `flavour` for the whole run, made as a
    builder without VBMI would make it (building never consults the CPU). Skips without OpenVINO or g++."""
    import shutil

    pytest.importorskip("openvino")
    if shutil.which("g++") is None:
        pytest.skip("no g++ to build the 2:4 kernels with")
    from holoserve import kernels

    cache = tmp_path_factory.mktemp(f"kernel-cache-{flavour}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(kernels.CACHE_ENV, str(cache))
        mp.delenv("CXX", raising=False)
        mp.setattr(kernels, "cpu_flags", lambda: set())
        path = kernels.build(flavour=flavour)
    return cache, path


@pytest.fixture(scope="session")
def kernel_build(tmp_path_factory):
    """The AVX-512 build (the one served), built once per run: (cache folder, library)."""
    return _build_kernels(tmp_path_factory, "avx512")


@pytest.fixture(scope="session")
def kernel_reference_build(tmp_path_factory):
    """The portable reference build (runs on any x86-64 CPU), built once per run: (cache folder, library)."""
    return _build_kernels(tmp_path_factory, "reference")
