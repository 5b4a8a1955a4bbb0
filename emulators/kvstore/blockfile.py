"""On-disk format of one Full Block.

    root/
      LOCK                     flock()ed by the one server using this root
      blocks/<k[0:2]>/<key>    one file per block: 64-byte header + payload
      blocks/<k[0:2]>/.tmp-*   a put in progress; never served, removed at startup

Header (little-endian), 64 bytes so it stays small beside blocks of 100s of KiB:
    0  magic "DPKV" | 4 version u8 | 5 payload checksum algo u8 | 6 flags u16
    8  payload length u64 | 16 key, 16 raw bytes | 32 payload checksum u32
    36 header CRC-32 u32 over bytes 0..35 | 40 zero padding to 64

Payload checksum algos (dualpath/store/checksum.py): 1 = CRC-32 (zlib; files
written before CRC-32C, still read and checked with CRC-32), 2 = CRC-32C (every
new file). The header's own CRC stays zlib CRC-32 whatever the payload algo:
it must be checkable before the algo byte can be trusted, and 36 bytes cost
nothing either way.

The key inside the header catches a file that sits under the wrong name; the
header CRC catches damage to the length or the payload checksum themselves.
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import NamedTuple

from dualpath.store.checksum import WRITE_ALGO, is_known_algo
from dualpath.store.errors import CorruptBlockError

MAGIC = b"DPKV"
VERSION = 1  # the algo byte, not the version, tells CRC-32 files from CRC-32C ones
HEADER_SIZE = 64
TEMP_PREFIX = ".tmp-"
_FIELDS = struct.Struct("<4sBBHQ16sI")  # 36 bytes, covered by the header CRC
_HCRC = struct.Struct("<I")


class Header(NamedTuple):
    payload_len: int
    algo: int  # payload checksum algorithm (checksum.ALGO_*)
    payload_crc: int


def encode_header(key: str, payload_len: int, payload_crc: int, algo: int = WRITE_ALGO) -> bytes:
    if not is_known_algo(algo):
        raise ValueError(f"unknown checksum algo {algo!r}")
    fields = _FIELDS.pack(MAGIC, VERSION, algo, 0, payload_len, bytes.fromhex(key), payload_crc)
    head = fields + _HCRC.pack(zlib.crc32(fields))
    return head + bytes(HEADER_SIZE - len(head))


def decode_header(raw: bytes, key: str) -> Header:
    """The header of a block file, or CorruptBlockError."""
    if len(raw) < HEADER_SIZE:
        raise CorruptBlockError(f"block {key}: header truncated ({len(raw)} bytes)", key=key)
    fields = raw[: _FIELDS.size]
    (hcrc,) = _HCRC.unpack_from(raw, _FIELDS.size)
    if zlib.crc32(fields) != hcrc:
        raise CorruptBlockError(f"block {key}: header checksum mismatch", key=key)
    magic, version, algo, _flags, n, key_raw, crc = _FIELDS.unpack(fields)
    if magic != MAGIC or version != VERSION or not is_known_algo(algo):
        raise CorruptBlockError(f"block {key}: unknown format {magic!r} v{version} algo {algo}", key=key)
    if key_raw.hex() != key:
        raise CorruptBlockError(f"block {key}: file holds block {key_raw.hex()}", key=key)
    return Header(n, algo, crc)


def fanout_dir(blocks_dir: Path, key: str) -> Path:
    # 256 sub-directories keep directories small at 10^5..10^6 blocks.
    return blocks_dir / key[:2]


def all_fanout_names() -> list[str]:
    return [f"{i:02x}" for i in range(256)]
