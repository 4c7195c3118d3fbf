"""bench.cpu_latency.shape_churn runs its three engines on every length, twice, and says what it timed."""
import sys

import pytest

pytest.importorskip("openvino")

from tests.unit.backends.test_openvino import with_openvino  # noqa: F401  (an exported tiny checkpoint)
from tests.unit.export.test_export import exported  # noqa: F401


def test_shape_churn_times_exact_and_padded_lengths(with_openvino, monkeypatch, capsys):
    from bench.cpu_latency import shape_churn

    ckpt, _ = with_openvino
    monkeypatch.setattr(sys, "argv", ["shape_churn", str(ckpt), "--rows", "2", "--runs", "3"])
    shape_churn.main()
    out = capsys.readouterr().out
    assert "3 lengths, 17 to 21" in out
    for label in ("2 rows, each length new: ", "2 rows, the same lengths again: "):
        line = next(x for x in out.splitlines() if x.startswith(label))
        for engine in ("onnxruntime", "openvino, exact lengths", "openvino, padded to 16"):
            assert f"{engine} " in line
