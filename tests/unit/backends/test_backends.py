"""Backends, tokenization and `--backend auto`, without a GPU: everything that needs no CUDA library."""
from __future__ import annotations

import importlib.util
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
from holoserve.backends.onnxruntime import INPUTS, choose_providers
from holoserve.core.tokenizer import TextEncoder, pad_batch
from tests.helpers.serving import REPO, server_env, tiny_checkpoint

os.environ.setdefault("OMP_NUM_THREADS", "1")



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


def test_onnxruntime_threads_spin_inside_a_run_only_and_every_way_predicts_the_same(sst2):
    """Served ONNX Runtime sessions spin-wait inside a run and stop when it returns (so the serving thread and
    the other runtime of a routed pair get the cores between runs); every way of waiting gives the same logits,
    and an unknown one is refused by name."""
    from holoserve.backends.auto import RoutedCpuBackend
    from holoserve.core.ort import SPIN, session

    art = load_artifact(sst2)
    ort = load_backend("onnxruntime", art, threads=2)

    def entry(sess, key):
        return sess.get_session_options().get_session_config_entry(key)

    assert entry(ort.session, "session.force_spinning_stop") == "1"
    assert ort.info()["threads_spin"] == "inside a run only"
    routed = RoutedCpuBackend(ort, load_backend("onnxruntime", art, threads=1), 64)
    assert routed.small is ort  # the same session, no second copy of the model
    feed = pad_batch(TextEncoder(art.path / "tokenizer.json", art.max_seq_length).encode(["a fine film", "dull"]))
    want = ort.infer(*feed)
    sessions = {spin: session(ort.path, threads=2, spin=spin) for spin in SPIN}
    assert entry(sessions["never"], "session.intra_op.allow_spinning") == "0"
    with pytest.raises(Exception):  # ONNX Runtime raises where a key was never set
        entry(sessions["always"], "session.force_spinning_stop")
    for sess in sessions.values():
        got = sess.run([ort.output_name], {n: feed[i] for i, n in enumerate(INPUTS) if n in ort.input_names})[0]
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="spin='sometimes': choose one of run, always, never"):
        session(ort.path, spin="sometimes")


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
        "print(json.dumps({'name': b.name, 'd': d, 'torch': 'torch' in sys.modules, "
        "'trt': any(m.startswith('tensorrt') for m in sys.modules)}))\n"
    )
    env = server_env(CUDA_VISIBLE_DEVICES="")  # as on a CPU-only machine, even if a GPU were present
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["name"] == "onnxruntime" and not out["torch"] and not out["trt"]
    assert set(out["d"]["skipped"]) == {"tensorrt", "torch-cuda", "openvino"}
    assert "no NVIDIA GPU" in out["d"]["skipped"]["torch-cuda"] and "onnxruntime" in out["d"]["reason"]
    assert "--target openvino" in out["d"]["skipped"]["openvino"]


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


def portable_sidecar():
    side = sidecar("tensorrt-rtx", "1.7.1.116", None)
    side["target"] = {"compute_capability": None, "compute_capabilities": ["SM80", "SM86", "SM89", "SM120"],
                      "portable": True, "gpu": None}
    return side


@pytest.mark.parametrize("side,kw,match", [
    (sidecar(), dict(flavour="tensorrt", version="10.5.0.18", compute_capability="8.6"), None),
    (sidecar(), dict(flavour="tensorrt", version="10.6.0.26", compute_capability="8.6"), "not portable"),
    (sidecar(), dict(flavour="tensorrt", version="10.5.0.18", compute_capability="8.9"), "SM89"),
    (sidecar(), dict(flavour="tensorrt", version="10.5.0.18", compute_capability=None), "no CUDA GPU"),
    (sidecar(), dict(flavour="tensorrt-rtx", version="1.7.1.116", compute_capability="8.6"), "built with tensorrt"),
    (sidecar("tensorrt-rtx", "1.7.1.116", "SM120"),
     dict(flavour="tensorrt-rtx", version="1.7.1.116", compute_capability="12.0"), None),
    # a portable TensorRT-RTX engine (the default build) runs on A100 and RTX 30/40/50, not on Turing or Hopper
    (portable_sidecar(), dict(flavour="tensorrt-rtx", version="1.7.1.116", compute_capability="8.9"), None),
    (portable_sidecar(), dict(flavour="tensorrt-rtx", version="1.7.1.116", compute_capability="12.0"), None),
    (portable_sidecar(), dict(flavour="tensorrt-rtx", version="1.7.1.116", compute_capability="7.5"),
     "portable TensorRT-RTX engine.*SM75"),
    (portable_sidecar(), dict(flavour="tensorrt-rtx", version="1.7.1.116", compute_capability="9.0"),
     "portable TensorRT-RTX engine.*SM90"),
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


A10 = {"name": "NVIDIA A10", "compute_capability": "8.6", "device": 0, "source": "cuda"}


def test_tensorrt_backend_refuses_missing_or_foreign_engines(sst2, tmp_path, monkeypatch):
    monkeypatch.delenv(trt_backend.ENGINE_CACHE_ENV, raising=False)
    monkeypatch.delenv(trt_backend.BUILD_ENV, raising=False)
    with pytest.raises(BackendUnavailable, match="holoserve build-engine"):
        load_backend("tensorrt", load_artifact(sst2))
    art = _with_engine(sst2, tmp_path, sidecar("tensorrt-rtx", "0.0.1", "SM86"))
    # No GPU here: refused before the library is even imported.
    monkeypatch.setattr(trt_backend, "current_gpu", lambda: None)
    with pytest.raises(BackendUnavailable, match="no CUDA GPU"):
        load_backend("tensorrt", art)
    # Pretend there is a GPU: the plan was built by another TensorRT-RTX version, refused before deserializing.
    monkeypatch.setattr(trt_backend, "current_gpu", lambda: A10)
    try:
        import tensorrt_rtx  # noqa: F401
    except ImportError:
        with pytest.raises(BackendUnavailable, match="not installed"):
            load_backend("tensorrt", art)
        return
    with pytest.raises(BackendUnavailable, match="not portable"):
        load_backend("tensorrt", art)


def test_tensorrt_rtx_validity_check_runs_before_deserializing(sst2, tmp_path, monkeypatch):
    """A plan whose sidecar matches but whose header TensorRT-RTX rejects is refused with the reason, not loaded."""
    trt = pytest.importorskip("tensorrt_rtx")
    art = _with_engine(sst2, tmp_path, sidecar("tensorrt-rtx", trt.__version__, "SM86"))
    monkeypatch.setattr(trt_backend, "current_gpu", lambda: A10)
    with pytest.raises(BackendUnavailable, match="TensorRT-RTX reports the engine invalid.*damaged"):
        load_backend("tensorrt", art)
    runtime = trt.Runtime(trt.Logger(trt.Logger.ERROR))
    assert trt_backend.rtx_validity(trt, runtime, b"not an engine" * 8) == (
        "INVALID", ["the file is damaged or not a TensorRT-RTX engine"])


def test_engine_settings(monkeypatch, tmp_path):
    monkeypatch.delenv(trt_backend.ENGINE_CACHE_ENV, raising=False)
    monkeypatch.delenv(trt_backend.BUILD_ENV, raising=False)
    assert trt_backend.engine_settings() == (None, "never")
    monkeypatch.setenv(trt_backend.ENGINE_CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(trt_backend.BUILD_ENV, "if-missing")
    assert trt_backend.engine_settings() == (tmp_path, "if-missing")
    assert trt_backend.engine_settings({"build_engine": "never"}) == (tmp_path, "never")
    monkeypatch.setenv(trt_backend.BUILD_ENV, "always")
    with pytest.raises(BackendUnavailable, match="choose never or if-missing"):
        trt_backend.engine_settings()
    monkeypatch.delenv(trt_backend.ENGINE_CACHE_ENV)
    with pytest.raises(BackendUnavailable, match="needs HOLOSERVE_ENGINE_CACHE"):
        trt_backend.engine_settings({"build_engine": "if-missing"})


@pytest.fixture(scope="module")
def trt_ckpt(tmp_path_factory):
    """A 1-layer checkpoint with both ONNX exports (ONNX Runtime and TensorRT placement), no engine."""
    pytest.importorskip("torch")
    from holoserve.export.onnx_export import export_checkpoint
    from tests.unit.export.test_export import make_calibrated_checkpoint

    ckpt = make_calibrated_checkpoint(tmp_path_factory.mktemp("trt-ckpt"), layers=1)
    export_checkpoint(ckpt, ["onnxruntime", "tensorrt"], progress=False, polygraphy=False)
    return ckpt


def test_engine_built_at_start_up_into_the_cache(trt_ckpt, tmp_path, monkeypatch, caplog):
    """HOLOSERVE_BUILD_ENGINE=if-missing: the backend runs `holoserve build-engine --cache-dir` for this GPU.

    Here TensorRT-RTX builds (on the CPU) for the pretended SM86 GPU; its header check then says the engine
    cannot run on this machine, which has no GPU. The second start finds the cached engine and builds nothing.
    """
    trt = pytest.importorskip("tensorrt_rtx")
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("datacenter TensorRT is installed: it would be the one building (needs a GPU)")
    monkeypatch.setattr(trt_backend, "current_gpu", lambda: A10)
    cache = tmp_path / "engines"
    art = load_artifact(trt_ckpt)
    caplog.set_level("INFO", logger="holoserve.backends")
    with pytest.raises(BackendUnavailable) as e:
        load_backend("tensorrt", art, engine_cache=str(cache), build_engine="if-missing", max_batch=4)
    assert "TensorRT-RTX reports the engine invalid on this machine" in str(e.value)
    assert "building a TensorRT engine" in caplog.text
    plans = list(cache.glob("*/*/model.plan"))
    assert len(plans) == 1 and plans[0].parent.name == f"tensorrt-rtx-{trt.__version__}-sm86"
    side = json.loads((plans[0].parent / "model.plan.json").read_text())
    assert side["target"]["compute_capability"] == "SM86"
    assert side["profiles"][0]["input_ids"]["max"] == [4, art.max_seq_length]
    mtime = plans[0].stat().st_mtime_ns
    caplog.clear()
    with pytest.raises(BackendUnavailable, match="invalid on this machine"):
        load_backend("tensorrt", art, engine_cache=str(cache), build_engine="if-missing", max_batch=4)
    assert plans[0].stat().st_mtime_ns == mtime and "is up to date" in caplog.text


def test_auto_says_loudly_why_an_engine_on_disk_is_not_used(trt_ckpt, tmp_path, monkeypatch, caplog):
    import shutil

    import holoserve.backends.auto as auto

    ckpt = tmp_path / "ckpt"
    shutil.copytree(trt_ckpt, ckpt)
    art = _with_engine(ckpt, tmp_path / "e", sidecar("tensorrt", "10.5.0.18", "SM86"))
    monkeypatch.setattr(auto, "nvidia_gpu_visible", lambda: False)
    caplog.set_level("INFO", logger="holoserve.backends")
    b, d = select_backend(art, threads=1)
    assert b.name == "onnxruntime"
    assert d["warnings"] and "model.plan is not used: no NVIDIA GPU visible" in d["warnings"][0]
    assert d["reason"].startswith("WARNING: the TensorRT engine")
    assert any(r.levelname == "WARNING" and "is not used" in r.getMessage() for r in caplog.records)
    # an engine that exists but fails its check: the check's reason is what auto reports
    monkeypatch.setattr(auto, "nvidia_gpu_visible", lambda: True)
    monkeypatch.setattr(auto.importlib.util, "find_spec", lambda name: None)  # no torch: skip torch-cuda
    monkeypatch.setattr(trt_backend, "current_gpu", lambda: {**A10, "compute_capability": "8.9"})
    monkeypatch.setattr(trt_backend, "import_library", lambda name: type("T", (), {"__version__": "10.5.0.18"}))
    b, d = select_backend(art, threads=1)
    assert b.name == "onnxruntime" and "SM89" in d["warnings"][0] and "holoserve build-engine" in d["warnings"][0]
    # without any engine on disk there is nothing to warn about
    b, d = select_backend(load_artifact(trt_ckpt), threads=1)
    assert b.name == "onnxruntime" and d["warnings"] == []


# ---- the backend's buffers, with stand-ins for TensorRT and CUDA (what a GPU run would call)


class _FakeEngine:
    def __init__(self, out_labels=2, max_shape=(8, 32)):
        self.out_labels, self.max_shape = out_labels, max_shape
        self.num_io_tensors = 4

    def get_tensor_name(self, i):
        return ["input_ids", "attention_mask", "token_type_ids", "logits"][i]

    def get_tensor_dtype(self, name):
        return "float32" if name == "logits" else "int64"

    def get_tensor_mode(self, name):
        return "out" if name == "logits" else "in"

    def get_tensor_profile_shape(self, name, profile):
        return (1, 1), (4, 16), self.max_shape


class _FakeContext:
    def __init__(self, engine):
        self.engine, self.shapes, self.addresses = engine, {}, {}

    def set_input_shape(self, name, shape):
        self.shapes[name] = tuple(shape)

    def get_tensor_shape(self, name):
        return (self.shapes["input_ids"][0], self.engine.out_labels)

    def set_tensor_address(self, name, ptr):
        self.addresses[name] = ptr

    def execute_async_v3(self, stream):
        return True


class _FakeMem:
    def __init__(self):
        self.sizes, self.closed = {}, 0

    def malloc(self, n):
        ptr = 4096 * (len(self.sizes) + 1)
        self.sizes[ptr] = n
        return ptr

    stream_handle = 0

    def htod(self, dst, src):
        self.host = getattr(self, "host", {}) | {dst: src.copy()}

    def dtoh(self, dst, src):  # the "engine": each row's logits are its first two token ids
        ids = next(a for a in self.host.values() if a.shape[0] == dst.shape[0] and a.max() > 1)
        dst[:] = ids[:, :dst.shape[1]]

    def synchronize(self):
        pass

    def close(self):
        self.closed += 1


def _fake_backend(engine, num_labels=2):
    import threading
    import weakref

    trt = type("trt", (), {"nptype": staticmethod(np.dtype), "TensorIOMode": type("M", (), {"INPUT": "in"})})
    be = object.__new__(trt_backend.TensorRTBackend)
    be.trt, be.plan_path, be.engine = trt, trt_backend.Path("model.plan"), engine
    be.context, be.mem = _FakeContext(engine), _FakeMem()
    be._finalizer = weakref.finalize(be, be.mem.close)
    be._lock, be._closed = threading.Lock(), False
    art = type("A", (), {"num_labels": num_labels, "path": trt_backend.Path("ckpt")})
    be.buffers = trt_backend.allocate_buffers(trt, engine, be.context, be.mem, be.plan_path, art)
    return be


def test_output_buffer_is_sized_from_the_engine():
    be = _fake_backend(_FakeEngine(out_labels=2, max_shape=(8, 32)))
    buf = be.buffers
    assert buf.output_capacity == 8 * 2 * 4 and be.mem.sizes[buf.ptrs["logits"]] == 64
    assert be.mem.sizes[buf.ptrs["input_ids"]] == 8 * 32 * 8
    assert set(be.context.addresses) == {"input_ids", "attention_mask", "token_type_ids", "logits"}
    with pytest.raises(BackendUnavailable, match="3 values per row but the checkpoint has 2 labels"):
        _fake_backend(_FakeEngine(out_labels=3))


def test_buffers_are_one_frozen_record_and_infer_splits_a_batch_beyond_the_profile():
    import dataclasses

    be = _fake_backend(_FakeEngine(out_labels=2, max_shape=(8, 32)))
    assert (be.buffers.max_batch, be.buffers.max_seq) == (8, 32) and be.buffers.output == "logits"
    with pytest.raises(dataclasses.FrozenInstanceError):
        be.buffers.output_capacity = 1
    ids = np.arange(2, 2 + 20 * 4, dtype=np.int64).reshape(20, 4)  # 20 rows > the profile's 8: three runs
    out = be.infer(ids, np.ones_like(ids), np.zeros_like(ids))
    assert out.dtype == np.float32 and np.array_equal(out, ids[:, :2].astype(np.float32))
    with pytest.raises(ValueError, match="exceeds the engine profile's maximum 32"):
        be.infer(*(np.ones((1, 33), dtype=np.int64),) * 3)


def test_close_frees_device_memory_once():
    be = _fake_backend(_FakeEngine())
    mem = be.mem
    be.close()
    be.close()
    assert mem.closed == 1 and be.context is None and be.engine is None
    with pytest.raises(RuntimeError, match="closed"):
        be.infer(*(np.ones((1, 4), dtype=np.int64),) * 3)
    be2 = _fake_backend(_FakeEngine())
    mem2 = be2.mem
    del be2  # garbage-collected without close(): the finalizer frees the memory
    import gc

    gc.collect()
    assert mem2.closed == 1


def test_cuda_memory_close_frees_buffers_and_stream(monkeypatch):
    calls = []

    class Cudart:
        cudaMemcpyKind = None

        def cudaStreamCreate(self):
            return 0, 77

        def cudaMalloc(self, n):
            calls.append(("malloc", n))
            return 0, 1000 + len(calls)

        def cudaFree(self, p):
            calls.append(("free", p))
            return (0,)

        def cudaStreamSynchronize(self, s):
            return (0,)

        def cudaStreamDestroy(self, s):
            calls.append(("destroy", s))
            return (0,)

    monkeypatch.setattr(trt_backend, "_cudart", lambda: Cudart())
    mem = trt_backend._CudaMem()
    a, b = mem.malloc(16), mem.malloc(32)
    mem.close()
    mem.close()
    assert [c for c in calls if c[0] != "malloc"] == [("free", a), ("free", b), ("destroy", 77)]


def test_tensorrt_backend_refuses_a_damaged_sidecar(sst2, tmp_path, monkeypatch):
    monkeypatch.setattr(trt_backend, "current_gpu", lambda: A10)
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
        (trt.Runtime, ["get_engine_validity"]),  # TensorRT-RTX only; the backend checks for it
    ]:
        assert [n for n in names if not hasattr(cls, n)] == []
    assert trt.TensorIOMode.INPUT is not None and np.dtype(trt.nptype(trt.DataType.INT64)) == np.int64
    assert set(trt_backend._DIAGNOSTICS) == set(trt.EngineInvalidityDiagnostics.__members__)
    assert {"VALID", "SUBOPTIMAL", "INVALID"} == set(trt.EngineValidity.__members__)


class _Timed:
    """A stand-in CPU backend whose run time grows with the batch's tokens at its own rate, plus a fixed
    cost: which of two wins depends on the batch size, as ONNX Runtime and OpenVINO do on some CPUs."""

    whole_batches = False

    def __init__(self, name: str, fixed_s: float, per_token_s: float):
        self.name, self.fixed_s, self.per_token_s, self.calls = name, fixed_s, per_token_s, []

    def infer(self, ids, mask, types):
        import time

        self.calls.append(ids.shape)
        time.sleep(self.fixed_s + self.per_token_s * ids.size)
        return np.full((ids.shape[0], 2), float(len(self.name)), np.float32)

    def info(self):
        return {"backend": self.name}


def _fake_cpu_backends(monkeypatch, backends):
    from holoserve.backends import auto

    monkeypatch.setattr(auto, "_precheck", lambda name, art, gpu, options=None, probe=True: None)
    monkeypatch.setattr(auto, "_saturates", lambda name: None)
    monkeypatch.setattr(auto, "load_backend", lambda name, art, **o: backends[name])
    monkeypatch.setattr(auto, "STARTUP_PLAN", dict(min_rounds=3, max_rounds=3, seconds=0.0, per_round=16))
    monkeypatch.delenv(auto.ROUTE_ENV, raising=False)
    return auto


def test_auto_routes_batches_by_size_when_each_cpu_backend_wins_some(sst2, monkeypatch):
    """ONNX Runtime faster for a lone request, OpenVINO for full batches: both serve, each batch routed to
    the one that was faster for its size, and the reason says where the line is."""
    fast_small = _Timed("onnxruntime", 0.0002, 3e-5)
    fast_large = _Timed("openvino", 0.003, 1e-6)
    auto = _fake_cpu_backends(monkeypatch, {"onnxruntime": fast_small, "openvino": fast_large})
    backend, why = auto.fastest_cpu(load_artifact(sst2), False, {}, {})
    seq = load_artifact(sst2).max_seq_length
    # timed on the SST-2 dev texts in batches of 1 to 32 rows; the fixed cost loses below ~100 tokens a batch
    assert "the median of 3 rounds timed at start-up on GLUE SST-2 dev set" in why
    assert isinstance(backend, auto.RoutedCpuBackend) and backend.name == "onnxruntime+openvino"
    assert seq <= backend.max_small_tokens < 4 * seq
    assert why.startswith(f"onnxruntime for batches of up to {backend.max_small_tokens} tokens and openvino above")
    assert "holoserve tune" in why
    ids = np.ones((1, seq), np.int64)
    fast_small.calls.clear(), fast_large.calls.clear()
    assert backend.infer(ids, ids, ids)[0, 0] == len("onnxruntime")
    big = np.ones((16, seq), np.int64)
    assert backend.infer(big, big, big)[0, 0] == len("openvino")
    assert fast_small.calls == [(1, seq)] and fast_large.calls == [(16, seq)]
    assert backend.info()["routing"]["runs"] == {"onnxruntime": 1, "openvino": 1}
    # a worker whose parent pinned the routing loads both and routes the same way, without timing
    monkeypatch.setenv(auto.ROUTE_ENV, json.dumps(backend.route()))
    fast_small.calls.clear(), fast_large.calls.clear()
    pinned, why = auto.fastest_cpu(load_artifact(sst2), False, {}, {})
    assert pinned.route() == backend.route() and why.startswith("the routing chosen before the workers started")
    assert fast_small.calls == fast_large.calls == []


def test_a_worker_pins_the_light_load_route(sst2, monkeypatch):
    """`--workers N` with the light-load route: each worker routes one-row batches, however long, to the
    same side as its parent, without timing; a pinned route that is not one is ignored."""
    ort, ov = _Timed("onnxruntime", 0.0, 0.0), _Timed("openvino", 0.0, 0.0)
    auto = _fake_cpu_backends(monkeypatch, {"onnxruntime": ort, "openvino": ov})
    route = {"small": "onnxruntime", "large": "openvino", "max_small_rows": 1}
    monkeypatch.setenv(auto.ROUTE_ENV, json.dumps(route))
    pinned, why = auto.fastest_cpu(load_artifact(sst2), False, {}, {})
    assert pinned.route() == route and why.startswith("the routing chosen before the workers started")
    assert ort.calls == ov.calls == []
    long_row, short_pair = np.ones((1, 128), np.int64), np.ones((2, 8), np.int64)
    pinned.infer(long_row, long_row, long_row)
    pinned.infer(short_pair, short_pair, short_pair)
    assert ort.calls == [(1, 128)] and ov.calls == [(2, 8)]
    # with OpenVINO a side, both load for the batches at once the server gives OpenVINO (service.open_backend)
    loads: list[tuple[str, int]] = []
    monkeypatch.setattr(auto, "load_backend", lambda name, art, **o: (
        loads.append((name, o.get("instances"))), {"onnxruntime": ort, "openvino": ov}[name])[1])
    auto.fastest_cpu(load_artifact(sst2), False, {"instances": 2, "openvino_instances": 1}, {})
    assert sorted(loads) == [("onnxruntime", 1), ("openvino", 1)], loads
    monkeypatch.setenv(auto.ROUTE_ENV, json.dumps({**route, "max_small_tokens": 64}))
    assert auto._route_from_env({"onnxruntime": ort, "openvino": ov}) is None


def test_auto_keeps_one_cpu_backend_when_it_wins_every_size(sst2, monkeypatch):
    a, b = _Timed("onnxruntime", 0.003, 2e-6), _Timed("openvino", 0.0005, 1e-6)
    auto = _fake_cpu_backends(monkeypatch, {"onnxruntime": a, "openvino": b})
    backend, why = auto.fastest_cpu(load_artifact(sst2), False, {}, {})
    assert backend is b and why.startswith("openvino, the fastest CPU backend by the median of 3 rounds timed at ")
