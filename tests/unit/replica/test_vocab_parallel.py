"""The vocab-parallel embedding and lm_head: each rank of a TP group holds V/tp rows of
each (V padded up to a multiple of tp), reads only those rows of the checkpoint, and the
group's lookups (all-reduced) and logits (gathered to rank 0, padding dropped) equal the
whole table's, including a rank that holds padding only."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from replica.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from replica.models.loader import load_model
from replica.parallel import SINGLE, TPGroup, free_port
from tests.unit.replica.test_linear_shard_load import Recording, _rows_read

H = 6


def _group(rank: int, size: int) -> TPGroup:
    return TPGroup(rank, size, pg=object())  # loading runs no collective


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("arch", ["llama", "odd_vocab"])
def test_each_rank_holds_its_vocab_rows_only(arch, rank, request):
    """llama: V 384, untied; odd_vocab: V 383 (rank 1 holds one padding row), tied."""
    model_dir = request.getfixturevalue(f"{arch}_dir")
    model, _ = load_model(str(model_dir), torch.float32, torch.device("cpu"), _group(rank, 2))
    cfg = model.config
    rows = -(-cfg.vocab_size // 2)
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    assert embed.shape == head.shape == (rows, cfg.hidden_size)
    assert (head is embed) == cfg.tie_word_embeddings == (arch == "odd_vocab")
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        whole_embed = f.get_tensor("model.embed_tokens.weight")
        whole_head = whole_embed if cfg.tie_word_embeddings else f.get_tensor("lm_head.weight")
    real = min(rows, cfg.vocab_size - rank * rows)
    assert torch.equal(embed[:real], whole_embed[rank * rows : rank * rows + real])
    assert torch.equal(head[:real], whole_head[rank * rows : rank * rows + real])
    assert not embed[real:].any()  # padding rows stay zero
    assert all(p.shape[0] < cfg.vocab_size for p in model.parameters())  # no whole table


@pytest.mark.parametrize(("vocab", "tp", "rank"), [(7, 2, 1), (5, 4, 2), (5, 4, 3)])
def test_loader_reads_only_its_rows(tmp_path, vocab, tp, rank):
    """(5, 4, 3): rows per rank 2, so rank 3 starts at id 6 > V and reads nothing."""
    table = torch.randn(vocab, H)
    path = tmp_path / "w.safetensors"
    save_file({"t": table}, str(path))
    layer = VocabParallelEmbedding(vocab, H, _group(rank, tp))
    with safe_open(str(path), framework="pt") as f:
        rec = Recording(f.get_slice("t"))
        layer.weight_loader(layer.weight, rec)
    rows = -(-vocab // tp)
    real = max(0, min(rows, vocab - rank * rows))
    assert _rows_read(rec.asked) == real
    assert torch.equal(layer.weight[:real], table[rank * rows : rank * rows + real])
    assert not layer.weight[real:].any()
    with pytest.raises(ValueError, match=rf"shape \({vocab + 1}, {H}\) does not fit"):
        layer.weight_loader(layer.weight, torch.zeros(vocab + 1, H))


def _rank_main(rank: int, tp: int, port: int, vocab: int, out: str) -> None:
    group = TPGroup.connect(rank, tp, port, "gloo", timeout_s=120)
    g = torch.Generator().manual_seed(0)
    table, hidden = torch.randn(vocab, H, generator=g), torch.randn(3, H, generator=g)
    ids = torch.tensor([vocab - 1, 0, vocab // 2, vocab - 1])
    embed = VocabParallelEmbedding(vocab, H, group)
    head = ParallelLMHead(vocab, H, group)
    for layer in (embed, head):
        layer.weight_loader(layer.weight, table)
    got = {"rows": embed(ids)}
    logits, empty = head(hidden), head(hidden[:0])
    if rank == 0:
        got |= {"logits": logits, "empty": empty}
    else:
        assert logits is None and empty is None
    save_file(got, f"{out}/rank{rank}.safetensors")
    group.close()


@pytest.mark.parametrize(("vocab", "tp"), [(7, 2), (5, 4)])
def test_lookups_and_logits_equal_the_whole_table(tmp_path, vocab, tp):
    mp.spawn(_rank_main, args=(tp, free_port(), vocab, str(tmp_path)), nprocs=tp, join=True)
    g = torch.Generator().manual_seed(0)
    table, hidden = torch.randn(vocab, H, generator=g), torch.randn(3, H, generator=g)
    ids = torch.tensor([vocab - 1, 0, vocab // 2, vocab - 1])
    ranks = [load_file(tmp_path / f"rank{r}.safetensors") for r in range(tp)]
    for got in ranks:  # a row plus zeros is exactly the row
        assert torch.equal(got["rows"], table[ids])
    whole = ParallelLMHead(vocab, H, SINGLE)
    whole.weight_loader(whole.weight, table)
    assert ranks[0]["logits"].dtype == torch.float32
    torch.testing.assert_close(ranks[0]["logits"], whole(hidden), rtol=1e-6, atol=1e-6)
    assert ranks[0]["empty"].shape == (0, vocab)
