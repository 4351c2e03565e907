"""/v1/jobs/{id}/model: the job's trained model as a zip (safetensors and manifest).

Thin: ``dynabatch.service.artifacts`` finds the files.
"""

from __future__ import annotations

from typing import Literal

from dynabatch.actors.export import ExportError, hf_files
from dynabatch.api.deps import ERRORS, NOT_FOUND, JobId, ServiceDep, require_token
from dynabatch.service.artifacts import job_model, zip_model
from dynabatch.service.schemas import ErrorResponse
from dynabatch.service.service_errors import JobConflict
from fastapi import APIRouter, Depends, Response

router = APIRouter(
    prefix="/v1/jobs",
    tags=["jobs"],
    dependencies=[Depends(require_token)],
    responses=ERRORS,
)


@router.get(
    "/{job_id}/model",
    summary="Download the job's trained model",
    response_class=Response,
    responses={
        200: {
            "content": {"application/zip": {}},
            "description": "A zip of model.safetensors (the final weights), "
            "best.safetensors (when kept) and manifest.json.",
        },
        **NOT_FOUND,
        409: {"model": ErrorResponse, "description": "The job has no trained weights yet."},
    },
)
def get_model(job_id: JobId, service: ServiceDep,
              format: Literal["dynabatch", "hf"] = "dynabatch") -> Response:
    """The job's trained model, written at its end: `model.safetensors`, `best.safetensors`
    when the job kept the best by metric, and `manifest.json` (the spec, the model builder,
    input shape, epoch, metrics, dtypes). `dynabatch.load_model(DIR)` rebuilds the module
    from the unpacked directory; any safetensors reader takes the weights. `format=hf`: a
    Hugging Face folder instead (`config.json` with `id2label` when the spec names
    `dataset.labels`, `model.safetensors`, the job's tokenizer), which
    `transformers.AutoModelFor...from_pretrained(DIR)` loads (409 for a model that is not
    `model.name: hf`)."""
    files = job_model(service, job_id)
    if format == "hf":
        try:
            files = hf_files(files)
        except ExportError as err:
            raise JobConflict(str(err)) from None
    return Response(
        zip_model(files),
        media_type="application/zip",
        headers={"Content-Disposition": f'attachment; filename="dynabatch-{job_id}-model.zip"'},
    )
