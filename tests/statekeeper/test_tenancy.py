import pytest

from statekeeper.cli import main
from statekeeper.tenancy import KeyStore


def test_keys_are_checked_against_their_digest_and_can_be_revoked(tmp_path):
    store = KeyStore(tmp_path / "keys.lmdb")
    record, key = store.create("acme")
    other, other_key = store.create("globex")
    assert store.tenant_of(key) == "acme" and store.tenant_of(other_key) == "globex"
    assert key not in (tmp_path / "keys.lmdb" / "data.mdb").read_bytes().decode("latin-1")  # only its digest
    forged = key[:-1] + ("A" if key[-1] != "A" else "B")  # the right id, a wrong secret
    assert store.tenant_of(forged) is None and store.tenant_of("") is None and store.tenant_of("sk-x.y") is None
    assert store.revoke(record.key_id) and not store.revoke("nokey123")
    assert store.tenant_of(key) is None and store.tenant_of(other_key) == "globex"
    assert {(r.key_id, r.tenant, r.revoked) for r in store.list()} == {
        (record.key_id, "acme", True), (other.key_id, "globex", False)}
    store.close()


@pytest.mark.parametrize("tenant", ["", "-starts-with-dash", "has space", "x" * 65])
def test_tenant_names_are_checked(tmp_path, tenant):
    store = KeyStore(tmp_path / "keys.lmdb")
    with pytest.raises(ValueError):
        store.create(tenant)
    store.close()


def test_the_keys_command_creates_lists_and_revokes(tmp_path, capsys):
    data_dir = str(tmp_path)
    main(["keys", "--data-dir", data_dir, "create", "--tenant", "acme"])
    key, details = capsys.readouterr().out.strip().split("\t")
    key_id = key[3:11]
    main(["keys", "--data-dir", data_dir, "list"])
    assert capsys.readouterr().out.split("\t")[:2] == [key_id, "acme"]
    main(["keys", "--data-dir", data_dir, "revoke", key_id])
    main(["keys", "--data-dir", data_dir, "list"])
    assert capsys.readouterr().out.strip().endswith("revoked")
    store = KeyStore(tmp_path / "keys.lmdb")
    assert store.tenant_of(key) is None
    store.close()
