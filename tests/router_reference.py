"""Router replay test cases and references, written from docs/layout.md and docs/router_replay.md.

A case draws every token's routes ``[len_i, L, K]`` (the truth), packs them per CP rank with the
plain-PyTorch pack of tests/reference.py, and cuts each CP rank's rows into ``tp`` contiguous
sequence-parallel chunks: chunk p, layer l is what MoE layer l of TP rank p records
(``[T_local_sp, K]``). Padding rows of the recording hold garbage (padding tokens are routed too);
the replay targets of padding rows are zero (verl packs into a zeroed buffer).
"""

from __future__ import annotations

import random

import torch

from reference import ref_layout, ref_pack

import verl_ops


class RouterCase:
    def __init__(
        self,
        rng: random.Random,
        lengths,
        num_layers: int,
        topk: int,
        *,
        tp: int = 1,
        cp: int = 1,
        cp_layout: str = "zigzag",
        fp8: bool = False,
        min_local_rows=None,
        high: int = 256,
    ):
        self.lengths = list(lengths)
        self.num_layers, self.topk, self.tp, self.cp = num_layers, topk, tp, cp
        self.layout = verl_ops.ThdLayout.from_lengths(
            self.lengths, tp_size=tp, cp_size=cp, cp_layout=cp_layout, fp8_padding=fp8, min_local_rows=min_local_rows
        )
        cu, cu_padded = ref_layout(self.lengths, tp, cp, cp_layout, fp8, min_local_rows)
        assert self.layout.cu_seqlens_padded_cpu.tolist() == cu_padded and self.layout.cu_seqlens_cpu.tolist() == cu
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        self.g = g
        self.high = high
        self.seqs = [torch.randint(0, high, (n, num_layers, topk), generator=g) for n in self.lengths]
        self.routes = torch.cat(self.seqs) if self.seqs else torch.zeros(0, num_layers, topk, dtype=torch.int64)
        self.replay_seqs = [torch.rand(n, generator=g) < 0.7 for n in self.lengths]
        self.replay = torch.cat(self.replay_seqs) if self.seqs else torch.zeros(0, dtype=torch.bool)
        ones = [torch.ones(n, dtype=torch.bool) for n in self.lengths]
        self.packed, self.valid, self.replay_packed = [], [], []
        for r in range(cp):
            kw = dict(feature_shape=(num_layers, topk), dtype=torch.int64)
            self.packed.append(ref_pack(self.seqs, cu_padded, cp, r, cp_layout, False, **kw)[0])
            self.valid.append(ref_pack(ones, cu_padded, cp, r, cp_layout, False, feature_shape=(), dtype=torch.bool)[0])
            self.replay_packed.append(
                ref_pack(self.replay_seqs, cu_padded, cp, r, cp_layout, False, feature_shape=(), dtype=torch.bool)[0]
            )
        self.rows_sp = self.layout.local_rows // tp
        self._recorded = {}

    def _chunk(self, t: torch.Tensor, tp_rank: int) -> torch.Tensor:
        return t[tp_rank * self.rows_sp : (tp_rank + 1) * self.rows_sp]

    def recorded_rows(self, tp_rank: int, cp_rank: int, dtype=torch.int64) -> torch.Tensor:
        """[T_local_sp, L, K]: what this rank's routers recorded (garbage in padding rows)."""
        key = (tp_rank, cp_rank)
        if key not in self._recorded:
            rows = self._chunk(self.packed[cp_rank], tp_rank).clone()
            invalid = ~self._chunk(self.valid[cp_rank], tp_rank)
            rows[invalid] = torch.randint(0, self.high, rows[invalid].shape, generator=self.g)
            self._recorded[key] = rows
        return self._recorded[key].to(dtype)

    def recorded(self, tp_rank: int, cp_rank: int, form: str = "list", dtype=torch.int64):
        """The recording in one of the input forms of merge_router_topk.

        list: L contiguous [T, K]; strided: L views [T, K] with row stride L*K (non-contiguous);
        stacked: one contiguous [L, T, K]; stacked_strided: a permuted [L, T, K] view.
        """
        rows = self.recorded_rows(tp_rank, cp_rank, dtype)
        if form == "list":
            return [rows[:, l].contiguous() for l in range(self.num_layers)]
        if form == "strided":
            return [rows[:, l] for l in range(self.num_layers)]
        if form == "stacked":
            return rows.permute(1, 0, 2).contiguous()
        assert form == "stacked_strided"
        return rows.permute(1, 0, 2)

    def expected_targets(self, tp_rank: int, cp_rank: int) -> torch.Tensor:
        """[L, T_local_sp, K] int64 replay targets (zero in padding rows)."""
        return self._chunk(self.packed[cp_rank], tp_rank).permute(1, 0, 2).contiguous()

    def expected_replay(self, tp_rank: int, cp_rank: int) -> torch.Tensor:
        return self._chunk(self.replay_packed[cp_rank], tp_rank)

    def nested_routes(self, dtype=torch.int16, device="cpu") -> torch.Tensor:
        return torch.nested.nested_tensor_from_jagged(
            self.routes.to(dtype).to(device), self.layout.cu_seqlens_cpu.to(torch.int64).to(device)
        )

    def nested_replay(self, device="cpu") -> torch.Tensor:
        return torch.nested.nested_tensor_from_jagged(
            self.replay.to(device), self.layout.cu_seqlens_cpu.to(torch.int64).to(device)
        )

    def padded(self, rng: random.Random, extra: int = 3):
        """(routes [B, S, L, K] int16 with garbage off-mask, mask [B, S] scattered, replay [B, S])."""
        B = len(self.lengths)
        S = max(self.lengths, default=0) + rng.randint(1, extra)
        mask = torch.zeros(B, S, dtype=torch.bool)
        for i, n in enumerate(self.lengths):
            mask[i, sorted(rng.sample(range(S), n))] = True
        routes = torch.randint(0, self.high, (B, S, self.num_layers, self.topk), generator=self.g)
        replay = torch.rand(B, S, generator=self.g) < 0.5
        for i, x in enumerate(self.seqs):
            routes[i, mask[i]] = x
            replay[i, mask[i]] = self.replay_seqs[i]
        return routes.to(torch.int16), mask, replay

    def padded_expected(self, mask: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(*mask.shape, self.num_layers, self.topk, dtype=torch.int16)
        for i, x in enumerate(self.seqs):
            out[i, mask[i]] = x.to(torch.int16)
        return out


def verl_stack(layers) -> torch.Tensor:
    """verl's record-side local step: per layer .to(int16), torch.stack, permute to [T, L, K]."""
    if isinstance(layers, torch.Tensor):
        layers = list(layers.unbind(0))
    return torch.stack([t.to(torch.int16) for t in layers]).permute(1, 0, 2).contiguous()
