"""The engine: requests, scheduling, the step loop and its message boundary (in a thread or a
process of its own), and the frontend side of that boundary."""
