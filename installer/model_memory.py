"""How much memory a split model needs on the trunk server and on each client.

    python installer/model_memory.py   # prints the README table "Memory each model needs"

Counts come from the models' published ``config.json`` values (below) with Llama-family layer
shapes: per layer q/k/v/o projections (+ q/k/v biases for Qwen2), gate/up/down MLP, two RMSNorms.
The client holds the embedding, k head + k tail layers, the final norm and the LM head; the trunk
server holds the other L - 2k layers. KV cache: 2 (K and V) x kv_heads x head_dim per token and
layer. Weights only — add about 0.5-1 GiB per process for the runtime (PyTorch, CUDA context).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB = 2**30

# Public config.json values (Hugging Face model cards), only the fields used here.
# fmt: off
MODELS: dict[str, dict[str, Any]] = {
    "SmolLM2-135M": dict(model_type="llama", num_hidden_layers=30, hidden_size=576,
                         intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, vocab_size=49152, tie_word_embeddings=True),
    "Mistral-7B": dict(model_type="mistral", num_hidden_layers=32, hidden_size=4096,
                       intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, vocab_size=32768, tie_word_embeddings=False),
    "Qwen2-7B": dict(model_type="qwen2", num_hidden_layers=28, hidden_size=3584,
                     intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                     head_dim=128, vocab_size=152064, tie_word_embeddings=False),
    "Llama-3-8B": dict(model_type="llama", num_hidden_layers=32, hidden_size=4096,
                       intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    "Mistral-NeMo-12B": dict(model_type="mistral", num_hidden_layers=40, hidden_size=5120,
                             intermediate_size=14336, num_attention_heads=32,
                             num_key_value_heads=8, head_dim=128, vocab_size=131072,
                             tie_word_embeddings=False),
    "Llama-3-70B": dict(model_type="llama", num_hidden_layers=80, hidden_size=8192,
                        intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                        head_dim=128, vocab_size=128256, tie_word_embeddings=False),
}
# fmt: on


@dataclass(frozen=True)
class Counts:
    layers: int
    per_layer: int  # parameters in one decoder layer
    embed: int
    lm_head: int  # 0 when tied to the embedding
    final_norm: int
    kv_per_token_layer: int  # K and V elements per token per layer

    @property
    def total(self) -> int:
        return self.layers * self.per_layer + self.embed + self.lm_head + self.final_norm


def counts(cfg: dict[str, Any]) -> Counts:
    """Parameter counts of a Llama-family model from its config.json values."""
    h = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or h // heads)
    inter = int(cfg["intermediate_size"])
    qkv_bias = cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False))
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    if qkv_bias:
        attn += heads * hd + 2 * kv * hd
    if cfg.get("attention_bias", False):
        attn += h  # o_proj bias
    mlp = 3 * h * inter + (2 * inter + h if cfg.get("mlp_bias", False) else 0)
    vocab = int(cfg["vocab_size"])
    return Counts(
        layers=int(cfg["num_hidden_layers"]),
        per_layer=attn + mlp + 2 * h,
        embed=vocab * h,
        lm_head=0 if cfg.get("tie_word_embeddings", False) else vocab * h,
        final_norm=h,
        kv_per_token_layer=2 * kv * hd,
    )


def split_bytes(c: Counts, k: int, bytes_per: int = 2) -> tuple[int, int]:
    """(client weight bytes, server weight bytes) for k head and k tail layers."""
    client = (c.embed + c.lm_head + c.final_norm + 2 * k * c.per_layer) * bytes_per
    server = (c.layers - 2 * k) * c.per_layer * bytes_per
    return client, server


def kv_bytes(c: Counts, layers: int, tokens: int, bytes_per: int = 2) -> int:
    return c.kv_per_token_layer * layers * tokens * bytes_per


def table(ks: tuple[int, ...] = (2, 8), context: int = 4096) -> str:
    """Markdown table: fp16 weights and KV cache on client and server per model and k."""
    rows = [
        "| Model | Params | k | Client weights | Client KV / 4k tokens | "
        "Server weights | Server KV / 4k tokens / session |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, cfg in MODELS.items():
        c = counts(cfg)
        for k in ks:
            if 2 * k >= c.layers:
                continue
            cl, sv = split_bytes(c, k)
            rows.append(
                f"| {name} | {c.total / 1e9:.2f} B | {k} | {cl / GIB:.2f} GiB | "
                f"{kv_bytes(c, 2 * k, context) / GIB:.3f} GiB | {sv / GIB:.2f} GiB | "
                f"{kv_bytes(c, c.layers - 2 * k, context) / GIB:.3f} GiB |"
            )
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
