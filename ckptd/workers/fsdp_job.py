"""A real FSDP2 training job on Ray actors (CPU, gloo): the demo's trainer, the tests' and P8's.

N actors form a ``gloo`` process group; the driver asks rank 0's actor for a free port on
127.0.0.1 and hands it to every rank. Each rank builds the same tiny Llama (HF config built in
code, so nothing is downloaded), shards it with ``fully_shard`` and trains it with AdamW and a
warm-up schedule on a synthetic token dataset.

Data position: the dataset's order in every epoch is a seeded permutation, and a step takes
the next ``global_batch`` samples of it, split evenly over the ranks. A checkpoint records the
samples consumed by all ranks, so a run resumed on another world size (one that divides the
global batch) trains on exactly the samples the old one would have; only which rank sees which
sample changes, and the loss (a mean over the global batch) equals the old run's up to the order
of the floating-point reduction.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray
import ray.util.scheduling_strategies
import torch

import ckptd
from ckptd.workers.dtensor import sharded_state
from ckptd.workers.training_state import capture_training_state, save_training_state

MODEL_DIR = "model"
VOCAB, SEQ, SAMPLES = 96, 16, 96


def tiny_llama_config(**overrides: Any):
    """A Llama of about 40k parameters: two layers, grouped-query attention, untied head."""
    from transformers import LlamaConfig

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              tie_word_embeddings=False)
    kw.update(overrides)
    return LlamaConfig(**kw)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def dataset(seed: int = 1234) -> torch.Tensor:
    """SAMPLES sequences of SEQ tokens: each continues a per-sample arithmetic progression, so
    there is something to learn."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (SAMPLES, 1), generator=g)
    stride = torch.randint(1, 7, (SAMPLES, 1), generator=g)
    return (start + stride * torch.arange(SEQ)) % VOCAB


def global_batch_indices(consumed: int, global_batch: int, seed: int) -> torch.Tensor:
    """The dataset indices of the global batch that starts at sample ``consumed``."""
    epoch, pos = divmod(consumed, SAMPLES)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    return order[pos:pos + global_batch]


@dataclass
class SaveTiming:
    blocked_s: float  # the training thread, inside save calls (staging, eager or fenced wait)
    step: int


class FSDPTrainer:
    """One rank (a Ray actor body: ``ray.remote(num_cpus=0)(FSDPTrainer)``)."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.rank = self.world_size = None
        self.coord: ckptd.CheckpointCoordinator | None = None
        self._background_group = None

    def port(self) -> int:
        return free_port()

    def node_address(self) -> tuple[str, int]:
        """This node's IP and a free port on it: the process group's rendezvous when the ranks
        run on several nodes (127.0.0.1 reaches only this one)."""
        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def node(self) -> str:
        """The node this rank runs on, in words: node id and IP."""
        return f"node {ray.get_runtime_context().get_node_id()[:12]} ({ray.util.get_node_ip_address()})"

    def setup(self, rank: int, world_size: int, port: int, *, run: str | None = None, seed: int = 0,
              global_batch: int = 12, lr: float = 3e-3, warmup: int = 4, config: dict | None = None,
              replicas: int = 1, master_addr: str = "127.0.0.1") -> None:
        """Join the process group and build the sharded model, optimizer and schedule.

        ``replicas > 1`` shards over a 2-D mesh (HSDP): ``replicas`` copies, each sharded over
        ``world_size // replicas`` ranks. ``master_addr:port`` is rank 0's rendezvous address.
        """
        from torch.distributed.fsdp import fully_shard
        from transformers import LlamaForCausalLM

        if global_batch % world_size or SAMPLES % global_batch:
            raise ValueError(f"global_batch {global_batch} must divide evenly over {world_size} ranks and "
                             f"into the {SAMPLES} samples of an epoch")
        self.teardown()
        torch.distributed.init_process_group("gloo", init_method=f"tcp://{master_addr}:{port}", rank=rank,
                                             world_size=world_size, timeout=timedelta(seconds=120))
        self.rank, self.world_size, self.seed, self.global_batch = rank, world_size, seed, global_batch
        torch.manual_seed(seed)  # the same initial weights on every rank
        self.config = tiny_llama_config(**(config or {}))
        self.model = LlamaForCausalLM(self.config)
        mesh = None
        if replicas > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard"))
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup))
        self.data = dataset()
        self.step, self.consumed = 0, 0
        self.coord = ckptd.CheckpointCoordinator(ckptd.get_monitor(run), worker_id=f"rank{rank}") if run else None
        self.timings: list[SaveTiming] = []
        self._background_group = None

    def teardown(self) -> None:
        if self.coord is not None:
            try:
                self.coord.close()
            finally:
                self.coord = None
        self._background_group = None
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    # -- training -----------------------------------------------------------------------------

    def _local_batch(self) -> torch.Tensor:
        idx = global_batch_indices(self.consumed, self.global_batch, self.seed)
        per = self.global_batch // self.world_size
        return self.data[idx[self.rank * per:(self.rank + 1) * per]]

    def train(self, steps: int, save_every: int = 0, fenced: bool = False) -> list[float]:
        """Train ``steps`` steps; the mean loss over the global batch of each.

        With ``save_every``, every such step saves the sharded state (model and optimizer) and
        the training state as two units of a full checkpoint; with ``fenced``, staging overlaps
        the next forward and backward and waits before the optimizer step.
        """
        losses = []
        for _ in range(steps):
            batch = self._local_batch()
            loss = self.model(input_ids=batch, labels=batch).loss
            loss.backward()
            if self.coord is not None and fenced:
                t0 = time.perf_counter()
                self.coord.before_update()
                self._blocked(time.perf_counter() - t0)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
            self.step += 1
            self.consumed += self.global_batch
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            losses.append(float(mean) / self.world_size)
            if save_every and self.step % save_every == 0:
                self.save(fenced=fenced)
        return losses

    def _blocked(self, seconds: float) -> None:
        if self.timings and self.timings[-1].step == self.step:
            self.timings[-1].blocked_s += seconds
        else:
            self.timings.append(SaveTiming(seconds, self.step))

    # -- checkpoints --------------------------------------------------------------------------

    def save(self, fenced: bool = False) -> None:
        """Save this rank's part of step ``self.step``: two units (sharded state, training state)."""
        t0 = time.perf_counter()
        step, out = self.step, self.coord.step_dir(self.step)
        state = sharded_state(self.model, self.optimizer, rank=self.rank, world_size=self.world_size)
        state.save(self.coord, "shards", step, f"{out}/{MODEL_DIR}", fenced=fenced)
        last = self.consumed - self.global_batch  # where the last trained batch started
        training = capture_training_state(
            epoch=last // SAMPLES, step=step, step_in_epoch=(last % SAMPLES) // self.global_batch + 1,
            steps_per_epoch=SAMPLES // self.global_batch,
            batch_size=self.global_batch // self.world_size, consumed_samples=self.consumed,
            rank=self.rank, world_size=self.world_size, lr_scheduler=self.scheduler)
        self.coord.save_async("train_state", lambda: save_training_state(out, training), step)
        self._blocked(time.perf_counter() - t0)

    def save_with_dcp(self, background: bool = False) -> None:
        """Save the model of step ``self.step`` with ``dcp.save`` through :class:`CkptdStorageWriter`:
        on the training thread (``save_sync``), or staged and planned on the save thread over a
        second gloo group, as ``dcp.async_save`` would."""
        from ckptd.workers.dcp import CkptdStorageWriter

        t0 = time.perf_counter()
        step = self.step
        writer = CkptdStorageWriter(f"{self.coord.step_dir(step)}/{MODEL_DIR}")
        if background:
            if self._background_group is None:
                self._background_group = torch.distributed.new_group(backend="gloo")
            group = self._background_group
            self.coord.save_state_async("dcp", self.model.state_dict(), step,
                                        lambda staged: writer.save(staged, process_group=group))
        else:
            self.coord.save_sync(lambda: writer.save(self.model.state_dict()), step)
        self._blocked(time.perf_counter() - t0)

    def load_with_dcp(self, path: str) -> None:
        """Load the model with plain ``dcp.load`` and DCP's own ``HuggingFaceStorageReader``."""
        import torch.distributed.checkpoint as dcp

        state = self.model.state_dict()
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(path))
        self.model.load_state_dict(state)

    def save_weights(self) -> None:
        """Publish this rank's block of the weights of step ``self.step`` (a state-dict save)."""
        t0 = time.perf_counter()
        step, out = self.step, self.coord.step_dir(self.step)
        state = sharded_state(self.model, rank=self.rank, world_size=self.world_size)
        state.save(self.coord, "weights", step, f"{out}/{MODEL_DIR}", is_state_dict=True)
        self._blocked(time.perf_counter() - t0)

    def register(self, units_per_rank: int = 2, state_dict: bool = False) -> int:
        """Rank 0 registers the current step's units of every rank (one call for the whole job):
        a full checkpoint (:meth:`save`: 2 units per rank) or a state dict (:meth:`save_weights`)."""
        count = units_per_rank * self.world_size
        if state_dict:
            self.coord.register(self.step, is_state_dict=True, state_dict_thread_count=count)
        else:
            self.coord.register(self.step, checkpoint_thread_count=count)
        return self.step

    def blocked_ms(self) -> list[float]:
        """How long each save held up this rank's training thread."""
        return [t.blocked_s * 1000 for t in self.timings]

    def wait_saves(self) -> None:
        self.coord.wait_all()

    def resume(self, root: str, step: int | None = None, weights_only: bool = False) -> dict:
        """Load the newest (or ``step``'s) checkpoint into this rank's model, optimizer, schedule
        (with ``weights_only``, the model alone)."""
        more = {} if weights_only else {"optimizer": self.optimizer, "lr_scheduler": self.scheduler}
        state = ckptd.resume(root, model=self.model, rank=self.rank, world_size=self.world_size, step=step,
                             model_dir=MODEL_DIR, **more)
        if state is None:
            return {}
        self.step, self.consumed = state.step, state.consumed_samples
        return {"step": state.step, "consumed": state.consumed_samples, "epoch": state.epoch}

    # -- inspection (collectives: call on every rank) -----------------------------------------

    def full_state(self) -> dict[str, torch.Tensor]:
        """The model's full tensors and the optimizer's full moments (all-gathered)."""
        out = {k: v.full_tensor() for k, v in self.model.state_dict().items()}
        for name, p in self.model.named_parameters():
            for k, v in self.optimizer.state.get(p, {}).items():
                out[f"optim.{name}.{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
        out["lr"] = torch.tensor(self.optimizer.param_groups[0]["lr"])
        return out

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(input_ids=input_ids).logits

    def arm(self, failpoint: str, action: str) -> None:
        from ckptd import failpoints

        failpoints.arm(failpoint, action)

    def pid(self) -> int:
        import os

        return os.getpid()


Trainer = ray.remote(num_cpus=0)(FSDPTrainer)


class FSDPJob:
    """The driver's handle on N :class:`FSDPTrainer` actors forming one process group.

    With ``spread``, new ranks are placed round-robin over the cluster's live nodes, the
    driver's first (rank ``r`` on node ``r % nodes``; Ray's ``SPREAD`` strategy is best effort and
    may put zero-CPU actors together), and rendezvous at rank 0's node IP instead of 127.0.0.1.
    """

    def __init__(self, world_size: int, *, actors: list | None = None, spread: bool = False, **setup: Any) -> None:
        self.actors = list(actors or [])[:world_size]
        nodes = _nodes_driver_first() if spread else []
        for rank in range(len(self.actors), world_size):
            placement = {}
            if nodes:
                placement["scheduling_strategy"] = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    nodes[rank % len(nodes)], soft=False)
            self.actors.append(Trainer.options(**placement).remote())
        self.world_size = world_size
        if spread:
            setup["master_addr"], port = ray.get(self.actors[0].node_address.remote())
        else:
            port = ray.get(self.actors[0].port.remote())
        ray.get([a.setup.remote(r, world_size, port, **setup) for r, a in enumerate(self.actors)])

    def call(self, method: str, *args: Any, **kwargs: Any) -> list:
        """Call ``method`` on every rank at once (collectives need all of them); the results by rank."""
        return ray.get([getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def teardown(self) -> None:
        """Leave the process group on every rank still alive."""
        for ref in [a.teardown.remote() for a in self.actors]:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                pass  # a rank that died: nothing to leave


def _nodes_driver_first() -> list[str]:
    """The ids of the cluster's live nodes: the caller's node, then the others by id."""
    here = ray.get_runtime_context().get_node_id()
    others = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)
    return [here, *others]
