"""The OpenAI-compatible schemas against the stock `openai` client: a stub server on 127.0.0.1
validates what the client sends with the request schemas and answers with the response schemas
and SSE helpers, and the client must parse every answer."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from pydantic import ValidationError

openai = pytest.importorskip("openai")

from flotilla.serve._openai import (SSE_DONE, AssistantMessage, ChatChoice, ChatCompletionRequest,
                                    ChatCompletionResponse, CompletionChoice, CompletionRequest, CompletionResponse,
                                    Usage, chat_stream, completion_stream, new_id, openai_error)

PIECES = ["Hel", "lo", " wor", "ld"]


class _Stub(BaseHTTPRequestHandler):
    seen: list = []

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):
        raw = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        schema = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}[self.path]
        try:
            request = schema.model_validate(raw)
        except ValidationError as e:
            status, body = openai_error(e)
            return self._send(status, "application/json", json.dumps(body).encode())
        self.seen.append((self.path, raw, request))
        usage = Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7)
        chat = schema is ChatCompletionRequest
        if request.stream:
            events = (chat_stream if chat else completion_stream)(request.model, PIECES, ["length"],
                                                                   (lambda: usage) if request.include_usage else None)
            return self._send(200, "text/event-stream", b"".join(events))
        if chat:
            cid, created = new_id("chatcmpl")
            response = ChatCompletionResponse(id=cid, created=created, model=request.model, usage=usage, choices=[
                ChatChoice(message=AssistantMessage(content="".join(PIECES)), finish_reason="stop")])
        else:
            cid, created = new_id("cmpl")
            response = CompletionResponse(id=cid, created=created, model=request.model, usage=usage,
                                          choices=[CompletionChoice(text="".join(PIECES), finish_reason="stop")])
        self._send(200, "application/json", response.model_dump_json().encode())

    def _send(self, status, kind, payload):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture(scope="module")
def client():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_port}/v1", api_key="unused", max_retries=0,
                        timeout=10)
    server.shutdown()
    server.server_close()


def test_chat_completions_from_the_stock_client(client):
    _Stub.seen.clear()
    answer = client.chat.completions.create(
        model="instruct", messages=[{"role": "developer", "content": "Be brief."},
                                    {"role": "user", "content": [{"type": "text", "text": "Say hello."}]}],
        max_completion_tokens=16, temperature=0.7, top_p=0.9, n=1, stop=["\n\n"], seed=3, user="u1",
        frequency_penalty=0, presence_penalty=0.0, logprobs=False, metadata={"team": "a"}, store=False,
        logit_bias={"2": -100, "300": 5})
    assert answer.choices[0].message.content == "Hello world" and answer.choices[0].finish_reason == "stop"
    assert answer.object == "chat.completion" and answer.usage.total_tokens == 7
    _, raw, request = _Stub.seen[-1]
    assert raw["max_completion_tokens"] == 16 and "stream" not in raw  # the client sends only what was passed
    assert request.token_limit == 16 and request.stop == ["\n\n"] and request.seed == 3
    assert request.token_biases == {2: -100.0, 300: 5.0}
    assert request.template_messages() == [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Say hello."}]


def test_chat_streams_are_read_piece_by_piece(client):
    pieces, reasons, usage = [], [], None
    for chunk in client.chat.completions.create(model="instruct", messages=[{"role": "user", "content": "hi"}],
                                                stream=True, stream_options={"include_usage": True}, max_tokens=4):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content)
            reasons.append(chunk.choices[0].finish_reason)
        else:
            usage = chunk.usage
    assert pieces == ["", *PIECES, None] and reasons == [None] * 5 + ["length"]
    assert usage.completion_tokens == 4
    # an earlier answer sent back as it came (`model_dump()` of a message) is accepted
    earlier = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]).choices[0]
    again = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"},
                                                                earlier.message.model_dump(),
                                                                {"role": "user", "content": "more"}])
    assert again.choices[0].message.content == "Hello world"


def test_completions_plain_and_streamed(client):
    answer = client.completions.create(model="instruct", prompt="def main(", max_tokens=8, temperature=0, seed=1,
                                       echo=False, best_of=1, logprobs=None)
    assert answer.choices[0].text == "Hello world" and answer.object == "text_completion"
    streamed = list(client.completions.create(model="instruct", prompt=["def main("], max_tokens=8, stream=True))
    assert [c.choices[0].text for c in streamed] == [*PIECES, ""]
    assert streamed[-1].choices[0].finish_reason == "length"
    assert client.completions.create(model="m", prompt=[1, 2, 3]).choices[0].text == "Hello world"  # token ids


def test_unsupported_requests_get_a_422_the_client_raises_with_the_field(client):
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], n=2)
    assert caught.value.param == "n" and "only n=1 is supported" in caught.value.message
    for kwargs, says in [(dict(presence_penalty=0.5), "`presence_penalty` is not supported"),
                         (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "`tools` is not supported"),
                         (dict(extra_body={"top_k": 5}), "top_k: unknown field; remove it"),
                         (dict(stop=["a", "b", "c", "d", "e"]), "at most 4"),
                         (dict(temperature=3), "less than or equal to 2"),
                         (dict(logit_bias={"2": -101}), "token 2: a bias is from -100 to 100; got -101"),
                         (dict(logit_bias={"<|im_end|>": -100}), 'keys are token ids, such as "13"')]:
        with pytest.raises(openai.UnprocessableEntityError, match=says):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], **kwargs)
    with pytest.raises(openai.UnprocessableEntityError, match="one prompt per request"):
        client.completions.create(model="m", prompt=["a", "b"])


def test_the_sse_format():
    events = list(chat_stream("m", ["a", "", "b"]))
    assert events[-1] == SSE_DONE == b"data: [DONE]\n\n"
    assert all(e.startswith(b"data: {") and e.endswith(b"}\n\n") for e in events[:-1])
    bodies = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
    assert [b["choices"][0]["delta"] for b in bodies] == [{"role": "assistant", "content": ""}, {"role": None, "content": "a"},
                                                         {"role": None, "content": "b"}, {"role": None, "content": None}]
    assert len({b["id"] for b in bodies}) == 1 and bodies[-1]["choices"][0]["finish_reason"] == "stop"
    status, body = openai_error("model 'x' is not served here", 404)
    assert status == 404 and body["error"]["message"] == "model 'x' is not served here"
    assert body["error"]["type"] == "invalid_request_error" and openai_error("late", 504)[1]["error"]["type"] == "server_error"


@pytest.mark.parametrize("field,value,says", [
    ("seed", 2**70, "less than or equal to 9223372036854775807"),
    ("seed", -1, "greater than or equal to 0"),
    ("temperature", 1e-300, "temperature of at least 0.01"),
    ("top_p", 0.0, "greater than 0"),
    ("stop", ["x" * 257], "at most 256 characters"),
    ("logit_bias", {str(i): 1.0 for i in range(301)}, "at most 300 token ids"),
])
def test_sampling_parameters_that_would_break_decoding_are_refused_naming_the_field(field, value, says):
    """What once answered 500 for a whole batch (a seed past 64 bits, a temperature that turns the
    probabilities into NaN) or made each decoded piece slow (long stop strings, huge biases) is a
    422 naming the field, for both endpoints."""
    for schema, body in ((ChatCompletionRequest, {"messages": [{"role": "user", "content": "Hi"}]}),
                         (CompletionRequest, {"prompt": "Hi"})):
        with pytest.raises(ValidationError) as e:
            schema.model_validate({"model": "m", field: value, **body})
        status, answer = openai_error(e.value)
        assert status == 422 and answer["error"]["param"] == field and says in answer["error"]["message"]


def test_a_tiny_top_p_keeps_the_most_likely_token():
    """top_p is in (0, 1]; one so small that float32 rounds it to 0 still samples the likeliest token."""
    import torch

    from flotilla.bundle._sampling import sample_next

    assert ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                                                 "top_p": 1e-300}).top_p == 1e-300
    logits = torch.tensor([1.0, 3.0, 2.0])
    assert {sample_next(logits, 1.0, None, 1e-300, torch.Generator().manual_seed(s)) for s in range(20)} == {1}


def test_an_error_answer_stays_small_whatever_the_request():
    """A body of thousands of bad fields lists 20 problems and counts the rest, under 16 KB."""
    from flotilla.serve._schemas import PredictRequest, listed_fields, validation_fields

    bad = {"instances": [[{"x": 1}] * 50] * 200, "k" * 100_000: 1}
    with pytest.raises(ValidationError) as e:
        PredictRequest.model_validate(bad)
    fields = validation_fields(e.value)
    assert len(fields) > 1000
    listed = listed_fields(fields)
    assert len(listed) == 21 and listed[-1].field == "(more)" and str(len(fields) - 20) in listed[-1].message
    assert len(json.dumps([f.model_dump() for f in listed])) < 16_000
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "bot", "content": "x"}] * 5000})
    assert len(json.dumps(openai_error(e.value)[1])) < 16_000


def test_log_probability_requests_parse_as_openai_and_lm_evaluation_harness_send_them():
    from pydantic import ValidationError

    from flotilla.serve._openai import ChatCompletionRequest, CompletionRequest

    # lm-evaluation-harness `local-completions`, a log-likelihood request: token ids in a list of one
    harness = CompletionRequest.model_validate({"model": "m", "prompt": [[5, 6, 7]], "temperature": 0, "max_tokens": 1,
                                                "logprobs": 1, "seed": 1234, "echo": True})
    assert harness.prompt == [5, 6, 7] and harness.top_logprobs_asked == 1 and harness.echo
    scored = CompletionRequest.model_validate({"model": "m", "prompt": "a b", "max_tokens": 0, "echo": True})
    assert scored.max_tokens == 0 and scored.top_logprobs_asked is None
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "logprobs": True, "top_logprobs": 3})
    assert chat.top_logprobs_asked == 3
    assert ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "logprobs": False}).top_logprobs_asked is None
    for body, says in [({"prompt": "a", "max_tokens": 0}, "`max_tokens: 0` generates nothing; it is for `echo: true`"),
                       ({"prompt": "a", "logprobs": 21}, "less than or equal to 20"),
                       ({"prompt": "a", "logprobs": 1, "stream": True}, "log-probabilities come with whole answers"),
                       ({"prompt": "a", "echo": True, "stream": True}, "`echo` comes with whole answers"),
                       ({"prompt": [[1, 2], [3]]}, "one prompt per request.*batch_size=1")]:
        with pytest.raises(ValidationError, match=says):
            CompletionRequest.model_validate({"model": "m", **body})
    for extra, says in [({"top_logprobs": 2}, "`top_logprobs` needs `logprobs: true`"),
                        ({"max_tokens": 0}, "greater than or equal to 1")]:
        with pytest.raises(ValidationError, match=says):
            ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra})
