"""vLLM's ``kv_transfer_params``, parsed once where a request enters (the API server or
``SamplingParams``) into a frozen value the engine reads by attribute.

    to a prefill instance:   {"do_remote_decode": true}
    its answer, to a decode: {"remote_host", "remote_port", "remote_lease_id",
                              "remote_block_hashes": [hex, ...]}
                             (+ "remote_rank_ports": [port, ...] from a tensor-parallel
                              prefill instance: rank r's share of the blocks is on port r,
                              + "remote_rank_hosts": [host, ...] where its ranks run on
                              several machines: rank r's is on host r)

Block hashes are hex strings in JSON and bytes inside openinfer (msgpack carries bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

FIELDS = ("do_remote_decode", "remote_host", "remote_port", "remote_lease_id",
          "remote_block_hashes", "remote_rank_ports", "remote_rank_hosts")


@dataclass(frozen=True)
class KVTransferParams:
    do_remote_decode: bool = False
    """Hold the prompt's KV for a decode instance to pull (sent to a prefill instance)."""
    remote_host: str | None = None
    remote_port: int | None = None
    remote_lease_id: str | None = None
    remote_block_hashes: tuple[bytes, ...] = ()
    """The prompt's full blocks the prefill instance holds, in order."""
    remote_rank_ports: tuple[int, ...] = ()
    """A tensor-parallel prefill instance's KV server port of each rank (rank 0's is
    ``remote_port``): each rank of the decode instance pulls its share from its own."""
    remote_rank_hosts: tuple[str, ...] = ()
    """With the prefill instance's ranks on several machines, each rank's KV server host
    (rank 0's is ``remote_host``); empty when they all listen on ``remote_host``."""

    def for_rank(self, rank: int) -> KVTransferParams:
        """What tensor-parallel rank ``rank`` of the decode instance pulls from: the same
        lease on its own rank's host and port (port 0, refused, when the prefill side has no
        such rank, so that share and the block fail and are recomputed)."""
        if not self.remote_rank_ports:
            return self
        port = self.remote_rank_ports[rank] if rank < len(self.remote_rank_ports) else 0
        host = (self.remote_rank_hosts[rank] if rank < len(self.remote_rank_hosts)
                else self.remote_host)
        return replace(self, remote_host=host, remote_port=port, remote_rank_ports=(),
                       remote_rank_hosts=())

    @property
    def all_addresses(self) -> list[tuple[str | None, int | None]]:
        """Every (host, port) holding the lease: each rank's, or the one."""
        if not self.remote_rank_ports:
            return [(self.remote_host, self.remote_port)]
        return [(rank.remote_host, rank.remote_port)
                for rank in map(self.for_rank, range(len(self.remote_rank_ports)))]

    @property
    def pulls(self) -> bool:
        """This request's prefix is to be pulled from a prefill instance."""
        return bool(self.remote_block_hashes)

    @staticmethod
    def parse(value: Any) -> KVTransferParams | None:
        """From a dict (hashes as hex strings or bytes); ValueError naming the field."""
        if value is None or isinstance(value, KVTransferParams):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_params must be an object, got {value!r}")
        unknown = sorted(set(value) - set(FIELDS))
        if unknown:
            raise ValueError(f"kv_transfer_params: unknown field(s) {', '.join(unknown)} "
                             f"(known: {', '.join(FIELDS)})")
        do_remote_decode = value.get("do_remote_decode", False)
        if not isinstance(do_remote_decode, bool):
            raise ValueError("kv_transfer_params.do_remote_decode must be a boolean")
        host, port, lease = (value.get(k) for k in ("remote_host", "remote_port",
                                                       "remote_lease_id"))
        if host is not None and not isinstance(host, str):
            raise ValueError("kv_transfer_params.remote_host must be a string")
        if port is not None and not (isinstance(port, int) and not isinstance(port, bool)
                                     and 0 < port < 65536):
            raise ValueError("kv_transfer_params.remote_port must be a port number")
        if lease is not None and not isinstance(lease, str):
            raise ValueError("kv_transfer_params.remote_lease_id must be a string")
        hashes = value.get("remote_block_hashes") or []
        try:
            assert isinstance(hashes, list | tuple)
            hashes = tuple(h if isinstance(h, bytes) else bytes.fromhex(h) for h in hashes)
        except (AssertionError, TypeError, ValueError):
            raise ValueError("kv_transfer_params.remote_block_hashes must be a list of hex "
                             "strings") from None
        if hashes and (host is None or port is None):
            raise ValueError("kv_transfer_params: remote_block_hashes need remote_host and "
                             "remote_port")
        rank_ports = value.get("remote_rank_ports") or ()
        if not (isinstance(rank_ports, list | tuple) and all(
                isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536
                for p in rank_ports)) or (rank_ports and rank_ports[0] != port):
            raise ValueError("kv_transfer_params.remote_rank_ports must be a list of port "
                             "numbers, remote_port first")
        rank_hosts = value.get("remote_rank_hosts") or ()
        if not (isinstance(rank_hosts, list | tuple) and all(isinstance(h, str) for h in rank_hosts)
                ) or (rank_hosts and (len(rank_hosts) != len(rank_ports) or rank_hosts[0] != host)):
            raise ValueError("kv_transfer_params.remote_rank_hosts must be a list of host names, "
                             "one per remote_rank_ports entry, remote_host first")
        return KVTransferParams(do_remote_decode, host, port, lease, hashes, tuple(rank_ports),
                                tuple(rank_hosts))

    def to_dict(self, hex_hashes: bool = False) -> dict[str, Any]:
        """The fields that are set (hashes as hex for JSON, bytes for msgpack), in the order
        a prefill instance's answer has always listed them; a lease names its blocks even
        when it holds none."""
        out: dict[str, Any] = {}
        if self.do_remote_decode:
            out["do_remote_decode"] = True
        if self.remote_block_hashes or self.remote_lease_id is not None:
            out["remote_block_hashes"] = [h.hex() if hex_hashes else h
                                          for h in self.remote_block_hashes]
        for key in ("remote_lease_id", "remote_host", "remote_port"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.remote_rank_ports:
            out["remote_rank_ports"] = list(self.remote_rank_ports)
        if self.remote_rank_hosts:
            out["remote_rank_hosts"] = list(self.remote_rank_hosts)
        return out
