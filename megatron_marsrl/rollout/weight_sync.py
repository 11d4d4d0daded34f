"""Engine side of disaggregated weight sync: one trainer rank broadcasts HF-named buckets to
SGLang servers over a dedicated process group.

The Megatron side (export in buckets, read-back and log-prob checks) is
megatron_marsrl/megatron/weight_sync.py; rollout code never imports Megatron.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron_marsrl.net import free_port


class DistributedWeightSender:
    """Disaggregated mode: SGLang servers on other GPUs (or nodes) receive the weights by
    broadcast over a dedicated process group (NCCL on GPU, gloo on CPU) from one trainer rank,
    instead of through shared-memory handles. Create and use it on that trainer rank only."""

    def __init__(self, servers: list, *, master_address: str | None = None, master_port: int = 0,
                 backend: str | None = None, group_name: str = "marsrl_weights"):
        """``master_address``: where the servers reach this rank (default: this machine's address
        on the route to the first server on another machine, 127.0.0.1 when all are on this one)."""
        from concurrent.futures import ThreadPoolExecutor
        from urllib.parse import urlsplit

        from sglang.srt.utils.common import init_custom_process_group

        from megatron_marsrl.net import route_address

        self.servers, self.group_name = servers, group_name
        away = [h for h in (urlsplit(s.url).hostname for s in servers) if not _on_this_machine(h)]
        master_address = master_address or (route_address(away[0]) if away else "127.0.0.1")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        master_port = master_port or free_port(master_address)
        world = 1 + sum(s.config.tp_size for s in servers)
        offsets = [1 + sum(s.config.tp_size for s in servers[:i]) for i in range(len(servers))]
        with ThreadPoolExecutor(len(servers)) as pool:  # the servers join while we join
            joins = [pool.submit(s.init_weights_group, master_address, master_port, rank_offset=o, world_size=world,
                                 group_name=group_name, backend=backend) for s, o in zip(servers, offsets)]
            self.group = init_custom_process_group(backend=backend, init_method=f"tcp://{master_address}:{master_port}",
                                                   world_size=world, rank=0, group_name=group_name)
            for join in joins:
                join.result()

    def send(self, buckets, *, version: int) -> dict:
        from concurrent.futures import ThreadPoolExecutor

        start, nbytes = time.perf_counter(), 0
        def begin(server) -> None:
            server._post("/pause_generation", {"mode": "retract"}, 60)
            server._ok(server._post("/begin_weight_update", {}, 60), "begin_weight_update")

        def end(server) -> None:
            server._ok(server._post("/end_weight_update", {}, 60), "end_weight_update")
            server._post("/flush_cache", {}, 60)
            server._post("/continue_generation", {}, 60)

        with ThreadPoolExecutor(len(self.servers)) as pool:  # each server's calls in order, the servers at once
            list(pool.map(begin, self.servers))
            try:
                for bucket in buckets:
                    receives = [pool.submit(s.receive_bucket, bucket, group_name=self.group_name, version=version)
                                for s in self.servers]
                    for _, tensor in bucket:
                        dist.broadcast(tensor.contiguous(), src=0, group=self.group)
                        nbytes += tensor.numel() * tensor.element_size()
                    for r in receives:
                        r.result()
            finally:
                list(pool.map(end, self.servers))
        for server in self.servers:
            server.weight_version = version
        seconds = time.perf_counter() - start
        return {"bytes": nbytes, "seconds": seconds, "gb_per_s": nbytes / max(seconds, 1e-9) / 1e9}

    def close(self, servers: list | None = None) -> None:
        """Free the group: on ``servers`` (default: all of its servers; give the ones still
        alive when some were lost), then on this rank."""
        try:
            for server in self.servers if servers is None else servers:
                server.destroy_weights_group(self.group_name)
        finally:
            dist.destroy_process_group(self.group)


def _on_this_machine(host: str) -> bool:
    """A server URL's host that names this machine: loopback, or the wildcard a server bound to
    every interface is reached through locally."""
    from megatron_marsrl.net import is_loopback, is_wildcard

    return is_loopback(host) or is_wildcard(host)
