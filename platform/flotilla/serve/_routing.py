"""Which version answers a request: a weighted split, sticky per caller, plus shadow mirroring.

    split = TrafficSplit({"3": 90, "4": 10})
    split.pick("user-17")     # the same version for this caller on every replica, every time
    split.pick(None)          # weighted at random
"""

from __future__ import annotations

import bisect
import hashlib
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class TrafficSplit:
    weights: dict[str, float]  # version -> weight (> 0 for at least one)

    def __post_init__(self):
        live = {v: float(w) for v, w in self.weights.items() if w > 0}
        if not live:
            raise ValueError(f"a traffic split needs a version with a positive weight, got {self.weights}")
        object.__setattr__(self, "weights", live)
        total = sum(live.values())
        bounds, acc = [], 0.0
        for w in live.values():
            acc += w / total
            bounds.append(acc)
        bounds[-1] = 1.0
        object.__setattr__(self, "_versions", list(live))
        object.__setattr__(self, "_bounds", bounds)

    @property
    def versions(self) -> list[str]:
        return list(self._versions)

    def percents(self) -> dict[str, float]:
        total = sum(self.weights.values())
        return {v: round(100 * w / total, 3) for v, w in self.weights.items()}

    def pick(self, caller: str | None = None, rng: random.Random | None = None) -> str:
        """A version for this request: by a stable hash of `caller` when given, else at random."""
        u = sticky_point(caller) if caller else (rng or random).random()
        return self._versions[min(bisect.bisect_right(self._bounds, u), len(self._versions) - 1)]


def sticky_point(caller: str) -> float:
    """A point in [0, 1) that depends only on `caller` (not on the process, unlike `hash()`)."""
    digest = hashlib.blake2b(caller.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64
