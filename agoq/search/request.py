"""One question to the search, `SearchRequest`: the memory budget per GPU, the objective and its caps, the knob
space, the method and its counts; and the rules that read each of its fields.

`agoq search` reads a request from its flags and the dashboard's `POST /api/plan` from its JSON body; both hand
the values to the rules here (`read_field`, `SearchRequest.read`), so that they accept and refuse the same values
in the same words. A refusal is a `BadField` naming the field as the request spells it (budget, time_cap, ...);
the command line shows it under its flag (--time-cap), the service under its JSON field (time_cap). Bad input is
quoted as a short excerpt, whatever its length.

The defaults (of `agoq search`, `agoq profile --budget` and the dashboard's plan service) are the fields' own:
  objective  "time": the most tokens/s that fits the budget
  error cap  "recipe": no more predicted gradient error than the published agoq-paper recipe on the profile
  time cap   None (no cap); "checkpoint": no slower than the best full-or-selective checkpointing that fits

`InfeasibleBudget` is the search's answer when no plan meets a request: typed, with the smallest budget that fits
(or the caps that no budget meets), so that each caller says what to do in its own words (`advice`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Mapping, Optional, Union

from agoq.units import excerpt, format_bytes, parse_size
from agoq.vocabulary import COMPILE_MODES as _COMPILE_MODES
from agoq.vocabulary import GRADIENT_MODES as _GRADIENT_MODES
from agoq.vocabulary import LAYOUTS as _LAYOUTS
from agoq.vocabulary import SHARDED, SHARDED_RETIRED
from agoq.vocabulary import MASTERS as _MASTERS
from agoq.vocabulary import OPTIMIZERS as _OPTIMIZERS

DEFAULT_OBJECTIVE = "time"
DEFAULT_ERROR_CAP = "recipe"
DEFAULT_TIME_CAP = None
CHECKPOINT_CAP = "checkpoint"
RECIPE_CAP = "recipe"
MAX_BUDGET_BYTES = 2**50  # 1 PiB per GPU: anything above is a typo, not a GPU

OBJECTIVES = ("time", "error")
METHODS = ("milp", "optuna", "both")
SAMPLERS = ("nsga2", "tpe")
CAP_FIELDS = ("objective", "time_cap", "error_cap")
# the knob space as `agoq search`'s flags name it: one value or "any" each (see knob_space)
ANY = "any"
GRADIENTS = (ANY, *_GRADIENT_MODES)
LAYOUTS = (ANY, *_LAYOUTS)
OPTIMIZERS = (ANY, *_OPTIMIZERS)
MASTERS = (*_MASTERS, ANY)
COMPILE_MODES = (ANY, *_COMPILE_MODES)
MASTER_CHOICES = ("fp32",)  # masters 'none' changes the update's rounding, which no error cap measures: opt in


@dataclass(frozen=True)
class KnobSpace:
    """Which values each outer knob may take (None: every value the profile has figures for; see
    agoq.search.knobs.combinations)."""

    gradient_modes: Optional[tuple] = None      # subset of bf16, quangrad8, sdp4bit
    layouts: Optional[tuple] = None             # subset of replicated, fsdp (agoq.search.layouts)
    optimizers: Optional[tuple] = None          # subset of adamw, adamw8bit
    masters: tuple = MASTER_CHOICES             # subset of fp32, none
    compile_modes: Optional[tuple] = None       # subset of eager, compiled
    global_batch: Optional[int] = None          # sequences per optimizer step (None: the profile's micro-batch)
    micro_batches: Optional[tuple] = None       # micro-batch sizes to try (None: every divisor of global_batch)
    offload: bool = True                        # layers' saved tensors may go to pinned host memory (where the
                                                # profile measured the host link)
    host_budget: Optional[int] = None           # bytes of pinned host memory offload may hold (None: the profile's
                                                # pinnable bytes)
    quantize_attention: bool = False            # offer attention (q, k, v) at a bit width: off by default, as in
                                                # agoq-paper (docs/search.md, "Attention")


class BadField(ValueError):
    """A value a rule refused: `field` as SearchRequest spells it, `problem` what was wrong and what to do."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


class InfeasibleBudget(ValueError):
    """No plan meets the request. `smallest_budget` (bytes per stage) is the least budget that one fits, or None
    when none does at any budget: then `caps` names the request's caps ("time_cap", "error_cap") not met."""

    def __init__(self, message: str, smallest_budget: Optional[int] = None, caps: tuple = ()):
        super().__init__(message)
        self.smallest_budget = smallest_budget
        self.caps = tuple(caps)

    def advice(self, name: Callable[[str], str] = str) -> str:
        """The message and what to do, the request's fields named by `name` (a flag on the command line, the
        JSON field in the service)."""
        if self.smallest_budget is not None:
            return f"{self}: give {name('budget')} {self.smallest_budget} or more"
        if self.caps:
            return f"{self}: raise {' or '.join(name(c) for c in self.caps)}"
        return str(self)


# --- the rules: each takes a value as the command line (text) or JSON (text, number, ...) gives it, or as the
# --- request holds it, and returns the request's value; ValueError saying what is wrong otherwise

def read_budget(value: Any) -> int:
    """Bytes per GPU from a number of bytes or a size as people write it ("30GiB", "1.5GB", "4096", "1e9"):
    more than 0 and at most MAX_BUDGET_BYTES."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected bytes (a number) or a size such as 30GiB or 4GB, got {excerpt(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"expected a finite number of bytes, got {value}")
    if isinstance(value, str):
        if value.strip().startswith("-"):
            raise ValueError(f"must be more than 0 bytes, got {excerpt(value)}")
        budget = parse_size(value)  # ValueError naming the forms it reads
    elif 0 < value < 0.5:  # less than a byte: said as the command line says it of the same text
        budget = parse_size(value)
    else:
        budget = int(round(value))
    if budget <= 0:
        raise ValueError(f"must be more than 0 bytes, got {excerpt(value)}")
    if budget > MAX_BUDGET_BYTES:
        raise ValueError(f"{excerpt(value)} is more than any GPU holds (at most {format_bytes(MAX_BUDGET_BYTES)} "
                         "per GPU): give the memory of one GPU, e.g. 80GB")
    return budget


def _cap(what: str, unit: str, word: str, positive: bool) -> Callable[[Any], Union[float, str, None]]:
    """The rule of a cap: a finite number (> 0 when `positive`, else >= 0), `word`, or 'none' / None (no cap)."""
    expected = f"expected {unit}, {word!r} or 'none'"

    def read(value: Any) -> Union[float, str, None]:
        if value is None or value == "none":
            return None
        if value == word:
            return word
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"{expected}, got {excerpt(value)}")
        try:
            number = float(value)
        except (ValueError, OverflowError):
            raise ValueError(f"{expected}, got {excerpt(value)}") from None
        if not math.isfinite(number):
            raise ValueError(f"the {what} must be a finite number ('none': no cap), got {excerpt(value)}")
        if not (number > 0 if positive else number >= 0):
            raise ValueError(f"the {what} must be {'>' if positive else '>='} 0, got {number:g}")
        return number
    return read


def _one_of(choices: tuple) -> Callable[[Any], str]:
    """The rule of a field that takes one of `choices`."""
    def read(value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"invalid choice {excerpt(value)}: choose {', '.join(choices)}")
        return value
    return read


def _layout(value: Any) -> str:
    """The rule of the layout: one of LAYOUTS; the retired own sharded layout is refused naming what replaced it
    (layout fsdp: FSDP2 with TLq-HS gradients and agoq's int8 / int4 weight gather, agoq.vocabulary)."""
    if value == SHARDED:
        raise ValueError(f"{SHARDED_RETIRED}; the search prices it as layout fsdp with gradients sdp4bit")
    return _one_of(LAYOUTS)(value)


def _whole(least: int, optional: bool = False) -> Callable[[Any], Optional[int]]:
    """The rule of a whole number >= `least` (None too, when `optional`)."""
    def read(value: Any) -> Optional[int]:
        if value is None and optional:
            return None
        number = None
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str):
            try:
                number = int(value)
            except ValueError:
                pass
        if number is None or number < least:
            raise ValueError(f"expected a whole number >= {least}, got {excerpt(value)}")
        return number
    return read


def _yes_no(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {excerpt(value)}")
    return value


def _on_off(value: Any) -> bool:
    """true/false, or the words on/off (the command line's)."""
    words = {"on": True, "off": False, "true": True, "false": False}
    if isinstance(value, str) and value.lower() in words:
        return words[value.lower()]
    if not isinstance(value, bool):
        raise ValueError(f"expected on or off (true or false), got {excerpt(value)}")
    return value


def read_host_budget(value: Any) -> Optional[int]:
    """Bytes of pinned host memory, as a budget is written (None: the profile's pinnable bytes)."""
    return None if value is None else read_budget(value)


RULES: dict[str, Callable[[Any], Any]] = {
    "budget": read_budget,
    "objective": _one_of(OBJECTIVES),
    "time_cap": _cap("time cap", "seconds", CHECKPOINT_CAP, positive=True),
    "error_cap": _cap("error cap", "a gradient error", RECIPE_CAP, positive=False),
    "method": _one_of(METHODS),
    "trials": _whole(1),
    "sampler": _one_of(SAMPLERS),
    "seed": _whole(0),
    "front_budgets": _whole(0),
    "validate": _whole(0),
    "validate_steps": _whole(1),
    "measure_trials": _yes_no,
    # the knob space's words (SearchRequest.read makes its KnobSpace of them)
    "gradients": _one_of(GRADIENTS),
    "layout": _layout,
    "optimizer": _one_of(OPTIMIZERS),
    "master": _one_of(MASTERS),
    "compile": _one_of(COMPILE_MODES),
    "global_batch": _whole(1, optional=True),
    "micro_batch": _whole(1, optional=True),
    "offload": _on_off,
    "host_budget": read_host_budget,
    "quantize_attention": _on_off,
}
KNOB_WORDS = ("gradients", "layout", "optimizer", "master", "compile", "global_batch", "micro_batch", "offload",
              "host_budget", "quantize_attention")
NONE_IS_A_VALUE = ("time_cap", "error_cap", "global_batch", "micro_batch", "host_budget")  # the rules that take None


def read_field(field: str, value: Any) -> Any:
    """The request's value of `field` read from `value` by the field's rule; BadField naming it otherwise."""
    try:
        return RULES[field](value)
    except ValueError as e:
        raise BadField(field, str(e)) from None


def knob_space(gradients: str = "any", layout: str = "any", optimizer: str = "any", master: str = "fp32",
               compile: str = "any", global_batch: Optional[int] = None,
               micro_batch: Optional[int] = None, offload: bool = True,
               host_budget: Optional[int] = None, quantize_attention: bool = False) -> KnobSpace:
    """The KnobSpace of the knob words: one value each, or "any" (every value the profile prices; masters 'any':
    fp32 and none); `micro_batch` fixes the micro-batch, else every divisor of the global batch is tried;
    `offload` False keeps every saved tensor on the GPU; `host_budget` bounds what offload pins;
    `quantize_attention` offers attention's quantized options."""
    def one(word: str) -> Optional[tuple]:
        return None if word == "any" else (word,)
    return KnobSpace(gradient_modes=one(gradients), layouts=one(layout), optimizers=one(optimizer),
                     masters=_MASTERS if master == "any" else (master,), compile_modes=one(compile),
                     global_batch=global_batch, micro_batches=None if micro_batch is None else (micro_batch,),
                     offload=offload, host_budget=host_budget, quantize_attention=quantize_attention)


@dataclass(frozen=True)
class SearchRequest:
    """What to search for (see `agoq search --help`): a plan under `budget` bytes per GPU (each pipeline stage)
    for `objective` ("time": the most tokens/s; "error": the least predicted gradient error) within `time_cap`
    (seconds, "checkpoint" or None) and `error_cap` (a gradient error, "recipe" or None), over the knob `space`;
    by `method` (milp, optuna or both) with `trials` Optuna trials of `sampler` seeded by `seed`, a MILP front of
    `front_budgets` budgets, and the `validate` best plans (and with `measure_trials` every trial's) run for real
    for `validate_steps` steps. Every field is checked by its rule when the request is made (BadField)."""

    budget: int
    objective: str = DEFAULT_OBJECTIVE
    time_cap: Union[float, str, None] = DEFAULT_TIME_CAP
    error_cap: Union[float, str, None] = DEFAULT_ERROR_CAP
    space: KnobSpace = KnobSpace()
    method: str = "milp"
    trials: int = 40
    sampler: str = "nsga2"
    seed: int = 0
    front_budgets: int = 8
    validate: int = 0
    validate_steps: int = 4
    measure_trials: bool = False

    def __post_init__(self):
        for f in fields(self):
            if f.name in RULES:
                object.__setattr__(self, f.name, read_field(f.name, getattr(self, f.name)))
        if not isinstance(self.space, KnobSpace):
            raise BadField("space", f"expected a KnobSpace, got {excerpt(self.space)}")

    @classmethod
    def read(cls, given: Mapping[str, Any]) -> "SearchRequest":
        """The request of fields as `agoq search`'s flags and POST /api/plan's JSON name them (WORDS: this class's
        fields, the knob space as its words instead of `space`). Absent: the default, and so is None where the
        field's rule takes none (None is no cap for a cap, the profile's for a batch size); `method` defaults to
        "both" when `trials` is given, else "milp". BadField names a field refused."""
        given = {name: value for name, value in given.items() if value is not None or name in NONE_IS_A_VALUE}
        words = {name: read_field(name, given.pop(name)) for name in KNOB_WORDS if name in given}
        given.setdefault("method", "both" if "trials" in given else "milp")
        return cls(space=knob_space(**words), **given)

    @classmethod
    def of(cls, request: Union["SearchRequest", int], changes: Mapping[str, Any]) -> "SearchRequest":
        """`request` with `changes` to its fields, or the request for a budget of `request` bytes with them."""
        if isinstance(request, SearchRequest):
            return replace(request, **changes) if changes else request
        return cls(request, **changes)

    @property
    def caps(self) -> dict[str, Any]:
        """The objective and the caps, by field name."""
        return {name: getattr(self, name) for name in CAP_FIELDS}


WORDS = tuple(f.name for f in fields(SearchRequest) if f.name != "space") + KNOB_WORDS


def cap_defaults() -> dict[str, Any]:
    """The objective's and the caps' defaults, by field name, and the objectives offered."""
    defaults = {f.name: f.default for f in fields(SearchRequest) if f.name in CAP_FIELDS}
    return {**defaults, "objectives": list(OBJECTIVES)}


__all__ = ["SearchRequest", "KnobSpace", "BadField", "InfeasibleBudget", "read_field", "knob_space",
           "cap_defaults", "read_host_budget", "RULES", "WORDS", "KNOB_WORDS", "CAP_FIELDS", "MAX_BUDGET_BYTES", "DEFAULT_OBJECTIVE",
           "DEFAULT_ERROR_CAP", "DEFAULT_TIME_CAP", "CHECKPOINT_CAP", "RECIPE_CAP", "MASTER_CHOICES"]
