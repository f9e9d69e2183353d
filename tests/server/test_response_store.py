"""The Responses API's store: bounded (the oldest go first), per owner, in a file that a new
process reads."""

from __future__ import annotations

import time

from openinfer.server.response_store import ResponseStore


def test_the_oldest_go_first_and_owners_see_only_their_own(tmp_path):
    store = ResponseStore(tmp_path / "r.sqlite3", max_responses=3)
    for i in range(5):
        store.put({"id": f"resp_{i}", "output": [i]}, [{"role": "user", "content": str(i)}], "a")
        time.sleep(0.002)  # distinct creation times
    assert len(store) == 3
    assert store.get("resp_0", "a") is None and store.get("resp_1", "a") is None
    assert store.get("resp_4", "a") == ({"id": "resp_4", "output": [4]},
                                        [{"role": "user", "content": "4"}])
    assert store.get("resp_4", "b") is None and store.get("resp_4", None) is None
    assert not store.delete("resp_4", "b") and store.delete("resp_4", "a")
    assert store.get("resp_4", "a") is None
    store.close()
    reopened = ResponseStore(tmp_path / "r.sqlite3")
    assert reopened.get("resp_3", "a")[0]["output"] == [3]
    reopened.close()


def test_a_server_that_serves_no_responses_call_makes_no_file(tmp_path):
    store = ResponseStore(tmp_path / "sub" / "r.sqlite3")
    assert not (tmp_path / "sub").exists()
    assert store.get("resp_x", None) is None
    assert (tmp_path / "sub" / "r.sqlite3").exists()
