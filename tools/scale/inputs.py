"""Projection inputs from a JSON file: platform figures, phase times per model, custom cases.

Format (every key optional except where noted)::

    {"platform": {"d2h_gbps": 25.0, ...},          # fields of projection.Platform
     "phases": {"7B": {"forward": 1.7, "backward": 3.4, "update": 0.2}, ...},
     "cases": [{"name": "my-node", "bytes_per_rank_gb": [10.5, 10.5], "mp_ranks": 2,
                "phases": {"forward": 1, "backward": 2, "update": 0.1}}],
     "sources": {"d2h_gbps": "where the figure comes from", ...}}
"""
from __future__ import annotations

import dataclasses
import json

from tools.errors import ToolInputError
from tools.scale.projection import Phases, Platform


@dataclasses.dataclass(frozen=True)
class CustomCase:
    """A user-measured configuration (no paper model behind it)."""

    name: str
    bytes_per_rank_gb: tuple[float, ...]
    mp_ranks: int
    phases: Phases


@dataclasses.dataclass(frozen=True)
class ProjectionInputs:
    platform: Platform
    phases: dict
    cases: tuple[CustomCase, ...]
    sources: dict


def _phases(obj, path: str, where: str) -> Phases:
    try:
        return Phases(**{k: float(obj[k]) for k in ("forward", "backward", "update")})
    except (KeyError, TypeError, ValueError) as error:
        raise ToolInputError(f"{where}: expected {{'forward': s, 'backward': s, 'update': s}}, "
                             f"found {obj!r} ({error})", path=path) from None


def load_inputs(path: str) -> ProjectionInputs:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ToolInputError("inputs file not found", path=path) from None
    except json.JSONDecodeError as error:
        raise ToolInputError(f"invalid JSON: {error.msg}", path=path, line=error.lineno) from None
    known = {f.name for f in dataclasses.fields(Platform)}
    platform_obj = data.get("platform", {})
    unknown = sorted(set(platform_obj) - known)
    if unknown:
        raise ToolInputError(f"unknown platform fields {unknown}; expected some of {sorted(known)}", path=path)
    platform = Platform(**platform_obj)
    phases = {name: _phases(obj, path, f"phases[{name!r}]") for name, obj in data.get("phases", {}).items()}
    cases = []
    for i, obj in enumerate(data.get("cases", [])):
        try:
            cases.append(CustomCase(str(obj["name"]), tuple(float(b) for b in obj["bytes_per_rank_gb"]),
                                    int(obj.get("mp_ranks", len(obj["bytes_per_rank_gb"]))),
                                    _phases(obj["phases"], path, f"cases[{i}].phases")))
        except (KeyError, TypeError, ValueError) as error:
            raise ToolInputError(f"cases[{i}]: needs name, bytes_per_rank_gb (list), phases; {error}",
                                 path=path) from None
    return ProjectionInputs(platform, phases, tuple(cases), data.get("sources", {}))
