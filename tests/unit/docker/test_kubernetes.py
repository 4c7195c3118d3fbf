"""deploy/kubernetes/holoserve.yaml: a Deployment, Service and PodDisruptionBudget for the CPU image.

Without a cluster: each object is validated against Kubernetes' own OpenAPI schema (kubernetes-validate,
strict: no unknown fields), the objects and the server's settings are checked to agree with each other
(selectors, ports, probes, the model folder, the grace period against the drain), and the Deployment's
container runs as the kubelet would run it (tests/helpers/containers.py): probes, a prediction under the
model name it sets, its preStop command and its threads from the CPU limit.
"""
from __future__ import annotations

import re

import httpx
import kubernetes_validate
import pytest
import yaml

from tests.helpers.containers import UID, cpu_quantity, env_of, run_as_kubelet
from tests.helpers.serving import REPO, tiny_checkpoint

MANIFEST = REPO / "deploy" / "kubernetes" / "holoserve.yaml"


def _objects() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text())}


def _container() -> dict:
    (container,) = _objects()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("kind", ["Deployment", "Service", "PodDisruptionBudget"])
def test_each_object_follows_kubernetes_schema(kind):
    kubernetes_validate.validate(_objects()[kind], kubernetes_validate.latest_version(), strict=True)


def test_the_objects_and_the_server_agree():
    objs = _objects()
    pod = objs["Deployment"]["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert objs["Deployment"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert objs["Service"]["spec"]["selector"].items() <= labels.items()
    assert objs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert objs["PodDisruptionBudget"]["spec"]["minAvailable"] < objs["Deployment"]["spec"]["replicas"]
    c = _container()
    env = env_of(c)
    port = int(env["HOLOSERVE_PORT"])
    (named,) = c["ports"]
    assert named["containerPort"] == port and objs["Service"]["spec"]["ports"][0]["targetPort"] == named["name"]
    assert c["readinessProbe"]["httpGet"]["port"] == c["livenessProbe"]["httpGet"]["port"] == port
    assert int(pod["metadata"]["annotations"]["prometheus.io/port"]) == port
    (mount,) = c["volumeMounts"]
    assert mount["mountPath"] == env["HOLOSERVE_MODEL_DIR"] and mount["readOnly"]
    pause = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    drain = float(env["HOLOSERVE_GRACEFUL_TIMEOUT_S"])
    assert pod["spec"]["terminationGracePeriodSeconds"] > pause + drain
    assert c["securityContext"]["runAsUser"] == UID and pod["spec"]["securityContext"]["runAsNonRoot"]
    assert re.search(rf"docker build .* -t {re.escape(c['image'])} ", (REPO / "README.md").read_text())


def test_the_args_are_holoserve_serve_options():
    from holoserve.cli import build_parser

    assert build_parser().parse_args(["serve", *_container()["args"]]).model_name == "tickets"


@pytest.fixture(scope="module")
def served(docker, image):
    c = _container()
    with run_as_kubelet(docker, c, [(str(tiny_checkpoint("sst2")), c["volumeMounts"][0]["mountPath"])]) as (name, url):
        yield name, url, c


def test_the_container_serves_as_the_kubelet_runs_it(served, docker):
    name, url, c = served
    assert httpx.get(url + c["livenessProbe"]["httpGet"]["path"]).status_code == 200
    r = httpx.post(url + "/predict", json={"texts": ["a gripping, funny film", "a dull mess"]}, timeout=30)
    assert r.status_code == 200 and r.json()["model"]["name"] == "tickets", r.text
    backend = httpx.get(url + "/v1/models").json()["models"][0]["backend"]
    cpus = cpu_quantity(c["resources"]["limits"]["cpu"])
    assert f"a CPU quota of {cpus:g} CPU" in backend["threads_why"], backend
    # the preStop hook's command exists in the image and runs as the container's user
    docker("exec", name, *c["lifecycle"]["preStop"]["exec"]["command"][:-1], "0")
    assert "holoserve_inference_request_success_total" in httpx.get(url + "/metrics").text
