"""The roster (membership and spares): who trains, at each step boundary.

These carry out the step loop's reconciling and regrouping effects (what a boundary does,
and in which order, is the reducer's: :mod:`dynabatch.scheduler.core.sync.loop`); who is
in, who holds the state and what to spawn is the pure
:class:`~dynabatch.scheduler.core.membership.Membership`'s.

An assignment is taken as it arrives, on the actor's request thread, while the step loop
trains (:meth:`Roster.start_assigned`): its new workers start then, and a boundary adopts
them once up, as it adopts any started worker. So the membership's placement changes
under the job's lock on both threads; the loop never holds it while it waits. Once a group
forms, the job tells the cluster scheduler its members (:meth:`Roster.report_group`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dynabatch.scheduler.control import Assign, Drain, Scale
from dynabatch.scheduler.core.cluster.ray_nodes import node_label
from dynabatch.scheduler.core.failures import FailureEvent
from dynabatch.scheduler.core.membership import SparePlan, Spawn
from dynabatch.scheduler.core.sync.boundary import wait_for_minimum
from dynabatch.scheduler.core.sync.loop import NODE_POLL_S
from dynabatch.scheduler.runtime.seam import GroupReport

if TYPE_CHECKING:
    from dynabatch.scheduler.control import JobControl
    from dynabatch.scheduler.core.membership import Membership, NodeInfo
    from dynabatch.scheduler.core.sync.protocol import SyncProtocol
    from dynabatch.scheduler.core.sync.tracker import Tracker
    from dynabatch.scheduler.runtime.seam import GroupReports, Runtime
    from dynabatch.scheduler.sync.evaluation import Evaluations
    from dynabatch.scheduler.sync.workforce import Workforce

# After adopting a spare at a boundary with nothing in flight, how long to wait for it to
# answer so that it joins this regroup rather than one segment later.
ADOPT_WAIT_S = 0.5
# How long each of the first start's waits for its workers lasts (the loop looks again
# after each: a cancel, the start timeout, workers that failed to start).
START_WAIT_S = 0.5


class Roster:
    """Who trains: the driver's side of :class:`~dynabatch.scheduler.core.membership.
    Membership` (named apart from the workers' process group, ``dynabatch.actors.group``)."""

    def __init__(self, protocol: SyncProtocol, membership: Membership, tracker: Tracker,
                 control: JobControl, workforce: Workforce, runtime: Runtime,
                 evals: Evaluations, reports: GroupReports | None):
        """``reports``: where a group formed is told to the cluster scheduler (None: not
        told)."""
        self.protocol, self.membership, self.tracker = protocol, membership, tracker
        self.control, self.workforce = control, workforce
        self.runtime, self.evals, self.reports = runtime, evals, reports
        self.nodes: list[NodeInfo] = []  # as last listed (the loop's Place)
        self.regroup_seconds = 0.0  # this driver's regroups, from the call to the group

    # ---------------------------------------------------------------- at a boundary
    def poll_nodes(self, starting: bool) -> None:
        """List the nodes now (the loop's ``Place`` first): the job's first start says when
        there are none; spares lost before they were adopted are noted."""
        with self.control.lock:
            self.nodes = self.runtime.nodes()
            if not self.nodes and starting:
                self.control.waiting(f"waiting for resources: {self.no_node_hint()}")
            for node, why in self.runtime.lost_spares():
                self.membership.spare_lost(node, why)
                self.control.log("WARNING", f"the spare worker on node {node_label(node)} was lost "
                                            f"before it was adopted ({why}); that node gets no "
                                            "other spare")

    def apply_requests(self, assignments: bool = False) -> bool:
        """Take the queued scale, drain and assign requests into the membership (what they
        drain leaves at :meth:`apply_drains`; workers still starting that an assignment
        leaves out stop now); ``assignments``: only the assignments at the head of the queue
        (with a segment in flight: their workers start now). True when one was taken."""
        m = self.membership
        took = False
        with self.control.lock:
            for r in self.control.take_requests(assignments):
                try:
                    match r:
                        case Scale(workers):
                            m.request_scale(workers, speeds=self.tracker.speeds())
                        case Drain(worker):
                            m.request_drain(worker)
                        case Assign(nodes):
                            m.request_assignment(nodes)
                            took = True
                            self.withdraw()
                except (KeyError, ValueError) as err:
                    self.control.log("WARNING", f"{r} not applied: {err}")
        return took

    def withdraw(self) -> None:
        """Stop the workers still starting that the assignment in force leaves out (an
        earlier one started them): they would hold slots the scheduler has given away."""
        for w in self.membership.withdraw():
            self.runtime.kill(w)
            self.control.log("INFO", f"worker {w} stopped before it joined: the assignment in "
                                     "force leaves its slot out")

    def apply_drains(self) -> None:
        """Remove the workers asked to leave, and those an assignment moves now (the loop
        settles the evaluations first: a drained worker may still owe its shard of one)."""
        with self.control.lock:
            changes = self.membership.apply_drains(self.tracker.speeds())
        for change in changes:
            self.workforce.changed(change)
            self.workforce.left(change.worker)

    # ---------------------------------------------------------------- starting workers
    def start_assigned(self) -> None:
        """An assignment arrived (on the actor's request thread, the step loop training
        meanwhile): take it now and start the workers its new slots need, as a boundary with
        a segment in flight would, so that they start up while the group trains and join at
        the first boundary once up; workers still starting for an earlier assignment that
        it leaves out stop. Before the job's first group (its first start places the newest
        assignment), or once it ends or is cancelled, the next boundary takes it."""
        c = self.control
        with self.control.lock:
            if (c.state.is_terminal or c.cancel_reason is not None or not self.protocol.loaded
                    or self.membership.generation == 0):
                return
            if self.apply_requests(assignments=True):
                self.poll_nodes(starting=False)
                self.start(self.spawns(starting=False))

    def place(self, starting: bool) -> tuple[tuple[Spawn, ...], SparePlan]:
        """List the nodes and plan, on them, the workers to start where members are missing
        and, except at the first start, the spares: the membership's plans (the loop's
        ``Place``)."""
        self.poll_nodes(starting)
        spawns = self.spawns(starting)
        if starting:
            return spawns, SparePlan()
        with self.control.lock:
            return spawns, self.membership.spare_plan(self.nodes, self.control.spec.spares)

    def spawns(self, starting: bool) -> tuple[Spawn, ...]:
        """The workers to start on the nodes last listed, now pending in the membership."""
        m = self.membership
        with self.control.lock:
            spawns = tuple(m.spawns(self.nodes, starting, self.control.spec.gpus_on))
            if not starting:
                self.note_placement(m.unplaced)
        return spawns

    def start(self, spawns: tuple[Spawn, ...], wait: bool = False) -> None:
        """Start ``spawns``' workers (the loop's ``StartWorkers``). ``wait``: an adopted
        spare is waited for a moment (see :data:`ADOPT_WAIT_S`)."""
        m = self.membership
        with self.control.lock:
            # One an assignment left out since it was planned (on the request thread) is not
            # pending any more: it is not started.
            spawns = tuple(sp for sp in spawns if sp.worker_id in m.pending)
            for i, sp in enumerate(spawns):
                try:
                    self.runtime.spawn(sp)
                except BaseException:
                    for left in spawns[i:]:  # not started: not left starting for ever
                        m.start_failed(left.worker_id)
                    raise
                self.control.log("INFO", f"starting worker {sp.worker_id} on node "
                                         f"{node_label(sp.node_id)}" + (" (GPU)" if sp.gpus else "")
                                         + (" (adopting its spare)" if sp.adopt else ""))
        if wait:
            # Nothing in flight: the adopted spare answers in milliseconds, and joins the
            # group formed at this boundary.
            self.adopt_started(ADOPT_WAIT_S)

    def tend_spares(self, plan: SparePlan) -> None:
        """Start and stop spares as the membership's ``plan`` says (the loop's
        ``TendSpares``)."""
        with self.control.lock:
            for node in plan.stop:
                self.runtime.stop_spare(node)
            for node in plan.start:
                self.runtime.start_spare(node)
                self.control.log("INFO", f"starting a spare worker on node {node_label(node)}")

    def placement_text(self, short: int, want: int) -> str:
        s = self.control.spec
        if self.membership.assignment is not None:
            return (f"{want - short} of {want} assigned workers placed: {short} are for "
                    "assigned nodes that are not alive or cannot host this job's workers "
                    f"(worker_cpus={s.worker_cpus:g}"
                    + (f", node_resource={s.node_resource!r}" if s.node_resource else "")
                    + ")")
        return (f"{want - short} of {want} requested workers placed: no eligible node has "
                f"room for another worker now (worker_cpus={s.worker_cpus:g}); the job "
                f"runs on {want - short} until CPUs free up or a node joins")

    def note_placement(self, unplaced: tuple[int, int] | None) -> None:
        """Keep saying, in the log once and in the reason while it lasts, that requested
        workers could not be placed."""
        c = self.control
        note = None if unplaced is None else self.placement_text(*unplaced)
        if note is None and self.control.scale_queued():
            return  # a scale request not applied yet: its note stands until it is
        if note != c.placement_note and note is not None:
            self.control.log("WARNING", f"cannot place every worker: {note}")
        elif note != c.placement_note:
            self.control.log("INFO", "every requested worker is placed")
        c.placement(note)

    def adopt_started(self, timeout_s: float) -> None:
        """Take in the workers that came up (waiting up to ``timeout_s`` for the first, not
        under the lock): each joins the members, its telemetry tracked from now, or is
        stopped when no longer wanted."""
        m = self.membership
        for st in self.runtime.poll_started(timeout_s):
            if st.error is not None:
                with self.control.lock:
                    m.start_failed(st.worker)
                self.control.log("WARNING", f"worker {st.worker} failed to start: {st.error}")
                continue
            with self.control.lock:
                change = m.started(st.worker)
            if change is None:
                self.workforce.left(st.worker)
            else:
                self.tracker.add(st.worker, m.get(st.worker).capacity)
                self.workforce.changed(change)

    def await_starts(self) -> None:
        """Wait a little for the first start's workers to come up, and take in those that
        did (the loop's ``AwaitStarts``; the start timeout is its)."""
        m = self.membership
        self.control.waiting(
            f"waiting for resources: {len(m.pending)} of {len(m.pending) + len(m.members)}"
            f" workers not started yet ({len(self.runtime.nodes())} eligible nodes; other "
            "jobs may hold their CPUs)")
        self.adopt_started(START_WAIT_S)

    def give_up_starts(self) -> None:
        """The workers still starting when the first start's wait ended (the loop's
        ``GiveUpStarts``): out of the membership, queued to be killed."""
        m = self.membership
        why = ("the job was cancelled while it started" if self.control.cancel_reason is not None
               else f"it could not start in {self.control.spec.start_timeout_s:.0f}s")
        with self.control.lock:
            given_up = list(m.pending)
            for w in given_up:
                m.start_failed(w)
        for w in given_up:
            self.control.log("WARNING", f"worker {w} given up: {why}")
            self.workforce.left(w)

    def wait_for_min(self, shortfall: str, since: float | None) -> bool:
        """Too few workers since ``since`` (None: from now; the loop's ``Waiting`` keeps
        when the wait began)."""
        c, s = self.control, self.control.spec
        wait = wait_for_minimum(
            since=since, now=self.control.clock.now(),
            started=self.membership.generation != 0, start_timeout_s=s.start_timeout_s,
            worker_wait_timeout_s=s.worker_wait_timeout_s)
        if wait.first:
            self.control.log("WARNING", f"cannot train: {shortfall}")
        hint = "" if self.runtime.nodes() else f": {self.no_node_hint()}"
        if wait.give_up:
            self.workforce.failed(FailureEvent(
                "no_workers",
                error=f"only {shortfall} available after waiting {wait.limit:.0f}s{hint}"))
            return False
        # (The job is PENDING meanwhile: its state follows the loop's Waiting.)
        c.waiting(f"waiting for nodes: {shortfall} ({wait.waited:.0f}s of "
                  f"{wait.limit:.0f}s){hint}")
        # The next boundary lists the nodes again (NODE_POLL_S) and starts what is missing.
        self.control.clock.sleep(NODE_POLL_S)
        return False

    def no_node_hint(self) -> str:
        s = self.control.spec
        g = s.worker_gpus
        gpus = g if g == "auto" else f"{g:g}"
        need = f"worker_cpus={s.worker_cpus:g}, worker_gpus={gpus}"
        if s.node_resource:
            need += f", node_resource={s.node_resource!r}"
        return f"no alive node offers {need}"

    # ---------------------------------------------------------------- the group
    def regroup(self, members: tuple[str, ...], weights: dict[str, Any] | None) -> bool:
        """Form a new generation of ``members``, rank 0 first (the loop's ``Regroup``; no
        member holding the committed state: it rolled back first). ``weights``: those a
        checkpoint restored, which go to rank 0 even when every member holds the committed
        position (a job starting from another's checkpoint, ``checkpoint.from``, is at epoch
        0 step 0 with them). False when it failed (the next step tries again)."""
        m = self.membership
        t0 = self.control.clock.now()
        # A join is its start-up (join_timeout) and the state broadcast (a collective).
        s = self.control.spec
        result = self.runtime.regroup(m.generation + 1, members, weights,
                                      s.join_timeout + s.collective_timeout_s + 30)
        if not result.ok:
            for w, why in result.lost.items():
                self.workforce.remove(w, "failure", why)
            why = "; ".join([*result.lost.values(), *([result.error] if result.error else [])])
            self.control.log("WARNING", f"regroup failed ({why}); retrying")
            self.workforce.failed(FailureEvent("regroup", lost=bool(result.lost), error=why))
            return False
        self.workforce.succeeded("regroup")
        self.evals.take_behind()  # an evaluation queued before the regroup ran before it
        with self.control.lock:
            m.regrouped(members)
        dt = self.control.clock.now() - t0
        self.regroup_seconds += dt
        self.control.log("INFO", f"generation {m.generation}: {len(members)} workers "
                                 f"{list(members)} (formed in {dt:.2f}s)")
        self.report_group(members)
        return True

    def report_group(self, members: tuple[str, ...]) -> None:
        """Tell the cluster scheduler the group that formed (``members``: their nodes and
        speeds, and the global batch), when one placed the job (an assignment is in force):
        its view shows them at once. Sent without waiting."""
        c = self.control
        m = self.membership
        if self.reports is None or m.assignment is None:
            return
        speeds = self.tracker.speeds()
        nodes = {x.worker_id: x.node for x in m.members}
        self.reports.report(GroupReport(
            c.job_id, tuple((nodes[w], speeds.get(w, 0.0)) for w in members if w in nodes),
            float(self.protocol.global_batch)))
