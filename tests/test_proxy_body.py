"""The request body's one parse (proxy/body.py): its limits, its stand-ins for long strings, and the bounded
structures it feeds (the prefix index, the peers' feed)."""
from __future__ import annotations

import json

import pytest

from proxy.body import SCAN_CHUNK, Limits, Refused, loads, parse
from proxy.routing.prefix import BLOCK_BYTES, PrefixIndex, prompt_blocks
from proxy.share import _within


def chat(*content, **extra) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": c} for c in content],
                       **extra}).encode()


@pytest.mark.unit
@pytest.mark.parametrize("body, says", [
    (json.dumps({"model": "m", "messages": [{"role": "user", "content": [{}] * 60_000}]}).encode(),
     "proxy.limits.max_json_values"),
    (b'{"model": "m", "x": ' + b"[" * 1000 + b"]" * 1000 + b"}", "proxy.limits.max_json_depth"),
    (b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "proxy.limits.max_json_depth"),
    (chat(*["hi"] * 9000), "proxy.limits.max_messages"),
    (chat(["a"] * 5000), "a message has 5000 content parts; at most 4096"),
    (chat("x" * (8192 * BLOCK_BYTES + 1)), "proxy.limits.max_prompt_blocks"),
    (json.dumps({"prompt": "y" * (8192 * BLOCK_BYTES * 7)}).encode(), "proxy.limits.max_prompt_blocks"),
])
def test_a_body_past_a_limit_is_refused_naming_it(body, says):
    with pytest.raises(Refused) as e:
        prompt_blocks(parse(body))
    assert says in str(e.value)


@pytest.mark.unit
def test_long_strings_are_stood_in_for_and_come_back_byte_for_byte():
    image = "data:image/png;base64," + "QUJD" * 50_000
    body = chat([{"type": "text", "text": "caf\u00e9 \"quoted\"\n" * 10_000},
                 {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "Describe it. " * 20}], user=42)
    parsed = parse(body)
    assert parsed.spans and parsed.model == "m" and parsed.user == 42
    text = parsed.text(parsed.request["messages"][0]["content"][0]["text"])
    assert text == "caf\u00e9 \"quoted\"\n" * 10_000 and len(text) > SCAN_CHUNK and len(parsed.spans) == 2
    again = json.loads(parsed.with_user("42"))
    assert again == {**json.loads(body), "user": "42"}
    other = parse(chat([{"type": "text", "text": "caf\u00e9 \"quoted\"\n" * 10_000},
                        {"type": "image_url", "image_url": {"url": image[:-4] + "QUJE"}}, {"type": "text", "text": "Describe it. " * 20}]))
    assert prompt_blocks(parsed)[-1] != prompt_blocks(other)[-1]     # the image counts by its bytes
    assert prompt_blocks(parsed) == prompt_blocks(body)


@pytest.mark.unit
@pytest.mark.parametrize("body", [b"", b"[1]", b"not json", b'{"a": "\\"', b'{"model": "\xff\xfe"}',
                                  b'{"a": "' + b"\\" * 5, b'{"model": 1e999999}', b'{"user": "\\ud800"}',
                                  b'{"model": "' + b"x" * 200_000])
def test_what_is_not_a_json_object_is_left_to_the_engine(body):
    parsed = parse(body)
    assert parsed.request is None or isinstance(parsed.request, dict)
    assert prompt_blocks(parsed) == [] and parsed.model in (None, "")


@pytest.mark.unit
@pytest.mark.parametrize("text", [
    b'{"model": "m", "user": "\xc3\xa9t\xc3\xa9"}', '{"a": "\u00e9"}'.encode("utf-16"), '{"a": 1}'.encode("utf-16-le"),
    '{"a": 1}'.encode("utf-32"), b"\xef\xbb\xbf{}", b'{"a": "\xed\xb0\x80"}', b"{", b"{\xff}", b" {}", b"[1]", b"",
])
def test_a_json_text_reads_as_json_loads_reads_it(text):
    """loads decodes a text opening with `{` as UTF-8 at once: what it reads, and what it refuses (ValueError),
    is json.loads's, whatever the text's encoding (UTF-16 and UTF-32, a BOM, a lone surrogate, not UTF-8)."""
    try:
        expected = json.loads(text)
    except ValueError as e:
        with pytest.raises(ValueError):
            loads(text)
        assert isinstance(e, ValueError)
    else:
        assert loads(text) == expected


@pytest.mark.unit
def test_limits_are_settings():
    small = Limits(max_content_parts=2)
    with pytest.raises(Refused, match="at most 2 are accepted"):
        prompt_blocks(parse(chat(["a", "b", "c"]), small))


@pytest.mark.unit
def test_the_prefix_index_never_holds_more_than_max_blocks_while_it_inserts(monkeypatch):
    index = PrefixIndex(max_blocks=100)
    sizes = []
    real = index._evict_oldest
    monkeypatch.setattr(index, "_evict_oldest", lambda: (sizes.append(len(index)), real()))
    index.insert(list(range(80)), "b0")
    index.insert(list(range(1000, 1150)), "b1")    # a prompt longer than the index: its tail goes first
    assert max(sizes) == 100 and len(index) == 100
    assert index.match(list(range(1000, 1150))) == {"b1": 100}


@pytest.mark.unit
def test_the_feed_answer_is_bounded_in_blocks_newest_first():
    decisions = [(i, "b0", list(range(3000))) for i in range(1, 6)]
    assert [d[0] for d in _within(decisions, 8192)] == [4, 5]
    assert [d[0] for d in _within([(9, "b0", list(range(20000)))], 8192)] == [9]   # at least one


@pytest.mark.unit
def test_the_limits_section_of_the_proxy_config(tmp_path):
    from proxy.config import ConfigError, load_config
    path = tmp_path / "proxy.yaml"
    path.write_text("backends: ['127.0.0.1:9']\nlimits: {max_content_parts: 16, inline_kb: 8}\n")
    limits = load_config(path).limits
    assert (limits.max_content_parts, limits.inline_kb, limits.max_messages) == (16, 8, Limits().max_messages)
    for bad, says in (("{max_json_depth: 5000}", "at most 512"), ("{max_messages: 0}", "at least 1"),
                      ("{max_parts: 3}", "unknown config key 'limits.max_parts'")):
        path.write_text(f"backends: ['127.0.0.1:9']\nlimits: {bad}\n")
        with pytest.raises(ConfigError, match=says):
            load_config(path)
