"""Device-free planner: costs, memory and communication models, MadPipe partitioning, ranked plans.

Public API:
  layer_comm_volumes, comm_time, layer_comm_time, group_bandwidths, Network  -- AxoNN eqs. 1-9
  param_state_bytes, stashed_microbatches, myelin_activation_units           -- Myelin memory model
  Profile, LayerCost, load_profile, save_profile, profile_from_json          -- chain costs (JSON)
  Chain, Stage, pipedream, madpipe, Grid                                     -- MadPipe / PipeDream
  schedule_allocation, validate_pattern, pattern_to_schedule                 -- ILP step and checks
  rank_plans, load_plan_overrides                                            -- ranked plans, plan files
"""
import importlib

# Resolved lazily: importing the comm model (e.g. from jaxhybrid.parallel.tensor) must not pull in the rest.
_EXPORTS = {
    "Chain": "jaxhybrid.planner.chain",
    "Stage": "jaxhybrid.planner.chain",
    "Network": "jaxhybrid.planner.comm_model",
    "comm_time": "jaxhybrid.planner.comm_model",
    "group_bandwidths": "jaxhybrid.planner.comm_model",
    "layer_comm_time": "jaxhybrid.planner.comm_model",
    "layer_comm_volumes": "jaxhybrid.planner.comm_model",
    "LayerCost": "jaxhybrid.planner.costs",
    "Profile": "jaxhybrid.planner.costs",
    "load_profile": "jaxhybrid.planner.costs",
    "profile_from_json": "jaxhybrid.planner.costs",
    "save_profile": "jaxhybrid.planner.costs",
    "schedule_allocation": "jaxhybrid.planner.ilp",
    "Grid": "jaxhybrid.planner.madpipe_dp",
    "madpipe": "jaxhybrid.planner.madpipe",
    "myelin_activation_units": "jaxhybrid.planner.memory",
    "param_state_bytes": "jaxhybrid.planner.memory",
    "stashed_microbatches": "jaxhybrid.planner.memory",
    "pattern_to_schedule": "jaxhybrid.planner.pattern",
    "validate_pattern": "jaxhybrid.planner.pattern",
    "pipedream": "jaxhybrid.planner.pipedream",
    "load_plan_overrides": "jaxhybrid.planner.plan",
    "rank_plans": "jaxhybrid.planner.plan",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxhybrid.planner' has no attribute {name!r}")
