"""The planner (torch-free): the fastest configuration that fits, and checks of
configurations people already have.

    result = plan_from_options(PlanOptions(model="glm-4-9b", gpu="4090"))
    result.best          # Plan: config, memory, speed, knobs changed
    result.misses        # nearest miss of every family that does not fit

``best_fit(cfg, cluster)`` is what ``oomless train``'s preflight calls.
"""

from .candidates import PlanRequest
from .options import PlanOptions, best_fit, plan_from_options, request_from_options
from .plan import Plan, PlanResult, search
from .request import build_request
from .suggest import plan

__all__ = ["Plan", "PlanOptions", "PlanRequest", "PlanResult", "best_fit", "build_request",
           "plan", "plan_from_options", "request_from_options", "search"]
