"""Tier L3: KV blocks as files under a directory (local disk, or a 3FS/NFS/Lustre mount).

One file per block, named by its content hash (never by anything from a request):

    DIR/<model fingerprint, 16 hex>/<hash[:2]>/<hash hex>.kvblock

Under tensor parallelism each rank stores its own share of a block (its KV heads) under a
fingerprint of its own (``rank_fingerprint``), and a block is in the store when every
rank's file is (``StoreMembership``, asked by the engine core).

A file is ``MAGIC | u32 header length | JSON header | payload``. The header names the
format version, the block layout (``BlockLayout.describe()``: model fingerprint, block
size, and every cacheable layer group's kind, layers, page shape and dtype), the block
hash and the payload's length and CRC32. A file whose header or checksum does not match
what this engine expects is deleted, never loaded: a store written under one layout is
never read under another.

Writes go to a temporary file in the same directory and are renamed into place, so a
reader (this process or another sharing the directory) sees a whole file or none.
The store is bounded by ``capacity_bytes``: when a write takes it over, the least
recently used files (by mtime, which a read refreshes) are deleted down to 90%. A pinned
block's file (a prompt-caching pin, kv/pins.py) has its mtime set to when the pin ends: the
collector never deletes a file dated in the future, whichever process pinned it, and a
restarted engine finds it still there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

from openinfer.kv.block_hash import BlockHash
from openinfer.kv.spec import BlockLayout

MAGIC = b"OIKVBLK\x00"
PROBE_PREFIX = ".probe-"
"""A rank's start-up probe file (a dot file: never taken for a block)."""
FORMAT_VERSION = 2  # 2: the header names a BlockLayout (layer groups)
SUFFIX = ".kvblock"
_LEN = struct.Struct("<I")


class StoreFileError(ValueError):
    """A block file that must not be used (and has been deleted)."""


def model_fingerprint(model_dir: str | Path) -> str:
    """sha256 over config.json and every safetensors file's size, first and last MiB
    (which hold its header and weights): distinct checkpoints, distinct stores. A .gguf
    file (config and weights in one) is hashed the same way, alone."""
    root = Path(model_dir)
    if root.is_file():
        digest, files = hashlib.sha256(b"gguf"), [root]
    else:
        digest = hashlib.sha256((root / "config.json").read_bytes())
        files = sorted(root.glob("*.safetensors"))
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
    return digest.hexdigest()


def rank_fingerprint(fingerprint: str, rank: int, num_ranks: int) -> str:
    """The fingerprint of one tensor-parallel rank's share of a model's KV (the model's
    own with one rank): a rank reads only files its own rank of the same split wrote."""
    if num_ranks == 1:
        return fingerprint
    return hashlib.sha256(f"{fingerprint}:tp{num_ranks}:rank{rank}".encode()).hexdigest()


def _block_path(directory: Path, block_hash: BlockHash) -> Path:
    name = block_hash.hex()
    return directory / name[:2] / f"{name}{SUFFIX}"


@dataclass(frozen=True)
class RankStore:
    """Where one rank's block files go, and the probe file it wrote there at start-up."""

    directory: Path
    probe: str


class StoreMembership:
    """Whether a block is in the store: every rank's file of it is there. The engine core
    asks this (a file test per rank) from its own process; the ranks read and write. So
    ranks on other machines need a store every node mounts at the same path (3FS, NFS):
    ``of_ranks`` makes sure at start-up."""

    def __init__(self, directories: list[Path]) -> None:
        self.directories = directories

    @staticmethod
    def of_ranks(stores: list[RankStore]) -> StoreMembership:
        """The membership test over the ranks' directories, once the probe each rank wrote is
        found from here (then removed); ValueError naming the first rank whose probe is not."""
        for rank, store in enumerate(stores):
            if not (store.directory / store.probe).is_file():
                raise ValueError(
                    f"--kv-store-dir: rank {rank} keeps its blocks in {store.directory}, which "
                    "the engine core's machine does not see; with ranks on other machines the "
                    "store must be one directory every node mounts at the same path (3FS, NFS)")
        for store in stores:
            (store.directory / store.probe).unlink(missing_ok=True)
        return StoreMembership([store.directory for store in stores])

    def __call__(self, block_hash: BlockHash) -> bool:
        return all(_block_path(d, block_hash).is_file() for d in self.directories)


class FileStore:
    def __init__(self, root: str | Path, layout: BlockLayout, capacity_bytes: int) -> None:
        if not layout.model_fingerprint:
            raise ValueError("a file store needs the model's fingerprint in its block layout")
        self.layout = layout
        self.capacity_bytes = capacity_bytes
        self.dir = Path(root) / layout.model_fingerprint[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        self._expected = {"layout": layout.describe()}
        self.bytes_used = sum(p.stat().st_size for p in self._files())
        self.num_deleted_bad = 0
        self.num_evicted = 0
        self._lock = threading.Lock()
        self._pins: dict[BlockHash, float] = {}
        """Pins of blocks not written yet: hash -> until (applied when written)."""

    def write_probe(self) -> str:
        """A file of this process's own name in the directory, for the engine core to look
        for (``StoreMembership.of_ranks``); returns its name."""
        name = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
        (self.dir / name).write_text(f"{os.uname().nodename} {os.getpid()}\n")
        return name

    def path_of(self, block_hash: BlockHash) -> Path:
        return _block_path(self.dir, block_hash)

    def contains(self, block_hash: BlockHash) -> bool:
        return self.path_of(block_hash).is_file()

    def write(self, block_hash: BlockHash, payload: bytes) -> bool:
        """Store a block (atomically); False when it was already there."""
        path = self.path_of(block_hash)
        if path.is_file():
            return False
        header = json.dumps({**self._expected, "version": FORMAT_VERSION,
                             "block_hash": block_hash.hex(), "payload_bytes": len(payload),
                             "crc32": zlib.crc32(payload)}).encode()
        path.parent.mkdir(parents=True, exist_ok=True)  # (again if the directory was removed)
        tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with tmp.open("wb") as f:
                f.write(MAGIC + _LEN.pack(len(header)) + header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError:  # a full, read-only or vanished disk: leave no partial file behind
            self._delete(tmp)
            raise
        with self._lock:  # I/O threads write concurrently; the budget is counted under it
            until = self._pins.pop(block_hash, None)
            if until is not None:
                _date(path, until)
            self.bytes_used += _file_size(path)
            if self.bytes_used > self.capacity_bytes:
                self._collect_garbage()
        return True

    def pin(self, block_hash: BlockHash, until: float) -> None:
        """Keep the block's file until ``until`` (unix time): its mtime moves there (never
        back). A block not written yet is dated when it is."""
        path = self.path_of(block_hash)
        with self._lock:
            try:
                _date(path, until)
            except FileNotFoundError:
                if len(self._pins) > 65536:  # (blocks never written: drop the ended pins)
                    now = time.time()
                    self._pins = {h: t for h, t in self._pins.items() if t > now}
                self._pins[block_hash] = max(until, self._pins.get(block_hash, 0.0))

    def read(self, block_hash: BlockHash) -> bytes:
        """The block's payload; raises StoreFileError (deleting the file) if it is bad,
        FileNotFoundError if it is gone (evicted by another process meanwhile)."""
        path = self.path_of(block_hash)
        data = path.read_bytes()
        try:
            payload = self._verify(data, block_hash)
        except StoreFileError:
            self._delete(path)
            self.num_deleted_bad += 1
            raise
        _date(path, time.time())  # recently used: last to be collected (a pinned one stays)
        return payload

    def _verify(self, data: bytes, block_hash: BlockHash) -> bytes:
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _LEN.size:
            raise StoreFileError("not a block file (bad magic)")
        (length,) = _LEN.unpack_from(data, len(MAGIC))
        start = len(MAGIC) + _LEN.size
        try:
            header = json.loads(data[start:start + length])
        except (ValueError, RecursionError) as e:  # (RecursionError: "[[[[..." nested deep)
            raise StoreFileError(f"unreadable header: {e}") from e
        if not isinstance(header, dict):
            raise StoreFileError("the header is not a JSON object")
        if header.get("version") != FORMAT_VERSION:
            raise StoreFileError(f"format version {header.get('version')}")
        for key, value in self._expected.items():
            if header.get(key) != value:
                raise StoreFileError(f"{key} mismatch: file has {header.get(key)!r}")
        if header.get("block_hash") != block_hash.hex():
            raise StoreFileError("block hash mismatch")
        payload = data[start + length:]
        if len(payload) != header.get("payload_bytes") or len(payload) != self.layout.block_bytes:
            raise StoreFileError("payload length mismatch (truncated?)")
        if zlib.crc32(payload) != header.get("crc32"):
            raise StoreFileError("checksum mismatch")
        return payload

    def collect_garbage(self) -> None:
        """Delete least recently used files until the store is at 90% of its budget."""
        with self._lock:
            self._collect_garbage()

    def _collect_garbage(self) -> None:
        entries = []
        for path in self._files():
            try:
                st = path.stat()
            except FileNotFoundError:
                continue  # another process collected it
            entries.append((st.st_mtime, st.st_size, path))
        self.bytes_used = sum(size for _, size, _ in entries)
        entries.sort()
        target = int(self.capacity_bytes * 0.9)
        now = time.time()
        for mtime, size, path in entries:
            if self.bytes_used <= target or mtime > now:  # (the rest are pinned)
                break
            self._delete(path)
            self.bytes_used -= size
            self.num_evicted += 1

    def _files(self):
        return (p for p in self.dir.glob(f"*/*{SUFFIX}") if not p.name.startswith("."))

    @staticmethod
    def _delete(path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _date(path: Path, when: float) -> None:
    """Move the file's mtime forward to ``when`` (FileNotFoundError if it is gone)."""
    if path.stat().st_mtime < when:
        os.utime(path, (when, when))


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def inspect_store(root: str | Path) -> list[dict]:
    """What a store directory holds, per model fingerprint (for `openinfer cache inspect`)."""
    summary = []
    for model_dir in sorted(p for p in Path(root).iterdir() if p.is_dir()):
        files = [p for p in model_dir.glob(f"*/*{SUFFIX}") if not p.name.startswith(".")]
        entry = {"fingerprint": model_dir.name, "blocks": len(files),
                 "bytes": sum(_file_size(p) for p in files), "layout": None, "bad_headers": 0}
        for path in files[:1]:
            data = path.read_bytes()
            try:
                (length,) = _LEN.unpack_from(data, len(MAGIC))
                header = json.loads(data[len(MAGIC) + _LEN.size:][:length])
                entry["layout"] = _summary(header["layout"])
            except (ValueError, KeyError, struct.error):
                entry["bad_headers"] += 1
        if files:
            mtimes = [p.stat().st_mtime for p in files]
            entry["oldest_mtime"], entry["newest_mtime"] = min(mtimes), max(mtimes)
        summary.append(entry)
    return summary


def _summary(layout: dict) -> dict:
    """A block layout in a line's worth of fields (for `openinfer cache inspect`)."""
    groups = layout["groups"]
    return {"block_size": layout["block_size"],
            "groups": "; ".join(f"{g['kind']} x{len(g['layers'])} layers {g['page_shape']} "
                                f"{g['dtype']}" for g in groups)}
