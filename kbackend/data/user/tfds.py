"""``tfds:NAME[:CONFIG]``: a prepared TensorFlow Datasets folder, read without downloading."""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kbackend.data.user.common import READ_BATCH, SPLIT_NAMES, Reader, Splits, Where, reading
from kbackend.data.user.datasets import _read_tf_dataset, _tensorflow
from kbackend.data.user.folder import _class_folders
from kbackend.errors import DataError, path_errors

TFDS_PREFIX = "tfds:"
TFDS_DATA_DIR_ENV = "TFDS_DATA_DIR"


def tfds_data_dir() -> Path:
    """Where prepared TFDS sets are read: ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``."""
    return Path(os.environ.get(TFDS_DATA_DIR_ENV) or Path.home() / "tensorflow_datasets")


def _version_key(name: str) -> tuple[int, ...] | None:
    return tuple(int(part) for part in name.split(".")) if re.fullmatch(
        r"\d+\.\d+\.\d+", name) else None


def _prepared_versions(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    found = [entry for entry in folder.iterdir() if _version_key(entry.name) is not None
             and (entry / "dataset_info.json").is_file()]
    return sorted(found, key=lambda entry: _version_key(entry.name) or ())


def _tfds_folder(where: Where, name: str, config: str) -> Path:
    """The newest prepared version folder of ``name`` (and ``config``), or a one-line error."""
    root = tfds_data_dir()
    with path_errors(root, "TFDS data folder", DataError):
        base = root / name / config if config else root / name
        versions = _prepared_versions(base)
        if not versions and not config and base.is_dir():
            configs = [entry.name for entry in _class_folders(base) if _prepared_versions(entry)]
            if len(configs) == 1:
                versions = _prepared_versions(base / configs[0])
            elif configs:
                raise where.error(f"TFDS dataset {name!r} has several prepared configs "
                                  f"{configs}: name one, as tfds:{name}:CONFIG.")
    if not versions:
        raise where.error(
            f"TFDS dataset {name + (':' + config if config else '')!r} is not prepared in "
            f"{str(base)!r} (searched ${TFDS_DATA_DIR_ENV}, else ~/tensorflow_datasets; nothing "
            "is downloaded): prepare it there first, e.g. tfds.builder(NAME, data_dir=...)"
            ".download_and_prepare(), or set TFDS_DATA_DIR.")
    return versions[-1]


@dataclass(frozen=True)
class TfdsSet(Reader):
    """``tfds:NAME[:CONFIG]``: the newest prepared version in ``tfds_data_dir()``."""

    where: Where
    source: str  # tfds:NAME[:CONFIG]
    max_bytes: int

    def read(self) -> Splits:
        splits, class_names, notes = _load_tfds(self.where, self.source[len(TFDS_PREFIX):],
                                                self.max_bytes)
        return Splits(name=self.source, kind="tfds", splits=splits, class_names=class_names,
                      notes=notes, owned=True)

    def check(self) -> None:
        """The prepared folder looked up (reading it takes TensorFlow)."""
        name, _, config = self.source[len(TFDS_PREFIX):].partition(":")
        _tfds_folder(self.where, name, config)


def _load_tfds(where: Where, spec: str, max_bytes: int) -> tuple[dict, tuple | None, tuple]:
    name, _, config = spec.partition(":")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or (config and not re.fullmatch(
            r"[A-Za-z0-9_.-]+", config)):
        raise where.error("expected tfds:NAME or tfds:NAME:CONFIG (e.g. tfds:mnist).")
    try:
        # An optional extra (`tfds`), heavy to import; an import statement here would be named
        # in tests/test_architecture.py's DEFERRABLE list.
        tfds = importlib.import_module("tensorflow_datasets")
    except ImportError:
        raise where.error("TFDS sources need TensorFlow Datasets, which is not installed: "
                          "pip install tensorflow-datasets (or kbackend[tfds]).") from None
    folder = _tfds_folder(where, name, config)
    tf = _tensorflow()
    with reading(where, f"reading the TFDS dataset in {str(folder)!r} failed",
                 (tf.errors.OpError, ValueError, OSError, KeyError)):
        builder = tfds.builder_from_directory(str(folder))
        info = builder.info
        keys = info.supervised_keys
        if not (isinstance(keys, tuple) and len(keys) == 2 and all(isinstance(k, str)
                                                                    for k in keys)):
            raise where.error(f"the TFDS dataset has no (input, label) supervised keys "
                              f"(supervised_keys={keys!r}; features: {sorted(info.features)}).")
        available = sorted(info.splits)
        chosen = {SPLIT_NAMES[split]: split for split in available if split in SPLIT_NAMES}
        if "train" not in chosen:
            raise where.error(f"the TFDS dataset has no train split. Splits: {available}.")
        datasets = {ours: builder.as_dataset(split=theirs, as_supervised=True,
                                             shuffle_files=False)
                    for ours, theirs in chosen.items()}
        label_feature = info.features[keys[1]]
        names = getattr(label_feature, "names", None)
        class_names = tuple(names) if names else None
        notes = [f"TFDS {info.full_name} from {folder}"]
        skipped = [split for split in available if split not in chosen.values()]
        if skipped:
            notes.append(f"TFDS splits not read: {', '.join(skipped)}")
        # texts gathered batch by batch; other inputs into arrays sized by the cardinality
        text = datasets["train"].element_spec[0].dtype == tf.string
        splits = {split: _read_tf_dataset(where, dataset.batch(READ_BATCH) if text else dataset,
                                          split, max_bytes, batched=text)
                  for split, dataset in datasets.items()}
    return splits, class_names, tuple(notes)
