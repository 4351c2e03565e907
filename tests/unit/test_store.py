"""SQLite job store: schema, queries, the lifecycle rules it enforces, persistence."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from dynabatch.actors.spec import JobSpec
from dynabatch.scheduler.core.lifecycle import InvalidTransition, JobState
from dynabatch.scheduler.telemetry import EpochRecord, JobSnapshot, LogLine
from dynabatch.service.store import EMBEDDED_CLUSTER, JobStore


def _spec(name: str = "job", **kw: object) -> JobSpec:
    return JobSpec.model_validate({"name": name, **kw})


def _record(epoch: int) -> EpochRecord:
    return EpochRecord(
        epoch=epoch,
        wall_s=1.0,
        steps=3,
        dataset_size=100,
        samples_trained=100,
        train_loss=0.5,
        utilization=0.8,
        compute_balance=0.9,
        policy="affine",
        workers=[],
    )


@pytest.fixture
def store(tmp_path: Path) -> JobStore:
    s = JobStore(tmp_path / "sub" / "jobs.db")
    yield s
    s.close()


def test_create_and_get(store: JobStore) -> None:
    rec = store.create("a" * 12, _spec("first", epochs=7), cluster="127.0.0.1:6379", now=10.0)
    assert rec.state == JobState.PENDING
    assert rec.reason
    assert rec.spec.epochs == 7
    assert rec.created_at == rec.updated_at == 10.0
    snap = rec.current_snapshot()
    assert (snap.job_id, snap.name, snap.state, snap.epochs) == (
        "a" * 12,
        "first",
        JobState.PENDING,
        7,
    )
    assert store.get("b" * 12) is None


def test_list_filters_and_paginates_newest_first(store: JobStore) -> None:
    for i in range(5):
        store.create(f"{i:012x}", _spec(f"j{i}"), cluster="x", now=float(i))
    store.transition(f"{1:012x}", JobState.CANCELLED, "bye", now=9.0)
    page, total = store.list(offset=0, limit=2)
    assert total == 5
    assert [r.name for r in page] == ["j4", "j3"]
    page, total = store.list(offset=4, limit=2)
    assert [r.name for r in page] == ["j0"]
    page, total = store.list(JobState.CANCELLED)
    assert total == 1 and page[0].reason == "bye" and page[0].finished_at == 9.0
    assert {r.name for r in store.live()} == {"j0", "j2", "j3", "j4"}
    assert store.count_by_state()[JobState.PENDING] == 4
    assert [r.name for r in store.finished_since(9.0)] == ["j1"]
    assert store.finished_since(9.5) == []


def test_transitions_are_enforced(store: JobStore) -> None:
    store.create("a" * 12, _spec(), cluster="x", now=1.0)
    store.transition("a" * 12, JobState.RUNNING, None, now=1.0)
    store.transition("a" * 12, JobState.SUCCEEDED, None, now=1.0)
    with pytest.raises(InvalidTransition, match="SUCCEEDED; it cannot become CANCELLED"):
        store.transition("a" * 12, JobState.CANCELLED, "late", now=1.0)
    with pytest.raises(KeyError):
        store.transition("f" * 12, JobState.CANCELLED, "unknown", now=1.0)


def test_snapshots_never_move_a_terminal_job(store: JobStore) -> None:
    store.create("a" * 12, _spec(), cluster="x", now=1.0)
    running = JobSnapshot(job_id="a" * 12, name="job", state=JobState.RUNNING, epoch=1, step=2)
    assert store.save_snapshot(running, now=1.0)
    rec = store.get("a" * 12)
    assert rec.state == JobState.RUNNING and rec.current_snapshot().step == 2
    # A quick job may be seen going from PENDING straight to SUCCEEDED: accepted.
    store.create("b" * 12, _spec(), cluster="x", now=1.0)
    done = JobSnapshot(job_id="b" * 12, name="job", state=JobState.SUCCEEDED, finished_at=5.0)
    assert store.save_snapshot(done, now=1.0)
    assert store.get("b" * 12).finished_at == 5.0
    # Once FAILED here (coordinator died), a stale snapshot does not resurrect it.
    store.transition("a" * 12, JobState.FAILED, "the coordinator died", now=1.0)
    assert not store.save_snapshot(running, now=1.0)
    rec = store.get("a" * 12)
    assert rec.state == JobState.FAILED
    snap = rec.current_snapshot()
    assert snap.state == JobState.FAILED and snap.reason == "the coordinator died"
    assert snap.step == 2  # the last telemetry is kept


def test_history_and_logs(store: JobStore) -> None:
    store.create("a" * 12, _spec(), cluster="x", now=1.0)
    assert store.last_epoch("a" * 12) is None and store.last_log_seq("a" * 12) is None
    store.add_history("a" * 12, [_record(0), _record(1)])
    store.add_history("a" * 12, [_record(1), _record(2)])  # re-delivery is idempotent
    assert [r.epoch for r in store.history("a" * 12)] == [0, 1, 2]
    assert [r.epoch for r in store.history("a" * 12, since=2)] == [2]
    assert store.last_epoch("a" * 12) == 2
    lines = [LogLine(seq=i, time=float(i), level="INFO", message=f"m{i}") for i in range(5)]
    store.add_logs("a" * 12, lines)
    assert [x.message for x in store.logs("a" * 12, since=3)] == ["m3", "m4"]
    assert [x.seq for x in store.logs("a" * 12, limit=2)] == [0, 1]
    assert store.last_log_seq("a" * 12) == 4


def test_persists_across_reopen(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    s = JobStore(path)
    s.create("a" * 12, _spec("kept", epochs=2), cluster=EMBEDDED_CLUSTER, now=1.0)
    s.add_history("a" * 12, [_record(0)])
    s.transition("a" * 12, JobState.CANCELLED, "stop", now=1.0)
    s.close()
    s = JobStore(path)
    rec = s.get("a" * 12)
    assert rec is not None
    assert (rec.name, rec.state, rec.reason, rec.cluster) == (
        "kept",
        JobState.CANCELLED,
        "stop",
        EMBEDDED_CLUSTER,
    )
    assert [r.epoch for r in s.history("a" * 12)] == [0]
    s.close()


def test_memory_store_and_threads() -> None:
    s = JobStore(":memory:")
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for i in range(20):
                jid = f"{k:02x}{i:010x}"
                s.create(jid, _spec(), cluster="x", now=1.0)
                s.add_logs(jid, [LogLine(seq=0, time=0.0, level="INFO", message="x")])
                s.list(limit=5)
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert s.list()[1] == 80
    s.close()


def test_an_older_file_gets_the_new_columns(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(
        """
        CREATE TABLE jobs (id TEXT PRIMARY KEY, name TEXT NOT NULL, spec TEXT NOT NULL,
            state TEXT NOT NULL, reason TEXT, cluster TEXT NOT NULL, created_at REAL NOT NULL,
            updated_at REAL NOT NULL, finished_at REAL, snapshot TEXT);
        """
    )
    db.execute(
        "INSERT INTO jobs VALUES ('a', 'old', ?, 'RUNNING', NULL, 'embedded', 1.0, 1.0, NULL, "
        "NULL)",
        (_spec("old").model_dump_json(),),
    )
    db.commit()
    db.close()
    s = JobStore(path)
    rec = s.get("a")
    assert rec is not None and (rec.resumes, rec.auto_resumes, rec.target_workers) == (0, 0, None)
    assert (rec.log_offset, rec.resync) == (0, False)
    s.close()


def test_mark_resumed_reopens_a_failed_job_and_offsets_its_logs(store: JobStore) -> None:
    store.create("j", _spec(), cluster=EMBEDDED_CLUSTER, now=1.0)
    store.add_logs("j", [LogLine(seq=i, time=1.0, level="INFO", message=f"m{i}") for i in range(3)])
    store.add_history("j", [_record(0), _record(1)])
    snap = JobSnapshot(job_id="j", name="job", state=JobState.RUNNING, epoch=2, workers=[])
    store.save_snapshot(snap, now=2.0)
    store.transition("j", JobState.FAILED, "boom", now=3.0)
    rec = store.mark_resumed("j", "resume requested", automatic=False, now=4.0)
    assert (rec.state, rec.reason, rec.finished_at) == (JobState.PENDING, "resume requested", None)
    assert (rec.resumes, rec.auto_resumes, rec.log_offset, rec.resync) == (1, 0, 4, True)
    assert store.logs("j")[-1].message == "resume requested"
    assert rec.current_snapshot().epoch == 2  # progress is kept until the new coordinator says
    rec = store.mark_resumed("j", "again", automatic=True, now=5.0)
    assert (rec.resumes, rec.auto_resumes, rec.log_offset) == (2, 1, 5)
    store.replace_history("j", [_record(0)])
    assert [r.epoch for r in store.history("j")] == [0]
    rec = store.get("j")
    assert rec is not None and not rec.resync
    store.reset_auto_resumes("j")
    assert store.get("j").auto_resumes == 0
    with pytest.raises(KeyError):
        store.mark_resumed("nope", "x", automatic=True, now=1.0)


def test_get_reads_the_row_once_until_it_is_written(store: JobStore) -> None:
    store.create("j", _spec(), cluster="x", now=1.0)
    sql: list[str] = []
    store._db.set_trace_callback(sql.append)
    first = store.get("j")
    assert sql == [] and first is store.get("j")  # create() read it: kept, no query
    row, history, rows = store.row_version("j"), store.history_version("j"), store.rows_version
    store.add_history("j", [_record(0)])  # the history moves, not the row
    assert (store.row_version("j"), store.rows_version) == (row, rows)
    assert store.history_version("j") > history
    assert store.get("j") is first
    sql.clear()
    snap = JobSnapshot(job_id="j", name="job", state=JobState.RUNNING, epoch=1, workers=[])
    store.save_snapshot(snap, now=2.0)
    assert store.row_version("j") > row and store.rows_version > rows
    rec = store.get("j")
    assert rec is not None and (rec.state, rec.current_snapshot().epoch) == (JobState.RUNNING, 1)
    assert any(s.startswith("SELECT * FROM jobs") for s in sql)  # read again, once
    sql.clear()
    assert store.get("j") is rec and sql == []
    store.transition("j", JobState.CANCELLED, "stop", now=3.0)
    done = store.get("j")
    assert done is not None and done.state == JobState.CANCELLED
    row = store.row_version("j")
    with pytest.raises(InvalidTransition):  # a refused write changes nothing
        store.transition("j", JobState.RUNNING, "no", now=1.0)
    assert store.get("j") is done and store.row_version("j") == row
    assert store.get("nope") is None and store.row_version("nope") == 0


def test_a_spec_stored_with_the_former_emulation_errors_reads_back(tmp_path: Path) -> None:
    """Every spec the service stored while the job spec had ``emulation.errors`` (fault
    injection, since moved to the tests) carries it; the spec now refuses the field, and
    the store still reads such a row back, without it."""
    import sqlite3

    path = tmp_path / "jobs.db"
    s = JobStore(path)
    s.create("a" * 12, _spec("old", emulation={"slowdowns": [1, 2]}), cluster="x", now=1.0)
    s.close()
    db = sqlite3.connect(path)
    with db:
        db.execute("UPDATE jobs SET spec = replace(spec, '\"disturbances\":[]', "
                   "'\"disturbances\":[],\"errors\":[]')")
    assert '"errors":[]' in db.execute("SELECT spec FROM jobs").fetchone()[0]
    db.close()
    s = JobStore(path)
    rec = s.get("a" * 12)
    s.close()
    assert rec is not None and rec.spec.emulation.slowdowns == [1, 2]
