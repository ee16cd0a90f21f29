"""Layer backend ``local``: plain torch layers behind plugtron's layer-backend interface.

This is the single-rank (tp = 1) set of building blocks; each layer asks its init method for the
full tensor and keeps its tensor-parallel shard, so the parallel versions slot in here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plugtron.core.errors import ConfigError
from plugtron.core.layer_backend import LayerBackend
from plugtron.core.sharding import set_tensor_parallel, shard_of


class _Linear(torch.nn.Module):
    def __init__(self, input_size, output_size, bias, init_method, skip_bias_add, tp_dim,
                 tp_rank, tp_size, chunks=1):
        super().__init__()
        full = init_method((output_size, input_size))
        self.weight = torch.nn.Parameter(shard_of(full, tp_dim, tp_rank, tp_size, chunks))
        set_tensor_parallel(self.weight, tp_dim, chunks)
        self.bias = None
        if bias:
            bias_shape = output_size // tp_size if tp_dim == 0 else output_size
            self.bias = torch.nn.Parameter(torch.zeros(bias_shape))
            if tp_dim == 0:
                set_tensor_parallel(self.bias, 0, chunks)
        self.skip_bias_add = skip_bias_add

    def forward(self, x):
        if self.skip_bias_add:
            return F.linear(x, self.weight), self.bias
        return F.linear(x, self.weight, self.bias), None


class ColumnParallelLinear(_Linear):
    def __init__(self, input_size, output_size, *, bias, init_method, gather_output=False,
                 skip_bias_add=False, partition_chunks=1):
        super().__init__(input_size, output_size, bias, init_method, skip_bias_add, 0, 0, 1,
                         partition_chunks)
        self.gather_output = gather_output


class RowParallelLinear(_Linear):
    def __init__(self, input_size, output_size, *, bias, init_method, input_is_parallel=True,
                 skip_bias_add=False):
        super().__init__(input_size, output_size, bias, init_method, skip_bias_add, 1, 0, 1)
        self.input_is_parallel = input_is_parallel


class VocabParallelEmbedding(torch.nn.Module):
    def __init__(self, num_embeddings, embedding_dim, *, init_method):
        super().__init__()
        self.weight = torch.nn.Parameter(init_method((num_embeddings, embedding_dim)))
        set_tensor_parallel(self.weight, 0)

    def forward(self, ids):
        return F.embedding(ids, self.weight)


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class CoreAttention(torch.nn.Module):
    """Causal scaled-dot-product attention; key/value groups are repeated for GQA."""

    def __init__(self, num_heads, num_query_groups, head_dim, dropout):
        super().__init__()
        self.num_heads, self.num_query_groups = num_heads, num_query_groups
        self.dropout = dropout

    def forward(self, q, k, v):
        b, s = q.shape[0], q.shape[1]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.num_query_groups != self.num_heads)
        return out.transpose(1, 2).reshape(b, s, -1)


class LocalBackend(LayerBackend):
    name = "local"

    def __init__(self, config, parallel):
        super().__init__(config, parallel)
        if parallel.tp_size != 1:
            raise ConfigError("layer backend 'local' does not support tensor parallelism yet "
                              f"(tp {parallel.tp_size}); use --tp 1")

    def column_parallel_linear(self, input_size, output_size, *, bias, init_method,
                               gather_output=False, skip_bias_add=False, partition_chunks=1):
        return ColumnParallelLinear(input_size, output_size, bias=bias, init_method=init_method,
                                    gather_output=gather_output, skip_bias_add=skip_bias_add,
                                    partition_chunks=partition_chunks)

    def row_parallel_linear(self, input_size, output_size, *, bias, init_method,
                            input_is_parallel=True, skip_bias_add=False):
        return RowParallelLinear(input_size, output_size, bias=bias, init_method=init_method,
                                 input_is_parallel=input_is_parallel,
                                 skip_bias_add=skip_bias_add)

    def vocab_parallel_embedding(self, num_embeddings, embedding_dim, *, init_method):
        return VocabParallelEmbedding(num_embeddings, embedding_dim, init_method=init_method)

    def norm(self, hidden_size):
        model = self.config.model
        if model.normalization == "RMSNorm":
            return RMSNorm(hidden_size, model.norm_epsilon)
        return torch.nn.LayerNorm(hidden_size, eps=model.norm_epsilon)

    def core_attention(self, num_heads, num_query_groups, head_dim, dropout):
        return CoreAttention(num_heads, num_query_groups, head_dim, dropout)

    def output_logits(self, hidden, weight, parallel_output):
        return F.linear(hidden, weight)

    def cross_entropy(self, logits, labels, vocab_size, label_smoothing=0.0):
        # Padded vocabulary columns are dropped, so they neither win nor take probability mass.
        logits = logits[..., :vocab_size].float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               reduction="none", label_smoothing=label_smoothing)
        return loss.view_as(labels)
