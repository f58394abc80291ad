"""The organisation-keyed split: a secret change of basis that the trunk computes through.

An organisation key (32 random bytes, :class:`OrgKey`) determines, for one model and one
range of trunk layers, a :class:`KeyedTransform`:

- ``q`` [H, H]: a Haar-random orthogonal matrix. The client sends ``h @ q`` instead of the head
  output ``h`` and turns the trunk's answer ``t'`` back with ``t' @ q.T``. RMSNorm only sees
  the length of a row, which ``q`` keeps, so every trunk layer computes the same function in
  the rotated basis once its norm weights are folded into the matrices that read the residual
  stream (``W diag(g) q``) and the matrices that write it are turned (``q.T W``).
- per trunk layer (:class:`LayerTransform`): a permutation of the KV groups and of the query
  heads inside each group; a per-KV-head scaled rotation of each rotary pair of q and the
  inverse-transpose on k (commutes with the rotary embedding, keeps q·k); a per-KV-head
  invertible mix of V, undone in the output projection; a permutation of the MLP channels and
  a positive scale on the up projection, undone in the down projection.
- optional ``noise``: Gaussian noise on every trunk matrix (relative to the matrix's RMS). This
  is the only part that changes what the model computes; the rest is exact up to float
  rounding.

Everything is derived from the key with a keyed hash (HMAC-SHA256) and numpy's PCG64 seeded
with the full 256-bit digest, so the same key, model and layer always give the same
transform, and different models get unrelated ones. What an attacker who knows this scheme
(but not the key) can still do is measured by :mod:`engine.keyed.attacks`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from engine.config import ModelConfig
from engine.errors import VeilError
from engine.model import LayerWeights

KEY_BYTES = 32
KEY_HEADER = "veil-org-key-v1"
SCALE_RANGE = 2.0  # scales are log-uniform in [1/SCALE_RANGE, SCALE_RANGE]


class KeyedError(VeilError):
    """A problem with an organisation key or a keyed model (one line for the user)."""


@dataclass(frozen=True)
class OrgKey:
    """The organisation's secret. Whoever holds it can undo the trunk's change of basis."""

    secret: bytes

    def __post_init__(self) -> None:
        if len(self.secret) != KEY_BYTES:
            raise KeyedError(f"an organisation key is {KEY_BYTES} bytes, not {len(self.secret)}")

    @classmethod
    def generate(cls) -> OrgKey:
        return cls(secrets.token_bytes(KEY_BYTES))

    @property
    def key_id(self) -> str:
        """A public name for the key (16 hex digits): the trunk and the client compare it; it
        reveals nothing about the secret."""
        return hmac.new(self.secret, b"veil org key id", hashlib.sha256).hexdigest()[:16]

    def digest(self, label: str) -> bytes:
        return hmac.new(self.secret, label.encode(), hashlib.sha256).digest()

    def rng(self, label: str) -> np.random.Generator:
        """A random stream for ``label``, seeded with 256 bits derived from the key."""
        entropy = int.from_bytes(self.digest(label), "big")
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))

    def to_text(self) -> str:
        return f"{KEY_HEADER} {self.secret.hex()}\n"

    @classmethod
    def from_text(cls, text: str, where: str = "the key") -> OrgKey:
        parts = text.split()
        if len(parts) != 2 or parts[0] != KEY_HEADER:
            raise KeyedError(f"{where} is not a Veil organisation key (expected '{KEY_HEADER} …')")
        try:
            secret = bytes.fromhex(parts[1])
        except ValueError:
            raise KeyedError(f"{where} is damaged: the key is not hexadecimal") from None
        if len(secret) != KEY_BYTES:
            raise KeyedError(f"{where} is damaged: the key has {len(secret)} bytes, not 32")
        return cls(secret)

    def save(self, path: Path) -> None:
        """Write the key readable by its owner only; never overwrites an existing file."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise KeyedError(f"{path} already exists; not overwriting a key") from None
        except OSError as e:
            raise KeyedError(f"cannot write the key to {path}: {e.strerror}") from None
        with os.fdopen(fd, "w") as f:
            f.write(self.to_text())

    @classmethod
    def load(cls, path: Path) -> OrgKey:
        try:
            text = path.read_text(encoding="ascii", errors="replace")
        except OSError as e:
            raise KeyedError(f"cannot read the organisation key {path}: {e.strerror}") from None
        return cls.from_text(text, str(path))


@dataclass
class LayerTransform:
    """The secret per-layer symmetries of one trunk layer (see the module docstring)."""

    q_heads: torch.Tensor  # [nh] long: new query head i is old head q_heads[i]
    kv_heads: torch.Tensor  # [nkv] long: new KV head g is old KV head kv_heads[g]
    qk_rot: torch.Tensor  # [nkv, hd, hd] float64: q_col -> R^T q_col, k_col -> R^-1 k_col
    vo_mix: torch.Tensor  # [nkv, hd, hd] float64: v_col -> A^T v_col
    mlp_perm: torch.Tensor  # [I] long: new channel j is old channel mlp_perm[j]
    mlp_scale: torch.Tensor  # [I] float64 > 0, on the up projection's rows


@dataclass
class KeyedTransform:
    """The whole secret transform of a trunk [start, end) of one model."""

    q: torch.Tensor  # [H, H] float64, orthogonal
    start: int
    end: int
    layers: list[LayerTransform]
    noise: float = 0.0
    key_id: str = ""

    def rotate_in(self, h: torch.Tensor) -> torch.Tensor:
        """Head output [B, H] -> what is sent: h @ q."""
        from engine.kernels import linear

        return linear(h, self._qt(h), invariant=True)  # [B, H]

    def rotate_out(self, t: torch.Tensor) -> torch.Tensor:
        """What the trunk returned [B, H] -> the plain basis: t @ q.T."""
        from engine.kernels import linear

        return linear(t, self._q(t), invariant=True)  # [B, H]

    def _q(self, like: torch.Tensor) -> torch.Tensor:
        return self._cached("_q_as", self.q, like)

    def _qt(self, like: torch.Tensor) -> torch.Tensor:
        return self._cached("_qt_as", self.q.T, like)

    def _cached(self, name: str, m: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        got: torch.Tensor | None = getattr(self, name, None)
        if got is None or got.dtype != like.dtype or got.device != like.device:
            got = m.to(dtype=like.dtype, device=like.device).contiguous()
            setattr(self, name, got)
        return got


def _rng(key: OrgKey, model_fp: str, what: str) -> np.random.Generator:
    return key.rng(f"veil keyed split|{model_fp}|{what}")


def _haar(rng: np.random.Generator, n: int) -> np.ndarray:
    """A Haar-random orthogonal n x n matrix (QR of a Gaussian with R's signs folded in)."""
    a = rng.standard_normal((n, n))
    q, r = np.linalg.qr(a)
    return q * np.sign(np.diag(r))[None, :]


def _log_uniform(rng: np.random.Generator, size: int | tuple[int, ...]) -> np.ndarray:
    return np.exp(rng.uniform(-np.log(SCALE_RANGE), np.log(SCALE_RANGE), size))


def _pair_rotation(rng: np.random.Generator, hd: int) -> np.ndarray:
    """[hd, hd]: a scaled rotation on each rotary pair (j, j + hd/2) — commutes with RoPE."""
    half = hd // 2
    s = _log_uniform(rng, half)
    a = rng.uniform(0.0, 2 * np.pi, half)
    r = np.zeros((hd, hd))
    j = np.arange(half)
    r[j, j] = s * np.cos(a)
    r[j + half, j + half] = s * np.cos(a)
    r[j, j + half] = s * np.sin(a)
    r[j + half, j] = -s * np.sin(a)
    return r


def check_supported(config: ModelConfig) -> None:
    if config.sandwich_norms:
        raise KeyedError(
            "a keyed split is not available for this model family: its norms on the layers' "
            "outputs (Gemma) do not commute with a change of basis"
        )


def derive(
    key: OrgKey, config: ModelConfig, model_fp: str, start: int, end: int, noise: float = 0.0
) -> KeyedTransform:
    """The transform ``key`` gives trunk layers [start, end) of the model ``model_fp``."""
    check_supported(config)
    if not 0 <= start < end <= config.n_layers:
        raise KeyedError(f"trunk range [{start}, {end}) is outside the model's layers")
    if noise < 0:
        raise KeyedError("noise must be >= 0")
    h, nh, nkv, hd = config.hidden_size, config.n_heads, config.n_kv_heads, config.head_dim
    inter = config.intermediate_size
    q = torch.from_numpy(_haar(_rng(key, model_fp, "residual"), h))
    group = nh // nkv
    layers = []
    for i in range(start, end):
        rng = _rng(key, model_fp, f"layer {i}")
        kv = rng.permutation(nkv)
        qh = np.concatenate([g * group + rng.permutation(group) for g in kv])
        if config.qk_norm:  # the per-dimension q/k norm weights would not commute
            rot = np.broadcast_to(np.eye(hd), (nkv, hd, hd)).copy()
        else:
            rot = np.stack([_pair_rotation(rng, hd) for _ in range(nkv)])
        mix = np.stack(
            [_haar(rng, hd) @ np.diag(_log_uniform(rng, hd)) @ _haar(rng, hd) for _ in range(nkv)]
        )
        layers.append(
            LayerTransform(
                q_heads=torch.from_numpy(qh).long(),
                kv_heads=torch.from_numpy(kv).long(),
                qk_rot=torch.from_numpy(rot),
                vo_mix=torch.from_numpy(mix),
                mlp_perm=torch.from_numpy(rng.permutation(inter)).long(),
                mlp_scale=torch.from_numpy(_log_uniform(rng, inter)),
            )
        )
    return KeyedTransform(q, start, end, layers, noise, key.key_id)


def _noisy(w: torch.Tensor, rel: float, rng: np.random.Generator) -> torch.Tensor:
    if rel <= 0:
        return w
    rms = w.pow(2).mean().sqrt()
    return w + torch.from_numpy(rng.standard_normal(tuple(w.shape))) * (rel * rms)


def key_layer(
    w: LayerWeights,
    config: ModelConfig,
    q: torch.Tensor,
    lt: LayerTransform,
    noise: float = 0.0,
    noise_rng: np.random.Generator | None = None,
) -> LayerWeights:
    """One trunk layer's float weights in the keyed basis (same dtype as given)."""
    for m in (w.wqkv, w.wo, w.wgu, w.wdown):
        if not isinstance(m, torch.Tensor):
            raise KeyedError("a keyed trunk is built from float weights (load with quant none)")
    if w.post_attn_norm is not None or w.post_mlp_norm is not None:
        check_supported(config)
    nh, nkv, hd = config.n_heads, config.n_kv_heads, config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    dt = w.wqkv.dtype
    rng = noise_rng or np.random.default_rng(0)
    f64 = torch.float64
    qkv = (w.wqkv.to(f64) * w.ln1.to(f64)[None, :]) @ q  # [(nh + 2 nkv) hd, H]
    wq = qkv[: nh * hd].view(nh, hd, hidden)[lt.q_heads]  # [nh, hd, H]
    wk = qkv[nh * hd : (nh + nkv) * hd].view(nkv, hd, hidden)[lt.kv_heads]  # [nkv, hd, H]
    wv = qkv[(nh + nkv) * hd :].view(nkv, hd, hidden)[lt.kv_heads]  # [nkv, hd, H]
    rot_t = lt.qk_rot.transpose(1, 2)  # [nkv, hd, hd]: R^T per KV head
    rot_inv = torch.linalg.inv(lt.qk_rot)  # [nkv, hd, hd]
    mix_t = lt.vo_mix.transpose(1, 2)  # A^T
    group = nh // nkv
    wq = torch.einsum("gij,gnjh->gnih", rot_t, wq.view(nkv, group, hd, hidden))
    wk = torch.einsum("gij,gjh->gih", rot_inv, wk)
    wv = torch.einsum("gij,gjh->gih", mix_t, wv)
    wqkv = torch.cat([wq.reshape(-1, hidden), wk.reshape(-1, hidden), wv.reshape(-1, hidden)])
    bias = None
    if w.bqkv is not None:
        b = w.bqkv.to(f64)
        bq = b[: nh * hd].view(nh, hd)[lt.q_heads].view(nkv, group, hd)
        bk = b[nh * hd : (nh + nkv) * hd].view(nkv, hd)[lt.kv_heads]
        bv = b[(nh + nkv) * hd :].view(nkv, hd)[lt.kv_heads]
        bq = torch.einsum("gij,gnj->gni", rot_t, bq)
        bk = torch.einsum("gij,gj->gi", rot_inv, bk)
        bv = torch.einsum("gij,gj->gi", mix_t, bv)
        bias = torch.cat([bq.reshape(-1), bk.reshape(-1), bv.reshape(-1)]).to(dt)
    # output projection: columns per query head, reordered, each head's block times A^-T
    wo = w.wo.to(f64).view(hidden, nh, hd)[:, lt.q_heads]  # [H, nh, hd]
    mix_inv_t = torch.linalg.inv(lt.vo_mix).transpose(1, 2)  # [nkv, hd, hd]
    wo = torch.einsum("hgnj,gji->hgni", wo.view(hidden, nkv, group, hd), mix_inv_t)
    wo = q.T @ wo.reshape(hidden, nh * hd)  # [H, nh hd]
    gu = (w.wgu.to(f64) * w.ln2.to(f64)[None, :]) @ q  # [2 I, H]
    gate = gu[:inter][lt.mlp_perm]  # [I, H]
    up = gu[inter:][lt.mlp_perm] * lt.mlp_scale[:, None]  # [I, H]
    down = w.wdown.to(f64)[:, lt.mlp_perm] / lt.mlp_scale[None, :]  # [H, I]
    down = q.T @ down  # [H, I]
    mats = [wqkv, wo, torch.cat([gate, up]), down]
    mats = [_noisy(m, noise, rng).to(dt).contiguous() for m in mats]
    ones = torch.ones_like(w.ln1)
    return replace(
        w,
        ln1=ones,
        wqkv=mats[0],
        wo=mats[1],
        ln2=torch.ones_like(w.ln2),
        wgu=mats[2],
        wdown=mats[3],
        bqkv=bias,
    )


def key_layers(
    layers: Sequence[LayerWeights],
    config: ModelConfig,
    transform: KeyedTransform,
    key: OrgKey | None = None,
    model_fp: str = "",
) -> list[LayerWeights]:
    """The trunk layers [transform.start, transform.end) in the keyed basis (with the
    transform's noise, drawn from the key when one is given)."""
    if len(layers) != transform.end - transform.start:
        raise KeyedError("the transform covers a different number of layers")
    out = []
    for i, (w, lt) in enumerate(zip(layers, transform.layers, strict=True)):
        rng = _rng(key, model_fp, f"noise {transform.start + i}") if key is not None else None
        out.append(key_layer(w, config, transform.q, lt, transform.noise, rng))
    return out
