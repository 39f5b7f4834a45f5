"""PyTorch reference for kiln's GPU throughput: the same GPT (pre-LayerNorm decoder, learned
positions, tied embeddings, GELU tanh, biases everywhere), or a Llama preset's Llama
(bench/torch_llama.py), AdamW, bf16 autocast, one GPU.
Prints one JSON line: tokens/s (median of steps 5..), MFU against --peak (H200 dense bf16:
989e12), with FLOPs per token counted as kiln counts them (6N + 12 L H Q T + the tied head)."""
import argparse, json, math, statistics, time

import torch
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {  # n_layers, d_model, n_heads, n_ctx, vocab (kiln-model's GptConfig presets)
    "gpt3_small": (12, 768, 12, 2048, 50257),
    "gpt3_medium": (24, 1024, 16, 2048, 50257),
    "small_cpu": (4, 256, 4, 128, 8192),
}
# n_layers, d_model, n_heads, n_kv_heads, ffn, n_ctx, vocab, rope_theta
LLAMA_PRESETS = {
    "llama_cpu": (4, 256, 8, 2, 704, 128, 8192, 10000.0),
    "llama3_8b": (32, 4096, 32, 8, 14336, 8192, 128256, 500000.0),
}


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln_1, self.ln_2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-5)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, n_layers, d, h, n_ctx, vocab):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(n_ctx, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d, eps=1e-5)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="gpt3_small", choices=sorted(PRESETS | LLAMA_PRESETS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--peak", type=float, default=989e12)
    p.add_argument("--compile", action="store_true")
    a = p.parse_args()
    torch.manual_seed(0)
    if a.preset in LLAMA_PRESETS:
        from torch_llama import Llama

        L, d, h, hkv, ffn, n_ctx, vocab, theta = LLAMA_PRESETS[a.preset]
        model = Llama(L, d, h, hkv, ffn, max(n_ctx, a.ctx), vocab, rope_theta=theta).cuda()
    else:
        L, d, h, n_ctx, vocab = PRESETS[a.preset]
        model = Gpt(L, d, h, n_ctx, vocab).cuda()
    step_fn = torch.compile(model) if a.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    times = []
    for s in range(a.steps):
        idx = torch.randint(0, vocab, (a.batch, a.ctx), device="cuda")
        tgt = torch.randint(0, vocab, (a.batch, a.ctx), device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_fn(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times[5:])
    tokens = a.batch * a.ctx / med
    embeddings = ("wte", "wpe", "embed_tokens", "lm_head")
    n_non_emb = sum(q.numel() for n, q in model.named_parameters() if not n.startswith(embeddings))
    flops = 6 * n_non_emb + 12 * L * h * (d // h) * a.ctx + 6 * vocab * d
    print(json.dumps({"impl": "pytorch", "torch": torch.__version__, "preset": a.preset,
                      "ctx": a.ctx, "batch": a.batch, "tokens_per_s": round(tokens, 1),
                      "mfu": round(tokens * flops / a.peak, 4), "loss": float(loss)}))


if __name__ == "__main__":
    main()
