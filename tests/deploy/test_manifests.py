"""The Kubernetes manifests under deploy/, validated against things this project did not write, and against the
project itself.

- Every manifest parses (multi-document YAML) and validates, strictly (unknown fields are errors), against the
  Kubernetes OpenAPI schemas that `kubernetes-validate` ships (offline), for the oldest and newest Kubernetes
  named in K8S_VERSIONS; the TLS component's JSON patch is applied with `jsonpatch` (RFC 6902) first.
- The KServe resources (InferenceService, ServingRuntime: CRDs, not in those schemas) are deserialized strictly
  into the typed models of KServe's Python SDK in its own environment (VIT_SERVE_KSERVE_PYTHON, as
  tests/serve/test_kserve_client.py); a misspelled field on a mutated copy must fail there and in the schemas.
- Against the project: every VIT_SERVE_* variable is a ServeSettings field and the settings build; container
  arguments go through the real `vit-serve serve` parser (the Deployment's after the Dockerfile's ENTRYPOINT;
  the KServe transformer's through its sh wrapper, run by /bin/sh with the arguments KServe appends); the
  Triton runtime loads models that `vit-export --format triton` really writes and that the gateway can serve;
  and the Deployment's own settings start the real gateway (two replicas sharing a real redis-server started
  with the Redis manifest's arguments): its probe paths answer, the HPA's metric is in /metrics, the keys come
  from the Secret's files, and an image classified on one replica is explained by id on the other.

No cluster, kustomize or container engine runs here: what kubectl, KServe's controller and the kubelet would do
beyond these checks is not exercised.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.triton_models import ECHO_MODEL

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# The oldest Kubernetes still commonly served and the newest kubernetes-validate 1.37 ships.
K8S_VERSIONS = ("1.30", "1.37")
CRD_GROUP = "serving.kserve.io"
KSERVE_SCRIPT = Path(__file__).with_name("kserve_models_script.py")
PREFIX = "VIT_SERVE_"
# KServe appends --model_name <isvc> --predictor_host <isvc>-predictor.<namespace> --http_port 8080 to a custom
# transformer's arguments (pkg/apis/serving/v1beta1/transformer_custom.go); the namespace of that test.
NAMESPACE = "default"


# ---- reading deploy/ ---------------------------------------------------------------------------------------


def _load(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _kustomizations() -> dict[Path, dict]:
    return {p: _load(p)[0] for p in sorted(DEPLOY.rglob("kustomization.yaml"))}


def _patch_files() -> set[Path]:
    return {(k.parent / p["path"]).resolve() for k, doc in _kustomizations().items() for p in doc.get("patches", [])}


def _manifest_files() -> list[Path]:
    skip = set(_kustomizations()) | _patch_files()
    return [p for p in sorted(DEPLOY.rglob("*.yaml")) if p.resolve() not in skip]


def _documents() -> list[tuple[Path, dict]]:
    return [(p, d) for p in _manifest_files() for d in _load(p)]


def _doc(kind: str, name: str) -> dict:
    found = [d for _, d in _documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name} under deploy/, found {len(found)}"
    return copy.deepcopy(found[0])


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _settings_kwargs(env: dict[str, str]) -> dict[str, str]:
    return {k[len(PREFIX):].lower(): v for k, v in env.items() if k.startswith(PREFIX)}


def _tls_deployment() -> dict:
    """The gateway's Deployment with the TLS component's JSON patch applied (jsonpatch: RFC 6902)."""
    jsonpatch = pytest.importorskip("jsonpatch")
    component = _kustomizations()[DEPLOY / "k8s" / "tls" / "kustomization.yaml"]
    (patch,) = component["patches"]
    assert patch["target"]["kind"] == "Deployment"
    ops = _load(DEPLOY / "k8s" / "tls" / patch["path"])[0]
    return jsonpatch.apply_patch(_doc("Deployment", patch["target"]["name"]), ops)


def _transformer() -> dict:
    (container,) = _doc("InferenceService", "vit")["spec"]["transformer"]["containers"]
    return container


# ---- Kubernetes schemas ------------------------------------------------------------------------------------


def test_every_manifest_is_a_named_resource():
    docs = _documents()
    assert {p.parent.name for p, _ in docs} == {"k8s", "kserve", "redis", "prometheus-adapter"}
    for path, doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(doc), path
        assert doc["metadata"].get("name"), path


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_strictly_against_the_kubernetes_schemas(version):
    assert version in {kubernetes_validate.utils.major_minor(v) for v in kubernetes_validate.utils.all_versions()}
    crds = []
    for path, doc in [*_documents(), (DEPLOY / "k8s/tls/patch.yaml", _tls_deployment())]:
        if doc["apiVersion"].split("/")[0] == CRD_GROUP:
            crds.append(doc["kind"])
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{path.relative_to(ROOT)}: {doc['kind']} {doc['metadata']['name']}: "
                        f"{'.'.join(map(str, e.path))}: {e.message}")
    # Nothing else is skipped: the CRDs go to the KServe SDK below.
    assert sorted(crds) == ["InferenceService", "ServingRuntime"]


def test_strict_schemas_catch_a_misspelled_field():
    """The negative control: a misspelled probe passes the lax schemas and fails the strict ones."""
    version = K8S_VERSIONS[-1]
    bad = _doc("Deployment", "vit-serve")
    container = bad["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    kubernetes_validate.validate(bad, version, strict=False)
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(bad, version, strict=True)
    wrong_type = _doc("HorizontalPodAutoscaler", "vit-serve")
    wrong_type["spec"]["maxReplicas"] = "ten"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, version, strict=True)


def test_kustomizations_name_every_manifest_once():
    listed: list[Path] = []
    for path, k in _kustomizations().items():
        assert k["apiVersion"].startswith("kustomize.config.k8s.io/") and k["kind"] in ("Kustomization", "Component")
        for entry in k.get("resources", []):
            target = (path.parent / entry).resolve()
            assert target.is_file() or (target / "kustomization.yaml").is_file(), f"{path}: {entry}"
            if target.is_file():
                listed.append(target)
        for patch in k.get("patches", []):
            assert (path.parent / patch["path"]).is_file(), f"{path}: {patch['path']}"
        for component in k.get("components", []):
            assert _load(path.parent / component / "kustomization.yaml")[0]["kind"] == "Component"
    assert sorted(listed) == sorted(p.resolve() for p in _manifest_files())
    # The commented-out component exists (the line users uncomment).
    text = (DEPLOY / "k8s" / "kustomization.yaml").read_text()
    assert re.search(r"^#\s+- tls\b", text, re.M) and (DEPLOY / "k8s" / "tls" / "kustomization.yaml").is_file()


# ---- KServe's SDK ------------------------------------------------------------------------------------------


def test_kserve_resources_deserialize_strictly_into_the_sdk_models(tmp_path, kserve_python):
    python = kserve_python
    docs = [{"name": f"{p.relative_to(DEPLOY)}:{d['kind']}", "kind": d["kind"], "doc": d}
            for p, d in _documents() if d["apiVersion"].split("/")[0] == CRD_GROUP]
    isvc = next(d["doc"] for d in docs if d["kind"] == "InferenceService")
    mutations = {}  # name -> (document, the misspelled field the error must name)
    bad = copy.deepcopy(isvc)
    bad["spec"]["predictor"]["model"]["storageUrl"] = bad["spec"]["predictor"]["model"].pop("storageUri")
    mutations["storageUrl"] = (bad, "storageUrl")
    bad = copy.deepcopy(isvc)
    probe = bad["spec"]["transformer"]["containers"][0]["readinessProbe"]["httpGet"]
    probe["paht"] = probe.pop("path")
    mutations["paht"] = (bad, "paht")
    bad = copy.deepcopy(isvc)
    bad["spec"]["transformer"]["minReplica"] = 1
    mutations["minReplica"] = (bad, "minReplica")
    runtime = next(d["doc"] for d in docs if d["kind"] == "ServingRuntime")
    bad = copy.deepcopy(runtime)
    bad["spec"]["supportedModelFormats"][0]["autoselect"] = False
    mutations["autoselect"] = (bad, "autoselect")
    kinds = {"storageUrl": "InferenceService", "paht": "InferenceService", "minReplica": "InferenceService",
             "autoselect": "ServingRuntime"}
    docs += [{"name": f"mutated:{n}", "kind": kinds[n], "doc": d} for n, (d, _) in mutations.items()]
    (tmp_path / "docs.json").write_text(json.dumps(docs))
    done = subprocess.run([python, str(KSERVE_SCRIPT), str(tmp_path / "docs.json")], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout)
    print(f"kserve {answer['kserve']}, kubernetes client {answer['kubernetes']}")
    results = answer["results"]
    assert sorted(n for n in results if not n.startswith("mutated:")) == [
        "kserve/inferenceservice.yaml:InferenceService", "kserve/servingruntime.yaml:ServingRuntime"]
    for name, error in results.items():
        if name.startswith("mutated:"):
            field = mutations[name.split(":", 1)[1]][1]
            assert error is not None and field in error, f"{name}: {error}"
        else:
            assert error is None, f"{name}: {error}"


# ---- against the project -----------------------------------------------------------------------------------


def _containers_with_settings() -> dict[str, dict]:
    return {"k8s Deployment": _doc("Deployment", "vit-serve")["spec"]["template"]["spec"]["containers"][0],
            "k8s Deployment + tls": _tls_deployment()["spec"]["template"]["spec"]["containers"][0],
            "kserve transformer": _transformer()}


@pytest.mark.parametrize("which", ["k8s Deployment", "k8s Deployment + tls", "kserve transformer"])
def test_every_vit_serve_variable_is_a_setting(which):
    pytest.importorskip("pydantic_settings")
    from vit_serve.serve.settings import ServeSettings

    container = _containers_with_settings()[which]
    names = {e["name"] for e in container["env"]}
    ours = {n for n in names if n.startswith(PREFIX)}
    assert ours, which
    unknown = {n for n in ours if n[len(PREFIX):].lower() not in ServeSettings.flat_fields()}
    assert not unknown, f"{which}: not ServeSettings fields: {sorted(unknown)}"
    ServeSettings(**_settings_kwargs(_env(container)))  # the values validate too (the TLS pair, the store URL)


def _dockerfile_entrypoint() -> list[str]:
    lines = [ln for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln.startswith("ENTRYPOINT ")]
    assert len(set(lines)) == 1, "both images (cpu, cuda) have the same entry point"
    return json.loads(lines[0][len("ENTRYPOINT "):])


def test_deployment_arguments_parse_and_its_ports_are_the_gateways():
    from vit_serve.cli import build_parser

    deployment = _doc("Deployment", "vit-serve")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    entrypoint = _dockerfile_entrypoint()
    assert "command" not in container, "the image's ENTRYPOINT runs (vit-serve serve --host 0.0.0.0 --port 8000)"
    args = build_parser().parse_args([*entrypoint[1:], *container["args"]])
    assert args.command == "serve" and args.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == args.port
    assert ports["grpc"] == int(_env(container)["VIT_SERVE_GRPC_PORT"])
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert args.model == mounts["models"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] in ports, probe
    service = _doc("Service", "vit-serve")
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    assert service["spec"]["selector"].items() <= pod_labels(deployment).items()
    hpa = _doc("HorizontalPodAutoscaler", "vit-serve")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "vit-serve"}
    # The key files are the Secret's keys, in the Secret's mount.
    secret = _doc("Secret", "vit-serve-keys")
    volume = next(v for v in pod["volumes"] if v["name"] == "keys")
    assert volume["secret"]["secretName"] == "vit-serve-keys"
    for var in ("VIT_SERVE_API_KEYS_FILE", "VIT_SERVE_ADMIN_API_KEYS_FILE"):
        path = Path(_env(container)[var])
        assert str(path.parent) == mounts["keys"] and path.name in secret["stringData"], var
    # The store is the Redis Service.
    redis_service = _doc("Service", "vit-serve-redis")
    assert _env(container)["VIT_SERVE_STORE"] == f"redis://vit-serve-redis:{redis_service['spec']['ports'][0]['port']}/0"


def test_termination_grace_covers_prestop_drain_grace_and_margin():
    """terminationGracePeriodSeconds (counted from the start of preStop) >= preStop's sleep + the gateway's drain
    + grace + margin, with the drain and grace the pod's own settings (ServeSettings from its environment)."""
    from vit_serve.serve.settings import ServeSettings
    from vit_serve.serve.shutdown import MARGIN_S, graceful_timeout

    pod = _doc("Deployment", "vit-serve")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = _env(container)
    settings = ServeSettings(**_settings_kwargs(env))
    assert {"VIT_SERVE_SHUTDOWN_DRAIN_S", "VIT_SERVE_SHUTDOWN_GRACE_S"} <= env.keys()  # set, not left to defaults
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    pre_stop = float(command[1])
    needed = pre_stop + settings.shutdown_drain_s + graceful_timeout(settings.shutdown_grace_s)
    assert needed == pre_stop + settings.shutdown_drain_s + settings.shutdown_grace_s + MARGIN_S
    assert pod["terminationGracePeriodSeconds"] >= needed, (pod["terminationGracePeriodSeconds"], needed)
    # At least one readiness probe falls within the drain (the pod has left the endpoints already: this is for
    # balancers that probe /readyz themselves).
    probe = container["readinessProbe"]
    assert settings.shutdown_drain_s >= probe["periodSeconds"], (settings.shutdown_drain_s, probe)


def pod_labels(deployment: dict) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def test_the_secrets_placeholders_are_hashes_no_key_matches():
    """What `kubectl apply -k` puts in place before the Secret is replaced: entries the gateway reads as hashes
    (sha256:HEX, kept as they are), so no key sent by a client can match them."""
    from vit_serve.serve.security import key_hash

    for name, text in _doc("Secret", "vit-serve-keys")["stringData"].items():
        entries = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        assert entries == ["sha256:" + "0" * 64], name
        assert "PLACEHOLDER" in text
        assert all(key_hash(e) == e for e in entries)  # taken as a hash, not as the key "sha256:000..."


def _stub_gateway(folder: Path) -> Path:
    """A `vit-serve` for PATH that parses its arguments with the real parser and prints them with the
    VIT_SERVE_* environment it was given, instead of starting a server."""
    folder.mkdir()
    stub = folder / "vit-serve"
    stub.write_text(f"#!{sys.executable}\n" + "import json, os, sys\n"
                    "from vit_serve.cli import build_parser\n"
                    "args = build_parser().parse_args(sys.argv[1:])\n"
                    "print(json.dumps({'args': {k: v for k, v in vars(args).items() if k != 'func'},\n"
                    "                  'env': {k: v for k, v in os.environ.items() if k.startswith('VIT_SERVE_')}}))\n")
    stub.chmod(0o755)
    return folder


def test_kserve_transformer_turns_kserves_arguments_into_settings(tmp_path):
    """The transformer's command, run by /bin/sh with the arguments KServe appends, calls `vit-serve serve`
    with arguments its parser takes, Triton's gRPC address on the predictor's Service, and KServe's port."""
    from vit_serve.runtime.backends.triton import parse_url
    from vit_serve.serve.settings import ServeSettings

    isvc = _doc("InferenceService", "vit")
    container = _transformer()
    assert "args" not in container, "KServe appends its own arguments; ours would come before them"
    kserve_args = ["--model_name", isvc["metadata"]["name"],
                   "--predictor_host", f"{isvc['metadata']['name']}-predictor.{NAMESPACE}", "--http_port", "8080"]
    bin_dir = _stub_gateway(tmp_path / "bin")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", **_env(container)}
    done = subprocess.run([*container["command"], *kserve_args], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout)
    assert seen["args"]["command"] == "serve"
    settings = ServeSettings(**_settings_kwargs(seen["env"]))
    assert settings.backend == "triton" and settings.host == "0.0.0.0"
    assert parse_url(settings.triton.triton_url) == ("grpc", f"vit-predictor.{NAMESPACE}:80")
    ports = [p["containerPort"] for p in container["ports"]]
    assert ports == [settings.port] == [8080]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] == settings.port
    # gRPC all the way: the predictor's first (Service) port is Triton's --grpc-port, as h2c.
    predictor = isvc["spec"]["predictor"]["model"]
    (port,) = predictor["ports"]
    runtime = _doc("ServingRuntime", predictor["runtime"])
    triton_args = runtime["spec"]["containers"][0]["args"]
    assert port["name"] == "h2c" and f"--grpc-port={port['containerPort']}" in triton_args
    assert "grpc-v2" in runtime["spec"]["protocolVersions"]
    assert {k: predictor["modelFormat"][k] for k in ("name", "version")} == {"name": "triton", "version": "2"}
    assert any(f["name"] == "triton" and f["version"] == "2" for f in runtime["spec"]["supportedModelFormats"])
    # The HPA scales the transformer's Deployment, named <isvc>-transformer by KServe in RawDeployment mode,
    # and KServe creates no autoscaler of its own.
    annotations = isvc["metadata"]["annotations"]
    assert annotations["serving.kserve.io/deploymentMode"] == "RawDeployment"
    assert annotations["serving.kserve.io/autoscalerClass"] == "external"
    hpa = _doc("HorizontalPodAutoscaler", "vit-transformer")
    assert hpa["spec"]["scaleTargetRef"]["name"] == f"{isvc['metadata']['name']}-transformer"


@pytest.fixture(scope="module")
def exported(tmp_path_factory, export_tiny) -> Path:
    """`vit-export --format onnx,triton` of a tiny random ViT under the quickstart's name: FOLDER/exports (what
    deploy/k8s serves) and FOLDER/model_repo (what deploy/kserve's predictor serves)."""
    from vit_serve.quickstart import QuickstartPaths

    folder = tmp_path_factory.mktemp("export")
    name = QuickstartPaths(Path("runs/quickstart")).onnx.stem
    result, _ = export_tiny(folder, 32, 0, [str(i) for i in range(10)], formats=("onnx", "triton"), name=name,
                            out=folder / "exports", repo=folder / "model_repo")
    assert result.ok
    return folder


def test_the_triton_runtime_loads_what_vit_export_writes_and_the_gateway_serves(exported):
    """`vit-export --format triton` under the quickstart's name: the runtime's --load-model models are in the
    repository, run on the stock Triton image's backends (no Python-backend model), and the transformer's model
    is a logits model the gateway accepts (backends.triton.model_info) whose explain model is loaded too."""
    pytest.importorskip("tritonclient")
    from google.protobuf import json_format
    from vit_export.triton_config import parse

    from vit_serve.runtime.backends.triton import model_info

    runtime = _doc("ServingRuntime", "vit-serve-tritonserver")
    args = runtime["spec"]["containers"][0]["args"]
    assert "--model-control-mode=explicit" in args and "--model-store=/mnt/models" in args
    loaded = [a.split("=", 1)[1] for a in args if a.startswith("--load-model=")]
    configs = {}
    for model in loaded:
        text = (exported / "model_repo" / model / "config.pbtxt").read_text()
        configs[model] = json_format.MessageToDict(parse(text), preserving_proto_field_name=True)
        assert configs[model].get("platform") in ("onnxruntime_onnx", "tensorrt_plan"), model
    served = _env(_transformer())["VIT_SERVE_MODEL"]
    info = model_info(served, configs[served], "test")
    assert info.explain and info.explain_model in loaded
    # Why explicit model control: the repository also holds Python-backend models the stock image cannot load.
    python_models = {p.parent.name for p in (exported / "model_repo").glob("*/config.pbtxt")
                     if 'backend: "python"' in p.read_text()}
    assert python_models and not python_models & set(loaded)
    # The predictor's storage is the repository folder itself (KServe mounts it at --model-store).
    assert _doc("InferenceService", "vit")["spec"]["predictor"]["model"]["storageUri"].endswith("/model_repo")


# Triton's flags that the harness owns (its own binary path, repository, ports and models); every other argument
# of the ServingRuntime is passed to the real tritonserver as the manifest writes it.
HARNESS_FLAGS = ("--model-store=", "--model-repository=", "--grpc-port=", "--http-port=", "--load-model=")


def _kubelet_expand(arg: str, env: dict[str, str]) -> str:
    """$(VAR) references in a container argument, expanded from the container's env as kubelet does."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def test_tritons_repository_api_is_refused_without_the_secrets_key(tmp_path):
    """The bundled tritonserver (2.51, the runtime image's release) run with the ServingRuntime's arguments, the
    Secret's key expanded as kubelet does: POST /v2/repository/index, load and unload, over HTTP and gRPC, are
    refused without the header and answered with it; health, metadata, model config and inference (all the
    gateway uses) stay open."""
    tritonclient_grpc = pytest.importorskip("tritonclient.grpc")
    import urllib.error
    import urllib.request

    from vit_export.tritonserver import TritonServer, available

    reason = available()
    if reason:
        pytest.skip(f"no tritonserver here: {reason}")
    (container,) = _doc("ServingRuntime", "vit-serve-tritonserver")["spec"]["containers"]
    (ref,) = [e for e in container["env"] if "valueFrom" in e]
    secret = ref["valueFrom"]["secretKeyRef"]
    assert (secret["name"], secret["key"]) == ("vit-serve-triton", "repository-key") and "value" not in ref
    key = secrets.token_hex(32)
    args = [_kubelet_expand(a, {ref["name"]: key}) for a in container["args"][1:]]
    assert container["args"][0] == "tritonserver" and not any("$(" in a for a in args)
    restricted = [a for a in args if a.startswith(("--http-restricted-api=", "--grpc-restricted-protocol="))]
    assert len(restricted) == 2 and all(a.endswith(f":triton-repository-key={key}") for a in restricted)
    assert all("model-repository" in a.split(":")[0].split("=")[1].split(",") for a in restricted)
    for name, text in ECHO_MODEL.items():
        (tmp_path / "echo" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "echo" / name).write_text(text)
    header = "triton-repository-key"
    with TritonServer(tmp_path, models=["echo"],
                      extra_args=tuple(a for a in args if not a.startswith(HARNESS_FLAGS))) as server:

        def post(path: str, headers: dict[str, str], body: bytes = b"{}") -> tuple[int, str]:
            request = urllib.request.Request(f"{server.http_url}{path}", data=body, method="POST", headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=30) as answer:
                    return answer.status, answer.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()

        for path in ("/v2/repository/index", "/v2/repository/models/echo/unload", "/v2/repository/models/echo/load"):
            status, body = post(path, {})
            assert status == 403 and header in body, (path, status, body)
            status, body = post(path, {header: "not-" + key})
            assert status == 403, (path, status, body)
        assert post("/v2/repository/index", {header: key})[0] == 200
        infer = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [2.5]}]}).encode()
        status, body = post("/v2/models/echo/infer", {}, infer)
        assert status == 200 and json.loads(body)["outputs"][0]["data"] == [2.5], body
        # Triton 2.51 checks a restricted gRPC protocol's key under its own prefix.
        grpc_header = f"triton-grpc-protocol-{header}"
        grpc = tritonclient_grpc.InferenceServerClient(server.grpc_url)
        try:
            with pytest.raises(tritonclient_grpc.InferenceServerException, match=grpc_header):
                grpc.get_model_repository_index()
            with pytest.raises(tritonclient_grpc.InferenceServerException, match=grpc_header):
                grpc.unload_model("echo", headers={header: key})  # the HTTP header's name is not the gRPC one
            assert [m.name for m in grpc.get_model_repository_index(headers={grpc_header: key}).models] == ["echo"]
            assert grpc.is_server_ready() and grpc.is_model_ready("echo")  # open, as the gateway calls them
            assert grpc.get_model_config("echo").config.backend == "python"
            x = tritonclient_grpc.InferInput("x", [1], "FP32")
            x.set_data_from_numpy(__import__("numpy").array([2.5], dtype="float32"))
            assert grpc.infer("echo", [x]).as_numpy("y").tolist() == [2.5]
        finally:
            grpc.close()


# ---- the Deployment's settings, served ---------------------------------------------------------------------


class RedisPod:
    """The Redis Deployment's pod made local: each volume a folder under `root` (the ConfigMap's and the Secret's
    items written as kubelet mounts them, the Secret's password replaced by `password`), and `local` turning the
    manifest's paths into those folders."""

    def __init__(self, root: Path, password: str) -> None:
        self.root = root
        self.spec = _doc("Deployment", "vit-serve-redis")["spec"]["template"]["spec"]
        self.folders = {v["name"]: root / v["name"] for v in self.spec["volumes"]}
        self.mounts: dict[str, str] = {}
        for c in self.spec["containers"] + self.spec["initContainers"]:
            for m in c["volumeMounts"]:
                assert self.mounts.setdefault(m["name"], m["mountPath"]) == m["mountPath"], m
        for volume in self.spec["volumes"]:
            folder = self.folders[volume["name"]]
            folder.mkdir(parents=True)
            if "configMap" in volume:
                for name, text in _doc("ConfigMap", volume["configMap"]["name"])["data"].items():
                    (folder / name).write_text(self.local(text))
            if "secret" in volume:
                secret = _doc("Secret", volume["secret"]["secretName"])
                for item in volume["secret"]["items"]:
                    assert item["key"] in secret["stringData"]
                    (folder / item["path"]).write_text(password)

    def local(self, text: str) -> str:
        for name, mount in sorted(self.mounts.items(), key=lambda kv: -len(kv[1])):
            text = text.replace(mount, str(self.folders[name]))
        return text

    def run_init(self) -> subprocess.CompletedProcess:
        """The init container's command, run by /bin/sh on the local folders."""
        (init,) = self.spec["initContainers"]
        command = [self.local(a) for a in init["command"]]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    def redis_args(self) -> list[str]:
        (container,) = self.spec["containers"]
        return [self.local(a) for a in container["args"]]


REDIS_TEST_PASSWORD = secrets.token_hex(32)  # what `openssl rand -hex 32` makes, as secret.yaml says


@pytest.fixture(scope="module")
def redis_from_manifest(tmp_path_factory, start_redis) -> Iterator[tuple[str, Any]]:
    """Debian's redis-server started as the Redis pod starts: the init container's script writes the requirepass
    directive from the Secret's file, then redis-server runs on the ConfigMap's redis.conf (plus a local port and
    folder); the client authenticates with the Secret's password."""
    pod = RedisPod(tmp_path_factory.mktemp("redis-pod"), REDIS_TEST_PASSWORD)
    done = pod.run_init()
    assert done.returncode == 0, done.stderr
    with start_redis(tmp_path_factory.mktemp("redis"), *pod.redis_args(), password=REDIS_TEST_PASSWORD,
                     requirepass=False) as started:
        yield started


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, exported, redis_from_manifest, ready_client) -> Iterator[tuple[list, str]]:
    """Two gateways built from the Deployment's env, as two pods: its volumes made local folders (the models an
    export, the keys the Secret's files written as secret.yaml tells users to, the Redis password the local
    redis-server's, as the vit-serve-redis Secret's file), the Redis Service replaced by the local redis-server
    (its URL without the password), gRPC on a free port. Yields the TestClients and the API key."""
    pytest.importorskip("fastapi")
    from vit_serve.serve.settings import ServeSettings

    folder = tmp_path_factory.mktemp("pod")
    deployment = _doc("Deployment", "vit-serve")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    mounts = {m["name"]: folder / m["mountPath"].lstrip("/") for m in container["volumeMounts"]}
    shutil.copytree(exported / "exports", mounts["models"])
    key = secrets.token_urlsafe(32)
    mounts["keys"].mkdir(parents=True)
    for name in _doc("Secret", "vit-serve-keys")["stringData"]:
        (mounts["keys"] / name).write_text("sha256:" + hashlib.sha256(key.encode()).hexdigest() + "\n")
    mounts["redis-password"].mkdir(parents=True)
    (mounts["redis-password"] / "password").write_text(REDIS_TEST_PASSWORD)
    (mounts["redis-password"] / "store_secret").write_text(secrets.token_hex(32))  # as secret.yaml says
    env = {}
    for var, value in _env(container).items():  # a path in a mount becomes that path in the mount's folder
        owner = [(m["mountPath"], m["name"]) for m in container["volumeMounts"]
                 if value.startswith(m["mountPath"] + "/")]
        mount, name = max(owner, default=(None, None), key=lambda o: len(o[0] or ""))
        env[var] = value.replace(mount, str(mounts[name]), 1) if mount else value
    redis_url, _ = redis_from_manifest
    env |= {"VIT_SERVE_STORE": redis_url, "VIT_SERVE_GRPC_PORT": "0", "VIT_SERVE_METRICS_PORT": "0"}
    model = str(mounts["models"])
    settings = ServeSettings(**_settings_kwargs(env), model=model, host="127.0.0.1", device="cpu")
    # the pods share the Secret's store secret, not a process's own
    assert not settings.explain_store.store_secret_generated
    with ready_client(settings) as a, ready_client(settings) as b:
        yield [a, b], key


def _probe_paths(container: dict) -> set[str]:
    return {container[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")}


def test_redis_runs_with_the_manifests_limits(redis_from_manifest):
    _, client = redis_from_manifest
    assert client.config_get("requirepass")["requirepass"] == REDIS_TEST_PASSWORD
    assert client.config_get("maxmemory")["maxmemory"] == str(256 * 1024 * 1024)
    assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "volatile-lru"
    assert client.config_get("save")["save"] == "" and client.config_get("appendonly")["appendonly"] == "no"


def test_redis_refuses_a_client_without_the_secrets_password(redis_from_manifest):
    """The config the manifest ships (requirepass from the Secret's file, through the init container): a PING
    without the password is refused with NOAUTH, one with a wrong password with WRONGPASS, the Secret's answers."""
    import redis

    url, client = redis_from_manifest
    port = client.connection_pool.connection_kwargs["port"]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:  # a bare client, no redis-py retries
        raw.sendall(b"PING\r\n")
        assert raw.recv(200).startswith(b"-NOAUTH")
    with redis.Redis(port=port) as anonymous, pytest.raises(redis.AuthenticationError, match=r"NOAUTH|authenticated"):
        anonymous.ping()
    with redis.Redis(port=port, password="not-" + REDIS_TEST_PASSWORD) as wrong, \
            pytest.raises(redis.AuthenticationError, match=r"WRONGPASS|invalid"):
        wrong.ping()
    with redis.Redis(port=port, password=REDIS_TEST_PASSWORD) as authenticated:
        assert authenticated.ping() is True
    assert "@" not in url  # the gateways' URL carries no password: they read it from the Secret's file


@pytest.mark.parametrize("password, reason", [
    (None, "32 to 256 characters, not 11"),  # the shipped placeholder
    ("a b" + "c" * 40, "only letters, digits"),  # Redis's config parser would split it
    ("p" * 40 + '"', "only letters, digits"),
    ("p" * 20, "32 to 256 characters, not 20"),
])
def test_redis_init_refuses_the_placeholder_and_passwords_redis_would_misread(tmp_path, password, reason):
    placeholder = _doc("Secret", "vit-serve-redis")["stringData"]["password"]
    assert "PLACEHOLDER" in placeholder
    pod = RedisPod(tmp_path, placeholder if password is None else password)
    done = pod.run_init()
    assert done.returncode != 0 and reason in done.stderr and "Secret vit-serve-redis" in done.stderr, done.stderr
    assert not any(pod.folders["auth"].iterdir()), "no requirepass directive written"


def _gateway_pods() -> dict[str, tuple[dict, dict, dict]]:
    """{which: (pod labels, pod spec, the gateway container)} of the two gateways that use the shared Redis."""
    deployment = _doc("Deployment", "vit-serve")
    transformer = _doc("InferenceService", "vit")["spec"]["transformer"]
    return {"k8s Deployment": (pod_labels(deployment), deployment["spec"]["template"]["spec"],
                               deployment["spec"]["template"]["spec"]["containers"][0]),
            "kserve transformer": (transformer["labels"], transformer, transformer["containers"][0])}


def _secret_file(spec: dict, container: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) of the file `path` in `container`, mounted from a Secret volume of the pod `spec`."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in container["volumeMounts"]:
        if str(Path(path).parent) == mount["mountPath"] and "secret" in volumes[mount["name"]]:
            secret = volumes[mount["name"]]["secret"]
            items = {i["path"]: i["key"] for i in secret.get("items", [])}
            name = Path(path).name
            return secret["secretName"], items.get(name, name) if items else name
    raise AssertionError(f"{path} is not in a Secret mount")


@pytest.mark.parametrize("which", ["k8s Deployment", "kserve transformer"])
def test_gateways_read_the_redis_password_and_their_keys_from_secret_files(which):
    _, spec, container = _gateway_pods()[which]
    env = _env(container)
    assert env["VIT_SERVE_STORE"] == "redis://vit-serve-redis:6379/0"  # no password in the URL
    assert _secret_file(spec, container, env["VIT_SERVE_STORE_PASSWORD_FILE"]) == ("vit-serve-redis", "password")
    name, key = _secret_file(spec, container, env["VIT_SERVE_API_KEYS_FILE"])
    assert key in _doc("Secret", name)["stringData"]
    # Redis's pod reads the same Secret key, and nothing carries the password in clear.
    redis_pod = _doc("Deployment", "vit-serve-redis")["spec"]["template"]["spec"]
    (volume,) = [v for v in redis_pod["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "vit-serve-redis" and volume["secret"]["items"][0]["key"] == "password"
    for c in redis_pod["containers"] + redis_pod["initContainers"]:
        assert "env" not in c and not any("requirepass" in a for a in c.get("args", [])), c["name"]
    config = _doc("ConfigMap", "vit-serve-redis-config")["data"]["redis.conf"]
    assert not re.search(r"^\s*requirepass", config, re.M) and re.search(r"^include /run/", config, re.M)


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions) applied to `labels`."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def test_only_the_gateways_pods_may_reach_redis():
    """The NetworkPolicy selects the Redis pod, allows ingress (and nothing else in it) only from pods of this
    namespace that both gateways are and that Redis and Triton are not, and only on Redis's port."""
    policy = _doc("NetworkPolicy", "vit-serve-redis")["spec"]
    redis_deployment = _doc("Deployment", "vit-serve-redis")
    assert _selects(policy["podSelector"], pod_labels(redis_deployment))
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}, "pods of this namespace only (no namespaceSelector, no ipBlock)"
    for which, (labels, _, _) in _gateway_pods().items():
        assert _selects(peer["podSelector"], labels), which
    # KServe labels the predictor's pods with the InferenceService's name and component; ours add none.
    predictor = {"serving.kserve.io/inferenceservice": "vit", "component": "predictor",
                 **_doc("InferenceService", "vit")["spec"]["predictor"].get("labels", {})}
    for name, labels in {"redis": pod_labels(redis_deployment), "triton predictor": predictor, "none": {}}.items():
        assert not _selects(peer["podSelector"], labels), name
    (port,) = rule["ports"]
    (container,) = redis_deployment["spec"]["template"]["spec"]["containers"]
    assert port["protocol"] == "TCP" and port["port"] in {p["name"] for p in container["ports"]}
    assert _selects({"matchLabels": {"a": "1"}}, {"a": "1", "b": "2"})  # the selector's semantics, both ways
    assert not _selects({"matchExpressions": [{"key": "a", "operator": "In", "values": ["2"]}]}, {"a": "1"})


def _kserve_pod_labels(component: str) -> dict[str, str]:
    """The labels KServe gives the pods of the InferenceService's `component` (predictor, transformer): the
    InferenceService's name and the component (pkg/constants: InferenceServicePodLabelKey, KServiceComponentLabel),
    with the component's own `labels`."""
    isvc = _doc("InferenceService", "vit")
    return {"serving.kserve.io/inferenceservice": isvc["metadata"]["name"], "component": component,
            **isvc["spec"][component].get("labels", {})}


def _ingress_ports(rule: dict, container_ports: dict[str, int]) -> set[int]:
    """The port numbers a NetworkPolicy ingress rule opens (named ports resolved by the pod's container ports)."""
    assert all(p.get("protocol", "TCP") == "TCP" for p in rule["ports"])
    return {container_ports.get(p["port"], p["port"]) for p in rule["ports"]}


PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}


def test_only_the_gateways_pods_reach_tritons_inference_api():
    """F5: the predictor's NetworkPolicy selects the pods KServe makes for the predictor (and not the gateway's),
    admits Triton's inference ports (the runtime's gRPC and HTTP) only from pods with the gateway's labels, which
    the transformer and deploy/k8s's Deployment carry and the predictor, Redis and an unlabelled pod do not, and
    Triton's metrics port only from Prometheus's pods; every port Triton listens on is in one rule."""
    policy = _doc("NetworkPolicy", "vit-predictor")["spec"]
    predictor, transformer = _kserve_pod_labels("predictor"), _kserve_pod_labels("transformer")
    assert _selects(policy["podSelector"], predictor) and not _selects(policy["podSelector"], transformer)
    assert policy["policyTypes"] == ["Ingress"]
    (container,) = _doc("ServingRuntime", "vit-serve-tritonserver")["spec"]["containers"]
    flags = dict(a.removeprefix("--").split("=", 1) for a in container["args"] if a.startswith("--") and "=" in a)
    inference = {int(flags["grpc-port"]), int(flags["http-port"])}
    metrics_port = int(_doc("ServingRuntime", "vit-serve-tritonserver")["spec"]["annotations"][
        "prometheus.kserve.io/port"])
    isvc_ports = {p["containerPort"] for p in _doc("InferenceService", "vit")["spec"]["predictor"]["model"]["ports"]}
    assert isvc_ports <= inference  # the port KServe's Service routes to is one of them
    by_ports = {}
    for rule in policy["ingress"]:
        (peer,) = rule["from"]  # no rule open to every source
        by_ports[frozenset(_ingress_ports(rule, {}))] = peer
    assert set(by_ports) == {frozenset(inference), frozenset({metrics_port})}
    gateway_peer, prometheus_peer = by_ports[frozenset(inference)], by_ports[frozenset({metrics_port})]
    assert set(gateway_peer) == {"podSelector"}, "pods of this namespace only (no namespaceSelector, no ipBlock)"
    for which, (labels, _, _) in _gateway_pods().items():
        assert _selects(gateway_peer["podSelector"], labels), which
    others = {"predictor": predictor, "redis": pod_labels(_doc("Deployment", "vit-serve-redis")), "none": {},
              "prometheus": PROMETHEUS}
    for name, labels in others.items():
        assert not _selects(gateway_peer["podSelector"], labels), name
    assert _selects(prometheus_peer["podSelector"], PROMETHEUS) and not _selects(prometheus_peer["podSelector"],
                                                                                 transformer)


def test_the_gateways_metrics_port_is_its_scrape_target_and_only_prometheus_reaches_it():
    """Both gateways serve /metrics without a key on VIT_SERVE_METRICS_PORT: their prometheus.io/port names it, a
    NetworkPolicy on their pods (not on others) admits only Prometheus's pods there and anyone to the API ports,
    and the main port keeps /metrics behind the key (open_probes does not open it)."""
    from vit_serve.serve.security import PROBE_PATHS

    assert "/metrics" not in PROBE_PATHS
    deployment = _doc("Deployment", "vit-serve")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    transformer_ports = {p["name"]: p["containerPort"] for p in _transformer()["ports"]}
    gateways = {
        "k8s Deployment": (deployment["spec"]["template"]["metadata"]["annotations"], container, named,
                           "vit-serve-gateway", pod_labels(deployment)),
        "kserve transformer": (_doc("InferenceService", "vit")["spec"]["transformer"]["annotations"],
                               _transformer(), transformer_ports, "vit-transformer",
                               _kserve_pod_labels("transformer")),
    }
    for which, (notes, c, ports, policy_name, labels) in gateways.items():
        metrics_port = int(_env(c)["VIT_SERVE_METRICS_PORT"])
        assert notes["prometheus.io/port"] == str(metrics_port), which
        assert notes["prometheus.io/path"] == "/metrics", which
        assert metrics_port not in ports.values() or ports.get("metrics") == metrics_port, which
        policy = _doc("NetworkPolicy", policy_name)["spec"]
        assert _selects(policy["podSelector"], labels), which
        assert not _selects(policy["podSelector"], _kserve_pod_labels("predictor")), which
        open_rules = [r for r in policy["ingress"] if "from" not in r]
        (api,) = open_rules
        assert metrics_port not in _ingress_ports(api, ports), which
        api_ports = {v for k, v in ports.items() if k != "metrics"}
        assert _ingress_ports(api, ports) == api_ports, which
        (scrape,) = [r for r in policy["ingress"] if "from" in r]
        assert _ingress_ports(scrape, ports) == {metrics_port}, which
        (peer,) = scrape["from"]
        assert _selects(peer["podSelector"], PROMETHEUS) and not _selects(peer["podSelector"], labels), which
    service = _doc("Service", "vit-serve")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]}["metrics"] == named["metrics"]


def test_probe_paths_answer_without_a_key(replicas):
    clients, _ = replicas
    paths = _probe_paths(_doc("Deployment", "vit-serve")["spec"]["template"]["spec"]["containers"][0])
    paths |= _probe_paths(_transformer())
    assert paths == {"/healthz", "/readyz"}
    for client in clients:
        for path in sorted(paths):
            answer = client.get(path)
            assert answer.status_code == 200, (path, answer.text)


def test_the_hpas_metric_is_exported_and_the_adapter_rule_names_it(replicas):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    clients, _ = replicas
    assert clients[0].get("/metrics").status_code == 401  # on the main port /metrics needs a key
    # What Prometheus scrapes: the metrics port (the pod's prometheus.io/port), without a key.
    text = httpx.get(f"http://127.0.0.1:{clients[0].app.state.metrics_listener.port}/metrics", timeout=30).text
    samples = {s.name: s for family in text_string_to_metric_families(text) for s in family.samples}
    (adapter,) = [d for _, d in _documents() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "adapter-config"]
    rules = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    exposed = {r["name"]["as"]: re.match(r"'?(\w+)\{", r["seriesQuery"]).group(1) for r in rules}
    for name in ("vit-serve", "vit-transformer"):
        hpa = _doc("HorizontalPodAutoscaler", name)
        pods = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
        assert pods, name
        for metric in pods:
            assert metric in exposed, f"no prometheus-adapter rule exposes {metric}"
            series = exposed[metric]
            assert series in samples, f"{series} is not in the gateway's /metrics"
            assert samples[series].labels.get("model") == "digits_32"


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (40, 40), (200, 30, 90)).save(buf, "PNG")
    return buf.getvalue()


def test_keys_come_from_the_secret_and_any_replica_explains_by_id(replicas):
    clients, key = replicas
    a, b = clients
    png, auth = _png(), {"Authorization": f"Bearer {key}"}
    assert a.post("/classify", content=png, headers={"Content-Type": "image/png"}).status_code == 401
    placeholder = {"Authorization": "Bearer sha256:" + "0" * 64}
    assert a.post("/classify", content=png, headers={"Content-Type": "image/png", **placeholder}).status_code == 401
    classified = a.post("/classify", content=png, headers={"Content-Type": "image/png", **auth})
    assert classified.status_code == 200, classified.text
    explained = b.get(f"/explain?id={classified.json()['id']}&format=json", headers=auth)
    assert explained.status_code == 200, explained.text


def test_the_store_secrets_placeholder_stops_a_gateway_in_one_line(tmp_path):
    """Until the vit-serve-redis Secret is replaced, a gateway refuses its placeholder store secret (shorter than
    the 16 bytes it accepts) instead of making ids with a secret everybody knows."""
    from vit_serve.serve.settings import ServeSettings
    from vit_serve.serve.stores.secret import StoreSecret

    secret = _doc("Secret", "vit-serve-redis")["stringData"]["store_secret"]
    (tmp_path / "store_secret").write_text(secret)
    with pytest.raises(ValueError, match="it needs at least 16") as e:
        StoreSecret.from_settings(ServeSettings(store_secret_file=str(tmp_path / "store_secret")).explain_store)
    assert "\n" not in str(e.value) and secret not in str(e.value)
