"""ServerConfig settings that depend on the backend, and their validation."""
import pytest

from holoserve import HoloServeError
from holoserve.backends.onnxruntime import OrtBackend
from holoserve.backends.tensorrt import TensorRTBackend
from holoserve.server.config import ServerConfig


class _Gpu:
    whole_batches = True


class _Plain:  # a backend that says nothing: treated as a CPU one
    pass


def test_padding_waste_auto_splits_on_cpu_and_never_on_gpu_backends():
    cfg = ServerConfig().validate()
    assert cfg.max_padding_waste == "auto"
    assert cfg.padding_waste_for(_Plain()) == 0.25 and cfg.padding_waste_for(_Gpu()) == -1.0
    assert OrtBackend.whole_batches is False and TensorRTBackend.whole_batches is True


@pytest.mark.parametrize("raw, want", [("0.1", 0.1), ("-1", -1.0), (0.5, 0.5)])
def test_padding_waste_given_is_kept_whatever_the_backend(raw, want):
    cfg = ServerConfig(max_padding_waste=raw).validate()
    assert cfg.padding_waste_for(_Plain()) == want == cfg.padding_waste_for(_Gpu())
    # and it survives the environment round trip the workers use
    assert ServerConfig.from_env(cfg.to_env()).padding_waste_for(_Gpu()) == want


def test_padding_waste_that_is_not_a_number_is_refused_with_the_fix():
    with pytest.raises(HoloServeError, match="max padding waste 'lots' must be a number .* or auto"):
        ServerConfig(max_padding_waste="lots").validate()
