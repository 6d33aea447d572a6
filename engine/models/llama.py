"""Llama-family decoder (Llama 2/3, SmolLM2) over a paged KV cache.

The flattened batch has no padding: `input_ids` and `positions` are [num_tokens], and each
attention layer reads and writes its layer's KV cache through the attention backend with
the step's `AttentionMetadata`. Layers are tensor-parallel aware (see layers/linear.py).
With pipeline parallelism the model holds only its stage's layers [start_layer,
end_layer) (vLLM's get_pp_indices split, engine/distributed/parallel_layout.py; the other indices are
`PPMissingLayer` placeholders so checkpoint names keep their layer numbers), the
embedding on the first stage and the final norm and LM head on the last; a stage other
than the last returns its intermediate tensors for the next stage instead of hidden states.
Source: Touvron et al., LLaMA (2023); HF transformers `modeling_llama.py` for the weight
names and RoPE convention (rotate-half); vLLM `vllm/model_executor/models/llama.py`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvpilot.engine.distributed import parallel_state as ps
from kvpilot.engine.attention.backend import AttentionBackend, AttentionMetadata
from kvpilot.engine.config import ModelConfig
from kvpilot.engine.layers.activation import SiluAndMul
from kvpilot.engine.layers.layernorm import RMSNorm
from kvpilot.engine.layers.linear import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from kvpilot.engine.layers.rotary_embedding import Rope, RotaryEmbedding
from kvpilot.engine.distributed.parallel_layout import get_pp_indices

KVCache = tuple[torch.Tensor, torch.Tensor]
IntermediateTensors = dict[str, torch.Tensor]


class LlamaAttention(nn.Module):
    """Self-attention of one layer: fused qkv projection (column parallel), RoPE, paged
    attention through the backend, output projection (row parallel, all-reduced). Holds
    num_heads / tp query heads and num_kv_heads / tp KV heads (GQA)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        tp = ps.get_tp_size()
        self.num_heads = cfg.num_heads // tp
        self.num_kv_heads = cfg.num_kv_heads // tp
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q_size, kv_size, kv_size], cfg.dtype)
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, cfg.dtype)
        self.backend = backend

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]: attends over kv_cache (this layer's (K, V), each
        [num_blocks, block_size, num_kv_heads / tp, head_dim]) after writing the new K/V into it."""
        n = x.shape[0]
        qkv = self.qkv_proj(x).view(n, -1, self.head_dim)  # [n, heads + 2 kv_heads, head_dim]
        out = self.backend.forward_qkv(qkv, rope, kv_cache[0], kv_cache[1], meta, self.scale, self.num_heads)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down_proj(silu(gate) * up), with gate/up fused and column
    parallel and down_proj row parallel."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [i, i], cfg.dtype)
        self.down_proj = RowParallelLinear(i, cfg.hidden_size, cfg.dtype)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], x's dtype (all-reduced over the tensor-parallel ranks)."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """One pre-norm decoder layer: RMSNorm, attention, RMSNorm, MLP, on vLLM's residual stream."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.self_attn = LlamaAttention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.mlp = LlamaMLP(cfg)

    def forward(self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (x, residual), vLLM's residual stream: the layer's input is
        x + residual (residual None: x alone, the first layer); the fused add+RMSNorm
        updates residual in place and the next layer adds the returned x."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class PPMissingLayer(nn.Module):
    """Stands for a layer that lives on another pipeline stage (vLLM's placeholder)."""

    def forward(self, *args, **kwargs):
        """Raises RuntimeError: the layer is not held on this pipeline stage."""
        raise RuntimeError("this layer lives on another pipeline stage")


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T] int64, positions [T] int64, kv_caches (this stage's layers),
    meta, intermediate) -> hidden [T, H] on the last stage, else IntermediateTensors
    {"hidden_states": [T, H]} (the model's dtype) for the next stage, which passes them as
    `intermediate` (the first stage embeds input_ids instead);
    compute_logits(hidden [n, H]) -> [n, vocab_size] float32 (last stage only)."""

    # models/cpu_decode_stack.DecodeStack: small decode steps in one C call, and the CPU kernel path
    # the modules were set to (engine/cpu/kernel_path.py): both given by cpu_decode_stack.apply
    decode_stack = None
    kernel_path = None

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        pp_rank, pp_size = ps.get_pp_rank(), ps.get_pp_size()
        self.is_first_stage, self.is_last_stage = pp_rank == 0, pp_rank == pp_size - 1
        self.start_layer, self.end_layer = get_pp_indices(cfg.num_layers, pp_rank, pp_size)

        def new_embedding() -> VocabParallelEmbedding:
            return VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.dtype)

        self.embed_tokens = new_embedding() if self.is_first_stage else None
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, backend) if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype) if self.is_last_stage else None
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.lm_head = None
        if self.is_last_stage:
            tied_here = cfg.tie_word_embeddings and self.is_first_stage
            self.lm_head = self.embed_tokens if tied_here else new_embedding()

    def intermediate_shapes(self, num_tokens: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of the IntermediateTensors a stage sends for num_tokens."""
        return {"hidden_states": ((num_tokens, self.config.hidden_size), self.config.dtype)}

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """This stage's part of the step; shapes in the class docstring. On CPU a small decode
        step may run as one C call (decode_stack); else embedding (first stage) or the received
        hidden states, this stage's layers, and the final norm on the last stage."""
        if self.decode_stack is not None and intermediate is None:
            hidden = self.decode_stack.forward(input_ids, positions, kv_caches, meta)
            if hidden is not None:
                return hidden
        # The residual stream is updated in place: a received tensor is copied first.
        x = self.embed_tokens(input_ids) if self.is_first_stage else intermediate["hidden_states"].clone()
        rope = self.rotary_emb.cos_sin(positions, x.dtype)
        residual = None
        for i, kv_cache in zip(range(self.start_layer, self.end_layer), kv_caches):
            x, residual = self.layers[i](rope, x, residual, kv_cache, meta)
        if residual is None:  # a stage without layers
            return {"hidden_states": x} if not self.is_last_stage else self.norm(x)
        if not self.is_last_stage:
            return {"hidden_states": x + residual}
        return self.norm(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size] float32 (last stage only)."""
        return self.lm_head.logits(hidden)

    def _stage_name(self, name: str) -> str | None:
        """The parameter name a checkpoint tensor loads into on this stage, or None when
        it belongs to another stage. A tied LM head off the first stage loads the
        embedding."""
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
            return name if self.start_layer <= int(parts[1]) < self.end_layer else None
        if parts[0] == "embed_tokens":
            if self.is_first_stage:
                return name
            tied_head = self.is_last_stage and self.config.tie_word_embeddings
            return name.replace("embed_tokens", "lm_head", 1) if tied_head else None
        if parts[0] in ("norm", "lm_head"):
            return name if self.is_last_stage else None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads HF Llama checkpoint tensors (full, unsharded), fusing q/k/v and gate/up,
        keeping this stage's layers and this rank's shards. Raises ValueError on a missing
        or unexpected tensor."""
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        params = dict(self.named_parameters())
        done: set[str] = set()
        fused_seen: dict[str, set[int]] = {}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if (name == "lm_head.weight" and self.config.tie_word_embeddings) or "rotary_emb" in name:
                continue
            name = self._stage_name(name)
            if name is None:
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                target, index = fused[parts[-2]]
                key = ".".join(parts[:-2] + [target, parts[-1]])
                self.get_submodule(key.rsplit(".", 1)[0]).load_full(index, tensor)
                fused_seen.setdefault(key, set()).add(index)
                continue
            if name not in params:
                raise ValueError(f"unexpected tensor in checkpoint: {name}")
            module = self.get_submodule(name.rsplit(".", 1)[0])
            if hasattr(module, "load_full"):
                module.load_full(tensor)
            else:
                params[name].data.copy_(tensor)
            done.add(name)
        for key, indices in fused_seen.items():
            if len(indices) == len(self.get_submodule(key.rsplit(".", 1)[0]).output_sizes):
                done.add(key)
        missing = set(params) - done
        if missing:
            raise ValueError(f"checkpoint lacks tensors: {sorted(missing)[:5]}")
