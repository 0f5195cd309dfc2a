"""The verifier's ranks under ``--tensor-parallel-size N``: who starts them, and what ranks 1..N-1 do.

One command starts them all, as vLLM does: rank 0 (the verifier the operator ran) spawns ranks
1..N-1 as ``python -m verifier_svc`` with its own flags and torchrun's variables (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); where those variables are already set
(torchrun, or a pod of a multi-node launcher), every rank was started by it and nothing is spawned.
Rank 0 serves gRPC and drives the forwards (``tensor_parallel.Leader``); ranks 1..N-1 load their
shard and :func:`follow_main` runs what rank 0 sends until it says stop or is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specmesh_server.tensor_parallel import Leader, Ranks, TensorParallelConfigError, init_ranks

if TYPE_CHECKING:
    import torch

    from verifier_svc.config import VerifierConfig


@dataclass(frozen=True)
class Placement:
    """Where this process stands: its rank among ``world``, its device, and how the ranks meet."""

    rank: int
    world: int
    device: torch.device  # cuda:LOCAL_RANK on a GPU host
    spawned: bool  # rank 0 starts the others itself (no launcher's variables)


def placement(config: VerifierConfig) -> Placement:
    """This process's :class:`Placement`, or a one-line refusal (:class:`TensorParallelConfigError`)
    where the degree exceeds the devices: GPUs on a CUDA host, cores elsewhere."""
    import torch

    from specmesh_server.model_loading import pick_device

    world = config.tensor_parallel_size
    env_world = os.environ.get("WORLD_SIZE")
    if env_world is not None and int(env_world) != world:
        raise TensorParallelConfigError(
            f"--tensor-parallel-size {world} but the launcher started WORLD_SIZE={env_world} ranks"
        )
    rank = int(os.environ.get("RANK", "0")) if env_world is not None else 0
    local_rank = int(os.environ.get("LOCAL_RANK", rank)) if env_world is not None else 0
    device = pick_device(config.device)
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if env_world is None and world > count:
            raise TensorParallelConfigError(f"--tensor-parallel-size {world} exceeds the {count} GPU(s) this host has")
        if local_rank >= count:  # a launcher's rank (it may span hosts): its own GPU on this host
            raise TensorParallelConfigError(f"LOCAL_RANK {local_rank} but this host has {count} GPU(s)")
        if device.index is None or world > 1:
            device = torch.device("cuda", local_rank if world > 1 else (device.index or 0))
    else:
        cores = len(os.sched_getaffinity(0))
        if world > cores:
            raise TensorParallelConfigError(
                f"--tensor-parallel-size {world} exceeds the {cores} CPU core(s) this process may use "
                "(one at least per rank)"
            )
    return Placement(rank, world, device, spawned=env_world is None and world > 1)


@dataclass
class Group:
    """Rank 0's handle on the ranks: the leader channel (and through it the groups), the ranks it spawned."""

    leader: Leader
    procs: list[subprocess.Popen]

    def close(self, timeout: float = 10.0) -> None:
        """Stop the other ranks: a stop message, then, past ``timeout``, a kill."""
        import torch.distributed as dist

        self.leader.close()
        for proc in self.procs:
            if self.leader.failed is not None:  # a rank is dead or hung: no stop message went out
                proc.kill()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
        if dist.is_initialized() and self.leader.failed is None:  # a failed group may hang its teardown
            dist.destroy_process_group()


def spawn(config: VerifierConfig, where: Placement, argv: list[str]) -> list[subprocess.Popen]:
    """Start ranks 1..world-1 (same flags, torchrun's variables); set rank 0's own variables."""
    from specmesh.deploy import free_port

    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(where.world),
        "LOCAL_WORLD_SIZE": str(where.world),
    }
    os.environ.update(env, RANK="0", LOCAL_RANK="0")
    procs = []
    for r in range(1, where.world):
        rank_env = {**os.environ, **env, "RANK": str(r), "LOCAL_RANK": str(r), "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "verifier_svc", *argv]
        procs.append(subprocess.Popen(cmd, env=rank_env, preexec_fn=_die_with_parent))
    return procs


def _die_with_parent() -> None:
    """In a spawned rank (Linux): SIGTERM when rank 0 dies, however it dies."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def join(config: VerifierConfig, where: Placement) -> Ranks:
    """Join the process group (every rank, once the others are started)."""
    if where.device.type == "cuda":  # kernels launch on the current device: this rank's own
        import torch

        torch.cuda.set_device(where.device)
    # Every rank decides alike: all on this host (spawned here, or torchrun's LOCAL_WORLD_SIZE says so).
    one_host = os.environ.get("LOCAL_WORLD_SIZE") == str(where.world)
    return init_ranks(where.rank, where.world, where.device, config.tensor_parallel_timeout_s, "env://", one_host)


def watch_spawned(procs: list[subprocess.Popen]) -> Any:
    """A ``Leader`` watch: the first spawned rank that exited, as a reason."""

    def exited() -> str | None:
        for i, proc in enumerate(procs, start=1):
            if (code := proc.poll()) is not None:
                return f"rank {i} (pid {proc.pid}) exited with status {code}"
        return None

    return exited


def follow_main(config: VerifierConfig, where: Placement) -> int:
    """Ranks 1..N-1: load this rank's shard and run rank 0's operations; the exit status."""
    import torch

    from specmesh_server.tensor_parallel import follow
    from verifier_svc.target_model import load_shard

    ranks = join(config, where)
    runner = load_shard(config, where, ranks)

    try:
        with torch.inference_mode():
            follow(ranks, where.device, {"forward": runner.forward, "copy": runner.cache.copy_slots})
    except Exception as exc:  # rank 0 gone, or this rank's own forward failed: exit, rank 0's watch sees it
        print(f"verifier rank {where.rank}: {exc!r}", file=sys.stderr, flush=True)
        return 1
    return 0
