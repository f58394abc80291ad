"""Tiny random-weight Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 checkpoints built from
configs, for tests."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Veil splits a language model between your computer and a server.",
    "Les élèves déjà partis — naïve café, smörgåsbord, 東京, emoji 🙂 and more.",
    "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    return lo",
    "Patient Jane Doe, phone 555-0142, lives at 12 Oak Street and has diabetes.",
]


@functools.lru_cache(maxsize=1)
def tiny_tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_config(family: str, n_layers: int = 4, **kw):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    tok = tiny_tokenizer()
    base = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    base.update(kw)
    if family == "llama":
        return LlamaConfig(**base)
    if family == "llama3":
        base.setdefault(
            "rope_parameters",
            {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        return LlamaConfig(**base)
    if family == "mistral":
        base.setdefault("sliding_window", 8)
        return MistralConfig(**base)
    if family == "qwen2":
        base.setdefault("tie_word_embeddings", True)
        return Qwen2Config(**base)
    if family == "qwen3":  # q/k norms; head_dim is not hidden / heads
        from transformers import Qwen3Config

        base.setdefault("head_dim", 24)
        return Qwen3Config(**base)
    if family in ("gemma3", "gemma2"):
        # sliding (window 8) and global layers mixed; a query scale that is not 1 / sqrt(hd);
        # soft-capped logits (and attention scores: Gemma 2 only)
        n = base["num_hidden_layers"]
        base.setdefault("head_dim", 16)
        base.setdefault("sliding_window", 8)
        base.setdefault(
            "layer_types", [("sliding_attention", "full_attention")[i % 3 == 1] for i in range(n)]
        )
        base.setdefault("query_pre_attn_scalar", 24)
        base.setdefault("final_logit_softcapping", 10.0)
        base["tie_word_embeddings"] = kw.get("tie_word_embeddings", True)
        if family == "gemma2":
            from transformers import Gemma2Config

            base.setdefault("attn_logit_softcapping", 2.0)
            return Gemma2Config(**base)
        from transformers import Gemma3TextConfig

        base.setdefault(
            "rope_parameters",
            {
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        )
        return Gemma3TextConfig(**base)
    raise ValueError(family)


def make_model(folder: Path, family: str = "llama", seed: int = 0, n_layers: int = 4, **kw):  # type: ignore[no-untyped-def]
    """Save a random-weight model + tokenizer to ``folder``; returns the HF model (eval, fp32)."""
    from transformers import AutoModelForCausalLM

    cfg = make_config(family, n_layers=n_layers, **kw)
    torch.manual_seed(seed)
    # transformers' SDPA path cannot cap attention scores (Gemma 2): its eager path can
    attn = "eager" if getattr(cfg, "attn_logit_softcapping", None) else "sdpa"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    with torch.no_grad():  # larger weights than the default init so logits are not all ties
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return model
