"""The 3FS-like KV store server (DESIGN.md section 6).

blockfile: on-disk block format; storage: durable put/get on one root;
server: the TCP server process; launch: start one as a subprocess.
"""
