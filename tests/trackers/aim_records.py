"""Reading an Aim repository back through Aim's own SDK (``aim.Repo``), for the aim tracker's
tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def read_runs(folder: Path) -> list[dict[str, Any]]:
    """Every run of the Aim repository in ``folder`` (the tracker's ``logging_dir``): its name,
    experiment, ``"hparams"``, metrics by name as ``(steps, values)`` in step order (Aim's
    ``__system__*`` resource metrics left out) and images by name as ``(steps, [(caption,
    size)])``.

    Aim 3.27+ reads runs through an index that its UI server builds (``aim up``, or
    ``aim storage reindex``), not the writer: each run is indexed here with the same
    ``RepoIndexManager`` first, then read with ``Repo.iter_runs``.
    """
    from aim import Repo
    from aim.sdk.index_manager import RepoIndexManager

    writer_side = Repo(str(folder))
    indexer = RepoIndexManager(writer_side)
    for run_hash in writer_side.list_all_runs():
        indexer.index(run_hash)
    runs = []
    for run in Repo(str(folder)).iter_runs():
        metrics = {}
        for metric in run.metrics():
            if not metric.name.startswith("__system__"):
                steps, (values, _epochs, _times) = metric.data.items_list()
                metrics[metric.name] = (list(steps), list(values))
        images = {}
        for name, context, _ in run.iter_sequence_info_by_type("aim.image"):
            steps, (values, _epochs, _times) = run.get_image_sequence(
                name, context
            ).data.items_list()
            images[name] = (list(steps), [(v.caption, v.to_pil_image().size) for v in values])
        runs.append(
            {
                "name": run.name,
                "experiment": run.experiment,
                "hparams": run["hparams"],
                "metrics": metrics,
                "images": images,
            }
        )
    return runs
