"""The persistent tier (L3) of the prefix cache: content-addressed KV pages in files on disk.

Several processes (replicas) may point at one directory, and the files outlive them, so a
restarted server finds the pages of earlier runs. A key is an opaque hex digest computed by the
caller from the tokens and the model identity; the store only checks its spelling.

    DIR/ab/ab12...ef.kv                     one page per file, fanned out by the key's first byte
    DIR/ab/.ab12...ef.<pid>.<rand>.tmp      a write in progress (renamed into place when done)

    file = b"MCIKV1\\0\\0" | u32 little-endian n | n bytes of UTF-8 JSON | payload
           JSON: identity, dtype, shape, nbytes (payload length), sha256 (of the payload)

Invariants:
* a page `get` returns always matched its header's checksum, the store's identity and the
  asked dtype and shape; a block that fails a check is deleted and never served (one with
  another identity belongs to another model sharing the directory: a miss, kept).
* a block appears under its name atomically (fsync'd temp file, then `os.replace`), so a
  reader in any process sees a whole block or none.
* after every `put` and `scan`, `used_bytes <= max_bytes`: least recently used files are
  deleted (a `get` that learns another replica's block may overshoot until the next put;
  deleting stays off the engine thread). The index is per process: blocks other replicas
  write are learned when read or at `scan`, so with several writers the directory can exceed
  the bound by their unseen writes, and recency is per process too (`get` refreshes the
  file's mtime so every `scan` sees it).
* a disk failure while writing (full disk, I/O error, the directory gone) disables the tier
  for the life of the store, with one warning; serving goes on without it. put/get/contains
  never raise for disk problems (a malformed key is a ValueError: a caller bug).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
import stat
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

log = logging.getLogger("mci")

MAGIC = b"MCIKV1\0\0"
_LENGTH = struct.Struct("<I")  # the JSON header's length, after the magic
_PREFIX = len(MAGIC) + _LENGTH.size
_MAX_HEADER = 1 << 16  # a longer header is garbage, not a block
_KEY = re.compile(r"[0-9a-f]{16,128}")
STALE_TMP_S = 60.0  # a temp file this old belongs to a writer that died


@dataclass
class StoreStats:
    """Plain counters, read by metrics. Bytes are whole files (header and payload)."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    writes: int = 0
    write_failures: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    used_bytes: int = 0


def _check_key(key: str) -> str:
    if not isinstance(key, str) or _KEY.fullmatch(key) is None:
        raise ValueError(f"file store: malformed key {key!r} (want 16-128 lowercase hex digits)")
    return key


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _reason(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno, type(exc).__name__) if exc.errno else type(exc).__name__
    return f"{name}: {exc.strerror or exc}"


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class FileStore:
    """Pages in files under `directory`, at most `max_bytes` of them by this process's count."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int, identity: str):
        if max_bytes < 1:
            raise ValueError("the storage tier needs a positive size")
        if not identity:
            raise ValueError("the storage tier needs a model identity")
        self.directory = os.fspath(directory)
        self.max_bytes = int(max_bytes)
        self.identity = identity
        self.enabled = True
        self.disabled_reason: str | None = None
        self.stats = StoreStats()
        # key -> file size, least recently used first; guarded by _lock (put runs on a
        # writer thread while get and contains run on the engine thread)
        self._index: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            self._disable(exc)
            return
        self.scan()

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key[:2], key + ".kv")

    # ---- lookup -------------------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        """Whether a block for `key` is on disk (any replica may have written it; unverified)."""
        _check_key(key)
        return self.enabled and os.path.exists(self._path(key))

    def get(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The verified page for `key` as a new tensor owning its memory, now the most recently
        used; None if absent, from another model, or corrupt (then deleted)."""
        _check_key(key)
        if not self.enabled:
            return None
        path = self._path(key)
        limit = _PREFIX + _MAX_HEADER + torch.Size(shape).numel() * dtype.itemsize
        try:
            with open(path, "rb") as f:
                data = f.read(limit + 1)  # a sound block is smaller: never read a huge file
        except (FileNotFoundError, NotADirectoryError):
            with self._lock:
                self.stats.misses += 1
                self._forget(key)  # another process evicted it
            return None
        except OSError as exc:  # EIO, EACCES, ...: the disk is failing
            self._disable(exc)
            return None
        header, problem = self._parse(data, dtype, shape)
        if problem == "identity":
            with self._lock:
                self.stats.misses += 1
            return None
        if problem is not None:
            log.warning(
                "hierarchical cache: storage block %s is corrupt (%s); deleted", key, problem
            )
            _remove_quietly(path)
            with self._lock:
                self.stats.corrupt += 1
                self._forget(key)
            return None
        with self._lock:
            self.stats.hits += 1
            self.stats.bytes_read += len(data)
            if key in self._index:
                self._index.move_to_end(key)
            else:  # written by another replica: from now on ours to count and evict too
                self._index[key] = len(data)
                self.stats.used_bytes += len(data)
        try:
            os.utime(path)  # recent for other processes' scans as well
        except OSError:
            pass
        payload = memoryview(data)[len(data) - header["nbytes"] :]
        if not payload.nbytes:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)

    def _parse(
        self, data: bytes, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> tuple[dict, str | None]:
        """(header, None) for a sound block of this identity, dtype and shape, else (_, why)."""
        if len(data) < _PREFIX or data[: len(MAGIC)] != MAGIC:
            return {}, "bad magic"
        (n,) = _LENGTH.unpack_from(data, len(MAGIC))
        if n > _MAX_HEADER or len(data) < _PREFIX + n:
            return {}, "truncated header"
        try:
            header = json.loads(data[_PREFIX : _PREFIX + n].decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):  # deep nesting: RecursionError
            return {}, "unreadable header"
        if not isinstance(header, dict):
            return {}, "unreadable header"
        if header.get("identity") != self.identity:
            return header, "identity"
        if header.get("dtype") != _dtype_name(dtype):
            return header, f"dtype {header.get('dtype')}, asked {_dtype_name(dtype)}"
        if header.get("shape") != list(shape):
            return header, f"shape {header.get('shape')}, asked {list(shape)}"
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if header.get("nbytes") != nbytes or len(data) - _PREFIX - n != nbytes:
            return header, f"payload of {len(data) - _PREFIX - n} bytes, want {nbytes}"
        if hashlib.sha256(memoryview(data)[_PREFIX + n :]).hexdigest() != header.get("sha256"):
            return header, "checksum mismatch"
        return header, None

    # ---- storing ------------------------------------------------------------------------------
    def put(self, key: str, page: torch.Tensor) -> bool:
        """Write `page` under `key` (already on disk: nothing to do) and evict down to the
        bound. False if the page is bigger than the whole store, or the tier is (now) disabled."""
        _check_key(key)
        if not self.enabled:
            return False
        path = self._path(key)
        if os.path.exists(path):
            return True
        cpu = page.detach().contiguous().cpu()
        payload = cpu.reshape(-1).view(torch.uint8).numpy().tobytes()
        header = json.dumps(
            {
                "identity": self.identity,
                "dtype": _dtype_name(cpu.dtype),
                "shape": list(cpu.shape),
                "nbytes": len(payload),
                "sha256": hashlib.sha256(payload).hexdigest(),
            },
            separators=(",", ":"),
        ).encode("utf-8")
        size = _PREFIX + len(header) + len(payload)
        if size > self.max_bytes:
            return False
        subdir = os.path.dirname(path)
        tmp = os.path.join(subdir, f".{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            os.makedirs(subdir, exist_ok=True)
            with open(tmp, "xb") as f:
                f.write(MAGIC + _LENGTH.pack(len(header)) + header)
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())  # the data is on disk before the name points at it
            os.replace(tmp, path)
        except OSError as exc:
            _remove_quietly(tmp)
            self._disable(exc, write=True)
            return False
        with self._lock:
            self.stats.writes += 1
            self.stats.bytes_written += size
            if key not in self._index:
                self._index[key] = size
                self.stats.used_bytes += size
            self._index.move_to_end(key)
            victims = self._take_victims()
        self._delete(victims)
        return True

    # ---- eviction and the index ---------------------------------------------------------------
    def _take_victims(self) -> list[str]:
        """Pop least recently used keys until the bound holds (call with the lock held)."""
        victims = []
        while self.stats.used_bytes > self.max_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self.stats.used_bytes -= size
            self.stats.evictions += 1
            victims.append(key)
        return victims

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            try:
                os.unlink(self._path(key))
            except (FileNotFoundError, NotADirectoryError):
                pass  # another replica evicted it first
            except OSError as exc:  # cannot delete: the bound cannot be kept
                self._disable(exc, write=True)
                return

    def _forget(self, key: str) -> None:
        """Drop `key` from the index (call with the lock held)."""
        size = self._index.pop(key, None)
        if size is not None:
            self.stats.used_bytes -= size

    def scan(self) -> None:
        """Rebuild the index from the directory, oldest mtime first; delete temp files of dead
        writers and evict down to the bound (`max_bytes` may have shrunk since the last run).
        A block written while the scan runs may be left out; it is indexed when next read."""
        if not self.enabled:
            return
        found: list[tuple[float, str, int]] = []
        now = time.time()
        try:
            subdirs = [e for e in os.scandir(self.directory) if e.is_dir(follow_symlinks=False)]
            for sub in subdirs:
                for entry in os.scandir(sub.path):
                    name = entry.name
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue  # deleted meanwhile
                    if name.startswith(".") and name.endswith(".tmp"):
                        if now - st.st_mtime > STALE_TMP_S:
                            _remove_quietly(entry.path)
                        continue
                    key = name[:-3] if name.endswith(".kv") else ""
                    if _KEY.fullmatch(key) and key[:2] == sub.name and stat.S_ISREG(st.st_mode):
                        found.append((st.st_mtime, key, st.st_size))
        except OSError as exc:
            self._disable(exc)
            return
        found.sort()
        with self._lock:
            self._index = OrderedDict((key, size) for _, key, size in found)
            self.stats.used_bytes = sum(size for _, _, size in found)
            victims = self._take_victims()
        self._delete(victims)

    # ---- failure ------------------------------------------------------------------------------
    def _disable(self, exc: OSError, write: bool = False) -> None:
        with self._lock:
            if write:
                self.stats.write_failures += 1
            if not self.enabled:
                return
            self.enabled = False
            self.disabled_reason = _reason(exc)
        log.warning(
            "hierarchical cache: storage tier disabled: %s (%s)",
            self.disabled_reason,
            self.directory,
        )
