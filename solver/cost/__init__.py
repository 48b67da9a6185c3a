"""The one cost model (no JAX): what a plan is priced with (`problem`: layers and
device kinds), each stage's price for every range of layers (`stage_costs`, what the
planner's search reads), and the price of a whole plan's decisions (`estimate`, what
every plan and every view gets)."""
