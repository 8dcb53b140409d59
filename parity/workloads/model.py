"""A small Llama-style decoder used as parity's built-in workload.

The shapes are chosen so that every parameter's dim-0 is divisible by the
usual small world sizes (1, 2, 4, 8): FSDP2 pads uneven shards while DTensor
``Shard(0)`` does not, and we want the eager and compiled sides to hold the
same local shards without having to reason about padding.

There is no rotary embedding: it would only add buffers and complex-number ops
that have nothing to do with what parity checks (collective layout and
bitwise equality of the training step).
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int = 256
    multiple_of: int = 32
    norm_eps: float = 1e-5

    @property
    def ffn_hidden_dim(self) -> int:
        # Llama's SwiGLU sizing: 2/3 of 4 * dim, rounded up to multiple_of.
        hidden = int(2 * 4 * self.dim / 3)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    # Set by train.py --reorder-op: the same three values multiplied in another order,
    # x * (r * w) instead of (x * r) * w, a planted single-operation difference for `parity bisect`.
    reorder = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 whatever the compute dtype, as Llama does.
        x_fp32 = x.float()
        r = torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.reorder:
            return (x_fp32 * (r * self.weight)).type_as(x)
        normed = x_fp32 * r
        return normed.type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        if args.dim % args.n_heads != 0:
            raise ValueError(f"dim {args.dim} is not divisible by n_heads {args.n_heads}")
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        # wq/wk/wv/wo all have the same shape on purpose: the "swapped" bucket
        # order of the compiled path needs two same-size payloads.
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        hidden = args.ffn_hidden_dim
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.init_weights()

    def init_weights(self) -> None:
        """Small normal init from the global RNG: callers seed before construction
        so every rank builds the same full model before sharding."""
        with torch.no_grad():
            nn.init.normal_(self.tok_embeddings.weight, std=0.02)
            for block in self.layers:
                for lin in (
                    block.attention.wq,
                    block.attention.wk,
                    block.attention.wv,
                    block.attention.wo,
                    block.feed_forward.w1,
                    block.feed_forward.w2,
                    block.feed_forward.w3,
                ):
                    nn.init.normal_(lin.weight, std=0.02)
            nn.init.normal_(self.output.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers:
            h = block(h)
        return self.output(self.norm(h))
