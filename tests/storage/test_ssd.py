import os

from storage.ssd import SsdTier


def test_blob_is_one_file_with_exactly_its_bytes(tmp_path):
    tier = SsdTier(tmp_path, 1 << 20)
    blob = os.urandom(5000)
    tier.put("session_A-1", blob)
    files = list(tmp_path.iterdir())
    assert [f.name for f in files] == ["session_A-1.kv"] and files[0].read_bytes() == blob


def test_leftover_temporary_files_are_removed_at_start(tmp_path):
    (tmp_path / "s1.kv.1234.tmp").write_bytes(b"torn write")
    (tmp_path / "s2.kv").write_bytes(b"complete")
    tier = SsdTier(tmp_path, 1 << 20)
    assert tier.keys() == {"s2": 8}
    assert sorted(f.name for f in tmp_path.iterdir()) == ["s2.kv"]


def test_failed_write_leaves_the_old_blob_and_accounting(tmp_path, monkeypatch):
    tier = SsdTier(tmp_path, 1 << 20)
    tier.put("k", b"old")

    def broken_fsync(fd):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    try:
        tier.put("k", b"new and longer")
    except OSError:
        pass
    monkeypatch.undo()
    assert tier.get("k") == b"old" and tier.usage() == 3
    assert sorted(f.name for f in tmp_path.iterdir()) == ["k.kv"]
