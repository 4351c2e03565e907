"""The training worker: a plain class; ``ray.remote`` is applied where it is launched.

Each step a worker trains its share of the global batch and joins a weighted all-reduce.
It scales its summed loss by 1/B (B the step's global batch), so its gradient is
``(b_i / B) · g_i`` with g_i the mean gradient over its b_i samples, and the SUM
all-reduce yields ``Σ_i (b_i / B) · g_i``: exactly the mean gradient of the global batch,
whatever the split. Compute (gather + forward + backward, plus any emulated slowdown) is
timed apart from the all-reduce, which includes waiting for slower peers.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from actors.emulation import ComputeClock, slowdown_at
from actors.group import ProcessGroup, Rendezvous
from scheduler.telemetry import SegmentResult, StepTelemetry
from service.spec import JobSpec


@dataclass(frozen=True)
class SegmentPlan:
    """Consecutive steps of one epoch for one worker: its sample indices per step."""

    epoch: int
    first_step: int
    step_batches: tuple[int, ...]  # global batch of each step
    indices: tuple[np.ndarray, ...]  # this worker's sample indices for each step


def build_optimizer(spec: JobSpec, params) -> torch.optim.Optimizer:
    o = spec.optimizer
    if o.name == "adam":
        return torch.optim.Adam(params, lr=o.lr, weight_decay=o.weight_decay)
    return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)


def pick_device(spec: JobSpec) -> torch.device:
    if spec.device == "cuda" or (spec.device == "auto" and spec.worker_gpus > 0):
        if torch.cuda.is_available():
            return torch.device("cuda", 0)
        if spec.device == "cuda":
            raise RuntimeError("device 'cuda' was requested but no GPU is visible to the worker")
    return torch.device("cpu")


class Worker:
    def __init__(
        self,
        worker_id: str,
        ordinal: int,
        spec: JobSpec,
        x_train: np.ndarray,
        y_train: np.ndarray,
        input_shape: tuple[int, ...],
        num_classes: int,
    ):
        from service.workloads.models import build_model

        self.worker_id = worker_id
        self.ordinal = ordinal
        self.spec = spec
        self.device = pick_device(spec)
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, int(spec.worker_cpus)))
        # Zero-copy views of the object-store arrays; batches are gathered per step.
        self.x = torch.from_numpy(np.asarray(x_train))
        self.y = torch.from_numpy(np.asarray(y_train))
        torch.manual_seed(spec.seed)
        self.model = build_model(spec.model, input_shape, num_classes).to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(spec, self.params)
        self.group = ProcessGroup("nccl" if self.device.type == "cuda" else "gloo",
                                  spec.collective_timeout_s)
        # Gradients live as views of one flat buffer: backward accumulates into it and the
        # all-reduce works on it in place, with no per-step allocation or copy.
        self._flat = torch.zeros(sum(p.numel() for p in self.params), device=self.device)
        off = 0
        for p in self.params:
            p.grad = self._flat[off:off + p.numel()].view_as(p)
            off += p.numel()
        self._stall_s = 0.0
        # CPU-time clock only for emulation on the CPU; a GPU's work is not thread time.
        self._clock = ComputeClock(spec.emulated and self.device.type == "cpu")
        self._warm_up()

    def _warm_up(self) -> None:
        """One throw-away forward/backward, so one-off costs (lazy init, allocator growth)
        are paid before the first timed step; a newcomer would otherwise look slow."""
        n = min(len(self.y), 8)
        if n:
            out = self.model(self.x[:n].to(self.device))
            F.cross_entropy(out, self.y[:n].to(self.device)).backward()
        self._flat.zero_()

    # --- membership -------------------------------------------------------------------
    def info(self) -> dict[str, str]:
        import ray

        return {"worker": self.worker_id, "node": ray.get_runtime_context().get_node_id(),
                "device": str(self.device)}

    def open_store(self, generation: int, world_size: int) -> Rendezvous:
        return self.group.open_store(generation, world_size)

    def join(self, rv: Rendezvous, rank: int, src_rank: int = 0) -> float:
        """Join generation ``rv`` and take the model and optimizer state from ``src_rank``."""
        t0 = time.perf_counter()
        self.group.join(rv, rank)
        self._broadcast_state(src_rank)
        return time.perf_counter() - t0

    def leave(self) -> None:
        self.group.leave()

    def _broadcast_state(self, src: int) -> None:
        with torch.no_grad():
            for t in self.model.state_dict().values():
                dist.broadcast(t, src)
        # The optimizer state may be empty on a newcomer (it is created lazily), so it
        # travels as bytes: size first, then payload.
        is_src = dist.get_rank() == src
        if is_src:
            buf = io.BytesIO()
            torch.save(self.optimizer.state_dict(), buf)
            payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
            payload = payload.to(self.device)
            size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.broadcast(size, src)
        if not is_src:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(payload, src)
        if not is_src:
            raw = io.BytesIO(payload.cpu().numpy().tobytes())
            self.optimizer.load_state_dict(torch.load(raw, weights_only=False))

    # --- training ---------------------------------------------------------------------
    def stall(self, seconds: float) -> None:
        """Test hook: make the next step hang for ``seconds`` (a hung worker)."""
        self._stall_s = seconds

    def run_segment(self, plan: SegmentPlan) -> SegmentResult:
        steps: list[StepTelemetry] = []
        error = None
        for k, (gb, idx) in enumerate(zip(plan.step_batches, plan.indices, strict=True)):
            try:
                steps.append(self._step(plan.epoch, plan.first_step + k, gb, idx))
            except (RuntimeError, dist.DistBackendError) as err:
                # A peer died or hung: report how far this worker got, so the scheduler can
                # retry the step in flight over the survivors.
                error = f"{type(err).__name__}: {err}".splitlines()[0][:500]
                break
        indices = None
        if self.spec.record_indices:
            indices = [int(i) for arr in plan.indices[: len(steps)] for i in arr]
        return SegmentResult(worker=self.worker_id, steps=steps, indices=indices, error=error)

    def _step(self, epoch: int, step: int, global_batch: int, idx: np.ndarray) -> StepTelemetry:
        factor = slowdown_at(self.spec.emulation, self.ordinal, epoch, step)
        self._clock.start()
        self._flat.zero_()
        n = len(idx)
        loss_sum = 0.0
        if n:
            ii = torch.from_numpy(np.asarray(idx, dtype=np.int64))
            xb = self.x.index_select(0, ii).to(self.device, non_blocking=True)
            yb = self.y.index_select(0, ii).to(self.device, non_blocking=True)
            loss = F.cross_entropy(self.model(xb), yb, reduction="sum")
            (loss / global_batch).backward()
            loss_sum = float(loss.detach())
        flat = self._flat
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        compute = self._clock.finish(factor)
        if self._stall_s:
            time.sleep(self._stall_s)
            self._stall_s = 0.0
        t1 = time.perf_counter()
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wait = time.perf_counter() - t1
        self.optimizer.step()
        return StepTelemetry(worker=self.worker_id, epoch=epoch, step=step, batch=n, samples=n,
                             compute_s=compute, wait_s=wait, loss_sum=loss_sum, slowdown=factor)

    # --- measurement (benchmarks) -----------------------------------------------------
    def profile(self, batches: list[int], repeats: int = 5) -> dict[int, float]:
        """Median solo compute seconds of one step at each batch size (emulation applied).
        Gradients are computed and discarded; the model is not updated."""
        out: dict[int, float] = {}
        n = len(self.y)
        rng = np.random.default_rng(self.ordinal)
        for b in batches:
            times = []
            for _ in range(repeats + 1):  # the first run warms caches up
                idx = rng.integers(0, n, size=b)
                self._clock.start()
                self._flat.zero_()
                ii = torch.from_numpy(idx)
                xb = self.x.index_select(0, ii).to(self.device)
                yb = self.y.index_select(0, ii).to(self.device)
                (F.cross_entropy(self.model(xb), yb, reduction="sum") / b).backward()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                factor = slowdown_at(self.spec.emulation, self.ordinal, 0, 0)
                times.append(self._clock.finish(factor))
            self._flat.zero_()
            out[b] = float(np.median(times[1:]))
        return out

    def time_allreduce(self, repeats: int = 10) -> float:
        """Median seconds of the gradient all-reduce when every member is ready."""
        times = []
        buf = torch.zeros_like(self._flat)
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    # --- evaluation and state ---------------------------------------------------------
    def evaluate(self, x_test: np.ndarray, y_test: np.ndarray, batch: int = 1024
                 ) -> tuple[float, float]:
        self.model.eval()
        total_loss, correct = 0.0, 0
        with torch.no_grad():
            for s in range(0, len(y_test), batch):
                xb = torch.from_numpy(np.asarray(x_test[s:s + batch])).to(self.device)
                yb = torch.from_numpy(np.asarray(y_test[s:s + batch])).to(self.device)
                out = self.model(xb)
                total_loss += float(F.cross_entropy(out, yb, reduction="sum"))
                correct += int((out.argmax(1) == yb).sum())
        self.model.train()
        n = max(len(y_test), 1)
        return total_loss / n, correct / n

    def state(self) -> dict[str, object]:
        """Model and optimizer state on the CPU, for checkpoints and equivalence tests."""
        return {
            "model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state(self, state: dict[str, object]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
