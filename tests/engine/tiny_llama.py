"""A tiny random-weight Llama (GQA: 4 heads over 2 KV heads, head_dim 32) with a
word-level tokenizer, saved as a Hugging Face directory, and the engines the parallelism
tests build on it and on SmolLM2."""

from __future__ import annotations

from pathlib import Path

import torch

from kvpilot.engine import LLM, SamplingParams

VOCAB = 96


def save_tiny_llama(path: Path, num_layers: int) -> Path:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    )
    torch.manual_seed(1234)
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(path, safe_serialization=True)
    word_level = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(VOCAB)}, unk_token="w2"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=word_level, bos_token="w0", eos_token="w1", unk_token="w2"
    ).save_pretrained(path)
    return path


def tiny_prompts() -> list[list[int]]:
    """Three prompts of 5, 22 and 40 tokens (the last is chunked by a 24-token budget)."""
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 22, 40)]


def tiny_llm(path, tp: int = 1, pp: int = 1) -> LLM:
    """An fp32 CPU engine on the tiny Llama; a 24-token budget chunks the 40-token prompt,
    so chunked prefill crosses ranks and stages too."""
    return LLM(str(path), dtype="float32", device="cpu", tensor_parallel_size=tp, pipeline_parallel_size=pp,
               block_size=16, num_gpu_blocks_override=32, max_model_len=128, max_num_seqs=4,
               max_num_batched_tokens=24, swap_space=0, seed=0)


def smollm2_llm(model_path, tp: int = 1, pp: int = 1) -> LLM:
    """An fp32 CPU engine on SmolLM2 with a small fixed KV cache."""
    return LLM(str(model_path), dtype="float32", device="cpu", tensor_parallel_size=tp, pipeline_parallel_size=pp,
               max_model_len=256, max_num_seqs=4, num_gpu_blocks_override=64, swap_space=0)


def generate_and_close(llm: LLM, prompts, params: SamplingParams) -> list[list[int]]:
    """Each prompt's output token ids; the engine (and its ranks) closed afterwards."""
    try:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    finally:
        llm.engine.close()
