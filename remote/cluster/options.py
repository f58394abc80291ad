"""``veil-trunk serve --ray`` options and flags (no Ray import: the plain server never needs it)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from remote.flags import finite_float


@dataclass
class ClusterOptions:
    address: str = "local"  # local: a private Ray runtime here; auto: the cluster this node joined
    replicas: int = 1
    gpus_per_replica: float | None = None  # None: 1 when --device/--devices names cuda, else 0
    cpus_per_replica: float = 1.0
    threads: int = 0  # torch threads in each replica (0: its CPUs)
    kernel_threads: int = 0
    max_restarts: int = -1  # Ray restarts a dead replica this often (-1: always)
    ready_timeout_s: float = 600.0
    namespace: str = "veil-trunk"


def add_serve_args(s: argparse.ArgumentParser) -> None:
    """The cluster flags of ``veil-trunk serve``."""
    g = s.add_argument_group("replicas on a Ray cluster (pip install 'veil[cluster]')")
    g.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="auto|ADDRESS",
        help="serve through replicas on Ray: this process becomes the gateway (same socket, keys "
        "and checks) and each replica loads the trunk once. No value: a private Ray runtime on "
        "this machine (loopback only, its own token and temp folder); auto: the cluster this "
        "node joined with `ray start`; or the head's HOST:PORT",
    )
    g.add_argument(
        "--replicas", type=int, default=1, metavar="N", help="trunk replicas (default 1)"
    )
    g.add_argument(
        "--gpus-per-replica",
        type=finite_float,
        default=None,
        metavar="G",
        help="GPUs per replica; G > 1 splits its layers into stages over them (default: 1 with "
        "--device cuda, else 0)",
    )
    g.add_argument(
        "--cpus-per-replica",
        type=finite_float,
        default=1.0,
        metavar="C",
        help="CPUs Ray reserves per replica; a CPU replica's torch threads (default 1)",
    )


def from_args(args: argparse.Namespace) -> ClusterOptions | None:
    """The options of ``--ray`` (None without it); ValueError with the message for bad values."""
    if args.ray is None:
        if args.replicas != 1 or args.gpus_per_replica is not None:
            raise ValueError("--replicas and --gpus-per-replica need --ray")
        return None
    if args.replicas < 1 or args.replicas > 64:
        raise ValueError("--replicas must be between 1 and 64")
    if (args.gpus_per_replica or 0) < 0 or args.cpus_per_replica < 0:
        raise ValueError("--gpus-per-replica and --cpus-per-replica cannot be negative")
    return ClusterOptions(
        address=args.ray,
        replicas=args.replicas,
        gpus_per_replica=args.gpus_per_replica,
        cpus_per_replica=args.cpus_per_replica,
        threads=args.threads,
        kernel_threads=args.kernel_threads,
    )
