"""The performance predictor: how long a plan's programs take and how much memory
they need, from the device catalog or, better, from a profile of real devices."""
