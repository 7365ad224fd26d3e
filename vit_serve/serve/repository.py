"""The models a gateway serves: which versions are loaded, loading and unloading them, and polling REPO.

Model control, with Triton's names (`--model-control`):

* `none`: every model of REPO is loaded at start-up (its versions chosen by its version policy); nothing changes
  afterwards, and the repository API's load / unload are refused.
* `poll`: the same, and REPO is scanned again every `repository_poll_s`: a new version is loaded and warmed up
  while the old one keeps serving, then switched in at once (no request sees neither); a removed version stops
  taking requests, finishes those it has (waiting at most `unload_grace_s`; the rest are answered 503), and is
  closed; a version rewritten in place is loaded again and switched in the same way (its metrics series carry
  on, set by the new one); a broken new version is refused, with its reason in the index, and the old one keeps
  serving. Load / unload are refused (the folder is the truth).
* `explicit`: only the models named by `--load-model` (`*`: all) are loaded at start-up; the repository API's
  load (which re-reads the model's folder) and unload change the rest.

A model that fails to load never takes the gateway down: it is shown with its reason (`index()`, `GET /models`)
and the others serve on. Only a repository of one file fails the start-up (nothing else could be served).

Each version is built by the `VersionLoader` (`version_loader`: its own model thread and runner with its model's
limits, its decoder, text tower and monitor); its phase (loading, ready, draining...) is its own
(`version_state`). The index (`index()`) shows a loaded version by its phase, and the versions with none by what
the repository knows of them: being built, refused (with the reason), unloaded or outside the version policy.

Traffic between versions (`traffic`): each model's `TrafficPolicy` (`--traffic` / `--shadow` over its
config.pbtxt's, replaced as a whole by `set_traffic`, the repository API) routes the requests that name no
version, and the versions it names are loaded too (beside its version policy's, when they are on disk). Every
loaded version hands its answers to the mirror of the repository's `TrafficSplits`, which copies those the policy
says to the shadow or primary and compares the pairs (`compare`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from prometheus_client import CollectorRegistry

from vit_serve.runtime.discovery import ModelEntry, VersionPolicy, VersionSource, select_versions
from vit_serve.runtime.model_config import ModelConfig
from vit_serve.runtime.settings import RepositorySettings
from vit_serve.serve.errors import BadRequestError, NotFoundError, NotReadyError
from vit_serve.serve.model_version import ModelVersion
from vit_serve.serve.schemas import TrafficSpec
from vit_serve.serve.traffic import TrafficPolicy, TrafficSplits
from vit_serve.serve.version_loader import VersionLoader, VersionRefusedError
from vit_serve.serve.version_state import VersionState

log = logging.getLogger("vit_serve.serve")

class ModelRepository:
    """The loaded versions of REPO's models, by name and version, and the state of every version.

    loader: scans REPO and builds each version (`version_loader`); config: which models and versions are served,
    and how the set changes; registry: where the traffic comparison's metrics are (`compare`, `traffic`)."""

    def __init__(self, loader: VersionLoader, config: RepositorySettings, registry: CollectorRegistry) -> None:
        self.loader, self.config = loader, config
        self.policy = VersionPolicy.parse(config.version_policy)
        self.served: dict[str, dict[int, ModelVersion]] = {}  # what requests are routed to
        self.entries: dict[str, ModelEntry] = {}  # the last scan
        self._failed: dict[tuple[str, int], tuple[str, str]] = {}  # (name, version) -> (fingerprint, reason)
        self._loading: set[tuple[str, int]] = set()
        self._unloading: dict[tuple[str, int], ModelVersion] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._lock = asyncio.Lock()  # one load / unload / poll at a time (and a clean RSS delta per load)
        self._poller: asyncio.Task[None] | None = None
        self._wanted: set[str] = set()  # models to keep loaded (all, or explicit mode's)
        self._attempted: set[str] = set()  # models ever asked to load (the index shows the others by name only)
        # each model's split, its draws and the live comparison of the versions it names
        self.traffic = TrafficSplits(config.traffic_weights, config.shadows, lambda name: self.served.get(name, {}),
                                     registry, config.compare_window)

    # ---- start and stop --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Scan REPO and load what the model control mode says; a one-file repository that cannot be served
        raises (the server does not start)."""
        config, root = self.config, Path(self.loader.root)
        self.entries = await self.loader.first_scan()
        one_file = self.loader.one_model  # one model given: it must load
        if config.model_control == "explicit" and not one_file:
            names = set(self.entries) if "*" in config.load_models else set(config.load_models)
            unknown = sorted(names - set(self.entries))
            if unknown:
                log.warning("--load-model %s: not in %s", ", ".join(unknown), root)
            self._wanted = names & set(self.entries)
        else:
            self._wanted = set(self.entries)
        async with self._lock:
            for name in sorted(self._wanted):
                await self._sync(name, warm_first=False)  # nothing serves yet: warm up while serving
        if one_file:
            (name,) = self.entries
            if not self.served.get(name):
                raise RuntimeError(self.why_not(name))
        for flag, names in (("--traffic", config.traffic_weights), ("--shadow", config.shadows)):
            if unknown := sorted(set(names) - set(self.entries)):
                log.warning("%s %s: not in %s", flag, ", ".join(unknown), root)
        if config.default_model is not None and config.default_model not in self.entries:
            raise ValueError(f"--default-model {config.default_model!r} is not a model of {self.loader.root} (it "
                             f"has {', '.join(sorted(self.entries)) or 'none'})")
        if config.model_control == "poll" and not one_file:
            self._poller = asyncio.get_running_loop().create_task(self._poll(), name="vit-serve-repository-poll")

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await self.traffic.mirror.stop()
        for versions in self.served.values():
            for v in versions.values():
                await v.close()
        self.served.clear()
        for task in list(self._closing):
            task.cancel()

    # ---- polling and the repository API ------------------------------------------------------------------

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.config.repository_poll_s)
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bad scan must not end polling
                log.exception("repository poll")

    async def poll_once(self) -> None:
        """Scan REPO again and bring every model in line with it (new versions in, removed ones out)."""
        entries = await self.loader.scan()
        async with self._lock:
            self.entries = entries
            self._wanted = set(entries)
            for name in sorted(set(entries) | set(self.served)):
                await self._sync(name)

    def _check_explicit(self, what: str, name: str) -> None:
        mode = self.config.model_control
        if mode != "explicit":
            why = "polling is enabled" if mode == "poll" else "model control is none"
            raise BadRequestError(f"cannot {what} model {name!r}: {why} (serve with --model-control explicit to "
                                  f"load and unload models through this API)")

    async def load(self, name: str) -> None:
        """Load (or reload from its folder) the model `name`: explicit model control only. 400 when it fails."""
        self._check_explicit("load", name)
        entries = await self.loader.scan()
        async with self._lock:
            self.entries = entries
            if name not in entries:
                raise BadRequestError(f"failed to load {name!r}: no such model in {self.loader.root} (it has "
                                      f"{', '.join(sorted(entries)) or 'none'})")
            self._wanted.add(name)
            for known in list(self._failed):  # an explicit load tries again even if nothing changed
                if known[0] == name:
                    del self._failed[known]
            await self._sync(name)
            if not self.served.get(name):
                raise BadRequestError(f"failed to load {name!r}: {self.why_not(name)}")

    async def unload(self, name: str) -> None:
        """Stop serving `name` (requests already routed to it finish): explicit model control only."""
        self._check_explicit("unload", name)
        async with self._lock:
            if name not in self.entries and name not in self.served:
                raise BadRequestError(f"failed to unload {name!r}: no such model")
            self._wanted.discard(name)
            self.traffic.reset(name)  # a model loaded again starts from its flags and config
            await self._sync(name)

    # ---- bringing one model in line ---------------------------------------------------------------------

    async def _sync(self, name: str, warm_first: bool = True) -> None:
        """Load the versions `name`'s policy wants and are not loaded (or changed on disk), then retire the
        others; `warm_first`: a new version takes requests only once warmed up. Call with the lock held."""
        entry = self.entries.get(name)
        served = self.served.setdefault(name, {})
        wanted: list[int] = []
        if entry is not None and entry.error is None and name in self._wanted:
            self._attempted.add(name)
            self.traffic.configure(name, entry.traffic, entry.shadow)
            named = self.traffic.versions(name)
            # refused before and unchanged since: not tried again (a version rewritten in place is)
            excluded = {v for v, src in entry.versions.items()
                        if self._failed.get((name, v), ("", ""))[0] == src.fingerprint != ""}
            kept: set[int] = set()  # rewritten in place but refused: the loaded one serves on
            while True:  # a refused version leaves the policy to choose among the others (the old ones)
                wanted = sorted(set(select_versions(entry, self.policy, excluded))
                                | {v for v in named if v in entry.versions and v not in excluded})
                todo = [v for v in wanted if v not in kept and (
                    v not in served or served[v].fingerprint != entry.versions[v].fingerprint)]
                if not todo:
                    break
                for v in todo:
                    new = await self._load_version(entry.versions[v], warm_first)
                    if new is None:
                        (kept if v in served else excluded).add(v)
                        continue
                    self.traffic.mirror.attach(new)
                    current, served[v] = served.get(v), new  # switched in: requests are routed to it from here
                    new.metrics.publish()  # the gauges of (name, v) are the new one's, even if `current` had them
                    if current is not None:
                        self._retire(current)
        for v in [v for v in served if v not in wanted]:
            self._retire(served.pop(v))
            self.traffic.compare.forget(name, v)
        if not served:
            self.served.pop(name, None)
            self.traffic.compare.forget(name)

    def set_traffic(self, name: str, spec: TrafficSpec) -> TrafficPolicy:
        """Replace `name`'s policy (the repository API): every version it names must be in service. 400 saying
        what is wrong; the new policy takes the next request (one object swapped), and the compare windows of
        the model start again."""
        served = self.served.get(name)
        if not served:
            if name not in self.entries:
                raise self.unknown(name)
            raise BadRequestError(f"model {name!r} is not loaded: {self.why_not(name)}")
        try:
            policy = TrafficPolicy.from_spec(name, spec)
        except ValueError as e:
            raise BadRequestError(f"traffic for {name!r}: {e}") from None
        missing = sorted(policy.versions - set(served))
        if missing:
            raise BadRequestError(f"traffic for {name!r}: version {', '.join(map(str, missing))} is not in service "
                                  f"(it serves {', '.join(map(str, sorted(served)))}); load it first")
        self.traffic.set(name, policy)  # new compare windows: its pairs are not mixed with the old policy's
        log.info("traffic of %s: %s", name, policy)
        return policy

    def _retire(self, version: ModelVersion) -> None:
        """Stop routing to `version`; it closes in the background once its requests are done (or the unload
        grace is over)."""
        key = (version.name, version.version)
        self._unloading[key] = version
        log.info("unloading %s (%d requests in flight)", version.label, version.in_flight)

        async def close() -> None:
            try:
                await version.close(self.config.unload_grace_s)
            finally:
                if self._unloading.get(key) is version:
                    del self._unloading[key]

        task = asyncio.get_running_loop().create_task(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _load_version(self, source: VersionSource, warm_first: bool) -> ModelVersion | None:
        """Load, then warm up (`warm_first`; else in the background), one version (`VersionLoader.load`); None, with
        the reason recorded, when either fails."""
        key = (source.name, source.version)
        self._loading.add(key)
        entry = self.entries.get(source.name)
        config = ModelConfig() if entry is None else entry.config  # the model's own; None: the gateway's
        try:
            version = await self.loader.load(source, config, len(self._wanted), warm_first)
        except VersionRefusedError as e:
            self._failed[key] = (source.fingerprint, str(e))
            log.warning("%s version %d refused: %s", source.name, source.version, e)
            return None
        finally:
            self._loading.discard(key)
        self._failed.pop(key, None)
        return version

    # ---- what routes ask --------------------------------------------------------------------------------

    @property
    def default_name(self) -> str | None:
        """The model a request naming none gets: --default-model, else the only model of REPO (those it lists as
        skipped, Triton's own, aside)."""
        if self.config.default_model is not None:
            return self.config.default_model
        names = {n for n, e in self.entries.items() if not e.skipped} | set(self.served)
        return next(iter(names)) if len(names) == 1 else None

    def unknown(self, name: str) -> NotFoundError:
        """The 404 of a model the repository does not have, naming those it has."""
        return NotFoundError(f"unknown model {name!r}; this gateway serves "
                             f"{', '.join(repr(n) for n in self.names()) or 'no model'}")

    def names(self) -> list[str]:
        return sorted(set(self.entries) | set(self.served))

    def newest(self, name: str | None) -> ModelVersion | None:
        """The newest version of `name` in service (None: none, or no name)."""
        served = self.served.get(name) if name is not None else None
        return served[max(served)] if served else None

    def get(self, name: str | None = None, version: str | int | None = None,
            session: str | None = None) -> ModelVersion:
        """The version a request is routed to: `name` (None: the default model) at `version` (None: its traffic
        split's draw, sticky per `session` (X-Session-Id); without a split, its newest loaded version). 404 naming
        what exists; 503 while the model is loading or unloaded."""
        if name is None:
            name = self.default_name
            if name is None:
                raise BadRequestError(f"this gateway serves several models; name one with ?model= (one of "
                                      f"{', '.join(self.names()) or 'none loaded'}), or start it with "
                                      f"--default-model")
        served = self.served.get(name)
        if not served:
            if name not in self.entries:
                raise self.unknown(name)
            raise NotReadyError(f"model {name!r} is not loaded: {self.why_not(name)}", headers={"Retry-After": "1"})
        if version is None:
            return self.traffic.choose(name, served, session)  # its draw, else `newest` (with the 404 / 503 above)
        try:
            v = int(version)
        except (TypeError, ValueError):
            raise NotFoundError(f"model {name!r} has no version {version!r} (versions are integers)") from None
        if v not in served:
            raise NotFoundError(f"model {name!r} has no version {v} in service (it serves "
                                f"{', '.join(map(str, sorted(served)))})")
        return served[v]

    def why_not(self, name: str) -> str:
        entry = self.entries.get(name)
        if entry is None:
            return "it is not in the repository"
        if entry.error:
            return entry.error
        if name not in self._wanted:
            return "it is not loaded (POST /v2/repository/models/{name}/load)".replace("{name}", name)
        reasons = [f"version {v}: {why}" for (n, v), (_, why) in sorted(self._failed.items()) if n == name]
        reasons += [f"version {v}: {why}" for v, why in sorted(entry.broken.items())]
        if not entry.versions and not reasons:
            return "it has no version"
        if any(n == name for n, _ in self._loading):
            return "loading"
        return "; ".join(reasons) or "no version matches its version policy"

    def index(self) -> list[VersionState]:
        """Every model of REPO with the state of each version it has on disk or in service (Triton's index)."""
        rows: list[VersionState] = []
        for name in self.names():
            entry = self.entries.get(name)
            served = self.served.get(name, {})
            versions = set(entry.versions if entry else ()) | set(entry.broken if entry else ()) | set(served)
            versions |= {v for n, v in self._unloading if n == name}
            if entry is not None and entry.error:
                rows.append(VersionState(name, None, "UNAVAILABLE", entry.error))
                continue
            if not versions or name not in self._attempted:
                rows.append(VersionState(name, None, None))
                continue
            for v in sorted(versions):
                rows.append(self._state(name, v, entry, served))
        return rows

    def _state(self, name: str, v: int, entry: ModelEntry | None, served: dict[int, ModelVersion]) -> VersionState:
        if v in served:  # a loaded version: its own phase (`version_state`)
            return served[v].status.index_row(name, v)
        if (name, v) in self._loading:
            return VersionState(name, v, "LOADING")
        if (name, v) in self._unloading:
            return self._unloading[name, v].status.index_row(name, v)
        if (name, v) in self._failed:
            return VersionState(name, v, "UNAVAILABLE", self._failed[name, v][1])
        if entry is not None and v in entry.broken:
            return VersionState(name, v, "UNAVAILABLE", entry.broken[v])
        if name not in self._wanted:
            return VersionState(name, v, "UNAVAILABLE", "unloaded")
        return VersionState(name, v, "UNAVAILABLE", "not in the version policy")

    def loaded(self) -> list[ModelVersion]:
        return [v for versions in self.served.values() for v in versions.values()]
