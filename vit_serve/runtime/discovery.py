"""What a model repository holds: the models, their versions on disk, and each model's version policy.

`scan(path)` reads a repository without loading anything. A repository is

* one model (`vit-serve serve MODEL`): a checkpoint (a file, a transformers / timm folder with config.json, or
  a hub id), an exported `NAME.onnx` (with its manifest `NAME.json`) or a TensorRT engine: a repository of one
  model, version 1;
* a folder of such files (what `vit-export --out DIR` writes): model NAME (the file's stem), version 1 each;
  `NAME_explain.onnx`, the text tower `NAME_text.onnx` (`vit-export --text-tower`, with its tokenizer folder) and
  the JSON manifests are the exports' companions, not models;
* a Triton-style folder, `NAME/VERSION/<one of those files>`: versions are positive integers, as in Triton, and
  `NAME/config.pbtxt` (Triton's model configuration, read with Triton's own schema from tritonclient) may set
  the model's `version_policy`, `max_batch_size` and `dynamic_batching` limits, and its traffic split between
  versions: `parameters { key: "traffic" value { string_value: "1:90,2:10" } }` and `shadow` ("3" or "3:25"),
  in the forms of `parse_weights` and `parse_shadow` (`--traffic` / `--shadow` win over them). `NAME/config.toml`
  (`vit_serve.runtime.model_config.ModelConfig`) sets the model's own limits, batching, instances, compute,
  decoding and monitoring; where both files set a value, config.toml's wins.

The Triton repository `vit-export --format triton` writes is one of these: NAME_onnx/VERSION/model.onnx with its
manifest `sidecar.json` is served (with its explain graph NAME_explain_onnx, named by its config's "vit_serve"
parameter, `vit_serve.manifest.TritonMeta`); the models only Triton runs (Python backend, ensemble, an engine
without its manifest) and the explain graphs are listed as skipped (`ModelEntry.skipped`), with why and what to
serve instead, under the names Triton gives them.

Both kinds may sit side by side in one folder. A model whose files cannot be told apart (two exports in one
version folder, two files claiming one name) is listed with the reason, and is not served.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from vit_serve.manifest import TRITON_ONNX, TritonMeta, find_manifest
from vit_serve.runtime.model_config import MODEL_CONFIG, ModelConfig, read_model_config
from vit_serve.text.manifest import TEXT_SUFFIX, text_manifest_path, text_path_of

log = logging.getLogger("vit_serve.serve")

ENGINE_SUFFIXES = (".engine", ".plan", ".trt")
CHECKPOINT_SUFFIXES = (".safetensors", ".npz", ".pth", ".pt", ".bin")
EXPLAIN_SUFFIX = "_explain"
TRITON_CONFIG = "config.pbtxt"


SkipKind = Literal["python", "ensemble", "explain", "engine"]


@dataclass(frozen=True)
class VersionPolicy:
    """Which versions of a model are served: Triton's `latest { num_versions: n }`, `all {}`, or `specific`."""

    kind: Literal["latest", "all", "specific"] = "latest"
    num_versions: int = 1
    versions: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str) -> VersionPolicy:
        """"latest" / "latest:N" / "all" / "specific:1,3" -> the policy; ValueError naming the forms."""
        kind, _, arg = text.strip().lower().partition(":")
        try:
            if kind == "latest":
                n = int(arg) if arg else 1
                if n >= 1:
                    return cls("latest", n)
            elif kind == "all" and not arg:
                return cls("all")
            elif kind == "specific":
                versions = tuple(sorted({int(v) for v in arg.split(",") if v.strip()}))
                if versions and versions[0] >= 1:
                    return cls("specific", versions=versions)
        except ValueError:
            pass
        raise ValueError(f"version policy {text!r}: expected latest, latest:N (N >= 1), all, or specific:V1,V2,... "
                         f"(versions >= 1)")

    def select(self, available: list[int]) -> list[int]:
        """The versions to serve out of `available`, ascending."""
        ordered = sorted(available)
        if self.kind == "all":
            return ordered
        if self.kind == "specific":
            return [v for v in ordered if v in self.versions]
        return ordered[-self.num_versions:]

    def __str__(self) -> str:
        if self.kind == "latest":
            return f"latest:{self.num_versions}"
        return "all" if self.kind == "all" else "specific:" + ",".join(map(str, self.versions))


def check_version(v: object, what: str = "version") -> int:
    """A version: an integer >= 1 (not a bool); ValueError naming `what` otherwise."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{what} {v!r}: versions are integers >= 1")
    return v


def check_weights(weights: Mapping[int, float]) -> dict[int, float]:
    """A traffic split's weights by version, checked: versions integers >= 1, weights finite numbers >= 0 with a
    sum > 0; ValueError saying what is wrong."""
    out: dict[int, float] = {}
    for v, w in weights.items():
        check_version(v)
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w < 0:
            raise ValueError(f"version {v}: the weight {w!r} is not a number >= 0")
        out[v] = float(w)
    if weights and sum(out.values()) <= 0:
        raise ValueError("the weights add up to 0: at least one version must take traffic")
    return out


def check_share(share: float) -> float:
    """A shadow's share of requests in percent, 0 < share <= 100; ValueError otherwise."""
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 100:
        raise ValueError(f"the shadow share {share!r} is not a percentage in (0, 100]")
    return float(share)


def parse_weights(text: str) -> dict[int, float]:
    """A traffic split: "1:90,2:10" (version:weight, weights relative: they need not add up to 100) or one
    version, "2" (all of it) -> {version: weight}; ValueError naming the form."""
    form = 'expected VERSION:WEIGHT,... (e.g. "1:90,2:10") or one VERSION'
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise ValueError(f"traffic {text!r}: {form}")
    weights: dict[int, float] = {}
    for part in parts:
        v, sep, w = part.partition(":")
        if not sep and len(parts) > 1:
            raise ValueError(f"traffic {text!r}: {part!r} has no weight ({form})")
        try:
            version, weight = int(v), float(w) if sep else 1.0
        except ValueError:
            raise ValueError(f"traffic {text!r}: {part!r} is not VERSION:WEIGHT ({form})") from None
        if version in weights:
            raise ValueError(f"traffic {text!r}: version {version} is named twice")
        weights[version] = weight
    try:
        return check_weights(weights)
    except ValueError as e:
        raise ValueError(f"traffic {text!r}: {e}") from None


def parse_shadow(text: str) -> tuple[int, float]:
    """A shadow version: "3" (every request copied) or "3:25" (a 25 % sample) -> (version, share in percent);
    ValueError naming the form."""
    v, sep, share = text.strip().partition(":")
    try:
        version, percent = int(v), float(share) if sep else 100.0
    except ValueError:
        raise ValueError(f"shadow {text!r}: expected VERSION or VERSION:SHARE (SHARE in percent, e.g. 3:25)") from None
    try:
        return check_version(version), check_share(percent)
    except ValueError as e:
        raise ValueError(f"shadow {text!r}: {e}") from None


@dataclass(frozen=True)
class VersionSource:
    """One version of a model on disk: the file to serve and which backend serves it.

    fingerprint: changes whenever the files of this version change (names, sizes, modification times), so that a
    repository poll can tell a version rewritten in place, or one that was still being copied, from one it has
    already seen."""

    name: str
    version: int
    path: Path
    backend: Literal["torch", "onnxruntime", "openvino", "tensorrt", "triton"]
    fingerprint: str = ""


@dataclass
class ModelEntry:
    """A model of the repository: its versions on disk, its policy and limits, or why it cannot be served."""

    name: str
    versions: dict[int, VersionSource] = field(default_factory=dict)
    policy: VersionPolicy | None = None  # None: the gateway's default policy
    config: ModelConfig = field(default_factory=ModelConfig)  # its config.toml over its config.pbtxt
    error: str | None = None  # the model as a whole is unusable (e.g. an unreadable config.pbtxt)
    broken: dict[int, str] = field(default_factory=dict)  # versions found but unusable, with the reason
    # A model only Triton serves (Python backend, ensemble, an engine without its manifest) or served with
    # another (an explain graph): listed, `error` saying why and what to serve instead, never loaded, and no
    # candidate for the default model.
    skipped: SkipKind | None = None
    meta: TritonMeta | None = None  # its config.pbtxt's "vit_serve" parameter, when it has one
    traffic: dict[int, float] | None = None  # its config.pbtxt's "traffic" parameter (`parse_weights`)
    shadow: tuple[int, float] | None = None  # its config.pbtxt's "shadow" parameter (`parse_shadow`)


def select_versions(entry: ModelEntry, default: VersionPolicy, refused: Collection[int] = ()) -> list[int]:
    """The versions of `entry` to serve, ascending: its own version policy's (its config.pbtxt), else `default`'s,
    among the versions on disk but `refused` (a refused version leaves the policy to choose among the others);
    none for a model that cannot be served (`entry.error`). The one version policy of the gateway's repository
    and of the Ray Serve application."""
    if entry.error is not None:
        return []
    return (entry.policy or default).select([v for v in entry.versions if v not in refused])


@dataclass(frozen=True)
class TritonConfig:
    """What the gateway reads of a Triton config.pbtxt."""

    policy: VersionPolicy | None = None
    config: ModelConfig = field(default_factory=ModelConfig)  # max_batch_size, dynamic_batching, instance_group
    platform: str = ""
    backend: str = ""
    meta: TritonMeta | None = None  # the "vit_serve" parameter of a vit-export model
    traffic: dict[int, float] | None = None  # the "traffic" parameter: weights by version
    shadow: tuple[int, float] | None = None  # the "shadow" parameter: (version, share in percent)


def backend_for(path: Path) -> Literal["torch", "onnxruntime", "openvino", "tensorrt"] | None:
    """Which backend serves this file (None: not a model file). An OpenVINO IR `NAME.xml` is a model of its own
    (openvino) unless `NAME.onnx` is beside it, whose companion it is (`--backend openvino` serves it then); its
    weights `NAME.bin` are no checkpoint."""
    suffix = path.suffix.lower()
    if suffix == ".onnx":  # the explain graph and the text tower are companions of NAME.onnx, not models
        return None if path.stem.endswith((EXPLAIN_SUFFIX, TEXT_SUFFIX)) else "onnxruntime"
    if suffix == ".xml":
        companion = path.stem.endswith((EXPLAIN_SUFFIX, TEXT_SUFFIX)) or path.with_suffix(".onnx").is_file()
        return None if companion or not find_manifest(path).is_file() else "openvino"
    if suffix == ".bin" and path.with_suffix(".xml").is_file():
        return None
    if suffix in ENGINE_SUFFIXES:
        return "tensorrt"
    if suffix in CHECKPOINT_SUFFIXES:
        return "torch"
    return None


def fingerprint(paths: list[Path]) -> str:
    """A digest of the files' names, sizes and modification times (not their bytes: a poll must stay cheap)."""
    h = hashlib.sha256()
    for p in sorted(paths):
        try:
            st = p.stat()
        except OSError:
            continue
        h.update(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:16]


def _visible(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    except OSError:
        return []


def read_triton_config(path: Path) -> TritonConfig:
    """`version_policy`, `max_batch_size`, `dynamic_batching`, platform, backend and the "vit_serve" parameter
    of a Triton config.pbtxt (Triton's schema); ValueError naming the file when it is unreadable."""
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        log.warning("%s: tritonclient is not installed, so its version policy and limits are not read (pip "
                    "install 'vit-serve[triton]'); the gateway's defaults apply", path)
        return TritonConfig()
    try:
        config = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    except (OSError, UnicodeDecodeError, text_format.ParseError) as e:
        raise ValueError(f"{path}: not a readable Triton model configuration ({' '.join(str(e).split())})") from e
    policy = None
    if config.HasField("version_policy"):
        choice = config.version_policy.WhichOneof("policy_choice")
        if choice == "latest":
            policy = VersionPolicy("latest", max(1, config.version_policy.latest.num_versions))
        elif choice == "all":
            policy = VersionPolicy("all")
        elif choice == "specific":
            policy = VersionPolicy("specific", versions=tuple(sorted(config.version_policy.specific.versions)))
    # instance_group: the instances a local backend runs at once (Triton's count, a group without one has 1)
    instances = sum(g.count or 1 for g in config.instance_group) or None
    limits = ModelConfig(max_batch=config.max_batch_size or None, instances=instances)
    if config.HasField("dynamic_batching"):
        db = config.dynamic_batching
        limits = ModelConfig(max_batch=limits.max_batch, max_delay_ms=db.max_queue_delay_microseconds / 1e3,
                             max_queue=db.default_queue_policy.max_queue_size or None, instances=instances)
    if config.backend == "openvino":  # Triton's OpenVINO backend: the gateway runs the model on OpenVINO too
        limits = dataclasses.replace(limits, runtime="openvino")
    meta = None
    if "vit_serve" in config.parameters:
        as_json: dict[str, Any] = {"parameters": {"vit_serve": {
            "string_value": config.parameters["vit_serve"].string_value}}}
        meta = TritonMeta.from_config(as_json, config.name or path.parent.name)
    try:
        traffic = parse_weights(config.parameters["traffic"].string_value) if "traffic" in config.parameters \
            else None
        shadow = parse_shadow(config.parameters["shadow"].string_value) if "shadow" in config.parameters else None
    except ValueError as e:
        raise ValueError(f"{path}: parameter {e}") from None
    return TritonConfig(policy, limits, config.platform, config.backend, meta, traffic, shadow)


def _skip_kind(folder: Path, config: TritonConfig) -> SkipKind | None:
    """Why the gateway leaves this Triton model to Triton: "python", "ensemble", "explain", "engine" or None."""
    if config.platform == "ensemble":
        return "ensemble"
    if config.backend == "python" or any((v / "model.py").is_file() for v in _visible(folder) if v.is_dir()):
        return "python"
    if config.meta is not None and config.meta.kind == "explain":
        return "explain"
    if config.platform == "tensorrt_plan" and not any(
            find_manifest(f).is_file() for v in _visible(folder) if v.is_dir() for f in _visible(v)
            if backend_for(f) == "tensorrt"):
        return "engine"
    return None


def _skip_reason(kind: SkipKind, meta: TritonMeta | None, onnx: str | None) -> str:
    """The index's reason for a skipped model; `onnx`: its export's ONNX logits model here, if any."""
    sibling = f", or its ONNX sibling {onnx} here" if onnx else ""
    if kind == "explain":
        logits = (meta.logits_model if meta else None) or onnx or "its logits model"
        return (f"the explain graph of {logits}: served with it here (POST /explain?model={logits}, or "
                f"/classify?explain=true), not as a model of its own")
    if kind == "ensemble":
        steps = f" ({meta.preprocess_model} -> {meta.classifier})" if meta and meta.classifier else ""
        return f"a Triton ensemble{steps}: serve it with tritonserver{sibling} (the gateway decodes images itself)"
    if kind == "engine":
        return (f"a TensorRT engine without its manifest beside it (vit-export keeps it in OUT/NAME_tensorrt/, "
                f"where `vit-serve serve` takes the engine): serve it with tritonserver{sibling}")
    if meta is not None and meta.kind == "preprocess":
        return (f"a Triton Python-backend model (the ensemble's image decoding): serve it with tritonserver"
                f"{sibling} (the gateway decodes images itself)")
    return f"a Triton Python-backend model: serve it with tritonserver{sibling}"


def triton_explain_of(path: Path) -> Path | None:
    """The explain graph of `REPO/MODEL/VERSION/FILE` in a `vit-export --format triton` repository:
    `REPO/EXPLAIN/VERSION/model.onnx`, EXPLAIN being named by MODEL's config.pbtxt; None when there is none."""
    vdir = path.parent
    config = vdir.parent / TRITON_CONFIG
    if not (vdir.name.isdigit() and config.is_file()):
        return None
    try:
        meta = read_triton_config(config).meta
    except ValueError:
        return None
    if meta is None or meta.explain_model is None:
        return None
    candidate = vdir.parent.parent / meta.explain_model / vdir.name / TRITON_ONNX
    return candidate if candidate.is_file() else None


def _version_source(name: str, version: int, folder: Path) -> VersionSource:
    files = _visible(folder)
    servable = [p for p in files if p.is_file() and backend_for(p)]
    if not servable:
        raise ValueError(f"{folder} holds no model vit-serve serves (NAME.onnx with its NAME.json, a TensorRT "
                         f"engine, or a checkpoint)")
    if len(servable) > 1:
        raise ValueError(f"{folder} holds {len(servable)} models ({', '.join(p.name for p in servable)}); a version "
                         f"folder holds one")
    path = servable[0]
    backend = backend_for(path)
    assert backend is not None
    return VersionSource(name, version, path, backend, fingerprint(files))


def _triton_style(folder: Path) -> ModelEntry | None:
    """`NAME/VERSION/...`: the entry, or None when `folder` has no numbered version folder (not a model)."""
    numbered = [p for p in _visible(folder) if p.is_dir() and p.name.isdigit() and int(p.name) >= 1]
    if not numbered:
        return None
    entry = ModelEntry(folder.name)
    config = TritonConfig()
    if (folder / TRITON_CONFIG).is_file():
        try:
            config = read_triton_config(folder / TRITON_CONFIG)
        except ValueError as e:
            entry.error = str(e)
            return entry
    own = ModelConfig()
    if (folder / MODEL_CONFIG).is_file():
        try:
            own = read_model_config(folder / MODEL_CONFIG)
        except ValueError as e:
            entry.error = str(e)
            return entry
    entry.policy, entry.config, entry.meta = config.policy, own.merged_over(config.config), config.meta
    if own.version_policy is not None:
        try:
            entry.policy = VersionPolicy.parse(own.version_policy)
        except ValueError as e:
            entry.error = f"{folder / MODEL_CONFIG}: version_policy: {e}"
            return entry
    entry.traffic, entry.shadow = config.traffic, config.shadow
    skip = _skip_kind(folder, config)
    if skip is not None:
        entry.skipped = skip  # its reason (`error`) is written once every model is known (`scan`)
        return entry
    for vdir in numbered:
        v = int(vdir.name)
        try:
            entry.versions[v] = _version_source(folder.name, v, vdir)
        except ValueError as e:
            entry.broken[v] = str(e)
    if not entry.versions and all("holds no model" in why for why in entry.broken.values()):
        return None  # not a model (no config said what it is)
    return entry


def _write_skip_reasons(entries: dict[str, ModelEntry]) -> None:
    """The reasons of the skipped models, naming their export's ONNX logits model when it is served here."""
    onnx = {e.meta.name: n for n, e in sorted(entries.items(), reverse=True) if e.meta is not None
            and not e.skipped and e.meta.kind == "logits" and e.meta.runtime == "onnxruntime"}
    for e in entries.values():
        if e.skipped is not None and e.error is None:
            e.error = _skip_reason(e.skipped, e.meta, onnx.get(e.meta.name) if e.meta else None)


def _one_file(name: str, path: Path, backend: Literal["torch", "onnxruntime", "openvino", "tensorrt"]
              ) -> ModelEntry:
    """Model `name`, version 1: the file, fingerprinted with its manifest, explain twin and text tower."""
    text = text_path_of(path)
    companions = [path, path.with_suffix(".json"), path.with_name(f"{path.stem}{EXPLAIN_SUFFIX}.onnx"), text,
                  text_manifest_path(text), path.with_suffix(".xml"), path.with_suffix(".bin")]
    return ModelEntry(name, {1: VersionSource(name, 1, path, backend, fingerprint(companions))})


def scan(path: str | os.PathLike[str], name: str | None = None) -> dict[str, ModelEntry]:
    """The repository at `path` (a model file or a folder), by model name; `name` renames a one-file repository.

    FileNotFoundError when `path` does not exist and is no hub id (`hf-hub:OWNER/NAME`, for the torch backend); a
    folder with no model in it is an empty repository.
    """
    from vit_serve.checkpoints.hub import missing_path, parse_hub_id  # lazy: the checkpoint readers are heavy

    root = Path(path)
    checkpoint_folder = root.is_dir() and (root / "config.json").is_file()  # transformers / timm hub layout
    if checkpoint_folder or (not root.exists() and parse_hub_id(str(path)) is not None):
        model = name or root.name  # a checkpoint folder, or a hub id (`hf-hub:timm/<name>`) for the torch backend
        return {model: ModelEntry(model, {1: VersionSource(model, 1, root, "torch", fingerprint([root]))})}
    if root.is_file():
        backend = backend_for(root)
        if backend is None:
            raise ValueError(f"{root.name} is not a model vit-serve serves (NAME.onnx, a TensorRT engine or a "
                             f"checkpoint: {', '.join(CHECKPOINT_SUFFIXES)})")
        model = name or root.stem
        return {model: _one_file(model, root, backend)}
    if not root.is_dir():
        raise FileNotFoundError(missing_path(str(path)))
    entries: dict[str, ModelEntry] = {}
    for child in _visible(root):
        if child.is_dir():
            entry = _triton_style(child)
            if entry is None:
                continue
        elif child.is_file() and (backend := backend_for(child)):
            entry = _one_file(child.stem, child, backend)
        else:
            continue
        if entry.name in entries:
            first = entries[entry.name]
            where = [str(s.path.relative_to(root)) for s in (*first.versions.values(), *entry.versions.values())]
            entries[entry.name] = ModelEntry(entry.name, error=f"{' and '.join(where) or entry.name} both claim the "
                                                               f"model name {entry.name!r}; rename one")
            continue
        entries[entry.name] = entry
    _write_skip_reasons(entries)
    return entries
