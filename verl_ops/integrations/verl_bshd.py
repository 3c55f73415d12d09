"""Drop-ins for verl's BSHD, dict-output and VLM-mask helpers (``verl/models/mcore/util.py``).

================================================  ===============================================
``preprocess_bshd_engine``                        jagged nested -> ``(x [B, S_local, *F], mask, position_ids)``
``postprocess_bshd_engine``                       ``[B, S_local, *F]`` + mask -> jagged nested
``preprocess_bshd``                               remove left padding (cp == 1)
``postprocess_bshd``                              put the left padding back
``postprocess_packed_seqs_for_dict_output``       ``entropy`` / ``log_probs`` of a fused kernel, unpacked
``build_vlm_attn_mask_thd`` / ``_bshd``           padded ids + prefix mask of a jagged batch
================================================  ===============================================

Each returns exactly what verl 0.9.1 returns (values in every row, dtypes, shapes, exception types
and messages). verl main (1dda039b) differs in one of them: its ``build_vlm_attn_mask_thd`` pads to
the longest length without 0.9.1's TP / CP alignment; the drop-in follows the verl in use
(:func:`vlm_thd_align_rule`, read from its source; ``VLM_THD_ALIGN_RULE`` overrides). The BSHD engine path is the THD zigzag path with every sequence padded to the
batch's (aligned) longest length: the same :class:`~verl_ops.ThdLayout` and fused
``preprocess_thd`` / ``postprocess_thd`` ops, one gather kernel per tensor. Parallel sizes come
from ``megatron.core.parallel_state`` as in verl (imported lazily).

Not reproduced: verl's Ascend-NPU branches (``is_npu_available``: a ``[B, 1, S, S]`` attention
mask for ``npu_fusion_attention``); these drop-ins always take verl's GPU/CPU path.

Where verl's result on bad input is torch's own error or a silent loss, the drop-ins raise their
own error instead (minimal cases in tests/test_verl_diff_fuzz.py, ``REASONS``):
``preprocess_bshd_engine`` with a ``forced_max_seqlen`` below the longest aligned sequence raises a
``ValueError`` (verl raises a shape ``RuntimeError`` at cp == 1 and drops the tokens past it at
cp > 1); ``postprocess_bshd`` with an original mask whose rows hold other token counts, or of
another width than ``origin_seqlen``, raises a ``RuntimeError`` naming it (verl: torch's
``RuntimeError`` / ``IndexError``); 0/1 integer masks are read as bool masks (verl indexes with
them as integer indices).
"""

from __future__ import annotations

import math

import torch

from .._thd import postprocess_thd, preprocess_thd
from ..layout import ThdLayout
from ._common import _mpu, _verl_rule
from .verl import postprocess_packed_seqs

__all__ = [
    "build_vlm_attn_mask_bshd",
    "build_vlm_attn_mask_thd",
    "postprocess_bshd",
    "postprocess_bshd_engine",
    "postprocess_packed_seqs_for_dict_output",
    "preprocess_bshd",
    "preprocess_bshd_engine",
]


def _nested_lengths(op: str, x) -> torch.Tensor:
    if not (isinstance(x, torch.Tensor) and x.is_nested):
        raise ValueError(f"{op}: input_ids must be a jagged nested tensor, got {type(x)}")
    offsets = x.offsets()
    if offsets is None or x._lengths is not None:
        raise ValueError(f"{op}: input_ids must be a contiguous jagged nested tensor (layout=torch.jagged)")
    return offsets.diff()


def _align_tp_cp(max_seqlen: int, tp_size: int, cp_size: int) -> tuple[int, int]:
    """(aligned max_seqlen, align): verl pads BSHD rows to tp*cp*2 (cp > 1) or tp."""
    align = tp_size * cp_size * 2 if cp_size > 1 else tp_size
    if align > 1:
        max_seqlen += (align - max_seqlen % align) % align
    return max_seqlen, align


def _prefix_mask(lengths: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """bool [B, len(positions)]: positions[j] < lengths[i]."""
    return positions.unsqueeze(0) < lengths.to(positions.device).unsqueeze(1)


def _uniform_layout(lengths, rows: int, cp_size: int) -> ThdLayout:
    """Every sequence padded to `rows` (the BSHD width): row i of the BSHD tensor is THD sequence i."""
    B = len(lengths) if not isinstance(lengths, torch.Tensor) else lengths.numel()
    cu_padded = torch.arange(B + 1, dtype=torch.int32) * rows
    return ThdLayout.from_padded_offsets(lengths, cu_padded, cp_size=cp_size, cp_layout="zigzag")


def _zigzag_positions(max_seqlen: int, cp_size: int, cp_rank: int, device) -> torch.Tensor:
    """int64 [max_seqlen / cp]: the global positions of this rank's BSHD columns."""
    if cp_size <= 1:
        return torch.arange(max_seqlen, dtype=torch.long, device=device)
    c = max_seqlen // (2 * cp_size)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, dtype=torch.long, device=device)
    second = torch.arange(max_seqlen - (cp_rank + 1) * c, max_seqlen - cp_rank * c, dtype=torch.long, device=device)
    return torch.cat((first, second))


def preprocess_bshd_engine(
    input_ids: torch.Tensor,
    pre_process: bool = True,
    need_roll: bool = False,
    use_fp8_padding: bool = False,
    forced_max_seqlen: int | None = None,
):
    """verl's BSHD model-engine pack of a jagged nested batch ``[B, j, *F]``.

    Every sequence is padded to ``S`` = the longest length (or ``forced_max_seqlen``) rounded up to
    ``tp*cp*2`` (cp > 1) or ``tp``; with FP8, ``S`` is further a multiple of
    ``128*tp*cp / gcd(B, 128*tp*cp)`` (so ``B*S`` splits into 128-row FP8 blocks per rank). With
    cp > 1 each rank keeps zigzag chunks ``r`` and ``2cp-1-r`` of every row.

    Returns ``(x [B, S/cp, *F], attention_mask bool [B, S/cp], position_ids int64 [B, S/cp])``:
    padding is zero, ``position_ids`` is the columns' global positions (an expanded view, as in
    verl). ``need_roll``: column at position q holds token ``(q+1) % S`` of the zero-padded row
    (cp == 1: each row rolled by one column). ``pre_process`` is accepted and, as in verl, ignored.
    """
    op = "preprocess_bshd_engine"
    del pre_process  # verl computes the padded tensor whatever its value
    lengths = _nested_lengths(op, input_ids)
    mpu = _mpu()
    cp_size = mpu.get_context_parallel_world_size()
    cp_rank = mpu.get_context_parallel_rank()
    tp_size = mpu.get_tensor_model_parallel_world_size()
    B = input_ids.shape[0]
    lengths_cpu = lengths.detach().to("cpu", torch.int64)
    max_seqlen = int(forced_max_seqlen) if forced_max_seqlen is not None else int(lengths_cpu.max())
    max_seqlen, align = _align_tp_cp(max_seqlen, tp_size, cp_size)
    if use_fp8_padding:
        fp8_total = 128 * tp_size * cp_size
        fp8_align = math.lcm(fp8_total // math.gcd(B, fp8_total), align)
        max_seqlen = (max_seqlen + fp8_align - 1) // fp8_align * fp8_align
    local = max_seqlen // cp_size if cp_size > 1 else max_seqlen
    layout = _uniform_layout(lengths_cpu, max_seqlen, cp_size).to(input_ids.device)
    rank = cp_rank if cp_size > 1 else 0
    # cp > 1: the zigzag THD roll is exactly verl's (q+1) % S over the zero-padded row.
    packed, _ = preprocess_thd(input_ids, layout, rank, roll=bool(need_roll) and cp_size > 1, validate=False)
    x = packed.view(B, local, *packed.shape[1:])
    if need_roll and cp_size <= 1:
        x = torch.roll(x, shifts=-1, dims=1)
    positions = _zigzag_positions(max_seqlen, cp_size, cp_rank, input_ids.device)
    attention_mask = _prefix_mask(lengths, positions)
    return x, attention_mask, positions.unsqueeze(0).expand_as(attention_mask)


def postprocess_bshd_engine(output: torch.Tensor, attention_mask: torch.Tensor, post_process: bool = True):
    """verl's BSHD unpack: ``[B, S/cp, *F]`` (+ this rank's mask) -> jagged nested ``[B, j, *F]``.

    With cp > 1 every rank's output and mask are all-gathered over the CP group, the zigzag chunks
    put back in order, and each row keeps the positions its full mask marks (in order). The
    gradient reaches this rank's ``output`` only, as in verl.
    """
    if not post_process:
        return output
    assert output.shape[:2] == attention_mask.shape, (
        f"output.shape: {output.shape}, attention_mask.shape: {attention_mask.shape}"
    )
    mpu = _mpu()
    cp_size = mpu.get_context_parallel_world_size()
    B, local = output.shape[0], output.shape[1]
    mask = attention_mask.bool()
    if cp_size > 1:
        assert local % 2 == 0, "CP bshd expects local sequence length to be divisible by 2"
        cp_rank = mpu.get_context_parallel_rank()
        group = mpu.get_context_parallel_group()
        # verl's collectives, in verl's order and shapes: outputs, then masks.
        outs = [torch.empty_like(output) for _ in range(cp_size)]
        torch.distributed.all_gather(outs, output.detach(), group=group)
        outs[cp_rank] = output  # the gradient reaches this rank's shard only
        masks = [torch.empty_like(mask) for _ in range(cp_size)]
        torch.distributed.all_gather(masks, mask, group=group)
        full = local * cp_size
        layout = _uniform_layout([full] * B, full, cp_size).to(output.device)
        shards = torch.stack([o.reshape(B * local, *output.shape[2:]) for o in outs])
        values = postprocess_thd(shards, layout, cp_rank, as_nested=False)
        full_mask = postprocess_thd(torch.stack(masks).view(cp_size, B * local), layout, cp_rank, as_nested=False)
    else:
        values = output.reshape(B * local, *output.shape[2:])
        full_mask = mask.reshape(B * local)
        full = local
    counts = full_mask.view(B, full).sum(dim=1)
    offsets = torch.zeros(B + 1, dtype=torch.int64, device=output.device)
    offsets[1:] = torch.cumsum(counts.to(output.device), dim=0)
    return torch.nested.nested_tensor_from_jagged(values[full_mask], offsets)


def preprocess_bshd(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    sequence_parallel: bool = False,
    pre_process: bool = True,
):
    """verl's left-padding removal (cp == 1): each row's masked tokens moved to its front.

    Returns ``(input_ids [B, S', *F], attention_mask [B, S'], position_ids [B, S'])`` with ``S'`` the
    longest row count (rounded up to tp when ``sequence_parallel``), zeros after each row's tokens.
    With ``pre_process=False`` ``input_ids`` is returned unchanged.
    """
    assert attention_mask.ndim == 2
    assert position_ids.ndim == 2
    mpu = _mpu()
    cp_size = mpu.get_context_parallel_world_size()
    assert cp_size == 1, "Context parallel size without seq_pack is not supported"
    B = input_ids.shape[0]
    mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
    seq_lens = mask.sum(dim=1)
    seq_len = int(seq_lens.max().item())
    if sequence_parallel:
        sp = mpu.get_tensor_model_parallel_world_size()
        seq_len += (sp - seq_len % sp) % sp
    lengths_cpu = seq_lens.detach().to("cpu", torch.int64)
    layout = _uniform_layout(lengths_cpu, seq_len, 1).to(input_ids.device)

    def pack(t):
        out, _ = preprocess_thd(t, layout, 0, attention_mask=mask, validate=False)
        return out.view(B, seq_len, *out.shape[1:])

    new_mask = _prefix_mask(seq_lens, torch.arange(seq_len, device=attention_mask.device))
    new_mask = new_mask.to(attention_mask.dtype)
    if attention_mask.dtype != torch.bool:  # verl copies the mask's own (true) values
        new_mask = pack(attention_mask)
    new_position_ids = pack(position_ids)
    if pre_process:
        return pack(input_ids), new_mask, new_position_ids
    return input_ids, new_mask, new_position_ids


def postprocess_bshd(
    result: torch.Tensor,
    attention_mask: torch.Tensor,
    original_attention_mask: torch.Tensor,
    origin_seqlen: int,
    post_process: bool = True,
):
    """verl's inverse of :func:`preprocess_bshd`: ``result[i, attention_mask[i]]`` back to the
    positions ``original_attention_mask[i]`` of a ``[B, origin_seqlen, *F]`` tensor (zeros elsewhere)."""
    if not post_process:
        return result
    B = result.shape[0]
    mask = attention_mask.bool()
    orig = original_attention_mask.bool()
    counts, orig_counts = mask.sum(dim=1), orig.sum(dim=1)
    if not torch.equal(counts.cpu(), orig_counts.cpu()):
        raise RuntimeError(
            "postprocess_bshd: attention_mask and original_attention_mask mark different numbers of "
            f"tokens per row ({counts.tolist()} vs {orig_counts.tolist()})"
        )
    if orig.shape[1] != origin_seqlen:
        raise RuntimeError(
            f"postprocess_bshd: original_attention_mask has {orig.shape[1]} columns, origin_seqlen={origin_seqlen}"
        )
    lengths_cpu = counts.detach().to("cpu", torch.int64)
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths_cpu, 0)
    layout = ThdLayout.from_padded_offsets(lengths_cpu, cu).to(result.device)
    return postprocess_thd(result[mask], layout, 0, attention_mask=orig)


def postprocess_packed_seqs_for_dict_output(
    labels_mask: torch.Tensor,
    output,
    packed_seq_params,
    attention_mask: torch.Tensor,
    batch_size: int,
    seq_len: int,
    post_process: bool = True,
) -> dict[str, torch.Tensor]:
    """verl's unpack of a fused kernel's ``entropy`` / ``log_probs`` (``[1, local_rows]`` each).

    As in verl, ``output.entropy`` and ``output.log_probs`` are replaced by their ``[1, -1]`` views
    and ``log_probs`` is zeroed where ``labels_mask`` is false, then both are unpacked with
    :func:`verl_ops.integrations.verl.postprocess_packed_seqs`.
    """
    output.entropy = output.entropy.view(1, -1)
    output.log_probs = output.log_probs.view(1, -1)
    output.log_probs = output.log_probs.masked_fill(~labels_mask, 0.0)
    return {
        "entropy": postprocess_packed_seqs(
            output.entropy, packed_seq_params, attention_mask, batch_size, seq_len, post_process=post_process
        ),
        "log_probs": postprocess_packed_seqs(
            output.log_probs, packed_seq_params, attention_mask, batch_size, seq_len, post_process=post_process
        ),
    }


def _vlm_padded(op, input_ids, batch_size, pad_token_id, max_seqlen):
    lengths = _nested_lengths(op, input_ids)
    padded = input_ids.to_padded_tensor(pad_token_id, output_size=(batch_size, max_seqlen))
    mask = _prefix_mask(lengths, torch.arange(max_seqlen, device=padded.device))
    return padded, mask


#: Whether build_vlm_attn_mask_thd rounds the longest length up to the TP / CP alignment:
#: ``"0.9.1"`` (it does), ``"main"`` (verl main 1dda039b: it pads to the longest length only), or
#: None (default) for the rule of the verl in use, read from its ``verl/models/mcore/util.py``.
VLM_THD_ALIGN_RULE: str | None = None


def vlm_thd_align_rule() -> str:
    """``"0.9.1"`` or ``"main"`` (see VLM_THD_ALIGN_RULE): whether the in-use verl's
    build_vlm_attn_mask_thd aligns to TP / CP (it names ``align_size``); ``"0.9.1"`` when no verl
    is found."""
    return _verl_rule("VLM_THD_ALIGN_RULE", VLM_THD_ALIGN_RULE, "build_vlm_attn_mask_thd",
                      lambda body: "align_size" not in body)


def build_vlm_attn_mask_thd(input_ids: torch.Tensor, pad_token_id: int = None):
    """``(input_ids padded with pad_token_id to [B, S], prefix mask bool [B, S])``, ``S`` the longest
    length rounded up to ``tp*cp*2`` (cp > 1) or ``tp`` as in verl 0.9.1; under verl main's rule
    (:func:`vlm_thd_align_rule`) the longest length itself."""
    op = "build_vlm_attn_mask_thd"
    lengths = _nested_lengths(op, input_ids)
    max_seqlen = int(lengths.max().item())
    if vlm_thd_align_rule() == "0.9.1":
        mpu = _mpu()
        max_seqlen, _ = _align_tp_cp(
            max_seqlen, mpu.get_tensor_model_parallel_world_size(), mpu.get_context_parallel_world_size()
        )
    return _vlm_padded(op, input_ids, input_ids.shape[0], pad_token_id, max_seqlen)


def build_vlm_attn_mask_bshd(
    input_ids: torch.Tensor, batch_size: int, pad_token_id: int = None, forced_max_seqlen: int | None = None
):
    """As :func:`build_vlm_attn_mask_thd` for the BSHD path: ``forced_max_seqlen`` (raw, before
    alignment) replaces the batch's longest length, as in :func:`preprocess_bshd_engine`."""
    op = "build_vlm_attn_mask_bshd"
    lengths = _nested_lengths(op, input_ids)
    mpu = _mpu()
    raw = forced_max_seqlen if forced_max_seqlen is not None else int(lengths.max().item())
    max_seqlen, _ = _align_tp_cp(
        raw, mpu.get_tensor_model_parallel_world_size(), mpu.get_context_parallel_world_size()
    )
    return _vlm_padded(op, input_ids, batch_size, pad_token_id, max_seqlen)
