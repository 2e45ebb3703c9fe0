"""What both vLLM lines' builder equivalence tests share: stock's KV length
per decode token in the cache layouts they cover (written out here as their
independent reference), the reference standing in for the varlen kernel, and
their hypothesis settings."""

from hypothesis import HealthCheck

from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref

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


def reference_kernel(q, kv_cache, weights, context_lens, block_table, indices,
                     max_context_len, **_):
    """Stand-in for the varlen kernel under the dispatch: the reference."""
    return paged_mqa_logits_ref(q, kv_cache, weights, context_lens, block_table,
                                max_context_len, indices)


SETTINGS = dict(derandomize=True, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
