"""AsyncLLM: the server's engine (front end here, core in a child process), streamed."""

from __future__ import annotations

import asyncio

import pytest

from openinfer import LLM, SamplingParams
from openinfer.engine.async_llm import AsyncLLM

PROMPTS = ["Hello there, how are you", "The quick brown fox", "import json\nimport os"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


async def _stream(llm: AsyncLLM, prompt, params, request_id: str) -> dict[int, dict]:
    """Concatenate the deltas of each sample (checking nothing follows the final one)."""
    samples: dict[int, dict] = {}
    finished = False
    async for delta in llm.generate(prompt, params, request_id):
        assert not finished, "a delta after the final one"
        for c in delta.outputs:
            s = samples.setdefault(c.index, {"text": "", "tokens": [], "finish": None})
            s["text"] += c.text
            s["tokens"] += c.token_ids
            s["finish"] = c.finish_reason
        finished = delta.finished
    assert finished
    return samples


@pytest.mark.slow
def test_streamed_outputs_equal_offline_and_aborts_free_blocks(qwen3_checkpoint):
    offline = LLM(str(qwen3_checkpoint), progress=False)
    expected = offline.generate(PROMPTS, GREEDY)
    tokens = offline.get_tokenizer()
    stop = expected[1].outputs[0].text[4:7]
    stopped = offline.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16,
                                                          ignore_eos=True, stop=[stop]))[0]

    async def scenario() -> None:
        llm = AsyncLLM(str(qwen3_checkpoint), kv_cache_memory=1 << 24)
        await llm.start()
        try:
            got = await asyncio.gather(*(_stream(llm, p, GREEDY, f"r{i}")
                                         for i, p in enumerate(PROMPTS)))
            for out, samples in zip(expected, got):
                assert samples[0]["tokens"] == out.outputs[0].token_ids
                assert samples[0]["text"] == out.outputs[0].text
                assert samples[0]["finish"] == "length"

            # A stop string: the streamed text ends before it, and never contained it.
            s = (await _stream(llm, PROMPTS[1], SamplingParams(
                temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]), "stop"))[0]
            assert s["text"] == stopped.outputs[0].text and stop not in s["text"]
            assert s["finish"] == "stop"

            # n=2 seeded samples stream under their indices.
            two = await _stream(llm, PROMPTS[0], SamplingParams(
                n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True), "two")
            assert sorted(two) == [0, 1] and all(len(v["tokens"]) == 8 for v in two.values())
            assert two[0]["text"] == tokens.decode(two[0]["tokens"], skip_special_tokens=True)

            # Bad input fails before queueing; the engine keeps serving.
            with pytest.raises(ValueError, match="prompt"):
                await _stream(llm, "", GREEDY, "bad")

            # Consumers that walk away mid-stream abort their requests.
            long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            aborted = llm.client.stats["num_aborted"]
            for i in range(4):
                async for _ in llm.generate(PROMPTS[i % 3], long, f"gone{i}"):
                    break
            for _ in range(200):
                stats = llm.client.stats
                if stats.get("num_running") == 0 and stats.get("kv_cache_usage") == 0:
                    break
                await asyncio.sleep(0.05)
            assert llm.client.stats["num_running"] == 0
            assert llm.client.stats["kv_cache_usage"] == 0
            # The core ended all four live (none ran to its 400 tokens first).
            assert llm.client.stats["num_aborted"] == aborted + 4
            assert not llm.output_processor.has_unfinished_requests()
            again = await _stream(llm, PROMPTS[0], GREEDY, "again")
            assert again[0]["tokens"] == expected[0].outputs[0].token_ids
        finally:
            await llm.shutdown()

    asyncio.run(scenario())
