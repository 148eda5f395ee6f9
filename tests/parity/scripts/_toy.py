"""The small stand-ins for the BERT/GLUE parts of Accelerate's example scripts.

Everything a ported script takes from ``transformers``, ``datasets`` and ``evaluate`` comes
from here instead: scikit-learn's bundled digits (no download) with an ``idx`` column, a
collate function returning a batch with ``.to(device)`` like a tokenizer's ``BatchEncoding``,
a two-layer MLP returning ``.loss``/``.logits``, an accuracy metric with ``add_batch`` /
``compute`` like ``evaluate``'s, and the linear warm-up schedule as a ``LambdaLR``. The model
and the metric report to :mod:`_record`, so a script's Accelerator calls stay untouched.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, overload

import _record
import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

#: The first 1000 of the 1797 digits are the training split, the next 297 the validation split
#: (neither a multiple of the scripts' batch sizes, so sharding has to even them out).
TRAIN_SIZE = 1000
VALIDATION_SIZE = 297
NUM_LABELS = 10
_MAX_TRAIN_BATCH = int(os.environ.get("PARITY_MAX_TRAIN_BATCH", "0")) or sys.maxsize


class DigitsSplit(Dataset[dict[str, Any]]):
    """One split of the digits: items ``{"idx", "features", "labels"}``, where ``idx`` is the
    row in scikit-learn's array (unique over both splits). Like a ``datasets.Dataset`` it has
    ``num_rows``, ``select(indices)`` and column access by name (``split["label"]``)."""

    def __init__(self, ids: torch.Tensor, features: torch.Tensor, labels: torch.Tensor) -> None:
        self.ids = ids
        self.features = features
        self.labels = labels

    @property
    def num_rows(self) -> int:
        """Number of samples."""
        return len(self.labels)

    def __len__(self) -> int:
        return len(self.labels)

    @overload
    def __getitem__(self, key: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, key: str) -> torch.Tensor: ...
    def __getitem__(self, key: int | str) -> dict[str, Any] | torch.Tensor:
        if isinstance(key, str):  # a column, as ``datasets`` spells it
            return {"idx": self.ids, "features": self.features, "label": self.labels}[key]
        return {
            "idx": int(self.ids[key]),
            "features": self.features[key],
            "labels": self.labels[key],
        }

    def select(self, indices: Sequence[int]) -> DigitsSplit:
        """The samples at ``indices`` (positions in this split), keeping their ids."""
        index = torch.as_tensor(indices, dtype=torch.long)
        return DigitsSplit(self.ids[index], self.features[index], self.labels[index])


def digits_path() -> Path:
    """The digits file scikit-learn ships (``sklearn.datasets.load_digits`` reads it), found
    without importing scikit-learn: the import costs each run more than the training does."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the parity scripts need scikit-learn's bundled digits")
    return Path(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")


def load_digits_splits() -> dict[str, DigitsSplit]:
    """``{"train", "validation"}`` splits (1000 and 297 samples), features scaled to [0, 1]."""
    data = torch.from_numpy(np.loadtxt(digits_path(), delimiter=","))
    features = data[:, :-1].float() / 16.0
    labels = data[:, -1].long()
    ids = torch.arange(len(labels))
    end = TRAIN_SIZE + VALIDATION_SIZE
    return {
        "train": DigitsSplit(ids[:TRAIN_SIZE], features[:TRAIN_SIZE], labels[:TRAIN_SIZE]),
        "validation": DigitsSplit(
            ids[TRAIN_SIZE:end], features[TRAIN_SIZE:end], labels[TRAIN_SIZE:end]
        ),
    }


class Batch(dict[str, torch.Tensor]):
    """A collated batch; ``.to`` moves it in place and returns it, as ``BatchEncoding.to``."""

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        for key, value in self.items():
            self[key] = value.to(device, non_blocking=non_blocking)
        return self


def collate(
    examples: Sequence[dict[str, Any]],
    max_length: int | None = None,
    pad_to_multiple_of: int | None = None,
) -> Batch:
    """Stack ``examples``, zero-padding the feature width as a tokenizer pads sequences: up to
    ``max_length`` when given, then up to a multiple of ``pad_to_multiple_of`` (64 features
    need no padding for 8 or 16). The model reads the first 64 features only."""
    features = torch.stack([e["features"] for e in examples])
    if max_length is not None and max_length > features.shape[1]:
        features = nn.functional.pad(features, (0, max_length - features.shape[1]))
    if pad_to_multiple_of:
        width = -(-features.shape[1] // pad_to_multiple_of) * pad_to_multiple_of
        features = nn.functional.pad(features, (0, width - features.shape[1]))
    return Batch(
        idx=torch.tensor([e["idx"] for e in examples], dtype=torch.long),
        features=features,
        labels=torch.stack([e["labels"] for e in examples]),
    )


class Output(NamedTuple):
    """What the classifier returns (``loss`` is None without labels)."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class DigitsClassifier(nn.Module):
    """64 -> 32 -> 10 MLP taking a collated batch as keywords (``model(**batch)``).

    With the environment variable ``PARITY_MAX_TRAIN_BATCH=<n>``, a training batch of more than
    ``n`` samples raises the RuntimeError PyTorch's CPU allocator raises when memory runs out,
    so ``find_executable_batch_size`` has something to retry on a machine with plenty of memory.
    """

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, NUM_LABELS))
        _record.model_built(self)

    def forward(
        self, idx: torch.Tensor, features: torch.Tensor, labels: torch.Tensor | None = None
    ) -> Output:
        if self.training and len(idx) > _MAX_TRAIN_BATCH:
            raise RuntimeError(
                f"DefaultCPUAllocator: can't allocate memory: batch of {len(idx)} samples "
                f"(PARITY_MAX_TRAIN_BATCH={_MAX_TRAIN_BATCH})"
            )
        _record.batch_seen(idx, training=self.training)
        logits = self.net(features[:, :64])
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return Output(loss, logits)


class Accuracy:
    """``evaluate.load("glue", "mrpc")`` in miniature: ``add_batch`` then ``compute`` (which
    resets), giving accuracy and F1 (macro-averaged over the 10 digits; MRPC's is binary)."""

    def __init__(self) -> None:
        self.predictions: list[torch.Tensor] = []
        self.references: list[torch.Tensor] = []

    def add_batch(self, predictions: torch.Tensor, references: torch.Tensor) -> None:
        """Add a batch of labels (1-D tensors of the same length)."""
        self.predictions.append(predictions.reshape(-1).cpu())
        self.references.append(references.reshape(-1).cpu())
        _record.metric_added(int(references.numel()))

    def compute(
        self, predictions: torch.Tensor | None = None, references: torch.Tensor | None = None
    ) -> dict[str, float]:
        """``{"accuracy", "f1"}`` over the batches added since the last call, after adding
        ``predictions``/``references`` when given (``evaluate``'s one-shot form)."""
        if predictions is not None and references is not None:
            self.add_batch(predictions=predictions, references=references)
        preds = (
            torch.cat(self.predictions) if self.predictions else torch.zeros(0, dtype=torch.long)
        )
        refs = torch.cat(self.references) if self.references else torch.zeros(0, dtype=torch.long)
        self.predictions, self.references = [], []
        accuracy = int((preds == refs).sum()) / max(len(refs), 1)
        labels = torch.arange(NUM_LABELS)
        true_pos = ((preds[:, None] == labels) & (refs[:, None] == labels)).sum(0)
        predicted = (preds[:, None] == labels).sum(0)
        actual = (refs[:, None] == labels).sum(0)
        f1 = (2 * true_pos / (predicted + actual).clamp(min=1)).mean()
        _record.metric_computed(accuracy)
        return {"accuracy": accuracy, "f1": float(f1)}


def linear_schedule_with_warmup(
    optimizer: torch.optim.Optimizer, num_warmup_steps: int, num_training_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """``transformers.get_linear_schedule_with_warmup``: linear warm-up, then linear decay to 0."""

    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        remaining = num_training_steps - step
        return max(0.0, remaining / max(1, num_training_steps - num_warmup_steps))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
