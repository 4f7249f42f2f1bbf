import pytest

from statekeeper.history import LmdbHistory


@pytest.fixture(params=["lmdb", "postgres"])
def open_store(request, tmp_path):
    """Opens history stores of one backend (the same contract runs against each): `place` names where the
    store keeps its data, so a second call with the same place reopens the first's."""
    opened, places = [], {}

    def open_(index_key: bytes = b"", place: str = "main"):
        if request.param == "lmdb":
            store = LmdbHistory(tmp_path / f"{place}.lmdb", index_key=index_key)
        else:
            from statekeeper.history.postgres import PostgresHistory

            if place not in places:
                places[place] = request.getfixturevalue("postgres_server").create_database()
            store = PostgresHistory(places[place], index_key=index_key, pool_size=4)
        opened.append(store)
        return store

    yield open_
    for store in opened:
        try:
            store.close()
        except Exception:  # noqa: S110 - closed by the test already (LMDB refuses a second close)
            pass
