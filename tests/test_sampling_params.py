"""SamplingParams: validation of the logit extras, n > 1 children, and the trip to the engine core."""

from __future__ import annotations

import pytest

from openinfer.engine import protocol
from openinfer.sampling_params import SamplingParams


def test_logit_bias_string_keys_become_ints():
    params = SamplingParams(logit_bias={"50": -100, 7: 2, " 9 ": 0.5})
    assert params.logit_bias == {50: -100.0, 7: 2.0, 9: 0.5}
    assert all(type(k) is int for k in params.logit_bias)


@pytest.mark.parametrize("bias", [
    {"abc": 1.0}, {"1.5": 1.0}, {"-3": 1.0}, {-3: 1.0}, {True: 1.0}, {None: 1.0},
    {1: 100.5}, {1: -101}, {1: float("nan")}, {1: float("inf")}, {1: "5"}, {1: True},
    {1: 1.0, "1": 2.0}, [1, 2],
])
def test_bad_logit_bias_names_the_field(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


@pytest.mark.parametrize("kwargs, field", [
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
    (dict(allowed_token_ids=["3"]), "allowed_token_ids"),
    (dict(allowed_token_ids=5), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
    (dict(bad_words=["  "]), "bad_words"),
    (dict(bad_words="word"), "bad_words"),
    (dict(bad_words=[3]), "bad_words"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=2.0), "truncate_prompt_tokens"),
])
def test_bad_extras_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_valid_extras_are_kept():
    params = SamplingParams(allowed_token_ids=(4, 2), bad_words=["a", "b", "a"],
                            truncate_prompt_tokens=-1)
    assert params.allowed_token_ids == [4, 2]
    assert params.bad_words == ["a", "b"]
    assert SamplingParams(truncate_prompt_tokens=3).truncate_prompt_tokens == 3
    assert not SamplingParams().edits_logits
    assert not SamplingParams(bad_words=["a"]).edits_logits  # not resolved into tokens yet
    assert SamplingParams(logit_bias={1: 0.0}).edits_logits
    assert SamplingParams(allowed_token_ids=[1]).edits_logits


def test_bad_words_token_ids_are_checked():
    params = SamplingParams(bad_words=["a"])
    for sequences in ([[]], [[1, -1]], [1], "x"):
        with pytest.raises(ValueError, match="bad_words"):
            params.set_bad_words_token_ids(sequences)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams().set_bad_words_token_ids([[1]])
    params.set_bad_words_token_ids([(1, 2), [3]])
    assert params.bad_words_token_ids == [[1, 2], [3]]
    assert params.edits_logits


def resolved_params(**kwargs) -> SamplingParams:
    params = SamplingParams(logit_bias={"5": 1.5, 9: -100}, allowed_token_ids=[5, 9, 11],
                            bad_words=["foo"], truncate_prompt_tokens=12, **kwargs)
    params.set_bad_words_token_ids([[3, 4], [7]])
    return params


def test_n_children_carry_the_extras_and_resolved_bad_words():
    params = resolved_params(n=3, seed=10)
    for i in range(3):
        child = params.child(i)
        assert (child.n, child.seed) == (1, 10 + i)
        assert child.logit_bias == {5: 1.5, 9: -100.0}
        assert child.allowed_token_ids == [5, 9, 11]
        assert child.bad_words == ["foo"] and child.bad_words_token_ids == [[3, 4], [7]]
        assert child.truncate_prompt_tokens == 12


def test_params_survive_the_engine_core_protocol():
    params = resolved_params(temperature=0.5)
    frame = protocol.encode(protocol.ADD, protocol.add_body("r", [1, 2], params, 0.0))
    kind, body = protocol.decode(frame)
    assert kind == protocol.ADD
    received = protocol.params_from_body(body)
    assert received == params
    assert received.bad_words_token_ids == [[3, 4], [7]]
    assert received.logit_bias == {5: 1.5, 9: -100.0}
    assert protocol.params_from_body(protocol.decode(
        protocol.encode(protocol.ADD, protocol.add_body("r", [1], SamplingParams(), 0.0)))[1]
    ) == SamplingParams()


def test_kv_transfer_params_are_parsed_once_into_a_frozen_value():
    from openinfer.kv.remote import KVTransferParams

    p = SamplingParams(kv_transfer_params={"remote_host": "10.0.0.1", "remote_port": 7000,
                                           "remote_lease_id": "r1",
                                           "remote_block_hashes": ["ab", "cd01"]})
    params = p.kv_transfer_params
    assert isinstance(params, KVTransferParams) and params.pulls
    assert params.remote_block_hashes == (b"\xab", b"\xcd\x01")
    assert SamplingParams.from_wire(p.to_wire()) == p            # bytes cross msgpack
    assert params.to_dict(hex_hashes=True)["remote_block_hashes"] == ["ab", "cd01"]
    assert SamplingParams(kv_transfer_params={"do_remote_decode": True}).kv_transfer_params \
        == KVTransferParams(do_remote_decode=True)
    for bad, field in [({"remote_engine_id": "x"}, "remote_engine_id"),
                       ({"do_remote_decode": "yes"}, "do_remote_decode"),
                       ({"remote_host": "h", "remote_port": 0}, "remote_port"),
                       ({"remote_block_hashes": ["ab"]}, "remote_host"),
                       ({"remote_host": "h", "remote_port": 1, "remote_block_hashes": "ab"},
                        "remote_block_hashes"),
                       ([1], "must be an object")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(kv_transfer_params=bad)
