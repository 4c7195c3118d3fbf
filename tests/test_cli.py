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
