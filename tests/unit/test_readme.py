"""The README's marked install and quick-start blocks, as .ci/readme-quickstart reads them (that step runs
them in CI; this checks, in seconds, that they are there and say what a new user needs)."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _block(marker: str) -> subprocess.CompletedProcess:
    script = (ROOT / ".ci" / "readme-quickstart").read_text()
    func = re.search(r"^block\(\) \{.*?^\}$", script, re.S | re.M).group(0)
    return subprocess.run(["bash", "-c", f"ROOT={ROOT}\n{func}\nblock {marker}"], capture_output=True, text=True)


def _commands(text: str) -> list[str]:
    return [line.split("#")[0].strip() for line in text.splitlines() if line.split("#")[0].strip()]


def test_the_install_block_pins_torch_first_as_the_ci_setup_does():
    res = _block("ci:readme-install")
    assert res.returncode == 0, res.stderr
    cmds = _commands(res.stdout)
    pin = re.search(r"pip install -q (torch==\S+)", (ROOT / ".ci" / "setup").read_text()).group(1)
    assert cmds[0] == f"pip install {pin}"
    assert "pip install '.[compress,export]'" in cmds and not any(c.startswith("pip install holoserve") for c in cmds)


def test_the_quick_start_needs_no_data_of_ones_own():
    res = _block("ci:readme-quickstart")
    assert res.returncode == 0, res.stderr
    cmds = _commands(res.stdout)
    assert cmds[0] == "holoserve compress --out runs/demo"
    assert not any("GLUE_DIR" in c or "--data-dir" in c or "--train" in c for c in cmds)


def test_a_missing_marker_is_an_error():
    res = _block("ci:no-such-block")
    assert res.returncode != 0 and "expected one line starting with" in res.stderr
