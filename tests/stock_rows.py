"""What stock's indexer metadata gives each decode token as its KV length, in
the cache layouts the builder tests cover (both vLLM lines' semantics, written
out here as the tests' independent reference)."""

DCP_WORLD = 2  # decode-context-parallel ranks the "dcp_rank<r>" layouts split over


def local_len(length: int, world: int, rank: int) -> int:
    """This rank's share of ``length`` tokens dealt round-robin (interleave 1)."""
    return length // world + (1 if length % world > rank else 0)


def row_len(seq_len: int, n: int, j: int, layout: str) -> int:
    """KV tokens token ``j`` of an ``n``-token request of ``seq_len`` sees:
    ``"dense"``; ``"v4"`` (a 4x compressed cache); ``"dcp_rank<r>"`` (rank
    ``r``'s share over :data:`DCP_WORLD` ranks)."""
    length = max(0, seq_len - n + j + 1)
    if layout == "v4":
        return length // 4
    if layout.startswith("dcp"):
        return local_len(length, DCP_WORLD, int(layout[-1]))
    return length
