"""Optimization profiles as an engine manifest records them, and how a call's shapes pick one (the TensorRT
backend reads them; dtrt.engines.profile_bounds makes them)."""

from dataclasses import dataclass, field

Range = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]

# inputs whose value, not their shape, sizes an output dim (the block's `rows`: its outputs' R). TensorRT takes such
# an input as a shape tensor: on the host, its values' range in each profile.
VALUE_DIMS = {"rows": "R"}


@dataclass(frozen=True)
class Profile:
    name: str
    shapes: dict[str, Range]  # input -> (min, opt, max)
    values: dict[str, Range] = field(default_factory=dict)  # a VALUE_DIMS input -> (min, opt, max) of its values

    def holds(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        return all(
            all(lo <= s <= hi for s, lo, hi in zip(shape, self.shapes[n][0], self.shapes[n][2]))
            and len(shape) == len(self.shapes[n][0])
            for n, shape in shapes.items()
        )

    def to_json(self) -> dict:
        out = {"name": self.name, "shapes": {n: [list(r) for r in rng] for n, rng in self.shapes.items()}}
        if self.values:
            out["values"] = {n: [list(r) for r in rng] for n, rng in self.values.items()}
        return out

    @classmethod
    def from_json(cls, d: dict) -> "Profile":
        def ranges(key):
            return {n: tuple(tuple(r) for r in rng) for n, rng in d.get(key, {}).items()}

        return cls(d["name"], ranges("shapes"), ranges("values"))


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
        for name, (_, _, hi) in p.values.items():
            largest[VALUE_DIMS[name]] = max(largest.get(VALUE_DIMS[name], 0), *hi)
    if any(isinstance(d, str) and d not in largest for d in dims):
        return None
    return tuple(d if isinstance(d, int) else largest[d] for d in dims)
