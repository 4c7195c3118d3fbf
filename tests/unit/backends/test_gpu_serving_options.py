"""The settings a GPU server is given for the dense baseline and for torch-cuda's routing: the torch backend's
precision and torch.compile, and the server flags that pass them (and torch-cuda's route) to the backends.
What can be checked without a GPU: the checks, the errors and what reaches the loaders."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from holoserve import HoloServeError  # noqa: E402
from holoserve.backends import BackendUnavailable, load_backend  # noqa: E402
from holoserve.core.artifact import load_artifact  # noqa: E402
from holoserve.server.config import ServerConfig  # noqa: E402
from tests.helpers.serving import tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def art():
    return load_artifact(tiny_checkpoint("sst2", onnx=False))


def test_torch_fp16_on_the_cpu_says_to_use_fp32(art):
    with pytest.raises(BackendUnavailable, match="use torch_precision='fp32' on the CPU"):
        load_backend("torch", art, device="cpu", torch_precision="fp16")


def test_unknown_torch_precision_lists_the_choices(art):
    with pytest.raises(HoloServeError, match=r"torch_precision must be one of \('fp32', 'fp16'\), not 'bf16'"):
        load_backend("torch", art, device="cpu", torch_precision="bf16")


def test_torch_backend_defaults_fp32_eager_and_length_groups_on_the_cpu(art):
    be = load_backend("torch", art, device="cpu", threads=1)
    info = be.info()
    assert info["precision"].startswith("fp32") and info["compiled"] is False
    assert be.whole_batches is False  # CPU: the server splits merged batches into length groups
    assert ServerConfig().padding_waste_for(be) == 0.25


def test_torch_compile_wraps_the_model_with_dynamic_shapes(art, monkeypatch):
    """torch_compile=True: inference goes through torch.compile(model, dynamic=True), so the server's many
    (batch, length) shapes do not each compile; the spy stands in for Inductor, which takes minutes on a CPU."""
    seen = {}

    def fake_compile(model, **kw):
        seen.update(kw)

        def run(**inputs):
            seen["calls"] = seen.get("calls", 0) + 1
            return model(**inputs)

        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    be = load_backend("torch", art, device="cpu", threads=1, torch_compile=True)
    ids = np.array([[2, 10, 11, 3]], dtype=np.int64)
    out = be.infer(ids, np.ones_like(ids), np.zeros_like(ids))
    assert out.shape == (1, 2) and seen == {"dynamic": True, "calls": 1}
    assert be.info()["compiled"] == "torch.compile (dynamic shapes)"


@pytest.mark.parametrize("field,value,message", [
    ("torch_precision", "fp8", "torch precision 'fp8' is not one of fp32, fp16"),
    ("torch_cuda_route", "dense", "torch-cuda route 'dense' is not one of auto, sparse, dense-int8"),
])
def test_server_settings_refuse_unknown_values(field, value, message):
    with pytest.raises(HoloServeError, match=message):
        ServerConfig(**{field: value}).validate()


def test_server_flags_reach_the_loaders(art, monkeypatch):
    from holoserve.server import service

    got = {}

    def fake_load(name, artifact, **opts):
        got.update(opts, name=name)
        return object()

    monkeypatch.setattr(service, "load_backend", fake_load)
    cfg = ServerConfig(artifact_dir=str(art.path), backend="torch", torch_precision="fp16", torch_compile=True,
                       torch_cuda_route="dense-int8").validate()
    service.open_backend(cfg, art)
    assert (got["name"], got["torch_precision"], got["torch_compile"], got["route"]) == ("torch", "fp16", True,
                                                                                         "dense-int8")
    got.clear()
    service.open_backend(ServerConfig(artifact_dir=str(art.path), backend="torch-cuda").validate(), art)
    assert got["route"] == "sparse" and got["torch_precision"] == "fp32" and "torch_compile" not in got


def test_serve_cli_parses_the_new_flags():
    import argparse

    from holoserve.serve_cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["ckpt", "--backend", "torch", "--torch-precision", "fp16", "--torch-compile",
                              "--torch-cuda-route", "sparse"])
    cfg = config_from_args(args)
    assert (cfg.torch_precision, cfg.torch_compile, cfg.torch_cuda_route) == ("fp16", True, "sparse")
    with pytest.raises(SystemExit):
        parser.parse_args(["ckpt", "--torch-cuda-route", "fastest"])
