"""Where each rank sits in a tensor x pipeline parallel engine and what it holds: pure
arithmetic, no processes, shared by the engine and the tuner's feasibility model.

Rank layout (Megatron-LM, as in vLLM `initialize_model_parallel`): global rank
= pp_rank x tp + tp_rank. The tp ranks of one pipeline stage are contiguous, so stage s's
tensor-parallel group is ranks [s*tp, (s+1)*tp) and tensor-parallel rank t talks to the
same t of the neighbouring stages (ranks t, t+tp, t+2tp, ... form one pipeline group).

    tp=2, pp=2:   stage 0: rank 0 (driver), rank 1     layers [0, L/2), embedding
                  stage 1: rank 2,          rank 3     layers [L/2, L), norm, LM head

Layers split by vLLM's `get_pp_indices` (vllm/distributed/utils.py): contiguous ranges of
num_layers // pp each; the remainder goes one layer each to the stages before the last,
counting back from the second-to-last (the last stage also carries the final norm and
LM head, the first the embedding).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.engine.config import ModelConfig, ParallelConfig, element_bytes


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers of stage `pp_rank` out of `pp_size`. E.g. 30 layers over
    4 stages: [0, 7), [7, 15), [15, 23), [23, 30). Raises ValueError when a stage would get
    no layer or pp_rank is out of range. Source: vLLM `get_pp_indices` (default partition)."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} is not in [0, {pp_size})")
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size {pp_size} exceeds the model's {num_layers} layers")
    sizes = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):  # remainder: second-to-last stage backwards
        sizes[-i] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


@dataclass(frozen=True)
class RankPosition:
    """One rank's coordinates. rank = pp_rank * tp_size + tp_rank; rank 0 is the driver."""

    rank: int
    tp_rank: int
    pp_rank: int
    tp_size: int
    pp_size: int

    @classmethod
    def of(cls, rank: int, parallel: ParallelConfig) -> RankPosition:
        """The position of global rank `rank` under `parallel`: tp_rank = rank % tp,
        pp_rank = rank // tp. Raises ValueError when rank is not in [0, world_size)."""
        tp = parallel.tensor_parallel_size
        if not 0 <= rank < parallel.world_size:
            raise ValueError(f"rank {rank} is not in [0, {parallel.world_size})")
        return cls(rank, rank % tp, rank // tp, tp, parallel.pipeline_parallel_size)

    @property
    def is_first_stage(self) -> bool:
        """True on pipeline stage 0 (holds the embedding)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """True on the last pipeline stage (holds the final norm and the LM head)."""
        return self.pp_rank == self.pp_size - 1

    @property
    def next_rank(self) -> int:
        """The same tensor-parallel rank in the next stage (the last stage has none)."""
        return self.rank + self.tp_size

    @property
    def prev_rank(self) -> int:
        """The same tensor-parallel rank in the previous stage (the first stage has none)."""
        return self.rank - self.tp_size

    @property
    def sends_logits(self) -> bool:
        """The last stage's first tensor-parallel rank sends the step's logits to the
        driver (every rank of the last stage holds them after the vocabulary all-gather)."""
        return self.is_last_stage and self.tp_rank == 0 and self.rank != 0

    def describe(self) -> str:
        """'rank 2 (pipeline stage 1, tensor-parallel rank 0)'."""
        return f"rank {self.rank} (pipeline stage {self.pp_rank}, tensor-parallel rank {self.tp_rank})"


def rank_kv_bytes_per_token(model: ModelConfig, parallel: ParallelConfig, rank: int,
                            dtype_bytes: int | None = None) -> int:
    """KV-cache bytes one token takes on `rank`: 2 (K and V) x its stage's layers x
    num_kv_heads / tp x head_dim x bytes per element. Summed over all ranks this is
    `model.kv_bytes_per_token()`."""
    pos = RankPosition.of(rank, parallel)
    start, end = get_pp_indices(model.num_layers, pos.pp_rank, pos.pp_size)
    if dtype_bytes is None:
        dtype_bytes = element_bytes(model.dtype)
    return 2 * (end - start) * (model.num_kv_heads // pos.tp_size) * model.head_dim * dtype_bytes


def rank_num_params(model: ModelConfig, parallel: ParallelConfig, rank: int) -> int:
    """Parameters held by `rank`: its stage's layers (linear weights split over tp, norms
    replicated), the vocabulary shard of the embedding on the first stage, the final norm
    and the LM head's shard on the last. With tied embeddings and more than one stage the
    last stage holds its own copy of the embedding as LM head (as vLLM does), so the ranks
    together hold more than `model.num_params()`."""
    pos = RankPosition.of(rank, parallel)
    tp = pos.tp_size
    h, i = model.hidden_size, model.intermediate_size
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    start, end = get_pp_indices(model.num_layers, pos.pp_rank, pos.pp_size)
    per_layer = (h * (q + 2 * kv) + q * h + 3 * h * i) // tp + 2 * h
    return (end - start) * per_layer + (h if pos.is_last_stage else 0) + rank_vocab_params(model, parallel, rank)


def rank_vocab_params(model: ModelConfig, parallel: ParallelConfig, rank: int) -> int:
    """Parameters of the vocabulary-sized weights `rank` holds: its embedding shard on the
    first stage, its LM-head shard on the last (one weight when tied on a single stage)."""
    pos = RankPosition.of(rank, parallel)
    vocab_shard = -(-model.vocab_size // pos.tp_size) * model.hidden_size
    tied_here = model.tie_word_embeddings and pos.is_first_stage
    return vocab_shard * (int(pos.is_first_stage) + int(pos.is_last_stage and not tied_here))


# Bytes per weight of the GGUF blocks `--quantization gguf` keeps (engine/layers/gguf_quant.py):
# the builtin SmolLM2 file has its linear layers in Q4_1 (20 bytes / 32) and its LM head in Q8_0 (34 / 32).
GGUF_LINEAR_BYTES_PER_WEIGHT = 20 / 32
GGUF_HEAD_BYTES_PER_WEIGHT = 34 / 32


def rank_gguf_block_bytes(model: ModelConfig, parallel: ParallelConfig, rank: int) -> int:
    """Bytes of GGUF blocks `rank` holds beside its dense weights with `--quantization gguf`
    (CPU): its stage's linear layers / tp in Q4_1 and, on the last stage, its LM
    head shard in Q8_0. The embedding lookup and the norms keep only the dense weight."""
    pos = RankPosition.of(rank, parallel)
    h, i = model.hidden_size, model.intermediate_size
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    start, end = get_pp_indices(model.num_layers, pos.pp_rank, pos.pp_size)
    linear = (end - start) * (h * (q + 2 * kv) + q * h + 3 * h * i) // pos.tp_size
    head = -(-model.vocab_size // pos.tp_size) * h if pos.is_last_stage else 0
    return int(linear * GGUF_LINEAR_BYTES_PER_WEIGHT + head * GGUF_HEAD_BYTES_PER_WEIGHT)
