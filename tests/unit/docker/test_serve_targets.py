"""bench.serve_load.targets for real, briefly, on the image the tests build: the image's `holoserve tune` on each
checkpoint before each kind of text's runs (on texts like theirs), then `docker run`'s defaults against the
image forced to ONNX Runtime on short, long and pair texts and against a baseline image (here the same image),
and the table of ratios against the targets (1-second levels: the ratios are not the point here). Every
container is refused AMX (--deny-amx), as the stand-in for the targets' CPU runs on a Xeon with AMX; the servers
following tune's profile shows they ran as tune did."""
from __future__ import annotations

import json
import os
import shutil

from holoserve.core.machine import cpu_flags
from tests.helpers.checkpoints import write_glue
from tests.helpers.containers import IMAGE, Docker
from tests.helpers.serving import tiny_checkpoint
from tests.unit.docker.test_docker_image import both_cpu_exports


def test_the_served_targets_run_end_to_end(docker: Docker, image, tmp_path, monkeypatch):
    from bench.serve_load import targets

    monkeypatch.setenv("PATH", os.path.dirname(docker.exe) + os.pathsep + os.environ.get("PATH", ""))
    single = both_cpu_exports(tmp_path / "sst2")
    pairs = tmp_path / "mrpc"
    shutil.copytree(tiny_checkpoint("mrpc"), pairs)  # tune writes its profile into the checkpoint
    glue = write_glue(tmp_path / "glue", train_rows=4, dev_rows=24)
    out = tmp_path / "out"
    assert targets.main(["--image", IMAGE, "--baseline-image", IMAGE, "--checkpoint", str(single),
                         "--pairs-checkpoint", str(pairs), "--data-dir", str(glue), "--duration", "1",
                         "--rounds", "1", "--out", str(out), "--deny-amx", "--tune-duration", "3"]) == 0
    res = json.loads((out / "targets.json").read_text())
    held_to = targets.targets_here(deny_amx=True)
    assert held_to == targets.TARGETS and res["deny_amx"] is True
    assert [(r["texts"], r["versus"], r["target"]) for r in res["rows"]] == \
        [(t, v, f"{op} {x}" if op else "—") for t, v, _, op, x in held_to]
    for row, (*_, op, x) in zip(res["rows"], held_to):
        assert isinstance(row["ratio"], float) and row["ratio"] > 0, row
        met = op is not None and (row["ratio"] >= x if op == ">=" else row["ratio"] <= x)
        same = row["versus"] == "onnxruntime" and row["default_backend"] == "onnxruntime"
        record = json.loads((out / f"{targets.run_name(row['texts'], row['versus'])}_docker.json").read_text())
        one_row = row["what"] == targets.WHAT["p50_ratio_1"] and targets.one_row_alike(record, row["versus"])
        assert row["verdict"] == (targets.SAME if same else targets.SAME_ONE_ROW if one_row else "measured"
                                  if op is None else "met" if met else "not met"), row
        assert row["default_backend"] in ("onnxruntime", "openvino", "openvino+onnxruntime"), row
    # tune ran in the image before each kind of text's runs, on texts like theirs, and its profile is what the
    # default containers served
    assert list(res["tuned"]) == ["long", "short", "pairs"], res["tuned"]
    assert all(t["decision"].startswith("decision: ") for t in res["tuned"].values()), res["tuned"]
    assert [t["checkpoint"] for t in res["tuned"].values()] == [single.name, single.name, pairs.name]
    assert res["tuned"]["long"]["texts"].endswith("(tune --texts)") and (out / "tune-long.txt").is_file()
    # with AMX refused, a CPU with AVX-512 VNNI + VBMI runs the 2:4 kernels under `auto`, so tune timed them
    # against OpenVINO's own GEMMs first on the checkpoint with an OpenVINO export, and kept them or not by that
    assert res["tuned"]["pairs"]["kernels"] is None  # no OpenVINO export: nothing to time them on
    if {"avx512_vnni", "avx512vbmi"} <= set(cpu_flags()):
        for t in (res["tuned"]["long"], res["tuned"]["short"]):
            assert t["kernels"] and isinstance(t["kernels"]["kept"], bool) and t["kernels"]["ratio"] > 0, t
            assert t["kernels"]["reason"] in (out / "targets.md").read_text()
    assert (single / "serving-profile.json").is_file() and (pairs / "serving-profile.json").is_file()
    withheld = json.loads((single / "serving-profile.json").read_text())["key"]["amx_withheld"]
    if "amx_int8" in cpu_flags():
        assert "the OS refuses AMX" in withheld, withheld
    else:
        assert withheld is None, withheld
    for name in res["runs"]:
        record = json.loads((out / f"{name}_docker.json").read_text())
        assert "serving profile" in record["variants"]["default"]["selection"], record["variants"]["default"]
    page = (out / "targets.md").read_text()
    assert (out / "targets.png").read_bytes()[:4] == b"\x89PNG" and "(targets.png)" in page
    assert res["cpu_class"] in page and "python -m bench.serve_load.targets --image" in page
    assert "AMX refused to every container (`--deny-amx`)" in page


def test_a_docker_comparison_restarts_its_containers_in_the_opposite_order(docker: Docker, image, tmp_path,
                                                                           monkeypatch):
    """With two rounds or more, `--docker` runs two legs: fresh containers, the second leg started in the opposite
    order, each level's numbers pooled over both legs, and the ratio of each leg kept apart."""
    from bench.serve_load import run as serve_load

    monkeypatch.setenv("PATH", os.path.dirname(docker.exe) + os.pathsep + os.environ.get("PATH", ""))
    ckpt = both_cpu_exports(tmp_path / "sst2")
    out = tmp_path / "out"
    assert serve_load.main(["--checkpoint", str(ckpt), "--docker", IMAGE, "--versus", "one-instance",
                            "--clients", "32", "--duration", "2", "--rounds", "3", "--out", str(out),
                            "--name", "legs"]) == 0
    res = json.loads((out / "legs_docker.json").read_text())
    assert res["start_orders"] == [["default", "one_instance"], ["one_instance", "default"]]
    for name, v in res["variants"].items():
        assert len(v["backends_seen"]) == 2, (name, v["backends_seen"])
        # the batches at once /v1/models reports: one where asked, the default's plan on the other
        assert v["instances"] == 1 if name == "one_instance" else v["instances"] in (1, 2), (name, v)
        (level,) = v["levels"]
        assert level["rounds"] == 3 and level["ok"] > 0 and level["status_counts"] == {"200": level["ok"]}, level
        # the CPU each answer cost the server (the container's process) and the load generator beside it
        assert level["server_cpu_ms_per_request"] > 0 and level["client_cpu_ms_per_request"] > 0, level
    by_leg = res["summary"]["throughput_ratio_32_by_leg"]
    assert len(by_leg) == 2 and all(r > 0 for r in by_leg), by_leg
    assert "in two legs with fresh containers started default before one_instance and then one_instance before " \
           "default" in (out / "legs_docker.md").read_text()
