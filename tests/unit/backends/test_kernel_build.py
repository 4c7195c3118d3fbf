"""Building the 2:4 kernels ahead of serving (holoserve.kernels.build / locate): what a builder needs, the
cache key, the lock, failed builds, and `auto` falling back to OpenVINO's GEMMs when the library is bad."""
from __future__ import annotations

import json
import shutil
import stat
import threading
from pathlib import Path

import pytest

pytest.importorskip("openvino")

from holoserve import kernels
from holoserve.kernels import KernelsUnavailable

if shutil.which("g++") is None:
    pytest.skip("no g++ to build the kernels with", allow_module_level=True)


@pytest.fixture(scope="module")
def built(kernel_build):
    return kernel_build


def fake_compiler(tmp_path: Path, body: str, version: str = "fake-c++ 1.0") -> Path:
    """A shell script answering --version and -dumpmachine like a compiler, running `body` otherwise
    ("$out" is the -o argument)."""
    script = tmp_path / "fake-cxx"
    script.write_text(f"""#!/bin/sh
case "$1" in --version) echo "{version}"; exit 0;; -dumpmachine) echo x86_64-linux-gnu; exit 0;; esac
out=""; prev=""; for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
{body}
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_a_build_records_its_key_and_loads_without_a_compiler(built, monkeypatch):
    cache, path = built
    info = json.loads((path.parent / kernels.BUILD_INFO).read_text())
    assert info["openvino"] and info["compiler"].startswith("g++") and info["libc"] and info["source_sha256"]
    assert not list(cache.glob("*/.build-*"))
    monkeypatch.setenv("HOLOSERVE_KERNEL_CACHE", str(cache))
    monkeypatch.setenv("CXX", "no-such-compiler-holoserve")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: set(kernels.REQUIRED_FLAGS))
    assert kernels.locate() == path == kernels.library_path()  # the prebuilt one, as in the serving image
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx512f"})
    with pytest.raises(KernelsUnavailable, match="this CPU lacks avx512bw"):
        kernels.locate()  # loading checks the CPU; building did not


def test_the_build_key_covers_the_compiler(built, tmp_path, monkeypatch):
    cache, path = built
    monkeypatch.setenv("HOLOSERVE_KERNEL_CACHE", str(cache))
    other = fake_compiler(tmp_path, "exit 1", version="g++ (Other) 99.1")
    ours = kernels.build_key(kernels._compiler_id(shutil.which("g++")))
    theirs = kernels.build_key(kernels._compiler_id(str(other)))
    assert theirs["compiler"].startswith("g++ (Other) 99.1") and kernels._key_dir(theirs) != kernels._key_dir(ours)
    monkeypatch.setenv("CXX", str(other))
    assert kernels.library_path() != path  # a new compiler means a new build


def test_a_failed_or_killed_build_leaves_nothing(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("HOLOSERVE_KERNEL_CACHE", str(cache))
    monkeypatch.setenv("CXX", str(fake_compiler(tmp_path,
                                                'echo "half a library" > "$out"; echo "error: boom" >&2; exit 1')))
    stale = cache / "0123456789abcdef" / ".build-killed.so"  # what a killed build leaves
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"partial")
    with pytest.raises(KernelsUnavailable, match="building the 2:4 kernels failed:\nerror: boom"):
        kernels.build()
    assert not [p for p in cache.rglob("*") if p.is_file() and p.name != kernels.LOCK], list(cache.rglob("*"))


def test_a_library_openvino_cannot_load_is_not_kept(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("HOLOSERVE_KERNEL_CACHE", str(cache))
    monkeypatch.setenv("CXX", str(fake_compiler(tmp_path, 'echo "not an ELF file" > "$out"')))
    with pytest.raises(KernelsUnavailable, match="OpenVINO cannot load the 2:4 kernels' library"):
        kernels.build()
    assert not list(cache.rglob("*.so")) and not list(cache.rglob(kernels.BUILD_INFO))


def test_concurrent_builds_compile_once(built, tmp_path, monkeypatch):
    """Workers starting together on an empty cache: one compiles, the others wait and load its build."""
    _, real = built
    log = tmp_path / "calls.log"
    cxx = fake_compiler(tmp_path, f'echo start >> "{log}"; sleep 1; cp "{real}" "$out"; echo end >> "{log}"')
    monkeypatch.setenv("HOLOSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(cxx))
    results, errors = [], []

    def one():
        try:
            results.append(kernels.build())
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(set(results)) == 1 and results[0].is_file()
    assert log.read_text().split() == ["start", "end"]


def test_auto_falls_back_to_openvinos_gemms_when_the_library_fails(tmp_path, monkeypatch):
    """A library that exists but that OpenVINO cannot load: `auto` serves on OpenVINO's GEMMs and says why;
    `on` fails loudly."""
    from holoserve.backends import openvino as ovb
    from holoserve.backends.base import BackendUnavailable
    from holoserve.export.onnx_export import export_checkpoint
    from tests.helpers.tiny import calibrated_tiny_checkpoint

    *_, art = calibrated_tiny_checkpoint(tmp_path / "ckpt", hidden=64, intermediate=128, max_seq_length=16)
    export_checkpoint(art.path, ["openvino"], progress=False, polygraphy=False, verify_exports=False)
    bad = tmp_path / "libbad.so"
    bad.write_bytes(b"not a library")
    monkeypatch.setattr(ovb, "cpu_has_amx", lambda: False)
    monkeypatch.setattr(kernels, "locate", lambda: bad)
    report: dict = {}
    compiled, _ = ovb.compile_model(art.path / "model.ov.onnx", threads=1, kernels="auto", report=report)
    assert report["status"].startswith("off: the kernels failed to load or compile"), report
    assert compiled.create_infer_request() is not None
    with pytest.raises(BackendUnavailable, match="with HoloServe's 2:4 kernels"):
        ovb.compile_model(art.path / "model.ov.onnx", threads=1, kernels="on")


def test_the_reference_build_has_its_own_key_and_loads_on_any_cpu(built, kernel_reference_build, monkeypatch,
                                                                  capsys):
    """The portable build: another key (flavour, flags) than the served one, built for baseline x86-64, found
    without a compiler on a CPU with none of the AVX-512 flags, where the AVX-512 build is refused."""
    from holoserve.kernels.__main__ import main

    cache, path = kernel_reference_build
    info = json.loads((path.parent / kernels.BUILD_INFO).read_text())
    served = json.loads((built[1].parent / kernels.BUILD_INFO).read_text())
    assert info["flavour"] == kernels.REFERENCE and served["flavour"] == kernels.AVX512
    assert "-DHOLOSERVE_REFERENCE" in info["cxxflags"] and "-march=x86-64 " in info["cxxflags"] + " "
    assert "avx512" not in info["cxxflags"] and info["source_sha256"] == served["source_sha256"]
    monkeypatch.setenv("HOLOSERVE_KERNEL_CACHE", str(cache))
    monkeypatch.setenv("CXX", "no-such-compiler-holoserve")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: set())
    assert kernels.locate(kernels.REFERENCE) == path == kernels.library_path(kernels.REFERENCE)
    with pytest.raises(KernelsUnavailable, match="this CPU lacks avx512f"):
        kernels.locate()
    with pytest.raises(KernelsUnavailable, match="unknown build of the 2:4 kernels 'avx2'"):
        kernels.locate("avx2")
    assert main(["build", "avx2"]) == 2 and "build [reference]" in capsys.readouterr().err
