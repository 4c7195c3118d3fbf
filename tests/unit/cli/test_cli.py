"""The one CLI: user options in --help, experiment switches only in --help-advanced."""
import pytest

from holoserve.cli import build_parser


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command,user,switch", [
    ("export", "--embeddings", "--no-fuse-attention"),
    ("build-engine", "--compute-capability", "--timing-cache"),
    ("compress", "--preset", "--train-limit"),
    ("eval", "--onnx", "--fp32"),
])
def test_help_lists_user_options_and_hides_experiment_switches(command, user, switch, capsys):
    plain = _help([command, "--help"], capsys)
    assert user in plain and switch not in plain and "--help-advanced" in plain
    full = _help([command, "--help-advanced"], capsys)
    assert user in full and switch in full


def test_advanced_switches_still_parse():
    args = build_parser().parse_args(["export", "ckpt", "--no-fuse-attention", "--threads", "2"])
    assert args.no_fuse_attention and args.threads == 2


def test_the_wheel_lists_every_package():
    """pyproject.toml names the packages one by one (compress/ and export/ map into holoserve.*): a new
    subpackage missing from that list would be left out of the wheel and the images."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = cfg["package-dir"]
    found = set()
    for pkg, folder in dirs.items():
        for init in (root / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(root / folder).parts
            found.add(".".join((pkg, *rel)))
    assert set(cfg["packages"]) == found
