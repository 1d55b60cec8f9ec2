"""Local attention kernels returning (out, lse), and the fp32 LSE merge of partial results."""
from burstserve.kernels.attention import AttentionBackend, available_backends, select_backend
from burstserve.kernels.merge import merge_into, merge_partials, merge_stacked

__all__ = ["AttentionBackend", "available_backends", "select_backend", "merge_into", "merge_partials", "merge_stacked"]
