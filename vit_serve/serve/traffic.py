"""How a model's requests are split between its versions (`TrafficPolicy`: weighted canaries, sticky sessions, a
shadow version), the copies that give the live comparison (`Mirror`), and each model's policy with its draws and
comparison (`TrafficSplits`, the repository's).

A policy comes from `--traffic NAME=1:90,2:10` / `--shadow NAME=3[:SHARE]`, else from the model's config.pbtxt
(`traffic` and `shadow` parameters), and is replaced as one object by `POST /v2/repository/models/NAME/traffic`
(`ModelRepository.set_traffic`). A request naming no version goes to a version of the split in service, drawn by
weight (the versions not in service are left out and the rest renormalised); with `X-Session-Id` the draw is a
stable hash of (model, session), so a session stays on one version while the versions in service do not change.
An explicit `?version=` always wins.

The primary is the version with the largest weight in service (ties: the newest); without weights, the newest
version in service. The others with a weight are canaries. Pairs for `compare`:

* shadow: a sampled share of the primary's answers is copied to the shadow version;
* canary: every canary answer is copied to the primary, so that canaries get pairs too.

A copy runs the same input and task (classify and embed; explanations are not copied) in the background at the
`admission.SHADOW` level, off the answer's path; its answer never reaches a client. It is dropped, and counted
(`vit_serve_shadow_dropped_total{model,version,reason}`), before it starts when either version's runner has
requests waiting (no headroom: "busy"), when `MAX_OUTSTANDING` copies are already running ("outstanding"), when the
two versions' preprocessing contracts differ ("contract"), and when the runner sheds it or it fails ("shed",
"error"); in a full queue the runner sheds shadow work first.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from prometheus_client import CollectorRegistry, Counter

from vit_serve.runtime.discovery import check_share, check_version, check_weights, parse_shadow, parse_weights
from vit_serve.runtime.metrics import MODEL
from vit_serve.runtime.scheduling import Result
from vit_serve.runtime.scheduling.errors import REFUSALS
from vit_serve.runtime.task import Task
from vit_serve.serve.admission import SHADOW, Admission
from vit_serve.serve.compare import Compare, Role
from vit_serve.serve.errors import GatewayTimeoutError, NotReadyError, QueueFullError
from vit_serve.serve.model_version import ModelVersion
from vit_serve.serve.schemas import ShadowSpec, TrafficSpec

log = logging.getLogger("vit_serve.serve")

MAX_OUTSTANDING = 8  # copies running at once per gateway: beyond, a copy is dropped ("outstanding")
MIRRORED = ("classify", "embed")  # the tasks copied (an explanation's rollout is not compared)


class Uniform(Protocol):
    def random(self) -> float: ...


def stable_draw(model: str, session: str) -> float:
    """A number in [0, 1) fixed by (model, session): the sticky draw of a session."""
    digest = hashlib.sha256(f"{model}\0{session}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


@dataclass(frozen=True)
class Shadow:
    version: int
    share: float = 100.0  # percent of the primary's answers copied


@dataclass(frozen=True)
class TrafficPolicy:
    """One model's split: weights by version (ascending; empty: the newest version in service) and a shadow."""

    model: str
    weights: tuple[tuple[int, float], ...] = ()
    shadow: Shadow | None = None

    @classmethod
    def of(cls, model: str, weights: Mapping[int, float] | None = None,
           shadow: tuple[int, float] | None = None) -> TrafficPolicy:
        """Checked (versions integers >= 1, weights >= 0 with a sum > 0, share in (0, 100]); ValueError."""
        checked = check_weights(dict(weights or {}))
        sh = None
        if shadow is not None:
            v, share = shadow
            sh = Shadow(check_version(v, "shadow version"), check_share(share))
        return cls(model, tuple(sorted(checked.items())), sh)

    @classmethod
    def parse(cls, model: str, traffic: str | None = None, shadow: str | None = None) -> TrafficPolicy:
        """From the flags' forms: "1:90,2:10" (or "2") and "3" / "3:25"; ValueError naming the form."""
        return cls.of(model, parse_weights(traffic) if traffic else None, parse_shadow(shadow) if shadow else None)

    @property
    def empty(self) -> bool:
        return not self.weights and self.shadow is None

    @property
    def versions(self) -> frozenset[int]:
        """Every version the policy names (weighted or shadow)."""
        return frozenset([v for v, _ in self.weights] + ([self.shadow.version] if self.shadow else []))

    def weight(self, version: int) -> float:
        return dict(self.weights).get(version, 0.0)

    def split(self, served: Collection[int]) -> list[tuple[int, float]]:
        """The weighted versions in service (weight > 0), ascending."""
        return [(v, w) for v, w in self.weights if w > 0 and v in served]

    def primary(self, served: Collection[int]) -> int | None:
        """The version with the largest weight in service (ties: the newest); none weighted: the newest."""
        split = self.split(served)
        if split:
            return max(split, key=lambda vw: (vw[1], vw[0]))[0]
        return max(served) if served else None

    def choose(self, served: Collection[int], session: str | None, rng: Uniform) -> int:
        """The version a request naming none goes to: drawn by weight among those in service (renormalised),
        by `stable_draw(model, session)` when it has a session, else by `rng`; none of them in service: the
        newest version in service. `served` must not be empty."""
        split = self.split(served)
        if not split:
            return max(served)
        u = stable_draw(self.model, session) if session else rng.random()
        total = sum(w for _, w in split)
        acc = 0.0
        for v, w in split:
            acc += w / total
            if u < acc:
                return v
        return split[-1][0]  # u within rounding of 1

    def to_spec(self, served: Collection[int] = ()) -> TrafficSpec:
        shadow = ShadowSpec(version=self.shadow.version, share=self.shadow.share) if self.shadow else None
        return TrafficSpec(traffic={str(v): w for v, w in self.weights}, shadow=shadow,
                           primary=self.primary(served) if served else None)

    @classmethod
    def from_spec(cls, model: str, spec: TrafficSpec) -> TrafficPolicy:
        """The API's body as a policy; ValueError saying what is wrong."""
        weights: dict[int, float] = {}
        for key, w in spec.traffic.items():
            try:
                v = int(key)
            except ValueError:
                raise ValueError(f"traffic: {key!r} is not a version (versions are integers)") from None
            weights[v] = w
        return cls.of(model, weights, (spec.shadow.version, spec.shadow.share) if spec.shadow else None)


@dataclass(frozen=True)
class Copy:
    """One copy to run: `source` answered, `target` runs the same input; `role` is the non-primary's."""

    source: ModelVersion
    target: ModelVersion
    role: Role  # "shadow": the target is the shadow; "canary": the source is the canary, the target the primary


@dataclass
class Mirror:
    """Schedules the copies of answers (`answered`, each version's `mirror` hook) and feeds the pairs to
    `compare`. `policy(name)` and `served(name)`: the model's current policy and versions in service."""

    policy: Callable[[str], TrafficPolicy | None]
    served: Callable[[str], Mapping[int, ModelVersion]]
    compare: Compare
    registry: CollectorRegistry
    rng: Uniform = field(default_factory=random.Random)
    max_outstanding: int = MAX_OUTSTANDING
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.dropped = Counter("vit_serve_shadow_dropped", "shadow and canary copies not run or not compared, by "
                               "the version that was to run them and why (busy: a runner had requests waiting; "
                               "outstanding: too many copies running; contract: other preprocessing; shed / "
                               "error: refused or failed there)", [*MODEL, "reason"], registry=self.registry)

    def attach(self, mv: ModelVersion) -> None:
        """Hand `mv`'s answers to this mirror (every loaded version: the policy decides at each answer)."""
        mv.mirror = lambda task, x, result, admission: self.answered(mv, task, x, result, admission)

    @property
    def outstanding(self) -> int:
        return len(self._tasks)

    def plan(self, mv: ModelVersion, task: Task) -> Copy | None:
        """The copy `mv`'s answer to `task` calls for under the current policy (None: none)."""
        policy = self.policy(mv.name)
        if policy is None or policy.empty or task.kind not in MIRRORED:
            return None
        served = self.served(mv.name)
        primary = policy.primary(served)
        if primary is None:
            return None
        if mv.version == primary:
            shadow = policy.shadow
            if shadow is None or shadow.version == primary or shadow.version not in served:
                return None
            if shadow.share < 100 and self.rng.random() * 100 >= shadow.share:
                return None
            return Copy(mv, served[shadow.version], "shadow")
        if policy.weight(mv.version) > 0 and primary in served:
            return Copy(mv, served[primary], "canary")
        return None

    def answered(self, mv: ModelVersion, task: Task, x: np.ndarray, result: Result,
                 admission: Admission | None) -> None:
        """`mv` answered `task` on x (a primary answer: ModelVersion.infer hands shadow answers to nobody):
        schedule its copy, or count why not (never blocks)."""
        copy = self.plan(mv, task)
        if copy is None:
            return
        reason = self._refusal(copy)
        if reason is not None:
            self._drop(copy, reason)
            return
        t = asyncio.get_running_loop().create_task(self._run(copy, task, x, result))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _refusal(self, copy: Copy) -> str | None:
        if copy.source.contract != copy.target.contract:
            return "contract"
        if copy.target.runner.depth > 0 or copy.source.runner.depth > 0:
            return "busy"
        if len(self._tasks) >= self.max_outstanding:
            return "outstanding"
        return None

    def _drop(self, copy: Copy, reason: str) -> None:
        self.dropped.labels(copy.target.name, str(copy.target.version), reason).inc()

    async def _run(self, copy: Copy, task: Task, x: np.ndarray, answer: Result) -> None:
        target = copy.target
        admission = Admission(priority=SHADOW, shadow=True, stage="queue", model=target.name,
                              version=str(target.version))
        t0 = time.perf_counter()
        try:
            other = await target.infer(task, x, admission=admission)
        except (QueueFullError, NotReadyError, GatewayTimeoutError, *REFUSALS):
            self._drop(copy, "shed")
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s: a %s copy failed", target.label, copy.role)
            self._drop(copy, "error")
            return
        log.debug("%s copy on %s took %.1f ms", copy.role, target.label, (time.perf_counter() - t0) * 1e3)
        if copy.role == "shadow":  # the source is the primary
            self.compare.add(copy.source.name, copy.source.version, target.version, "shadow", answer, other)
        else:  # the source is the canary, the copy ran on the primary
            self.compare.add(copy.source.name, target.version, copy.source.version, "canary", other, answer)

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


class TrafficSplits:
    """Each model's `TrafficPolicy` (from `--traffic` / `--shadow` over its config.pbtxt, or set through the
    repository API, which wins until the model is unloaded), the draws that route by it, and what compares the
    versions it names (`compare`, fed by `mirror`). `served(name)`: the model's versions in service."""

    def __init__(self, weights: Mapping[str, Mapping[int, float]], shadows: Mapping[str, tuple[int, float]],
                 served: Callable[[str], Mapping[int, ModelVersion]], registry: CollectorRegistry,
                 window: int = 1000) -> None:
        self._flags = (weights, shadows)
        self._policies: dict[str, TrafficPolicy] = {}  # replaced whole, never changed in place
        self._set: set[str] = set()  # models whose policy the repository API set
        self._rng = random.Random()
        self.compare = Compare(registry, window)
        self.mirror = Mirror(self._policies.get, served, self.compare, registry, self._rng)

    def get(self, name: str) -> TrafficPolicy | None:
        return self._policies.get(name)

    def versions(self, name: str) -> frozenset[int]:
        """The versions `name`'s policy names (they are loaded too)."""
        policy = self._policies.get(name)
        return frozenset() if policy is None else policy.versions

    def configure(self, name: str, weights: Mapping[int, float] | None, shadow: tuple[int, float] | None) -> None:
        """The model's policy from the flags over its config's `weights` and `shadow` (unless the API set one)."""
        if name in self._set:
            return
        flag_weights, flag_shadows = self._flags
        policy = TrafficPolicy.of(name, flag_weights.get(name, weights), flag_shadows.get(name, shadow))
        if policy.empty:  # both checked already (settings, discovery)
            self._policies.pop(name, None)
        else:
            self._policies[name] = policy

    def set(self, name: str, policy: TrafficPolicy) -> None:
        """The repository API's policy for `name`: it takes the next request, and the model's compare windows
        start again (its pairs are not mixed with the old policy's)."""
        self._policies[name] = policy
        self._set.add(name)
        self.compare.forget(name)

    def reset(self, name: str) -> None:
        """`name` is unloaded: loaded again, it starts from its flags and config."""
        self._set.discard(name)

    def choose(self, name: str, served: Mapping[int, ModelVersion], session: str | None) -> ModelVersion:
        """The version a request naming none goes to: its policy's draw (sticky per `session`), else the newest."""
        policy = self._policies.get(name)  # read once: a policy swapped meanwhile takes the next request
        if policy is not None and policy.weights:
            return served[policy.choose(served, session, self._rng)]
        return served[max(served)]
