"""Named, versioned datasets derived from the log under stated rules (docs/datasets.md).

The Python API: ``derive_dataset`` (replay the runs' episodes under ``DatasetRules`` and
store a version identified by its content hash), ``diff_datasets`` (rows added, removed and
changed, and the shift of mean rewards and advantages), and, from ``store.datasets``,
``get_version``, ``list_versions``, ``read_rows`` and ``delete_version``.
"""

from store.datasets import (
    DatasetRow,
    DatasetVersion,
    delete_version,
    get_version,
    list_versions,
    read_rows,
)
from workers.datasets.build import DatasetBuildError, EmptySelectionError, Episode
from workers.datasets.compare import DatasetDiff, Shift, diff_datasets, diff_rows
from workers.datasets.derive import (
    DerivedDataset,
    DerivePool,
    code_version,
    derive_dataset,
    parse_rules,
)
from workers.datasets.rules import DatasetRules

__all__ = [
    "DatasetBuildError",
    "DatasetDiff",
    "DatasetRow",
    "DatasetRules",
    "DatasetVersion",
    "DerivePool",
    "DerivedDataset",
    "EmptySelectionError",
    "Episode",
    "Shift",
    "code_version",
    "delete_version",
    "derive_dataset",
    "diff_datasets",
    "diff_rows",
    "get_version",
    "list_versions",
    "parse_rules",
    "read_rows",
]
