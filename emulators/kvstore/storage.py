"""Durable block storage on one root directory (no networking here).

Crash safety rests on three rules:
  1. A put writes a temp file in the block's own directory, fsyncs it, then
     publishes it under its final name with link() (rename that never replaces:
     the first writer of a key wins, a concurrent one sees EEXIST), unlinks the
     temp name and fsyncs the directory. Only then is the put acknowledged.
     So a final name always points at a complete, fsynced file.
  2. Temp names start with TEMP_PREFIX, which no valid key can, so a temp file
     can never be served; startup removes every one left by a crash.
  3. Every read checks the header (magic, key, header CRC, length vs file size);
     the payload checksum and its algorithm travel to the client, which checks
     it on every read.

Damaged blocks (a bit flip on disk, a truncated file, a header that no longer
checks) are repairable: a put of a key that is already stored first checks the
stored file, header and payload CRC, and if it fails, the new (CRC-checked)
bytes replace it with rename() (atomic: a reader sees the old file or the new
one, never a mix) and the put reports "repaired". A put of a key whose stored
block checks out stays "exists" and changes nothing (first writer wins).

`has()` (the protocol's "has") checks the header and the file size, which costs
one open, fstat and 64-byte pread per key (about 10 us) and catches truncation
and header damage, but not a flipped payload bit. `has(key, verify=True)` also
reads the payload and checks its CRC (a full read of the block: on demand only).
A payload flip that a cheap has() still calls present is caught by the client's
CRC check on every read (get_many raises CorruptBlockError naming the key, so
a caller can treat it as a miss and recompute), and repaired by the next put.
"""
from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from dualpath.store.checksum import WRITE_ALGO, checksum
from dualpath.store.errors import (
    BadRequestError,
    CorruptBlockError,
    MissingBlockError,
    StoreError,
    StoreFullError,
    StoreIOError,
    short_repr,
)
from dualpath.store.keys import check_key, is_valid_key

from .blockfile import HEADER_SIZE, TEMP_PREFIX, all_fanout_names, decode_header, encode_header, fanout_dir

log = logging.getLogger(__name__)

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_VERIFY_CHUNK = 1 << 20  # scratch for a payload check when the caller lends none


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _os_error(exc: OSError, what: str, key: str | None) -> StoreError:
    if exc.errno in _FULL_ERRNOS:
        return StoreFullError(f"disk full while {what}" + (f" block {key}" if key else ""), key=key)
    return StoreIOError(f"{what}" + (f" block {key}" if key else "") + f": {exc}", key=key)


@dataclass
class RecoveryReport:
    removed_temp_files: int
    blocks: int
    used_bytes: int
    ignored_entries: int


@dataclass
class BlockHandle:
    """An open block file; the caller closes it (close()) after sending."""

    key: str
    fd: int
    payload_len: int
    payload_crc: int
    algo: int  # of payload_crc: CRC-32C, or CRC-32 for files written before it
    payload_offset: int = HEADER_SIZE

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class BlockStore:
    def __init__(self, root: str | os.PathLike[str], capacity_bytes: int, max_block_bytes: int,
                 block_bytes: int = 0) -> None:
        if capacity_bytes <= 0 or max_block_bytes <= 0:
            raise ValueError("capacity_bytes and max_block_bytes must be positive")
        if not 0 <= block_bytes <= max_block_bytes:
            raise ValueError(f"block_bytes must be 0 (any size) or in [1, max_block_bytes={max_block_bytes}]")
        self.root = Path(root)
        self.blocks_dir = self.root / "blocks"
        self.capacity_bytes = capacity_bytes
        self.max_block_bytes = max_block_bytes
        self.block_bytes = block_bytes  # 0: blocks of any size up to max_block_bytes
        self._lock = threading.Lock()
        self._used = 0  # bytes of published block files (headers included)
        self._reserved = 0  # bytes promised to puts in progress
        self._blocks = 0
        self._lock_fd = -1
        self._tmp_seq = itertools.count()

    # ---- lifecycle -------------------------------------------------------
    def open(self) -> RecoveryReport:
        """Take the root's lock, create the layout and recover from a crash."""
        self.blocks_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"another store server already uses root {self.root}") from None
        self._lock_fd = fd
        for name in all_fanout_names():
            (self.blocks_dir / name).mkdir(exist_ok=True)
        fsync_dir(self.blocks_dir)
        fsync_dir(self.root)
        return self._recover()

    def _recover(self) -> RecoveryReport:
        removed = blocks = used = ignored = 0
        for name in all_fanout_names():
            d = self.blocks_dir / name
            touched = False
            with os.scandir(d) as it:
                for entry in it:
                    if entry.name.startswith(TEMP_PREFIX):
                        # A put that never got acknowledged: its bytes were never visible.
                        os.unlink(entry.path)
                        removed += 1
                        touched = True
                    elif is_valid_key(entry.name) and entry.name.startswith(name) and entry.is_file(follow_symlinks=False):
                        blocks += 1
                        used += entry.stat(follow_symlinks=False).st_size
                    else:
                        ignored += 1
                        log.warning("ignoring unexpected entry %s", entry.path)
            if touched:
                fsync_dir(d)
        with self._lock:
            self._used, self._blocks, self._reserved = used, blocks, 0
        return RecoveryReport(removed, blocks, used, ignored)

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    # ---- queries ---------------------------------------------------------
    def path_of(self, key: str) -> Path:
        return fanout_dir(self.blocks_dir, check_key(key)) / key

    def has(self, key: str, verify: bool = False, scratch: memoryview | None = None) -> bool:
        """True if the block is stored and its header and size check out; with `verify`,
        its payload CRC too (reads the whole block). A damaged block is not "had"."""
        return self.block_state(key, verify, scratch) == "ok"

    def block_state(self, key: str, verify: bool = True, scratch: memoryview | None = None) -> str:
        """"ok", "absent" or "corrupt" (damaged header, size or, with `verify`, payload; or
        something that is not a regular file we wrote, e.g. a symlink)."""
        try:
            handle = self.check_block(key, self.open_fd(key))
        except MissingBlockError:
            return "absent"
        except (CorruptBlockError, StoreIOError):
            return "corrupt"
        try:
            if verify:
                self.verify(handle, scratch if scratch is not None else memoryview(bytearray(_VERIFY_CHUNK)))
            return "ok"
        except (CorruptBlockError, StoreIOError):
            return "corrupt"
        finally:
            handle.close()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "used_bytes": self._used,
                "reserved_bytes": self._reserved,
                "capacity_bytes": self.capacity_bytes,
                "blocks": self._blocks,
            }

    # ---- reads -----------------------------------------------------------
    def open_block(self, key: str) -> BlockHandle:
        return self.check_block(key, self.open_fd(key))

    def open_fd(self, key: str) -> int:
        """Open a block's file (no validation yet). MissingBlockError if absent."""
        path = self.path_of(key)
        try:
            # O_NOFOLLOW: a block is a regular file we wrote, never a link to elsewhere.
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise MissingBlockError(f"block {key} not found", key=key) from None
        except OSError as exc:
            raise _os_error(exc, "opening", key) from None

    @staticmethod
    def prefetch_fd(fd: int) -> int:
        """Ask the kernel to start reading the whole file now (asynchronously); only a hint.

        Returns the bytes asked for (the file's size; 0 if the hint failed).
        """
        try:
            size = os.fstat(fd).st_size
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            return 0
        return size

    @staticmethod
    def check_block(key: str, fd: int) -> BlockHandle:
        """Validate an open block file's header and size; takes ownership of fd."""
        try:
            size = os.fstat(fd).st_size
            n, algo, crc = decode_header(os.pread(fd, HEADER_SIZE, 0), key)
            if size != HEADER_SIZE + n:
                raise CorruptBlockError(f"block {key}: file is {size} bytes, header says {HEADER_SIZE + n}", key=key)
            return BlockHandle(key, fd, n, crc, algo)
        except OSError as exc:
            os.close(fd)
            raise _os_error(exc, "reading", key) from None
        except BaseException:
            os.close(fd)
            raise

    def verify(self, handle: BlockHandle, scratch: memoryview) -> None:
        """Check the payload checksum on the server (optional: the client always checks)."""
        crc, off, end = 0, handle.payload_offset, handle.payload_offset + handle.payload_len
        while off < end:
            try:
                k = os.preadv(handle.fd, [scratch[: min(len(scratch), end - off)]], off)
            except OSError as exc:
                raise _os_error(exc, "reading", handle.key) from None
            if k <= 0:
                raise CorruptBlockError(f"block {handle.key}: short read", key=handle.key)
            crc = checksum(scratch[:k], handle.algo, crc)
            off += k
        if crc != handle.payload_crc:
            raise CorruptBlockError(f"block {handle.key}: payload checksum mismatch", key=handle.key)

    # ---- writes ----------------------------------------------------------
    def begin_put(self, key: str, payload_len: int, payload_crc: int, scratch: memoryview | None = None) -> "PutTxn | None":
        """A transaction to stream the payload into, or None if the block is already stored intact.

        `payload_crc` is the payload's WRITE_ALGO (CRC-32C) checksum: new blocks are never CRC-32.
        If a file is stored under the key but fails its checks (header, size, payload CRC),
        the transaction replaces it (txn.repair is True): the only way to mend a damaged block.
        """
        check_key(key)
        self.check_size(payload_len, key)
        final = self.path_of(key)
        state = self.block_state(key, verify=True, scratch=scratch)
        if state == "ok":
            self._make_durable(final.parent, key)
            return None
        repair = state == "corrupt"
        old = 0
        if repair:
            try:
                old = _counted_size(final, key) or 0  # freed when the repair replaces it
            except OSError:
                old = 0
        need = HEADER_SIZE + payload_len
        with self._lock:
            if self._used - old + self._reserved + need > self.capacity_bytes:
                raise StoreFullError(
                    f"capacity exceeded storing block {key}: used {self._used} + in flight "
                    f"{self._reserved} + {need} > capacity {self.capacity_bytes} bytes",
                    key=key,
                )
            self._reserved += need
        try:
            return PutTxn(self, key, payload_len, payload_crc, final, repair=repair)
        except BaseException:
            self._release(need)
            raise

    def check_size(self, payload_len: object, key: str | None = None) -> int:
        """A put's payload length, or BadRequestError: 1..max_block_bytes, and exactly
        block_bytes where the store was told its block size. A 0-byte block is never a block."""
        if type(payload_len) is not int or not 1 <= payload_len <= self.max_block_bytes:
            raise BadRequestError(f"block size {short_repr(payload_len)} outside [1, {self.max_block_bytes}] bytes", key=key)
        if self.block_bytes and payload_len != self.block_bytes:
            raise BadRequestError(f"block of {payload_len} bytes; this store holds blocks of exactly "
                                  f"{self.block_bytes} bytes", key=key)
        return payload_len

    def delete(self, key: str) -> bool:
        final = self.path_of(key)
        # Under the lock, like every change of a final name, so the accounting stays exact
        # beside a concurrent repair (which replaces the file) of the same key.
        with self._lock:
            try:
                st = os.lstat(final)
                os.unlink(final)
            except FileNotFoundError:
                return False
            except OSError as exc:
                raise _os_error(exc, "deleting", key) from None
            if stat.S_ISREG(st.st_mode):  # only regular files were counted as blocks
                self._used -= st.st_size
                self._blocks -= 1
        self._make_durable(final.parent, key)
        return True

    def _release(self, reserved: int) -> None:
        with self._lock:
            self._reserved -= reserved

    def _published(self, reserved: int, size: int | None, replaced: int | None = None) -> None:
        """Account for a put made visible: `size` bytes added (None: nothing added), replacing
        a file of `replaced` bytes (None: nothing was replaced, a new block)."""
        with self._lock:
            self._reserved -= reserved
            if size is not None:
                self._used += size - (replaced or 0)
                if replaced is None:
                    self._blocks += 1

    def _make_durable(self, directory: Path, key: str) -> None:
        try:
            fsync_dir(directory)
        except OSError as exc:
            raise _os_error(exc, "syncing directory of", key) from None

    def _temp_name(self, key: str) -> str:
        return f"{TEMP_PREFIX}{key}-{os.getpid()}-{next(self._tmp_seq)}"


class PutTxn:
    """One put in progress: write() the payload in chunks, then commit() or abort()."""

    def __init__(self, store: BlockStore, key: str, payload_len: int, payload_crc: int, final: Path,
                 repair: bool = False) -> None:
        self.store, self.key, self.final = store, key, final
        self.repair = repair  # replace a damaged file stored under the key
        self.payload_len, self.payload_crc = payload_len, payload_crc
        self.reserved = HEADER_SIZE + payload_len
        self.tmp = final.parent / store._temp_name(key)
        self.written = 0
        self._crc = 0
        self._done = False
        try:
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise _os_error(exc, "creating temp file for", key) from None
        try:
            self._write_all(encode_header(key, payload_len, payload_crc, WRITE_ALGO))
        except BaseException:
            self.abort()
            raise

    def _write_all(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        try:
            while view:
                k = os.write(self.fd, view)
                view = view[k:]
        except OSError as exc:
            raise _os_error(exc, "writing", self.key) from None

    def write(self, chunk: memoryview) -> None:
        if self.written + len(chunk) > self.payload_len:
            raise BadRequestError(f"block {self.key}: more payload than announced", key=self.key)
        self._crc = checksum(chunk, WRITE_ALGO, self._crc)
        self._write_all(chunk)
        self.written += len(chunk)

    def commit(self) -> str:
        """Make the block durable and visible: "new" if this put stored it, "repaired" if it
        replaced a damaged file, "exists" if an intact one was stored meanwhile."""
        try:
            if self.written != self.payload_len:
                raise BadRequestError(f"block {self.key}: {self.written} of {self.payload_len} bytes", key=self.key)
            if self._crc != self.payload_crc:
                # Damaged on the way in: refuse it rather than store a block that fails every read.
                raise CorruptBlockError(f"block {self.key}: payload checksum mismatch on put", key=self.key)
            try:
                os.fsync(self.fd)
            except OSError as exc:
                raise _os_error(exc, "syncing", self.key) from None
            os.close(self.fd)
            self.fd = -1
            status, replaced = self._publish()
        except BaseException:
            self.abort()
            raise
        # Visible from here on: account for it even if the steps below fail.
        self._done = True
        size = HEADER_SIZE + self.payload_len
        if status == "new":
            self.store._published(self.reserved, size)
        elif status == "repaired":
            self.store._published(self.reserved, size, replaced)  # replaced None: it was no block
        else:
            self.store._published(self.reserved, None)
        if status != "repaired":  # rename() consumed the temp name
            try:
                os.unlink(self.tmp)
            except OSError as exc:  # harmless: startup removes temp names
                log.warning("could not remove %s: %s", self.tmp, exc)
        # Not acknowledged until the directory entry itself is on disk.
        self.store._make_durable(self.final.parent, self.key)
        return status

    def _publish(self) -> tuple[str, int | None]:
        """Give the temp file its final name: link() for a new block (never replaces: the
        first writer wins), rename() over a damaged one. Returns the status and the size of
        the file replaced."""
        store = self.store
        with store._lock:  # every change of a final name happens under the lock (see delete)
            try:
                os.link(self.tmp, self.final)
                return "new", None
            except FileExistsError:
                if not self.repair:
                    return "exists", None  # a concurrent put of the same key won; same bytes by construction
            except OSError as exc:
                raise _os_error(exc, "publishing", self.key) from None
            try:
                replaced = _counted_size(self.final, self.key)
                os.rename(self.tmp, self.final)
            except FileNotFoundError:  # deleted meanwhile: publish as new
                try:
                    os.link(self.tmp, self.final)
                    return "new", None
                except OSError as exc:
                    raise _os_error(exc, "publishing", self.key) from None
            except OSError as exc:
                raise _os_error(exc, "replacing damaged", self.key) from None
        log.warning("repaired block %s: replaced a damaged file", self.key)
        return "repaired", replaced

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass
        except OSError as exc:  # leave it for the next startup's cleanup
            log.warning("could not remove %s: %s", self.tmp, exc)
        self.store._release(self.reserved)


def _counted_size(path: Path, key: str) -> int | None:
    """The bytes the accounting holds for the file at `path`: None for anything but a regular
    file (never counted as a block). The size its header states where the header still
    decodes: a file truncated behind the store's back is still counted at its written size."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return st.st_size
    try:
        return HEADER_SIZE + decode_header(os.pread(fd, HEADER_SIZE, 0), key).payload_len
    except (OSError, CorruptBlockError):
        return st.st_size
    finally:
        os.close(fd)
