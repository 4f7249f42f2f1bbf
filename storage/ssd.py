"""SSD tier: one file per blob in a directory (which may sit on its own disk).

A write goes to a temporary file, is fsynced, renamed over the final name, and the directory is
fsynced, so a crash leaves either the old blob or the new one, never a torn file. Reads map the file
(zero-copy from the page cache). Leftover temporary files are removed at start-up."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from storage.tier import Buffer, SizedTier

_SUFFIX = ".kv"
_TEMP = ".tmp"


def _file_name(key: str) -> str:
    # Session ids are URL-safe base64; anything else is hex-encoded so a key can never escape the folder.
    if key and all(c.isalnum() or c in "-_" for c in key):
        return key + _SUFFIX
    return "x" + key.encode().hex() + _SUFFIX


def _key_of(file_name: str) -> str:
    stem = file_name[: -len(_SUFFIX)]
    if stem.startswith("x") and len(stem) % 2 == 1:
        try:
            return bytes.fromhex(stem[1:]).decode()
        except ValueError:
            pass
    return stem


class SsdTier(SizedTier):
    name = "ssd"
    streams_reads = True

    def __init__(self, path: Path, budget_bytes: int):
        self._dir = path
        path.mkdir(parents=True, exist_ok=True)
        for leftover in path.glob("*" + _TEMP):
            leftover.unlink(missing_ok=True)
        super().__init__(budget_bytes, {_key_of(f.name): f.stat().st_size for f in path.glob("*" + _SUFFIX)})

    def _path(self, key: str) -> Path:
        return self._dir / _file_name(key)

    def put(self, key: str, blob: Buffer) -> None:
        self._check_room(key, len(blob))
        final = self._path(key)
        temp = final.with_name(f"{final.name}.{threading.get_ident()}{_TEMP}")
        try:
            with open(temp, "wb") as fh:
                fh.write(blob)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(temp, final)
            self._fsync_dir()
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        self._record(key, len(blob))

    def _fsync_dir(self) -> None:
        fd = os.open(self._dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def get(self, key: str) -> Buffer | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    @contextmanager
    def read(self, key: str) -> Iterator[Buffer | None]:
        try:
            fh = open(self._path(key), "rb")
        except FileNotFoundError:
            yield None
            return
        with fh:
            if os.fstat(fh.fileno()).st_size == 0:
                yield b""
                return
            mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            view = memoryview(mapped)
            try:
                yield view
            finally:
                try:
                    view.release()
                    mapped.close()
                except BufferError:
                    pass  # a caller still holds a view into the map; it is unmapped when collected

    def delete(self, key: str) -> bool:
        self._forget(key)
        try:
            self._path(key).unlink()
            return True
        except FileNotFoundError:
            return False
