"""SQLite persistence for jobs, their per-epoch history and their logs.

One connection under a lock, shared by the API's request threads and the sync loop; columns
added since the first release are added to an older file on open. Every state move is
checked against the lifecycle inside its transaction. A resumed job's new coordinator counts
its log lines from 0 and holds the history only up to its checkpoint: ``log_offset`` keeps
stored lines apart and ``resync`` marks a history to be re-read whole.
"""

from __future__ import annotations

import functools
import itertools
import json
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dynabatch.actors.spec import JobSpec, spec_warnings_caught
from dynabatch.scheduler.core.lifecycle import InvalidTransition, JobState
from dynabatch.scheduler.telemetry import EpochRecord, JobSnapshot, LogLine

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    spec TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT,
    cluster TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    finished_at REAL,
    snapshot TEXT,
    resumes INTEGER NOT NULL DEFAULT 0,
    auto_resumes INTEGER NOT NULL DEFAULT 0,
    target_workers INTEGER,
    log_offset INTEGER NOT NULL DEFAULT 0,
    resync INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs (state, created_at);
CREATE TABLE IF NOT EXISTS history (
    job_id TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    epoch INTEGER NOT NULL,
    record TEXT NOT NULL,
    PRIMARY KEY (job_id, epoch)
);
CREATE TABLE IF NOT EXISTS logs (
    job_id TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    time REAL NOT NULL,
    level TEXT NOT NULL,
    message TEXT NOT NULL,
    PRIMARY KEY (job_id, seq)
);
"""

EMBEDDED_CLUSTER = "embedded"
RECORDS_KEPT = 1024  # job records kept in memory by JobStore.get (the most recently read)

# Columns added after the first release: (name, definition) for ALTER TABLE on older files.
_ADDED_COLUMNS = (
    ("resumes", "INTEGER NOT NULL DEFAULT 0"),
    ("auto_resumes", "INTEGER NOT NULL DEFAULT 0"),
    ("target_workers", "INTEGER"),
    ("log_offset", "INTEGER NOT NULL DEFAULT 0"),
    ("resync", "INTEGER NOT NULL DEFAULT 0"),
)


# A new job's reason until its coordinator reports: launched at once (no cluster scheduler),
# or queued with the scheduler until its next round places it (which then gives the reason).
STARTING = "submitted; the coordinator is starting"
QUEUED = "queued: waiting for the cluster scheduler's next round"


@dataclass(frozen=True, slots=True)
class JobRecord:
    """A job as stored: what was asked for, where it ran and what was last seen of it."""

    id: str
    name: str
    spec: JobSpec
    state: JobState
    reason: str | None
    cluster: str
    created_at: float
    updated_at: float
    finished_at: float | None
    snapshot: JobSnapshot | None
    resumes: int = 0
    """Times the job was resumed from its checkpoint (automatically or on request)."""
    auto_resumes: int = 0
    """Automatic resumes since the job last finished an epoch or was resumed on request."""
    target_workers: int | None = None
    """The size last asked for with scale or drain; a resumed coordinator starts with it."""
    log_offset: int = 0
    resync: bool = False

    def current_snapshot(self) -> JobSnapshot:
        """The latest snapshot, with the stored state and reason (which win on conflict)."""
        if self.snapshot is None:
            return JobSnapshot(
                job_id=self.id,
                name=self.name,
                state=self.state,
                reason=self.reason,
                epochs=self.spec.epochs,
                policy=self.spec.policy,
                emulated=self.spec.emulated,
                finished_at=self.finished_at,
            )
        if self.snapshot.state == self.state and self.snapshot.reason == self.reason:
            return self.snapshot
        update: dict[str, object] = {"state": self.state, "reason": self.reason}
        if self.state.is_terminal and self.snapshot.finished_at is None:
            update["finished_at"] = self.finished_at
        return self.snapshot.model_copy(update=update)


# Parsed JSON columns by their text: a job's spec, snapshot and epoch records are read far
# more often than they change (every status, list, history and page read parses them), and
# the models are frozen, so one parse serves every read of the same text.
@functools.lru_cache(maxsize=1024)
def _load_spec(text: str) -> JobSpec:
    if '"errors"' in text:
        # Stored while the spec had emulation.errors (fault injection, now the tests'):
        # every such spec carries it, empty for all but fault tests. Read without it.
        data = json.loads(text)
        if isinstance(data.get("emulation"), dict):
            data["emulation"].pop("errors", None)
            text = json.dumps(data)
    # A stored spec was warned about when it was submitted; reading it back says nothing.
    with spec_warnings_caught():
        return JobSpec.model_validate_json(text)


_snapshot = functools.lru_cache(maxsize=1024)(JobSnapshot.model_validate_json)
_epoch_record = functools.lru_cache(maxsize=1024)(EpochRecord.model_validate_json)


def _coordinator_gone(snapshot: str | None, state: JobState, reason: str) -> str | None:
    """A stored snapshot as a new coordinator starts from: its progress, with ``state`` and
    ``reason``, and no workers (they went with the old one)."""
    if not snapshot:
        return snapshot
    update = {"state": state, "reason": reason, "workers": [], "finished_at": None}
    return JobSnapshot.model_validate_json(snapshot).model_copy(update=update).model_dump_json()


def _row_to_record(row: sqlite3.Row) -> JobRecord:
    snap = row["snapshot"]
    return JobRecord(
        id=row["id"],
        name=row["name"],
        spec=_load_spec(row["spec"]),
        state=JobState(row["state"]),
        reason=row["reason"],
        cluster=row["cluster"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        finished_at=row["finished_at"],
        snapshot=_snapshot(snap) if snap else None,
        resumes=int(row["resumes"]),
        auto_resumes=int(row["auto_resumes"]),
        target_workers=row["target_workers"],
        log_offset=int(row["log_offset"]),
        resync=bool(row["resync"]),
    )


class JobStore:
    """Jobs, history and logs in one SQLite file (or ``":memory:"``)."""

    def __init__(self, path: str | Path = "dynabatch.db"):
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(
            self.path, check_same_thread=False, isolation_level=None, timeout=10.0
        )
        self._db.row_factory = sqlite3.Row
        # Versions of what this store wrote (see "Versions" below), and the records last
        # read by get() (one is dropped when its row is written).
        self._clock = itertools.count(1)
        self._row_versions: dict[str, int] = {}
        self._history_versions: dict[str, int] = {}
        self._rows_version = 0
        self._version = 0
        self._records: OrderedDict[str, JobRecord] = OrderedDict()
        with self._lock:
            if self.path != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(SCHEMA)
            have = {r[1] for r in self._db.execute("PRAGMA table_info(jobs)").fetchall()}
            for name, definition in _ADDED_COLUMNS:
                if name not in have:
                    self._db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {definition}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(
        self, job_id: str | None = None, *, row: bool = True, history: bool = False
    ) -> Iterator[sqlite3.Connection]:
        """One write transaction; once it committed, the versions of what it wrote to
        ``job_id`` (its ``row``, its ``history``) move on."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            if job_id is not None:
                version = self._version = next(self._clock)
                if row:
                    self._row_versions[job_id] = version
                    self._rows_version = version
                    self._records.pop(job_id, None)
                if history:
                    self._history_versions[job_id] = version

    # Versions ---------------------------------------------------------------------------
    # The store is the service's only writer to its file (one API process per SQLite file,
    # README "single writer"), so it knows when what it holds changed without asking
    # SQLite: readers keep what they built from the store (a record, a serialized answer)
    # with the version it was read at, and reuse it while the version is the same. A
    # version is read before the data it describes, so a write in between is seen as a
    # change at the next read (never the reverse).
    def row_version(self, job_id: str) -> int:
        """Changes whenever the job's row (state, snapshot, counters) is written."""
        return self._row_versions.get(job_id, 0)

    def history_version(self, job_id: str) -> int:
        """Changes whenever the job's epoch records are written."""
        return self._history_versions.get(job_id, 0)

    @property
    def version(self) -> int:
        """Changes whenever any job's row or epoch records are written."""
        return self._version

    @property
    def rows_version(self) -> int:
        """Changes whenever any job's row is written (a job created, synced, ended...)."""
        return self._rows_version

    # Jobs -------------------------------------------------------------------------------
    def create(
        self,
        job_id: str,
        spec: JobSpec,
        *,
        cluster: str,
        now: float,
        reason: str = STARTING,
    ) -> JobRecord:
        with self._tx(job_id) as db:
            db.execute(
                "INSERT INTO jobs (id, name, spec, state, reason, cluster, created_at, "
                "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    job_id,
                    spec.name,
                    spec.model_dump_json(),
                    JobState.PENDING.value,
                    reason,
                    cluster,
                    now,
                    now,
                ),
            )
        record = self.get(job_id)
        assert record is not None
        return record

    def get(self, job_id: str) -> JobRecord | None:
        """The job as stored; no query while its row is unchanged since the last read."""
        with self._lock:
            rec = self._records.get(job_id)
            if rec is not None:
                self._records.move_to_end(job_id)
                return rec
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                return None
            rec = _row_to_record(row)
            self._records[job_id] = rec  # a write to the row (under this lock) drops it
            while len(self._records) > RECORDS_KEPT:
                self._records.popitem(last=False)
            return rec

    def list(
        self, state: JobState | None = None, *, offset: int = 0, limit: int = 50
    ) -> tuple[list[JobRecord], int]:
        """Newest first; returns the page and the total number of matching jobs."""
        where, args = ("WHERE state = ?", (state.value,)) if state else ("", ())
        with self._lock:
            total = self._db.execute(f"SELECT COUNT(*) FROM jobs {where}", args).fetchone()[0]
            rows = self._db.execute(
                f"SELECT * FROM jobs {where} ORDER BY created_at DESC, id LIMIT ? OFFSET ?",
                (*args, limit, offset),
            ).fetchall()
        return [_row_to_record(r) for r in rows], int(total)

    def live(self) -> list[JobRecord]:
        """Jobs that are not terminal (PENDING or RUNNING), oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM jobs WHERE state IN (?, ?) ORDER BY created_at, id",
                (JobState.PENDING.value, JobState.RUNNING.value),
            ).fetchall()
        return [_row_to_record(r) for r in rows]

    def finished_since(self, since: float) -> list[JobRecord]:
        """Terminal jobs that finished at or after ``since``."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM jobs WHERE state NOT IN (?, ?) AND finished_at >= ? "
                "ORDER BY created_at, id",
                (JobState.PENDING.value, JobState.RUNNING.value, since),
            ).fetchall()
        return [_row_to_record(r) for r in rows]

    def count_by_state(self) -> dict[JobState, int]:
        with self._lock:
            rows = self._db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall()
        counts = dict.fromkeys(JobState, 0)
        for state, n in rows:
            counts[JobState(state)] = int(n)
        return counts

    def save_snapshot(self, snapshot: JobSnapshot, *, now: float) -> bool:
        """Store what the coordinator reported; whether the row changed. The service only
        samples the coordinator's transitions, so any state is accepted for a live job (each is
        reachable from each live one: dynabatch.scheduler.core.lifecycle); a job already
        terminal here is left alone."""
        with self._tx(snapshot.job_id) as db:
            row = db.execute(
                "SELECT state, finished_at FROM jobs WHERE id = ?", (snapshot.job_id,)
            ).fetchone()
            if row is None or JobState(row["state"]).is_terminal:
                return False
            finished = row["finished_at"]
            if snapshot.state.is_terminal:
                finished = snapshot.finished_at or now
            db.execute(
                "UPDATE jobs SET state = ?, reason = ?, snapshot = ?, updated_at = ?, "
                "finished_at = ? WHERE id = ?",
                (
                    snapshot.state.value,
                    snapshot.reason,
                    snapshot.model_dump_json(),
                    now,
                    finished,
                    snapshot.job_id,
                ),
            )
        return True

    def transition(
        self, job_id: str, new: JobState, reason: str | None, *, now: float
    ) -> JobRecord:
        """A service-initiated state change, checked against the lifecycle (``KeyError``,
        ``InvalidTransition``)."""
        with self._tx(job_id) as db:
            row = db.execute(
                "SELECT state, finished_at FROM jobs WHERE id = ?", (job_id,)
            ).fetchone()
            if row is None:
                raise KeyError(job_id)
            old = JobState(row["state"])
            if not old.can_become(new):
                raise InvalidTransition(old, new)
            finished = now if new.is_terminal else row["finished_at"]
            db.execute(
                "UPDATE jobs SET state = ?, reason = ?, updated_at = ?, finished_at = ? "
                "WHERE id = ?",
                (new.value, reason, now, finished, job_id),
            )
        record = self.get(job_id)
        assert record is not None
        return record

    def set_target_workers(self, job_id: str, workers: int | None) -> None:
        with self._tx(job_id) as db:
            db.execute("UPDATE jobs SET target_workers = ? WHERE id = ?", (workers, job_id))

    def mark_resumed(
        self,
        job_id: str,
        reason: str,
        *,
        automatic: bool,
        cluster: str | None = None,
        now: float,
    ) -> JobRecord:
        """A new coordinator is being started for the job from its checkpoint: PENDING with
        ``reason`` (the one way out of FAILED or CANCELLED), ``reason`` logged, the log offset
        moved past the stored lines, a full history re-read marked, the old workers gone."""
        with self._tx(job_id) as db:
            row = db.execute(
                "SELECT state, snapshot, auto_resumes, cluster FROM jobs WHERE id = ?", (job_id,)
            ).fetchone()
            if row is None:
                raise KeyError(job_id)
            new = JobState(row["state"]).resumed()
            last = self.last_log_seq(job_id)
            seq = 0 if last is None else last + 1
            db.execute(
                "INSERT INTO logs (job_id, seq, time, level, message) VALUES (?, ?, ?, ?, ?)",
                (job_id, seq, now, "WARNING", reason),
            )
            snapshot = _coordinator_gone(row["snapshot"], new, reason)
            db.execute(
                "UPDATE jobs SET state = ?, reason = ?, updated_at = ?, finished_at = NULL, "
                "snapshot = ?, resumes = resumes + 1, auto_resumes = ?, log_offset = ?, "
                "resync = 1, cluster = ? WHERE id = ?",
                (
                    new.value,
                    reason,
                    now,
                    snapshot,
                    int(row["auto_resumes"]) + 1 if automatic else 0,
                    seq + 1,
                    cluster or row["cluster"],
                    job_id,
                ),
            )
        record = self.get(job_id)
        assert record is not None
        return record

    def reset_auto_resumes(self, job_id: str) -> None:
        with self._tx(job_id) as db:
            db.execute("UPDATE jobs SET auto_resumes = 0 WHERE id = ?", (job_id,))

    def interrupt(self, job_id: str, reason: str, *, now: float) -> JobRecord | None:
        """A live job whose coordinator is gone but which will be resumed later (when the API
        starts again): PENDING with ``reason``, no workers. A job the lifecycle does not let
        become PENDING (a finished one) is left alone: None."""
        with self._tx(job_id) as db:
            row = db.execute("SELECT state, snapshot FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                return None
            old = JobState(row["state"])
            if old is not JobState.PENDING and not old.can_become(JobState.PENDING):
                return None
            snapshot = _coordinator_gone(row["snapshot"], JobState.PENDING, reason)
            db.execute(
                "UPDATE jobs SET state = ?, reason = ?, updated_at = ?, snapshot = ? WHERE id = ?",
                (JobState.PENDING.value, reason, now, snapshot, job_id),
            )
        return self.get(job_id)

    # History ----------------------------------------------------------------------------
    def replace_history(self, job_id: str, records: Iterable[EpochRecord]) -> None:
        """The job's whole history is ``records`` (a resumed coordinator's, read in full);
        clears the job's ``resync`` mark."""
        rows = [(job_id, r.epoch, r.model_dump_json()) for r in records]
        with self._tx(job_id, history=True) as db:
            db.execute("DELETE FROM history WHERE job_id = ?", (job_id,))
            db.executemany(
                "INSERT INTO history (job_id, epoch, record) VALUES (?, ?, ?)", rows
            )
            db.execute("UPDATE jobs SET resync = 0 WHERE id = ?", (job_id,))

    def add_history(self, job_id: str, records: Iterable[EpochRecord]) -> None:
        rows = [(job_id, r.epoch, r.model_dump_json()) for r in records]
        if not rows:
            return
        with self._tx(job_id, row=False, history=True) as db:
            db.executemany(
                "INSERT OR REPLACE INTO history (job_id, epoch, record) VALUES (?, ?, ?)", rows
            )

    def history(self, job_id: str, since: int = 0) -> list[EpochRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT record FROM history WHERE job_id = ? AND epoch >= ? ORDER BY epoch",
                (job_id, since),
            ).fetchall()
        return [_epoch_record(r[0]) for r in rows]

    def last_records(self, job_ids: Iterable[str]) -> dict[str, EpochRecord]:
        """Each job's last epoch record (jobs without one are left out), in one query."""
        ids = list(job_ids)
        if not ids:
            return {}
        marks = ", ".join("?" * len(ids))
        with self._lock:
            rows = self._db.execute(
                f"SELECT h.job_id, h.record FROM history h JOIN (SELECT job_id, MAX(epoch) AS e "
                f"FROM history WHERE job_id IN ({marks}) GROUP BY job_id) m "
                "ON h.job_id = m.job_id AND h.epoch = m.e",
                ids,
            ).fetchall()
        return {r[0]: _epoch_record(r[1]) for r in rows}

    def last_epoch(self, job_id: str) -> int | None:
        with self._lock:
            row = self._db.execute(
                "SELECT MAX(epoch) FROM history WHERE job_id = ?", (job_id,)
            ).fetchone()
        return None if row[0] is None else int(row[0])

    # Logs -------------------------------------------------------------------------------
    def add_logs(self, job_id: str, lines: Iterable[LogLine]) -> None:
        rows = [(job_id, x.seq, x.time, x.level, x.message) for x in lines]
        if not rows:
            return
        with self._tx() as db:
            db.executemany(
                "INSERT OR REPLACE INTO logs (job_id, seq, time, level, message) "
                "VALUES (?, ?, ?, ?, ?)",
                rows,
            )

    def logs(self, job_id: str, since: int = 0, limit: int = 1000) -> list[LogLine]:
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, time, level, message FROM logs WHERE job_id = ? AND seq >= ? "
                "ORDER BY seq LIMIT ?",
                (job_id, since, limit),
            ).fetchall()
        return [
            LogLine(seq=r["seq"], time=r["time"], level=r["level"], message=r["message"])
            for r in rows
        ]

    def last_log_seq(self, job_id: str) -> int | None:
        with self._lock:
            row = self._db.execute(
                "SELECT MAX(seq) FROM logs WHERE job_id = ?", (job_id,)
            ).fetchone()
        return None if row[0] is None else int(row[0])
