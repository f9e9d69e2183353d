"""Messages between a front end and the engine-core process.

msgpack frames over ZMQ (never pickle): ``[kind, body]``.

    front end -> core:  add {request_id, prompt_token_ids, params, arrival_time}
                        abort [request_id, ...]
                        utility {call_id, method}      (admin calls: reset_prefix_cache, stats)
                        shutdown null
    core -> front end:  ready {num_blocks, block_size, max_model_len}
                        outputs {outputs: [EngineCoreOutput as a list], stats: {...}}
                        utility_result {call_id, result | error}
                        error "message"   (the core could not start, or died)
"""

from __future__ import annotations

from typing import Any

import msgpack

from openinfer.engine.outputs import EngineCoreOutput
from openinfer.kv.remote import KVTransferParams
from openinfer.outputs import Logprob, PositionLogprobs, PromptSources
from openinfer.sampling_params import SamplingParams

ADD, ABORT, UTILITY, SHUTDOWN = "add", "abort", "utility", "shutdown"
READY, OUTPUTS, UTILITY_RESULT, ERROR = "ready", "outputs", "utility_result", "error"


def encode(kind: str, body: Any = None) -> bytes:
    return msgpack.packb([kind, body], use_bin_type=True)


def decode(frame: bytes) -> tuple[str, Any]:
    kind, body = msgpack.unpackb(frame, raw=False)
    return kind, body


def add_body(request_id: str, prompt_token_ids: list[int], params: SamplingParams,
             arrival_time: float) -> dict:
    return {"request_id": request_id, "prompt_token_ids": prompt_token_ids,
            "params": params.to_wire(), "arrival_time": arrival_time}


def params_from_body(body: dict) -> SamplingParams:
    return SamplingParams.from_wire(body["params"])


def _pack_logprobs(entry: PositionLogprobs) -> list:
    return [[token_id, lp.logprob, lp.rank] for token_id, lp in entry.items()]


def _unpack_logprobs(packed: list) -> PositionLogprobs:
    return {token_id: Logprob(logprob, rank) for token_id, logprob, rank in packed}


def pack_output(out: EngineCoreOutput) -> list:
    prompt = None
    if out.prompt_logprobs is not None:
        start, entries = out.prompt_logprobs
        prompt = [start, [_pack_logprobs(e) for e in entries]]
    return [out.request_id, out.new_token_ids,
            None if out.new_logprobs is None else [_pack_logprobs(e) for e in out.new_logprobs],
            prompt, out.finish_reason, out.stop_reason, out.num_cached_tokens,
            None if out.kv_transfer_params is None else out.kv_transfer_params.to_dict(),
            out.first_scheduled_time,
            None if out.prompt_sources is None else out.prompt_sources.to_wire(),
            out.pinned_tokens]


def unpack_output(packed: list) -> EngineCoreOutput:
    (request_id, tokens, logprobs, prompt, finish_reason, stop_reason, num_cached, kv,
     scheduled, sources, pinned) = packed
    return EngineCoreOutput(
        request_id=request_id,
        new_token_ids=tokens,
        new_logprobs=None if logprobs is None else [_unpack_logprobs(e) for e in logprobs],
        prompt_logprobs=None if prompt is None else (
            prompt[0], [_unpack_logprobs(e) for e in prompt[1]]),
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        num_cached_tokens=num_cached,
        kv_transfer_params=KVTransferParams.parse(kv),
        first_scheduled_time=scheduled,
        prompt_sources=None if sources is None else PromptSources(*sources),
        pinned_tokens=pinned,
    )
