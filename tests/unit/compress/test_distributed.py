"""`holoserve compress` under 🤗 Accelerate with two CPU processes (DDP over gloo): the checkpoint passes
the same contract checks, and a second run resumes from the saved state to the same weights."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

from holoserve.core.artifact import load_artifact
from tests.helpers.checkpoints import check_saved_checkpoint, write_glue
from tests.helpers.tiny import make_tiny_bert

REPO = Path(__file__).resolve().parents[3]


def _launch(args, tmp_path):
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or "accelerate"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
           "no", "--dynamo_backend", "no", "-m", "holoserve", "compress", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


def test_two_processes_write_a_valid_checkpoint_and_resume(tmp_path):
    base = make_tiny_bert(tmp_path / "tiny", hidden=32, intermediate=64)
    glue = write_glue(tmp_path / "glue")
    out = tmp_path / "out"
    args = ["--task", "sst2", "--data-dir", str(glue), "--model", str(base), "--out", str(out), "--max-steps", "6",
            "--no-progress", "--device", "cpu", "--set", "batch_size=8", "--set", "calib_batches=2",
            "--set", "save_every=3"]
    first = _launch(args, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    info = check_saved_checkpoint(out)  # independent checker: every encoder Linear 2:4 and int8-exact
    assert info["quantized"] and info["layers"] == 12  # 2 layers x 6 Linears
    art = load_artifact(out)  # the contract checks of the loader
    assert art.manifest.training["processes"] == 2
    assert first.stderr.count("[dense] steps=") == 1, "only the main process logs"
    weights = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    again = _launch([*args, "--overwrite"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already done (saved state)" in again.stderr or "already trained (saved state)" in again.stderr
    assert hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() == weights
    assert json.loads((out / "manifest.json").read_text())["training"]["processes"] == 2
