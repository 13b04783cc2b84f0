"""Replay: turning an episode's events into merged training timelines and negative samples.

Pure functions over plain data (no database, no I/O): initial timelines from LLM calls
(``initial``, with prompt segmentation in ``segment``), timeline merging (``timeline``), fork
detection (``forks``), training samples (``samples``), negative samples (``negatives``), and
the entry point ``replay_episode`` (``episode``), and chat-template rendering (``render``).

The jobs that read episodes from the database, write projections and run process pools
live apart, in :mod:`workers.replay.jobs`; a test checks that this core imports neither them
nor anything that does I/O.
"""

from workers.replay.episode import (
    ReplayResult,
    code_version,
    discarded_calls,
    has_token_ids,
    merge_policy_of,
    needs_tokenizer,
    replay_episode,
    untokenized_reason,
)
from workers.replay.errors import PromptMismatchError, ReplayError, SegmentationError
from workers.replay.forks import ForkPoint, detect_forks
from workers.replay.initial import build_initial_timeline
from workers.replay.negatives import NegativeSample, build_negative, select_negatives
from workers.replay.samples import Sample, build_sample
from workers.replay.segment import Segmentation, Segmenter
from workers.replay.timeline import (
    MergeOutcome,
    MergePolicy,
    Message,
    Timeline,
    loss_mask,
    merge_timelines,
    plan_merge,
)

__all__ = [
    "ForkPoint",
    "MergeOutcome",
    "MergePolicy",
    "Message",
    "NegativeSample",
    "PromptMismatchError",
    "ReplayError",
    "ReplayResult",
    "has_token_ids",
    "needs_tokenizer",
    "untokenized_reason",
    "Sample",
    "SegmentationError",
    "Segmentation",
    "Segmenter",
    "Timeline",
    "build_initial_timeline",
    "build_negative",
    "build_sample",
    "code_version",
    "detect_forks",
    "discarded_calls",
    "loss_mask",
    "merge_policy_of",
    "merge_timelines",
    "plan_merge",
    "replay_episode",
    "select_negatives",
]
