"""The split: head (embedding + first layers), trunk (middle layers), tail (last layers + norm
+ LM head).

Head, trunk and tail share one narrow interface — hidden states + positions + tree parents +
which nodes of the previous block to keep, in; hidden states out — so the trunk can live in
this process (:class:`LocalTrunk`) or behind the network (``engine.transport``).

The client side (:class:`ClientModel`) reads only the embedding, its local layers, the final
norm and the LM head from the checkpoint, and reads further layers when ``k`` grows. The trunk
side (:func:`load_trunk`) reads only the trunk layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from engine import kernels
from engine.config import ModelConfig
from engine.errors import SplitError
from engine.kernels import linear
from engine.keyed.transform import KeyedTransform, OrgKey
from engine.loading import (
    Progress,
    ResolvedModel,
    WeightReader,
    load_config,
    load_tokenizer,
    resolve,
    weights_fingerprint,
)
from engine.model import (
    LayerStack,
    LayerWeights,
    Weight,
    layer_tensor_names,
    norm_vector,
    rms_norm,
)
from engine.paced import labelled_if_slow
from engine.quant import QuantWeight, weight_bytes
from engine.quant.load import client_reader, resolve_quant


@dataclass(frozen=True)
class SplitPlan:
    """Which layers run where: head [0, head), trunk [head, n - tail), tail [n - tail, n)."""

    n_layers: int
    head: int
    tail: int

    @classmethod
    def symmetric(cls, n_layers: int, k: int) -> SplitPlan:
        top = (n_layers + 1) // 2
        if not 1 <= k <= top:
            raise SplitError(
                f"local layers must be between 1 and {top} for this model ({n_layers} layers), "
                f"got {k}"
            )
        return cls.of(n_layers, k, min(k, n_layers - k))

    @classmethod
    def of(cls, n_layers: int, head: int, tail: int) -> SplitPlan:
        if head < 1 or tail < 1 or head + tail > n_layers:
            raise SplitError(
                f"a split needs at least 1 head and 1 tail layer and at most {n_layers} in all; "
                f"got head={head}, tail={tail}"
            )
        return cls(n_layers, head, tail)

    @property
    def trunk_range(self) -> tuple[int, int]:
        return self.head, self.n_layers - self.tail

    @property
    def fully_local(self) -> bool:
        return self.head + self.tail >= self.n_layers


@runtime_checkable
class Trunk(Protocol):
    """The middle layers, wherever they run."""

    start: int
    end: int
    # A trunk may also have ``key_id``: an organisation key's public id when it computes in that
    # key's secret basis (then the runner sends ``h @ q`` and turns the answer back), and
    # ``submit``/``collect``: a block sent now and its answer taken later, in order, so that a
    # second block can go before the first one's answer is back (rounds in flight; a trunk
    # without them answers at once).

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        parents: Sequence[int] | None = None,
        keep: Sequence[int] | None = None,
    ) -> torch.Tensor: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


class LocalTrunk:
    """Trunk layers in this process."""

    def __init__(self, stack: LayerStack) -> None:
        self.stack = stack
        self.start = stack.start
        self.end = stack.end
        self.round_trips = 0
        self.key_id: str | None = None  # set by engine.keyed.trunk.load_keyed_trunk

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        parents: Sequence[int] | None = None,
        keep: Sequence[int] | None = None,
    ) -> torch.Tensor:
        self.round_trips += 1
        return self.stack.forward(hidden, positions, parents, keep)

    def submit(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        parents: Sequence[int] | None = None,
        keep: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """In this process there is no link to overlap: computed now, returned by collect."""
        return self.forward(hidden, positions, parents, keep)

    def collect(self, ticket: torch.Tensor) -> torch.Tensor:
        return ticket

    def reset(self) -> None:
        self.stack.reset()

    def close(self) -> None:
        pass


def read_layers(
    reader: Any,
    config: ModelConfig,
    indices: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str,
) -> dict[int, LayerWeights]:
    out: dict[int, LayerWeights] = {}
    for i in indices:
        tensors = reader.read(layer_tensor_names(config, i), dtype=dtype, device=device)
        out[i] = LayerWeights.from_tensors(tensors, i, config)
    return out


def trunk_fingerprint(reader: WeightReader, config: ModelConfig, start: int, end: int) -> str:
    names = [n for i in range(start, end) for n in layer_tensor_names(config, i)]
    return config.fingerprint() + "-" + weights_fingerprint(reader, names)


def load_trunk(
    spec: str | ResolvedModel,
    start: int,
    end: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    progress: Progress | None = None,
    quant: str = "auto",
) -> LocalTrunk:
    """Build a trunk for layers [start, end) from those layers' tensors alone. ``quant`` (as
    ``--client-quant`` and ``veil-trunk serve --quant``: auto, none, int8, int4) is what the
    trunk's matrices are held as on a CPU; ``auto`` (the default) keeps a GGUF file's own
    quantized blocks, as the trunk server does."""
    resolved = spec if isinstance(spec, ResolvedModel) else resolve(spec, progress)
    config = load_config(resolved.folder)
    if not 0 <= start < end <= config.n_layers:
        raise SplitError(f"trunk range [{start}, {end}) is outside the model's {config.n_layers}")
    q = resolve_quant(quant, resolved) if str(device) == "cpu" else "none"
    reader = client_reader(WeightReader(resolved.folder), resolved, config, q)
    layers = read_layers(reader, config, range(start, end), dtype, device)
    return LocalTrunk(
        LayerStack(
            config, start, [layers[i] for i in range(start, end)], dtype=dtype, device=device
        )
    )


class ClientModel:
    """Runs on the user's computer: tokenizer, embedding, head and tail layers, norm, LM head."""

    def __init__(
        self,
        resolved: ResolvedModel,
        plan: SplitPlan,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        config: ModelConfig | None = None,
        tokenizer: Any = None,
        private_weights: str | Path | None = None,
        client_quant: str = "none",
        org_key: OrgKey | str | Path | None = None,
    ) -> None:
        self.resolved = resolved
        self.name = resolved.name
        self.dtype = dtype
        self.device = torch.device(device)
        self.config = config or load_config(resolved.folder)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(resolved.folder)
        self.reader: Any = WeightReader(resolved.folder)
        if private_weights is not None:  # organisation-private head/tail layers
            from engine.audit.overlay import OverlayReader

            self.reader = OverlayReader(self.reader, Path(private_weights), self.config)
        cfg = self.config
        # What the client's matrices are held as: "none" (float), "gguf" (the file's own
        # quantized blocks), "int8" or "int4" (quantized at load, cached). ``weights`` reads
        # them; ``reader`` stays the float checkpoint (trunk fingerprints, private overlays).
        self.client_quant = resolve_quant(
            client_quant if self.device.type == "cpu" else "none",
            resolved,
            private=private_weights is not None,
        )
        self.weights: Any = client_reader(self.reader, resolved, cfg, self.client_quant)
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        tied = cfg.tie_word_embeddings or not self.weights.has("lm_head.weight")
        if not tied:
            names.append("lm_head.weight")
        t = self.weights.read(names, dtype=dtype, device=device)
        norm = t["model.norm.weight"]
        assert isinstance(norm, torch.Tensor)
        self.norm_weight: torch.Tensor = norm_vector(norm, cfg)  # [H], as multiplied
        # The LM head is [V, H], like the embedding; a tied model shares one buffer.
        self.embed_weight: Weight = _contiguous(t["model.embed_tokens.weight"])  # [V, H]
        if tied:
            self.lm_head: Weight = self.embed_weight  # [V, H]
        else:
            self.lm_head = _contiguous(t["lm_head.weight"])  # [V, H]
        self._layers: dict[int, LayerWeights] = {}
        self.plan = plan
        self.head = LayerStack(cfg, 0, [])
        self.tail = LayerStack(cfg, cfg.n_layers, [])
        self.set_split(plan)
        # the organisation key (a keyed trunk server); the rotation is derived on first use
        self.org_key: OrgKey | None = None
        if org_key is not None:
            self.org_key = org_key if isinstance(org_key, OrgKey) else OrgKey.load(Path(org_key))
        self._keyed: KeyedTransform | None = None

    def set_org_key(self, key: OrgKey | None) -> None:
        """Use another organisation key (or none) from the next connection on."""
        if key != self.org_key:
            self.org_key, self._keyed = key, None

    @property
    def key_id(self) -> str | None:
        """The organisation key's public id (None: no key)."""
        return self.org_key.key_id if self.org_key is not None else None

    def keyed(self) -> KeyedTransform:
        """The organisation key's change of basis for this model (derived once)."""
        if self.org_key is None:
            raise SplitError("this trunk runs a keyed model, but no organisation key is loaded")
        if self._keyed is None:
            from engine.keyed.trunk import client_model_fp, client_transform

            fp = client_model_fp(self.resolved.folder, self.reader)
            self._keyed = client_transform(self.org_key, self.config, fp)
        return self._keyed

    def set_split(self, plan: SplitPlan) -> None:
        """Re-split: read newly needed layers, drop ones no longer local. Caches are reset."""
        if plan.n_layers != self.config.n_layers:
            raise SplitError("split plan is for a different model")
        want = list(range(0, plan.head)) + list(range(plan.n_layers - plan.tail, plan.n_layers))
        if hasattr(self.reader, "check_plan"):
            self.reader.check_plan(plan.head, plan.n_layers - plan.tail)
        missing = [i for i in want if i not in self._layers]
        self._layers.update(
            read_layers(self.weights, self.config, missing, self.dtype, self.device)
        )
        for i in list(self._layers):
            if i not in want:
                del self._layers[i]
        self.plan = plan
        n = plan.n_layers
        self.head = LayerStack(
            self.config,
            0,
            [self._layers[i] for i in range(plan.head)],
            dtype=self.dtype,
            device=self.device,
        )
        tail_start = n - plan.tail
        self.tail = LayerStack(
            self.config,
            tail_start,
            [self._layers[i] for i in range(tail_start, n)],
            dtype=self.dtype,
            device=self.device,
        )

    def tap_layers(self) -> tuple[int, int, int]:
        """How many decoder layers lie below each of :class:`BlockStates`' three states."""
        return self.plan.head, self.plan.n_layers - self.plan.tail, self.plan.n_layers

    def trunk_fingerprint(self) -> str:
        start, end = self.plan.trunk_range
        return trunk_fingerprint(self.reader, self.config, start, end)

    def local_param_bytes(self) -> int:
        """Bytes of weights held here, as held: quantized matrices count their blocks."""
        b = weight_bytes(self.embed_weight) + weight_bytes(self.norm_weight)
        if self.lm_head is not self.embed_weight:
            b += weight_bytes(self.lm_head)
        return b + sum(w.nbytes() for w in self._layers.values())

    def reset(self) -> None:
        self.head.reset()
        self.tail.reset()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Two tokens through the local layers and the LM head, and the top successors of their
        logits (what a speculative round learns from), then forget them: the kernels' first-use
        compiles (once per machine, then loaded from disk in a second) happen here, while
        loading says so, instead of silently inside the first reply — where one also made the
        speculative decoder's first drafted round look seconds long."""
        ids = torch.zeros(2, dtype=torch.long, device=self.device)  # [2]
        pos = torch.arange(2, device=self.device)  # [2]
        x = self.embed(ids)  # [2, H]
        x = self.tail.forward(self.head.forward(x, pos), pos)  # [2, H]
        kernels.top_k_softmax(self.logits(x), 2)
        self.reset()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed_weight, QuantWeight):
            x = self.embed_weight.rows(ids).to(device=self.device, dtype=self.dtype)  # [B, H]
        else:
            x = F.embedding(ids.to(self.device), self.embed_weight)  # [B, H]
        if self.config.embed_scale != 1.0:  # Gemma: sqrt(hidden), rounded to the weights' dtype
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype, device=x.device)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        h = rms_norm(hidden, self.norm_weight, self.config.rms_eps)  # [B, H]
        out = linear(h, self.lm_head).float()  # [B, V]
        cap = self.config.final_softcap
        return out if cap is None else torch.tanh(out / cap) * cap


@dataclass
class BlockStates:
    """A block's hidden states at the three places the client sees them: after its head layers,
    as the trunk returned them, and after its tail layers (before the final norm). A learned
    draft head reads all three (:mod:`engine.drafts.head`)."""

    head: torch.Tensor  # [B, H]
    trunk: torch.Tensor  # [B, H]
    final: torch.Tensor  # [B, H]

    def features(self) -> torch.Tensor:
        return torch.cat([self.head, self.trunk, self.final], dim=-1)  # [B, 3H]


@dataclass
class InFlight:
    """A block whose head layers ran and whose trunk step was sent (:meth:`SplitRunner.start`);
    :meth:`SplitRunner.finish` takes the trunk's answer and runs the tail."""

    head: torch.Tensor  # [B, H] after the head layers
    positions: torch.Tensor  # [B]
    parents: Sequence[int] | None
    keep: Sequence[int] | None
    ticket: Any  # the trunk's handle (or its answer, for a trunk that answers at once)


class SplitRunner:
    """Runs a block through head → trunk → tail → LM head and counts trunk round trips."""

    def __init__(self, client: ClientModel, trunk: Trunk | None) -> None:
        self.client = client
        self.trunk = trunk
        self.check()

    def check(self) -> None:
        plan = self.client.plan
        if plan.fully_local:
            return
        if self.trunk is None:
            raise SplitError("this split needs a trunk, but none is connected")
        if (self.trunk.start, self.trunk.end) != plan.trunk_range:
            raise SplitError(
                f"trunk serves layers [{self.trunk.start}, {self.trunk.end}) but the split needs "
                f"{list(plan.trunk_range)}"
            )
        self.keyed  # noqa: B018 - a keyed trunk needs this client's key: refused here, at once

    @property
    def keyed(self) -> KeyedTransform | None:
        """The trunk's secret basis when it runs a model keyed to an organisation key (then
        what is sent is ``keyed.rotate_in(h)``), else None."""
        key_id = getattr(self.trunk, "key_id", None) if self.remote else None
        if key_id is None:
            return None
        if self.client.key_id != key_id:
            from engine.keyed.transform import KeyedError

            mine = self.client.key_id
            raise KeyedError(
                f"the trunk runs a model keyed to organisation key {key_id}; "
                + (f"this computer's key is {mine}" if mine else "add your organisation's key")
            )
        return self.client.keyed()

    @property
    def remote(self) -> bool:
        return not self.client.plan.fully_local

    def reset(self) -> None:
        self.client.reset()
        if self.trunk is not None and self.remote:
            self.trunk.reset()

    @torch.inference_mode()
    def hidden(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        parents: Sequence[int] | None = None,
        keep: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Final hidden states [B, H] (before the norm and LM head) for a block of tokens."""
        return self.forward_states(ids, positions, parents, keep).final

    @torch.inference_mode()
    def forward(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        parents: Sequence[int] | None = None,
        keep: Sequence[int] | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits [B, V] (or [1, V] with ``last_only``) for a block of tokens."""
        x = self.hidden(ids, positions, parents, keep)  # [B, H]
        if last_only:
            x = x[-1:]
        return self.client.logits(x)

    @torch.inference_mode()
    def forward_states(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        parents: Sequence[int] | None = None,
        keep: Sequence[int] | None = None,
    ) -> BlockStates:
        """Like :meth:`hidden` (one trunk round trip), but the hidden states at the head, the
        trunk and the tail; the logits are ``client.logits(states.final)``."""
        return self.finish(self.start(ids, positions, parents, keep))

    @torch.inference_mode()
    def start(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        parents: Sequence[int] | None = None,
        keep: Sequence[int] | None = None,
    ) -> InFlight:
        """The first half of :meth:`forward_states`: the head layers, and the trunk step sent
        (on a trunk with ``submit``) without waiting for its answer. Blocks are finished in the
        order they were started; a second block may be started first (rounds in flight)."""
        c = self.client
        ids_t = torch.tensor(list(ids), dtype=torch.long, device=c.device)  # [B]
        pos_t = torch.tensor(list(positions), dtype=torch.long, device=c.device)  # [B]
        x = c.embed(ids_t)  # [B, H]
        h = c.head.forward(x, pos_t, parents, keep)  # [B, H]
        ticket: Any = h
        if self.remote:
            assert self.trunk is not None
            keyed = self.keyed
            sent = h if keyed is None else keyed.rotate_in(h)  # [B, H] (a keyed trunk: h @ q)
            submit = getattr(self.trunk, "submit", None)
            if submit is not None:
                ticket = submit(sent, pos_t, parents, keep)
            else:
                ticket = self.trunk.forward(sent, pos_t, parents, keep)
        return InFlight(h, pos_t, parents, keep, ticket)

    @torch.inference_mode()
    def finish(self, f: InFlight) -> BlockStates:
        """The trunk's answer to a started block, then the tail layers."""
        c = self.client
        t = f.ticket  # [B, H]
        if self.remote:
            assert self.trunk is not None
            collect = getattr(self.trunk, "collect", None)
            if collect is not None:
                t = collect(f.ticket)
            t = t.to(device=c.device, dtype=c.dtype)
            keyed = self.keyed
            if keyed is not None:  # a keyed trunk answers in its secret basis
                t = keyed.rotate_out(t)  # [B, H]
        return BlockStates(f.head, t, c.tail.forward(t, f.positions, f.parents, f.keep))


def load_client(
    spec: str | ResolvedModel,
    local_layers: int = 2,
    *,
    tail_layers: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    progress: Progress | None = None,
    private_weights: str | Path | None = None,
    client_quant: str = "auto",
    warm_up: bool = False,
    org_key: OrgKey | str | Path | None = None,
) -> ClientModel:
    """The client for ``spec``. ``client_quant``: ``auto`` (a GGUF file's matrices stay in
    their quantized blocks; float checkpoints stay float), ``none`` (everything float: the
    reference path), ``int8`` or ``int4`` (quantized at load, cached). ``warm_up``: run two
    tokens through it (:func:`warm_up_client`: the kernels' one-time compiles then happen
    while loading, under a "preparing kernels" label when they take a while, not inside the
    first reply). ``org_key``: the
    organisation key (an :class:`OrgKey` or its file) for a trunk server that runs a keyed
    model; a trunk in this process (the public model's) ignores it."""
    resolved = spec if isinstance(spec, ResolvedModel) else resolve(spec, progress)
    config = load_config(resolved.folder)
    if tail_layers is None:
        plan = SplitPlan.symmetric(config.n_layers, local_layers)
    else:
        plan = SplitPlan.of(config.n_layers, local_layers, tail_layers)
    client = ClientModel(
        resolved,
        plan,
        dtype=dtype,
        device=device,
        config=config,
        private_weights=private_weights,
        client_quant=client_quant,
        org_key=org_key,
    )
    if warm_up:
        warm_up_client(client, progress)
    return client


WARM_LABEL_AFTER_S = 1.0  # the warm-up's label shows once it has run this long (0: at once)


def warm_up_client(client: ClientModel, progress: Progress | None = None) -> None:
    """:meth:`ClientModel.warm_up` under a "preparing kernels" label that shows only once the
    warm-up has taken ``WARM_LABEL_AFTER_S``: first-use compiles take seconds, once per machine
    (then the label says why loading waits); loading the compiled kernels from numba's disk
    cache takes a fraction of a second and shows nothing (no line in a CLI's output)."""
    if progress is None:
        client.warm_up()
    else:
        labelled_if_slow(progress, "preparing kernels", client.warm_up, WARM_LABEL_AFTER_S)


def _contiguous(t: torch.Tensor | QuantWeight) -> Weight:
    return t.contiguous() if isinstance(t, torch.Tensor) else t


def folder_of(spec: str | Path) -> Path:
    return resolve(str(spec)).folder
