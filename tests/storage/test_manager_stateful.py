"""Random put / get / delete / promote / restart sequences against a plain dict model."""

import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from storage.dram import DramTier
from storage.index import LmdbTierIndex
from storage.lmdb_tier import LmdbTier
from storage.manager import TierManager
from storage.ssd import SsdTier

KEYS = st.sampled_from([f"s{i}" for i in range(8)])
BUDGETS = {"dram": 3_000, "lmdb": 4_000, "ssd": 5_000}


class TierManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="sk-stateful-"))
        self.model: dict[str, bytes] = {}  # what a reader may still get back
        self.manager = self._open()

    def _open(self) -> TierManager:
        return TierManager(
            [DramTier(BUDGETS["dram"]), LmdbTier(self.dir / "kv.lmdb", BUDGETS["lmdb"]),
             SsdTier(self.dir / "files", BUDGETS["ssd"])],
            LmdbTierIndex(self.dir / "index"),
        )

    @rule(key=KEYS, size=st.integers(1, 2_500), fill=st.integers(0, 255))
    def put(self, key, size, fill):
        blob = bytes([fill]) * size
        landed = self.manager.put(key, blob)
        if landed is None:
            self.model.pop(key, None)
        else:
            self.model[key] = blob

    @rule(key=KEYS)
    def get(self, key):
        with self.manager.read(key) as (tier, blob):
            got = None if blob is None else bytes(blob)
        if key in self.model:
            assert got == self.model[key] and tier is not None
        else:
            assert got is None

    @rule(key=KEYS)
    def delete(self, key):
        self.manager.delete(key)
        self.model.pop(key, None)

    @rule(key=KEYS)
    def promote(self, key):
        where = self.manager.promote(key)
        assert (where is None) == (key not in self.model)

    @rule(key=KEYS, tier=st.sampled_from(["lmdb", "ssd"]))
    def put_low(self, key, tier):
        blob = key.encode() * 100
        if self.manager.put(key, blob, tier=tier) is None:
            self.model.pop(key, None)
        else:
            self.model[key] = blob

    @rule()
    def restart(self):
        lost = {key for key in self.model if self.manager.locate(key) == "dram"}  # DRAM dies with the process
        self.manager.close()
        self.manager = self._open()
        for key in lost:
            self.model.pop(key)

    @invariant()
    def placement_matches_model_and_budgets_hold(self):
        # Evictions may drop keys from the manager, never add keys the model lacks.
        assert self.manager.keys() <= set(self.model)
        for key in set(self.model) - self.manager.keys():
            self.model.pop(key)  # evicted from the last tier: the model forgets it too
        for tier in self.manager.tiers:
            assert tier.usage() <= tier.capacity()
            assert sum(tier.keys().values()) == tier.usage()
        for key in self.model:
            assert self.manager.tiers[[t.name for t in self.manager.tiers].index(self.manager.locate(key))].contains(key)
        assert set(self.manager.index.load()) == self.manager.keys()

    def teardown(self):
        self.manager.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TierManagerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_tier_manager_matches_a_dict = TierManagerMachine.TestCase
