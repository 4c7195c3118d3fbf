"""KServe: deploy/kserve/servingruntime.yaml and inferenceservice.yaml.

Without a cluster, two checks. The manifests agree with each other, with KServe's conventions (the model in
/mnt/models, the container named kserve-container, `{{.Name}}` the InferenceService's name) and with the
image and the CLI they name. And the runtime's container runs as a kubelet would run it: the test image
with the spec's args (the image's entrypoint kept, as Kubernetes keeps it when only `args` is given), its
environment, user, dropped capabilities, read-only root filesystem and CPU and memory limits, the checkpoint
read-only at /mnt/models; then its probes, the Open Inference Protocol under the InferenceService's name
(through tritonclient) and the metrics path of its annotations are asked.
"""
from __future__ import annotations

import json
import re
import time
import uuid

import httpx
import numpy as np
import pytest
import yaml

from holoserve.core.manifest import SCHEMA_VERSION
from tests.helpers.containers import IMAGE, UID
from tests.helpers.serving import REPO, tiny_checkpoint

RUNTIME = REPO / "deploy" / "kserve" / "servingruntime.yaml"
SERVICE = REPO / "deploy" / "kserve" / "inferenceservice.yaml"
MODEL_DIR = "/mnt/models"  # where KServe's storage initializer puts storageUri's files
NAME = "tickets"


def _runtime() -> dict:
    return yaml.safe_load(RUNTIME.read_text())


def _service() -> dict:
    return yaml.safe_load(SERVICE.read_text())


def _container(name: str = NAME) -> dict:
    """The runtime's container as KServe hands it to Kubernetes for an InferenceService called `name`: its
    Go template rendered over the InferenceService's metadata, of which the runtime uses only .Name."""
    (container,) = _runtime()["spec"]["containers"]
    text = json.dumps(container)
    assert set(re.findall(r"\{\{[^}]*\}\}", text)) <= {"{{.Name}}"}, text
    return json.loads(text.replace("{{.Name}}", name))


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def _quantity(cpu: str) -> float:
    return float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)


def test_the_runtime_follows_kserves_conventions_and_the_image():
    rt = _runtime()
    assert rt["apiVersion"] == "serving.kserve.io/v1alpha1" and rt["kind"] == "ServingRuntime"
    spec, c = rt["spec"], _container()
    # every manifest schema version this release reads, and nothing else
    formats = spec["supportedModelFormats"]
    assert {f["name"] for f in formats} == {"holoserve"} and all(f["autoSelect"] for f in formats)
    assert sorted(int(f["version"]) for f in formats) == list(range(1, SCHEMA_VERSION + 1))
    assert "v2" in spec["protocolVersions"]
    assert c["name"] == "kserve-container" and "command" not in c  # the image's entrypoint runs
    assert re.search(rf"docker build .* -t {re.escape(c['image'])} ", (REPO / "README.md").read_text()), c["image"]
    env = _env(c)
    assert env["HOLOSERVE_MODEL_DIR"] == MODEL_DIR
    port = int(env["HOLOSERVE_PORT"])
    assert [p["containerPort"] for p in c["ports"]] == [port]
    assert c["readinessProbe"]["httpGet"]["port"] == c["livenessProbe"]["httpGet"]["port"] == port
    assert int(spec["annotations"]["prometheus.kserve.io/port"]) == port
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and sc["runAsUser"] == UID
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]


def test_the_args_are_holoserve_serve_options():
    from holoserve.cli import build_parser

    args = build_parser().parse_args(["serve", *_container()["args"]])
    assert args.model_name == NAME


def test_the_inference_service_names_the_runtime():
    isvc, rt = _service(), _runtime()
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1" and isvc["kind"] == "InferenceService"
    assert isvc["metadata"]["name"] == NAME
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == rt["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in rt["spec"]["supportedModelFormats"]}
    assert model["protocolVersion"] in rt["spec"]["protocolVersions"]
    assert model["storageUri"].split("://")[0] in ("s3", "gs", "pvc", "https", "hf", "oci", "azure")


def _docker_run_args(c: dict, ckpt, name: str) -> list[str]:
    """`docker run` flags for what the kubelet would do with the container spec."""
    sc, limits = c["securityContext"], c["resources"]["limits"]
    port = c["ports"][0]["containerPort"]
    args = ["run", "-d", "--name", name, "-p", f"127.0.0.1::{port}", "-v", f"{ckpt}:{MODEL_DIR}:ro",
            "--user", str(sc["runAsUser"]), "--cpus", f"{_quantity(limits['cpu']):g}",
            "--memory", limits["memory"].replace("Gi", "g").replace("Mi", "m")]
    if sc.get("readOnlyRootFilesystem"):
        args.append("--read-only")
    if sc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    args += [f"--cap-drop={cap}" for cap in sc["capabilities"]["drop"]]
    for k, v in _env(c).items():
        args += ["-e", f"{k}={v}"]
    return [*args, IMAGE, *c.get("args", [])]


@pytest.fixture(scope="module")
def runtime_container(docker, image):
    c = _container()
    name = f"holoserve-kserve-{uuid.uuid4().hex[:10]}"
    docker(*_docker_run_args(c, tiny_checkpoint("sst2"), name))
    try:
        port = docker("port", name, f"{c['ports'][0]['containerPort']}/tcp").stdout.split()[0]
        url = "http://" + port
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + c["readinessProbe"]["httpGet"]["path"], timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            state = json.loads(docker("inspect", name).stdout)[0]["State"]
            logs = docker("logs", name, check=False)
            assert state["Running"], f"exited ({state['ExitCode']}):\n{(logs.stdout + logs.stderr)[-3000:]}"
            assert time.monotonic() < deadline, (logs.stdout + logs.stderr)[-3000:]
            time.sleep(0.3)
        yield url, c
    finally:
        docker("rm", "-f", name, check=False)


def test_the_runtime_container_serves_the_open_inference_protocol(runtime_container):
    import tritonclient.http as httpclient

    url, c = runtime_container
    assert httpx.get(url + c["livenessProbe"]["httpGet"]["path"]).status_code == 200
    assert httpx.get(url + "/v2/health/ready").status_code == 200
    assert httpx.get(f"{url}/v2/models/{NAME}/ready").status_code == 200
    texts = ["a gripping, funny film", "a dull mess", "loved it"]
    client = httpclient.InferenceServerClient(url.removeprefix("http://"))
    try:
        batch = httpclient.InferInput("TEXT", [len(texts), 1], "BYTES")
        batch.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=object))
        result = client.infer(NAME, [batch])
    finally:
        client.close()
    labels = [x.decode() for x in result.as_numpy("LABEL").reshape(-1)]
    assert result.as_numpy("LOGITS").shape == (len(texts), 2)
    predicted = httpx.post(url + "/predict", json={"texts": texts}, timeout=30).json()["predictions"]
    assert labels == [p["label"] for p in predicted]


def test_the_runtime_container_reports_its_cpu_limit_and_metrics(runtime_container):
    url, c = runtime_container
    cpus = _quantity(c["resources"]["limits"]["cpu"])
    backend = httpx.get(url + "/v1/models").json()["models"][0]["backend"]
    assert f"a CPU quota of {cpus:g} CPU" in backend["threads_why"], backend
    path = _runtime()["spec"]["annotations"]["prometheus.kserve.io/path"]
    text = httpx.get(url + path).text
    assert re.search(rf'holoserve_inference_request_success_total{{[^}}]*model="{NAME}"', text), text[:2000]
