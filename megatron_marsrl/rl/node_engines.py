"""SGLang servers on every node of a run, reached by rank 0's engine pools over HTTP.

Rank 0 starts its own node's engines (RolloutSide); the first rank of every other node starts
that node's (`NodeEngines`), on the same GPUs of its node. All ranks then exchange the
servers' addresses on the control group (`gather_remote`) and rank 0 adds the other nodes'
servers to its pools: requests are balanced over every engine of the run, and the other
nodes' engines take each weight sync by broadcast from rank 0 (rollout/pool.py).

Only SGLang servers spread: the in-process engines ("hf", "sglang") live in rank 0's process.
Every node must see the model directory rank 0 uses (a shared file system, as for checkpoints).
An engine on another node whose process dies is not restarted (its owner does not watch it):
its requests fail over to the other engines.
"""
from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist

from megatron_marsrl.net import is_loopback, is_wildcard, route_address
from megatron_marsrl.rl.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class NodeRank:
    """Where this rank sits: its node, the number of nodes, its rank on the node."""

    node: int
    nodes: int
    local_rank: int
    per_node: int
    """Trainer ranks per node (they use the node's first GPUs)."""

    @classmethod
    def from_env(cls) -> "NodeRank":
        """From torchrun's environment (GROUP_RANK is the node's rank; one node without it)."""
        world = int(os.environ.get("WORLD_SIZE", 1))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return cls(node=int(os.environ.get("GROUP_RANK", 0)), nodes=max(1, world // per_node),
                   local_rank=int(os.environ.get("LOCAL_RANK", 0)), per_node=per_node)


def spreads(config: TrainConfig, where: NodeRank) -> bool:
    """Whether this run starts engines on more than rank 0's node."""
    return config.engine.on_every_node and where.nodes > 1


def check_placement(config: TrainConfig, where: NodeRank) -> None:
    """Refuse, before anything starts, engines that other nodes cannot reach (servers bound to
    loopback while the nodes are not all this machine) and split engines on trainer GPUs."""
    import torch

    eng, master = config.engine, os.environ.get("MASTER_ADDR", "127.0.0.1")
    if spreads(config, where) and is_loopback(eng.host) and not is_loopback(master):
        raise ValueError(f"engine.host={eng.host!r}: rank 0 must reach the SGLang servers of all {where.nodes} nodes "
                         "over the network: set engine.host=0.0.0.0 and the same secret in MARSRL_SGLANG_API_KEY on "
                         "every node")
    if eng.placement == "split" and torch.cuda.is_available() and eng.base_gpu_id < where.per_node:
        raise ValueError(f"engine.placement=split: the engines start at GPU {eng.base_gpu_id}, but this node's "
                         f"{where.per_node} trainer ranks use GPUs 0..{where.per_node - 1}: set engine.base_gpu_id="
                         f"{where.per_node} (trainer ranks per node + engine GPUs per node <= the node's GPUs)")


class NodeEngines:
    """The engines one node (not rank 0's) starts for rank 0's pools: one set per policy."""

    def __init__(self, config: TrainConfig, hf_dir: str, where: NodeRank):
        from megatron_marsrl.rl.rollout_side import engines_of_policy, memory_saver
        from megatron_marsrl.rollout.factory import start_node_engines

        self.servers: dict[str, list] = {}
        try:
            for i, name in enumerate(config.policy_names()):
                cfg = engines_of_policy(config, i)
                cfg = dataclasses.replace(cfg, seed=cfg.seed + where.node * cfg.num_engines)  # distinct per node
                self.servers[name] = start_node_engines(cfg, hf_dir, memory_saver=memory_saver(config))
        except BaseException:
            self.close()
            raise
        toward = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.urls = {name: [_advertised(s.url, toward) for s in servers] for name, servers in self.servers.items()}

    def close(self) -> None:
        for servers in self.servers.values():
            for server in servers:
                server.shutdown()


def _advertised(url: str, toward: str) -> str:
    """``url`` as another node reaches it: a server bound to every interface (0.0.0.0) is
    announced under this node's address on the route to rank 0's node."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if not is_wildcard(parts.hostname or ""):
        return url
    return f"{parts.scheme}://{route_address(toward)}:{parts.port}"


def gather_remote(group, mine: NodeEngines | None) -> dict[str, list[str]]:
    """Every rank: the other nodes' server URLs per policy, in node order (collective on `group`)."""
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine.urls if mine is not None else {}, group=group)
    out: dict[str, list[str]] = {}
    for urls in everyone:
        for name, listed in urls.items():
            out.setdefault(name, []).extend(listed)
    return out
