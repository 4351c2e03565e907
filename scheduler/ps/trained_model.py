"""A parameter-server job's trained model: the server's flat weights as the model's state
dict, put out by the one function every driver uses
(:meth:`~dynabatch.scheduler.control.JobControl.publish_model`): ``model.safetensors`` and
``manifest.json``, kept for download and written to ``artifacts.dir`` when set."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dynabatch.actors.errors import first_line
from dynabatch.actors.spec import JobSpec

if TYPE_CHECKING:
    from dynabatch.scheduler.ps.driver import PSCoordinator


def model_state(
    spec: JobSpec, input_shape: tuple[int, ...], num_classes: int, flat: Any
) -> dict[str, Any]:
    """The model's state dict with the server's flat parameter vector ``flat`` in it: the
    job's model as every replica builds it, its trainable parameters replaced in order (the
    order the server flattened them in)."""
    import torch
    from dynabatch.actors.ps import build_replica, shared_tensor

    model = build_replica(spec, input_shape, num_classes)
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(shared_tensor(flat).clone(), params)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def export_model(coord: PSCoordinator, reason: str) -> None:
    """The server's weights now as the job's trained model, at the epochs trained so far. A
    server that cannot be read is a WARNING in the job's log: the job ends as it was going
    to."""
    if coord.model_shape is None:  # the data never loaded: nothing was trained
        return
    shape, classes = coord.model_shape
    try:
        state = model_state(coord.spec, shape, classes, coord.runtime.final_weights())
    except Exception as err:  # a Ray error, a timeout: the training stands
        coord.log(
            "WARNING",
            f"model export ({reason}) skipped: the server's weights cannot be read "
            f"({first_line(err)})",
        )
        return
    coord.publish_model(
        input_shape=shape,
        num_classes=classes,
        state=state,
        epoch=len(coord.history()),
        reason=reason,
    )
