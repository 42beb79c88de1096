"""Device-free planner: costs, memory and communication models, MadPipe, ranked plans."""
