"""`holoserve compress --help` says plainly what runs by default and where ADMM is offered."""
import re

import pytest

from holoserve.cli import main


@pytest.fixture(scope="module")
def help_text():
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["compress", "--help"])
    return re.sub(r"\s+", " ", out.getvalue())


def test_the_help_names_the_default_method_and_what_it_does(help_text):
    assert "What runs by default (--method oneshot)" in help_text
    for step in ("a dense teacher is fine-tuned", "projected once onto 2:4 ∩ INT8", "|w|·‖x‖^0.5",
                 "optimal-brain-surgeon steps", "quantization-aware training (QAT) with distillation"):
        assert step in help_text, step
    assert "The default does not use ADMM" in help_text
    assert "ADMM-trained" not in help_text


def test_the_help_says_where_admm_is_offered_and_why_it_is_not_the_default(help_text):
    for where in ("--method admm ", "--method admm_guided",
                  "--set projection=admm ", "--set projection=admm_fixed_mask", "--set projection=admm_stable"):
        assert where in help_text, where
    assert "docs/results/2026-11-28-admm-decisive.md" in help_text.replace("- ", "-")  # argparse wraps at hyphens
    assert "oneshot (default)" in help_text


def test_the_method_choices_are_the_registered_recipes(help_text):
    """--method lists what compress/methods.py registers, from the one list the light CLI can read."""
    from holoserve.compress.methods import METHODS
    from holoserve.core.choices import COMPRESS_METHODS, DEFAULT_METHOD

    assert sorted(METHODS) == sorted(COMPRESS_METHODS) and DEFAULT_METHOD in METHODS
    assert "{" + ",".join(COMPRESS_METHODS) + "}" in help_text
