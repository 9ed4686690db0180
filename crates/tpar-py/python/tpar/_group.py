"""What the ranks of a torch.distributed group tell each other before and after they create
tpar's communicator (imported only where a group is given, with torch already loaded):

- :func:`gather_texts`: one all-gather of a short text per rank, as fixed-size byte rows of
  tensors (no pickled objects: gloo's object collectives break under torch.inference_mode,
  pytorch issue 126032), on the CPU for gloo and on the current GPU for an NCCL-only group;
- :func:`host_split`: why a group whose ranks run on several hosts cannot be one tpar group;
- :func:`first_cause`: of every rank's outcome, the failure that caused the others.
"""

from __future__ import annotations

import json

# The bytes of one rank's row: its host name, a directory and token (rank 0), and a reason.
ROW_BYTES = 2048
# The longest reason that travels (the rest of a longer one is cut).
REASON_BYTES = 1200


def gather_texts(group, text: str) -> list[str]:
    """Every rank's ``text`` (at most :data:`ROW_BYTES` bytes of UTF-8), in group-rank order."""
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    device = torch.device("cpu")
    if "gloo" not in backend and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    data = text.encode("utf-8", "replace")[:ROW_BYTES]
    row = torch.zeros(ROW_BYTES, dtype=torch.uint8)
    if data:
        row[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    row = row.to(device)
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, row, group=group)
    return [bytes(r.cpu().tolist()).rstrip(b"\0").decode("utf-8", "replace") for r in rows]


def gather_records(group, record: dict) -> list[dict]:
    """Every rank's ``record`` (a small JSON object; its "reason" is cut to fit a row)."""
    reason = record.get("reason")
    if reason is not None:
        record = dict(
            record,
            reason=reason.encode("utf-8", "replace")[:REASON_BYTES].decode("utf-8", "ignore"),
        )
    return [json.loads(text) if text else {} for text in gather_texts(group, json.dumps(record))]


def host_split(hosts: list[str]) -> tuple[int, str] | None:
    """``(rank, why)`` when the ranks run on more than one host (the first rank not on rank 0's
    host, and a sentence naming the hosts and their ranks), else None."""
    if len(set(hosts)) <= 1:
        return None
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    where = "; ".join(f"ranks {ranks} on {host}" for host, ranks in by_host.items())
    first = next(rank for rank, host in enumerate(hosts) if host != hosts[0])
    return first, (
        f"the group spans {len(by_host)} hosts ({where}); tpar reduces within one host: "
        "give it a group of one host's ranks (across hosts, keep NCCL)"
    )


def first_cause(records: list[dict]) -> tuple[int, str, int] | None:
    """Of every rank's ``{"reason", "cause"}`` (reason None: it succeeded; cause: the rank
    whose failure it was, itself or a peer it heard of), the failure that caused the others:
    ``(rank, reason, how many ranks failed for their own reason)``, the lowest such rank first.
    None when every rank succeeded."""
    failed = [(rank, r) for rank, r in enumerate(records) if r.get("reason") is not None]
    if not failed:
        return None
    own = [(rank, r) for rank, r in failed if r.get("cause", rank) == rank]
    if own:
        rank, record = own[0]
        return rank, record["reason"], len(own)
    # Every failing rank heard of the failure from elsewhere: name the rank it came from.
    rank, record = failed[0]
    return record["cause"], record["reason"], 1
