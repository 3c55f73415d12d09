"""Drop-ins for verl's pipeline-parallel router-map helpers (``verl/utils/megatron/router_replay_utils.py``).

==================================  ===========================================================
``pp_gather``                       this pipeline rank's router map, dense ``[bs, S, L_local, K]``
                                    or jagged ``[B, j, L_local, K]``, gathered over the pipeline
                                    group into the map of every MoE layer, on the CPU
``reorder_and_merge_vpp_layers``    the router maps recorded per (micro-batch, model chunk), in
                                    schedule order -> one map, the chunks' layers side by side
``merge_nested_router_maps``        the micro-batches' router maps -> one int16 jagged tensor
==================================  ===========================================================

Each returns exactly what verl 0.9.1 returns (values, dtypes, shapes, devices, nested offsets,
exception types and messages). verl main (1dda039b) has the same signatures; the installed 0.9.1
differs in behaviour only where main fails, and the drop-ins follow 0.9.1 there:

* ``pp_gather`` raises ``RuntimeError("pipeline group size W does not match configured PP size P.")``
  (main: an ``IndexError`` or a silently short map), and gathers dense maps whose pipeline stages own
  different numbers of MoE layers, zero included (main: an all-gather of tensors of different
  shapes). A dense map is reinterpreted as int16 through its bytes, as verl does (an int16 map comes
  back unchanged); when no stage owns a layer the local map is returned, copied to the CPU.
* ``reorder_and_merge_vpp_layers`` raises ``RuntimeError("R2 RECORD must capture every scheduled
  microbatch/chunk, ...")`` when the list does not hold one map per schedule entry (main: an
  ``IndexError``, or extra maps silently ignored).

How they differ from verl's code (not in what they return):

* ``pp_gather`` moves tensors, not pickles: one fixed-size all-gather of each rank's shape, dtype
  and layer count, then one all-gather of every rank's bytes (the layer dimension padded to the
  largest stage; a jagged map's offsets travel in front of its values) into one buffer, gathered as
  uint8 (NCCL has no int16), and one concatenation of the layer pieces into the output. Every rank
  issues both collectives whatever its data: a rank whose map is malformed, or ranks whose maps do
  not fit together, make every rank raise (the malformed rank its own error, the others a
  ``RuntimeError`` naming it) instead of leaving the others in a collective. The pipeline group is
  megatron-core's ``parallel_state.get_pipeline_model_parallel_group()``, as in verl; gloo groups
  move CPU tensors, other backends tensors on the current accelerator. With virtual pipeline stages,
  the layers each (pipeline stage, model chunk) owns come from verl's own
  ``get_moe_num_layers_to_build`` (looked up in ``verl.utils.megatron.router_replay_utils`` when
  called), so the layer order is verl's. A jagged map takes its offsets from pipeline rank 0, as
  verl's concatenation does.
* ``merge_nested_router_maps`` and ``reorder_and_merge_vpp_layers`` copy each micro-batch's rows
  once into the output (verl unbinds every sequence, then concatenates twice). The schedule comes
  from megatron-core's ``get_schedule_table``, as in verl.
* Jagged inputs must be ``torch.jagged`` nested tensors without holes (offsets only) for
  ``pp_gather``, as for every drop-in of this package (``ValueError`` otherwise). The merge helpers
  accept anything verl accepts: maps they cannot copy row-wise (holes, components of different
  trailing shapes, mixed dtypes or devices) go through torch's own nested-tensor constructor and
  concatenation, which decide the result or the error exactly as in verl.
"""

from __future__ import annotations

import importlib
import sys
from functools import reduce

import torch

from .._validate import check_jagged, is_jagged_nested
from ._common import _megatron, _mpu

__all__ = ["merge_nested_router_maps", "pp_gather", "reorder_and_merge_vpp_layers"]

_OWNER = "verl.utils.megatron.router_replay_utils"
# dtypes a jagged map may travel in (an index into this tuple goes into the shape exchange).
_WIRE_DTYPES = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
)
_MAX_DIMS = 8
_DENSE, _JAGGED = 0, 1


# --------------------------------------------------------------------------------------------
# merge_nested_router_maps


def _rows_of_map(m):
    """(values [rows, *F], sequence lengths as a list) of one router map when its sequences are
    consecutive rows of one buffer (jagged without holes and ragged in dim 1, or dense
    ``[b, S, *F]`` with dim >= 2); None otherwise."""
    if is_jagged_nested(m):
        if m._lengths is not None or m._ragged_idx != 1:
            return None
        values = m._values
        lengths = m.offsets().diff().tolist()
        start = int(m.offsets()[0])
        if start != 0 or sum(lengths) != values.shape[0]:
            return None
        return values, lengths
    if isinstance(m, torch.Tensor) and not m.is_nested and m.dim() >= 2:
        return m.reshape(m.shape[0] * m.shape[1], *m.shape[2:]), [m.shape[1]] * m.shape[0]
    return None


def _nested_from_list(router_maps):
    """torch's own list constructor over every sequence of the maps (irregular inputs only)."""
    seqs = []
    for m in router_maps:
        if not isinstance(m, torch.Tensor):
            raise AttributeError(f"'{type(m).__name__}' object has no attribute 'unbind'")
        seqs.extend(s.to(torch.int16) for s in m.unbind())
    return torch.nested.as_nested_tensor(seqs, layout=torch.jagged)


def _regular_maps(router_maps):
    """[(values, lengths)] of maps whose sequences all share one trailing shape, one device; else None."""
    parts = [_rows_of_map(m) for m in router_maps]
    if not parts or any(p is None for p in parts):
        return None
    nonempty = [p for p in parts if p[1]]
    if not nonempty:
        return None
    feat, device = nonempty[0][0].shape[1:], nonempty[0][0].device
    if any(v.shape[1:] != feat or v.device != device for v, _ in nonempty):
        return None
    return nonempty


def _jagged_int16(values: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0, out=offsets[1:])
    return torch.nested.nested_tensor_from_jagged(
        values, offsets.to(values.device), min_seqlen=min(lengths), max_seqlen=max(lengths)
    )


def _copy_rows(out: torch.Tensor, parts) -> None:
    """Rows of ``parts`` one after the other into ``out`` (int16, possibly a column slice): one
    concatenation when it can write ``out`` directly, else one converting copy per part."""
    values = [v for v, _ in parts]
    if out.is_contiguous() and all(v.dtype == out.dtype for v in values):
        torch.cat(values, dim=0, out=out)
        return
    row = 0
    for v in values:
        out[row : row + v.shape[0]].copy_(v)
        row += v.shape[0]


def merge_nested_router_maps(router_maps) -> torch.Tensor:
    """verl's merge of recorded micro-batch routes: every sequence of every map, in order, as one
    int16 jagged nested tensor (offsets int64 on the values' device).

    Args:
        router_maps: the micro-batches' router maps, jagged ``[b_i, j, *F]`` (dense ``[b_i, S, *F]``
            works too: S rows per sequence), any dtype (converted to int16).
    """
    router_maps = list(router_maps)
    parts = _regular_maps(router_maps)
    if parts is None:
        return _nested_from_list(router_maps)
    first = parts[0][0]
    lengths = [n for _, ls in parts for n in ls]
    out = torch.empty((sum(lengths), *first.shape[1:]), dtype=torch.int16, device=first.device)
    _copy_rows(out, parts)
    return _jagged_int16(out, lengths)


# --------------------------------------------------------------------------------------------
# reorder_and_merge_vpp_layers


def _schedule_table(num_microbatches, vpp_size, microbatch_group_size_per_vp_stage):
    get_schedule_table = _megatron("megatron.core.pipeline_parallel.schedules", "get_schedule_table",
                                   "verl_ops.integrations.verl_pp")
    return get_schedule_table(num_microbatches, vpp_size, microbatch_group_size_per_vp_stage)


def _merge_chunks_jagged(chunks):
    """Jagged branch: chunk c's maps merged (as merge_nested_router_maps), then the chunks side by
    side along dim 2, offsets of chunk 0. One row copy per map when every map is regular and the
    chunks line up row for row; torch's concatenation (and its error) otherwise."""
    per_chunk = [_regular_maps(maps) for maps in chunks]
    if all(p is not None for p in per_chunk) and per_chunk:
        firsts = [p[0][0] for p in per_chunk]
        rows = [sum(v.shape[0] for v, _ in p) for p in per_chunk]
        feat = firsts[0].shape[2:]
        if (
            all(f.dim() >= 2 and f.shape[2:] == feat and f.device == firsts[0].device for f in firsts)
            and len(set(rows)) == 1
        ):
            widths = [f.shape[1] for f in firsts]
            out = torch.empty((rows[0], sum(widths), *feat), dtype=torch.int16, device=firsts[0].device)
            col = 0
            for parts, width in zip(per_chunk, widths):
                _copy_rows(out[:, col : col + width], parts)
                col += width
            return _jagged_int16(out, [n for _, ls in per_chunk[0] for n in ls])
    return torch.cat([merge_nested_router_maps(maps) for maps in chunks], dim=2)


def _merge_chunks_dense(chunks):
    """Dense branch: chunk c's maps stacked along dim 0, the chunks side by side along dim 2. One
    copy per map into the output when all maps share dtype, device and shape (but the batch dim,
    equal per chunk position); torch's concatenations (and their errors) otherwise."""
    flat = [t for maps in chunks for t in maps]
    ok = (
        chunks
        and all(maps for maps in chunks)
        and all(isinstance(t, torch.Tensor) and not t.is_nested and t.dim() >= 3 for t in flat)
    )
    if ok:
        t0 = flat[0]
        ok = all(t.dtype == t0.dtype and t.device == t0.device and t.dim() == t0.dim() for t in flat)
    if ok:
        rows = [sum(t.shape[0] for t in maps) for maps in chunks]
        widths = [maps[0].shape[2] for maps in chunks]
        rest = (t0.shape[1], *t0.shape[3:])
        ok = len(set(rows)) == 1 and all(
            (t.shape[1], *t.shape[3:]) == rest and t.shape[2] == w for maps, w in zip(chunks, widths) for t in maps
        )
    if not ok:
        return torch.cat([torch.cat(maps, dim=0) for maps in chunks], dim=2)
    out = torch.empty((rows[0], t0.shape[1], sum(widths), *t0.shape[3:]), dtype=t0.dtype, device=t0.device)
    col = 0
    for maps, width in zip(chunks, widths):
        row = 0
        for t in maps:
            out[row : row + t.shape[0], :, col : col + width].copy_(t)
            row += t.shape[0]
        col += width
    return out


def reorder_and_merge_vpp_layers(
    micro_batch_tensor_list,
    num_microbatches: int,
    vpp_size: int,
    microbatch_group_size_per_vp_stage: int,
) -> torch.Tensor:
    """verl's merge of the router maps of an interleaved (virtual) pipeline schedule.

    Args:
        micro_batch_tensor_list: one router map per entry of megatron-core's schedule table
            ``get_schedule_table(num_microbatches, vpp_size, microbatch_group_size_per_vp_stage)``
            (entry v = (micro-batch, model chunk)), in schedule order: dense ``[b, S, L_c, K]`` or
            jagged ``[b, j, L_c, K]``.

    Returns:
        The maps of each model chunk stacked in micro-batch order (dense: along dim 0; jagged: as
        :func:`merge_nested_router_maps`, int16), the chunks side by side along dim 2: dense
        ``[sum b, S, sum L_c, K]`` or jagged ``[sum b, j, sum L_c, K]`` (offsets of chunk 0).
        Jagged when the first map is.

    Raises:
        RuntimeError: ``len(micro_batch_tensor_list)`` differs from the schedule's length (verl's text).
    """
    schedule = _schedule_table(num_microbatches, vpp_size, microbatch_group_size_per_vp_stage)
    if len(micro_batch_tensor_list) != len(schedule):
        raise RuntimeError(
            "R2 RECORD must capture every scheduled microbatch/chunk, including zero-layer chunks: "
            f"captured={len(micro_batch_tensor_list)}, expected={len(schedule)}"
        )
    chunks = [[] for _ in range(vpp_size)]
    for tensor, (_, chunk_id) in zip(micro_batch_tensor_list, schedule):
        chunks[chunk_id].append(tensor)
    if micro_batch_tensor_list[0].is_nested:
        return _merge_chunks_jagged(chunks)
    return _merge_chunks_dense(chunks)


# --------------------------------------------------------------------------------------------
# pp_gather


def _moe_layers_per_stage(tf_config, pp_size: int, vp_size: int) -> list[list[int]]:
    """``counts[pp][vp]``: MoE layers of model chunk ``vp`` on pipeline stage ``pp``, by verl's own
    ``get_moe_num_layers_to_build`` (its layer assignment, whatever megatron-core's version)."""
    owner = sys.modules.get(_OWNER) or importlib.import_module(_OWNER)
    count = owner.get_moe_num_layers_to_build
    return [[count(tf_config, vp, pp) for vp in range(vp_size)] for pp in range(pp_size)]


def _layer_pieces(layers: list[int], tf_config, vp_size) -> list[tuple[int, int, int]]:
    """(pipeline rank, first local layer, end) of each piece of the output's layer dim, in order:
    whole ranks without virtual stages; else for each model chunk, each rank's layers of that
    chunk (clamped to the layers the rank holds, as slicing its map would)."""
    if vp_size is None:
        return [(r, 0, n) for r, n in enumerate(layers)]
    counts = _moe_layers_per_stage(tf_config, len(layers), vp_size)
    pieces = []
    for vp in range(vp_size):
        for pp, n in enumerate(layers):
            start, stop, _ = slice(sum(counts[pp][:vp]), sum(counts[pp][: vp + 1])).indices(n)
            pieces.append((pp, start, max(start, stop)))
    return pieces


def _transport_device(group) -> torch.device:
    """CPU for gloo; the current accelerator for NCCL and the other device backends."""
    if str(torch.distributed.get_backend(group)) == "gloo":
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if acc is None:
        return torch.device("cpu")
    return torch.device(acc.type, torch.accelerator.current_device_index())


def _word_dtype(nbytes: int) -> torch.dtype:
    """Widest integer dtype whose size divides ``nbytes`` (the copies move words, not bytes)."""
    for dt in (torch.int64, torch.int32, torch.int16):
        if nbytes % dt.itemsize == 0:
            return dt
    return torch.uint8


class _Local:
    """This rank's map as it travels: ``kind``, the dtype code, the transported shape (dense: the
    uint8 view's, jagged: the values'), the layer count, the batch size (jagged) and the tensors."""

    def __init__(self, x, vp_size):
        self.x = x
        if x.is_nested:
            check_jagged("pp_gather", "local_layers_router_map", x)
            if x._ragged_idx != 1:
                raise ValueError("pp_gather: local_layers_router_map must be ragged in dim 1")
            self.kind, self.values, self.offsets = _JAGGED, x._values, x.offsets()
            if x.dim() < 3:
                torch.cat([x, x], dim=2)  # verl's concatenation raises on a map without a layer dim
            if vp_size is not None and self.values.dim() < 3:  # verl slices [:, piece, :] per sequence
                raise IndexError(f"too many indices for tensor of dimension {self.values.dim()}")
            ends = self.offsets[[0, -1]].tolist()
            if ends != [0, self.values.shape[0]]:
                raise ValueError(
                    f"pp_gather: local_layers_router_map's offsets must run from 0 to its {self.values.shape[0]} "
                    f"value rows, got {ends[0]}..{ends[1]}"
                )
            if self.values.dtype not in _WIRE_DTYPES:
                raise ValueError(f"pp_gather: unsupported router map dtype {self.values.dtype}")
            self.dtype_code = _WIRE_DTYPES.index(self.values.dtype)
            self.shape, self.layers, self.batch = tuple(self.values.shape), self.values.shape[1], x.size(0)
            # its cached min / max length, if any: verl's concatenation keeps rank 0's
            lo, hi = x._min_seqlen, x._max_seqlen
            self.cache = (int(lo), int(hi)) if lo is not None and hi is not None else (-1, -1)
        else:
            # verl's own steps (and errors): the uint8 view, then the layer count from dim 2.
            self.kind, self.payload = _DENSE, x.contiguous().view(torch.uint8)
            self.layers = x.shape[2]
            self.dtype_code, self.shape, self.batch = _WIRE_DTYPES.index(torch.uint8), tuple(self.payload.shape), 0
            self.cache = (-1, -1)
        if len(self.shape) > _MAX_DIMS:
            raise ValueError(f"pp_gather: router maps of at most {_MAX_DIMS} dims are supported, got {x.dim()}")

    @staticmethod
    def words(local, error) -> list[int]:
        if error is not None:
            return [1] + [0] * (7 + _MAX_DIMS)
        shape = list(local.shape) + [-1] * (_MAX_DIMS - len(local.shape))
        return [0, local.kind, local.dtype_code, len(local.shape), local.batch, local.layers, *shape, *local.cache]


def _exchange_descriptions(local, error, group, world: int, device) -> list[list[int]]:
    words = torch.tensor(_Local.words(local, error), dtype=torch.int64, device=device)
    out = torch.empty(world * words.numel(), dtype=torch.int64, device=device)
    torch.distributed.all_gather_into_tensor(out, words, group=group)
    rows = out.view(world, -1).tolist()
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        if error is not None:
            raise error
        raise RuntimeError(f"pp_gather: pipeline rank(s) {failed} rejected their router maps (their error says why)")
    return [row[1:] for row in rows]


def _same_but(shapes: list[tuple], dim: int) -> bool:
    return all(len(s) == len(shapes[0]) and s[:dim] + s[dim + 1 :] == shapes[0][:dim] + shapes[0][dim + 1 :]
               for s in shapes)


def _gather_bytes(send: torch.Tensor, group, world: int) -> torch.Tensor:
    recv = torch.empty(world * send.numel(), dtype=torch.uint8, device=send.device)
    torch.distributed.all_gather_into_tensor(recv, send, group=group)
    return recv.view(world, send.numel())


def _assemble(blocks: torch.Tensor, rows: int, width: int, row_bytes: int, pieces) -> torch.Tensor:
    """``blocks [world, rows * width * row_bytes]`` (uint8) -> ``[rows, sum of pieces, row_bytes]``
    (uint8): the layer pieces side by side, one concatenation, moved as words."""
    word = _word_dtype(row_bytes) if blocks.shape[1] else torch.uint8  # (an empty buffer has no word stride)
    src = blocks.view(word).view(blocks.shape[0], rows, width, row_bytes // word.itemsize)
    out = torch.cat([src[r, :, a:b] for r, a, b in pieces], dim=1)
    return out.view(torch.uint8)


def pp_gather(local_layers_router_map, tf_config):
    """verl's gather of the router maps of every pipeline stage (a collective over the pipeline group).

    Args:
        local_layers_router_map: this stage's map, dense ``[bs, S, L_local, *F]`` (its bytes are
            gathered and read back as int16, as verl does) or jagged ``[B, j, L_local, *F]`` (any
            dtype; the ranks' dtypes are promoted as ``torch.cat`` would).
        tf_config: ``pipeline_model_parallel_size`` and ``virtual_pipeline_model_parallel_size``.

    Returns:
        The input itself when ``pipeline_model_parallel_size <= 1``; else, on the CPU, the maps of
        all stages side by side along dim 2 (in stage order, or with virtual stages, chunk by
        chunk: chunk 0 of every stage, then chunk 1, ...): dense int16 ``[bs, S, L, *F]`` or
        jagged ``[B, j, L, *F]`` with pipeline rank 0's offsets.
    """
    pp_size = tf_config.pipeline_model_parallel_size
    if pp_size <= 1:
        return local_layers_router_map
    group = _mpu().get_pipeline_model_parallel_group()
    world = torch.distributed.get_world_size(group)
    if world != pp_size:
        raise RuntimeError(f"pipeline group size {world} does not match configured PP size {pp_size}.")
    vp_size = tf_config.virtual_pipeline_model_parallel_size
    device = _transport_device(group)
    local, error = None, None
    try:
        local = _Local(local_layers_router_map, vp_size)
    except Exception as e:  # noqa: BLE001  (re-raised on this rank after the shape exchange)
        error = e
    described = _exchange_descriptions(local, error, group, world, device)
    kinds = [d[0] for d in described]
    if len(set(kinds)) > 1:
        raise RuntimeError(
            "pp_gather: pipeline ranks hold different kinds of router maps (jagged on ranks "
            f"{[r for r, k in enumerate(kinds) if k == _JAGGED]}, dense on the others)"
        )
    shapes = [tuple(d[5 : 5 + d[2]]) for d in described]
    layers = [d[4] for d in described]
    width = max(layers)
    if local.kind == _DENSE:
        return _gather_dense(local, shapes, layers, width, tf_config, vp_size, group, world, device)
    return _gather_jagged(local, described, shapes, layers, width, tf_config, vp_size, group, world, device)


def _gather_dense(local, shapes, layers, width, tf_config, vp_size, group, world, device):
    x = local.x
    if width == 0:  # no stage owns a layer: verl returns the local map (copied to the CPU)
        if vp_size is not None:
            _layer_pieces(layers, tf_config, vp_size)
            if x.dim() < 4:
                raise IndexError(f"too many indices for tensor of dimension {x.dim()}")
        return torch.empty(x.shape, dtype=x.dtype)
    if x.dim() < 4:  # verl's [:, :, :n, :] slicing of a map of three dims
        raise IndexError(f"too many indices for tensor of dimension {x.dim()}")
    if not _same_but(shapes, 2):
        raise RuntimeError(
            f"pp_gather: pipeline ranks' router maps differ outside the layer dim (uint8 views: {shapes})"
        )
    pieces = _layer_pieces(layers, tf_config, vp_size)
    shape = shapes[0]
    rows, row_bytes = shape[0] * shape[1], 1
    for n in shape[3:]:
        row_bytes *= n
    payload = local.payload.to(device).view(rows, local.layers, row_bytes)
    if local.layers == width:
        send = payload.reshape(-1)
    else:
        send = torch.empty(rows * width * row_bytes, dtype=torch.uint8, device=device)
        send.view(rows, width, row_bytes)[:, : local.layers].copy_(payload)
    out = _assemble(_gather_bytes(send, group, world), rows, width, row_bytes, pieces).to("cpu")
    return out.view(shape[0], shape[1], out.shape[1], *shape[3:]).view(torch.int16)


def _gather_jagged(local, described, shapes, layers, width, tf_config, vp_size, group, world, device):
    dtypes = [_WIRE_DTYPES[d[1]] for d in described]
    dtype = reduce(torch.promote_types, dtypes)
    if not _same_but(shapes, 1):  # verl's concatenation of the values along the layer dim raises
        torch.cat([torch.empty(s, dtype=dt, device="meta") for s, dt in zip(shapes, dtypes)], dim=1)
    pieces = _layer_pieces(layers, tf_config, vp_size)
    batch = max(d[3] for d in described)
    head = (batch + 1) * 8  # every rank's offsets slot, int64, in front of its values
    rows, feat = shapes[0][0], shapes[0][2:]
    row_bytes = dtype.itemsize
    for n in feat:
        row_bytes *= n
    send = torch.empty(head + rows * width * row_bytes, dtype=torch.uint8, device=device)
    send[: (local.batch + 1) * 8].view(torch.int64).copy_(local.offsets)
    values = send[head:].view(dtype).view(rows, width, *feat)
    values[:, : local.layers].copy_(local.values)
    blocks = _gather_bytes(send, group, world)
    offsets = blocks[0, : (described[0][3] + 1) * 8].view(torch.int64).to("cpu")
    out = _assemble(blocks[:, head:], rows, width, row_bytes, pieces).to("cpu")
    out = out.view(dtype).view(rows, out.shape[1], *feat)
    # the min / max length cache of rank 0's map, as verl's concatenation of the gathered maps
    # (rank 0's first) carries it
    lo, hi = described[0][5 + _MAX_DIMS : 7 + _MAX_DIMS]
    cache = {"min_seqlen": lo, "max_seqlen": hi} if lo >= 0 and hi >= 0 else {}
    return torch.nested.nested_tensor_from_jagged(out, offsets, **cache)
