"""Drive `dflash-rs serve` with the official `openai` package (pinned by
scripts/fetch-assets.sh): models, chat, completion, streaming, and the errors the client
raises for a bad request and an unknown model. Prints one JSON line of what it saw; exits
non-zero at the first thing that is not as OpenAI's API has it.

    python3 tests/clients/openai_client.py http://127.0.0.1:PORT/v1 MODEL
"""
import json
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=300)

ids = [m.id for m in client.models.list().data]
assert ids == [model], ids

msgs = [{"role": "user", "content": "What is 7 times 8?"}]
chat = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0)
choice = chat.choices[0]
assert choice.message.role == "assistant" and choice.message.content, chat
assert choice.finish_reason in ("stop", "length"), choice.finish_reason
assert chat.usage.completion_tokens >= 1 and chat.usage.prompt_tokens > 0, chat.usage
assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
spec = chat.model_extra["speculative_decoding"]
assert spec["rounds"] >= 1, spec

stream = client.chat.completions.create(
    model=model, messages=msgs, max_tokens=24, temperature=0, stream=True,
    stream_options={"include_usage": True})
parts, reasons, usage = [], [], None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        parts.append(c.delta.content or "")
        if c.finish_reason:
            reasons.append(c.finish_reason)
# the stream's text is the whole response's, token for token at T = 0
assert "".join(parts) == choice.message.content, ("".join(parts), choice.message.content)
assert reasons == [choice.finish_reason], reasons
assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens, usage

comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                 temperature=0)
assert comp.choices[0].text and comp.usage.prompt_tokens > 0, comp

try:
    client.chat.completions.create(model=model, messages=msgs, temperature=-1)
    raise SystemExit("a negative temperature was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and e.body["param"] == "temperature", e.body

try:
    client.chat.completions.create(model="no-such-model", messages=msgs)
    raise SystemExit("an unknown model was accepted")
except openai.NotFoundError as e:
    assert e.status_code == 404, e

print(json.dumps({"chat": choice.message.content, "streamed_chunks": len(parts),
                  "completion": comp.choices[0].text, "ok": True}))
