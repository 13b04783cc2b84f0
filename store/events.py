"""Event types: plain immutable data with no database imports.

Every event is a frozen pydantic model with a ``type`` name and a ``schema_version``.
Token payloads (``prompt_ids``, ``response_ids``, ``logprobs``) are numpy arrays (int32 /
float32) that the store keeps in binary columns, never in JSON. ``parse_event`` builds the
model of a stored or submitted ``(type, data)`` pair and upcasts older schema versions.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, get_args, get_origin

import numpy as np
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError
from pydantic_core import ValidationError as _PydanticValidationError

from store.arguments import RealNumber

__all__ = [
    "ABANDONED_ERROR_TYPE",
    "MAX_INT",
    "Event",
    "EVENT_TYPES",
    "TOKEN_FIELDS",
    "EGPO_ALPHA",
    "EGPO_LAM",
    "CorrectionConfig",
    "EgpoConfig",
    "REJECTION_MODES",
    "RejectionRule",
    "failure_order_key",
    "MergeConfig",
    "RollbackConfig",
    "NegativeConfig",
    "RolloutConfig",
    "RemoteAgentConfig",
    "RunConfig",
    "RunCreated",
    "BranchedFrom",
    "EpisodeStarted",
    "LLMCalled",
    "ToolReturned",
    "CheckpointCreated",
    "AttemptFailed",
    "RolledBack",
    "RewardAssigned",
    "RewardNumber",
    "EpisodeFinished",
    "PolicyServed",
    "PolicyUpdated",
    "TrainedSamples",
    "parse_event",
    "event_type",
    "DEFAULT_ROLLBACK_ERRORS",
    "EPISODE_STATUSES",
]

INT32_MAX = 2**31 - 1

#: Names of the token payload fields; the store keeps them in binary columns.
TOKEN_FIELDS = ("prompt_ids", "response_ids", "logprobs")
#: The largest count or version an event may carry on append: what the projections' integer
#: columns hold, so that an event the log accepts can always be projected.
MAX_INT = 2**31 - 1


def _as_token_ids(value: Any) -> np.ndarray:
    """Token ids as a read-only int32 array; refuses floats, negatives and values past int32."""
    if isinstance(value, np.ndarray):
        arr = value
    else:
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"token ids must be a list of integers: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        arr = arr.astype(np.int32)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got {arr.dtype}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0:
            raise ValueError(f"token ids must be non-negative, got {lo}")
        if hi > INT32_MAX:
            raise ValueError(f"token ids must fit in int32, got {hi}")
    out = np.ascontiguousarray(arr, dtype=np.int32)
    out.flags.writeable = False
    return out


def _as_logprobs(value: Any) -> np.ndarray:
    """Log-probabilities as a read-only float32 array; refuses NaN, infinities (also a value
    such as -1e400 that only float32 cannot hold) and positive values."""
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"logprobs must be a list of numbers: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"logprobs must be one-dimensional, got shape {arr.shape}")
    if arr.size:
        if np.isnan(arr).any():
            raise ValueError("logprobs must not contain NaN")
        if (arr > 1e-4).any():
            raise ValueError(f"logprobs must be <= 0, got {float(arr.max())}")
    with np.errstate(over="ignore"):
        out = np.ascontiguousarray(arr, dtype=np.float32)
    if out.size and not np.isfinite(out).all():
        bad = int(np.flatnonzero(~np.isfinite(out))[0])
        raise ValueError(f"logprobs must be finite float32 values, entry {bad} is "
                         f"{float(arr[bad])}")
    out.flags.writeable = False
    return out


TokenIds = Annotated[
    np.ndarray,
    BeforeValidator(_as_token_ids),
    PlainSerializer(lambda a: a.tolist(), return_type=list),
]
Logprobs = Annotated[
    np.ndarray,
    BeforeValidator(_as_logprobs),
    PlainSerializer(lambda a: a.tolist(), return_type=list),
]


def _takes_bool(annotation: Any) -> bool:
    """Whether a field of this type annotation may hold a boolean (bool or Any in it)."""
    if annotation is bool or annotation is Any:
        return True
    return any(_takes_bool(a) for a in get_args(annotation))


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads true as 1: a boolean sent for a count, version or number
        # (or as a value of a dict of numbers) is a client bug, not a 1.
        if info.field_name is None:
            return value
        kind = _BOOL_KINDS.get((cls, info.field_name))
        if kind is None:
            annotation = cls.model_fields[info.field_name].annotation
            kind = _BOOL_KINDS[(cls, info.field_name)] = (
                "takes" if _takes_bool(annotation)
                else "dict" if get_origin(annotation) is dict else "number")
        if kind == "takes":
            return value
        if isinstance(value, bool):
            raise ValueError("must be a number, not a boolean")
        if (kind == "dict" and isinstance(value, dict)
                and any(isinstance(v, bool) for v in value.values())):
            raise ValueError("values must be numbers, not booleans")
        return value


#: What ``_Frozen._no_bool_for_number`` checks of each (model, field), worked out from the
#: annotation on first use (every event read from the log validates the same fields):
#: ``takes`` (a boolean is a valid value), ``dict`` (a dict whose values must not be
#: booleans) or ``number`` (the value must not be a boolean).
_BOOL_KINDS: dict[tuple[type, str], str] = {}


class Event(_Frozen):
    """Base of every event. ``event_id`` is the idempotency key (generated when absent)."""

    type: ClassVar[str] = ""
    schema_version: ClassVar[int] = 1

    event_id: uuid.UUID | None = None
    occurred_at: dt.datetime | None = None

    def to_data(self) -> dict[str, Any]:
        """The JSON part of the event: every field but the id, time and token payloads."""
        return self.model_dump(
            mode="json", exclude={"event_id", "occurred_at", *TOKEN_FIELDS}
        )

    def token_payloads(self) -> dict[str, np.ndarray]:
        """The binary payloads this event carries (empty for most types)."""
        return {}


EVENT_TYPES: dict[str, type[Event]] = {}


def event_type(cls: type[Event]) -> type[Event]:
    """Register an event class under its ``type``; refuses a name registered twice."""
    if not cls.type:
        raise TypeError(f"{cls.__name__} has no type name")
    if cls.type in EVENT_TYPES:
        raise TypeError(f"event type {cls.type!r} is already registered")
    EVENT_TYPES[cls.type] = cls
    return cls


# --- run configuration -------------------------------------------------------------------

DEFAULT_ROLLBACK_ERRORS = (
    "ImportError",
    "ModuleNotFoundError",
    "SyntaxError",
    "IndentationError",
    "NameError",
    "tool call format is wrong",
)


def failure_order_key(episode_id: str | None, index: int | None) -> tuple[Any, ...]:
    """The one order of failed attempts, by which a group's negative samples are chosen
    (replay) and leased (the cap): earliest in its episode first (the failure's position in
    the episode stream; unknown positions last), then by episode id. Each episode's own
    clock, not the wall clock: which of a group's concurrent episodes failed first in time
    depends on scheduling, so a run would not train the same negatives twice."""
    return (index is None, index or 0, episode_id or "")


# EGPO's defaults (seed ``004``), written once: the run configuration and the trainer's
# functions read them from here.
EGPO_LAM = 0.4
EGPO_ALPHA = 2.0


def _reading_stored(info: ValidationInfo) -> bool:
    """Whether the event is being read back from the log (``parse_event(..., stored=True)``):
    checks added after a run could be created apply to new runs only, so a run stored before
    them still reads."""
    return bool(info.context and info.context.get("stored"))


def _refuse(loc: tuple[str | int, ...], message: str, value: Any) -> _PydanticValidationError:
    """A validation error located at the field ``loc`` (relative to the model being checked),
    for a check that spans several fields: pydantic prefixes the enclosing models' location,
    so a run config refused this way names e.g. ``config.egpo.alpha``, not just ``egpo``."""
    return _PydanticValidationError.from_exception_data("RunConfig", [InitErrorDetails(
        type=PydanticCustomError("value_error", "Value error, {reason}", {"reason": message}),
        loc=loc, input=value)])


class EgpoConfig(_Frozen):
    """EGPO's entropy bonus (seed ``004``): ``lam`` its weight (0 turns EGPO into GRPO),
    ``alpha`` the bound on it relative to the advantage, ``variant`` the bonus's form. Each
    form keeps an advantage's sign only under a condition, checked when the run is created
    (not at its first training step), as the trainer's bonus functions check it: ``clip``
    needs ``lam < alpha`` (refused naming ``lam``), ``paper`` needs ``alpha > 1`` (refused
    naming ``alpha``). Both numbers must be finite."""

    lam: float = Field(default=EGPO_LAM, ge=0, allow_inf_nan=False)
    alpha: float = Field(default=EGPO_ALPHA, gt=0, allow_inf_nan=False)
    variant: Literal["clip", "paper"] = "clip"

    @model_validator(mode="after")
    def _keeps_the_sign(self, info: ValidationInfo) -> EgpoConfig:
        if _reading_stored(info):
            return self
        if self.variant == "clip" and not self.lam < self.alpha:
            raise _refuse(("lam",), f"egpo.lam ({self.lam}) must be below egpo.alpha "
                          f"({self.alpha}) for the 'clip' variant, or the bonus can flip a "
                          "negative advantage", self.lam)
        if self.variant == "paper" and not self.alpha > 1.0:
            raise _refuse(("alpha",), f"egpo.alpha ({self.alpha}) must be above 1 for the "
                          "'paper' variant (bonus min(lam*H, |A|/alpha)), or the bonus can "
                          "flip a negative advantage", self.alpha)
        return self


class MergeConfig(_Frozen):
    compare_level: Literal["text", "token"] = "text"
    ignore_tools: bool = True


class RollbackConfig(_Frozen):
    enable_tool_rollback: bool = True
    max_tool_retries: int = Field(default=3, ge=0)
    rollback_on_errors: tuple[str, ...] = DEFAULT_ROLLBACK_ERRORS
    save_negative_samples: bool = True


class NegativeConfig(_Frozen):
    """What a failed call's negative sample is worth (docs/training.md, "Advantages of
    negative samples")."""

    negative_reward: float = Field(default=-1.0, allow_inf_nan=False)
    max_negative_samples_per_group: int = Field(default=1, ge=0)
    #: ``group`` (seed ``000``): a negative sample joins its parent's GRPO group with
    #: ``negative_reward`` and moves the group's mean and spread, so in a group whose episodes
    #: all failed those episodes get a positive advantage. ``episodes``: the group's
    #: advantages come from its episodes alone and a negative sample's advantage is
    #: ``negative_reward`` itself; a group whose episodes all failed trains only its negatives.
    baseline: Literal["group", "episodes"] = "group"


class RolloutConfig(_Frozen):
    """How a run's rollout workers sample: per-call sampling and per-episode limits."""

    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int = Field(default=256, ge=1)
    max_turns: int = Field(default=8, ge=1)
    max_total_tokens: int = Field(default=4096, ge=1)
    #: The run's sampling seed. Set, an episode's seed derives from it and the episode's
    #: place (task, policy version, group index, slot, attempt), not from the run id: two
    #: runs with one seed sample alike. None: from the episode id (every run differs).
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    #: Rollouts across policy updates: an episode in flight when a newer policy of the run is
    #: served takes it up before its next LLM call (each ``llm_called`` records its own
    #: version and log-probs). False: an episode is played on one policy version. Refused
    #: with ``seed`` (a seeded run samples alike in every run; which call meets which policy
    #: depends on when the trainer publishes it).
    continue_across_updates: bool = False
    #: The user's tools a remote rollout of the run offers (``workers.rollout.user_tools``):
    #: tool modules (dotted names or ``.py`` paths) and MCP server URLs, beside the
    #: server's own (settings ``rollout_tool_modules``, ``rollout_mcp_servers``).
    tool_modules: tuple[Annotated[str, Field(min_length=1, max_length=500)], ...] = Field(
        default=(), max_length=32)
    mcp_servers: tuple[Annotated[str, Field(min_length=1, max_length=2000)], ...] = Field(
        default=(), max_length=32)

    @model_validator(mode="after")
    def _consistent(self) -> RolloutConfig:
        if self.continue_across_updates and self.seed is not None:
            raise _refuse(("continue_across_updates",), "continue_across_updates cannot be "
                          "combined with a sampling seed (rollout.seed): which call meets "
                          "which policy depends on when a policy is published, so seeded "
                          "runs would not sample alike; leave one of them out", True)
        return self


#: The revisions of the remote-rollout (TrainGate) protocol a RolloutServer may speak:
#: ``POST /rollout`` answered synchronously (its rollouts calling ``/v1/completions`` or
#: ``/v1/chat/completions``), or ``POST /v1/rollout/init`` answered at once and the rollout's
#: end reported to ``/v1/rollout/completed``. ``auto``: probed at the first rollout.
RemoteProtocol = Literal["auto", "sync-completions", "sync-chat", "async"]


class RemoteAgentConfig(_Frozen):
    """A user's RolloutServer that plays a run's episodes (``workers.rollout.remote_agent``):
    rollout workers create each episode, give the server a credential that records only it,
    and call the server with this store as the trainer."""

    url: str = Field(min_length=1, max_length=2000)
    protocol: RemoteProtocol = "auto"
    #: Rollouts of the run in flight at once, across every rollout worker process
    #: (``workers.rollout.run_slots``).
    max_in_flight: int = Field(default=8, ge=1, le=4096)
    #: Seconds a rollout may take (the synchronous answer, or the completion report).
    timeout_s: float = Field(default=900.0, gt=0, le=86_400, allow_inf_nan=False)
    #: Further attempts at reaching the server when a call finds it unreachable or answering
    #: 502/503/504 before the rollout recorded anything.
    retries: int = Field(default=2, ge=0, le=10)
    #: The tokenizer name sent to the server (``tokenizer_name``); None: the run's.
    tokenizer_name: str | None = Field(default=None, min_length=1, max_length=500)

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        from urllib.parse import urlsplit

        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises for a port that is not a number
        except ValueError as exc:
            raise ValueError(f"not a URL: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http(s) URL with a host, got {url[:100]!r}")
        if parts.query or parts.fragment:
            raise ValueError("the RolloutServer's URL takes no query or fragment")
        return url.rstrip("/")


RejectionMode = Literal["token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2",
                        "seq_sum_k3", "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
                        "seq_max_k2", "seq_max_k3"]
#: verl 0.9.1's rejection options (``rollout_rs``): a divergence statistic of each token's
#: ``log_ratio`` (k1 ``-log_ratio``, k2 ``log_ratio**2 / 2``, k3 ``exp(log_ratio) - 1 -
#: log_ratio``), kept per token or taken over the sample (sum, mean, max).
REJECTION_MODES: tuple[str, ...] = get_args(RejectionMode)
#: The largest threshold a run may set (a cap beyond it is no cap).
_MAX_THRESHOLD = 1e6


class RejectionRule(_Frozen):
    """One rejection criterion (``workers.trainer.correction``). ``mode`` names the statistic
    (:data:`REJECTION_MODES`). For the ``k1`` modes ``[lower, upper]`` is a band on the ratio
    ``pi_rollout / pi_train`` (the statistic must lie in ``[log lower, log upper]``):
    ``upper >= 1``, ``lower`` in ``(0, 1]``, default ``1 / upper``. For ``k2``/``k3`` (never
    negative) ``upper > 0`` is the largest divergence kept and ``lower`` must be left out.
    A zero-staleness sample (every statistic 0) always passes."""

    mode: RejectionMode
    upper: float = Field(gt=0, le=_MAX_THRESHOLD, allow_inf_nan=False)
    lower: float | None = Field(default=None, gt=0, le=1.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _bounds_fit_the_mode(self) -> RejectionRule:
        if self.mode.endswith("k1"):
            if self.upper < 1.0:
                raise _refuse(("upper",), f"upper must be >= 1 for {self.mode} (a band on "
                              f"pi_rollout/pi_train that holds 1), got {self.upper}", self.upper)
        elif self.lower is not None:
            raise _refuse(("lower",), f"{self.mode} takes only an upper bound (its statistic "
                          "is never negative); leave lower out", self.lower)
        return self

    @property
    def band(self) -> tuple[float, float]:
        """``(lower, upper)`` of a ``k1`` mode's ratio band (lower defaults to 1/upper)."""
        return (self.lower if self.lower is not None else 1.0 / self.upper), self.upper


def _legacy_rejection(data: dict[str, Any]) -> dict[str, Any]:
    """The correction settings of runs created before rejection rules: ``rejection`` "none",
    "token" (verl ``token_k1``) or "sequence" (``seq_sum_k1``) with one band
    ``rejection_upper`` (>= 1, default 2) / ``rejection_lower`` (in (0, 1]), as a rule list.
    Errors name the field the caller gave."""
    data = dict(data)
    upper = data.pop("rejection_upper", 2.0)
    lower = data.pop("rejection_lower", None)
    kind = data.get("rejection", "none")
    if not isinstance(kind, str):
        raise _refuse(("rejection_upper",), "rejection_upper and rejection_lower go with "
                      "rejection 'token' or 'sequence'; with a list of rules give each rule's "
                      "upper and lower", upper)
    modes = {"none": None, "token": "token_k1", "sequence": "seq_sum_k1"}
    if kind not in modes:
        raise _refuse(("rejection",), "rejection must be a list of rules ({mode, upper, "
                      f"lower}}) or one of 'none', 'token', 'sequence', got {kind!r}", kind)
    for name, value, low in (("rejection_upper", upper, 1.0), ("rejection_lower", lower, 0.0)):
        if value is None and name == "rejection_lower":
            continue
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or value != value or not low <= value <= _MAX_THRESHOLD
                or (name == "rejection_lower" and not 0.0 < value <= 1.0)):
            bound = "in (0, 1]" if name == "rejection_lower" else f"in [1, {_MAX_THRESHOLD:g}]"
            raise _refuse((name,), f"{name} must be a number {bound}, got {value!r}", value)
    mode = modes[kind]
    data["rejection"] = [] if mode is None else [
        {"mode": mode, "upper": upper, **({} if lower is None else {"lower": lower})}]
    return data


class CorrectionConfig(_Frozen):
    """Off-policy correction from the rollout log-probs (``workers.trainer.correction``, equal
    to verl 0.9.1's ``rollout_corr_helper``; ``docs/training.md`` has the table).

    - ``mode``: "decoupled" (the trainer's recomputed log-probs are the PPO ratio's old
      policy; IS weights and rejection compare them with the rollout's) or "bypass" (the
      rollout log-probs are the old policy; IS and rejection are computed in the loss from the
      current policy, verl's ``bypass_mode``) with ``loss_type`` "ppo_clip" (no IS weights:
      the ratio is the IS ratio) or "reinforce" (``-w * A * log pi``).
    - ``is_level``: "none", "token" or "sequence"; ``is_threshold`` the cap C (>= 1);
      ``is_threshold_lower`` (in (0, 1]) turns truncation into IcePop: weights outside
      ``[is_threshold_lower, is_threshold]`` become 0; ``is_batch_normalize`` divides the
      weights by their batch mean.
    - ``rejection``: rules (:class:`RejectionRule`), all of which a token or sample must
      pass (verl's chained ``rollout_rs``). The older form (``rejection`` "none", "token" or
      "sequence" with ``rejection_upper``/``rejection_lower``) is read as one k1 rule.

    Defaults: decoupled, token-level TIS with cap 2, no rejection. Out-of-range values and
    settings that contradict each other (a loss type in decoupled mode, IS weights that bypass
    PPO-clip would ignore, IcePop or normalisation with no IS level, a mode twice) are refused
    at run creation, naming the field.
    """

    mode: Literal["decoupled", "bypass"] = "decoupled"
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    is_level: Literal["none", "token", "sequence"] = "token"
    is_threshold: float = Field(default=2.0, ge=1.0, le=_MAX_THRESHOLD, allow_inf_nan=False)
    is_threshold_lower: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    is_batch_normalize: bool = False
    rejection: tuple[RejectionRule, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _older_form(cls, data: Any) -> Any:
        if isinstance(data, dict) and (isinstance(data.get("rejection"), str)
                                       or "rejection_upper" in data
                                       or "rejection_lower" in data):
            return _legacy_rejection(data)
        return data

    @model_validator(mode="after")
    def _consistent(self) -> CorrectionConfig:
        if self.mode == "decoupled" and self.loss_type != "ppo_clip":
            raise _refuse(("loss_type",), f"loss_type {self.loss_type!r} applies to mode "
                          "'bypass' only; decoupled mode trains with PPO-clip", self.loss_type)
        if self.mode == "bypass" and self.loss_type == "ppo_clip" and self.is_level != "none":
            raise _refuse(("is_level",), "bypass mode with loss_type 'ppo_clip' applies no IS "
                          "weights (the PPO ratio pi/pi_rollout is the IS ratio); set is_level "
                          "'none', or loss_type 'reinforce'", self.is_level)
        if self.is_level == "none":
            for name in ("is_threshold_lower", "is_batch_normalize"):
                if getattr(self, name) not in (None, False):
                    raise _refuse((name,), f"{name} needs IS weights; is_level is 'none'",
                                  getattr(self, name))
        seen: dict[str, int] = {}
        for index, rule in enumerate(self.rejection):
            if rule.mode in seen:
                raise _refuse(("rejection", index, "mode"), f"rejection mode {rule.mode!r} "
                              f"is already rule {seen[rule.mode]}", rule.mode)
            seen[rule.mode] = index
        return self


def template_syntax_problem(template: str) -> str | None:
    """Why ``template`` is not a Jinja chat template transformers can compile (its syntax,
    with the ``loopcontrols`` extension and the ``{% generation %}`` block transformers
    adds), or None. Only the syntax is checked: nothing is rendered."""
    from jinja2 import TemplateSyntaxError, nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> list[nodes.Node]:
            next(parser.stream)
            return list(parser.parse_statements(("name:endgeneration",), drop_needle=True))

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, "jinja2.ext.loopcontrols"])
    try:
        environment.parse(template)
    except TemplateSyntaxError as exc:
        return f"chat_template is not a valid Jinja template: {exc.message} (line {exc.lineno})"
    return None


class RunConfig(_Frozen):
    group_size: int = Field(default=8, ge=1)
    rollout: RolloutConfig = RolloutConfig()
    egpo: EgpoConfig = EgpoConfig()
    merge: MergeConfig = MergeConfig()
    rollback: RollbackConfig = RollbackConfig()
    negatives: NegativeConfig = NegativeConfig()
    correction: CorrectionConfig = CorrectionConfig()
    # Rollout-level advantages: GRPO/EGPO statistics over episodes (an episode that yielded
    # several samples counts once; each negative sample is its own unit) and equal episode
    # weight in the loss. Identical to sample level when every episode yields one sample.
    rollout_level: bool = True
    model: str | None = None
    tokenizer: str | None = None
    chat_template: str | None = None
    #: A user's RolloutServer plays the run's episodes (None: the rollout workers' agent
    #: loop does).
    remote_agent: RemoteAgentConfig | None = None

    @field_validator("chat_template")
    @classmethod
    def _template_parses(cls, template: str | None, info: ValidationInfo) -> str | None:
        # Checked here, not at the first rollout: a template that does not parse fails every
        # episode of the run.
        if not template or _reading_stored(info):
            return template
        problem = template_syntax_problem(template)
        if problem is not None:
            raise ValueError(problem)
        return template

    @property
    def tokenizer_name(self) -> str | None:
        """The tokenizer the run's prompts are rendered and replayed with: ``tokenizer``,
        else ``model`` (the model folder's own tokenizer), else None (the run names none).
        Rollout, replay, the gateway, exports and the trainer all read it here."""
        return self.tokenizer or self.model


# --- events ------------------------------------------------------------------------------


@event_type
class RunCreated(Event):
    type: ClassVar[str] = "run_created"
    run_id: str = Field(min_length=1, max_length=200)
    project: str = Field(default="default", min_length=1, max_length=200)
    config: RunConfig = RunConfig()


class BranchedFrom(_Frozen):
    """Where a branched episode comes from: the stored episode ``episode_id`` whose first
    ``turn`` LLM calls (and the tool results that followed them) it starts with, and the
    checkpoint it was asked from, when it was (``checkpoint_created.checkpoint_id``)."""

    episode_id: str = Field(min_length=1, max_length=200)
    turn: int = Field(ge=0)
    checkpoint: str | None = Field(default=None, min_length=1, max_length=200)


@event_type
class EpisodeStarted(Event):
    type: ClassVar[str] = "episode_started"
    run_id: str = Field(min_length=1, max_length=200)
    group_id: str = Field(min_length=1, max_length=200)
    task_id: str | None = None
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    policy_version: int = Field(default=0, ge=0)
    branched_from: BranchedFrom | None = None

    def to_data(self) -> dict[str, Any]:
        # An episode that is no branch stores no ``branched_from`` key (the field came later).
        data = super().to_data()
        if data.get("branched_from") is None:
            data.pop("branched_from", None)
        return data


@event_type
class LLMCalled(Event):
    type: ClassVar[str] = "llm_called"
    agent: str = Field(default="main", min_length=1, max_length=200)
    call_id: str = Field(min_length=1, max_length=200)
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    prompt_ids: TokenIds
    response_ids: TokenIds
    logprobs: Logprobs
    response: dict[str, Any] = Field(default_factory=dict)
    finish_reason: str | None = None
    policy_version: int = Field(default=0, ge=0)
    latency_ms: float | None = None
    usage: dict[str, Any] | None = None

    @field_validator("logprobs")
    @classmethod
    def _lengths_agree(cls, logprobs: np.ndarray, info: ValidationInfo) -> np.ndarray:
        response = info.data.get("response_ids")
        if response is not None and len(logprobs) != len(response):
            raise ValueError(
                f"logprobs has {len(logprobs)} entries but response_ids has "
                f"{len(response)}; they must be of equal length"
            )
        return logprobs

    def to_data(self) -> dict[str, Any]:
        # The request history is the bulk of this event and is already plain JSON data (it
        # was validated as lists and dicts): hand it over as is instead of re-serialising it.
        return {
            "agent": self.agent,
            "call_id": self.call_id,
            "messages": self.messages,
            "tools": self.tools,
            "response": self.response,
            "finish_reason": self.finish_reason,
            "policy_version": self.policy_version,
            "latency_ms": self.latency_ms,
            "usage": self.usage,
        }

    def token_payloads(self) -> dict[str, np.ndarray]:
        return {
            "prompt_ids": self.prompt_ids,
            "response_ids": self.response_ids,
            "logprobs": self.logprobs,
        }


@event_type
class ToolReturned(Event):
    type: ClassVar[str] = "tool_returned"
    agent: str = Field(default="main", min_length=1, max_length=200)
    tool_call_id: str | None = None
    name: str = Field(min_length=1, max_length=200)
    arguments: dict[str, Any] = Field(default_factory=dict)
    output: str = ""
    is_error: bool = False
    error_type: str | None = None
    error_message: str | None = None
    duration_ms: float | None = None


@event_type
class CheckpointCreated(Event):
    type: ClassVar[str] = "checkpoint_created"
    agent: str = Field(default="main", min_length=1, max_length=200)
    checkpoint_id: str = Field(min_length=1, max_length=200)
    position_key: str = Field(pattern=r"^turn_\d+$")
    retry_count: int = Field(default=0, ge=0)


#: The error type of an ``attempt_failed`` for a call the client abandoned (a retry that threw
#: the answer away, ``X-Trajstore-Abandoned``). With a ``rolled_back`` discarding that call,
#: replay never makes it a positive sample.
ABANDONED_ERROR_TYPE = "Abandoned"


@event_type
class AttemptFailed(Event):
    type: ClassVar[str] = "attempt_failed"
    agent: str = Field(default="main", min_length=1, max_length=200)
    checkpoint_id: str = Field(min_length=1, max_length=200)
    position_key: str = Field(pattern=r"^turn_\d+$")
    retry_index: int = Field(ge=0)
    error_messages: list[str] = Field(default_factory=list)
    error_types: list[str] = Field(default_factory=list)
    failed_tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    failed_call_id: str | None = None


@event_type
class RolledBack(Event):
    type: ClassVar[str] = "rolled_back"
    agent: str = Field(default="main", min_length=1, max_length=200)
    checkpoint_id: str = Field(min_length=1, max_length=200)
    discarded_call_ids: list[str] = Field(default_factory=list)


#: A reward or one of its components: a finite number, never a boolean (refused by
#: ``_Frozen``), nor a string that looks like one (strict): ``store.arguments.RealNumber``.
RewardNumber = RealNumber


@event_type
class RewardAssigned(Event):
    """An episode's reward. The latest one in the stream is the episode's reward; it may
    arrive after ``episode_finished`` as long as none of the episode's samples was consumed
    (``store.eventlog``: the one event a finished episode still takes)."""

    type: ClassVar[str] = "reward_assigned"
    value: RewardNumber
    components: dict[str, RewardNumber] = Field(default_factory=dict)
    source: str = "task"


EPISODE_STATUSES = ("completed", "terminated", "truncated", "error", "aborted")


@event_type
class EpisodeFinished(Event):
    type: ClassVar[str] = "episode_finished"
    status: Literal["completed", "terminated", "truncated", "error", "aborted"]
    reason: str | None = None


class TrainedSamples(_Frozen):
    """Which samples a training step trained (lineage, ``store.lineage``): parallel lists,
    one entry per sample in batch order: its id (the projection's ``sample_id``, or the row
    index of ``dataset_id``'s version when the step trained a dataset), its episode and the
    reward it was trained with. ``dataset_id`` None: the run's own projection."""

    sample_ids: list[Annotated[int, Field(ge=0, le=2**63 - 1)]] = Field(min_length=1)
    episode_ids: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)
    rewards: list[Annotated[float, Field(allow_inf_nan=False)]] = Field(min_length=1)
    dataset_id: int | None = Field(default=None, ge=1, le=2**63 - 1)

    @model_validator(mode="after")
    def _one_entry_per_sample(self) -> TrainedSamples:
        n = len(self.sample_ids)
        for name in ("episode_ids", "rewards"):
            if len(getattr(self, name)) != n:
                raise _refuse((name,), f"trained.{name} has {len(getattr(self, name))} "
                              f"entries for {n} sample ids", len(getattr(self, name)))
        if len(set(self.sample_ids)) != n:
            raise _refuse(("sample_ids",), "trained.sample_ids names a sample twice",
                          self.sample_ids)
        return self


@event_type
class PolicyUpdated(Event):
    type: ClassVar[str] = "policy_updated"
    version: int = Field(ge=0)
    step: int = Field(ge=0)
    metrics: dict[str, float] = Field(default_factory=dict)
    checkpoint: str | None = None
    #: the samples the step trained (None: not recorded, as before lineage)
    trained: TrainedSamples | None = None


@event_type
class PolicyServed(Event):
    """A rollout engine took a policy version of the run (``store.serving``): its stable id
    (host, process, backend), the backend kind, where the weights came from (a checkpoint
    folder or URL, ``push`` from a trainer in the same process, a server's weight-update
    route) and how long loading them took."""

    type: ClassVar[str] = "policy_served"
    version: int = Field(ge=0)
    engine: str = Field(min_length=1, max_length=200)
    backend: str = Field(min_length=1, max_length=100)
    source: str | None = Field(default=None, max_length=2000)
    load_seconds: float | None = Field(default=None, ge=0, allow_inf_nan=False)


# --- upcasting ---------------------------------------------------------------------------

#: (type, stored schema version) -> function turning that version's data into the next one's.
UPCASTERS: dict[tuple[str, int], Callable[[dict[str, Any]], dict[str, Any]]] = {}


def parse_event(
    type_name: str,
    data: dict[str, Any],
    *,
    schema_version: int | None = None,
    tokens: dict[str, Any] | None = None,
    event_id: uuid.UUID | str | None = None,
    occurred_at: dt.datetime | None = None,
    stored: bool = False,
) -> Event:
    """Build the event model of ``type_name`` from its JSON ``data`` (and token payloads).

    Raises ``KeyError`` naming the type when it is unknown and pydantic's
    ``ValidationError`` when the data does not fit the schema. Data stored under an older
    ``schema_version`` is upcast step by step to the current one first. ``stored`` (an event
    read back from the log) skips the run configuration's checks that span several fields
    (EGPO's sign conditions, the chat template's syntax), so a run created before a check
    existed still reads; the field types and ranges are checked either way.
    """
    cls = EVENT_TYPES.get(type_name)
    if cls is None:
        raise KeyError(f"unknown event type {type_name!r}; known: {sorted(EVENT_TYPES)}")
    version = cls.schema_version if schema_version is None else schema_version
    if version > cls.schema_version:
        raise ValueError(
            f"{type_name} schema version {version} is newer than this code's "
            f"{cls.schema_version}"
        )
    while version < cls.schema_version:
        data = UPCASTERS[(type_name, version)](dict(data))
        version += 1
    fields: dict[str, Any] = dict(data)
    if tokens:
        fields.update(tokens)
    if event_id is not None:
        fields["event_id"] = event_id
    if occurred_at is not None:
        fields["occurred_at"] = occurred_at
    return cls.model_validate(fields, context={"stored": True} if stored else None)
