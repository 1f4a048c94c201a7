"""Small real data sets that ship inside installed packages (no download at run time).

* :func:`load_digits_tensors` -- scikit-learn's 8×8 handwritten digits (1,797 greyscale
  images of 0-9, bundled with scikit-learn) as float tensors ``[N, 1, 8, 8]`` in ``[0, 1]``
  with a fixed, stratified train/test split.
* :func:`digits_loaders` -- the same split as ``DataLoader``s whose shuffling is seeded,
  so a training run repeats exactly.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

DIGITS_IMAGE_SIZE = 8
DIGITS_NUM_CLASSES = 10
DIGITS_MAX_VALUE = 16.0  # pixel values in load_digits are integers 0..16


@dataclass(frozen=True)
class DigitsSplit:
    """The digits data set split in two. Images ``[N, 1, 8, 8]`` float32 in [0, 1]; labels int64."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor

    def __repr__(self) -> str:
        return (f"DigitsSplit(train: {tuple(self.train_images.shape)} images, "
                f"test: {tuple(self.test_images.shape)} images, {DIGITS_NUM_CLASSES} classes)")


def _stratified_test_indices(labels: np.ndarray, test_fraction: float, seed: int) -> np.ndarray:
    """The same fraction of every class goes to the test set; which ones is fixed by ``seed``."""
    rng = np.random.default_rng(seed)
    test = []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        count = int(round(len(members) * test_fraction))
        test.append(rng.permutation(members)[:count])
    return np.sort(np.concatenate(test))


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``(images [1797, 8, 8] float64 in 0..16, labels [1797] int64)``: the CSV file that ships
    inside scikit-learn, read as ``sklearn.datasets.load_digits`` reads it, without importing
    scikit-learn (about a second of a notebook's run time). Where a scikit-learn release keeps the
    file elsewhere, ``load_digits`` itself reads it."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the digits ship inside scikit-learn: pip install scikit-learn")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        from sklearn.datasets import load_digits

        digits = load_digits()
        return digits.images, digits.target.astype(np.int64)
    table = np.loadtxt(path, delimiter=",")  # 64 pixels then the label, one image per row
    return table[:, :-1].reshape(-1, DIGITS_IMAGE_SIZE, DIGITS_IMAGE_SIZE), table[:, -1].astype(np.int64)


def load_digits_tensors(test_fraction: float = 0.2, seed: int = 0) -> DigitsSplit:
    """scikit-learn's 8×8 digits as tensors, split into train and test (stratified, fixed by ``seed``).

    With the defaults: 1,438 training and 359 test images, each ``[1, 8, 8]``, pixels / 16.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be between 0 and 1, got {test_fraction}")
    pixels, targets = digits_arrays()
    images = torch.from_numpy(pixels.astype(np.float32) / DIGITS_MAX_VALUE).unsqueeze(1)  # [N, 1, 8, 8]
    labels = torch.from_numpy(targets)
    test_index = _stratified_test_indices(targets, test_fraction, seed)
    is_test = np.zeros(len(labels), dtype=bool)
    is_test[test_index] = True
    test_mask = torch.from_numpy(is_test)
    return DigitsSplit(images[~test_mask], labels[~test_mask], images[test_mask], labels[test_mask])


def digits_loaders(batch_size: int = 64, seed: int = 0, test_fraction: float = 0.2,
                   split: DigitsSplit | None = None) -> tuple[DataLoader, DataLoader]:
    """``(train_loader, test_loader)`` over :func:`load_digits_tensors`.

    The training loader reshuffles every epoch from its own generator seeded with ``seed``,
    so two runs with the same seed see the same batches; the test loader does not shuffle.
    Batches are CPU tensors ``([batch, 1, 8, 8] float32, [batch] int64)``.
    """
    split = split or load_digits_tensors(test_fraction=test_fraction, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    train_loader = DataLoader(TensorDataset(split.train_images, split.train_labels),
                              batch_size=batch_size, shuffle=True, generator=generator)
    test_loader = DataLoader(TensorDataset(split.test_images, split.test_labels),
                             batch_size=256, shuffle=False)
    return train_loader, test_loader


__all__ = ["DigitsSplit", "load_digits_tensors", "digits_loaders",
           "DIGITS_IMAGE_SIZE", "DIGITS_NUM_CLASSES"]
