"""An epoch's batches at any number of workers: every rank reads the whole (materialized) train split
in one order and takes its share, so an epoch interrupted at a batch resumes there on another number
of workers and no row is used twice. Real Ray Data, each rank in its own Ray task (its own process)."""

from __future__ import annotations

import pytest
import ray

from flotilla.spec import TrainSpec
from flotilla.train._deepspeed_config import rank_share
from flotilla.train._loop import _epoch_batches

pytestmark = pytest.mark.integration

ROWS, BATCH = 1000, 32  # 32 batches, the last one of 8 rows


@ray.remote(num_cpus=0)
def _rows_of(ds, epoch: int, place: tuple[int, int], skip: int, steps: int | None = None) -> list[int]:
    shard = ds.iterator()  # (what Ray Train hands a rank for a dataset it does not split)
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    t = TrainSpec(batch_size=BATCH, seed=3)
    got = []
    for i, batch in enumerate(_epoch_batches(shard, t, ROWS, True, epoch, place, skip, {"id": None}, "cpu")):
        if steps is not None and i == steps:
            break
        got += batch["id"].tolist()
    return got


def test_an_epoch_resumed_at_another_size_continues_at_its_batch_and_uses_no_row_twice(ray_cluster):
    ds = ray.data.range(ROWS, override_num_blocks=6).materialize()
    t = TrainSpec(batch_size=BATCH)
    # Two ranks do 10 steps each (20 batches), then the epoch goes on with 3 ranks from batch 20.
    before = ray.get([_rows_of.remote(ds, 1, (r, 2), 0, 10) for r in range(2)])
    after = ray.get([_rows_of.remote(ds, 1, (r, 3), 20) for r in range(3)])
    used = [row for rows in before + after for row in rows]
    assert len(used) == len(set(used)), "a row was used twice within the epoch"
    assert rank_share(ROWS, 3, t, 20) == 4 and len(used) == ROWS  # 20 + 3 x 4 batches: all 32
    # The same order on one worker: its first 20 batches are the two ranks' 20, the rest are the three's.
    alone = ray.get(_rows_of.remote(ds, 1, (0, 1), 0))
    assert set(alone[: 20 * BATCH]) == {row for rows in before for row in rows}
    assert set(alone[20 * BATCH:]) == {row for rows in after for row in rows}
    # Another epoch, another order.
    assert ray.get(_rows_of.remote(ds, 2, (0, 1), 0)) != alone
