"""Timing caches that this machine cannot use, the per-GPU engine cache, `--if-missing`, `--require-sparse`, and
`holoserve build-engine` without torch or onnx (as in the GPU image). TensorRT-RTX runs the real builds on CPU."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import warnings

import pytest

from holoserve.export.engine import attach_timing_cache, build_engine, save_timing_cache
from holoserve.export.engine_cache import build_cached_engine, up_to_date
from holoserve.export.engine_settings import EngineBuildError, EngineOptions, Flavour, ShapeProfile, build_target
from holoserve.core.sidecar import cached_engines, read_sidecar
from tests.helpers.serving import REPO
from tests.unit.export.test_engine import trt_export  # noqa: F401  (the fixture)

HAVE_RTX = importlib.util.find_spec("tensorrt_rtx") is not None
needs_rtx = pytest.mark.skipif(not HAVE_RTX, reason="TensorRT-RTX (pip install 'holoserve[tensorrt]') is not installed")
SMALL = ShapeProfile((1, 1), (4, 16), (8, 32))


# ------------------------------------------------------------------------------------------ timing cache


class _Cache:
    def __init__(self, data=b"fresh-cache"):
        self.data = data

    def serialize(self):
        return self.data


class _Config:
    """IBuilderConfig's timing-cache calls, behaving as datacenter TensorRT does with a foreign cache."""

    def __init__(self, accepts_blob=False, create_raises=False, accepts_fresh=True, get_returns_none=False):
        self.accepts_blob, self.create_raises = accepts_blob, create_raises
        self.accepts_fresh, self.get_returns_none = accepts_fresh, get_returns_none
        self.attached = None

    def create_timing_cache(self, blob):
        if blob and self.create_raises:
            raise RuntimeError("Failed to deserialize timing cache")
        return _Cache(bytes(blob) or b"fresh-cache")

    def set_timing_cache(self, cache, ignore_mismatch):
        assert ignore_mismatch is False  # never load a cache from another device on purpose
        ok = self.accepts_fresh if cache.data == b"fresh-cache" else self.accepts_blob
        if ok:
            self.attached = cache
        return ok

    def get_timing_cache(self):
        return None if self.get_returns_none else self.attached


def test_timing_cache_from_another_gpu_falls_back_to_a_fresh_one(tmp_path):
    cfg = _Config(accepts_blob=False)
    cache, note = attach_timing_cache(cfg, b"cache-from-an-A100")
    assert cache is cfg.attached and cache.data == b"fresh-cache" and "another GPU or TensorRT version" in note
    path = tmp_path / "timing.cache"
    assert save_timing_cache(cfg, path) is None and path.read_bytes() == b"fresh-cache"

    cfg = _Config(accepts_blob=True)
    assert attach_timing_cache(cfg, b"cache-from-this-gpu")[1] == "reused"
    assert attach_timing_cache(_Config(), b"")[1] == "created"
    assert attach_timing_cache(_Config(create_raises=True), b"garbage")[0].data == b"fresh-cache"
    assert attach_timing_cache(_Config(accepts_fresh=False), b"x") == (None, "could not attach a timing cache; "
                                                                           "built without one")
    # TensorRT hands back an empty cache for a file it cannot read: that is not a reused cache either
    assert "not reusable here" in attach_timing_cache(_Config(accepts_blob=True), b"fresh-cache")[1]


def test_no_timing_cache_to_save_is_a_note_not_a_crash(tmp_path):
    """get_timing_cache() returning None used to crash the build after the plan was written (None.serialize())."""
    path = tmp_path / "timing.cache"
    assert "no timing cache" in save_timing_cache(_Config(get_returns_none=True), path)
    assert not path.exists()


@needs_rtx
def test_timing_cache_calls_on_a_real_builder_config(tmp_path):
    """The same calls against TensorRT-RTX's IBuilderConfig (where they are deprecated no-ops): nothing crashes."""
    import tensorrt_rtx as trt

    builder = trt.Builder(trt.Logger(trt.Logger.ERROR))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        cfg = builder.create_builder_config()
        cache, note = attach_timing_cache(cfg, b"")
        assert cache is not None and note == "created"
        blob = bytes(cfg.get_timing_cache().serialize())  # "another build"'s cache
        cfg2 = builder.create_builder_config()
        cache2, _ = attach_timing_cache(cfg2, blob)
        assert cache2 is not None
        assert save_timing_cache(cfg2, tmp_path / "saved.cache") is None and (tmp_path / "saved.cache").stat().st_size
        # a file TensorRT cannot read comes back as an empty cache: not taken for a reused one
        cache3, note = attach_timing_cache(builder.create_builder_config(), b"garbage, not a timing cache" * 8)
        assert cache3 is not None and "not reusable here" in note


@needs_rtx
def test_rtx_build_leaves_a_foreign_timing_cache_alone(trt_export, tmp_path):
    cache = tmp_path / "from-another-build.cache"
    cache.write_bytes(b"ptrt" + bytes(range(200)))
    res = build_engine(trt_export / "model.trt.onnx", tmp_path / "e.plan",
                       EngineOptions(flavour="tensorrt_rtx", profile=SMALL, timing_cache=cache))
    assert res.plan.is_file() and res.sidecar_path.is_file()  # the sidecar is written too
    assert "not used" in res.sidecar["timing_cache"]
    assert cache.read_bytes() == b"ptrt" + bytes(range(200))


# ------------------------------------------------------------------------------------------ engine cache


@needs_rtx
def test_cached_engine_is_keyed_by_tensorrt_and_target_and_reused(trt_export, tmp_path):
    import tensorrt_rtx

    onnx_path = trt_export / "model.trt.onnx"
    cache = tmp_path / "engines"
    first = build_cached_engine(onnx_path, cache, EngineOptions(flavour="tensorrt_rtx", profile=SMALL))
    v = tensorrt_rtx.__version__
    assert not first.skipped and first.plan.parent.name == f"tensorrt-rtx-{v}-portable"
    sha = first.sidecar["onnx"]["sha256"]
    assert first.plan.parent.parent.name == sha[:16]
    mtime = first.plan.stat().st_mtime_ns
    again = build_cached_engine(onnx_path, cache, EngineOptions(flavour="tensorrt_rtx", profile=SMALL))
    assert again.skipped and again.plan == first.plan and first.plan.stat().st_mtime_ns == mtime
    pinned = build_cached_engine(onnx_path, cache, EngineOptions(flavour="tensorrt_rtx", compute_capability="SM86",
                                                              profile=SMALL))
    assert not pinned.skipped and pinned.plan.parent.name == f"tensorrt-rtx-{v}-sm86"
    assert set(cached_engines(cache, sha)) == {first.plan, pinned.plan}
    # why an engine is not up to date
    flv = Flavour("tensorrt_rtx", v)
    assert up_to_date(first.plan, flavour=flv, target=build_target(flv), onnx_sha256=sha) is None
    assert "another ONNX export" in up_to_date(first.plan, flavour=flv, target=build_target(flv), onnx_sha256="0" * 64)
    assert "not portable across versions" in up_to_date(first.plan, flavour=Flavour("tensorrt_rtx", "9.9"),
                                                        target=build_target(flv), onnx_sha256=sha)
    assert "does not exist" in up_to_date(tmp_path / "none.plan", flavour=flv, target=build_target(flv),
                                          onnx_sha256=sha)


@needs_rtx
def test_cli_cache_dir_leaves_the_checkpoint_alone(trt_export, tmp_path, capsys):
    from holoserve.cli import main

    manifest = (trt_export / "manifest.json").read_bytes()
    args = ["build-engine", str(trt_export), "--cache-dir", str(tmp_path / "engines"), "--if-missing",
            "--flavour", "tensorrt_rtx", "--max", "8x32", "--opt", "4x16"]
    assert main(args) == 0
    assert "built in" in capsys.readouterr().out
    assert main(args) == 0
    assert "is up to date" in capsys.readouterr().out
    assert (trt_export / "manifest.json").read_bytes() == manifest  # nothing recorded in the checkpoint
    plans = list((tmp_path / "engines").glob("*/*/model.plan"))
    assert len(plans) == 1 and read_sidecar(plans[0])["profiles"][0]["input_ids"]["max"] == [8, 32]
    assert main([*args, "--out", str(tmp_path / "x.plan")]) == 2
    assert "either --out or --cache-dir" in capsys.readouterr().err


@needs_rtx
def test_require_sparse_fails_without_confirmed_sparse_kernels(trt_export, tmp_path, capsys):
    from holoserve.cli import main

    out = tmp_path / "e.plan"
    rc = main(["build-engine", str(trt_export / "model.trt.onnx"), "--out", str(out), "--flavour", "tensorrt_rtx",
               "--max", "8x32", "--opt", "4x16", "--require-sparse"])
    err = capsys.readouterr().err
    assert rc == 2 and "--require-sparse: 0 of 12 weight GEMMs run sparse kernels, 12 unknown" in err
    assert "no plan was written" in err and "Traceback" not in err
    assert not out.exists() and not out.with_name("e.plan.json").exists()
    with pytest.raises(EngineBuildError, match="--require-sparse"):
        build_engine(trt_export / "model.trt.onnx", out,
                     EngineOptions(flavour="tensorrt_rtx", profile=SMALL, require_sparse=True))


@needs_rtx
def test_build_engine_needs_neither_torch_nor_onnx(trt_export, tmp_path):
    """What the GPU image has: TensorRT and the base install, no [export] extra."""
    code = (
        "import sys, json\n"
        "for m in ('torch', 'transformers', 'onnx', 'onnxscript', 'polygraphy', 'onnxruntime'):\n"
        "    sys.modules[m] = None  # importing any of them now fails\n"
        "from holoserve.cli import main\n"
        f"rc = main(['build-engine', {str(trt_export)!r}, '--cache-dir', {str(tmp_path / 'engines')!r},"
        " '--flavour', 'tensorrt_rtx', '--max', '8x32', '--opt', '4x16'])\n"
        "print(json.dumps({'rc': rc}))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"rc": 0}, r.stdout + r.stderr
    assert list((tmp_path / "engines").glob("*/*/model.plan.json"))
