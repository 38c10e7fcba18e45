"""optim.groups: parameters picked by a name pattern, each group with its own LR multiplier and weight decay.

    optim:
      groups:
        "wte|wpe": {lr_scale: 0.1}            # the embeddings at a tenth of the LR
        "ln_|bias": {weight_decay: 0.0}       # no decay on LayerNorms and biases, whatever optim.decay_mask says

A pattern is a Python regular expression searched in the parameter's nanoGPT name (`transformer.wte.weight`,
`transformer.h.0.attn.c_attn.bias`, `lm_head.weight`: the names both backends and the torch format share). A group's
LR is lr_scale x LR(t); its weight_decay, where given, replaces optim.weight_decay and the decay mask for its
parameters. Parameters no pattern matches keep lr_scale 1 and the decay mask. A parameter two patterns match, or a
pattern that matches nothing, is refused: the groups do not depend on the order they are written in (config.yaml
stores them sorted), and a misspelt pattern does not silently do nothing.

Pure Python: jaxtrain (optim.py, optax) and torchref (torch param groups) both take their groups from `assign`.
"""

import dataclasses
import math
import re
from typing import NamedTuple, Optional

from jaxtrain.errors import UserError


@dataclasses.dataclass
class ParamGroup:
    lr_scale: float = 1.0  # multiplies the schedule's LR(t) for this group's parameters
    weight_decay: Optional[float] = None  # None: optim.weight_decay where optim.decay_mask decays, else 0


class Setting(NamedTuple):
    """What one parameter trains with: LR(t) x lr_scale, and decoupled weight decay weight_decay (torch AdamW's
    p *= 1 - lr * weight_decay)."""
    lr_scale: float
    weight_decay: float


def validate(groups: dict[str, ParamGroup]) -> None:
    """Each pattern a regular expression, each lr_scale > 0 and each weight_decay >= 0, finite."""
    for pattern, group in groups.items():
        key = f"optim.groups[{pattern!r}]"
        if not pattern:
            raise UserError(f"{key}: an empty pattern matches every parameter; set optim.lr or optim.weight_decay "
                            f"instead, or name the parameters (e.g. 'wte|wpe')")
        try:
            re.compile(pattern)
        except re.error as e:
            raise UserError(f"{key} is not a regular expression ({e}); escape special characters with \\") from None
        if not (math.isfinite(group.lr_scale) and group.lr_scale > 0):
            raise UserError(f"{key}.lr_scale must be a finite number > 0, got {group.lr_scale}")
        wd = group.weight_decay
        if wd is not None and not (math.isfinite(wd) and wd >= 0):
            raise UserError(f"{key}.weight_decay must be a finite number >= 0 (or null for optim.weight_decay and "
                            f"the decay mask), got {wd}")


def assign(decays: dict[str, bool], groups: dict[str, ParamGroup], weight_decay: float) -> dict[str, Setting]:
    """Parameter name -> Setting, for every name in `decays` (name -> the decay mask's verdict)."""
    matches = {name: [p for p in groups if re.search(p, name)] for name in decays}
    for name, patterns in matches.items():
        if len(patterns) > 1:
            raise UserError(f"parameter {name} matches several optim.groups patterns ({', '.join(map(repr, patterns))})"
                            f"; make them exclusive, e.g. with $ or a longer name")
    for pattern in groups:
        if not any(pattern in patterns for patterns in matches.values()):
            raise UserError(f"optim.groups pattern {pattern!r} matches no parameter; the names look like "
                            f"{', '.join(list(decays)[:4])}, ...")
    settings = {}
    for name, patterns in matches.items():
        group = groups[patterns[0]] if patterns else ParamGroup()
        wd = group.weight_decay if group.weight_decay is not None else (weight_decay if decays[name] else 0.0)
        settings[name] = Setting(group.lr_scale, wd)
    return settings


def torch_order(settings: dict[str, Setting]) -> list[tuple[Setting, list[str]]]:
    """The parameters as torch AdamW param groups, one per distinct Setting: those at lr_scale 1 first (so that
    group 0's LR is LR(t), as the metrics report it), then by lr_scale; the decayed before the undecayed, so that
    with no optim.groups torchref's groups are [decay, no decay] as before groups existed."""
    by_setting: dict[Setting, list[str]] = {}
    for name, setting in settings.items():
        by_setting.setdefault(setting, []).append(name)
    return sorted(by_setting.items(), key=lambda item: (item[0].lr_scale != 1.0, item[0].lr_scale, -item[0].weight_decay))
