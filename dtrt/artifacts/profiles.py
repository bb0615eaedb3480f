"""Optimization profiles as an engine manifest records them, and how a call's shapes pick one (the TensorRT
backend reads them; dtrt.engines.profiles makes them)."""

from dataclasses import dataclass

Range = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class Profile:
    name: str
    shapes: dict[str, Range]  # input -> (min, opt, max)

    def holds(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        return all(
            all(lo <= s <= hi for s, lo, hi in zip(shape, self.shapes[n][0], self.shapes[n][2]))
            and len(shape) == len(self.shapes[n][0])
            for n, shape in shapes.items()
        )

    def to_json(self) -> dict:
        return {"name": self.name, "shapes": {n: [list(r) for r in rng] for n, rng in self.shapes.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "Profile":
        return cls(d["name"], {n: tuple(tuple(r) for r in rng) for n, rng in d["shapes"].items()})


def select_profile(profiles: list[Profile], shapes: dict[str, tuple[int, ...]]) -> int:
    """Index of the first profile that holds `shapes`; ValueError naming the input that fits none."""
    for i, p in enumerate(profiles):
        if p.holds(shapes):
            return i
    bad = next(n for n, s in shapes.items() if not any(p.holds({n: s}) for p in profiles))
    ranges = " or ".join(f"{list(p.shapes[bad][0])}..{list(p.shapes[bad][2])}" for p in profiles)
    raise ValueError(f"input {bad} of shape {list(shapes[bad])} is outside the engine's profiles ({ranges})")


def max_shape(dims: list, profiles: list[Profile], inputs: dict[str, dict]) -> tuple[int, ...] | None:
    """The largest shape an output with `dims` takes over `profiles` (None when a dim is not an input's)."""
    largest: dict[str, int] = {}
    for p in profiles:
        for name, meta in inputs.items():
            for d, hi in zip(meta["dims"], p.shapes[name][2]):
                if isinstance(d, str):
                    largest[d] = max(largest.get(d, 0), hi)
    if any(isinstance(d, str) and d not in largest for d in dims):
        return None
    return tuple(d if isinstance(d, int) else largest[d] for d in dims)
