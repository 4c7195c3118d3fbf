"""Checkpoint round trip, and every bad checkpoint gives its own clear ArtifactError."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForSequenceClassification

from holoserve.compress.checkpoint import CheckpointContents, load_model, save_checkpoint
from holoserve.compress.layers import encoder_linear_names
from holoserve.compress.sparsify import finalize, hard_masks
from holoserve.core.artifact import ArtifactError, load_artifact
from holoserve.core.files import file_entry
from holoserve.cli import main
from holoserve.data.tasks import get_task

from tests.helpers.checkpoints import check_saved_checkpoint
from tests.helpers.tiny import make_tiny_bert

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("art")
    src = make_tiny_bert(root / "tiny", hidden=32, intermediate=64)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(src), local_files_only=True)
    layers = encoder_linear_names(model)
    scales = finalize(model, hard_masks(model, layers), quant=True)
    amax = {f"{n}.input": 3.0 for n in layers}
    out = root / "ckpt"
    save_checkpoint(model, src, out, CheckpointContents(task=get_task("sst2"), base_model="tiny",
        max_seq_length=32, sparse_layers=layers, weight_scales=scales, act_amax=amax,
        metrics={"primary": "accuracy", "dense": {"accuracy": 0.9}, "compressed": {"accuracy": 0.89}}))
    return out, model, src


@pytest.fixture
def ckpt(good, tmp_path):
    dst = tmp_path / "c"
    shutil.copytree(good[0], dst)
    return dst


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def _write_manifest(path, m):
    (path / "manifest.json").write_text(json.dumps(m))


def _rewrite_weights(path, fn):
    """Change model.safetensors with fn(tensors) and re-record its checksum, so only the weight check can fail."""
    t = load_file(str(path / "model.safetensors"))
    fn(t)
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    m = _manifest(path)
    m["files"]["model.safetensors"] = file_entry(path / "model.safetensors")
    _write_manifest(path, m)


def _fails(path, *fragments):
    with pytest.raises(ArtifactError) as e:
        load_artifact(path)
    for f in fragments:
        assert f in str(e.value), str(e.value)
    return str(e.value)


def test_round_trip(good):
    path, model, _ = good
    check_saved_checkpoint(path)
    loaded, art = load_model(path)
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    x = torch.randint(5, 50, (2, 7))
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=x).logits, loaded(input_ids=x).logits)
    assert art.task_name == "sst2" and art.labels == ["negative", "positive"] and art.nm == (2, 4)
    assert art.activation_amax()[f"{art.sparse_layers[0]}.input"] == 3.0
    assert np.array_equal(art.weight_scales(art.sparse_layers[0]),
                          np.asarray(_manifest(path)["quantization"]["weights"]["scales"][art.sparse_layers[0]],
                                     dtype=np.float32))
    assert loaded.config.id2label == {0: "negative", 1: "positive"}


def test_missing_file(ckpt):
    (ckpt / "tokenizer.json").unlink()
    _fails(ckpt, "missing file 'tokenizer.json'")


def test_checksum_mismatch(ckpt):
    cfg = (ckpt / "config.json").read_bytes()
    (ckpt / "config.json").write_bytes(cfg.replace(b"bert", b"BERT", 1))
    _fails(ckpt, "checksum mismatch for config.json")


def test_size_mismatch(ckpt):
    with open(ckpt / "model.safetensors", "ab") as f:
        f.write(b"\0" * 8)
    _fails(ckpt, "model.safetensors has", "truncated or was replaced")


def test_layer_listed_sparse_but_dense(ckpt):
    layer = _manifest(ckpt)["sparsity"]["layers"][0]

    def densify(t):
        w = t[f"{layer}.weight"]
        t[f"{layer}.weight"] = np.where(w == 0, w[0, 0] if w[0, 0] else np.float32(0.01), w).astype(np.float32)

    _rewrite_weights(ckpt, densify)
    _fails(ckpt, f"layer {layer!r} is listed as 2:4 sparse", "groups of 4 hold more than 2 non-zeros")


def test_weight_off_its_int8_grid(ckpt):
    layer = _manifest(ckpt)["sparsity"]["layers"][1]

    def nudge(t):
        w = t[f"{layer}.weight"]
        i = np.flatnonzero(w)[3]
        w.flat[i] = np.nextafter(w.flat[i], np.float32(np.inf))

    _rewrite_weights(ckpt, nudge)
    _fails(ckpt, f"layer {layer!r} is not exactly int8 x per-channel scale")


def test_wrong_number_of_scales(ckpt):
    m = _manifest(ckpt)
    layer = m["sparsity"]["layers"][0]
    m["quantization"]["weights"]["scales"][layer] = m["quantization"]["weights"]["scales"][layer][:-1]
    _write_manifest(ckpt, m)
    _fails(ckpt, "output channels but")


def test_listed_layer_missing_from_weights(ckpt):
    m = _manifest(ckpt)
    m["sparsity"]["layers"].append("bert.encoder.layer.9.output.dense")
    _write_manifest(ckpt, m)
    _fails(ckpt, "'bert.encoder.layer.9.output.dense' is listed", "is not in model.safetensors")


@pytest.mark.parametrize("version,msg", [(99, "is newer than this HoloServe understands"),
                                         (0, "unknown manifest schema_version 0"),
                                         ("1", "no integer schema_version")])
def test_schema_versions(ckpt, version, msg):
    m = _manifest(ckpt)
    m["schema_version"] = version
    _write_manifest(ckpt, m)
    _fails(ckpt, msg)


def test_schema_v1_checkpoint_still_loads(ckpt):
    """A manifest written before the typed schema (v1: no task.num_labels) loads, upgraded in memory;
    the next write stores the current version."""
    from holoserve.core.artifact import add_files
    from holoserve.core.manifest import SCHEMA_VERSION

    m = _manifest(ckpt)
    m["schema_version"] = 1
    del m["task"]["num_labels"]
    m["exports"] = {}
    _write_manifest(ckpt, m)
    art = load_artifact(ckpt)
    assert art.manifest.schema_version == SCHEMA_VERSION == 3
    assert art.num_labels == 2 and art.labels == ["negative", "positive"]
    (ckpt / "notes.txt").write_text("x")
    add_files(art, {"notes.txt": ckpt / "notes.txt"})
    assert _manifest(ckpt)["schema_version"] == 3 and _manifest(ckpt)["task"]["num_labels"] == 2


def test_schema_v2_checkpoint_loads_without_a_sequence_length_section(ckpt):
    """Schema 3 adds only the optional `sequence_length` section: a v2 manifest (without it) loads as 3, a
    section with an unknown field or a bad value is refused by name."""
    m = _manifest(ckpt)
    m["schema_version"] = 2
    m.pop("sequence_length", None)
    _write_manifest(ckpt, m)
    art = load_artifact(ckpt)
    assert art.manifest.schema_version == 3 and art.manifest.sequence_length is None
    good = {"source": "data", "train_rows": 10, "train_rows_truncated": 0, "longest_row": 12, "coverage": 0.99,
            "tokens_at_coverage": 12, "multiple": 32, "preset_cap": 64, "model_positions": 512}
    m["schema_version"] = 3
    m["sequence_length"] = good
    _write_manifest(ckpt, m)
    assert load_artifact(ckpt).manifest.sequence_length.tokens_at_coverage == 12
    for bad, msg in ((dict(good, guess=1), "sequence_length.guess"), (dict(good, source="preset"), "source"),
                     (dict(good, coverage=1.5), "coverage")):
        m["sequence_length"] = bad
        _write_manifest(ckpt, m)
        _fails(ckpt, msg)


@pytest.mark.parametrize("where,value,msg", [
    ((), ("surprise", 1), "surprise: Extra inputs are not permitted"),
    (("task",), ("pair", "maybe"), "task.pair: Input should be a valid boolean"),
    (("quantization", "activations"), ("qmax", 255), "quantization.activations.qmax"),
    (("sparsity",), ("n", 4), "sparsity n/m invalid (4/4)"),
])
def test_manifest_fields_are_typed_and_closed(ckpt, where, value, msg):
    """Unknown fields are refused and every field is type-checked, naming the field in the error."""
    m = _manifest(ckpt)
    section = m
    for key in where:
        section = section[key]
    section[value[0]] = value[1]
    _write_manifest(ckpt, m)
    _fails(ckpt, "does not follow schema 3", msg)


def test_export_entries_are_typed(ckpt):
    from holoserve.core.artifact import add_files

    (ckpt / "model.onnx").write_bytes(b"onnx")
    with pytest.raises(ArtifactError, match="exports.onnxruntime.opset"):
        add_files(ckpt, {"model.onnx": ckpt / "model.onnx"}, exports={"onnxruntime": {"file": "model.onnx",
                                                                                     "opset": "seventeen"}})
    assert "model.onnx" not in _manifest(ckpt)["files"], "a refused entry must leave the manifest alone"


def test_invalid_json(ckpt):
    (ckpt / "manifest.json").write_text('{"format": "holoserve-checkpoint", ')
    _fails(ckpt, "manifest.json is not valid JSON")


def test_not_a_checkpoint(tmp_path, good):
    _fails(tmp_path, "missing manifest.json", "not a HoloServe checkpoint")
    _fails(tmp_path / "nowhere", "does not exist")
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    _fails(tmp_path, "is not a holoserve-checkpoint manifest")
    # a plain HF folder (the teacher kind) is not a checkpoint either
    _fails(good[2], "missing manifest.json")


def test_damaged_safetensors(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"not safetensors at all")
    m = _manifest(ckpt)
    m["files"]["model.safetensors"] = file_entry(ckpt / "model.safetensors")
    _write_manifest(ckpt, m)
    _fails(ckpt, "cannot be read as safetensors")


def test_writer_refuses_unprojected_weights(good, tmp_path):
    _, _, src = good
    model = AutoModelForSequenceClassification.from_pretrained(str(src), local_files_only=True)
    layers = encoder_linear_names(model)
    with pytest.raises(ArtifactError, match="is listed as 2:4 sparse"):
        save_checkpoint(model, src, tmp_path / "bad", CheckpointContents(task=get_task("sst2"), base_model="tiny",
            max_seq_length=32, sparse_layers=layers))
    assert not (tmp_path / "bad").exists()


def test_cli_reports_bad_checkpoint_without_traceback(ckpt, capsys):
    (ckpt / "manifest.json").write_text("{")
    assert main(["eval", str(ckpt), "--data-dir", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not valid JSON" in err and "Traceback" not in err


def test_checkpoint_files_are_readable_by_other_users(good, tmp_path):
    """Temp-file based atomic writes must not leave 0600 files (a server in a container runs as another user)."""
    import os
    import stat

    from holoserve.core.files import atomic_copy, atomic_write_bytes

    old = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "a", b"x")
        atomic_copy(tmp_path / "a", tmp_path / "b")
        out = tmp_path / "ckpt"
        shutil.copytree(good[0], tmp_path / "src")
        m = _manifest(tmp_path / "src")
        from holoserve.core.artifact import write_artifact

        write_artifact(out, m, {n: tmp_path / "src" / n for n in m["files"]})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "b").stat().st_mode) == 0o644
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o644 for f in out.iterdir())
