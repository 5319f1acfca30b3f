#!/usr/bin/env python3
"""Talks to a running `sluice serve` through the official `openai` and `anthropic`
Python clients and checks what they parse: chat and completions, whole and streamed,
usage, logprobs, a 400 raised as the client's own error, and Anthropic messages.

    check_clients.py URL QUESTION EXPECTED

EXPECTED is a text the greedy answer to QUESTION (a question about a capital: the
JSON-schema part asks for the city and country) must contain.
Exits non-zero, saying what differed, on any mismatch. Run by the serve tests with
the clients scripts/client_venv.sh installs.
"""

import json
import sys

import anthropic
import openai

url, asked, expected = sys.argv[1], sys.argv[2], sys.argv[3]
question = [{"role": "user", "content": asked}]
oa = openai.OpenAI(base_url=url + "/v1", api_key="unused")

models = [m.id for m in oa.models.list()]
assert len(models) == 1, models

whole = oa.chat.completions.create(model=models[0], messages=question, max_tokens=24, temperature=0)
text = whole.choices[0].message.content
assert expected in text, text
assert whole.choices[0].finish_reason in ("stop", "length"), whole
assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens, whole.usage

stream = oa.chat.completions.create(
    model=models[0], messages=question, max_tokens=24, temperature=0, stream=True,
    stream_options={"include_usage": True},
)
chunks = list(stream)
streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
assert streamed == text, (streamed, text)
assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens, chunks[-1]

lp = oa.chat.completions.create(model=models[0], messages=question, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
first = lp.choices[0].logprobs.content[0]
assert first.logprob == first.top_logprobs[0].logprob <= 0, first

done = oa.completions.create(model=models[0], prompt="Once upon a time", max_tokens=8, temperature=0)
assert done.choices[0].text and done.usage.completion_tokens == 8, done

schema = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40}},
    "required": ["city", "country"],
    "additionalProperties": False,
}
structured = oa.chat.completions.create(
    model=models[0], messages=question, max_tokens=60, temperature=0,
    response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}},
)
answer = json.loads(structured.choices[0].message.content)
assert set(answer) == {"city", "country"} and all(isinstance(v, str) for v in answer.values()), answer
assert expected in answer["city"], answer

try:
    oa.chat.completions.create(model=models[0], messages=question, max_tokens=10**6)
    raise SystemExit("a max_tokens past the context was accepted")
except openai.BadRequestError as e:
    assert "context" in str(e), e

an = anthropic.Anthropic(base_url=url, api_key="unused")
msg = an.messages.create(model=models[0], max_tokens=24, messages=question, extra_body={"temperature": 0})
assert msg.content[0].text == text, (msg.content[0].text, text)
assert msg.stop_reason in ("end_turn", "max_tokens"), msg
with an.messages.stream(model=models[0], max_tokens=24, messages=question, extra_body={"temperature": 0}) as s:
    assert "".join(s.text_stream) == text
    assert s.get_final_message().usage.output_tokens == msg.usage.output_tokens

print("clients: openai", openai.__version__, "and anthropic", anthropic.__version__, "parsed every answer")
