"""The disk tier: one file per block under a directory, within a byte budget, surviving restarts.

Layout: ROOT/<last two hex digits of the key>/<key hex> (256 fan-out directories, so no directory
grows past a few thousand entries). A write goes to a temporary file beside its target, then
os.replace: a reader sees the old entry, the new one or none, never a torn one; a crash leaves
a temporary file, reclaimed at the next start when its writer process is gone. No fsync: a file
torn by a power loss fails the codec's length or checksum check and is reclaimed as a miss.

The budget is kept with an LRU index in memory (key -> size, oldest first), rebuilt at start
from the files' mtimes; a hit sets its file's mtime so the order survives a restart. When the
disk itself is full (ENOSPC) the store stops writing, with one warning, and keeps serving reads.
One directory per server: two processes writing one directory would each keep their own budget.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

from trtprompt.engine.engine_dir import pid_alive
from trtprompt.engine.tiers.store import TierCounters

log = logging.getLogger(__name__)

TMP_MARK = ".tmp-"


class DiskStore:
    name = "disk"

    def __init__(self, root: str | Path, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"disk_cache_size must be a positive number of bytes, got {capacity_bytes!r}")
        self.root = Path(root).expanduser()
        self.capacity = capacity_bytes
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key hex -> file size, least recently used first
        self.used_bytes = 0
        self.writing = True  # False once the disk was full
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"disk_cache_path {self.root} cannot be created: {exc}") from exc
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise ValueError(f"disk_cache_path {self.root} is not a writable directory")
        self.reclaimed_temp_files = 0
        self._rebuild()

    # -- start ------------------------------------------------------------------

    def _rebuild(self) -> None:
        """Index the entries left by earlier runs (oldest mtime first); reclaim dead writers' temp files."""
        found: list[tuple[int, str, int]] = []
        for sub in self.root.iterdir():
            if not (sub.is_dir() and len(sub.name) == 2):
                continue
            for entry in os.scandir(sub):
                if TMP_MARK in entry.name:
                    self._reclaim_temp(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    found.append((st.st_mtime_ns, entry.name, st.st_size))
        for _mtime, name, size in sorted(found):
            self._index[name] = size
            self.used_bytes += size
        self._unlink(self._evict_over(self.capacity))  # the budget may have shrunk since
        log.info("disk tier %s: %d entries, %d bytes of %d", self.root, len(self._index), self.used_bytes,
                 self.capacity)

    def _reclaim_temp(self, path: Path) -> None:
        try:
            pid = int(path.name.rsplit(TMP_MARK, 1)[1].split("-", 1)[0])
        except (IndexError, ValueError):
            pid = 0
        if pid and pid != os.getpid() and pid_alive(pid):
            return  # another live process is writing it
        path.unlink(missing_ok=True)
        self.reclaimed_temp_files += 1

    # -- BlockStore ------------------------------------------------------------------

    def _path(self, name: str) -> Path:
        return self.root / name[-2:] / name

    def contains(self, key: bytes) -> bool:
        """Whether the index holds key (no I/O: the scheduler asks this before it plans a load)."""
        with self._lock:
            return key.hex() in self._index

    def get(self, key: bytes) -> bytes | None:
        name = key.hex()
        with self._lock:
            known = name in self._index
            if known:
                self._index.move_to_end(name)
        if not known:
            self.counters.add(misses=1)
            return None
        path = self._path(name)
        try:
            with path.open("rb") as f:
                data = f.read()
            os.utime(path)  # the LRU order survives a restart
        except OSError as exc:
            self._forget(name)
            self.counters.add(misses=1, errors=0 if isinstance(exc, FileNotFoundError) else 1)
            if not isinstance(exc, FileNotFoundError):
                log.warning("disk tier: cannot read %s: %s", path, exc)
            return None
        self.counters.add(hits=1, bytes_read=len(data))
        return data

    def put(self, key: bytes, value: bytes) -> bool:
        if not self.writing or len(value) > self.capacity:
            self.counters.add(drops=1)
            return False
        name = key.hex()
        path = self._path(name)
        tmp = path.with_name(f"{name}{TMP_MARK}{os.getpid()}-{threading.get_ident()}")
        try:
            self._write(path, tmp, value)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self._write_failed(exc)
            return False
        with self._lock:
            self.used_bytes += len(value) - self._index.pop(name, 0)
            self._index[name] = len(value)
            victims = self._evict_over(self.capacity)
        self._unlink(victims)
        self.counters.add(writes=1, bytes_written=len(value))
        return True

    @staticmethod
    def _write(path: Path, tmp: Path, value: bytes) -> None:
        path.parent.mkdir(exist_ok=True)
        with tmp.open("wb") as f:
            f.write(value)
        os.replace(tmp, path)

    def _write_failed(self, exc: OSError) -> None:
        self.counters.add(drops=1)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            if self.writing:
                log.warning("disk tier %s: the disk is full (%s); no more blocks are written to it, reads go on",
                            self.root, exc.strerror)
            self.writing = False
            return
        self.counters.add(errors=1)
        log.warning("disk tier: write failed: %s", exc)

    def _evict_over(self, limit: int) -> list[str]:
        """Pop least recently used entries until used_bytes <= limit (caller holds the lock, or is __init__)."""
        victims = []
        while self.used_bytes > limit and self._index:
            name, size = self._index.popitem(last=False)
            self.used_bytes -= size
            victims.append(name)
        self.counters.add(evictions=len(victims))
        return victims

    def _unlink(self, names: list[str]) -> None:
        for name in names:
            self._path(name).unlink(missing_ok=True)

    def _forget(self, name: str) -> None:
        with self._lock:
            self.used_bytes -= self._index.pop(name, 0)

    def delete(self, key: bytes) -> None:
        name = key.hex()
        self._forget(name)
        self._path(name).unlink(missing_ok=True)

    def probe(self) -> str | None:
        """None when the filesystem has room for the budget; else what to fix (logged once, at start)."""
        try:
            st = os.statvfs(self.root)
        except OSError as exc:
            problem = f"disk tier {self.root}: cannot read the filesystem's free space: {exc}"
        else:
            room = st.f_bavail * st.f_frsize + self.used_bytes  # our own entries count as room
            if room >= self.capacity:
                return None
            problem = (f"disk tier {self.root}: disk_cache_size is {self.capacity} bytes but the filesystem has "
                       f"{room} bytes for it; writes stop with one warning when the disk fills")
        log.warning("%s", problem)
        return problem

    def close(self) -> None:
        with self._lock:
            self.writing = False

    def __len__(self) -> int:
        return len(self._index)
