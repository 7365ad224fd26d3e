"""Strict deserialization of KServe resources into the `kserve` SDK's typed models; run by test_manifests.py in
the SDK's own environment (VIT_SERVE_KSERVE_PYTHON). Prints {name: null, or the first error with its path}.

The SDK's own `ApiClient.deserialize` drops unknown keys and cannot resolve the Kubernetes types it nests
(V1Container, V1ObjectMeta live in the `kubernetes` package), so the walk is here: at every KServe model the
document's keys must be in the model's `attribute_map` (a misspelled field is an error), each value is turned
into its `openapi_types` type, and the model is built with its constructor (which checks required fields); at a
Kubernetes type the value goes to the `kubernetes` client's pydantic model (`extra="forbid"`), which does the
same all the way down. Usage: python kserve_models_script.py DOCS.json (a list of {"name", "kind", "doc"}).
"""

from __future__ import annotations

import json
import re
import sys
from importlib.metadata import version

import kserve
import kubernetes.client

KINDS = {"InferenceService": "V1beta1InferenceService", "ServingRuntime": "V1alpha1ServingRuntime",
         "ClusterServingRuntime": "V1alpha1ClusterServingRuntime"}
SCALARS = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}
QUANTITY = "ResourceQuantity"  # a Kubernetes quantity: "2", 2, "4Gi"


class InvalidError(ValueError):
    pass


def _class(name: str):
    return getattr(kserve.models, name, None) or getattr(kubernetes.client, name, None)


def build(data, type_name: str, path: str):
    """`data` as `type_name` (an openapi_types string), or InvalidError naming `path`."""
    if data is None:
        return None
    if m := re.fullmatch(r"[Ll]ist\[(.+)\]", type_name):
        if not isinstance(data, list):
            raise InvalidError(f"{path}: expected a list, got {type(data).__name__}")
        return [build(v, m.group(1), f"{path}[{i}]") for i, v in enumerate(data)]
    if m := re.fullmatch(r"[Dd]ict\((?:str|[A-Za-z]+), ?(.+)\)", type_name):
        if not isinstance(data, dict):
            raise InvalidError(f"{path}: expected a mapping, got {type(data).__name__}")
        return {k: build(v, m.group(1), f"{path}.{k}") for k, v in data.items()}
    if type_name == "object":
        return data
    if type_name in SCALARS or type_name == QUANTITY:
        allowed = (str, int, float) if type_name == QUANTITY else SCALARS[type_name]
        if not isinstance(data, allowed) or (isinstance(data, bool) and bool not in allowed):
            raise InvalidError(f"{path}: expected {type_name}, got {type(data).__name__} {data!r}")
        return data
    klass = _class(type_name)
    if klass is None:
        raise InvalidError(f"{path}: type {type_name} is in neither kserve.models nor kubernetes.client; cannot check")
    if hasattr(klass, "model_validate"):  # kubernetes' pydantic models: strict (extra="forbid") all the way down
        try:
            return klass.model_validate(data)
        except Exception as e:  # pydantic.ValidationError; its message names the fields
            raise InvalidError(f"{path} ({type_name}): {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise InvalidError(f"{path}: expected a {type_name} mapping, got {type(data).__name__}")
    by_json = {j: attr for attr, j in klass.attribute_map.items()}
    unknown = sorted(set(data) - set(by_json))
    if unknown:
        raise InvalidError(f"{path}: unknown field(s) {unknown} for {type_name}")
    kwargs = {by_json[k]: build(v, klass.openapi_types[by_json[k]], f"{path}.{k}") for k, v in data.items()}
    try:
        return klass(**kwargs)
    except (TypeError, ValueError) as e:  # the constructors' required-field and enum checks
        raise InvalidError(f"{path} ({type_name}): {e}") from None


def check(kind: str, doc: dict) -> str | None:
    if kind not in KINDS:
        return f"no kserve model for kind {kind}"
    try:
        build(doc, KINDS[kind], kind)
    except InvalidError as e:
        return str(e)
    return None


def main() -> int:
    with open(sys.argv[1]) as f:
        docs = json.load(f)
    print(json.dumps({"kserve": version("kserve"), "kubernetes": version("kubernetes"),
                      "results": {d["name"]: check(d["kind"], d["doc"]) for d in docs}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
