"""Scheduling: the scheduler, its asynchronous and pipelined variants, and the step it hands the runner."""
