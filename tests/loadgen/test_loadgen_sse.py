"""The incremental SSE parser against the event-stream framing rules."""

import pytest

from kvpilot.loadgen.request_client import SSEDecoder, build_payload, endpoint_is_chat, RequestInput

STREAM = (
    'data: {"choices": [{"text": "h\u00e9llo \U0001f600"}]}\n\n'
    ": ping\n\n"
    'data: {"choices": [{"text": " world"}]}\n\n'
    "data: [DONE]\n\n"
).encode()
EVENTS = ['{"choices": [{"text": "h\u00e9llo \U0001f600"}]}', '{"choices": [{"text": " world"}]}', "[DONE]"]


def feed_in_pieces(data: bytes, cuts: list[int]) -> list[str]:
    decoder, events, prev = SSEDecoder(), [], 0
    for cut in [*cuts, len(data)]:
        events += decoder.feed(data[prev:cut])
        prev = cut
    return events + decoder.close()


def test_whole_stream_in_one_chunk():
    assert feed_in_pieces(STREAM, []) == EVENTS


def test_every_split_point_gives_the_same_events():
    # includes splits inside the multi-byte characters and between the two newlines
    for cut in range(1, len(STREAM)):
        assert feed_in_pieces(STREAM, [cut]) == EVENTS, cut


def test_byte_by_byte_feed():
    assert feed_in_pieces(STREAM, list(range(1, len(STREAM)))) == EVENTS


@pytest.mark.parametrize("newline", ["\r\n", "\r"])
def test_crlf_and_cr_line_ends(newline):
    data = STREAM.decode().replace("\n", newline).encode()
    assert feed_in_pieces(data, []) == EVENTS
    for cut in range(1, len(data)):  # "\r" | "\n" split across chunks must not make an extra blank line
        assert feed_in_pieces(data, [cut]) == EVENTS, cut


def test_multiline_data_fields_and_other_fields():
    data = b"event: message\nid: 7\nretry: 100\ndata: first\ndata:second\n\n"
    assert feed_in_pieces(data, []) == ["first\nsecond"]


def test_event_without_closing_blank_line_is_returned_by_close():
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"usage": {}}') == []
    assert decoder.close() == ['{"usage": {}}']


def test_blank_lines_without_data_make_no_event():
    assert feed_in_pieces(b"\n\n: comment only\n\n\n", []) == []


def test_endpoint_kind_from_url():
    assert endpoint_is_chat("http://h:1/v1/chat/completions") is True
    assert endpoint_is_chat("http://h:1/v1/completions/") is False
    with pytest.raises(ValueError, match="must end with"):
        endpoint_is_chat("http://h:1/generate")


def test_payloads_follow_the_openai_shapes():
    base = dict(prompt="hi", prompt_len=1, output_len=16, model="m", api_url="http://h/v1/completions")
    completion = build_payload(RequestInput(**base, ignore_eos=True, extra_body={"temperature": 0}))
    assert completion == {"model": "m", "prompt": "hi", "max_tokens": 16, "stream": True,
                          "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0}
    chat = build_payload(RequestInput(**base, chat=True))
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert chat["max_completion_tokens"] == chat["max_tokens"] == 16
    assert "prompt" not in chat and "ignore_eos" not in chat
