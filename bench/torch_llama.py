"""The Llama of kiln-model's `llama_cpu` preset (`GptConfig::llama`) in plain PyTorch, as
Hugging Face's `LlamaForCausalLM` writes it: pre-RMSNorm decoder, rotary positions with
`rotate_half`, grouped-query attention (key/value heads repeated with `repeat_interleave`,
then `F.scaled_dot_product_attention(is_causal=True)`), a SwiGLU MLP `down(silu(gate(x)) *
up(x))`, no biases, an untied `lm_head`. Used by bench/pytorch_ref.py (CPU) and
bench/torch_gpt.py (GPU)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def llama_ffn(d):
    """Llama's SwiGLU width: 8d/3 rounded up to a multiple of 32 (704 at d 256, as kiln)."""
    return ((8 * d + 2) // 3 + 31) // 32 * 32


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Block(nn.Module):
    def __init__(self, d, h, hkv, ffn, eps):
        super().__init__()
        self.h, self.hkv, self.hd = h, hkv, d // h
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.q_proj = nn.Linear(d, h * self.hd, bias=False)
        self.k_proj = nn.Linear(d, hkv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, hkv * self.hd, bias=False)
        self.o_proj = nn.Linear(h * self.hd, d, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=eps)
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        a = self.input_layernorm(x)
        q = self.q_proj(a).view(b, t, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(a).view(b, t, self.hkv, self.hd).transpose(1, 2)
        v = self.v_proj(a).view(b, t, self.hkv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(self.h // self.hkv, dim=1)
        v = v.repeat_interleave(self.h // self.hkv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, t, self.h * self.hd))
        m = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))


class Llama(nn.Module):
    def __init__(self, n_layers, d, h, hkv, ffn, n_ctx, vocab, rope_theta=10000.0, eps=1e-5):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, h, hkv, ffn, eps) for _ in range(n_layers))
        self.norm = nn.RMSNorm(d, eps=eps)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        hd = d // h
        inv_freq = 1.0 / rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        freqs = torch.outer(torch.arange(n_ctx, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [n_ctx, hd], rotate_half's pairing
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.embed_tokens(idx)
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        for blk in self.layers:
            x = blk(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
