"""The training worker: a plain class; ``ray.remote`` is applied where it is launched.

Each step the worker trains its share of the global batch with the step's math
(:mod:`dynabatch.actors.step`) and joins the weighted all-reduce of its gradient buffer,
which also carries the step's coverage (:mod:`dynabatch.actors.reducer`); this module adds
the group, the clocks and the error classes around them.

Errors are classified where they happen (the kinds: :class:`SegmentResult`'s ``error_kind``;
out of device memory: docs/spec.md), and the worker leaves the group at once on any, so
peers blocked in the collective fail fast instead of waiting out the timeout.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from dynabatch.actors.accumulate import largest_micro, micro_cap, tighter_cap
from dynabatch.actors.contracts import (
    IsgdPlan,
    SegmentPlan,
    SegmentResult,
    StepPlan,
    StepTelemetry,
    encode_counts,
    plan_key,
)
from dynabatch.actors.device_data import WorkerData, data_budget, model_bytes
from dynabatch.actors.emulation import ComputeClock, node_slowdown, slowdown_at
from dynabatch.actors.errors import first_line, is_out_of_memory, is_user_error
from dynabatch.actors.group import ProcessGroup, Rendezvous, gpu_key
from dynabatch.actors.optim import build_optimizer
from dynabatch.actors.output import own_actor_id
from dynabatch.actors.precision import SpeedOptions, channels_last_applies
from dynabatch.actors.reducer import GradientReducer
from dynabatch.actors.spec import JobSpec
from dynabatch.actors.step import (
    ExtraPassFailed,
    PhaseLog,
    StepMath,
    cover,
    held,
    mean_loss,
    share_sqnorm,
)
from torch.utils._pytree import tree_map


class _StepFailed(Exception):
    def __init__(self, kind: str, err: BaseException, compute_s: float,
                 oom_batch: int | None = None):
        super().__init__(first_line(err, limit=500))
        self.kind = kind
        self.compute_s = compute_s
        self.oom_batch = oom_batch


def cuda_index(gpu_ids: list[str | int], visible: str | None) -> int:
    """The torch index (``cuda:<i>``) of the GPU Ray gave this worker: the position of its
    GPU id (``ray.get_gpu_ids()``) among ``CUDA_VISIBLE_DEVICES``, which Ray sets per actor
    to exactly its GPUs (so usually 0); where that is unset every GPU is visible and the id
    is the index. No GPU id (outside Ray): the first visible GPU."""
    if not gpu_ids:
        return 0
    mine = str(gpu_ids[0])
    if visible is None or not visible.strip():
        return int(mine)
    listed = [v.strip() for v in visible.split(",")]
    if mine not in listed:
        raise RuntimeError(f"Ray gave this worker GPU {mine}, which CUDA_VISIBLE_DEVICES "
                           f"({visible}) does not list")
    return listed.index(mine)


def pick_device(spec: JobSpec, gpus: float, gpu_ids: list[str | int] | None = None
                ) -> torch.device:
    """The worker's device: the GPU Ray gave it (``gpu_ids``, see :func:`cuda_index`) when
    it was placed with one (``gpus`` > 0)."""
    if spec.device == "cpu" or (spec.device == "auto" and gpus <= 0):
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", cuda_index(gpu_ids or [],
                                               os.environ.get("CUDA_VISIBLE_DEVICES")))
    if spec.device == "cuda" or gpus > 0:
        raise RuntimeError("a GPU was requested but no GPU is visible to the worker")
    return torch.device("cpu")


def speed_options(spec: JobSpec, input_shape: tuple[int, ...]) -> SpeedOptions:
    """The spec's ``channels_last`` and ``compile`` for samples of ``input_shape``;
    channels_last is dropped, with a warning, where batches are not 4-D images."""
    channels_last = spec.channels_last
    if channels_last and not channels_last_applies(input_shape):
        warnings.warn(f"channels_last is ignored: the samples' shape {tuple(input_shape)} is "
                      "not an image's (C, H, W), so batches are not 4-D", UserWarning,
                      stacklevel=2)
        channels_last = False
    c = spec.compile
    if c is None:
        return SpeedOptions(channels_last)
    return SpeedOptions(channels_last, c.mode, c.dynamic, c.backend)


def compute_clock(spec: JobSpec, device: torch.device) -> ComputeClock:
    """The worker's compute clock: emulating when the spec sets an emulation, on the CPU by
    the thread's CPU time, on a GPU by the wall clock after a device synchronisation (a
    GPU's work is not the thread's time)."""
    sync = ((lambda: torch.cuda.synchronize(device))
            if spec.emulated and device.type == "cuda" else None)
    return ComputeClock(spec.emulated, sync)


def to_cpu(obj: Any) -> Any:
    """A copy of a (nested) state dict with every tensor on the CPU: checkpoints and the
    coordinator must not need a GPU to hold a GPU worker's state."""
    return tree_map(lambda t: t.detach().cpu().clone() if isinstance(t, torch.Tensor) else t,
                    obj)


class Worker:
    """One training worker. ``worker_id`` None builds a *spare*: the process, the imports,
    the data, the model and its warm-up are paid now, on an idle node, and :meth:`adopt`
    later gives it the identity of the worker that starts there (a scale-up or a
    replacement), so that worker trains a fraction of a second after it is wanted."""

    _gather: Any = None  # the data's gatherer, set with the first epoch's order

    def __init__(
        self,
        worker_id: str | None,
        ordinal: int,
        spec: JobSpec,
        x_train: np.ndarray,
        y_train: np.ndarray,
        input_shape: tuple[int, ...],
        num_classes: int,
        gpus: float = 0.0,
    ):
        from dynabatch.actors.workloads.models import build_model
        from dynabatch.actors.workloads.objective import objective_for

        self.worker_id = worker_id or "spare"
        self.ordinal = ordinal
        self.spec = spec
        self._gpu_ids: list[str | int] = []
        if gpus > 0:  # the GPUs Ray gave it; none outside Ray (tests, bench/gpu_check.py)
            import ray

            self._gpu_ids = list(ray.get_gpu_ids()) if ray.is_initialized() else []
        self.device = pick_device(spec, gpus, self._gpu_ids)
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, int(spec.worker_cpus)))
        else:  # kernels and allocations that name no index go to this worker's GPU too
            torch.cuda.set_device(self.device)
        # In-memory arrays (zero-copy views, in host memory until the model is built: see
        # _place_data), or a source read by position (``x_train`` a DataRef, ``y_train``
        # None): only the samples this worker trains are read, ahead of time.
        self.data = WorkerData(x_train, y_train, spec, self.device)
        # The job's per-sample loss and metrics (actors/workloads/objective.py).
        self.objective = objective_for(spec, self.data.targets)
        free_before = (torch.cuda.mem_get_info(self.device)[0]
                       if self.device.type == "cuda" else 0)
        torch.manual_seed(spec.seed)
        self.model = build_model(spec.model, input_shape, num_classes).to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.math = StepMath(self.model, self.objective, self.params, spec.precision,
                             speed_options(spec, input_shape), spec.optimizer.clip_grad_norm)
        self.optimizer = build_optimizer(spec, self.params)
        self.group = ProcessGroup(spec.collective_timeout_s, spec.join_timeout)
        self.reducer = GradientReducer(self.params, self.device, spec.global_batch,
                                       spec.allreduce,
                                       spec.bucket_kb * 1024 if spec.bucket_kb else None)
        self.micro_cap = micro_cap(spec.micro_batch, ordinal) if worker_id else None
        # The cap this segment's shares are computed under: the spec's, tightened by the
        # memory cap the driver learned for this node and device (SegmentPlan.micro_cap).
        self._cap = self.micro_cap
        self._late_failure: _StepFailed | None = None  # after a step that was applied
        # The last plan update applied: (epoch, its step plans by step).
        self._update: tuple[int, dict[int, StepPlan]] | None = None
        # Emulated slowdowns apply on either device (actors/emulation.py).
        self._clock = compute_clock(spec, self.device)
        # The node's own emulated slowness (actors/emulation.py), only for an emulated job:
        # a real run is never slowed by the node's environment.
        self._node_factor = node_slowdown() if spec.emulated else 1.0
        act_per_sample = self._warm_up()
        self._place_data(free_before, act_per_sample)

    def _warm_up(self) -> float:
        """One throw-away forward/backward, so one-off costs (lazy init, allocator growth)
        are paid before the first timed step; a newcomer would otherwise look slow.
        Returns the device bytes it took per sample at its peak (activations; 0 on the
        CPU), which sizes what the data may take of the device."""
        n = min(len(self.data), 8)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        batch = self.data.warm(n) if n else None
        if batch is not None:
            self.math.share(held(*batch), 0, n, n)
        self.reducer.zero_()
        if not (cuda and batch is not None):
            return 0.0
        return max(0, torch.cuda.max_memory_allocated(self.device) - base) / n

    def _place_data(self, free_before: int, act_per_sample: float) -> None:
        """The in-memory training set goes on the device if it fits in what the model, its
        optimizer state and the activations of the largest micro-batch this worker may
        compute leave of the device memory that was free before the model
        (:func:`~dynabatch.actors.device_data.data_budget`); else it is staged per
        micro-batch from host memory."""
        budget = None
        if self.device.type == "cuda":
            micro = self._cap or self.spec.max_batch or self.spec.global_batch
            budget = data_budget(free_before, model_bytes(self.params, self.optimizer),
                                 act_per_sample, micro)
        self.data.place(budget)

    # --- membership -------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        import ray

        node = ray.get_runtime_context().get_node_id()
        # "gpu": the physical GPU, so the driver can tell members that share one (gloo).
        return {"worker": self.worker_id, "node": node, "device": str(self.device),
                "gpu": gpu_key(node, self._gpu_ids) if self.device.type == "cuda" else None}

    # This actor's Ray id: the job reads its stdout and stderr by it (actors/output.py).
    actor_id = staticmethod(own_actor_id)

    def adopt(self, worker_id: str, ordinal: int, reservation: Any = None) -> dict[str, Any]:
        """A spare becomes worker ``worker_id``: only what depends on the identity is set
        (emulation and the micro-batch cap follow the ordinal). ``reservation`` is there
        for its dependency only: the driver passes its reservation of the worker's
        resources, so this runs once they are held."""
        self.worker_id = worker_id
        self.ordinal = ordinal
        self.micro_cap = self._cap = micro_cap(self.spec.micro_batch, ordinal)
        return self.info()

    def open_store(self, generation: int, world_size: int, backend: str = "gloo") -> Rendezvous:
        return self.group.open_store(generation, world_size, backend)

    def join(self, rv: Rendezvous, rank: int, src_rank: int = 0) -> float:
        """Join generation ``rv`` and take the model and optimizer state from ``src_rank``."""
        t0 = time.perf_counter()
        self._update = None  # updates are per generation (its store)
        # NCCL's communicator is created here, on this worker's GPU, within the start-up
        # timeout, not lazily in the state broadcast below.
        self.group.join(rv, rank, self.device)
        # The group's collective plan, the same in every member (actors/reducer.py).
        self.reducer.use_group(rv.backend)
        self._broadcast_state(src_rank)
        return time.perf_counter() - t0

    def leave(self) -> None:
        self.group.leave()

    def _broadcast_state(self, src: int) -> None:
        # As objects: a newcomer's optimizer state is empty (created lazily), and members
        # may be on different devices; everything travels on the CPU.
        box: list[Any] = [self.state() if dist.get_rank() == src else None]
        device = self.device if self.group.backend == "nccl" else None
        dist.broadcast_object_list(box, src=src, device=device)
        if dist.get_rank() != src:
            self.load_state(box[0])

    # --- training ---------------------------------------------------------------------
    def run_segment(self, plan: SegmentPlan) -> SegmentResult:
        if not self.group.active:
            # It left after a failed step: a plan sent ahead cannot run without a group.
            return SegmentResult(worker=self.worker_id, steps=[], error="not in a group",
                                 error_kind="peer", failed_compute_s=0.0)
        # The gatherer holds this epoch's order (computed and placed once an epoch); the
        # segment's shares are read ahead (dynabatch.actors.device_data).
        self._gather = self.data.for_epoch(plan.seed, plan.epoch, plan.dataset_size,
                                           self.spec.dataset.shuffle)
        self.data.plan(plan.steps, plan.dataset_size)
        self._cap = tighter_cap(self.micro_cap, plan.micro_cap)
        steps: list[StepTelemetry] = []
        isgd = plan.isgd  # ISGD's chart, kept up to date with every step's global loss
        for sp in plan.steps:
            try:
                if plan.updates:
                    sp = self._plan_update(plan.epoch, sp)
                steps.append(self._step(plan.epoch, sp, isgd))
                if isgd is not None:
                    isgd = isgd.after(steps[-1].isgd_loss)
                if self._late_failure is not None:
                    err, self._late_failure = self._late_failure, None
                    raise err
            except _StepFailed as err:
                # Leave at once so peers blocked in the collective fail fast.
                self.group.leave()
                if err.kind == "oom":
                    self._free_cache(err)
                return SegmentResult(worker=self.worker_id, steps=steps, error=str(err),
                                     error_kind=err.kind, failed_compute_s=err.compute_s,
                                     oom_batch=err.oom_batch)
        return SegmentResult(worker=self.worker_id, steps=steps)

    def _plan_update(self, epoch: int, sp: StepPlan) -> StepPlan:
        """This step's plan after the driver's updates. Before starting the step the worker
        claims its key in the group's store: a plan update posted there first applies from
        this step on every worker; otherwise the key is sealed and a later post refused
        (dynabatch.scheduler.core.sync.update). No store, no step: it fails as a peer error."""
        import pickle

        try:
            got = self.group.claim(plan_key(epoch, sp.step))
        except Exception as err:
            raise _StepFailed("peer", err, 0.0) from err
        if got is not None:
            mine = pickle.loads(got).get(self.worker_id, ())
            self._update = (epoch, {u.step: u for u in mine})
        if self._update is not None and self._update[0] == epoch:
            return self._update[1].get(sp.step, sp)
        return sp

    def _step(self, epoch: int, sp: StepPlan, isgd: IsgdPlan | None = None) -> StepTelemetry:
        factor = slowdown_at(self.spec.emulation, self.ordinal, epoch, sp.step) * self._node_factor
        t_step = time.perf_counter()
        clock = self._clock
        clock.start()
        r = self.reducer
        # Emulated slowness is applied before each bucket leaves (actors/emulation.py), so
        # the all-reduce sees a slowed worker as it would see a slow one.
        r.begin(sp.size, norms=sp.noise,
                pace=(lambda: clock.pace(factor)) if clock.emulated else None)
        log = PhaseLog(r.marks.mark, lambda: clock.slept)
        try:
            cover(r.cov, sp)
            # The last micro-batch's backward arms the reducer: buckets go out as they
            # complete, behind the rest of backward.
            share = self.math.share(self._gather.gather, sp.own_start,
                                    sp.own_start + sp.own_size, sp.size, self._cap,
                                    arm=r.arm, log=log, loss_slot=r.loss_slot)
        except Exception as err:
            if is_out_of_memory(err):
                # Not this worker's bug: its micro-batch is too large for its device. The
                # driver halves its memory cap and retries the step (scheduler/core/failures.py).
                raise _StepFailed("oom", err, clock.finish(1.0),
                                  largest_micro(sp.own_size, self._cap)) from err
            # An error in the job's data, model or configuration fails it at once.
            kind = "user" if is_user_error(err) else "compute"
            raise _StepFailed(kind, err, clock.finish(1.0)) from err
        compute = clock.finish(factor)  # sleeps what is left of an emulated slowdown
        # The time the step blocked for its samples (0 when read-ahead hid it) is compute:
        # a worker whose loader cannot keep up gets the share its loader feeds.
        data_wait, loader_rate = self.data.take_stats()
        if clock.cpu_time:  # thread CPU time does not count a wait
            compute += data_wait
        compute_end = r.marks.mark()
        t1 = time.perf_counter()
        try:
            # On a GPU the step's one synchronisation; loss and norms come home with it.
            red = r.finish(compute_end, share.loss)
            coverage = encode_counts(np.rint(red.coverage).astype(np.int64))
            # ISGD: every worker judges and charts the same all-reduced loss of the global
            # batch, before any update; it rode in the gradient's all-reduce (loss slot).
            psi = mean_loss(red.global_loss_sum, sp.size) if isgd is not None else None
        except Exception as err:
            raise _StepFailed("peer", err, compute) from err
        t2 = time.perf_counter()
        wait = t2 - t1
        if red.compute_s is not None:  # device-timed (GPU)
            compute, wait = red.compute_s, red.wait_s
        # Host floats, or CUDA events after the synchronisation; read before ISGD's passes
        # begin steps of their own.
        gather_s, forward_s, backward_s = log.breakdown(r.marks.seconds)
        local_sq = global_sq = None
        if sp.noise:  # goodput: |g_i|² of the mean over the share, from (b_i/B)·g_i; |G|²
            # (fp16: both were measured on the loss-scaled gradient)
            s2 = self.math.scaler.scale ** 2 if self.math.scaler is not None else 1.0
            global_sq = red.global_sq / s2 if red.global_sq is not None else None
            local_sq = share_sqnorm(red.local_sq / s2 if red.local_sq is not None else None,
                                    sp.size, sp.own_size)
        rule = isgd.rule() if isgd is not None else None
        try:
            # Under-trained: conservative iterations first, each followed by a pass; the
            # ordinary step then uses the last pass's gradient (dynabatch.actors.optim).
            up = self.math.update(self.optimizer, sp.lr, rule, psi,
                                  lambda: self._isgd_pass(sp))
        except ExtraPassFailed as err:
            # The step's samples are trained (its collective completed): report it with the
            # updates applied, then stop the segment. Replicas left apart are made equal
            # again by the regroup's state broadcast.
            up = err.update
            self._late_failure = _StepFailed("peer", err.__cause__ or err, compute)
        except Exception as err:
            raise _StepFailed("compute", err, compute) from err
        t3 = time.perf_counter()
        return StepTelemetry(
            worker=self.worker_id, epoch=epoch, step=sp.step, batch=sp.own_size,
            samples=sp.own_size, compute_s=compute, wait_s=wait, loss_sum=red.loss_sum,
            slowdown=factor, start=sp.own_start, step_start=sp.start, step_size=sp.size,
            coverage=coverage, gather_s=gather_s, forward_s=forward_s, backward_s=backward_s,
            optimizer_s=t3 - t2 - up.extra_s, overlap_s=red.hidden_s, step_s=t3 - t_step,
            micro_batches=share.micro_batches, micro_cap=self._cap,
            flagged=up.flagged, extra_iters=up.extra_iters, isgd_loss=psi,
            overflow=up.overflow,
            local_sqnorm=local_sq, global_sqnorm=global_sq,
            data_wait_s=data_wait, loader_rate=loader_rate,
        )

    def _free_cache(self, failed: _StepFailed) -> None:
        """After an out-of-memory: let go of the failed pass (its traceback's frames hold
        the activations) and give the allocator's cached blocks back, so the retry starts
        from what the model and optimizer hold."""
        failed.__cause__ = failed.__context__ = None
        failed.__traceback__ = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _isgd_pass(self, sp: StepPlan) -> float:
        """The pass of one ISGD extra iteration: this worker's share again at the current
        weights, all-reduced (its coverage slots stay zero: it trains no new sample).
        Returns the global mean loss."""
        r = self.reducer
        r.begin(sp.size)
        share = self.math.share(self._gather.gather, sp.own_start, sp.own_start + sp.own_size,
                                sp.size, self._cap, arm=r.arm, loss_slot=r.loss_slot)
        red = r.finish(loss=share.loss)
        return mean_loss(red.global_loss_sum, sp.size)

    # --- evaluation and state ---------------------------------------------------------
    _eval_cap: int | None = None  # the evaluation batch an out-of-memory left

    def evaluate_shard(self, x_test: np.ndarray, y_test: np.ndarray, lo: int, hi: int,
                       batch: int = 1024) -> dict[str, Any]:
        """This worker's shard ``[lo, hi)`` of the held-out set: ``{"sums": {"n", "loss",
        <metric>: Σ}, "seconds": wall time}`` (:meth:`Objective.eval_sums`). Sent between
        segments, it scores the weights the segment before left (an actor runs its calls
        in order); the coordinator adds the shards up and finishes them. Its batch is
        ``batch``, at most the shard, tightened by the worker's memory cap and by what an
        earlier evaluation learned: an out-of-memory halves it (kept for later evaluations)
        and scores the shard again; only one sample not fitting raises."""
        t0 = time.perf_counter()
        b = max(1, min(batch, hi - lo))
        for cap in (self._cap, self._eval_cap):
            b = min(b, cap) if cap is not None else b
        while True:
            try:
                sums = self.data.eval_sums(self.objective, self.model, x_test, y_test, lo, hi, b)
                return {"sums": sums, "seconds": time.perf_counter() - t0}
            except Exception as err:
                if not is_out_of_memory(err) or b <= 1:
                    raise
                err.__traceback__ = None  # its frames hold the failed batch's tensors
            b = self._eval_cap = b // 2
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def state(self) -> dict[str, Any]:
        """Model and optimizer state, every tensor on the CPU (checkpoints, broadcasts,
        equivalence tests)."""
        state = {"model": to_cpu(self.model.state_dict()),
                 "optimizer": to_cpu(self.optimizer.state_dict())}
        if self.math.scaler is not None:  # fp16: the group's loss scale travels with it
            state["loss_scale"] = self.math.scaler.state_dict()
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        # None when the state came from a job with another optimizer (checkpoint.from):
        # this one starts fresh. Optimizer.load_state_dict casts state to the parameters'
        # device.
        if state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.math.scaler is not None and state.get("loss_scale") is not None:
            self.math.scaler.load_state_dict(state["loss_scale"])
