"""Calibrated per-head budgets as the service reads them: one JSON file per model and scorer.

`statekeeper calibrate` (statekeeper/evaluation/calibration.py) measures and writes the profile; the
session service only loads it, so this module is plain Python (no torch, no evaluation harness)."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(slots=True)
class HeadProfile:
    """Calibrated per-head budgets for one model and scorer: for each global retention rho, each head's
    mean retention mu, spread sigma and budget B = min(1, mu + alpha sigma) (TANGRAM eq. 5)."""

    model: str
    scorer: str
    alpha: float
    samples: int
    budgets: dict[str, list[list[float]]]  # rho_key(rho) -> [L][H]
    means: dict[str, list[list[float]]]
    stds: dict[str, list[list[float]]]
    stability: dict[str, float]  # rho_key(rho) -> mean Spearman of each sample's head ranking with the mean's
    # HeteroCache's head taxonomy (compression/taxonomy.py HeadTaxonomy.to_dict): `calibrate --taxonomy`
    taxonomy: dict | None = None

    def check(self, num_layers: int, kv_heads: int) -> None:
        """Raises ValueError unless every per-head table is [num_layers][kv_heads] numbers (budgets, means and
        spreads within [0, 1]) and the taxonomy's heads are this model's: a profile of another shape (another
        model's, a file edited by hand) compressed the heads it lacked to their sinks and recent tokens, or
        failed every compression."""
        for name, tables in (("budgets", self.budgets), ("means", self.means), ("stds", self.stds)):
            for rho, table in tables.items():
                _check_table(f"{name}[{rho}]", table, (num_layers, kv_heads), unit=True)
        if self.taxonomy is not None:
            _check_taxonomy(self.taxonomy, num_layers, kv_heads)

    def budget_for(self, keep: float) -> list[list[float]] | None:
        return self.budgets.get(rho_key(keep))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "HeadProfile":
        return cls(**json.loads(text))


def _check_table(name: str, table, shape: tuple[int, ...], unit: bool = False, kind=(int, float)) -> None:
    """`table`: nested lists of `shape` whose items are of `kind` (numbers within [0, 1] where `unit`)."""
    if not shape:
        if type(table) not in (kind if isinstance(kind, tuple) else (kind,)) or (
                unit and not 0.0 <= table <= 1.0):
            raise ValueError(f"head profile: {name} holds {table!r}")
        return
    if not isinstance(table, list) or len(table) != shape[0]:
        raise ValueError(f"head profile: {name} is not {shape[0]} long (the model's layers then KV heads)")
    for index, item in enumerate(table):
        _check_table(f"{name}[{index}]", item, shape[1:], unit, kind)


def _check_taxonomy(taxonomy: dict, num_layers: int, kv_heads: int) -> None:
    try:
        _check_table("taxonomy.roles", taxonomy["roles"], (num_layers, kv_heads), kind=str)
        _check_table("taxonomy.live_budgets", taxonomy["live_budgets"], (num_layers, kv_heads), unit=True)
        _check_table("taxonomy.stability", taxonomy["stability"], (num_layers, kv_heads), unit=True)
        _check_table("taxonomy.pair_overlap", taxonomy["pair_overlap"], (num_layers, kv_heads, kv_heads), unit=True)
        for cluster in taxonomy["clusters"]:
            heads = [cluster["pivot"], *cluster["satellites"]]
            if not (0 <= cluster["layer"] < num_layers and all(type(h) is int and 0 <= h < kv_heads for h in heads)):
                raise ValueError(f"head profile: the taxonomy's cluster {cluster} is not of this model's heads")
    except (KeyError, TypeError) as exc:
        raise ValueError(f"head profile: a malformed taxonomy ({exc!r})") from None


def rho_key(rho: float) -> str:
    """How a retention rho is written as a key of the profile's dicts (0.5 -> "0.5")."""
    return f"{rho:g}"


def profile_path(directory: Path, model: str, scorer: str) -> Path:
    return directory / f"heads-{model}-{scorer}.json"


def load_profile(directory: Path, model: str, scorer: str, shape: tuple[int, int]) -> HeadProfile | None:
    """The profile for this model and scorer, or None when there is none (or it is unreadable, was written
    for another model or scorer, or its tables are not of `shape`: the model's layers and KV heads)."""
    path = profile_path(directory, model, scorer)
    try:
        profile = HeadProfile.from_json(path.read_text())
        if profile.model == model and profile.scorer == scorer:
            profile.check(*shape)
    except (OSError, ValueError, TypeError) as exc:
        if path.exists():
            log.warning("ignoring unreadable head profile %s: %s", path, exc)
        return None
    return profile if profile.model == model and profile.scorer == scorer else None
