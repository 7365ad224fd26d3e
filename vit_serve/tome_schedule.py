"""Token merging's schedule (ToMe, Bolya et al., ICLR 2023): how many tokens each layer merges, as plain Python.

Settings, config files and the CLI check an r here without importing torch (`vit_serve.tome` holds the merging
itself and re-exports these).
"""

from __future__ import annotations

# r as it is asked for: an int (every layer), a list (one per layer) or (r, inflection) (`parse_r`).
TomeR = int | list[int] | tuple[int, float]


def parse_r(depth: int, r: TomeR) -> list[int]:
    """r per layer, as the reference's `parse_r`: an int (the same r in every layer), a list (one per layer,
    padded with 0), or (r, inflection) with inflection in [-1, 1]: -1 the paper's decreasing schedule."""
    if isinstance(r, list):
        if len(r) > depth:
            raise ValueError(f"token merging: {len(r)} values of r for a model of {depth} layers")
        if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in r):
            raise ValueError(f"token merging: r must be whole numbers >= 0, got {r}")
        return [*r, *[0] * (depth - len(r))]
    inflect = 0.0
    if isinstance(r, tuple):
        r, inflect = r
        if not -1.0 <= inflect <= 1.0:
            raise ValueError(f"token merging: the inflection must be in [-1, 1], got {inflect}")
    if not isinstance(r, int) or isinstance(r, bool) or r < 0:
        raise ValueError(f"token merging: r must be a whole number >= 0, got {r!r}")
    lo = int(r * (1.0 - inflect))
    step = (2 * r - 2 * lo) / max(depth - 1, 1)
    return [int(lo + step * i) for i in range(depth)]


def merged_count(tokens: int, r: int, protected: int) -> int:
    """How many tokens one merge removes from `tokens`: r, at most half of the unprotected ones (as the
    reference)."""
    return max(0, min(r, (tokens - protected) // 2))


def tokens_after(tokens: int, schedule: list[int], protected: int) -> list[int]:
    """The token count entering each layer and after the last: [T_0, T_1, ..., T_L]."""
    counts = [tokens]
    for r in schedule:
        counts.append(counts[-1] - merged_count(counts[-1], r, protected))
    return counts


def parse_tome(text: str) -> TomeR:
    """A command line's r: "13" (every layer), "13,13,8" (per layer, padded with 0) or "16:-1" (r and the
    schedule's inflection, `parse_r`). ValueError with the accepted forms."""
    s = text.strip()
    try:
        if ":" in s:
            r, inflect = s.split(":", 1)
            value: TomeR = (int(r), float(inflect))
        elif "," in s:
            value = [int(v) for v in s.split(",")]
        else:
            value = int(s)
    except ValueError:
        raise ValueError(f"token merging: bad r {text!r}; use e.g. 13 (every layer), 13,13,8 (per layer) or "
                         f"16:-1 (r and the schedule's inflection in [-1, 1])") from None
    parse_r(1 if not isinstance(value, list) else max(len(value), 1), value)  # the sign and range checks
    return value


def fewest_patches(schedule: list[int]) -> int:
    """The fewest patch tokens for which no layer's merge is capped at half the unprotected tokens: with at
    least this many, every layer merges exactly its r (so an exported graph's token counts are the schedule's
    at every resolution)."""
    need, merged = 0, 0
    for r in schedule:
        if r:
            need = max(need, merged + 2 * r)
        merged += r
    return need
