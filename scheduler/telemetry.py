"""Typed values that cross process boundaries: what a worker reports and what an epoch was.

The same ``EpochRecord`` feeds the CLI table, the REST history, the Prometheus collector
and the JSON report, so its fields are defined once, here. Pure: no ray, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping

from dynabatch.actors.contracts import _Frozen
from dynabatch.scheduler.core.lifecycle import JobState
from pydantic import Field


def scores_text(scores: Mapping[str, float]) -> str:
    """Held-out metrics as every view shows them, each by its spec name: ``mae 12.3456,
    mse 301.2500`` ("" when there are none)."""
    return ", ".join(f"{k} {v:.4f}" for k, v in scores.items())


def splits_text(validation: Mapping[str, float] | None, test: Mapping[str, float] | None
                ) -> str:
    """Held-out metrics of each split, the split named: ``validation f1 0.8123; test f1
    0.7950`` ("" when there are none)."""
    return "; ".join(f"{name} {text}" for name, scores in (("validation", validation),
                                                           ("test", test))
                     if scores and (text := scores_text(scores)))


class WorkerEpochStats(_Frozen):
    worker: str
    node: str
    batch: int = Field(description="Batch size at the end of the epoch.")
    partition: int = Field(description="Samples this worker trained in the epoch.")
    steps: int
    compute_s: float
    wait_s: float
    throughput: float = Field(description="Samples per compute-second.")
    slowdown: float = 1.0


class StepBreakdown(_Frozen):
    """Where a step's time went, in seconds per step: the mean over the epoch's committed
    steps of the workers' mean phase times, plus the coordinator's share.

    ``gather_s + forward_s + backward_s`` is the workers' compute (``compute_s`` in the
    telemetry, without emulated slowdowns); ``allreduce_wait_s`` is the all-reduce after
    compute, including waiting for slower peers; ``overlap_s`` is the all-reduce hidden
    behind compute (bucketed mode: how long some bucket was in flight before compute
    ended). ``coordinator_s`` is the epoch's wall time that no
    worker step (and no evaluation) covers (dispatch, results, ledger, planning, regroups),
    per step. ``evaluation_s`` is what the epoch's evaluation cost the critical path, per
    step: the slowest holder's shard (the holders score their shards of the held-out set
    side by side, then train on), or the coordinator's wait for it where it had to wait;
    ``evaluation_hidden_s`` is the rest of the evaluation work, which one worker scoring
    the whole set would have added (``dynabatch.scheduler.sync.evaluation``).
    """

    gather_s: float = 0.0
    data_wait_s: float = Field(default=0.0, description="Of gather_s: the time a step "
                               "blocked for its samples (0 when read-ahead hid the reads).")
    loader_rate: float | None = Field(default=None, description="The workers' mean loader "
                                      "speed, samples per second of reading.")
    forward_s: float = 0.0
    backward_s: float = 0.0
    allreduce_wait_s: float = 0.0
    optimizer_s: float = 0.0
    overlap_s: float = 0.0
    coordinator_s: float = 0.0
    evaluation_s: float = 0.0
    evaluation_hidden_s: float = 0.0
    micro_batches: float = Field(default=1.0, description="Mean micro-batches per share.")


class EpochRecord(_Frozen):
    """One epoch of a job, as its coordinator saw it."""

    epoch: int
    wall_s: float
    steps: int
    dataset_size: int
    samples_trained: int = Field(
        description="Samples in the epoch's committed steps, from the workers' reports."
    )
    retried_samples: int = Field(
        default=0,
        description="Samples computed in a step attempt that failed and was retried; not "
        "part of samples_trained.",
    )
    verified: bool = Field(
        default=False,
        description="The ledger rebuilt the epoch from the workers' reports (the all-reduced "
        "coverage of every committed step) and found every sample trained exactly once.",
    )
    train_loss: float
    test_loss: float | None = None
    test_accuracy: float | None = None
    test_metrics: dict[str, float] = Field(
        default_factory=dict,
        description="The job's evaluation metrics on the held-out set (accuracy, perplexity, "
        "mse, f1, auroc, user metrics), by name.",
    )
    test_matrices: dict[str, list[list[float]]] = Field(
        default_factory=dict,
        description="The job's held-out metrics that are tables, by name: a confusion "
        "matrix's rows are the true classes, its columns the predicted ones (counts).",
    )
    validation_loss: float | None = None
    validation_metrics: dict[str, float] = Field(
        default_factory=dict,
        description="With dataset.validation: the job's metrics on the validation split, by "
        "name (early_stopping and keep_best judge on them; test_* then holds the test set's "
        "scores only where it was scored: the final epoch, or every epoch when asked).")
    validation_matrices: dict[str, list[list[float]]] = Field(
        default_factory=dict, description="The validation split's table metrics (a "
        "confusion matrix), as test_matrices.")
    utilization: float = Field(description="sum(compute_i) / (n_workers * wall time).")
    compute_balance: float = Field(description="mean(compute_i) / max(compute_i).")
    rebalances: int = 0
    generation: int = 0
    policy: str
    emulated: bool = False
    workers: list[WorkerEpochStats]
    global_batch: int | None = Field(default=None, description="The epoch's global batch.")
    lr: float | None = Field(default=None, description="Learning rate of the last step.")
    grad_evals: int = Field(
        default=0, description="Per-sample gradients computed (ISGD extra iterations "
        "included).")
    isgd_flagged: int = Field(default=0, description="Batches ISGD flagged under-trained.")
    isgd_extra_iterations: int = Field(default=0, description="ISGD extra iterations.")
    noise_scale: float | None = Field(
        default=None, description="Goodput mode: estimated gradient noise scale tr(Σ)/|∇L|².")
    goodput_batch: int | None = Field(
        default=None, description="Goodput mode: the global batch chosen for the next epoch.")
    elapsed_s: float | None = Field(
        default=None, description="Wall time from the epoch's start to its last step's "
        "results, scheduling included (wall_s counts the training segments only; the "
        "epoch's evaluation runs on the holders right after).")
    evaluation_s: float = Field(
        default=0.0, description="What the epoch's evaluation cost the critical path: the "
        "slowest holder's shard of the held-out set, or the coordinator's wait for it.")
    evaluation_hidden_s: float = Field(
        default=0.0, description="Evaluation work the split across holders kept off the "
        "critical path (the other shards' time).")
    breakdown: StepBreakdown | None = None

    @property
    def scores(self) -> dict[str, float]:
        """The held-out metrics by name; a record that has only ``test_accuracy`` (a
        parameter-server job's, an old report's): that, as ``accuracy``."""
        if self.test_metrics or self.test_accuracy is None:
            return dict(self.test_metrics)
        return {"accuracy": self.test_accuracy}

    def held_out(self, split: str) -> tuple[float | None, dict[str, float]]:
        """The held-out loss and metrics of ``split`` (test, validation)."""
        if split == "validation":
            return self.validation_loss, dict(self.validation_metrics)
        return self.test_loss, self.scores


class WorkerStatus(_Frozen):
    """A worker's latest allocation and telemetry, for the live view."""

    worker: str
    node: str
    rank: int
    batch: int
    partition: int
    throughput: float = 0.0
    compute_s_per_step: float = 0.0
    wait_s_per_step: float = 0.0
    slowdown: float = 1.0
    joined: bool = Field(default=True, description="In the group that trains now; false "
                         "while it is up but joins only at the next step boundary.")


class MembershipEvent(_Frozen):
    """A worker joined, left (drained) or failed."""

    time: float
    kind: str = Field(description="join, leave or failure")
    worker: str
    node: str
    reason: str
    generation: int


class LogLine(_Frozen):
    seq: int
    time: float
    level: str
    message: str


class PSWorkerStatus(_Frozen):
    """One learner of a parameter-server job (protocol ps)."""

    worker: str
    batch: int
    pushes: int
    applied: int
    refused: int
    staleness_mean: float
    staleness_max: int
    staleness_counts: dict[int, int] = Field(
        default_factory=dict, description="Applied gradients by staleness τ.")
    member: bool = True


class PSStatus(_Frozen):
    """The parameter server's state (protocol ps)."""

    mode: str
    version: int = Field(description="Updates applied so far (the server's timestamp).")
    applied: int
    refused: int
    deferred: int = Field(default=0, description="Updates put off by on_stale: wait.")
    pushes: int
    pushes_per_s: float
    workers: list[PSWorkerStatus] = Field(default_factory=list)


class JobSnapshot(_Frozen):
    """The live state of a job, read by the API, the CLI and the metrics collector."""

    @property
    def group_size(self) -> int:
        """The workers that train now: those listed but still joining are not counted (the
        one count the status, the metrics and the cluster scheduler report)."""
        return sum(1 for w in self.workers if w.joined)

    job_id: str
    name: str
    state: JobState
    reason: str | None = None
    epoch: int = 0
    step: int = 0
    steps_per_epoch: int = 0
    epochs: int = 0
    generation: int = 0
    policy: str = ""
    emulated: bool = False
    workers: list[WorkerStatus] = Field(default_factory=list)
    train_loss: float | None = None
    test_accuracy: float | None = None
    test_metrics: dict[str, float] = Field(
        default_factory=dict, description="The last evaluated epoch's held-out metrics, by "
        "the names in the job's spec (accuracy, mae, mse, user metrics).")
    validation_metrics: dict[str, float] = Field(
        default_factory=dict, description="With dataset.validation: the last evaluated "
        "epoch's metrics on the validation split (test_metrics: the test set's, once "
        "scored).")
    utilization: float | None = None
    compute_balance: float | None = None
    rebalances_total: int = 0
    epochs_completed: int = 0
    epoch_durations_s: list[float] = Field(default_factory=list)
    worker_events: dict[str, int] = Field(
        default_factory=dict, description="Counts keyed 'kind:reason', e.g. 'failure:node lost'."
    )
    regroup_seconds_total: float = 0.0
    retried_samples_total: int = 0
    rollbacks_total: int = Field(0, description="Times every worker holding the state was "
                                 "lost and the job went back to its last checkpoint, its "
                                 "history with it (since its coordinator started).")
    step_breakdown: StepBreakdown | None = Field(
        default=None, description="Where the last epoch's step time went.")
    started_at: float | None = None
    finished_at: float | None = None
    ps: PSStatus | None = Field(default=None, description="Parameter-server jobs only.")
    global_batch: int | None = Field(default=None, description="The current global batch.")
    lr: float | None = Field(default=None, description="The current step's learning rate.")
    noise_scale: float | None = Field(
        default=None, description="Goodput mode: the gradient noise scale estimate.")
    goodput_batch: int | None = Field(
        default=None, description="Goodput mode: the global batch it chose last.")
    isgd_flagged_total: int = 0
    isgd_extra_iterations_total: int = 0
