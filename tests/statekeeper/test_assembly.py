"""How the service is put together from its configuration (statekeeper/assembly.py): here, the secrets a data
directory keeps for itself when the configuration gives none."""

import stat

import pytest

from statekeeper.assembly import local_secret


def test_a_local_secret_is_made_once_and_kept_to_this_user(tmp_path):
    path = tmp_path / "index-secret"
    secret = local_secret(path)
    assert len(secret) == 32 and local_secret(path) == secret
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("held", [b"", b"short"])
def test_a_local_secret_file_left_empty_or_short_is_made_again(tmp_path, held):
    """A file created but never written (a crash or a power loss right after the first start; a second process
    that read it before the first had written) held no key: every later start took b"" as the key (the index
    unkeyed, each Redis blob sealed under a new random key), and never wrote it again."""
    path = tmp_path / "blob-secret"
    path.write_bytes(held)
    secret = local_secret(path)
    assert len(secret) == 32 and path.read_bytes() == secret and local_secret(path) == secret


def test_a_local_secret_is_made_on_a_filesystem_without_hard_links(tmp_path, monkeypatch):
    """SMB, vboxsf and some FUSE volumes refuse hard links: the secret is created in place there."""
    import errno
    import os

    def no_links(source, target):
        raise OSError(errno.EPERM, "hard links are not supported")

    monkeypatch.setattr(os, "link", no_links)
    path = tmp_path / "index-secret"
    secret = local_secret(path)
    assert len(secret) == 32 and path.read_bytes() == secret
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index-secret"]  # no draft left behind
