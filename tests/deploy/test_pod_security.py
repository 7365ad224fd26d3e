"""Every pod that deploy/ makes, checked against the Pod Security Standards' "restricted" profile and this project's
own hardening on top of it.

The reference is the published profile (https://kubernetes.io/docs/concepts/security/pod-security-standards/,
the "latest" version of the baseline and restricted controls), written out below as `restricted_violations`, a
pure function of a pod's metadata and spec that returns the violations it finds; the admission plugin itself
(pod-security-admission) is Go and needs an API server, which does not run here. The function is tested on pods
made to break each control, so the check can fail. On top of the profile, every pod here has a read-only root
filesystem (what each program writes is an emptyDir), no service account token and the RuntimeDefault seccomp
profile set for the whole pod.

The pods: the gateway's Deployment (deploy/k8s, with and without the TLS component), Redis's (deploy/redis), and
KServe's two pods (deploy/kserve), built as KServe builds them: the predictor is the InferenceService's pod fields
with the ServingRuntime's container and volumes, the transformer is the InferenceService's transformer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

from test_manifests import DEPLOY, _doc, _documents, _tls_deployment  # noqa: E402

# ---- the profile ---------------------------------------------------------------------------------------------

# Baseline, "Capabilities": what may be added beyond the runtime's default set.
BASELINE_CAPABILITIES = frozenset({"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                                   "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})
# Baseline, "Sysctls": the safe set.
SAFE_SYSCTLS = frozenset({"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                          "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range",
                          "net.ipv4.ip_local_reserved_ports", "net.ipv4.tcp_keepalive_time",
                          "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                          "net.ipv4.tcp_keepalive_probes"})
# Baseline, "SELinux": the types a pod may ask for (besides none or "").
SELINUX_TYPES = frozenset({"container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
# Restricted, "Volume Types": the only volume sources allowed.
RESTRICTED_VOLUMES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                                "projected", "secret"})
# Restricted, "Capabilities": the only one that may be added (after dropping ALL).
RESTRICTED_ADD = frozenset({"NET_BIND_SERVICE"})
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"


def _containers(spec: dict) -> list[tuple[str, dict]]:
    return [(f"{kind}[{c.get('name', i)}]", c) for kind in ("initContainers", "containers", "ephemeralContainers")
            for i, c in enumerate(spec.get(kind) or [])]


def restricted_violations(spec: dict, annotations: dict[str, str] | None = None) -> list[str]:
    """The controls of the "restricted" profile (baseline's included) that a pod `spec` (with its metadata's
    `annotations`) breaks, one line each naming the field; [] when it meets the profile."""
    out: list[str] = []
    pod_sc = spec.get("securityContext") or {}
    containers = _containers(spec)

    # -- baseline --
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("HostProcess: spec.securityContext.windowsOptions.hostProcess is true")
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            out.append(f"Host Namespaces: spec.{field} is true")
    for vol in spec.get("volumes") or []:
        if "hostPath" in vol:
            out.append(f"HostPath Volumes: volume {vol.get('name')} is a hostPath")
    for name, value in (annotations or {}).items():
        if name.startswith(APPARMOR_ANNOTATION) and value != "runtime/default" and not value.startswith("localhost/"):
            out.append(f"AppArmor: annotation {name} is {value!r}")
    for sysctl in pod_sc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"Sysctls: spec.securityContext.sysctls {sysctl.get('name')} is not in the safe set")

    def security_context_checks(where: str, sc: dict) -> None:
        apparmor = (sc.get("appArmorProfile") or {}).get("type")
        if apparmor not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"AppArmor: {where}.appArmorProfile.type is {apparmor!r}")
        selinux = sc.get("seLinuxOptions") or {}
        if selinux.get("type") not in (None, "", *SELINUX_TYPES):
            out.append(f"SELinux: {where}.seLinuxOptions.type is {selinux['type']!r}")
        for field in ("user", "role"):
            if selinux.get(field) not in (None, ""):
                out.append(f"SELinux: {where}.seLinuxOptions.{field} is set")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"Seccomp: {where}.seccompProfile.type is Unconfined")
        if sc.get("runAsUser") == 0:
            out.append(f"Running as Non-root user: {where}.runAsUser is 0")

    security_context_checks("spec.securityContext", pod_sc)
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    for where, c in containers:
        sc = c.get("securityContext") or {}
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"HostProcess: {where}.securityContext.windowsOptions.hostProcess is true")
        if sc.get("privileged"):
            out.append(f"Privileged Containers: {where}.securityContext.privileged is true")
        caps = sc.get("capabilities") or {}
        added = set(caps.get("add") or [])
        if added - BASELINE_CAPABILITIES:
            out.append(f"Capabilities: {where} adds {sorted(added - BASELINE_CAPABILITIES)} (baseline)")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"Host Ports: {where} port {port.get('containerPort')} has hostPort {port['hostPort']}")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"/proc Mount Type: {where}.securityContext.procMount is {sc['procMount']!r}")
        security_context_checks(f"{where}.securityContext", sc)

        # -- restricted, per container --
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"Privilege Escalation: {where}.securityContext.allowPrivilegeEscalation is not false")
        non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"Running as Non-root: {where} does not set runAsNonRoot: true (nor does the pod)")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"Seccomp: {where} has no RuntimeDefault or Localhost seccompProfile (nor does the pod)")
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"Capabilities: {where} does not drop ALL")
        if added - RESTRICTED_ADD:
            out.append(f"Capabilities: {where} adds {sorted(added - RESTRICTED_ADD)} (only NET_BIND_SERVICE)")

    # -- restricted, per pod --
    for vol in spec.get("volumes") or []:
        sources = set(vol) - {"name"}
        if not sources <= RESTRICTED_VOLUMES:
            out.append(f"Volume Types: volume {vol.get('name')} is {sorted(sources - RESTRICTED_VOLUMES)}")
    return out


# ---- this project's hardening, beyond the profile -------------------------------------------------------------

# What each program writes, beside its mounted data: emptyDirs at these paths (the gateway: tempfile's and torch's
# temporary files, and HOME's caches; Triton: its and its backends' temporary files; Redis: its working directory).
WRITABLE = {"gateway": ("/tmp", "/home/vit/.cache"), "triton": ("/tmp",), "redis": ("/data",),
            "redis-init": ("/run/vit-serve-redis",)}


def hardening_violations(spec: dict) -> list[str]:
    """What `spec` lacks of the hardening every pod here has beyond the profile."""
    out = []
    if spec.get("automountServiceAccountToken") is not False:
        out.append("automountServiceAccountToken is not false")
    if ((spec.get("securityContext") or {}).get("seccompProfile") or {}).get("type") != "RuntimeDefault":
        out.append("spec.securityContext.seccompProfile.type is not RuntimeDefault")
    for where, c in _containers(spec):
        if (c.get("securityContext") or {}).get("readOnlyRootFilesystem") is not True:
            out.append(f"{where}: readOnlyRootFilesystem is not true")
    return out


def _writable_mounts(spec: dict, container: dict) -> set[str]:
    empty = {v["name"] for v in spec.get("volumes") or [] if "emptyDir" in v}
    return {m["mountPath"] for m in container.get("volumeMounts") or []
            if m["name"] in empty and not m.get("readOnly")}


# ---- the pods deploy/ makes -----------------------------------------------------------------------------------

POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


def _kserve_predictor() -> tuple[dict, dict]:
    """The predictor's pod as KServe builds it: the InferenceService's pod fields, the ServingRuntime's container
    (with the predictor model's ports) and volumes."""
    isvc = _doc("InferenceService", "vit")
    predictor = copy.deepcopy(isvc["spec"]["predictor"])
    model = predictor.pop("model")
    runtime = _doc("ServingRuntime", model["runtime"])["spec"]
    (container,) = copy.deepcopy(runtime["containers"])
    if "ports" in model:
        container["ports"] = model["ports"]
    pod = {k: v for k, v in predictor.items() if k not in ("minReplicas", "maxReplicas", "labels", "annotations")}
    pod["containers"] = [container]
    pod["volumes"] = [*pod.get("volumes", []), *runtime.get("volumes", [])]
    return pod, predictor.get("annotations", {})


def _kserve_transformer() -> tuple[dict, dict]:
    transformer = copy.deepcopy(_doc("InferenceService", "vit")["spec"]["transformer"])
    annotations = transformer.pop("annotations", {})
    pod = {k: v for k, v in transformer.items() if k not in ("minReplicas", "maxReplicas", "labels")}
    return pod, annotations


def _template(doc: dict) -> tuple[dict, dict]:
    template = doc["spec"]["template"]
    return template["spec"], template["metadata"].get("annotations", {})


def pods() -> dict[str, tuple[dict, dict]]:
    """{name: (pod spec, pod annotations)} of every pod deploy/ makes, and which program each container runs."""
    return {
        "k8s/deployment.yaml": _template(_doc("Deployment", "vit-serve")),
        "k8s/deployment.yaml + tls": _template(_tls_deployment()),
        "redis/redis.yaml": _template(_doc("Deployment", "vit-serve-redis")),
        "kserve predictor": _kserve_predictor(),
        "kserve transformer": _kserve_transformer(),
    }


PROGRAMS = {"k8s/deployment.yaml": {"gateway": "gateway"}, "k8s/deployment.yaml + tls": {"gateway": "gateway"},
            "redis/redis.yaml": {"redis": "redis", "requirepass": "redis-init"},
            "kserve predictor": {"kserve-container": "triton"}, "kserve transformer": {"kserve-container": "gateway"}}


def test_every_workload_under_deploy_is_checked():
    """No pod escapes: the pod-making documents under deploy/ are the ones `pods` builds (plus KServe's)."""
    workloads = sorted(f"{p.relative_to(DEPLOY)}:{d['kind']}:{d['metadata']['name']}" for p, d in _documents()
                       if d["kind"] in POD_TEMPLATE_KINDS | {"Pod", "CronJob", "InferenceService", "ServingRuntime"})
    assert workloads == ["k8s/deployment.yaml:Deployment:vit-serve",
                         "kserve/inferenceservice.yaml:InferenceService:vit",
                         "kserve/servingruntime.yaml:ServingRuntime:vit-serve-tritonserver",
                         "redis/redis.yaml:Deployment:vit-serve-redis"]
    assert set(_doc("InferenceService", "vit")["spec"]) == {"predictor", "transformer"}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_pod_meets_the_restricted_profile(name):
    spec, annotations = pods()[name]
    assert restricted_violations(spec, annotations) == []


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_pod_has_a_read_only_root_filesystem_no_token_and_runtime_default_seccomp(name):
    spec, _ = pods()[name]
    assert hardening_violations(spec) == []
    # What each program writes is an emptyDir, mounted writable.
    for container in spec["containers"] + spec.get("initContainers", []):
        program = PROGRAMS[name][container["name"]]
        missing = set(WRITABLE[program]) - _writable_mounts(spec, container)
        assert not missing, f"{name} {container['name']}: no writable emptyDir at {sorted(missing)}"
    assert {c["name"] for c in spec["containers"] + spec.get("initContainers", [])} == set(PROGRAMS[name])


# ---- the check itself fails on what breaks the profile ------------------------------------------------------------


def _good() -> dict:
    return {"securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
            "automountServiceAccountToken": False,
            "containers": [{"name": "app", "image": "app", "ports": [{"containerPort": 8080}],
                            "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                                "capabilities": {"drop": ["ALL"]}}}],
            "volumes": [{"name": "tmp", "emptyDir": {}}]}


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def apply(pod: dict) -> None:
        *parents, last = path.split(".")
        node = pod
        for key in parents:
            node = node[int(key)] if key.isdigit() else node.setdefault(key, {})
        node[last] = value
    return apply


def _drop(path: str) -> Callable[[dict], None]:
    def apply(pod: dict) -> None:
        *parents, last = path.split(".")
        node = pod
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        del node[last]
    return apply


def _init_container(pod: dict) -> None:
    pod["initContainers"] = [{"name": "init", "image": "app"}]  # no securityContext at all


def _hostpath(pod: dict) -> None:
    pod["volumes"].append({"name": "host", "hostPath": {"path": "/"}})


C = "containers.0.securityContext"
BAD = {  # control -> (the mutation, the words its violation must contain)
    "hostProcess": (_set("securityContext.windowsOptions.hostProcess", True), "HostProcess"),
    "hostNetwork": (_set("hostNetwork", True), "spec.hostNetwork"),
    "hostPID": (_set("hostPID", True), "spec.hostPID"),
    "hostIPC": (_set("hostIPC", True), "spec.hostIPC"),
    "privileged": (_set(f"{C}.privileged", True), "Privileged Containers"),
    "capability beyond baseline": (_set(f"{C}.capabilities.add", ["SYS_ADMIN"]), "SYS_ADMIN"),
    "capability beyond restricted": (_set(f"{C}.capabilities.add", ["CHOWN"]), "only NET_BIND_SERVICE"),
    "no drop ALL": (_set(f"{C}.capabilities.drop", ["NET_RAW"]), "does not drop ALL"),
    "hostPath": (_hostpath, "HostPath Volumes"),
    "hostPort": (_set("containers.0.ports.0.hostPort", 80), "Host Ports"),
    "AppArmor unconfined": (_set(f"{C}.appArmorProfile", {"type": "Unconfined"}), "AppArmor"),
    "SELinux type": (_set(f"{C}.seLinuxOptions", {"type": "spc_t"}), "SELinux"),
    "SELinux user": (_set("securityContext.seLinuxOptions", {"user": "system_u"}), "seLinuxOptions.user"),
    "procMount": (_set(f"{C}.procMount", "Unmasked"), "/proc Mount Type"),
    "seccomp unconfined": (_set(f"{C}.seccompProfile", {"type": "Unconfined"}), "Unconfined"),
    "no seccomp": (_drop("securityContext.seccompProfile"), "no RuntimeDefault or Localhost"),
    "unsafe sysctl": (_set("securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}]), "kernel.msgmax"),
    "nfs volume": (lambda pod: pod["volumes"].append({"name": "n", "nfs": {"server": "s", "path": "/"}}), "nfs"),
    "privilege escalation": (_set(f"{C}.allowPrivilegeEscalation", True), "allowPrivilegeEscalation"),
    "privilege escalation unset": (_drop(f"{C}.allowPrivilegeEscalation"), "allowPrivilegeEscalation"),
    "runAsNonRoot false": (_set(f"{C}.runAsNonRoot", False), "Running as Non-root:"),
    "runAsNonRoot unset": (_drop("securityContext.runAsNonRoot"), "Running as Non-root:"),
    "runAsUser 0": (_set(f"{C}.runAsUser", 0), "runAsUser is 0"),
    "init container unhardened": (_init_container, "initContainers[init]"),
}


def test_the_check_passes_a_pod_that_meets_the_profile():
    assert restricted_violations(_good()) == [] and hardening_violations(_good()) == []
    allowed = _good()  # what the profile allows: Localhost seccomp, NET_BIND_SERVICE, safe sysctls, PVCs
    allowed["containers"][0]["securityContext"]["capabilities"]["add"] = ["NET_BIND_SERVICE"]
    allowed["containers"][0]["securityContext"]["seccompProfile"] = {"type": "Localhost", "localhostProfile": "p"}
    allowed["securityContext"]["sysctls"] = [{"name": "net.ipv4.ip_local_port_range", "value": "1024 65535"}]
    allowed["volumes"].append({"name": "d", "persistentVolumeClaim": {"claimName": "c"}})
    assert restricted_violations(allowed, {APPARMOR_ANNOTATION + "app": "runtime/default"}) == []


@pytest.mark.parametrize("control", list(BAD))
def test_the_check_names_each_broken_control(control):
    pod = _good()
    mutate, words = BAD[control]
    mutate(pod)
    found = restricted_violations(pod)
    assert found and any(words in v for v in found), found


def test_the_check_reads_apparmor_annotations_and_the_hardening_check_fails():
    assert any("AppArmor" in v for v in restricted_violations(_good(), {APPARMOR_ANNOTATION + "app": "unconfined"}))
    pod = _good()
    pod["automountServiceAccountToken"] = True
    pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] = False
    pod["securityContext"]["seccompProfile"] = {"type": "Localhost", "localhostProfile": "p"}
    assert len(hardening_violations(pod)) == 3

