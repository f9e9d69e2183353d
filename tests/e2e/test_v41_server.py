"""`openinfer serve` on a tiny DeepSeek-V4.1 in DeepInfer's release format: chat and
completions, streamed and not, through the official client; the server's greedy tokens are
the offline engine's, and its replies are the same whether streamed or not."""

from __future__ import annotations

from server_process import MODEL, start_server, stop
from v41_checkpoint import build_v41_checkpoint

from openinfer import LLM, SamplingParams


def test_chat_and_completions_streamed_and_not(tmp_path):
    import openai

    path = build_v41_checkpoint(tmp_path / "v41")
    url, proc = start_server(path, "--block-size", "4", "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        prompt = "The compressed entries of a consumer layer"
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                         logprobs=1, extra_body={"ignore_eos": True})
        offline = LLM(str(path), dtype="float32", progress=False).generate(
            [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        assert done.choices[0].text == offline.outputs[0].text
        assert done.usage.completion_tokens == 8
        streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text

        messages = [{"role": "user", "content": "Which layers own a cache?"}]
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                               temperature=0)
        assert reply.choices[0].finish_reason in ("length", "stop") and reply.usage.prompt_tokens > 0
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                temperature=0, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == reply.choices[0].message.content
    finally:
        stop(proc)
