"""A request's milestones (RequestMetrics): the engine core reports when it first scheduled
a request, across the process boundary too, so queue/prefill/decode times can be told apart."""

from __future__ import annotations

from openinfer import LLM, SamplingParams
from openinfer.engine import protocol
from openinfer.engine.outputs import EngineCoreOutput


def test_first_scheduled_time_survives_the_wire():
    out = EngineCoreOutput("r", [5], first_scheduled_time=12.5)
    assert protocol.unpack_output(protocol.pack_output(out)).first_scheduled_time == 12.5
    assert protocol.unpack_output(protocol.pack_output(EngineCoreOutput("r", []))) \
        .first_scheduled_time is None


def test_every_request_gets_ordered_milestones(qwen3_checkpoint):
    # max_num_seqs 1: the second and third prompts queue behind the first.
    llm = LLM(str(qwen3_checkpoint), progress=False, max_num_seqs=1)
    params = SamplingParams(max_tokens=5, ignore_eos=True, n=2, seed=0, temperature=1.0)
    outs = llm.generate(["first prompt", "second prompt", "third prompt"], params)
    for out in outs:
        m = out.metrics
        assert m is not None and m.first_scheduled_time is not None
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    # The later ones waited for the earlier ones to finish.
    assert outs[2].metrics.first_scheduled_time >= outs[0].metrics.first_token_time
