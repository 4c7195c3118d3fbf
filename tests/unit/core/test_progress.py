"""Progress on stderr (holoserve.core.progress): bars on a terminal, plain lines elsewhere."""
import io

from holoserve.core import progress
from holoserve.core.progress import Progress, StepBar, counted, current


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_without_a_terminal_phases_write_plain_lines_and_no_redraws():
    out = io.StringIO()
    with Progress(20, stream=out, interval=0.0) as p:
        assert current() is p
        with p.phase("dense", 10) as bar:
            for _ in range(10):
                bar.update(1, loss="0.5")
        with p.phase("calibrate", None, weight=10):
            pass
    assert current() is not p
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert lines[0].endswith("[dense] 1/10 steps (10 %), 0:00 elapsed, ETA 0:00 loss=0.5 | overall 5 %, ETA 0:00")
    assert "[dense] 10/10 steps (100 %)" in lines[9] and "overall 50 %" in lines[9]
    assert lines[10].endswith("[calibrate] running, 0:00 elapsed | overall 50 %, ETA 0:00")
    assert p.done == p.planned == 20


def test_plain_lines_come_at_most_once_per_interval():
    out = io.StringIO()
    with Progress(1000, stream=out, interval=3600.0) as p:
        with p.phase("qat", 1000) as bar:
            for _ in range(1000):
                bar.update(1)
    assert out.getvalue() == ""


def test_on_a_terminal_the_overall_bar_and_each_phase_bar_stay():
    out = _Terminal()
    with Progress(2, stream=out, desc="compress") as p:
        assert p.bars
        with p.phase("dense", 1) as bar:
            bar.update(1)
        with p.phase("project", None):
            pass
    text = out.getvalue()
    finals = [line.rsplit("\r", 1)[-1] for line in text.split("\n") if line.strip()]
    assert any(f.startswith("dense: 100%") for f in finals), finals
    assert any(f.startswith("project: 100%") for f in finals), finals
    assert any(f.startswith("compress: 100%") for f in finals), finals


def test_a_phase_longer_than_planned_grows_the_total_and_a_disabled_one_is_silent():
    out = io.StringIO()
    with Progress(1, stream=out, interval=0.0) as p:
        with p.phase("eval", 3, enabled=False) as bar:
            for _ in range(3):
                bar.update(1)
        assert p.done == p.planned == 3
    assert out.getvalue() == ""
    quiet = io.StringIO()
    with Progress(5, stream=quiet, enabled=False, interval=0.0) as p:
        with p.phase("dense", 5) as bar:
            bar.update(5)
    assert quiet.getvalue() == ""


def test_steps_and_counted_batches_as_the_export_shows_them():
    out = io.StringIO()
    with Progress(2, stream=out, interval=0.0, desc="export") as p:
        bar = StepBar(p)
        bar.set_postfix_str("torch.onnx.export")
        bar.update(1)
        bar.set_postfix_str("verify")
        assert list(counted([1, 2], "verify: onnxruntime")) == [1, 2]
        bar.update(1)
        bar.close()
    text = out.getvalue()
    assert "[torch.onnx.export] running" in text and "[verify] running" in text
    assert "[verify: onnxruntime] 2/2 batches (100 %)" in text
    assert p.done == 2 and progress._CURRENT is None
