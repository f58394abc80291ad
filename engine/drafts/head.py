"""A learned draft head (EAGLE-3 style): the network, its file, and which model it belongs to.

The client already holds, for every verified token, its hidden state after the head layers, as
the trunk returned it, and after the tail (:class:`engine.split.BlockStates`). The head fuses the
three (``fc``: [3H] -> [H]), pairs the result with the *next* token's embedding, and runs one
decoder layer whose attention reads the head's own KV cache; its output goes through the model's
own final norm and LM head (frozen and shared, never copied into the file). Row ``i`` therefore
sees token ``i + 1`` and predicts token ``i + 2``. Drafting deeper, the layer's output stands in
for the features of a position the model has not computed yet, which is what training unrolls
("training-time test", :mod:`engine.drafts.train`).

The LM head may be restricted to the tokens the model writes most often (FR-Spec): drafting then
reads a few thousand rows of the LM head per step instead of all of them. Verification always
uses the full vocabulary, so this changes speed and acceptance, never the output.

A head file is a safetensors file: the layer's weights (float16), the draft vocabulary, and
metadata naming the model it was trained on (config and weight fingerprints) and which layers
its three features come from. :func:`load_head` refuses a head made for another model.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.errors import VeilError
from engine.kernels import linear
from engine.model import apply_rope, rms_norm

HEAD_FORMAT = "veil-draft-head/1"
WEIGHTS = ("fc", "ln_emb", "ln_hid", "wqkv", "wo", "ln_post", "wgu", "wdown")
STATS = ("feat_scale",)  # float32 in the file: feature outliers reach ~1e4


class DraftHeadError(VeilError):
    """A draft head file is unreadable or belongs to another model."""


@dataclass(frozen=True)
class HeadShape:
    """Sizes of the head's decoder layer (attention shaped like the model's own layers)."""

    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    rms_eps: float

    @classmethod
    def for_model(cls, cfg: ModelConfig, intermediate: int | None = None) -> HeadShape:
        return cls(
            cfg.hidden_size,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.head_dim,
            intermediate or cfg.intermediate_size,
            cfg.rms_eps,
        )


class DraftHeadNet(torch.nn.Module):
    """The trainable part: feature fusion and one decoder layer. Frozen model parts (embedding,
    final norm, LM head) are passed in, never stored here."""

    feat_scale: torch.Tensor

    def __init__(self, shape: HeadShape) -> None:
        super().__init__()
        s = shape
        h, qkv = s.hidden, (s.n_heads + 2 * s.n_kv_heads) * s.head_dim
        self.shape = s
        self.fc = torch.nn.Parameter(torch.empty(h, 3 * h))  # [H, 3H]
        self.ln_emb = torch.nn.Parameter(torch.ones(h))  # [H]
        self.ln_hid = torch.nn.Parameter(torch.ones(h))  # [H]
        self.wqkv = torch.nn.Parameter(torch.empty(qkv, 2 * h))  # [(nh + 2 nkv) hd, 2H]
        self.wo = torch.nn.Parameter(torch.empty(h, s.n_heads * s.head_dim))  # [H, nh hd]
        self.ln_post = torch.nn.Parameter(torch.ones(h))  # [H]
        self.wgu = torch.nn.Parameter(torch.empty(2 * s.intermediate, h))  # [2 I, H]
        self.wdown = torch.nn.Parameter(torch.empty(h, s.intermediate))  # [H, I]
        # Per-dimension scale of the features, measured on the training data: a few dimensions
        # of a model's residual stream carry values thousands of times the rest ("massive
        # activations"), which would otherwise swamp the fusion. (Scale only, no centering: the
        # pass-through start below must reproduce the final hidden state exactly.)
        self.register_buffer("feat_scale", torch.ones(3 * h))  # [3H] 1 / root mean square
        self.dropout = 0.0  # on the scaled features, in training only
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        with torch.no_grad():
            for w in (self.fc, self.wqkv, self.wo, self.wgu, self.wdown):
                bound = 1.0 / math.sqrt(w.shape[1])
                w.uniform_(-bound, bound, generator=generator)
            self.wo.mul_(0.1)  # a small residual branch to start with
            self.wdown.mul_(0.1)
            self.init_passthrough()

    def init_passthrough(self) -> None:
        """Start the fusion close to "pass the final hidden state through" (the model's own
        next-token guess, one position early), so the first loss is that of a sensible head."""
        h = self.shape.hidden
        with torch.no_grad():
            self.fc.mul_(0.1)
            self.fc[:, 2 * h :] += torch.diag(1.0 / self.feat_scale[2 * h :])

    def set_feature_stats(self, feats: torch.Tensor) -> None:
        """Scale each dimension by its root mean square over ``feats`` [N, 3H] (training rows)."""
        with torch.no_grad():
            rms = feats.float().pow(2).mean(0).sqrt()
            self.feat_scale.copy_(1.0 / rms.clamp(min=1e-3))

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """[..., 3H] client features -> [..., H] (the layer's 'hidden' input)."""
        x = feats * self.feat_scale
        if self.training and self.dropout:
            x = F.dropout(x, self.dropout)
        return _lin(x, self.fc)

    def qkv(
        self, hid: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows [..., R, H] of hidden + next-token embedding -> q [..., nh, R, hd] and k, v
        [..., nkv, R, hd], rotated to their positions (cos/sin [..., R, hd])."""
        s = self.shape
        eps = s.rms_eps
        u = torch.cat([rms_norm(emb, self.ln_emb, eps), rms_norm(hid, self.ln_hid, eps)], -1)
        x = _lin(u, self.wqkv)  # [..., R, (nh + 2 nkv) hd]
        nq, nk = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
        lead = x.shape[:-1]
        q = x[..., :nq].reshape(*lead, s.n_heads, s.head_dim).transpose(-2, -3)
        k = x[..., nq : nq + nk].reshape(*lead, s.n_kv_heads, s.head_dim).transpose(-2, -3)
        v = x[..., nq + nk :].reshape(*lead, s.n_kv_heads, s.head_dim).transpose(-2, -3)
        c, n = cos.unsqueeze(-3), sin.unsqueeze(-3)  # [..., 1, R, hd]
        return apply_rope(q, c, n), apply_rope(k, c, n), v

    def finish(self, hid: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """Residual + output projection + MLP: hid [..., R, H], att [..., nh, R, hd] -> [..., R, H]
        (the layer's output: next step's 'hidden', and what the LM head reads)."""
        s = self.shape
        att = att.transpose(-2, -3)  # [..., R, nh, hd]
        att = att.reshape(*att.shape[:-2], s.n_heads * s.head_dim)  # [..., R, nh hd]
        x = hid + _lin(att, self.wo)
        h = rms_norm(x, self.ln_post, s.rms_eps)
        gate, up = _lin(h, self.wgu).chunk(2, dim=-1)  # [..., R, I] each
        return x + _lin(F.silu(gate) * up, self.wdown)


def _lin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for any leading shape, through the float32 row kernel when it applies."""
    if x.dim() == 2:
        return linear(x, w)
    return linear(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])


@dataclass
class DraftHead:
    """A trained head and what it was made for.

    ``feature_layers``: how many decoder layers lie below each of the three features (the client
    exposes them when its split is ``head, n - tail, n``). ``vocab``: the draft vocabulary (model
    token ids) its LM head is restricted to; ``None`` = all tokens.
    """

    net: DraftHeadNet
    model_name: str
    config_fingerprint: str
    weights_fingerprint: str
    feature_layers: tuple[int, int, int]
    vocab: torch.Tensor | None = None  # [Vd] int64, ascending
    info: dict[str, Any] = field(default_factory=dict)  # training record, shown to users
    path: Path | None = None

    @property
    def fingerprint(self) -> str:
        return f"{self.config_fingerprint}-{self.weights_fingerprint}"

    def describe(self) -> str:
        v = "all" if self.vocab is None else str(int(self.vocab.numel()))
        n = self.net.n_params()
        return f"{self.path or 'draft head'} ({n / 1e6:.1f}M parameters, draft vocabulary {v})"


def model_fingerprint(reader: Any, config: ModelConfig) -> tuple[str, str]:
    """(config fingerprint, weights fingerprint) of the whole model a client reads: a head's
    features come from every layer, so it belongs to exactly these weights (an organisation's
    private head/tail layers make a different model)."""
    from engine.loading import weights_fingerprint

    base = getattr(reader, "base", reader)  # engine.audit.overlay.OverlayReader wraps the files
    w = weights_fingerprint(base, base.names())
    private = getattr(reader, "tensors", None)
    if isinstance(private, dict) and private:
        h = hashlib.sha256(w.encode())
        for n in sorted(private):
            t = private[n].detach().float().contiguous()
            h.update(n.encode())
            h.update(t.reshape(-1)[:4096].numpy().tobytes())
        w = h.hexdigest()[:16]
    return config.fingerprint(), w


def save_head(head: DraftHead, path: str | Path) -> Path:
    """Write ``head`` as safetensors (float16 weights + metadata); returns the path."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors = {n: getattr(head.net, n).detach().to(torch.float16).contiguous() for n in WEIGHTS}
    tensors.update({n: getattr(head.net, n).detach().float().contiguous() for n in STATS})
    if head.vocab is not None:
        tensors["vocab"] = head.vocab.to(torch.int32).contiguous()
    s = head.net.shape
    meta = {
        "format": HEAD_FORMAT,
        "model": head.model_name,
        "config_fingerprint": head.config_fingerprint,
        "weights_fingerprint": head.weights_fingerprint,
        "feature_layers": ",".join(str(i) for i in head.feature_layers),
        "shape": json.dumps(vars(s)),
        "info": json.dumps(head.info, sort_keys=True),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)
    return path


def read_meta(path: str | Path) -> dict[str, str]:
    """A head file's metadata, without reading its weights."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
    except FileNotFoundError:
        raise DraftHeadError(f"no draft head file at {path}") from None
    except Exception as exc:
        raise DraftHeadError(f"{path} is not a draft head file ({exc})") from None
    if meta.get("format") != HEAD_FORMAT:
        raise DraftHeadError(f"{path} is not a Veil draft head file")
    return meta


def load_head(path: str | Path, fingerprint: tuple[str, str] | None = None) -> DraftHead:
    """Read a head file; with ``fingerprint`` (see :func:`model_fingerprint`), refuse a head
    trained for another model in one line."""
    from safetensors.torch import load_file

    meta = read_meta(path)
    if fingerprint is not None and (
        meta.get("config_fingerprint"),
        meta.get("weights_fingerprint"),
    ) != tuple(fingerprint):
        raise DraftHeadError(
            f"the draft head {path} was trained for another model "
            f"('{meta.get('model', '?')}'); train one for this model with `veil train-draft`"
        )
    try:
        shape = HeadShape(**json.loads(meta["shape"]))
        layers = tuple(int(x) for x in meta["feature_layers"].split(","))
        info = json.loads(meta.get("info") or "{}")
        tensors = load_file(str(path))
        net = DraftHeadNet(shape)
        with torch.no_grad():
            for n in WEIGHTS + STATS:
                p = getattr(net, n)
                t = tensors[n]
                if t.shape != p.shape:
                    raise ValueError(f"{n} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
                p.copy_(t.float())
    except (KeyError, ValueError, TypeError) as exc:
        raise DraftHeadError(f"the draft head {path} is damaged ({exc})") from None
    if len(layers) != 3:
        raise DraftHeadError(f"the draft head {path} is damaged (feature layers {layers})")
    net.requires_grad_(False)
    vocab = tensors["vocab"].long() if "vocab" in tensors else None
    return DraftHead(
        net,
        meta.get("model", ""),
        meta["config_fingerprint"],
        meta["weights_fingerprint"],
        (layers[0], layers[1], layers[2]),
        vocab,
        info,
        Path(path),
    )


def shipped_heads_dir() -> Path:
    """``resources/draft_heads`` in a checkout or inside the installed app bundle."""
    base = Path(getattr(sys, "_MEIPASS", Path(__file__).resolve().parents[2]))
    return base / "resources" / "draft_heads"


def find_shipped_head(config_fingerprint: str, folder: Path | None = None) -> Path | None:
    """The shipped head file whose model config matches (weights are checked on load)."""
    folder = folder or shipped_heads_dir()
    if not folder.is_dir():
        return None
    for p in sorted(folder.glob("*.safetensors")):
        try:
            if read_meta(p).get("config_fingerprint") == config_fingerprint:
                return p
        except DraftHeadError:
            continue
    return None
