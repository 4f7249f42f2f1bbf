import pytest

from tests.utils.live_server import live_server
from tests.utils.openai_server import Server


@pytest.fixture
def servers(make_service, tmp_path):
    """A statekeeper server (DRAM, then LMDB) and a reference that keeps no state: its one tier has no
    room, so a state that leaves memory is gone and each of its turns recomputes from the history."""
    stateful = make_service(data_dir=tmp_path / "stateful")
    stateless = make_service(tiers=("dram",), tier_budget_bytes=1, data_dir=tmp_path / "stateless")
    with live_server(stateful) as url, live_server(stateless) as reference_url:
        yield Server(url), Server(reference_url)
