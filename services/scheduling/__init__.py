"""Scheduling policies shared by the router, the planner and the simulator: pure, no I/O, no clock."""
