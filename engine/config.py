"""Model configuration: the few numbers the layer math needs, read from a Hugging Face config."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.errors import UnsupportedArchitecture

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
FAMILY_NAMES = ("Llama", "Mistral", "Qwen2", "Qwen3", "Gemma 2", "Gemma 3")
GEMMA_FAMILIES = ("gemma2", "gemma3_text")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# Fields added for families after the first three: left out of the fingerprint while they hold
# their defaults, so Llama / Mistral / Qwen2 models keep the fingerprints their shipped draft
# heads, private overlays and servers know them by.
_LATER_FIELDS = {
    "qk_norm": False,
    "norm_plus_one": False,
    "sandwich_norms": False,
    "mlp_act": "silu",
    "embed_scale": 1.0,
    "query_scale": None,
    "attn_softcap": None,
    "final_softcap": None,
    "local_rope_theta": None,
}


def unsupported_family(family: str) -> UnsupportedArchitecture:
    """The one-line refusal for a model family Veil does not implement."""
    return UnsupportedArchitecture(
        f"model family '{family or 'unknown'}' is not supported",
        hint="Veil runs " + ", ".join(FAMILY_NAMES) + " models",
    )


@dataclass(frozen=True)
class ModelConfig:
    family: str  # llama | mistral | qwen2 | qwen3 | gemma2 | gemma3_text
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3", "factor": ..., ...}
    attn_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    # Per-layer sliding window (None = full attention), len == n_layers.
    layer_windows: tuple[int | None, ...] = field(default_factory=tuple)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Qwen3 / Gemma 3: an RMSNorm over each query and key head before the rotary embedding.
    qk_norm: bool = False
    # Gemma: norms scale by (1 + weight); the loaders add the 1 to the stored weight.
    norm_plus_one: bool = False
    # Gemma: the attention and MLP outputs are normed before the residual add, and the MLP
    # input has its own norm (pre_feedforward_layernorm).
    sandwich_norms: bool = False
    mlp_act: str = "silu"  # silu | gelu_tanh: the gate's activation
    embed_scale: float = 1.0  # embedding rows are multiplied by this (Gemma: sqrt(hidden))
    query_scale: float | None = None  # attention scale when not 1 / sqrt(head_dim)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the mask
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    # Rotary base of the sliding-window layers when it differs from the global layers' (Gemma 3:
    # 10k local, 1M global; local layers take no rope scaling).
    local_rope_theta: float | None = None

    def __post_init__(self) -> None:
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (None,) * self.n_layers)

    @property
    def plain_layers(self) -> bool:
        """Whether the decoder layer is the Llama one (pre-norm, SiLU gate, plain attention):
        what the one-call quantized layer (``engine.kernels.fused_layers``) computes."""
        return all(getattr(self, k) == v for k, v in _LATER_FIELDS.items())

    def require_plain_layers(self, what: str) -> None:
        """Refuse, in one line, a tool whose own copy of the layer math is the Llama one."""
        if not self.plain_layers:
            name = dict(zip(SUPPORTED_FAMILIES, FAMILY_NAMES, strict=True))[self.family]
            raise UnsupportedArchitecture(
                f"{what} does not support {name} models yet",
                hint="it supports Llama, Mistral and Qwen2 models; chatting works with all",
            )

    def layer_rope(self, index: int) -> str:
        """Which rotary table decoder layer ``index`` uses: "global" or "local"."""
        local = self.local_rope_theta is not None and self.layer_windows[index] is not None
        return "local" if local else "global"

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type") or self.rope_scaling.get("type") or "default")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layer_windows"] = list(self.layer_windows)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["layer_windows"] = tuple(d.get("layer_windows") or ())
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)

    def fingerprint(self) -> str:
        """Hash of everything that changes the math (not of the weights)."""
        d = {
            k: v
            for k, v in self.to_dict().items()
            if k not in _LATER_FIELDS or v != _LATER_FIELDS[k]
        }
        blob = json.dumps(d, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Build from a transformers ``PretrainedConfig`` (4.x or 5.x style)."""
        family = str(getattr(hf, "model_type", "")).lower()
        if family not in SUPPORTED_FAMILIES:
            raise unsupported_family(family)
        n_heads = int(hf.num_attention_heads)
        hidden = int(hf.hidden_size)
        head_dim = getattr(hf, "head_dim", None) or hidden // n_heads
        n_layers = int(hf.num_hidden_layers)

        # transformers 5 keeps rope settings in `rope_parameters`; 4.x in rope_theta + rope_scaling.
        rope_params = getattr(hf, "rope_parameters", None) or {}
        local_params: dict[str, Any] = {}
        if isinstance(rope_params, dict) and "full_attention" in rope_params:
            local_params = rope_params.get("sliding_attention") or {}
            rope_params = rope_params["full_attention"]
        theta = rope_params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        scaling = getattr(hf, "rope_scaling", None) or None
        if rope_params and rope_params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if scaling:
            rtype = scaling.get("rope_type") or scaling.get("type") or "default"
            if rtype not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedArchitecture(
                    f"rope scaling '{rtype}' is not supported",
                    hint="supported: " + ", ".join(SUPPORTED_ROPE_TYPES),
                )
            scaling = None if rtype == "default" else dict(scaling)

        window = getattr(hf, "sliding_window", None)
        layer_types = getattr(hf, "layer_types", None)
        gemma = family in GEMMA_FAMILIES
        gemma3 = family == "gemma3_text"
        if gemma:
            if getattr(hf, "use_bidirectional_attention", False):
                raise UnsupportedArchitecture(
                    "bidirectional Gemma models (embedding models) are not supported",
                    hint="Veil runs causal language models",
                )
            if (
                layer_types is None
            ):  # transformers' defaults: every 6th (Gemma 3) or 2nd layer global
                pattern = int(getattr(hf, "sliding_window_pattern", 6) if gemma3 else 2)
                layer_types = [
                    "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                    for i in range(n_layers)
                ]
            windows = tuple(
                int(window) if window and t == "sliding_attention" else None for t in layer_types
            )
        elif family in ("qwen2", "qwen3"):
            use_sw = bool(getattr(hf, "use_sliding_window", False))
            if use_sw and window and layer_types:
                windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
            elif use_sw and window:
                mwl = int(getattr(hf, "max_window_layers", n_layers))
                windows = tuple(window if i >= mwl else None for i in range(n_layers))
            else:
                windows = (None,) * n_layers
        elif family == "mistral" and window:
            windows = (int(window),) * n_layers
        else:
            windows = (None,) * n_layers

        local_theta = None
        if gemma3:
            if local_params.get("rope_type", "default") != "default":
                raise UnsupportedArchitecture(
                    f"rope scaling '{local_params['rope_type']}' on sliding-window layers is "
                    "not supported"
                )
            local_theta = float(
                local_params.get("rope_theta", getattr(hf, "rope_local_base_freq", 10000.0))
            )
        scalar = getattr(hf, "query_pre_attn_scalar", None) if gemma else None
        query_scale = float(scalar) ** -0.5 if scalar and scalar != head_dim else None
        act = str(getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu"))
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise UnsupportedArchitecture(f"activation '{act}' is not supported")

        def cap(name: str) -> float | None:
            v = getattr(hf, name, None)
            return float(v) if v else None

        eos = getattr(hf, "eos_token_id", None)
        eos_ids: tuple[int, ...]
        if eos is None:
            eos_ids = ()
        elif isinstance(eos, (list, tuple)):
            eos_ids = tuple(int(e) for e in eos)
        else:
            eos_ids = (int(eos),)

        return cls(
            family=family,
            vocab_size=int(hf.vocab_size),
            hidden_size=hidden,
            intermediate_size=int(hf.intermediate_size),
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(getattr(hf, "num_key_value_heads", None) or n_heads),
            head_dim=int(head_dim),
            rms_eps=float(hf.rms_norm_eps),
            rope_theta=float(theta),
            rope_scaling=scaling,
            attn_bias=family == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            max_position_embeddings=int(getattr(hf, "max_position_embeddings", 4096) or 4096),
            layer_windows=windows,
            eos_token_ids=eos_ids,
            bos_token_id=getattr(hf, "bos_token_id", None),
            qk_norm=family == "qwen3" or gemma3,
            norm_plus_one=gemma,
            sandwich_norms=gemma,
            mlp_act="gelu_tanh" if act == "gelu_pytorch_tanh" else "silu",
            embed_scale=float(hidden) ** 0.5 if gemma else 1.0,
            query_scale=query_scale,
            # transformers' Gemma 3 attention never applies its config's score cap
            attn_softcap=cap("attn_logit_softcapping") if family == "gemma2" else None,
            final_softcap=cap("final_logit_softcapping") if gemma else None,
            local_rope_theta=local_theta,
        )
