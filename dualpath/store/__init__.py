"""Client side of the 3FS-like KV store (DESIGN.md section 6).

keys: chained prefix keys; striping: key -> server; protocol: wire frames;
checksum: block checksums (CRC-32C, CRC-32 of older blocks);
client: put/get_many; readq: a node's pending read bytes; errors: typed errors;
bench: store read throughput against fio.
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
from .readq import ReadQueue
from .striping import server_index

__all__ = [
    "StoreClient",
    "ReadQueue",
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
