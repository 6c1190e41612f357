"""Attention over tree rows one segment at a time (see :class:`.tree.TreeSegments`): each segment's queries against
its gathered keys (the path above it, then itself), causal aligned to the bottom right. The gather's backward sums
each shared key's and value's gradients over the segments that read it, as the rows' separate forwards do.

The attention functions of :mod:`.varlen` call :func:`tree_attention` for forwards carrying
:data:`TREE_SEGMENTS_KWARG`; on CUDA in half precision the segments go to torch's flash varlen kernel in one call
(bottom-right causal when a segment has more keys than queries), elsewhere to sdpa one segment at a time (the
masked CPU kernel: on this machine faster than the rows' causal kernel at a group's shapes, since it does less work).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

TREE_SEGMENTS_KWARG = "trl_scale_tree_segments"


def tree_attention(query, key, value, segments, scale: float | None, flash: Callable | None = None) -> torch.Tensor:
    """Attention of tree tokens laid out as ``[N, heads, dim]`` (keys and values may have fewer heads). `flash`:
    a varlen kernel ``(q, k, v, cu_q, cu_k, max_q, max_k, scale) -> out`` to run all segments in one call."""
    key = key.index_select(0, segments.kv_index)
    value = value.index_select(0, segments.kv_index)
    if flash is not None:
        return flash(
            query,
            key,
            value,
            segments.cu_seq_lens_q,
            segments.cu_seq_lens_k,
            segments.max_length_q,
            segments.max_length_k,
            scale,
        )
    q_bounds, k_bounds = segments.cu_seq_lens_q.tolist(), segments.cu_seq_lens_k.tolist()
    gqa = key.size(1) != query.size(1)
    outputs = []
    for i in range(len(q_bounds) - 1):
        q = query[q_bounds[i] : q_bounds[i + 1]].transpose(0, 1)
        k = key[k_bounds[i] : k_bounds[i + 1]].transpose(0, 1)
        v = value[k_bounds[i] : k_bounds[i + 1]].transpose(0, 1)
        above = k.size(1) - q.size(1)
        if above == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            mask = torch.ones(q.size(1), k.size(1), dtype=torch.bool, device=q.device).tril(above)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs) if outputs else query.new_zeros(query.shape)
