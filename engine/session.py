"""Build a ready-to-run split from user options: the one place the CLI, the app and the
benchmark turn "model + local layers (+ server)" into a :class:`SplitRunner`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import GenerationError
from engine.loading import DEFAULT_MODEL, Progress, ResolvedModel
from engine.split import ClientModel, SplitRunner, Trunk, load_client, load_trunk

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """A dtype name; ``auto`` is the fastest exact-enough one for ``device``
    (:func:`engine.kernels.cpu.default_dtype`)."""
    if name.lower() == "auto":
        from engine.kernels.cpu import default_dtype

        return default_dtype(device)
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise GenerationError(
            f"unknown dtype '{name}'", hint="use auto, float32, bfloat16 or float16"
        ) from None


@dataclass
class RunnerOptions:
    # None: the server's model, fetched from it (with ``server``), else the embedded default
    model: str | None = DEFAULT_MODEL
    local_layers: int = 2
    tail_layers: int | None = None
    server: str | None = None  # None: the trunk runs in this process
    insecure: bool = False  # plain TCP to a loopback `veil-trunk serve --insecure`
    dtype: str = "float32"
    device: str = "cpu"
    private_weights: str | None = None  # organisation-private head/tail layers (veil privatize)
    client_quant: str = (
        "auto"  # the client's matrices: auto (GGUF kept quantized), none, int8, int4
    )
    # the organisation key file for a server that runs a keyed model (a trunk run in this
    # process is the public model's and ignores it)
    org_key: str | None = None
    # asked before the server's model is downloaded: (manifest, bytes to fetch) -> go ahead?
    confirm_download: Callable[[Any, int], bool] | None = None
    fetched: Any = None  # set by open_runner: the server's part it loaded (InstalledPart)


def open_trunk(client: ClientModel, opts: RunnerOptions, progress: Progress | None) -> Trunk | None:
    """The trunk for ``client``'s split: None when fully local, in-process without a server."""
    if client.plan.fully_local:
        return None
    start, end = client.plan.trunk_range
    if opts.server:
        from engine.transport import connect_trunk

        return connect_trunk(opts.server, client, progress=progress, insecure=opts.insecure)
    return load_trunk(
        client.resolved,
        start,
        end,
        dtype=parse_dtype(opts.dtype, opts.device),
        device=opts.device,
        progress=progress,
    )


def open_runner(opts: RunnerOptions, progress: Progress | None = None) -> SplitRunner:
    spec: str | ResolvedModel = opts.model or DEFAULT_MODEL
    if opts.model is None and opts.server:
        from engine.delivery.client import check_local_layers, fetch_server_part

        part = fetch_server_part(
            opts.server,
            insecure=opts.insecure,
            confirm=opts.confirm_download,
            progress=progress,
        )
        check_local_layers(part, opts.local_layers, opts.tail_layers)
        opts.fetched, spec = part, part.resolved
    client = load_client(
        spec,
        opts.local_layers,
        tail_layers=opts.tail_layers,
        dtype=parse_dtype(opts.dtype, opts.device),
        device=opts.device,
        progress=progress,
        private_weights=opts.private_weights,
        client_quant=opts.client_quant,
        org_key=opts.org_key,
    )
    return SplitRunner(client, open_trunk(client, opts, progress))
