"""The CPU backends' choice tests time OpenVINO against ONNX Runtime whatever this CPU's INT8 GEMMs do: where
OpenVINO's saturate (x86-64 without VNNI), `auto` leaves it out, which tests of its own check by stating the
probe's answer either way or measuring it (test_openvino.py), so the modules that test the choice itself
state it as exact, for their module-wide fixtures too."""
import pytest

STATED_EXACT = {"test_openvino.py", "test_serving_profile.py"}


@pytest.fixture(scope="module", autouse=True)
def _int8_probe_exact(request):
    if request.path.name not in STATED_EXACT:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOLOSERVE_INT8_PROBE", "exact")
        yield
