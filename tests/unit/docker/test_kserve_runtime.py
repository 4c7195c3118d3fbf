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

import httpx
import numpy as np
import pytest
import yaml

from holoserve.core.manifest import SCHEMA_VERSION
from tests.helpers.containers import UID, cpu_quantity, env_of, run_as_kubelet
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
    env = env_of(c)
    assert env["HOLOSERVE_MODEL_DIR"] == MODEL_DIR
    port = int(env["HOLOSERVE_PORT"])
    assert [p["containerPort"] for p in c["ports"]] == [port]
    assert c["readinessProbe"]["httpGet"]["port"] == c["livenessProbe"]["httpGet"]["port"] == port
    assert int(spec["annotations"]["prometheus.kserve.io/port"]) == port
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and sc["runAsUser"] == UID
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]


def test_the_runtime_container_follows_kubernetes_schema():
    """The container spec is a core/v1 Container: strictly valid in a Pod (no unknown or mistyped field)."""
    import kubernetes_validate

    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": NAME}, "spec": {"containers": [_container()]}}
    kubernetes_validate.validate(pod, kubernetes_validate.latest_version(), strict=True)


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


@pytest.fixture(scope="module")
def runtime_container(docker, image):
    c = _container()
    with run_as_kubelet(docker, c, [(str(tiny_checkpoint("sst2")), MODEL_DIR)]) as (_, url):
        yield url, c


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
    cpus = cpu_quantity(c["resources"]["limits"]["cpu"])
    backend = httpx.get(url + "/v1/models").json()["models"][0]["backend"]
    assert f"a CPU quota of {cpus:g} CPU" in backend["threads_why"], backend
    path = _runtime()["spec"]["annotations"]["prometheus.kserve.io/path"]
    text = httpx.get(url + path).text
    assert re.search(rf'holoserve_inference_request_success_total{{[^}}]*model="{NAME}"', text), text[:2000]
