"""A 32-turn chat with a tiny DeepSeek-V4 through two real servers, one with prefix caching
(window snapshots every 16 tokens, so later turns resume from the last turn's snapshot) and
one without: every reply is the same, and the caching server reports cached prompt tokens."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import DEEPSEEK_V4, build_checkpoint, randomize_v4
from server_process import MODEL, metrics, start_servers, stop

TURNS = 32


@pytest.mark.slow
def test_32_turn_chat_gives_the_same_replies_with_and_without_caching(tmp_path, tokenizer):
    import openai

    path = build_checkpoint(tmp_path / "v4", "DeepseekV4ForCausalLM", tokenizer, extra_config=DEEPSEEK_V4,
                            num_layers=4, num_heads=4, num_kv_heads=1, head_dim=32,
                            intermediate_size=32, max_position_embeddings=4096)
    randomize_v4(path)
    common = ("--block-size", "4", "--max-model-len", "2048")
    (cached_url, cached), (plain_url, plain) = start_servers(  # both at once
        (path, *common, "--window-snapshot-interval", "16"), (path, *common, "--no-prefix-caching"))
    pool = ThreadPoolExecutor(2)
    try:
        clients = [openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
                   for url in (cached_url, plain_url)]

        def ask(chat: list[dict]) -> list:
            """The same chat to both servers at once (each computes on one core)."""
            return list(pool.map(lambda c: c.chat.completions.create(
                model=MODEL, messages=chat, max_tokens=4, temperature=0), clients))

        messages: list[dict] = []
        hits = []
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"Turn {turn}: tell me more."})
            replies = ask(messages)
            texts = [r.choices[0].message.content for r in replies]
            assert texts[0] == texts[1], f"turn {turn}: {texts}"
            details = replies[0].usage.prompt_tokens_details
            hits.append(details.cached_tokens if details else 0)
            messages.append({"role": "assistant", "content": texts[0]})
        # From the second turn on, the conversation so far is found in the cache.
        assert all(h > 0 for h in hits[1:]), hits
        # Each turn resumes at the last one's final block, whose window pages are kept: no
        # replay. A branch from inside an earlier turn (an edited question) hits up to a
        # block between window snapshots: it resumes from the snapshot behind it and replays
        # the rest, and the reply is still the plain server's.
        for turn in (9, 17, 22, 30):
            branch = messages[:2 * turn] + [
                {"role": "user", "content": f"Turn {turn}: tell me less, please."}]
            replies = ask(branch)
            texts = [r.choices[0].message.content for r in replies]
            assert texts[0] == texts[1], f"branch at turn {turn}: {texts}"
            assert replies[0].usage.prompt_tokens_details.cached_tokens > 0
        assert metrics(cached_url)["openinfer:window_replayed_tokens_total"] > 0
    finally:
        pool.shutdown()
        stop(cached)
        stop(plain)
