"""Prefill/decode disaggregation between two real engines over real sockets, shared memory
and files: the decode side's tokens equal colocated serving, only blocks it lacks cross,
and every failure (dead prefill, stalled or corrupt transfer) still completes the
request with no block left held on either side."""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
import zlib

import pytest
from kv_pages import assert_same_pages, prompt_pages

from openinfer import LLM, SamplingParams
from openinfer.transfer.protocol import recv_frame, send_frame

MiB = 1024**2
PROMPT_LEN = 100  # 6 full blocks before the last token, 4 tokens recomputed by decode
DECODE = dict(temperature=0, max_tokens=8, ignore_eos=True)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(PROMPT_LEN)] for _ in range(n)]


@pytest.fixture(scope="module")
def plain(qwen3_checkpoint) -> LLM:
    return LLM(str(qwen3_checkpoint), enable_prefix_caching=False, progress=False,
               kv_cache_memory=32 * MiB)


@pytest.fixture
def engine(qwen3_checkpoint):
    """Engines on a small KV pool, whose KV servers and I/O threads stop after the test
    (a serving thread would otherwise keep the whole cache alive)."""
    made: list[LLM] = []

    def make(**options) -> LLM:
        made.append(LLM(str(qwen3_checkpoint), progress=False, kv_cache_memory=32 * MiB,
                        **options))
        return made[-1]

    yield make
    for llm in made:
        llm.engine.core.shutdown()


def _prefill(llm: LLM, prompts: list[list[int]]) -> list[dict]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1,
                                                kv_transfer_params={"do_remote_decode": True}))
    params = [o.kv_transfer_params for o in outs]
    assert all(p and len(p["remote_block_hashes"]) == PROMPT_LEN // 16 for p in params)
    return params


def _decode(llm: LLM, prompts, params: list[dict]) -> list[list[int]]:
    outs = llm.generate(prompts, [SamplingParams(**DECODE, kv_transfer_params=p) for p in params])
    return [o.outputs[0].token_ids for o in outs]


def _wait_leases_freed(prefill: LLM, timeout_s: float = 5.0) -> None:
    core = prefill.engine.core
    deadline = time.monotonic() + timeout_s
    while core.kv.num_held and time.monotonic() < deadline:
        time.sleep(0.02)
        core.connector.collect_leases()
    assert core.kv.num_held == 0 and core.executor.worker.kv.server.num_leases == 0


@pytest.mark.parametrize("connector", ["tcp", "shm", "file"])
def test_disaggregated_greedy_tokens_equal_colocated(engine, plain, tmp_path, connector):
    store = {"kv_store_dir": str(tmp_path / "shared")} if connector == "file" else {}
    prefill = engine(kv_role="prefill", **store)
    decode = engine(kv_role="decode", kv_connector=connector, **store)
    prompts = _prompts(4, seed=1)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, SamplingParams(**DECODE))]
    params = _prefill(prefill, prompts)
    assert _decode(decode, prompts, params) == expected
    core = decode.engine.core
    from_store = core.kv.hit_tokens_by_tier["L3"] // 16  # a shared store: some already there
    assert core.scheduler.num_remote_blocks_pulled + from_store == 4 * 6
    assert core.scheduler.num_prompt_tokens_computed == 4 * 4  # only the tails
    mover = core.executor.worker.kv.mover
    assert mover.stats.remote_pull_failures == 0
    if connector != "file":
        assert mover.stats.bytes["remote_to_host"] == 24 * mover.block_bytes
    # Each pulled block lands in its place in the request's table (tokens cannot tell).
    (prompt,) = _prompts(1, seed=11)
    (pull,) = _prefill(prefill, [prompt])
    moved = core.scheduler.num_remote_blocks_pulled + core.kv.hit_tokens_by_tier["L3"] // 16
    assert_same_pages(prompt_pages(decode, prompt, SamplingParams(**DECODE, kv_transfer_params=pull)),
                      prompt_pages(plain, prompt))
    assert core.scheduler.num_remote_blocks_pulled + core.kv.hit_tokens_by_tier["L3"] // 16 == moved + 6
    _wait_leases_freed(prefill)


def test_decode_pulls_only_the_blocks_it_does_not_hold(engine, plain):
    prefill = engine(kv_role="prefill")
    decode = engine(kv_role="decode")
    (prompt,) = _prompts(1, seed=2)
    decode.generate([prompt[:60]], SamplingParams(**DECODE))  # it caches 3 blocks of it
    params = _prefill(prefill, [prompt])
    expected = [plain.generate([prompt], SamplingParams(**DECODE))[0].outputs[0].token_ids]
    out = decode.generate([prompt], SamplingParams(**DECODE, kv_transfer_params=params[0]))[0]
    assert [out.outputs[0].token_ids] == expected
    assert decode.engine.core.scheduler.num_remote_blocks_pulled == 3
    assert out.num_cached_tokens == 48  # its own hits; pulled blocks are not cache hits
    _wait_leases_freed(prefill)
    # Now it holds the whole prompt: nothing crosses, and the prefill side is told at once
    # (not after its 30 s lease).
    params = _prefill(prefill, [prompt])
    out = decode.generate([prompt], SamplingParams(**DECODE, kv_transfer_params=params[0]))[0]
    assert [out.outputs[0].token_ids] == expected and out.num_cached_tokens == 96
    assert decode.engine.core.scheduler.num_remote_blocks_pulled == 3
    _wait_leases_freed(prefill, timeout_s=5)


def test_a_request_aborted_before_its_pull_releases_the_lease(engine):
    """A decode request that ends before it pulls (its client left while it waited) tells
    the prefill instance at once, instead of leaving the blocks held to the lease timeout."""
    prefill = engine(kv_role="prefill")
    decode = engine(kv_role="decode")
    (prompt,) = _prompts(1, seed=5)
    params = _prefill(prefill, [prompt])
    assert prefill.engine.core.executor.worker.kv.server.num_leases == 1
    decode.engine.add_request("gone", prompt, SamplingParams(**DECODE,
                                                             kv_transfer_params=params[0]))
    decode.engine.abort_request("gone")
    assert not decode.engine.has_unfinished_requests()
    _wait_leases_freed(prefill)  # (its lease timeout is 30 s)
    assert prefill.engine.core.executor.worker.kv.server.num_expired == 0
    assert decode.engine.core.scheduler.num_remote_blocks_pulled == 0


def test_32_simultaneous_transfers(engine, plain):
    prefill = engine(kv_role="prefill")
    decode = engine(kv_role="decode", kv_host_memory=64 * 6 * 16 * 2 * 2 * 16 * 4)
    prompts = _prompts(32, seed=3)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, SamplingParams(**DECODE))]
    params = _prefill(prefill, prompts)
    assert _decode(decode, prompts, params) == expected
    assert decode.engine.core.scheduler.num_remote_blocks_pulled == 32 * 6
    assert prefill.engine.core.executor.worker.kv.server.num_pulls == 32
    _wait_leases_freed(prefill)


class _BadPrefill:
    """A real socket that answers pulls wrongly: never (stall) or with a corrupt block."""

    def __init__(self, behaviour: str, block_bytes: int) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.behaviour, self.block_bytes = behaviour, block_bytes
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with contextlib.suppress(OSError):  # the puller hangs up on a bad frame
                header, _ = recv_frame(conn, 0)
                if header.get("op") != "pull":  # the failed puller's release: not answered
                    pass
                elif self.behaviour == "corrupt":
                    payload = bytes(self.block_bytes)
                    send_frame(conn, {"op": "block", "i": 0, "hash": header["hashes"][0],
                                      "group": 0, "crc": zlib.crc32(payload) ^ 1}, payload)
                elif self.behaviour == "garbage":
                    conn.sendall(b"\xff\xff\xff\xff not a frame")
                time.sleep(3)  # "stall" never answers
            conn.close()


@pytest.mark.parametrize("failure", ["dead_prefill", "stall", "corrupt", "garbage", "corrupt_shm"])
def test_failed_transfers_recompute_and_free_blocks_on_both_sides(engine, plain, failure):
    prefill = engine(kv_role="prefill", kv_lease_s=0.5)
    decode = engine(kv_role="decode", kv_transfer_timeout=0.5,
                    kv_connector="shm" if failure.endswith("shm") else "tcp")
    prompts = _prompts(2, seed=4)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, SamplingParams(**DECODE))]
    params = _prefill(prefill, prompts)
    if failure == "dead_prefill":
        prefill.engine.core.executor.worker.kv.server.close()
    else:
        bad = _BadPrefill(failure.removesuffix("_shm"),
                          decode.engine.core.executor.worker.kv.mover.block_bytes)
        params = [{**p, "remote_port": bad.port} for p in params]
    assert _decode(decode, prompts, params) == expected  # recomputed locally
    core = decode.engine.core
    assert core.executor.worker.kv.mover.stats.remote_pull_failures == 2
    assert core.scheduler.num_prompt_tokens_computed == 2 * PROMPT_LEN
    _wait_leases_freed(prefill)  # nobody pulled: the prefill side's leases expire (0.5 s)


def test_fail_policy_fails_the_request_and_keeps_serving(engine, plain):
    prefill = engine(kv_role="prefill", kv_lease_s=0.2)
    decode = engine(kv_role="decode", kv_load_failure_policy="fail",
                 kv_transfer_timeout=0.5)
    prompts = _prompts(2, seed=5)
    params = _prefill(prefill, prompts)
    prefill.engine.core.executor.worker.kv.server.close()
    outs = decode.generate(prompts, [SamplingParams(**DECODE, kv_transfer_params=p) for p in params])
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error"]
    expected = plain.generate(prompts[:1], SamplingParams(**DECODE))[0].outputs[0].token_ids
    assert decode.generate(prompts[:1], SamplingParams(**DECODE))[0].outputs[0].token_ids == expected
    _wait_leases_freed(prefill)  # the leases expire (0.2 s)


def _ask(port: int, frame: dict) -> tuple[dict, bool]:
    """One raw request frame to a KV server: its first answer, and whether it then closed
    the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        send_frame(sock, frame)
        header, _ = recv_frame(sock, 1 << 20)
        sock.settimeout(2)
        try:
            closed = sock.recv(1) == b""
        except TimeoutError:
            closed = False
        return header, closed


def test_a_lease_is_readable_only_by_who_holds_its_random_id_and_the_secret(engine, plain):
    """A lease is named by 128 random bits, not the request id; the KV server refuses, counts
    and closes a connection that names anything else, lacks the shared secret, or asks it to
    write into a shared-memory segment no connector made, and lends nothing to it; the decode
    instance holding the id and the secret pulls as usual."""
    prefill = engine(kv_role="prefill", kv_transfer_secret="s3cret", kv_lease_s=5)
    decode = engine(kv_role="decode", kv_transfer_secret="s3cret")
    prompts = _prompts(1, seed=7)
    out = prefill.generate(prompts, SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True}))[0]
    params = out.kv_transfer_params
    lease, port = params["remote_lease_id"], params["remote_port"]
    assert len(bytes.fromhex(lease)) == 16 and lease != out.request_id
    server = prefill.engine.core.executor.worker.kv.server
    layout = server.layout
    pull = dict(op="pull", hashes=params["remote_block_hashes"], layout=layout, mode="tcp",
                shm=None, release=False)
    attempts = [
        dict(pull, lease=out.request_id, secret="s3cret"),                 # the request id
        dict(pull, lease=lease),                                          # no secret
        dict(pull, lease=lease, secret="guess"),                          # a wrong secret
        dict(pull, lease=lease, secret="s3cret", mode="shm", shm="psm_victim"),
        dict(op="release", lease=lease, secret="wrong"),
        dict(op="stat", lease=lease, secret="s3cret"),
    ]
    for frame in attempts:
        header, closed = _ask(port, frame)
        assert header["op"] == "end" and header["n"] == 0 and header["error"], frame
        assert closed, frame
    assert server.num_rejected == len(attempts) and server.bytes_sent == 0
    assert server.num_leases == 1  # the refused release released nothing
    header, _ = _ask(port, dict(op="release", lease="ab" * 16, secret="s3cret"))
    assert header["op"] == "ok" and server.num_leases == 1  # releasing nothing: no refusal
    assert server.num_rejected == len(attempts)
    stats = prefill.engine.core.stats()
    assert stats["kv_transfer_rejected"] == len(attempts)
    # The holder of the id and the secret: the blocks, and the tokens of a plain run.
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, SamplingParams(**DECODE))]
    assert _decode(decode, prompts, [params]) == expected
    assert decode.engine.core.scheduler.num_remote_blocks_pulled == PROMPT_LEN // 16
    _wait_leases_freed(prefill)
    # A decode instance without the secret is refused, and recomputes.
    stranger = engine(kv_role="decode")
    params = _prefill(prefill, prompts)
    assert _decode(stranger, prompts, params) == expected
    assert stranger.engine.core.scheduler.num_remote_blocks_pulled == 0
    # Its pull was refused, then the release it sends after a failed pull.
    deadline = time.monotonic() + 10
    while server.num_rejected < len(attempts) + 2:
        assert time.monotonic() < deadline, server.num_rejected
        time.sleep(0.02)
    _wait_leases_freed(prefill, timeout_s=10)  # its refused release did not: it expires
