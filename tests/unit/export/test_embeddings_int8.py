"""Per-row INT8 word embeddings: compress puts the table on its grid, the manifest records the
scales, the loader proves them on the saved file, and export stores the table as int8 losslessly."""
import json
import os

import numpy as np
import pytest

from holoserve.core.artifact import ArtifactError, load_artifact

from holoserve.core.files import atomic_write_json
from holoserve.cli import main

from tests.helpers.checkpoints import check_saved_checkpoint, write_glue
from tests.helpers.tiny import make_tiny_bert

os.environ.setdefault("OMP_NUM_THREADS", "1")
TABLE = "bert.embeddings.word_embeddings"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("emb")
    model = make_tiny_bert(root / "tiny", hidden=32, intermediate=64)
    glue = write_glue(root / "glue")
    out = root / "ckpt"
    argv = ["compress", "--task", "sst2", "--data-dir", str(glue), "--out", str(out), "--model", str(model),
            "--max-steps", "8", "--threads", "1", "--no-progress", "--set", "quantize_embeddings=true"]
    assert main(argv) == 0
    return {"path": out, "glue": glue}


def test_table_is_on_its_per_row_int8_grid_on_disk(ckpt):
    from safetensors.numpy import load_file

    path = ckpt["path"]
    check_saved_checkpoint(path)
    m = json.loads((path / "manifest.json").read_text())
    entry = m["quantization"]["embeddings"][TABLE]
    table = load_file(str(path / "model.safetensors"))[f"{TABLE}.weight"]
    s = np.asarray(entry["scales"], np.float32)[:, None]
    assert entry["granularity"] == "per_row" and len(entry["scales"]) == table.shape[0]
    codes = np.rint(table / s)
    assert np.abs(codes).max() <= 127
    assert np.array_equal(codes.astype(np.float32) * s, table)
    assert np.array_equal(load_artifact(path).embedding_scales(), s[:, 0])


def test_eval_reproduces_the_manifest_metric(ckpt, capsys):
    assert main(["eval", str(ckpt["path"]), "--task", "sst2", "--data-dir", str(ckpt["glue"])]) == 0
    out = json.loads(capsys.readouterr().out)
    m = json.loads((ckpt["path"] / "manifest.json").read_text())
    assert out["metrics"]["accuracy"] == pytest.approx(m["metrics"]["compressed"]["accuracy"])


def test_table_off_its_grid_is_refused(ckpt, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpt["path"], bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["quantization"]["embeddings"][TABLE]["scales"][5] *= 1.37
    atomic_write_json(bad / "manifest.json", m)
    with pytest.raises(ArtifactError, match="not exactly int8 x per-row scale"):
        load_artifact(bad)


def test_export_stores_the_table_as_int8_losslessly(ckpt, tmp_path, capsys):
    pytest.importorskip("onnx")
    import shutil

    import onnx
    from onnx import numpy_helper

    path = tmp_path / "exp"
    shutil.copytree(ckpt["path"], path)
    # default --embeddings auto: int8 only when lossless, which the checkpoint's own scales make it
    assert main(["export", str(path), "--target", "onnxruntime", "--data-dir", str(ckpt["glue"])]) == 0
    out = capsys.readouterr().out
    assert "int8 word embeddings" in out and "written as MatMulIntegerToFloat" in out
    model = onnx.load(str(path / "model.onnx"))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    codes = inits["word_embeddings.int8"]
    scales = inits["word_embeddings.row_scale"]
    assert codes.dtype == np.int8
    from safetensors.numpy import load_file

    table = load_file(str(path / "model.safetensors"))[f"{TABLE}.weight"]
    assert np.array_equal(codes.astype(np.float32) * scales[:, None], table)
    entry = json.loads((path / "manifest.json").read_text())["exports"]["onnxruntime"]
    assert isinstance(entry["word_embeddings"], dict)


def test_gpu_carry_packs_the_int8_table_as_codes_exactly(ckpt, tmp_path):
    """bench/gpu/pack.py: an INT8-grid embedding table is packed as int8 codes and unpacks bit-exactly
    (as fp16 it would break the checkpoint's own INT8 contract on the GPU machine)."""
    from pathlib import Path

    import numpy as np
    from safetensors.numpy import load_file

    from tests.helpers.bench import gpu_module

    packing = gpu_module("pack")
    info = packing.pack(ckpt["path"], tmp_path / "packed", fp16_min_elements=1)  # every other float tensor as fp16
    assert info["kinds"]["bert.embeddings.word_embeddings.weight"] == "int8"
    art = packing.unpack(tmp_path / "packed", tmp_path / "back")  # verified on load: INT8 grid included
    a = load_file(str(Path(ckpt["path"]) / "model.safetensors"))["bert.embeddings.word_embeddings.weight"]
    b = load_file(str(art.path / "model.safetensors"))["bert.embeddings.word_embeddings.weight"]
    assert np.array_equal(a, b)
