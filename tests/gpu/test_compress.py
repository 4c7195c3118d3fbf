"""`holoserve compress` and `holoserve eval` on a CUDA GPU (the tiny pipeline)."""
import json

import pytest

from holoserve.cli import main
from tests.helpers.checkpoints import check_saved_checkpoint
from tests.unit.compress.test_pipeline import compress, env  # noqa: F401  (env is the fixture)

pytestmark = pytest.mark.gpu


def test_compress_and_eval_on_the_gpu(env, capsys):
    out = env["root"] / "admm-cuda"
    assert compress(env, out, "--device", "cuda") == 0
    info = check_saved_checkpoint(out)  # saved from the GPU, checked on the file
    assert info["layers"] == 12 and info["quantized"]
    m = json.loads((out / "manifest.json").read_text())
    assert m["training"]["device"] == "cuda" and "GPU" in m["training"]["machine"]
    assert m["training"]["phases"]["projection"]["method"] == "obs"  # the default projection, weights on the GPU
    capsys.readouterr()
    assert main(["eval", str(out), "--data-dir", str(env["glue"]), "--device", "cuda"]) == 0
    on_gpu = json.loads(capsys.readouterr().out)["metrics"]["accuracy"]
    assert main(["eval", str(out), "--data-dir", str(env["glue"]), "--device", "cpu"]) == 0
    on_cpu = json.loads(capsys.readouterr().out)["metrics"]["accuracy"]
    assert on_gpu == pytest.approx(m["metrics"]["compressed"]["accuracy"])
    assert abs(on_cpu - on_gpu) <= 1 / 48 + 1e-9  # 48 dev rows: float32 outside the INT8 GEMMs may flip one
