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

    def budget_for(self, keep: float) -> list[list[float]] | None:
        return self.budgets.get(rho_key(keep))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "HeadProfile":
        return cls(**json.loads(text))


def rho_key(rho: float) -> str:
    """How a retention rho is written as a key of the profile's dicts (0.5 -> "0.5")."""
    return f"{rho:g}"


def profile_path(directory: Path, model: str, scorer: str) -> Path:
    return directory / f"heads-{model}-{scorer}.json"


def load_profile(directory: Path, model: str, scorer: str) -> HeadProfile | None:
    """The profile for this model and scorer, or None when there is none (or it is unreadable, or was
    written for another model or scorer)."""
    path = profile_path(directory, model, scorer)
    try:
        profile = HeadProfile.from_json(path.read_text())
    except (OSError, ValueError, TypeError) as exc:
        if path.exists():
            log.warning("ignoring unreadable head profile %s: %s", path, exc)
        return None
    return profile if profile.model == model and profile.scorer == scorer else None
