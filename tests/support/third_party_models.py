"""Small models written the way a third party writes them, with no thought of megatron-lite.

Plain nn.Module code in the idioms of popular repositories (nanoGPT's tied head, torchvision's ResNet
Sequential, peft's LoRA injection, Llama's reference blocks, multi-task heads chosen per batch). Each one
reproduces a trap for a data-parallel wrapper; test_third_party_models.py trains them against torch's own
DistributedDataParallel + AdamW:

  * TiedLM          -- `self.head.weight = self.embed.weight`: one parameter, two uses, two module names.
  * tiny_resnet()   -- an nn.Sequential with BatchNorm2d (running statistics are buffers) and no nn.ModuleList.
  * LoRAMLP         -- a "pretrained" base frozen with requires_grad=False before wrapping, LoRA adapters
                       injected by replacing modules (lora_B starts at zero, as peft does), a trainable head.
  * MultiTaskNet    -- two branches of different widths held as plain attributes; the caller's task id
                       decides which runs, so ranks run different branches (find_unused_parameters=True).
  * TinyLlama       -- hand-written RMSNorm, SwiGLU MLP, grouped-query attention with rotary embeddings
                       (a non-persistent buffer), blocks in an nn.ModuleList, untied output layer.
  * StackedMLP      -- blocks registered through an nn.Sequential and iterated through a plain Python list
                       alias of it (no nn.ModuleList anywhere).

Everything here imports torch only.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


# ------------------------------------------------------------------------------ tied embeddings (nanoGPT style)
class MLPBlock(nn.Module):
    """Pre-norm residual MLP."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, hidden)
        self.proj = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class TiedLM(nn.Module):
    """Token embedding shared with the output projection (weight tying)."""

    def __init__(self, vocab=32, dim=16, n_layers=2, max_len=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList([MLPBlock(dim, 2 * dim) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # weight tying, as nanoGPT and GPT-2 do

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


# ------------------------------------------------------------------------------ BatchNorm CNN (torchvision style)
class BasicBlock(nn.Module):
    """ResNet's basic block: conv-bn-relu-conv-bn plus the identity."""

    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(out)))


def tiny_resnet(in_channels=3, channels=4, classes=3):
    return nn.Sequential(
        nn.Conv2d(in_channels, channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        BasicBlock(channels),
        BasicBlock(channels),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(channels, classes),
    )


# ------------------------------------------------------------------------------ frozen base + LoRA (peft style)
class LoRALinear(nn.Module):
    """base(x) + B(A(x)) * alpha / r, with B initialised to zero so training starts from the base model."""

    def __init__(self, base: nn.Linear, r=2, alpha=4, dropout=0.0):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / r
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


class PretrainedMLP(nn.Module):
    """The 'pretrained' backbone the adapters are injected into."""

    def __init__(self, dim_in=6, dim=12, layers=2, out=2):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(dim_in if i == 0 else dim, dim) for i in range(layers)])
        self.head = nn.Linear(dim, out)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def lora_mlp(r=2):
    """PretrainedMLP with every hidden Linear wrapped in LoRALinear; only the adapters and the head train."""
    model = PretrainedMLP()
    for i, layer in enumerate(model.layers):
        model.layers[i] = LoRALinear(layer, r=r)
    for name, param in model.named_parameters():
        param.requires_grad = "lora_" in name or name.startswith("head.")  # peft's modules_to_save=["head"]
    return model


# ------------------------------------------------------------------------------ rank-dependent branches
class TaskBranch(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim))

    def forward(self, x):
        return x + self.net(x)


class MultiTaskNet(nn.Module):
    """A shared trunk and head around one of two task branches (different widths), picked per batch."""

    def __init__(self, dim_in=6, dim=8):
        super().__init__()
        self.trunk = nn.Linear(dim_in, dim)
        self.branch_a = TaskBranch(dim, 8)
        self.branch_b = TaskBranch(dim, 12)
        self.head = nn.Linear(dim, 2)

    def forward(self, x, task: int):
        h = torch.relu(self.trunk(x))
        h = self.branch_a(h) if task == 0 else self.branch_b(h)
        return self.head(h)


# ------------------------------------------------------------------------------ Llama-like blocks
class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Causal self-attention with n_kv_heads < n_heads (grouped-query) and rotary position embeddings."""

    def __init__(self, dim, n_heads, n_kv_heads, max_len, theta=10000.0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        freqs = torch.outer(torch.arange(max_len).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.cos[:t], self.sin[:t]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        groups = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, hidden, max_len):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv_heads, max_len)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class TinyLlama(nn.Module):
    def __init__(self, vocab=32, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, hidden=24, max_len=8):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            [TransformerBlock(dim, n_heads, n_kv_heads, hidden, max_len) for _ in range(n_layers)])
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


# ------------------------------------------------------------------------------ blocks in a list / nn.Sequential
class ResidualMLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class StackedMLP(nn.Module):
    """Blocks registered by an nn.Sequential, run through a plain list attribute (to collect features)."""

    def __init__(self, dim_in=6, dim=10, depth=3, out=2):
        super().__init__()
        self.stem = nn.Linear(dim_in, dim)
        self.body = nn.Sequential(*[ResidualMLP(dim, 2 * dim) for _ in range(depth)])
        self.blocks = list(self.body)  # a plain Python list: nn.Module does not register it again
        self.head = nn.Linear(dim * depth, out)

    def forward(self, x):
        h = self.stem(x)
        features = []
        for block in self.blocks:
            h = block(h)
            features.append(h)
        return self.head(torch.cat(features, dim=-1))
