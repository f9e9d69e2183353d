"""Stored responses (the Responses API's ``store``): each response's JSON and the conversation
it ends (its input items after the earlier turns', then its output items), so that
``previous_response_id`` continues it. One SQLite file, so they outlive a restart; bounded
(the oldest go first); each visible only to the API key that made it."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any


def default_path() -> Path:
    """Where ``--responses-store`` keeps them by default: the user's cache folder."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "openinfer" / "responses.sqlite3"


SCHEMA = """CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, created REAL NOT NULL,
    response TEXT NOT NULL, conversation TEXT NOT NULL)"""


class ResponseStore:
    """``path``: the SQLite file (``":memory:"``: kept in this process only); at most
    ``max_responses`` kept."""

    def __init__(self, path: str | Path, max_responses: int = 10_000) -> None:
        self.path, self.max_responses = str(path), max_responses
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    @property
    def _db(self) -> sqlite3.Connection:
        """The file, opened on first use (a server that serves no Responses call makes none).
        One connection for the server's threads, serialised by the lock: each call is one
        short statement on a small row. Replicas on one host may share the file."""
        if self._conn is None:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                                   timeout=10.0)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(SCHEMA)
            self._conn = conn
        return self._conn

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]],
            owner: str | None) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                             (response["id"], owner or "", time.time(), json.dumps(response),
                              json.dumps(conversation)))
            self._db.execute("DELETE FROM responses WHERE id IN (SELECT id FROM responses "
                             "ORDER BY created DESC LIMIT -1 OFFSET ?)", (self.max_responses,))

    def get(self, response_id: str, owner: str | None) -> tuple[dict, list[dict]] | None:
        """(the response, its conversation), or None if there is none for this owner."""
        with self._lock:
            row = self._db.execute("SELECT response, conversation FROM responses WHERE id = ? "
                                   "AND owner = ?", (response_id, owner or "")).fetchone()
        return None if row is None else (json.loads(row[0]), json.loads(row[1]))

    def delete(self, response_id: str, owner: str | None) -> bool:
        with self._lock:
            cursor = self._db.execute("DELETE FROM responses WHERE id = ? AND owner = ?",
                                      (response_id, owner or ""))
        return cursor.rowcount > 0

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
