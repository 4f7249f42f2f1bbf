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

from storage.base import Buffer, Tier, TierFull

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


class SsdTier(Tier):
    name = "ssd"

    def __init__(self, path: Path, budget_bytes: int):
        self._dir = path
        self._budget = budget_bytes
        self._lock = threading.Lock()
        path.mkdir(parents=True, exist_ok=True)
        for leftover in path.glob("*" + _TEMP):
            leftover.unlink(missing_ok=True)
        self._sizes = {_key_of(f.name): f.stat().st_size for f in path.glob("*" + _SUFFIX)}
        self._used = sum(self._sizes.values())

    def _path(self, key: str) -> Path:
        return self._dir / _file_name(key)

    def put(self, key: str, blob: Buffer) -> None:
        with self._lock:
            old = self._sizes.get(key, 0)
            if self._used - old + len(blob) > self._budget:
                raise TierFull(f"ssd: {len(blob)} bytes do not fit")
            self._used += len(blob) - old  # reserved before the write so concurrent puts see it
            self._sizes[key] = len(blob)
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
            with self._lock:
                self._used -= len(blob) - old
                if old:
                    self._sizes[key] = old
                else:
                    self._sizes.pop(key, None)
            raise

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

    def contains(self, key: str) -> bool:
        return key in self._sizes

    def delete(self, key: str) -> bool:
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is not None:
                self._used -= size
        try:
            self._path(key).unlink()
            return True
        except FileNotFoundError:
            return False

    def keys(self) -> dict[str, int]:
        return dict(self._sizes)

    def usage(self) -> int:
        return self._used

    def capacity(self) -> int:
        return self._budget
