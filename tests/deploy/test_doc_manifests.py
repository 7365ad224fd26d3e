"""The Kubernetes manifests the guides show (```yaml blocks of docs/guides/*.md with a `kind`) validate strictly
against the Kubernetes schemas `kubernetes-validate` ships, as deploy/'s do (tests/deploy/test_manifests.py); the
serving guide's NetworkPolicy for Weaviate admits Weaviate's pods alone, on the port the gateway's Deployment
serves HTTP on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSIONS = ("1.30", "1.37")
BLOCK = re.compile(r"^```yaml\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _manifests() -> list[tuple[str, dict]]:
    found = []
    for page in sorted((ROOT / "docs/guides").glob("*.md")):
        for block in BLOCK.findall(page.read_text()):
            for doc in yaml.safe_load_all(block):
                if isinstance(doc, dict) and "kind" in doc:
                    found.append((page.name, doc))
    return found


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_guides_manifests_validate_strictly(version):
    docs = _manifests()
    assert ("serving.md", "NetworkPolicy") in {(page, d["kind"]) for page, d in docs}
    for page, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{page}: {doc['kind']} {doc['metadata']['name']}: {'.'.join(map(str, e.path))}: {e.message}")


def test_the_weaviate_policy_admits_weaviates_pods_alone_on_the_http_port():
    (policy,) = [d for page, d in _manifests() if d["metadata"]["name"] == "vit-serve-weaviate-inference"]
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "weaviate"}
    assert peer["namespaceSelector"]["matchLabels"]  # one namespace, not every namespace's weaviate pods
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    deployment = next(yaml.safe_load_all((ROOT / "deploy/k8s/deployment.yaml").read_text()))
    ports = {p["name"]: p["containerPort"] for c in deployment["spec"]["template"]["spec"]["containers"]
             for p in c.get("ports", [])}
    assert [p["port"] for p in rule["ports"]] == [ports["http"]]
