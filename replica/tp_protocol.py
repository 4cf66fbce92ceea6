"""What the tensor-parallel driver (rank 0) sends its workers: tensors only, no pickles.

Every command is one broadcast of a fixed int64 header [HEADER_LEN], then the payload
tensors the header sizes (broadcast, except WRITE's values: one send to each worker):

    kind   header[1:]                                    payload
    STEP   T, D, W, P, Wp, lora_count, S, M              int64 [4T + D*W + D + 3P + P*Wp
                                                         + S + M]
    WRITE  slot, numel, rank                             int64 [num_slices] slice ranks,
                                                         float [numel] A and B values of
                                                         the receiving rank's shard
    CLEAR  slot                                          -
    STOP   -                                             -

STEP payload, in order: input_ids [T], positions [T], lora_slots [T], slot_mapping [T],
decode block tables [D, W], decode context lens [D], prefill (start, q_len, context_len)
[P, 3], prefill block tables [P, Wp] zero-padded (attention reads a chunk's table only
up to its context_len), sample rows [S], prompt rows [M] (the rows whose logits the
driver computes: each worker computes its vocab shard of them for the driver's gather).
Example: one decode token (table [3], 5 tokens of KV) and a 3-token prefill chunk (table
[1, 2]) that ends its prompt, no prompt logprobs: T=4, D=1, W=1, P=1, Wp=2, S=2, M=0.

WRITE payload: for each layer, group and slice of `base_shape.GROUPS` in order, the
slice's rank (0 = untargeted); then rank t's shard (`slot_buffers.shard_slice`) of A
[r, H] and B [N, r] of each targeted slice, flattened and concatenated, sent to rank t
alone. Every rank's shard has the same numel (the model's sizes divide by tp), so the
values a worker receives are the whole adapter's / tp, roughly: column-parallel groups
keep A whole. Example (tp 2, one qkv slice of rank 4, H 8, N 8): each worker receives
A [4, 8] and its half of B [4, 4], 48 values instead of 64.
"""

from __future__ import annotations

import torch

from lora_core.base_shape import GROUPS, BaseShape
from lora_core.slot_buffers import shard_slice
from lora_core.weights import AdapterWeights, SliceWeights
from replica.layers.attention import AttentionMetadata, PrefillChunk
from replica.model_runner import StepBatch

HEADER_LEN = 10
STEP, WRITE, CLEAR, STOP = 1, 2, 3, 4


def header(kind: int, *fields: int, device: torch.device) -> torch.Tensor:
    """int64 [HEADER_LEN]: kind, then fields, zero-padded."""
    values = [kind, *fields]
    assert len(values) <= HEADER_LEN, "header fields fit HEADER_LEN"
    return torch.tensor(values + [0] * (HEADER_LEN - len(values)), dtype=torch.long, device=device)


def pack_step(batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of one step; payload on the batch's device."""
    meta = batch.meta
    t = batch.input_ids.shape[0]
    dev = batch.input_ids.device
    parts = [batch.input_ids, batch.positions, batch.lora_slots.long(), meta.slot_mapping]
    d, w = 0, 0
    if meta.num_decode:
        d, w = meta.decode_block_tables.shape
        parts += [meta.decode_block_tables.reshape(-1), meta.decode_context_lens]
    p = len(meta.prefills)
    wp = max((c.block_table.shape[0] for c in meta.prefills), default=0)
    if p:
        parts.append(
            torch.tensor(
                [[c.start, c.q_len, c.context_len] for c in meta.prefills],
                dtype=torch.long,
                device=dev,
            ).view(-1)
        )
        tables = torch.zeros(p, wp, dtype=torch.long, device=dev)
        for i, c in enumerate(meta.prefills):
            tables[i, : c.block_table.shape[0]] = c.block_table
        parts.append(tables.view(-1))
    prompt_rows = batch.prompt_rows if batch.prompt_rows is not None else batch.sample_rows[:0]
    parts += [batch.sample_rows, prompt_rows]
    s, m = batch.sample_rows.shape[0], prompt_rows.shape[0]
    payload = torch.cat([x.reshape(-1).long() for x in parts])
    return header(STEP, t, d, w, p, wp, batch.lora_count, s, m, device=dev), payload


def step_payload_len(h: list[int]) -> int:
    """Payload elements of a STEP header (as a list of ints)."""
    t, d, w, p, wp, _, s, m = h[1:9]
    return 4 * t + d * w + d + 3 * p + p * wp + s + m


def unpack_step(h: list[int], payload: torch.Tensor, dense_prompt_min: int) -> StepBatch:
    """The StepBatch a worker runs: its sample and prompt rows say which rows' logit
    shards to compute; no sequences, no prompt targets (only the driver samples and
    scores). dense_prompt_min: the worker's EngineConfig.dense_prompt_min (the driver's,
    since every rank builds from one config)."""
    t, d, w, p, wp, lora_count, s, m = h[1:9]
    sizes = [t, t, t, t, d * w, d, 3 * p, p * wp, s, m]
    ids, pos, slots, slot_mapping, dtables, dlens, pinfo, ptables, rows, prompt_rows = (
        payload.split(sizes)
    )
    ptables = ptables.view(p, wp)
    prefills = [
        PrefillChunk(start, q_len, ctx, ptables[i])
        for i, (start, q_len, ctx) in enumerate(pinfo.view(p, 3).tolist())
    ]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        num_decode=d,
        decode_block_tables=dtables.view(d, w) if d else None,
        decode_context_lens=dlens if d else None,
        prefills=prefills,
        dense_prompt_min=dense_prompt_min,
    )
    return StepBatch(
        input_ids=ids,
        positions=pos,
        lora_slots=slots,
        lora_count=lora_count,
        meta=meta,
        sample_rows=rows,
        sample_seqs=[],
        prompt_rows=prompt_rows if m else None,
    )


def _slice_keys(base: BaseShape):
    for layer in range(base.num_layers):
        for group, modules in GROUPS.items():
            for s in range(len(modules)):
                yield layer, group, s


def slice_ranks(weights: AdapterWeights, base: BaseShape, device: torch.device) -> torch.Tensor:
    """int64 [num_slices] on device: each slice's rank in `_slice_keys` order (0: none)."""
    ranks = []
    for layer, group, s in _slice_keys(base):
        sw = weights.slices(layer, group)[s]
        ranks.append(0 if sw is None else sw.rank)
    return torch.tensor(ranks, dtype=torch.long, device=device)


def pack_shard(
    weights: AdapterWeights,
    base: BaseShape,
    tp_rank: int,
    tp_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rank tp_rank's shard of every targeted slice's A and B, flat: [numel] in dtype
    (the slots') on device. numel is the same for every tp_rank."""
    values = []
    for layer, group, s in _slice_keys(base):
        sw = weights.slices(layer, group)[s]
        if sw is not None:
            part = shard_slice(sw, group, tp_rank, tp_size)
            values += [part.a.reshape(-1), part.b.reshape(-1)]
    flat = torch.cat(values) if values else torch.zeros(0)
    return flat.to(device, dtype)


def num_slices(base: BaseShape) -> int:
    return base.num_layers * sum(len(m) for m in GROUPS.values())


def unpack_shard(
    ranks: torch.Tensor, flat: torch.Tensor, base: BaseShape, rank: int, tp_size: int
) -> AdapterWeights:
    """The shard AdapterWeights (views of flat; content_hash empty) of adapter rank
    `rank` from slice_ranks' and pack_shard's tensors: what `SlotBuffers.write_shard`
    of a rank of a tp_size group takes."""
    layers: list[dict[str, list[SliceWeights | None]]] = [
        {g: [] for g in GROUPS} for _ in range(base.num_layers)
    ]
    offset = 0
    for (layer, group, s), r in zip(_slice_keys(base), ranks.tolist(), strict=True):
        if r == 0:
            layers[layer][group].append(None)
            continue
        h, outs = base.shard_sizes(group, tp_size)
        n = outs[s]
        a = flat[offset : offset + r * h].view(r, h)
        offset += r * h
        b = flat[offset : offset + n * r].view(n, r)
        offset += n * r
        layers[layer][group].append(SliceWeights(a, b))
    if offset != flat.numel():
        raise ValueError(f"{flat.numel()} values received; the slice ranks need {offset}")
    packed = tuple({g: tuple(v) for g, v in layer.items()} for layer in layers)
    return AdapterWeights("", rank, packed)
