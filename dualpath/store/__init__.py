"""Client side of the 3FS-like KV store (DESIGN.md section 6).

keys: chained prefix keys; striping: key -> server; protocol: wire frames;
checksum: block checksums (CRC-32C, CRC-32 of older blocks);
client: put/get_many; errors: typed errors. (A node's pending reads are counted by its read
queue, dualpath/nodes/read_queue.py; the benchmark against fio is testbed/calibrate/benches/store_fio.py.)
"""
from .client import StoreClient
from .errors import (
    BadKeyError,
    BadRequestError,
    CorruptBlockError,
    MissingBlockError,
    ProtocolError,
    ServerBusyError,
    StoreConnectionError,
    StoreError,
    StoreFullError,
    StoreIOError,
)
from .keys import chain_keys, check_key, is_valid_key
from .striping import server_index

__all__ = [
    "StoreClient",
    "chain_keys",
    "check_key",
    "is_valid_key",
    "server_index",
    "StoreError",
    "MissingBlockError",
    "BadKeyError",
    "StoreFullError",
    "CorruptBlockError",
    "BadRequestError",
    "ServerBusyError",
    "StoreIOError",
    "ProtocolError",
    "StoreConnectionError",
]
