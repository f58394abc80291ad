"""Model configuration: the few numbers the layer math needs, read from a Hugging Face config."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.errors import UnsupportedArchitecture

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    family: str  # llama | mistral | qwen2
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

    def __post_init__(self) -> None:
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (None,) * self.n_layers)

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
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Build from a transformers ``PretrainedConfig`` (4.x or 5.x style)."""
        family = str(getattr(hf, "model_type", "")).lower()
        if family not in SUPPORTED_FAMILIES:
            raise UnsupportedArchitecture(
                f"model family '{family or 'unknown'}' is not supported",
                hint="Veil runs "
                + ", ".join(f.capitalize() for f in SUPPORTED_FAMILIES)
                + " models",
            )
        n_heads = int(hf.num_attention_heads)
        hidden = int(hf.hidden_size)
        head_dim = getattr(hf, "head_dim", None) or hidden // n_heads
        n_layers = int(hf.num_hidden_layers)

        # transformers 5 keeps rope settings in `rope_parameters`; 4.x in rope_theta + rope_scaling.
        rope_params = getattr(hf, "rope_parameters", None) or {}
        if isinstance(rope_params, dict) and "full_attention" in rope_params:
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
        if family == "qwen2":
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
        )
