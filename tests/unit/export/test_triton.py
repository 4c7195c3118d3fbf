"""The Triton model repository: what `holoserve export --triton-repo` writes, its configs read with Triton's
own schema, the Python model run with a stand-in for Triton's Python-backend module, and the whole
repository served by a real tritonserver (the one the nvidia-pytriton wheel ships) giving the same
predictions as `holoserve serve` and HoloServe's ONNX Runtime backend."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import httpx
import numpy as np
import pytest

from holoserve.backends.onnxruntime import OrtBackend
from holoserve.core.artifact import add_files, load_artifact, read_manifest
from holoserve.core.tokenizer import TextEncoder, pad_batch
from holoserve.export.triton import HEADER, TritonRepoError, default_model_name, write_triton_repo
from holoserve.export.triton_local import Listen, local_tritonserver
from tests.helpers.serving import stop, ThreadServer, free_port, tiny_checkpoint

os.environ.setdefault("OMP_NUM_THREADS", "1")

TEXTS = ["the movie was good", "i hated it", "a dog is playing with the cat in the garden all day long",
         "ok", "héllo wörld — ünïcode", "great " * 40]
PAIRS = [("a dog is playing", "a dog plays"), ("the cat sat", "stocks fell sharply"), ("same", "same")]





def reference(ckpt: Path, items) -> np.ndarray:
    """Logits of each text (or pair) alone, straight from HoloServe's ONNX Runtime backend."""
    art = load_artifact(ckpt)
    enc = TextEncoder(ckpt / "tokenizer.json", art.max_seq_length, pair=art.is_pair)
    be = OrtBackend(art, threads=1)
    return np.concatenate([be.infer(*pad_batch([e], enc.pad_id)) for e in enc.encode(list(items))])


# --------------------------------------------------------------------------- Triton's config schema


def model_config_pb2():
    """Triton's ModelConfig protobuf (shipped in tritonclient), loaded without tritonclient.grpc's grpc import."""
    spec = importlib.util.find_spec("tritonclient")
    if spec is None:
        pytest.skip("tritonclient is not installed (pip install -e '.[triton]')")
    pytest.importorskip("google.protobuf")
    path = Path(list(spec.submodule_search_locations)[0]) / "grpc" / "model_config_pb2.py"
    mod_spec = importlib.util.spec_from_file_location("triton_model_config_pb2", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def parse_config(path: Path):
    from google.protobuf import text_format

    pb2 = model_config_pb2()
    return text_format.Parse(path.read_text(), pb2.ModelConfig())


def test_python_model_layout_and_config(sst2, tmp_path):
    repo = write_triton_repo(sst2, tmp_path / "repo", max_batch_size=16, max_queue_delay_us=500, instances=2)
    name = default_model_name(sst2)
    assert name == "ckpt-sst2" and set(repo.models) == {name, f"{name}_onnx"}
    assert set(repo.skipped) == {f"{name}_trt_onnx", f"{name}_trt"}
    model = tmp_path / "repo" / name
    bundle = model / "1" / "checkpoint"
    assert sorted(p.name for p in bundle.iterdir()) == ["config.json", "manifest.json", "model.onnx", "tokenizer.json"]
    assert (bundle / "manifest.json").read_bytes() == (sst2 / "manifest.json").read_bytes()
    assert (bundle / "model.onnx").read_bytes() == (sst2 / "model.onnx").read_bytes()
    assert (model / "labels.txt").read_text().split() == ["negative", "positive"]
    text = (model / "config.pbtxt").read_text()
    assert text.startswith(HEADER)
    cfg = parse_config(model / "config.pbtxt")
    assert cfg.name == name and cfg.backend == "python" and cfg.max_batch_size == 16
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 500
    pb2 = model_config_pb2()
    assert [(i.name, i.data_type, list(i.dims)) for i in cfg.input] == [("TEXT", pb2.TYPE_STRING, [1])]
    assert [(o.name, o.data_type, list(o.dims)) for o in cfg.output] == [("LOGITS", pb2.TYPE_FP32, [2]),
                                                                        ("LABEL", pb2.TYPE_STRING, [1])]
    assert cfg.output[0].label_filename == "labels.txt"
    kind_cpu = pb2.ModelInstanceGroup.KIND_CPU
    assert cfg.instance_group[0].count == 2 and cfg.instance_group[0].kind == kind_cpu
    assert cfg.parameters["threads"].string_value == "0"
    # No temporary folder is left beside or inside the repository.
    assert [p.name for p in tmp_path.iterdir()] == ["repo"]
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == [name, f"{name}_onnx"]

    onnx = parse_config(tmp_path / "repo" / f"{name}_onnx" / "config.pbtxt")
    assert onnx.platform == "onnxruntime_onnx" and onnx.max_batch_size == 16
    assert [(i.name, list(i.dims)) for i in onnx.input] == [(n, [-1]) for n in
                                                           ("input_ids", "attention_mask", "token_type_ids")]
    assert all(i.data_type == pb2.TYPE_INT64 for i in onnx.input)
    assert [(o.name, o.data_type, list(o.dims)) for o in onnx.output] == [("logits", pb2.TYPE_FP32, [2])]
    assert onnx.instance_group[0].kind == kind_cpu


def test_pair_and_regression_configs(mrpc, stsb, tmp_path):
    write_triton_repo(mrpc, tmp_path / "repo", model_name="para")
    write_triton_repo(stsb, tmp_path / "repo", model_name="sim")
    para = parse_config(tmp_path / "repo" / "para" / "config.pbtxt")
    assert [i.name for i in para.input] == ["TEXT", "TEXT_PAIR"]
    sim = parse_config(tmp_path / "repo" / "sim" / "config.pbtxt")
    assert [(o.name, list(o.dims)) for o in sim.output] == [("LOGITS", [1]), ("LABEL", [1])]
    assert sim.output[0].label_filename == ""  # regression: no labels file
    assert not (tmp_path / "repo" / "sim" / "labels.txt").exists()
    # Both models sit side by side in one repository.
    assert {p.name for p in (tmp_path / "repo").iterdir()} == {"para", "para_onnx", "sim", "sim_onnx"}


def add_engine(ckpt: Path, flavour: str, scratch: Path) -> None:
    """Record a TensorRT engine in the checkpoint: a stand-in plan file with the sidecar `holoserve
    build-engine` writes (a datacenter TensorRT or a TensorRT-RTX one)."""
    plan, side = scratch / "model.plan", scratch / "model.plan.json"
    plan.write_bytes(b"not a real plan")
    side.write_text(json.dumps({
        "format": "holoserve-tensorrt-engine", "version": 1,
        "tensorrt": {"flavour": flavour, "module": flavour.replace("-", "_"), "version": "10.5.0"},
        "target": {"gpu": "NVIDIA A10", "compute_capability": "8.6"},
        "profiles": [{n: {"min": [1, 1], "opt": [8, 32], "max": [8, 32]}
                      for n in ("input_ids", "attention_mask", "token_type_ids")}],
        "inputs": [{"name": n, "dtype": "int64"} for n in ("input_ids", "attention_mask", "token_type_ids")],
        "outputs": [{"name": "logits", "dtype": "float32"}]}))
    add_files(ckpt, {"model.plan": plan, "model.plan.json": side},
              exports={"tensorrt": {"file": "model.plan", "sidecar": "model.plan.json"}}, move=False)


def gpu_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of `src` with the TensorRT-placement ONNX export and a datacenter TensorRT engine recorded."""
    from holoserve.export.onnx_export import export_checkpoint

    shutil.copytree(src, dst)
    export_checkpoint(dst, ("tensorrt",), polygraphy=False, progress=False, check_predictions=False,
                      verify_exports=False)
    add_engine(dst, "tensorrt", dst.parent)
    return dst


def test_gpu_configs_follow_the_exports(sst2, tmp_path):
    """The TensorRT-placement ONNX gets an onnxruntime model with the TensorRT accelerator; a datacenter
    TensorRT plan a tensorrt_plan model; a TensorRT-RTX plan none (Triton's TensorRT backend cannot load
    it), and the stale plan model of an earlier export is removed."""
    ckpt = gpu_checkpoint(sst2, tmp_path / "ckpt")
    repo = write_triton_repo(ckpt, tmp_path / "repo", model_name="m")
    assert set(repo.models) == {"m", "m_onnx", "m_trt_onnx", "m_trt"} and not repo.skipped

    trt_onnx = parse_config(tmp_path / "repo" / "m_trt_onnx" / "config.pbtxt")
    kind_gpu = model_config_pb2().ModelInstanceGroup.KIND_GPU
    assert trt_onnx.platform == "onnxruntime_onnx" and trt_onnx.instance_group[0].kind == kind_gpu
    (acc,) = trt_onnx.optimization.execution_accelerators.gpu_execution_accelerator
    assert acc.name == "tensorrt"
    assert acc.parameters["precision_mode"] == "INT8" and acc.parameters["trt_sparsity_enable"] == "1"
    assert acc.parameters["trt_profile_max_shapes"] == "input_ids:32x32,attention_mask:32x32,token_type_ids:32x32"
    copied = tmp_path / "repo" / "m_trt_onnx" / "1" / "model.onnx"
    assert copied.read_bytes() == (ckpt / "model.trt.onnx").read_bytes()

    plan = parse_config(tmp_path / "repo" / "m_trt" / "config.pbtxt")
    assert plan.platform == "tensorrt_plan" and plan.instance_group[0].kind == kind_gpu
    assert plan.max_batch_size == 8  # the engine's profile allows at most 8 rows
    assert [i.name for i in plan.input] == ["input_ids", "attention_mask", "token_type_ids"]
    assert (tmp_path / "repo" / "m_trt" / "1" / "model.plan").read_bytes() == b"not a real plan"
    assert "TensorRT 10.5.0" in (tmp_path / "repo" / "m_trt" / "config.pbtxt").read_text()

    add_engine(ckpt, "tensorrt-rtx", tmp_path)
    repo = write_triton_repo(ckpt, tmp_path / "repo", model_name="m")
    assert "m_trt" not in repo.models and "tensorrt-rtx" in repo.skipped["m_trt"]
    assert repo.removed == ["m_trt"] and not (tmp_path / "repo" / "m_trt").exists()


def test_refusals(sst2, tmp_path):
    with pytest.raises(TritonRepoError, match="model name"):
        write_triton_repo(sst2, tmp_path / "repo", model_name="../evil")
    with pytest.raises(TritonRepoError, match="max batch size"):
        write_triton_repo(sst2, tmp_path / "repo", max_batch_size=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(TritonRepoError, match="not a folder"):
        write_triton_repo(sst2, tmp_path / "file")
    plain = tiny_checkpoint("sst2", onnx=False)
    with pytest.raises(TritonRepoError, match="no onnxruntime export"):
        write_triton_repo(plain, tmp_path / "repo")
    # A model folder that another tool wrote is never removed as "stale".
    (tmp_path / "repo2" / "ckpt-sst2_trt").mkdir(parents=True)
    (tmp_path / "repo2" / "ckpt-sst2_trt" / "config.pbtxt").write_text('name: "ckpt-sst2_trt"\n')
    repo = write_triton_repo(sst2, tmp_path / "repo2")
    assert repo.removed == [] and (tmp_path / "repo2" / "ckpt-sst2_trt").is_dir()


def test_export_cli_writes_the_repository(sst2, tmp_path, capsys):
    """`holoserve export ... --triton-repo`, also with --out: the bundle then carries the new export, and its
    manifest records it with the file's hash."""
    import argparse

    from holoserve.export import cli

    ckpt = tmp_path / "ckpt"
    shutil.copytree(sst2, ckpt)
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args([str(ckpt), "--target", "onnxruntime", "--no-verify", "--out", str(tmp_path / "out"),
                         "--triton-repo", str(tmp_path / "repo"), "--triton-model-name", "clf",
                         "--triton-max-batch-size", "4", "--json"])
    assert cli.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["triton_repo"]["models"]) == {"clf", "clf_onnx"}
    bundle = tmp_path / "repo" / "clf" / "1" / "checkpoint"
    assert (bundle / "model.onnx").read_bytes() == (tmp_path / "out" / "model.onnx").read_bytes()
    m = read_manifest(bundle)
    assert m.exports.get("onnxruntime").file == "model.onnx"
    from holoserve.core.artifact import verify_files

    verify_files(bundle, m, ["model.onnx", "tokenizer.json", "config.json"])
    assert parse_config(tmp_path / "repo" / "clf" / "config.pbtxt").max_batch_size == 4

    args = p.parse_args([str(ckpt), "--target", "onnxruntime", "--no-verify", "--triton-repo", str(tmp_path / "r2")])
    assert cli.run(args) == 0
    out = capsys.readouterr().out
    assert "Triton model repository" in out and "ckpt: backend python" in out and "ckpt_trt: not written" in out


# --------------------------------------------------------------------------- model.py, without Triton


class FakeTensor:
    def __init__(self, name, array):
        self._name, self._array = name, array

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class FakeResponse:
    def __init__(self, output_tensors, error=None):
        self.outputs = {t.name(): t.as_numpy() for t in output_tensors}
        self.error = error


class FakeRequest:
    def __init__(self, **inputs):
        self._inputs = [FakeTensor(k, v) for k, v in inputs.items()]

    def inputs(self):
        return self._inputs


def fake_pb_utils():
    mod = types.ModuleType("triton_python_backend_utils")
    mod.Tensor = FakeTensor
    mod.InferenceResponse = FakeResponse
    mod.TritonError = lambda msg: msg
    mod.get_input_tensor_by_name = lambda req, name: next((t for t in req.inputs() if t.name() == name), None)
    return mod


def load_model(repo_model: Path, monkeypatch, instance_group: list | None = None, **params):
    """The written model.py, imported with a stand-in for Triton's module and initialized as Triton would."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils())
    spec = importlib.util.spec_from_file_location(f"triton_model_{repo_model.name}", repo_model / "1" / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.TritonPythonModel()
    cfg = {"name": repo_model.name, "parameters": {k: {"string_value": str(v)} for k, v in
                                                   {"threads": 1, "max_text_bytes": 10000, **params}.items()}}
    if instance_group is not None:
        cfg["instance_group"] = instance_group
    model.initialize({"model_config": json.dumps(cfg), "model_instance_kind": "CPU", "model_name": repo_model.name})
    return model


def column(values) -> np.ndarray:
    return np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=object).reshape(-1, 1)


def test_model_py_matches_the_onnx_backend(sst2, tmp_path, monkeypatch):
    write_triton_repo(sst2, tmp_path / "repo")
    model = load_model(tmp_path / "repo" / "ckpt-sst2", monkeypatch)
    # Several requests in one execute() call, as the dynamic batcher hands them over.
    reqs = [FakeRequest(TEXT=column(TEXTS[:2])), FakeRequest(TEXT=column(TEXTS[2:3])),
            FakeRequest(TEXT=column(TEXTS[3:]))]
    out = model.execute(reqs)
    logits = np.concatenate([r.outputs["LOGITS"] for r in out])
    want = reference(sst2, TEXTS)
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
    labels = [x.decode() for r in out for x in r.outputs["LABEL"].reshape(-1)]
    assert labels == [["negative", "positive"][k] for k in want.argmax(1)]
    assert all(r.outputs["LABEL"].shape == (len(r.outputs["LOGITS"]), 1) for r in out)
    assert out[0].outputs["LOGITS"].dtype == np.float32


def test_model_py_threads_follow_the_cpu_budget(sst2, tmp_path, monkeypatch):
    """threads 0: the CPU budget (holoserve.core.machine.cpu_budget) shared by the CPU instances, as `serve`
    shares it by workers; where no limit applies, ONNX Runtime's default; a number given is kept."""
    from holoserve.core import machine

    seen = []

    def budget(workers):
        seen.append(workers)
        return machine.CpuBudget(3, "3 threads: a CPU quota of 6 CPUs (cgroup), 8 physical cores")

    monkeypatch.setattr(machine, "cpu_budget", budget)
    write_triton_repo(sst2, tmp_path / "repo")
    model = tmp_path / "repo" / "ckpt-sst2"
    assert load_model(model, monkeypatch, threads=0).backend.threads == 3 and seen == [1]
    load_model(model, monkeypatch, [{"count": 2, "kind": "KIND_CPU"}], threads=0)
    assert seen[-1] == 2
    assert load_model(model, monkeypatch, threads=2).backend.threads == 2 and len(seen) == 2
    monkeypatch.setattr(machine, "cpu_budget", lambda workers: machine.CpuBudget(None, "the runtime's default"))
    assert load_model(model, monkeypatch, threads=0).backend.threads == 0


def test_model_py_groups_by_length_without_changing_answers(sst2, tmp_path, monkeypatch):
    write_triton_repo(sst2, tmp_path / "repo")
    model = load_model(tmp_path / "repo" / "ckpt-sst2", monkeypatch, max_padding_waste=0.1)
    calls = []
    infer = model.backend.infer
    model.backend.infer = lambda *a: calls.append(a[0].shape) or infer(*a)
    out = model.execute([FakeRequest(TEXT=column(TEXTS))])
    assert len(calls) > 1  # short and long texts were not padded together
    np.testing.assert_allclose(out[0].outputs["LOGITS"], reference(sst2, TEXTS), rtol=1e-5, atol=1e-5)


def test_model_py_pairs_and_regression(mrpc, stsb, tmp_path, monkeypatch):
    write_triton_repo(mrpc, tmp_path / "repo")
    write_triton_repo(stsb, tmp_path / "repo")
    para = load_model(tmp_path / "repo" / "ckpt-mrpc", monkeypatch)
    (r,) = para.execute([FakeRequest(TEXT=column([a for a, _ in PAIRS]), TEXT_PAIR=column([b for _, b in PAIRS]))])
    np.testing.assert_allclose(r.outputs["LOGITS"], reference(mrpc, PAIRS), rtol=1e-5, atol=1e-5)
    sim = load_model(tmp_path / "repo" / "ckpt-stsb", monkeypatch)
    (r,) = sim.execute([FakeRequest(TEXT=column([a for a, _ in PAIRS]), TEXT_PAIR=column([b for _, b in PAIRS]))])
    assert r.outputs["LOGITS"].shape == (3, 1) and [x for x in r.outputs["LABEL"].reshape(-1)] == [b"score"] * 3
    np.testing.assert_allclose(r.outputs["LOGITS"], reference(stsb, PAIRS), rtol=1e-5, atol=1e-5)


def test_model_py_refuses_bad_requests_alone(sst2, mrpc, tmp_path, monkeypatch):
    write_triton_repo(sst2, tmp_path / "repo")
    write_triton_repo(mrpc, tmp_path / "repo")
    model = load_model(tmp_path / "repo" / "ckpt-sst2", monkeypatch, max_text_bytes=50)
    good = FakeRequest(TEXT=column(["the movie was good"]))
    out = model.execute([FakeRequest(TEXT=column([b"\xff\xfe"])), good, FakeRequest(TEXT=column(["x" * 51])),
                         FakeRequest(OTHER=column(["a"])), FakeRequest(TEXT=column(["fine", "  "]))])
    assert "UTF-8" in out[0].error and out[0].outputs == {}
    assert out[1].error is None and out[1].outputs["LOGITS"].shape == (1, 2)
    assert "51 bytes" in out[2].error and "missing" in out[3].error and "blank" in out[4].error
    para = load_model(tmp_path / "repo" / "ckpt-mrpc", monkeypatch)
    (r,) = para.execute([FakeRequest(TEXT=column(["a", "b"]), TEXT_PAIR=column(["c"]))])
    assert "TEXT_PAIR has 1" in r.error
    with pytest.raises(RuntimeError, match="max_seq_length"):
        load_model(tmp_path / "repo" / "ckpt-sst2", monkeypatch, max_seq_length=10_000)


def test_model_py_refuses_a_changed_onnx_file(sst2, tmp_path, monkeypatch):
    from holoserve.core.manifest import ArtifactError

    write_triton_repo(sst2, tmp_path / "repo")
    onnx = tmp_path / "repo" / "ckpt-sst2" / "1" / "checkpoint" / "model.onnx"
    onnx.write_bytes(onnx.read_bytes()[:-1] + b"\0")
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        load_model(tmp_path / "repo" / "ckpt-sst2", monkeypatch)


# --------------------------------------------------------------------------- a real tritonserver


def stub_pythonpath() -> list[Path]:
    """Where this environment has NumPy 2, the folder of numpy<2 that the Python backend needs (.ci/setup
    installs it at <venv>/triton-python)."""
    if int(np.__version__.split(".")[0]) < 2:
        return []
    folder = Path(sys.prefix) / "triton-python"
    if not any(folder.glob("numpy-1.*.dist-info")):
        pytest.skip(f"this environment has numpy {np.__version__} and Triton's Python backend (Triton 2.51) "
                    f"needs numpy<2: pip install --no-deps --target {folder} 'numpy<2' (as .ci/setup does)")
    return [folder]


@pytest.fixture(scope="module")
def triton(sst2, mrpc, stsb, tmp_path_factory):
    """tritonserver on loopback serving the three text models; yields (url, repo)."""
    if importlib.util.find_spec("pytriton") is None:
        pytest.skip("no tritonserver: pip install --no-deps nvidia-pytriton==0.7.0 (as .ci/setup does)")
    pytest.importorskip("tritonclient.http")
    root = tmp_path_factory.mktemp("triton")
    repo = root / "repo"
    # A long queue delay, so that concurrent requests reliably meet in one batch.
    write_triton_repo(sst2, repo, max_batch_size=8, max_queue_delay_us=300_000)
    write_triton_repo(mrpc, repo)
    write_triton_repo(stsb, repo)
    # Token-id models for GPU fleets: not loaded at start (this tritonserver has neither GPU backend).
    write_triton_repo(gpu_checkpoint(sst2, root / "gpu"), repo, model_name="gpu")
    port = free_port()
    lt = local_tritonserver(repo, root / "work", Listen(http_port=port), exit_timeout_s=2, pythonpath=stub_pythonpath(),
                            models=["ckpt-sst2", "ckpt-mrpc", "ckpt-stsb"])
    env = dict(lt.env, OMP_NUM_THREADS="1")
    log = open(root / "tritonserver.log", "wb")
    proc = subprocess.Popen(lt.argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        import time

        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {proc.returncode}:\n"
                                   f"{(root / 'tritonserver.log').read_text(errors='replace')[-4000:]}")
            try:
                if httpx.get(url + "/v2/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError((root / "tritonserver.log").read_text(errors="replace")[-4000:])
            time.sleep(0.2)
        yield url, repo
    finally:
        stop(proc)
        log.close()


@contextlib.contextmanager
def client(url: str, concurrency: int = 1):
    import tritonclient.http as th

    c = th.InferenceServerClient(url.removeprefix("http://"), concurrency=concurrency, network_timeout=120)
    try:
        yield c
    finally:
        c.close()


def text_inputs(texts, pairs=None):
    import tritonclient.http as th

    out = []
    for name, values in (("TEXT", texts), ("TEXT_PAIR", pairs)):
        if values is None:
            continue
        arr = column(values)
        inp = th.InferInput(name, list(arr.shape), "BYTES")
        inp.set_data_from_numpy(arr)
        out.append(inp)
    return out


def served(ckpt: Path, body: dict) -> list[dict]:
    """Predictions of `holoserve serve` (the same app, on loopback) for a /predict body."""
    from holoserve.server.app import create_app
    from holoserve.server.config import ServerConfig

    with ThreadServer(create_app(ServerConfig(artifact_dir=str(ckpt), threads=1))) as srv:
        r = httpx.post(srv.url + "/predict", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["predictions"]


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_tritonserver_answers_like_holoserve_serve(triton, sst2):
    import tritonclient.http as th

    url, _ = triton
    with client(url) as c:
        assert c.is_model_ready("ckpt-sst2")
        res = c.infer("ckpt-sst2", text_inputs(TEXTS))
        logits, labels = res.as_numpy("LOGITS"), [x.decode() for x in res.as_numpy("LABEL").reshape(-1)]
        # Triton's classification extension reads the label names from labels.txt.
        top = c.infer("ckpt-sst2", text_inputs(TEXTS), outputs=[th.InferRequestedOutput("LOGITS", class_count=1)])
    np.testing.assert_allclose(logits, reference(sst2, TEXTS), rtol=1e-5, atol=1e-5)
    preds = served(sst2, {"texts": TEXTS})
    assert labels == [p["label"] for p in preds]
    np.testing.assert_allclose(softmax(logits), [[p["scores"][k] for k in ("negative", "positive")] for p in preds],
                               rtol=1e-5, atol=1e-6)
    assert [x.decode().split(":")[2] for x in top.as_numpy("LOGITS").reshape(-1)] == labels


def test_tritonserver_pairs_and_regression(triton, mrpc, stsb):
    url, _ = triton
    a, b = [p[0] for p in PAIRS], [p[1] for p in PAIRS]
    with client(url) as c:
        para = c.infer("ckpt-mrpc", text_inputs(a, b))
        sim = c.infer("ckpt-stsb", text_inputs(a, b))
    preds = served(mrpc, {"pairs": [list(p) for p in PAIRS]})
    assert [x.decode() for x in para.as_numpy("LABEL").reshape(-1)] == [p["label"] for p in preds]
    np.testing.assert_allclose(para.as_numpy("LOGITS"), reference(mrpc, PAIRS), rtol=1e-5, atol=1e-5)
    scores = served(stsb, {"pairs": [list(p) for p in PAIRS]})
    np.testing.assert_allclose(sim.as_numpy("LOGITS")[:, 0], [p["score"] for p in scores], rtol=1e-5, atol=1e-5)
    assert [x.decode() for x in sim.as_numpy("LABEL").reshape(-1)] == ["score"] * 3


def test_tritonserver_batches_concurrent_requests(triton, sst2):
    """Single-text requests sent together are combined by Triton's dynamic batcher; each still gets its
    own answer."""
    url, _ = triton
    texts = [f"{t} {i}" for i, t in enumerate(TEXTS[:3] * 2)]
    stats = lambda: httpx.get(f"{url}/v2/models/ckpt-sst2/stats", timeout=10).json()["model_stats"][0]  # noqa: E731
    before = stats()
    with client(url, concurrency=len(texts)) as c:
        pending = [c.async_infer("ckpt-sst2", text_inputs([t])) for t in texts]
        results = [p.get_result() for p in pending]
    after = stats()
    logits = np.concatenate([r.as_numpy("LOGITS") for r in results])
    np.testing.assert_allclose(logits, reference(sst2, texts), rtol=1e-5, atol=1e-5)
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == len(texts) and executions < inferences


def test_tritonserver_reports_a_bad_request_and_parses_every_config(triton):
    """A non-UTF-8 text gets Triton's 400 error while the model stays up. The token-id models' configs pass
    Triton's own parser and checks: loading them stops only where this CPU-only tritonserver lacks the
    backend or the GPU (a config Triton cannot read fails earlier, "failed to poll from model repository")."""
    import tritonclient.http as th
    from tritonclient.utils import InferenceServerException

    url, repo = triton
    with client(url) as c:
        arr = np.array([[b"\xff\xfe"]], dtype=object)
        inp = th.InferInput("TEXT", [1, 1], "BYTES")
        inp.set_data_from_numpy(arr)
        with pytest.raises(InferenceServerException, match="UTF-8"):
            c.infer("ckpt-sst2", [inp])
        assert c.is_model_ready("ckpt-sst2")
    errors = {}
    for model in ("ckpt-sst2_onnx", "gpu_onnx", "gpu_trt_onnx", "gpu_trt"):
        r = httpx.post(f"{url}/v2/repository/models/{model}/load", timeout=60)
        assert r.status_code == 400, (model, r.text)
        errors[model] = r.json()["error"]
        assert "poll" not in errors[model], errors[model]
    for model, backend in (("ckpt-sst2_onnx", "onnxruntime"), ("gpu_onnx", "onnxruntime"),
                           ("gpu_trt_onnx", "onnxruntime"), ("gpu_trt", "tensorrt")):
        assert f"unable to find backend library for backend '{backend}'" in errors[model], errors[model]
