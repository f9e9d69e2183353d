// openinfer's chat page (GET /): a conversation with the served model over
// /v1/chat/completions, streamed, each turn's prompt tokens (and how many were a prefix-cache
// hit) shown under its answer. streamChat is the page's whole protocol: it yields {text} pieces,
// then {usage}; it runs in a browser and in node (tests/e2e/test_chat_page.py drives it
// against a real server).
"use strict";

async function* streamChat(base, apiKey, body, signal) {
  const headers = {"Content-Type": "application/json"};
  if (apiKey) headers.Authorization = "Bearer " + apiKey;
  const response = await fetch(base + "/v1/chat/completions", {
    method: "POST", headers, signal,
    body: JSON.stringify({...body, stream: true, stream_options: {include_usage: true}})});
  if (!response.ok) {
    const error = await response.json().catch(() => ({}));
    throw new Error((error.error && error.error.message) || response.statusText);
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {  // one server-sent event
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (delta && delta.content) yield {text: delta.content};
        if (chunk.usage) yield {usage: chunk.usage};
      }
    }
  }
}

if (typeof module !== "undefined") module.exports = {streamChat};

if (typeof document !== "undefined") {
  const $ = (id) => document.getElementById(id);
  const history = [];
  let running = null;

  function bubble(role, text) {
    const div = document.createElement("div");
    div.className = "msg " + role;
    div.textContent = text;
    $("log").appendChild(div);
    div.scrollIntoView();
    return div;
  }

  async function loadModel() {
    const key = $("key").value;
    const response = await fetch("/v1/models", {headers: key ? {Authorization: "Bearer " + key} : {}});
    const models = response.ok ? await response.json() : {data: []};
    $("model").textContent = models.data.length ? models.data[0].id : "(an API key is needed)";
    return models.data.length ? models.data[0].id : null;
  }

  async function send(event) {
    event.preventDefault();
    if (running) { running.abort(); return; }
    const text = $("input").value.trim();
    if (!text) return;
    $("input").value = "";
    localStorage.setItem("openinfer-key", $("key").value);
    const model = await loadModel();
    history.push({role: "user", content: text});
    bubble("user", text);
    const out = bubble("assistant", "");
    let usage = null;
    running = new AbortController();
    $("send").textContent = "Stop";
    const body = {model, messages: history, temperature: Number($("temperature").value)};
    if ($("max").value) body.max_tokens = Number($("max").value);
    try {
      for await (const piece of streamChat("", $("key").value, body, running.signal)) {
        if (piece.text) out.textContent += piece.text;
        if (piece.usage) usage = piece.usage;
      }
    } catch (error) {
      if (error.name !== "AbortError") bubble("error", String(error.message || error));
    }
    history.push({role: "assistant", content: out.textContent});
    if (usage) {
      const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
      bubble("usage", `prompt ${usage.prompt_tokens} tokens (${cached} cached) · ` +
                      `${usage.completion_tokens} generated`);
    }
    running = null;
    $("send").textContent = "Send";
  }

  window.addEventListener("load", () => {
    $("key").value = localStorage.getItem("openinfer-key") || "";
    $("form").addEventListener("submit", send);
    $("clear").addEventListener("click", () => { history.length = 0; $("log").textContent = ""; });
    loadModel();
    // A link may carry a first message: /?q=...&temperature=0&max_tokens=32 sends it.
    const link = new URLSearchParams(location.search);
    if (link.get("temperature")) $("temperature").value = link.get("temperature");
    if (link.get("max_tokens")) $("max").value = link.get("max_tokens");
    if (link.get("q")) {
      $("input").value = link.get("q");
      $("form").requestSubmit();
    }
  });
}
