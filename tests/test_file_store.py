"""The persistent (L3) tier: roundtrips, sharing between replicas and restarts, and the faults
it must survive, each caused for real (corrupt files, a full disk, a vanished directory,
concurrent readers) rather than mocked."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from mci.cache.file_store import FileStore

ID = "model-a"
SHAPE = (2, 4, 16)  # rows, page_tokens, latent_dim
MB = 1 << 20


def key(i: int) -> str:
    return hashlib.sha256(f"page {i}".encode()).hexdigest()


def page(i: int, dtype=torch.float32, shape=SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(shape, generator=g).to(dtype)


def block_path(directory, k: str) -> Path:
    return Path(directory) / k[:2] / f"{k}.kv"


def tmp_files(directory) -> list[Path]:
    return list(Path(directory).rglob("*.tmp"))


# ---- roundtrip, sharing, restart --------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_roundtrip_is_bit_identical(tmp_path, dtype):
    store = FileStore(tmp_path, MB, ID)
    p = page(1, dtype)
    assert not store.contains(key(1))
    assert store.get(key(1), dtype, SHAPE) is None
    assert store.put(key(1), p)
    assert store.contains(key(1))
    assert block_path(tmp_path, key(1)).is_file()
    got = store.get(key(1), dtype, SHAPE)
    assert got is not None and got.dtype == dtype and tuple(got.shape) == SHAPE
    assert torch.equal(got, p)
    got.zero_()  # the result owns its memory: a second read is unaffected
    assert torch.equal(store.get(key(1), dtype, SHAPE), p)
    size = block_path(tmp_path, key(1)).stat().st_size
    assert size > p.numel() * p.element_size()
    s = store.stats
    assert (s.hits, s.misses, s.corrupt, s.writes, s.write_failures) == (2, 1, 0, 1, 0)
    assert (s.bytes_written, s.bytes_read, s.used_bytes) == (size, 2 * size, size)
    assert store.put(key(1), p) and store.stats.writes == 1  # already there: no rewrite
    assert store.enabled and store.disabled_reason is None
    assert tmp_files(tmp_path) == []


def test_shared_between_replicas_and_restarts(tmp_path):
    a, b = FileStore(tmp_path, MB, ID), FileStore(tmp_path, MB, ID)
    assert a.put(key(1), page(1))
    assert b.contains(key(1))
    assert torch.equal(b.get(key(1), torch.float32, SHAPE), page(1))
    assert b.stats.used_bytes == a.stats.used_bytes  # b learned the block by reading it
    assert b.put(key(2), page(2))
    del a, b
    restarted = FileStore(tmp_path, MB, ID)
    size = block_path(tmp_path, key(1)).stat().st_size
    assert restarted.stats.used_bytes == 2 * size
    for i in (1, 2):
        assert torch.equal(restarted.get(key(i), torch.float32, SHAPE), page(i))


def test_another_identity_never_served_nor_deleted(tmp_path):
    mine = FileStore(tmp_path, MB, ID)
    assert mine.put(key(1), page(1))
    other = FileStore(tmp_path, MB, "model-b")
    assert other.contains(key(1))  # unverified by design: get decides
    assert other.get(key(1), torch.float32, SHAPE) is None
    assert (other.stats.misses, other.stats.corrupt, other.stats.hits) == (1, 0, 0)
    assert block_path(tmp_path, key(1)).is_file()
    assert torch.equal(mine.get(key(1), torch.float32, SHAPE), page(1))


@pytest.mark.parametrize("bad", ["../x", "ZZ", "", "ABCDEF0123456789", "0" * 15, "0" * 129, 7])
def test_malformed_key_rejected(tmp_path, bad):
    store = FileStore(tmp_path, MB, ID)
    with pytest.raises(ValueError):
        store.put(bad, page(1))
    with pytest.raises(ValueError):
        store.get(bad, torch.float32, SHAPE)
    with pytest.raises(ValueError):
        store.contains(bad)
    assert list(tmp_path.iterdir()) == []


# ---- corruption -------------------------------------------------------------------------------
def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 7])


def _garbage_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[12:40] = b"\xff" * 28  # inside the JSON header, after magic and length
    path.write_bytes(bytes(data))


def _bad_magic(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:8] = b"NOTMCIKV"
    path.write_bytes(bytes(data))


def _huge_header_length(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff\xff\xff\x7f"
    path.write_bytes(bytes(data))


def _tiny(path: Path) -> None:
    path.write_bytes(b"MCI")


@pytest.mark.parametrize(
    "damage",
    [_flip_last_byte, _truncate, _garbage_header, _bad_magic, _huge_header_length, _tiny],
)
def test_corrupt_block_dropped(tmp_path, caplog, damage):
    store = FileStore(tmp_path, MB, ID)
    assert store.put(key(1), page(1))
    damage(block_path(tmp_path, key(1)))
    with caplog.at_level(logging.WARNING, logger="mci"):
        assert store.get(key(1), torch.float32, SHAPE) is None
    assert store.stats.corrupt == 1 and store.stats.hits == 0
    assert not block_path(tmp_path, key(1)).exists()
    assert store.stats.used_bytes == 0
    assert key(1) in caplog.text
    assert store.enabled  # a bad block is not a bad disk
    assert store.put(key(1), page(1))  # and can be written again
    assert torch.equal(store.get(key(1), torch.float32, SHAPE), page(1))


@pytest.mark.parametrize(
    ("dtype", "shape"), [(torch.bfloat16, SHAPE), (torch.float32, (2, 8, 8)), (torch.int32, SHAPE)]
)
def test_wrong_dtype_or_shape_is_corrupt(tmp_path, dtype, shape):
    store = FileStore(tmp_path, MB, ID)
    assert store.put(key(1), page(1))
    assert store.get(key(1), dtype, shape) is None
    assert store.stats.corrupt == 1
    assert not block_path(tmp_path, key(1)).exists()


# ---- the size bound ---------------------------------------------------------------------------
def _block_size(tmp_path) -> int:
    probe = FileStore(tmp_path / "probe", MB, ID)
    probe.put(key(0), page(0))
    return probe.stats.used_bytes


def test_lru_bound(tmp_path):
    size = _block_size(tmp_path)
    store = FileStore(tmp_path / "s", 3 * size + size // 2, ID)
    for i in range(3):
        assert store.put(key(i), page(i))
    assert store.get(key(0), torch.float32, SHAPE) is not None  # 0 is now the most recent
    assert store.put(key(3), page(3)) and store.put(key(4), page(4))
    present = {i for i in range(5) if store.contains(key(i))}
    assert present == {0, 3, 4}
    assert store.stats.evictions == 2
    assert store.stats.used_bytes == 3 * size <= store.max_bytes
    assert len(list((tmp_path / "s").rglob("*.kv"))) == 3


def test_page_bigger_than_store_refused(tmp_path):
    store = FileStore(tmp_path, 100, ID)
    assert store.put(key(1), page(1)) is False
    assert store.enabled and store.stats.write_failures == 0 and store.stats.writes == 0
    assert list(tmp_path.rglob("*.kv")) == [] and tmp_files(tmp_path) == []


def test_scan_orders_by_mtime_and_enforces_a_smaller_bound(tmp_path):
    size = _block_size(tmp_path)
    d = tmp_path / "s"
    first = FileStore(d, MB, ID)
    for i in range(4):
        first.put(key(i), page(i))
    now = time.time()
    for age, i in [(400, 2), (300, 0), (200, 3), (100, 1)]:  # oldest first: 2, 0, 3, 1
        os.utime(block_path(d, key(i)), (now - age, now - age))
    restarted = FileStore(d, 2 * size, ID)  # a smaller store than last run
    assert {i for i in range(4) if restarted.contains(key(i))} == {3, 1}
    assert restarted.stats.used_bytes == 2 * size and restarted.stats.evictions == 2
    restarted.get(key(3), torch.float32, SHAPE)
    restarted.put(key(9), page(9))
    assert {i for i in (1, 3, 9) if restarted.contains(key(i))} == {3, 9}


def test_scan_removes_stale_temp_files_only(tmp_path):
    sub = tmp_path / "ab"
    sub.mkdir()
    stale, fresh = sub / ".ab.1.x.tmp", sub / ".ab.2.y.tmp"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    old = time.time() - 120
    os.utime(stale, (old, old))
    (sub / "not-a-block.txt").write_bytes(b"left alone")
    store = FileStore(tmp_path, MB, ID)
    assert not stale.exists() and fresh.exists()
    assert (sub / "not-a-block.txt").exists() and store.stats.used_bytes == 0


def test_evicting_a_block_another_replica_deleted(tmp_path):
    size = _block_size(tmp_path)
    d = tmp_path / "s"
    store = FileStore(d, 2 * size, ID)
    store.put(key(1), page(1))
    store.put(key(2), page(2))
    block_path(d, key(1)).unlink()  # as another replica's eviction would
    assert store.put(key(3), page(3))  # evicts 1 from the index: the file is gone already
    assert store.enabled and store.stats.evictions == 1
    assert store.stats.used_bytes == 2 * size
    assert {i for i in (1, 2, 3) if store.contains(key(i))} == {2, 3}


# ---- disk failures ----------------------------------------------------------------------------
@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 KiB tmpfs mounted at tmp_path/mnt, unmounted afterwards."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {res.stderr.strip() or res.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_full_disk_disables_the_tier(small_tmpfs, caplog):
    d = small_tmpfs / "kv"
    store = FileStore(d, 64 * MB, ID)  # bounded by the disk, not by max_bytes
    shape = (1, 4, 1024)  # 16 KiB a page
    stored = []
    with caplog.at_level(logging.WARNING, logger="mci"):
        for i in range(20):
            if not store.put(key(i), page(i, shape=shape)):
                break
            stored.append(i)
        else:
            pytest.fail("a 64 KiB disk took 20 pages of 16 KiB")
        assert stored, "not even one page fit"
        assert not store.enabled
        assert "ENOSPC" in store.disabled_reason
        assert store.stats.write_failures == 1
        assert store.put(key(99), page(99, shape=shape)) is False  # no raise, no disk
        assert store.get(key(stored[0]), torch.float32, shape) is None
        assert not store.contains(key(stored[0]))
    assert store.stats.write_failures == 1
    disabled = [r for r in caplog.records if "storage tier disabled" in r.getMessage()]
    assert len(disabled) == 1
    assert tmp_files(d) == []
    # the blocks written before the disk filled are intact for a store that can read them
    reader = FileStore(d, 64 * MB, ID)
    assert torch.equal(
        reader.get(key(stored[0]), torch.float32, shape), page(stored[0], shape=shape)
    )


def test_directory_replaced_by_a_file(tmp_path, caplog):
    d = tmp_path / "kv"
    store = FileStore(d, MB, ID)
    assert store.put(key(1), page(1))
    shutil.rmtree(d)
    d.write_bytes(b"not a directory")
    with caplog.at_level(logging.WARNING, logger="mci"):
        assert store.get(key(1), torch.float32, SHAPE) is None  # a miss: nothing is there
        assert store.put(key(2), page(2)) is False
    assert not store.enabled
    assert store.disabled_reason.startswith(("ENOTDIR", "EEXIST")), store.disabled_reason
    assert store.stats.write_failures == 1
    assert "storage tier disabled" in caplog.text
    assert store.put(key(3), page(3)) is False
    assert store.get(key(1), torch.float32, SHAPE) is None and not store.contains(key(1))


def test_unusable_directory_at_start_disables(tmp_path):
    d = tmp_path / "file"
    d.write_bytes(b"x")
    store = FileStore(d / "kv", MB, ID)
    assert not store.enabled and store.disabled_reason.startswith("ENOTDIR")
    assert store.put(key(1), page(1)) is False and store.get(key(1), torch.float32, SHAPE) is None


def test_read_only_directory_disables(tmp_path):
    if os.geteuid() == 0:
        # root ignores permission bits; a read-only bind is the same fault without them
        pytest.skip("permission bits do not stop root")
    d = tmp_path / "kv"
    store = FileStore(d, MB, ID)
    d.chmod(0o500)
    try:
        assert store.put(key(1), page(1)) is False
        assert not store.enabled and store.disabled_reason.startswith("EACCES")
    finally:
        d.chmod(0o700)


# ---- concurrency ------------------------------------------------------------------------------
@pytest.mark.parametrize("one_store", [True, False], ids=["writer-thread", "other-replica"])
def test_concurrent_reader_never_sees_a_partial_block(tmp_path, one_store):
    shape = (4, 64, 256)  # 256 KiB a page: writes are slow enough to be caught mid-way
    writer = FileStore(tmp_path, 1 << 30, ID)
    reader = writer if one_store else FileStore(tmp_path, 1 << 30, ID)
    n = 60
    done = threading.Event()
    errors: list[BaseException] = []
    seen: set[str] = set()

    def write():
        try:
            for i in range(n):
                assert writer.put(key(i), page(i, shape=shape))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            done.set()

    def read():
        try:
            while True:
                finished = done.is_set()
                for p in tmp_path.rglob("*.kv"):
                    k = p.name[:-3]
                    got = reader.get(k, torch.float32, shape)
                    assert got is not None, f"listed block {k} not served"
                    seen.add(k)
                if finished:
                    return
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write), threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert reader.stats.corrupt == 0 and reader.stats.misses == 0
    assert len(seen) == n and reader.stats.hits >= n
    assert reader.stats.used_bytes == writer.stats.used_bytes == writer.stats.bytes_written
    assert tmp_files(tmp_path) == []
