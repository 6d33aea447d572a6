"""The ShareGPT loader against the real (truncated) data file and SmolLM2's tokenizer,
and the random-prompt generator."""

import json
import random

import numpy as np
import pytest

from kvpilot.loadgen.datasets import (
    SampleRequest,
    encode_plain,
    is_valid_sequence,
    iter_sharegpt,
    sample_random_requests,
    sample_sharegpt_requests,
    sharegpt_pairs,
    token_ids,
)


class WhitespaceTokenizer:
    """A tokenizer with only encode(): one token per whitespace-separated word."""

    def encode(self, text):
        return [hash(w) % 1000 for w in text.split()]


class CallOnlyTokenizer:
    """A tokenizer with only a Hugging Face style __call__ on single texts."""

    def __call__(self, text):
        if not isinstance(text, str):
            raise TypeError("one text at a time")
        return {"input_ids": list(range(len(text.split())))}


def conv(prompt, reply, first="human"):
    second = "gpt" if first == "human" else "human"
    return {"id": "x", "conversations": [{"from": first, "value": prompt}, {"from": second, "value": reply}]}


def write_truncated(path, items, cut_bytes=40):
    text = json.dumps(items, indent=1)
    path.write_text(text[: len(text) - cut_bytes])  # cut inside the last item, as the wheel's file is
    return path


def test_real_file_streams_to_the_cut():
    count, last = 0, None
    for item in iter_sharegpt():
        count, last = count + 1, item
    assert count == 17671
    assert isinstance(last["conversations"], list) and last["id"]


def test_truncated_file_drops_the_partial_item(tmp_path):
    items = [conv(f"prompt {i}", f"reply {i}") for i in range(5)]
    path = write_truncated(tmp_path / "cut.json", items)
    assert [e["conversations"][0]["value"] for e in iter_sharegpt(path)] == [f"prompt {i}" for i in range(4)]


def test_corruption_before_the_end_raises(tmp_path):
    good = json.dumps([conv("a " * 50, "b " * 50) for _ in range(3000)])  # well past ijson's read buffer
    path = tmp_path / "bad.json"
    path.write_text(good.replace("}, {", "}, ]{", 1))  # broken between items 0 and 1
    with pytest.raises(ValueError, match="malformed JSON"):
        list(iter_sharegpt(path))


def test_first_thousand_raw_pairs_match_design_stats(smollm2_tokenizer):
    # DESIGN.md: first 1,000 (turn 0, turn 1) pairs with SmolLM2's tokenizer, before the
    # length filter: prompt mean 420, p50 210; output mean 216, p50 135.
    pairs = []
    for pair in sharegpt_pairs():
        pairs.append(pair)
        if len(pairs) == 1000:
            break
    ids = smollm2_tokenizer([t for pair in pairs for t in pair]).input_ids
    prompt = np.array([len(x) for x in ids[0::2]])
    output = np.array([len(x) for x in ids[1::2]])
    assert prompt.mean() == pytest.approx(420, abs=1)
    assert np.median(prompt) == pytest.approx(210, abs=1)
    assert output.mean() == pytest.approx(216, abs=1)
    assert np.median(output) == pytest.approx(135, abs=1)


def test_vllm_filter_on_first_thousand_in_file_order(smollm2_tokenizer):
    reqs = sample_sharegpt_requests(smollm2_tokenizer, 1000, shuffle=False)
    assert len(reqs) == 1000
    prompt = np.array([r.prompt_len for r in reqs])
    output = np.array([r.expected_output_len for r in reqs])
    assert prompt.min() >= 4 and output.min() >= 4 and prompt.max() <= 1024
    assert (prompt + output).max() <= 2048
    # the filter drops long prompts, so the kept ones are shorter than the raw 420 mean
    assert prompt.mean() == pytest.approx(244.6, abs=1) and np.median(prompt) == pytest.approx(123.5, abs=1)
    assert output.mean() == pytest.approx(218.8, abs=1) and np.median(output) == pytest.approx(138, abs=1)
    for r in reqs[:20]:
        assert r.prompt_len == len(smollm2_tokenizer(r.prompt).input_ids)


def test_seeded_shuffle_reproduces_vllm_order(smollm2_tokenizer):
    reqs = sample_sharegpt_requests(smollm2_tokenizer, 5, seed=0)
    # vLLM: random.seed(seed); random.shuffle(data); then the first valid entries
    pairs = list(sharegpt_pairs())
    state = random.getstate()
    random.seed(0)
    random.shuffle(pairs)
    random.setstate(state)
    expected = []
    for prompt, reply in pairs:
        p, o = len(token_ids(smollm2_tokenizer, prompt)), len(token_ids(smollm2_tokenizer, reply))
        if is_valid_sequence(p, o):
            expected.append(SampleRequest(prompt, p, o))
        if len(expected) == 5:
            break
    assert reqs == expected
    assert sample_sharegpt_requests(smollm2_tokenizer, 5, seed=1) != reqs


def test_fixed_output_length_overrides_reference(smollm2_tokenizer):
    reqs = sample_sharegpt_requests(smollm2_tokenizer, 300, shuffle=False, output_len=2)
    assert {r.expected_output_len for r in reqs} == {2}  # below the min-length rule: allowed when fixed
    assert len(reqs) == 300
    unfixed = sample_sharegpt_requests(smollm2_tokenizer, 300, shuffle=False)
    # pairs with a reply < 4 tokens are kept only when the output length is fixed
    assert [r.prompt for r in reqs] != [r.prompt for r in unfixed]


def test_duck_typed_tokenizers_and_oversampling(tmp_path):
    items = [conv("one two three four five", "a b c d e f"), conv("too short", "a b c d e"),
             conv("w x y z", "reply with enough words", first="gpt")]
    path = write_truncated(tmp_path / "small.json", items + [conv("cut", "cut")])
    for tokenizer in (WhitespaceTokenizer(), CallOnlyTokenizer()):
        reqs = sample_sharegpt_requests(tokenizer, 2, shuffle=False, path=path)
        assert [(r.prompt_len, r.expected_output_len) for r in reqs] == [(5, 6), (4, 4)]
    reqs = sample_sharegpt_requests(WhitespaceTokenizer(), 7, path=path, seed=3)
    assert len(reqs) == 7 and {r.prompt for r in reqs} == {"one two three four five", "w x y z"}
    assert len(sample_sharegpt_requests(WhitespaceTokenizer(), 7, path=path, oversample=False)) == 2


def test_is_valid_sequence_boundaries():
    assert is_valid_sequence(4, 4) and is_valid_sequence(1024, 1024)
    assert not is_valid_sequence(3, 100) and not is_valid_sequence(100, 3)
    assert not is_valid_sequence(1025, 4) and not is_valid_sequence(1024, 1025)
    assert is_valid_sequence(100, 1, skip_min_output_len_check=True)


def test_bad_request_counts_are_rejected():
    with pytest.raises(ValueError, match="num_requests"):
        sample_sharegpt_requests(WhitespaceTokenizer(), 0)


def test_random_prompts_have_their_stated_token_counts(smollm2_tokenizer):
    reqs = sample_random_requests(smollm2_tokenizer, 16, input_len=200, output_len=32, range_ratio=0.25, seed=4)
    for r in reqs:
        assert r.prompt_len == len(encode_plain(smollm2_tokenizer, r.prompt))
        assert 150 <= r.prompt_len <= 250 and 24 <= r.expected_output_len <= 40
        assert "<|im_start|>" not in r.prompt and "<|endoftext|>" not in r.prompt  # no special tokens
    assert len({r.prompt_len for r in reqs}) > 1
    assert reqs == sample_random_requests(smollm2_tokenizer, 16, input_len=200, output_len=32, range_ratio=0.25, seed=4)
    fixed = sample_random_requests(smollm2_tokenizer, 4, input_len=64, output_len=8)
    assert [(r.prompt_len, r.expected_output_len) for r in fixed] == [(64, 8)] * 4


def test_random_rejects_bad_ratio(smollm2_tokenizer):
    with pytest.raises(ValueError, match="range_ratio"):
        sample_random_requests(smollm2_tokenizer, 2, range_ratio=1.0)
