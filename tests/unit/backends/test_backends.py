"""Backends, tokenization and `--backend auto`, without a GPU: everything that needs no CUDA library."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from holoserve.core.artifact import add_files, load_artifact
from holoserve.backends import BackendUnavailable, load_backend
from holoserve.backends import tensorrt as trt_backend
from holoserve.backends.auto import select_backend
from holoserve.backends.onnxruntime import choose_providers
from holoserve.core.tokenizer import TextEncoder, pad_batch
from tests.helpers.serving import REPO, server_env, tiny_checkpoint

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def sst2():
    return tiny_checkpoint("sst2")


# --------------------------------------------------------------------------- tokenization


def test_tokenizer_truncates_reports_and_pads(sst2):
    enc = TextEncoder(sst2 / "tokenizer.json", 8)
    short, long = enc.encode(["good movie", "the movie was very very very good and fun"])
    assert short.length == 4 and not short.truncated  # [CLS] good movie [SEP]
    assert long.length == 8 and long.truncated
    ids, mask, types = pad_batch([short, long], enc.pad_id)
    assert ids.shape == mask.shape == types.shape == (2, 8) and ids.dtype == np.int64
    assert mask[0].tolist() == [1, 1, 1, 1, 0, 0, 0, 0] and (ids[0, 4:] == enc.pad_id).all()
    pair_enc = TextEncoder(sst2 / "tokenizer.json", 8, pair=True)
    (p,) = pair_enc.encode([("the movie", "a dog is playing with the cat")])
    assert p.length == 8 and p.truncated and p.token_type_ids.tolist().count(1) > 0


def test_tokenizer_errors(tmp_path):
    from holoserve import HoloServeError

    with pytest.raises(HoloServeError, match="tokenizer.json"):
        TextEncoder(tmp_path / "tokenizer.json", 32)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(HoloServeError, match="cannot be read"):
        TextEncoder(tmp_path / "tokenizer.json", 32)


# --------------------------------------------------------------------------- ONNX Runtime and torch


def test_onnxruntime_matches_torch_reference(tmp_path):
    """The ORT backend on a plain fp32 export of the checkpoint equals the torch backend (same weights)."""
    import shutil

    from tests.helpers.serving import export_onnx

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("sst2", onnx=False), ckpt)
    art = load_artifact(ckpt)
    torch_be = load_backend("torch", art, device="cpu", threads=1)
    export_onnx(torch_be.model, tmp_path / "fp32.onnx")
    art = add_files(art, {"model.onnx": tmp_path / "fp32.onnx"}, exports={"onnxruntime": {"file": "model.onnx"}},
                    move=False)
    ort_be = load_backend("onnxruntime", art, threads=1)
    enc = TextEncoder(ckpt / "tokenizer.json", art.max_seq_length)
    batch = pad_batch(enc.encode(["good", "the movie was awful and boring", "i loved it"]))
    a, b = ort_be.infer(*batch), torch_be.infer(*batch)
    assert a.shape == (3, 2) and a.dtype == np.float32
    np.testing.assert_allclose(a, b, atol=1e-4)
    info = ort_be.info()
    assert info["providers"] == ["CPUExecutionProvider"] and info["file"] == "model.onnx"
    assert torch_be.info()["device"] == "cpu"


def test_onnxruntime_serves_the_qdq_export(sst2):
    art = load_artifact(sst2)
    be = load_backend("onnxruntime", art, threads=1)
    enc = TextEncoder(sst2 / "tokenizer.json", art.max_seq_length)
    single = [be.infer(*pad_batch([e]))[0] for e in enc.encode(["good", "the movie was awful and boring"])]
    both = be.infer(*pad_batch(enc.encode(["good", "the movie was awful and boring"])))
    np.testing.assert_allclose(both, np.stack(single), atol=1e-4)  # padding does not change a row's logits


def test_onnxruntime_without_export_says_how_to_make_one():
    art = load_artifact(tiny_checkpoint("sst2", onnx=False))
    with pytest.raises(BackendUnavailable, match="holoserve export"):
        load_backend("onnxruntime", art)


def test_choose_providers():
    assert choose_providers(["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    both = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert choose_providers(both) == both
    assert choose_providers(both, "cpu") == ["CPUExecutionProvider"]
    with pytest.raises(BackendUnavailable, match="onnxruntime-gpu"):
        choose_providers(["CPUExecutionProvider"], "cuda")


def test_unknown_backend():
    from holoserve import HoloServeError

    with pytest.raises(HoloServeError, match="unknown backend"):
        load_backend("nope", load_artifact(tiny_checkpoint("sst2")))


# --------------------------------------------------------------------------- auto


def test_auto_picks_onnxruntime_on_a_cpu_machine_without_importing_torch(sst2):
    code = (
        "import sys, json\n"
        "from holoserve.core.artifact import load_artifact\n"
        "from holoserve.backends.auto import select_backend\n"
        f"b, d = select_backend(load_artifact({str(sst2)!r}))\n"
        "print(json.dumps({'name': b.name, 'd': d, 'torch': 'torch' in sys.modules, 'trt': any(m.startswith('tensorrt') for m in sys.modules)}))\n"
    )
    env = server_env(CUDA_VISIBLE_DEVICES="")  # as on a CPU-only machine, even if a GPU were present
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["name"] == "onnxruntime" and not out["torch"] and not out["trt"]
    assert set(out["d"]["skipped"]) == {"tensorrt", "torch-cuda"}
    assert "no NVIDIA GPU" in out["d"]["skipped"]["torch-cuda"] and "onnxruntime" in out["d"]["reason"]


def test_auto_explains_when_nothing_can_serve(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    art = load_artifact(tiny_checkpoint("sst2", onnx=False))
    with pytest.raises(BackendUnavailable, match="no backend can serve") as e:
        select_backend(art)
    assert "holoserve export" in str(e.value) and "build-engine" in str(e.value)


def test_auto_falls_back_when_a_backend_breaks(sst2, monkeypatch):
    import holoserve.backends.auto as auto

    monkeypatch.setattr(auto, "nvidia_gpu_visible", lambda: True)
    monkeypatch.setattr(auto.importlib.util, "find_spec", lambda name: object())

    def fake_load(name, artifact, **kw):
        if name == "torch-cuda":
            raise RuntimeError("CUDA driver too old")
        return load_backend(name, artifact, **kw)

    monkeypatch.setattr(auto, "load_backend", fake_load)
    b, d = select_backend(load_artifact(sst2), threads=1)
    assert b.name == "onnxruntime" and "CUDA driver too old" in d["skipped"]["torch-cuda"]


# --------------------------------------------------------------------------- TensorRT (no library needed)


def sidecar(flavour="tensorrt", version="10.5.0.18", cc="SM86", **extra):
    from holoserve.core import sidecar as engine_sidecar

    module = flavour.replace("-", "_")
    return {"format": engine_sidecar.SIDECAR_FORMAT, "version": engine_sidecar.SIDECAR_VERSION,
            "tensorrt": {"flavour": flavour, "module": module, "version": version},
            "target": {"compute_capability": cc, "gpu": "NVIDIA A10"}, **extra}


@pytest.mark.parametrize("side,kw,match", [
    (sidecar(), dict(flavour="tensorrt", version="10.5.0.18", compute_capability="8.6"), None),
    (sidecar(), dict(flavour="tensorrt", version="10.6.0.26", compute_capability="8.6"), "not portable"),
    (sidecar(), dict(flavour="tensorrt", version="10.5.0.18", compute_capability="8.9"), "SM89"),
    (sidecar(), dict(flavour="tensorrt", version="10.5.0.18", compute_capability=None), "no CUDA GPU"),
    (sidecar(), dict(flavour="tensorrt-rtx", version="1.7.1.116", compute_capability="8.6"), "built with tensorrt"),
    (sidecar("tensorrt-rtx", "1.7.1.116", "SM120"),
     dict(flavour="tensorrt-rtx", version="1.7.1.116", compute_capability="12.0"), None),
])
def test_engine_check(side, kw, match):
    if match is None:
        trt_backend.check_engine(side, **kw)
    else:
        with pytest.raises(BackendUnavailable, match=match) as e:
            trt_backend.check_engine(side, **kw)
        assert "build-engine" in str(e.value) or "GPU" in str(e.value)


def test_runtime_module():
    assert trt_backend.runtime_module(sidecar()) == ("tensorrt", "tensorrt")
    assert trt_backend.runtime_module(sidecar("tensorrt-rtx")) == ("tensorrt-rtx", "tensorrt_rtx")
    with pytest.raises(BackendUnavailable, match="unknown TensorRT flavour"):
        trt_backend.runtime_module({"tensorrt": {"flavour": "onnx"}})


def _with_engine(src, tmp_path, side: dict):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    (tmp_path / "model.plan").write_bytes(b"not really an engine")
    (tmp_path / "model.plan.json").write_text(json.dumps(side))
    return add_files(ckpt, {"model.plan": tmp_path / "model.plan", "model.plan.json": tmp_path / "model.plan.json"},
                     exports={"tensorrt": {"file": "model.plan", "sidecar": "model.plan.json"}}, move=False)


def test_tensorrt_backend_refuses_missing_or_foreign_engines(sst2, tmp_path, monkeypatch):
    with pytest.raises(BackendUnavailable, match="holoserve build-engine"):
        load_backend("tensorrt", load_artifact(sst2))
    art = _with_engine(sst2, tmp_path, sidecar("tensorrt-rtx", "0.0.1", "SM86"))
    # No GPU here: refused before the library is even imported.
    monkeypatch.setattr(trt_backend, "gpu_compute_capability", lambda: None)
    with pytest.raises(BackendUnavailable, match="no CUDA GPU"):
        load_backend("tensorrt", art)
    # Pretend there is a GPU: the plan was built by another TensorRT-RTX version, refused before deserializing.
    monkeypatch.setattr(trt_backend, "gpu_compute_capability", lambda: "8.6")
    try:
        import tensorrt_rtx  # noqa: F401
    except ImportError:
        with pytest.raises(BackendUnavailable, match="not installed"):
            load_backend("tensorrt", art)
        return
    with pytest.raises(BackendUnavailable, match="not portable"):
        load_backend("tensorrt", art)


def test_tensorrt_backend_refuses_a_damaged_sidecar(sst2, tmp_path):
    art = _with_engine(sst2, tmp_path, {"format": "something else"})
    with pytest.raises(BackendUnavailable, match="not a HoloServe engine sidecar"):
        load_backend("tensorrt", art)


def test_tensorrt_api_used_by_the_backend_exists():
    """The names the backend calls exist in the TensorRT Python API (checked on TensorRT-RTX, same API)."""
    trt = pytest.importorskip("tensorrt_rtx", reason="no TensorRT Python package installed")
    for cls, names in [
        (trt.Runtime, ["deserialize_cuda_engine"]),
        (trt.ICudaEngine, ["num_io_tensors", "get_tensor_name", "get_tensor_mode", "get_tensor_dtype",
                           "get_tensor_profile_shape", "create_execution_context"]),
        (trt.IExecutionContext, ["set_input_shape", "set_tensor_address", "get_tensor_shape", "execute_async_v3"]),
    ]:
        assert [n for n in names if not hasattr(cls, n)] == []
    assert trt.TensorIOMode.INPUT is not None and np.dtype(trt.nptype(trt.DataType.INT64)) == np.int64
