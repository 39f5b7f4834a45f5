"""PyTorch reference for kiln's CPU throughput (`bench/src/bin/bench_train.rs`): the same GPT as
bench/torch_gpt.py (pre-LayerNorm decoder, learned positions, tied embeddings, GELU tanh,
biases everywhere), or with --arch llama the same Llama as bench/torch_llama.py (RMSNorm,
rotary, SwiGLU, grouped-query attention, no biases, untied head; bench_train's defaults:
8 query heads sharing 2 key/value heads, SwiGLU 8d/3 rounded up to 32), the same loop as nanoGPT (AdamW with betas 0.9/0.95, weight decay 0.1 on
matrices and embeddings only, clipping at 1.0), random tokens, on the CPU. f32, or bf16
through torch.autocast("cpu"). Prints one JSON line: tokens/s over the median step of steps 5
to --steps, as bench_train does."""
import argparse, json, os, statistics, time

import torch

from torch_gpt import Gpt
from torch_llama import Llama, llama_ffn


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="gpt", choices=["gpt", "llama"])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=None, help="default 4 (gpt) or 8 (llama)")
    p.add_argument("--kv-heads", type=int, default=None, help="llama only; default 2")
    p.add_argument("--ffn", type=int, default=None, help="llama only; default 8d/3 up to 32")
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.arch == "gpt":
        if a.kv_heads is not None or a.ffn is not None:
            p.error("--kv-heads and --ffn size a Llama (pass --arch llama)")
        a.heads = a.heads or 4
        a.kv_heads, a.ffn = a.heads, 4 * a.d_model
        model = Gpt(a.layers, a.d_model, a.heads, a.ctx, a.vocab)
    else:
        a.heads, a.kv_heads = a.heads or 8, a.kv_heads or 2
        a.ffn = a.ffn or llama_ffn(a.d_model)
        if a.d_model % a.heads or a.heads % a.kv_heads:
            p.error(f"--kv-heads {a.kv_heads} must divide --heads {a.heads}, which must divide "
                    f"--d-model {a.d_model}")
        model = Llama(a.layers, a.d_model, a.heads, a.kv_heads, a.ffn, a.ctx, a.vocab)
    for m in model.modules():  # GPT-2's initialisation, as kiln's
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, torch.nn.Linear) and m.bias is not None:
            torch.nn.init.zeros_(m.bias)
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    times = []
    for s in range(1, a.steps + 1):
        idx = torch.randint(0, a.vocab, (a.batch, a.ctx))
        tgt = torch.randint(0, a.vocab, (a.batch, a.ctx))
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            loss = model(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if s >= 5:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    print(json.dumps({"impl": "pytorch", "torch": torch.__version__, "arch": a.arch,
                      "d_model": a.d_model, "layers": a.layers, "heads": a.heads,
                      "kv_heads": a.kv_heads, "ffn": a.ffn, "ctx": a.ctx, "vocab": a.vocab,
                      "params": sum(q.numel() for q in model.parameters()),
                      "batch": a.batch, "dtype": a.dtype, "threads": a.threads,
                      "tokens_per_s": round(a.batch * a.ctx / step_s, 1),
                      "step_s": round(step_s, 4), "loss": loss.detach().item()}))


if __name__ == "__main__":
    main()
