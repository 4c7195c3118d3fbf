"""The checkpoint contract where checkpoints are read: only regular files inside the folder that the
manifest lists with their hash; config and manifest agree; hostile files get clear errors; a writer
killed at any instant leaves the old or the new complete checkpoint, and its leftovers are swept."""
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from holoserve.core.artifact import ArtifactError, add_files, load_artifact
from holoserve.core.files import file_entry, sweep_stale, temp_sibling
from tests.unit.core.test_artifact import _fails, _manifest, _write_manifest, ckpt, good  # noqa: F401  (fixtures)


def _relist(path, name):
    m = _manifest(path)
    m["files"][name] = file_entry(path / name)
    _write_manifest(path, m)


def test_a_symlinked_file_is_refused(ckpt, tmp_path):
    (tmp_path / "elsewhere.json").write_bytes((ckpt / "tokenizer.json").read_bytes())
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "tokenizer.json").symlink_to(tmp_path / "elsewhere.json")
    _fails(ckpt, "tokenizer.json is a symbolic link")
    with pytest.raises(ArtifactError, match="symbolic link"):
        load_artifact(ckpt, verify=False, check_weights=False)  # also where hashes are not checked


@pytest.mark.parametrize("name", ["../../elsewhere.onnx", "sub/model.onnx", ".hidden.onnx", " model.onnx"])
def test_export_entries_name_plain_files(ckpt, name):
    m = _manifest(ckpt)
    m["exports"] = {"onnxruntime": {"file": name}}
    _write_manifest(ckpt, m)
    _fails(ckpt, "is not a plain file name inside the checkpoint folder")


def test_an_export_must_be_listed_with_its_hash(ckpt):
    (ckpt / "model.onnx").write_bytes(b"unlisted")
    m = _manifest(ckpt)
    m["exports"] = {"onnxruntime": {"file": "model.onnx"}}
    _write_manifest(ckpt, m)
    _fails(ckpt, "does not list in files")


def test_files_outside_the_folder_are_refused(ckpt):
    m = _manifest(ckpt)
    m["files"]["../manifest.json"] = m["files"]["config.json"]
    _write_manifest(ckpt, m)
    _fails(ckpt, "'../manifest.json' is not a plain file name")


def test_a_huge_manifest_is_refused_unread(ckpt):
    with open(ckpt / "manifest.json", "r+b") as f:
        f.truncate(300 << 20)  # sparse: 300 MB on paper
    t0 = time.perf_counter()
    _fails(ckpt, "manifest.json is 300 MiB")
    assert time.perf_counter() - t0 < 5


def test_a_deeply_nested_manifest_is_a_clear_error(ckpt):
    (ckpt / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    _fails(ckpt, "nested too deeply")


def test_labels_must_match_the_model_outputs(ckpt):
    m = _manifest(ckpt)
    m["task"]["labels"] = ["a", "b", "c"]
    m["task"]["num_labels"] = 3
    _write_manifest(ckpt, m)
    _fails(ckpt, "the model has 2 outputs (config.json) but manifest.json says task.num_labels = 3")


def test_a_corrupt_config_with_a_valid_checksum_is_a_clear_error(ckpt):
    (ckpt / "config.json").write_text("{not json")
    _relist(ckpt, "config.json")
    _fails(ckpt, "config.json is not valid JSON")


def test_pickle_bytes_named_safetensors_are_never_unpickled(ckpt):
    (ckpt / "model.safetensors").write_bytes(pickle.dumps({"w": [1, 2, 3]}))
    _relist(ckpt, "model.safetensors")
    m = _manifest(ckpt)
    m["sparsity"] = m["quantization"] = None  # even a checkpoint with nothing to prove about its weights
    _write_manifest(ckpt, m)
    _fails(ckpt, "cannot be read as safetensors")


def test_a_refused_swap_leaves_the_old_checkpoint(ckpt, tmp_path, monkeypatch):
    import holoserve.core.artifact as artifact

    before = (ckpt / "manifest.json").read_bytes()
    (tmp_path / "extra.txt").write_text("new")

    def crash(new, dst):
        raise OSError("killed")

    monkeypatch.setattr(artifact, "replace_dir", crash)
    with pytest.raises(OSError, match="killed"):
        add_files(ckpt, {"extra.txt": tmp_path / "extra.txt"}, move=False)
    assert (ckpt / "manifest.json").read_bytes() == before and not (ckpt / "extra.txt").exists()
    assert not [p for p in ckpt.parent.iterdir() if p.name.startswith(f".{ckpt.name}.")], "temporary left behind"
    load_artifact(ckpt)


def test_leftovers_of_dead_writers_are_swept_and_live_ones_kept(ckpt):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = ckpt.parent / f".{ckpt.name}.{int(dead.stdout)}.export-abc"
    stale.mkdir()
    (stale / "model.onnx").write_bytes(b"x" * 1000)
    live = temp_sibling(ckpt, "tmp")  # this process's
    assert sweep_stale(ckpt) == [stale.name]
    assert not stale.exists() and live.exists()


WRITER = textwrap.dedent("""
    import sys, os
    from pathlib import Path
    from holoserve.core.artifact import add_files, write_artifact, load_artifact
    ckpt, mode, i = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    src = ckpt.parent / f"payload-{i}.bin"
    src.write_bytes(os.urandom(8 << 20))
    print("go", flush=True)
    if mode == "add":
        add_files(ckpt, {"model.onnx": src}, exports={"onnxruntime": {"file": "model.onnx"}}, move=False)
    else:
        art = load_artifact(ckpt, check_weights=False)
        write_artifact(ckpt, art.manifest, {n: ckpt / n for n in art.manifest.files}, overwrite=True)
""")


@pytest.mark.parametrize("mode", ["add", "overwrite"])
def test_a_writer_killed_at_any_instant_leaves_a_complete_checkpoint(ckpt, mode):
    """SIGKILL an export-style add (or a compress-style overwrite) at staggered instants: the path
    always loads (sizes and hashes checked), and the next writer sweeps the dead one's leftovers. The
    checkpoint already has an export, so a writer that renamed the new file in before rewriting the
    manifest would leave a size/hash mismatch."""
    (ckpt.parent / "old.onnx").write_bytes(b"old export")
    add_files(ckpt, {"model.onnx": ckpt.parent / "old.onnx"}, exports={"onnxruntime": {"file": "model.onnx"}})
    for i in range(12):
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(ckpt), mode, str(i)], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        p.stdout.readline()  # imports done, payload written
        time.sleep(0.004 * i)
        p.send_signal(signal.SIGKILL)
        p.wait()
        art = load_artifact(ckpt)  # the old or the new checkpoint, complete
        if "model.onnx" in art.manifest.files:
            assert art.export("onnxruntime").file == "model.onnx"
    sweep_stale(ckpt)
    assert not [p for p in ckpt.parent.iterdir() if p.name.startswith(f".{ckpt.name}.")]
    if mode == "overwrite":
        m = json.loads((ckpt / "manifest.json").read_text())
        assert set(m["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}


def test_serve_refuses_weights_off_the_contract(ckpt, capsys):
    """What is served is checked at load: a '2:4' layer with a dense group is refused, not served."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from holoserve.cli import main

    t = load_file(str(ckpt / "model.safetensors"))
    layer = _manifest(ckpt)["sparsity"]["layers"][0]
    w = t[f"{layer}.weight"].copy()
    w[0, :4] = np.float32(w[np.nonzero(w)][0])  # one group of four non-zeros on the grid
    t[f"{layer}.weight"] = w
    save_file(t, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    _relist(ckpt, "model.safetensors")
    assert main(["serve", str(ckpt), "--backend", "torch", "--port", "0"]) == 2
    assert "is listed as 2:4 sparse but 1 groups of 4 hold more than 2 non-zeros" in capsys.readouterr().err
