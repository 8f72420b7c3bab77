"""How every bench judges: against a target fixed before measuring, on the
median of at least three alternated rounds.

A bench declares its ``Target`` list at the top of its module (name, bound,
direction, and the settings under which the target holds), measures one
figure per target per round, and prints ``verdicts(...)``: per target the
median of its rounds against the bound, ``met`` or ``MISS``, with the best
round beside it for information only. Fewer than ``MIN_ROUNDS`` rounds, or
settings other than the target's, print ``not judged`` with the reason,
never a verdict.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

MIN_ROUNDS = 3


@dataclass(frozen=True)
class Target:
    name: str
    bound: float
    at_most: bool  # True: the figure must be <= bound; False: >= bound
    unit: str = ""
    fmt: str = ".3f"
    # The settings (the bench's arguments) the target is fixed for: a run
    # with other values is not judged against it.
    conditions: dict[str, object] = field(default_factory=dict)

    def met(self, value: float) -> bool:
        return value <= self.bound if self.at_most else value >= self.bound

    def best(self, values: list[float]) -> float:
        return min(values) if self.at_most else max(values)

    def show(self, value: float) -> str:
        return f"{value:{self.fmt}}{self.unit}"


def verdicts(
    targets: list[Target], rounds: dict[str, list[float]], settings: dict[str, object]
) -> list[str]:
    """One line per target: the median of its rounds, the verdict, the best round."""
    lines = []
    width = max(len(target.name) for target in targets)
    for target in targets:
        values = rounds.get(target.name, [])
        bound = f"{'<=' if target.at_most else '>='} {target.show(target.bound)}"
        if not values:
            lines.append(f"{target.name:<{width}}  no rounds                     target {bound}")
            continue
        median = statistics.median(values)
        differs = {
            name: settings.get(name)
            for name, wanted in target.conditions.items()
            if settings.get(name) != wanted
        }
        if len(values) < MIN_ROUNDS:
            verdict = f"not judged: {len(values)} rounds (at least {MIN_ROUNDS})"
        elif differs:
            fixed = ", ".join(f"{name} {target.conditions[name]}" for name in differs)
            verdict = f"not judged: the target is fixed for {fixed}"
        else:
            verdict = "met" if target.met(median) else "MISS"
        lines.append(
            f"{target.name:<{width}}  median {target.show(median):>10}  target {bound:<12}"
            f"  {verdict}   (best round {target.show(target.best(values))}, "
            f"{len(values)} rounds; for information)"
        )
    return lines
