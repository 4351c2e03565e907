"""A job's trained model, as the service serves it (``GET /v1/jobs/{id}/model``).

A job without ``artifacts.dir`` has its model files only in its coordinator, which the
service releases once the job has finished: :func:`keep_model` first copies them beside the
service's database (:func:`models_dir`).
"""

from __future__ import annotations

import io
import logging
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from dynabatch.actors.data.fs import join
from dynabatch.actors.data.source import DataError
from dynabatch.actors.export import ExportError, has_model, read_files, write_files
from dynabatch.service.ray_client import RayClusterClient
from dynabatch.service.service_errors import JobConflict, RayCallError

if TYPE_CHECKING:  # the job service calls keep_model: no import cycle
    from dynabatch.service.job_service import JobService

log = logging.getLogger("dynabatch.service")


def models_dir(db_path: str) -> Path | None:
    """Where the service keeps the models of jobs without ``artifacts.dir``: ``models/``
    beside its database (``DYNABATCH_DB_PATH``), the service's own disk. None for an
    in-memory database: such a service has no disk of its own to keep them on."""
    if db_path in ("", ":memory:") or db_path.startswith("file::memory:"):
        return None
    return Path(db_path).expanduser().resolve().parent / "models"


def keep_model(cluster: RayClusterClient, job_id: str, models_dir: Path | None) -> bool:
    """Copy the finished job's model files from its coordinator into ``models_dir/JOB_ID``,
    before the coordinator is released. False when it has none (or cannot be asked): a
    failure to keep them never keeps the job from being released."""
    if models_dir is None:
        return False
    try:
        files = cluster.model_files(job_id)
        if not files:
            return False
        write_files(files, str(models_dir / job_id), field="models directory")
    except (RayCallError, ExportError, DataError) as err:
        log.warning("job %s: cannot keep its trained model (%s)", job_id, err)
        return False
    return True


def job_model(service: JobService, job_id: str) -> dict[str, bytes]:
    """The job's model files by name, from its ``artifacts.dir``, the service's copy (in
    :func:`models_dir`) or its live coordinator. Raises ``JobNotFound`` (no such job),
    :class:`JobConflict` (409) when it has no weights anywhere yet or a file cannot be read."""
    rec = service.get(job_id)
    places = []
    if rec.spec.artifacts.dir:
        places.append(join(rec.spec.artifacts.dir, job_id))
    kept = models_dir(service.store.path)
    if kept is not None:
        places.append(str(kept / job_id))
    try:
        for place in places:
            if has_model(place):
                return read_files(place)
    except (ExportError, DataError) as err:
        raise JobConflict(str(err)) from None
    try:
        files = service.cluster.model_files(job_id)
    except RayCallError:  # no coordinator (released, lost) or Ray down
        files = None
    if not files:
        raise JobConflict(f"job {job_id} has no trained weights yet")
    return files


def zip_model(files: dict[str, bytes]) -> bytes:
    """The files as one zip (stored, not compressed: weights do not compress)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as z:
        for name in sorted(files):
            z.writestr(name, files[name])
    return buf.getvalue()


def unzip_model(data: bytes, directory: Path) -> list[str]:
    """Write a downloaded model zip's files into ``directory`` (created); their names.
    ValueError with one line when it is not a model zip: a name with a path in it (which
    could write outside ``directory``) or no manifest."""
    from dynabatch.actors.export import FILES, MANIFEST, TOKENIZER

    allowed = {MANIFEST, TOKENIZER, *FILES.values()}
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = z.namelist()
            bad = [n for n in names if n not in allowed]
            if bad or MANIFEST not in names:
                why = f"unexpected file {bad[0]!r}" if bad else f"no {MANIFEST}"
                raise ValueError(f"not a dynabatch model download ({why})")
            directory.mkdir(parents=True, exist_ok=True)
            for n in names:
                (directory / n).write_bytes(z.read(n))
    except zipfile.BadZipFile as err:
        raise ValueError(f"not a dynabatch model download ({err})") from None
    return sorted(names)


def write_hf_export(data: bytes, directory: Path) -> list[str]:
    """A downloaded model zip (``data``, as ``GET /v1/jobs/{id}/model`` serves it) written
    into ``directory`` (created) as a Hugging Face folder
    (:func:`dynabatch.actors.export.hf_files`); the names written. ValueError (an
    ``ExportError``) with one line when it is not a Hugging Face model."""
    import tempfile

    from dynabatch.actors.export import hf_files, read_files

    with tempfile.TemporaryDirectory(prefix="dynabatch-export-") as tmp:
        unzip_model(data, Path(tmp))
        files = hf_files(read_files(tmp))
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (directory / name).write_bytes(content)
    return sorted(files)
