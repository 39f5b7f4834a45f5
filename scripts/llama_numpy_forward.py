"""Llama's forward pass in numpy alone, from a Hugging Face LlamaForCausalLM folder.

Written from Llama's definition (transformers' modeling_llama), independently of kiln: it
reads config.json and the weights (model.safetensors, or the shards model.safetensors.index.json
lists, parsed by hand as gpt2_numpy_forward.py does), runs the model in float64 and writes the logits of every position as
little-endian float32.

    python3 llama_numpy_forward.py DIR IDS OUT [--interleaved]
      DIR  a folder with config.json and the weights
      IDS  comma-separated token ids
      OUT  file for the logits, [len(IDS), vocab] float32
      --interleaved  rotate pairs (2i, 2i + 1), as Meta's original checkpoints are laid out,
                     instead of transformers' rotate_half pairs (i, i + head_dim / 2): a
                     folder in the transformers layout then gives different logits
"""
import json
import math
import os
import sys

import numpy as np

# the safetensors parser of the GPT-2 reference beside this file (numpy and the format alone)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_numpy_forward import load_safetensors  # noqa: E402


def load_weights(folder):
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.exists(index):
        return load_safetensors(os.path.join(folder, "model.safetensors"))
    files = sorted(set(json.load(open(index))["weight_map"].values()))
    out = {}
    for f in files:
        out.update(load_safetensors(os.path.join(folder, f)))
    return out


def rms_norm(x, g, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g


def inv_freq(cfg, dh):
    # transformers 5 writes rope_parameters (theta and scaling together); earlier versions
    # rope_theta and rope_scaling
    p = cfg.get("rope_parameters") or {}
    base = p.get("rope_theta", cfg.get("rope_theta", 10000.0))
    f = 1.0 / base ** (np.arange(0, dh, 2, dtype=np.float64) / dh)
    s = p if p else cfg.get("rope_scaling")
    if not s or s.get("rope_type", s.get("type")) == "default":
        return f
    kind = s.get("rope_type", s.get("type"))
    assert kind == "llama3", f"rope_scaling {kind} is not read here"
    old = s["original_max_position_embeddings"]
    low, high, factor = s["low_freq_factor"], s["high_freq_factor"], s["factor"]
    wavelen = 2 * math.pi / f
    out = np.where(wavelen > old / low, f / factor, f)
    smooth = (old / wavelen - low) / (high - low)
    mid = (wavelen >= old / high) & (wavelen <= old / low)
    return np.where(mid, (1 - smooth) * f / factor + smooth * f, out)


def rotate(x, cos, sin, interleaved):
    # x [heads, t, dh]; cos, sin [t, dh / 2]
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = b * cos + a * sin
        return out
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def forward(cfg, w, ids, interleaved=False):
    t = len(ids)
    d, h = cfg["hidden_size"], cfg["num_attention_heads"]
    hkv = cfg.get("num_key_value_heads") or h
    dh = cfg.get("head_dim") or d // h
    eps = cfg.get("rms_norm_eps", 1e-6)
    assert cfg.get("hidden_act", "silu") == "silu"
    ang = np.arange(t, dtype=np.float64)[:, None] * inv_freq(cfg, dh)[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    x = w["model.embed_tokens.weight"][ids]
    causal = np.triu(np.ones((t, t), dtype=bool), k=1)
    for i in range(cfg["num_hidden_layers"]):
        p = lambda name: w[f"model.layers.{i}.{name}.weight"]
        a = rms_norm(x, p("input_layernorm"), eps)
        q = (a @ p("self_attn.q_proj").T).reshape(t, h, dh).transpose(1, 0, 2)
        k = (a @ p("self_attn.k_proj").T).reshape(t, hkv, dh).transpose(1, 0, 2)
        v = (a @ p("self_attn.v_proj").T).reshape(t, hkv, dh).transpose(1, 0, 2)
        q, k = rotate(q, cos, sin, interleaved), rotate(k, cos, sin, interleaved)
        k, v = np.repeat(k, h // hkv, axis=0), np.repeat(v, h // hkv, axis=0)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(dh)
        s = np.where(causal, -np.inf, s)
        s = np.exp(s - s.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        y = (s @ v).transpose(1, 0, 2).reshape(t, h * dh)
        x = x + y @ p("self_attn.o_proj").T
        m = rms_norm(x, p("post_attention_layernorm"), eps)
        gate, up = m @ p("mlp.gate_proj").T, m @ p("mlp.up_proj").T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ p("mlp.down_proj").T
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight")
    if head is None or cfg.get("tie_word_embeddings", False):
        head = w["model.embed_tokens.weight"]
    return x @ head.T


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    folder, ids, out = args
    cfg = json.load(open(os.path.join(folder, "config.json")))
    assert cfg["model_type"] == "llama", cfg["model_type"]
    ids = [int(i) for i in ids.split(",")]
    logits = forward(cfg, load_weights(folder), ids, "--interleaved" in sys.argv)
    logits.astype("<f4").tofile(out)


if __name__ == "__main__":
    main()
