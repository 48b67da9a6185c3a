"""Plans: where every part of the step runs, as data, and the stage assignments the
planning passes (`hetpar.pipeline`) call.

- `model`: the Plan dataclasses (plain data, the contract between planning and compile)
- `auto`: the planner's stage assignment (an adapter to `solver.planner`)
- `manual`: stage assignment for a fixed stage or replica count
- `runnable`: what the runtime needs of a plan, checked before it runs
- `file`, `schema`: plan files (versioned JSON, schema-checked)
"""

from hetpar.plan.model import ClusterGroup, Plan, ProgramSignature, Spec, StagePlan, fmt_time, runs, spec_text

__all__ = ["ClusterGroup", "Plan", "ProgramSignature", "Spec", "StagePlan", "fmt_time", "runs", "spec_text"]
