"""GPT-2's forward pass in numpy alone, from a Hugging Face GPT-2 folder.

Written from GPT-2's definition (transformers' modeling_gpt2), independently of kiln: it reads
config.json and model.safetensors (the format parsed by hand: an 8-byte little-endian header
length, a JSON header, raw little-endian data), runs the model in float64 and writes the
logits of every position as little-endian float32.

    python3 gpt2_numpy_forward.py DIR IDS OUT
      DIR  a folder with config.json and model.safetensors
      IDS  comma-separated token ids
      OUT  file for the logits, [len(IDS), vocab] float32
"""
import json
import struct
import sys

import numpy as np


def load_safetensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    dtypes = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        data = raw[8 + n + start : 8 + n + end]
        if info["dtype"] == "BF16":
            u = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
            a = u.view(np.float32)
        else:
            a = np.frombuffer(data, dtype=dtypes[info["dtype"]])
        out[name] = a.reshape(info["shape"]).astype(np.float64)
    return out


def layer_norm(x, g, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def gelu_new(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def forward(cfg, w, ids):
    p = lambda name: w.get("transformer." + name, w.get(name))
    t = len(ids)
    d, h = cfg["n_embd"], cfg["n_head"]
    dh = d // h
    eps = cfg.get("layer_norm_epsilon", 1e-5)
    assert cfg.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh")
    x = p("wte.weight")[ids] + p("wpe.weight")[np.arange(t)]
    causal = np.triu(np.ones((t, t), dtype=bool), k=1)
    for i in range(cfg["n_layer"]):
        b = f"h.{i}."
        a = layer_norm(x, p(b + "ln_1.weight"), p(b + "ln_1.bias"), eps)
        # Conv1D: y = x @ W + b with W stored [in, out]
        qkv = a @ p(b + "attn.c_attn.weight") + p(b + "attn.c_attn.bias")
        q, k, v = np.split(qkv, 3, axis=-1)
        q, k, v = (m.reshape(t, h, dh).transpose(1, 0, 2) for m in (q, k, v))
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(dh)
        scores = np.where(causal, -np.inf, scores)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        y = (probs @ v).transpose(1, 0, 2).reshape(t, d)
        x = x + y @ p(b + "attn.c_proj.weight") + p(b + "attn.c_proj.bias")
        m = layer_norm(x, p(b + "ln_2.weight"), p(b + "ln_2.bias"), eps)
        m = gelu_new(m @ p(b + "mlp.c_fc.weight") + p(b + "mlp.c_fc.bias"))
        x = x + m @ p(b + "mlp.c_proj.weight") + p(b + "mlp.c_proj.bias")
    x = layer_norm(x, p("ln_f.weight"), p("ln_f.bias"), eps)
    return x @ p("wte.weight").T


def main():
    folder, ids, out = sys.argv[1], sys.argv[2], sys.argv[3]
    cfg = json.load(open(f"{folder}/config.json"))
    w = load_safetensors(f"{folder}/model.safetensors")
    logits = forward(cfg, w, np.array([int(s) for s in ids.split(",")]))
    logits.astype("<f4").tofile(out)


if __name__ == "__main__":
    main()
