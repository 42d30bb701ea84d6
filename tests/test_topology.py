"""The topology object: the Trainer calls it unconditionally; a one-process group trains like the default."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_train.data import DataLoader
from mlx_train.distributed.topology import DataParallel, Single, Topology
from mlx_train.errors import ConfigError
from mlx_train.training import DistributedTrainer, Trainer
from mlx_train.training.batches import Batches
from mlx_train.training.state import LoopState


def _data(n=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, 3, n).astype(np.int32)


def _params(trainer):
    return {k: np.array(v) for k, v in tree_flatten(trainer.model.parameters())}


def _trained(**options):
    mx.random.seed(0)
    trainer = Trainer(nn.Linear(4, 3), optim.SGD(0.1), batch_size=8, num_workers=0, **options)
    trainer.train(_data(), epochs=2)
    return trainer


class Recording(Topology):
    """One process, recording the hooks the loop calls."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def prepare(self, model, config):
        self.calls.append("prepare")
        return model

    def shard(self, batches):
        self.calls.append("shard")

    def start_run(self):
        self.calls.append("start_run")
        super().start_run()

    def vote_stop(self, requested):
        self.calls.append("vote_stop")
        return None

    def reduce(self, values):
        self.calls.append("reduce")
        return super().reduce(values)

    def before_report(self, meter):
        self.calls.append("before_report")

    def before_save(self, checkpoints, step, model, optimizer):
        self.calls.append(f"before_save {step}")

    def callbacks(self, config):
        self.calls.append("callbacks")
        return []


def test_the_default_topology_is_single_and_an_explicit_one_trains_the_same():
    default, explicit = _trained(), _trained(topology=Single())
    assert isinstance(default.topology, Single) and default.group is None and default.is_main
    assert all(np.array_equal(a, b) for a, b in zip(_params(default).values(), _params(explicit).values(), strict=True))


def test_a_group_of_one_trains_exactly_like_one_process():
    group = mx.distributed.init()
    assert group.size() == 1
    alone, grouped = _trained(), _trained(topology=DataParallel(group))
    assert grouped.group is group and grouped.topology.batch_ranks == 1
    assert all(np.array_equal(a, b) for a, b in zip(_params(alone).values(), _params(grouped).values(), strict=True))


def test_the_loop_calls_the_topology_it_is_given(tmp_path):
    topology = Recording()
    mx.random.seed(0)
    trainer = Trainer(nn.Linear(4, 3), optim.SGD(0.1), batch_size=8, num_workers=0, topology=topology,
                      report_every="4 steps", checkpoint_every="4 steps")
    trainer.train(_data(), epochs=1, checkpoint_dir=str(tmp_path / "ckpt"))
    calls = topology.calls
    assert calls[0] == "prepare" and calls[1] == "callbacks" and calls[2:4] == ["shard", "shard"]
    assert calls.count("vote_stop") == trainer.step == 8  # after every step
    assert "before_report" in calls and calls.count("reduce") >= 2  # reports sum over ranks through it
    assert [c for c in calls if c.startswith("before_save")] == ["before_save 4", "before_save 8"]


def test_a_topology_can_refuse_a_run_before_it_starts():
    class NoCheckpoints(Topology):
        def check_run(self, model, config, checkpoint_dir, resume):
            if checkpoint_dir:
                raise ConfigError("no checkpoints here")
            return resume

    trainer = Trainer(nn.Linear(4, 3), optim.SGD(0.1), batch_size=8, num_workers=0, topology=NoCheckpoints())
    with pytest.raises(ConfigError, match="no checkpoints here"):
        trainer.train(_data(), epochs=1, checkpoint_dir="anywhere")
    assert trainer.step == 0


def test_distributed_trainer_alone_is_a_trainer_with_a_group_topology():
    trainer = DistributedTrainer(nn.Linear(4, 3), optim.SGD(0.1), strategy="data_parallel", batch_size=8)
    assert isinstance(trainer, Trainer) and isinstance(trainer.topology, DataParallel)
    assert (trainer.world_size, trainer.rank, trainer.strategy, trainer.layout) == (1, 0, "data_parallel", {})


def test_batches_answer_the_same_questions_for_a_loader_and_a_plain_iterable():
    state = LoopState()
    x, y = _data(32)
    loader = DataLoader((x, y), batch_size=8, shuffle=False, num_workers=0)
    batches, plain = Batches(loader), Batches([(x[:8], y[:8])] * 3)
    assert (batches.epoch(state), batches.position, batches.length) == (0, 0, 4)
    assert (plain.epoch(state), plain.position, plain.length) == (state.next_epoch, 0, None)
    assert plain.finished_epoch(0) is None and plain.replay(0) is None
    handed_out = iter(batches)
    for _ in range(4):
        next(handed_out)
    assert batches.position == 4 and batches.finished_epoch(0) is True and loader.epoch == 1
    batches.shard(1, 2)
    assert loader.world_size == 2
    plain.shard(1, 2)  # a plain iterable is the user's to shard: nothing happens
    assert len(list(plain)) == 3
