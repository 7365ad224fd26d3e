"""The options of attention rollout, defined once: how heads are fused and what share of the weakest weights is
discarded, their defaults, and their check.

No math here (that is `vit_serve.explain`): the export manifest, the CLIs and the gateway name these options
without depending on torch or on the rollout itself.
"""

from __future__ import annotations

HEAD_FUSIONS = ("mean", "max", "min")
# The rollout settings used when none are asked for: vit-explain's defaults (mean fusion, drop the weakest 90%).
# Every default in the project (exports, the gateway, the CLIs, the manifest) is these two names.
DEFAULT_HEAD_FUSION = "mean"
DEFAULT_DISCARD_RATIO = 0.9


def check_rollout_options(head_fusion: str, discard_ratio: float) -> None:
    """ValueError naming the option when `head_fusion` is not one of HEAD_FUSIONS or `discard_ratio` is outside
    [0, 1)."""
    if head_fusion not in HEAD_FUSIONS:
        raise ValueError(f"unknown head_fusion {head_fusion!r}; expected one of {', '.join(HEAD_FUSIONS)}")
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(f"discard_ratio must be in [0, 1), got {discard_ratio}")
