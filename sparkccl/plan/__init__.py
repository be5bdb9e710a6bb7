"""Plans: every collective's schedule as data (docs/ARCHITECTURE.md), and the verifier that proves it."""
from .build import build_all, build_plan
from .geometry import PIECES, Part, flag_value, piece_bounds, sub_range
from .model import Op, RankPlan, Region, flag_word
from .verify import Collective, PlanError, lower_bound, verify, verify_plans

__all__ = [
    "PIECES", "Collective", "Op", "Part", "PlanError", "RankPlan", "Region", "build_all",
    "build_plan", "flag_value", "flag_word", "lower_bound", "piece_bounds", "sub_range",
    "verify", "verify_plans",
]
