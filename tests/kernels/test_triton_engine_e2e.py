"""End to end: a small random-weight Llama run through the engine with the Triton backend
(under the interpreter) and with the torch backend gives the same greedy tokens.

The schedule is chosen to reach every kernel path: a 24-token budget chunks the longer
prompts (extend over a cached part), decodes share steps with prefill chunks, and two
prompts share a full-block prefix with prefix caching on (an extend over shared blocks).
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
engine = pytest.importorskip("kvpilot.engine")

VOCAB = 96


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 2-layer GQA Llama (4 heads over 2 KV heads, head_dim 32) with random weights and a
    word-level tokenizer, saved as an HF directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    )
    torch.manual_seed(1234)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    word_level = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w2"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=word_level, bos_token="w0", eos_token="w1", unk_token="w2"
    )
    tokenizer.save_pretrained(path)
    return path


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(3, VOCAB, (18,), generator=gen).tolist()  # > one 16-token block
    return [
        torch.randint(3, VOCAB, (5,), generator=gen).tolist(),
        shared + torch.randint(3, VOCAB, (4,), generator=gen).tolist(),
        torch.randint(3, VOCAB, (40,), generator=gen).tolist(),
        shared + torch.randint(3, VOCAB, (9,), generator=gen).tolist(),
    ]


def _generate(path, backend: str) -> list[list[int]]:
    llm = engine.LLM(
        model=str(path), dtype="float32", device="cpu", attention_backend=backend,
        block_size=16, num_gpu_blocks_override=32, max_model_len=128, max_num_seqs=4,
        max_num_batched_tokens=24, enable_chunked_prefill=True, enable_prefix_caching=True,
        swap_space=0, seed=0,
    )
    params = engine.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate(_prompts(), params)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_triton_backend_generates_the_same_greedy_tokens_as_torch(tiny_llama, monkeypatch):
    from kvpilot.engine.attention.triton_backend import TritonAttentionBackend

    steps = []
    forward = TritonAttentionBackend.forward

    def recording_forward(self, query, key, value, k_cache, v_cache, meta, scale):
        extends = range(meta.num_decodes, meta.num_seqs)
        cached = [meta.seq_lens_cpu[i] - meta.query_lens_cpu[i] for i in extends]
        steps.append((meta.num_decodes, cached))
        return forward(self, query, key, value, k_cache, v_cache, meta, scale)

    monkeypatch.setattr(TritonAttentionBackend, "forward", recording_forward)
    expected = _generate(tiny_llama, "torch")
    actual = _generate(tiny_llama, "triton")

    assert all(len(tokens) == 10 for tokens in expected)
    assert actual == expected
    # The schedule reached every path: decodes beside chunks in one step, and chunks over
    # already-cached tokens (a later chunk of a long prompt, or a prefix-cache hit).
    assert any(nd and cached for nd, cached in steps)
    assert any(c > 0 for _, cached in steps for c in cached)
